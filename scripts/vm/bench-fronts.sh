# The front rows of `tmem bench pressure`, measured in a guest whose zram
# has writeback (Debian 13's kernel), sourced by scripts/vm/init.sh:
#   VM_BENCH=scripts/vm/bench-fronts.sh VM_KERNELS=trixie VM_TIMEOUT=3600 scripts/vm-test.sh
# A uniformly hot ladder (every page read at each pass) and a job with a
# cold part (--cold-share 75), each with zram alone and zram in front of
# tmem. With a disk in the guest (VM_DISK=MiB, mounted at /var/tmp) also
# the rows that need one: zram writing back to a plain file (zram+disk,
# the kernel's own answer), zswap alone over a swap file, and zswap in
# front of tmem. BENCH_LEVELS (set above this file's text) picks the
# limits. Under TCG wall times are slow for every row alike: compare them
# as ratios; memory figures and page counts are exact.
MIB=${BENCH_MIB:-128}
LEVELS=${BENCH_LEVELS:-50,35}
ROWS=zram,zram+tmem
grep -q " /var/tmp " /proc/mounts && ROWS=zram,zram+tmem,zram+disk,zswap,zswap+tmem
for m in fuse loop zram; do modprobe "$m" || exit 1; done
echo "== uniformly hot: $MIB MiB at $LEVELS %, rows $ROWS"
tmem bench pressure --workload-mib "$MIB" --levels "$LEVELS" --runs 1 --passes 2 \
    --backends "$ROWS" --json /tmp/hot.json || exit 1
echo "== a cold part: --cold-share 75, $MIB MiB at $LEVELS %, rows $ROWS"
tmem bench pressure --workload-mib "$MIB" --levels "$LEVELS" --runs 1 --passes 2 --cold-share 75 \
    --backends "$ROWS" --json /tmp/cold.json || exit 1
