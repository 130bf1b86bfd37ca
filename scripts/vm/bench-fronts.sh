# The front rows of `tmem bench pressure`, measured in a guest whose zram
# has writeback (Debian 13's kernel), sourced by scripts/vm/init.sh:
#   VM_BENCH=scripts/vm/bench-fronts.sh VM_KERNELS=trixie VM_TIMEOUT=3600 scripts/vm-test.sh
# A uniformly hot ladder (every page read at each pass) and a job with a
# cold part (--cold-share 75), each with zram alone and zram in front of
# tmem. Under TCG wall times are slow for every row alike: compare them as
# ratios; memory figures and page counts are exact.
MIB=${BENCH_MIB:-128}
for m in fuse loop zram; do modprobe "$m" || exit 1; done
echo "== uniformly hot: $MIB MiB at 50% and 35%"
tmem bench pressure --workload-mib "$MIB" --levels 50,35 --runs 1 --passes 2 \
    --backends zram,zram+tmem --json /tmp/hot.json || exit 1
echo "== a cold part: --cold-share 75, $MIB MiB at 50% and 35%"
tmem bench pressure --workload-mib "$MIB" --levels 50,35 --runs 1 --passes 2 --cold-share 75 \
    --backends zram,zram+tmem --json /tmp/cold.json || exit 1
