# tmem over each transport, FUSE + loop (`tmem-fuse`), the kernel's ublk
# driver (`tmem-ublk`) and its NBD client (`tmem-nbd`), beside zram, in one
# guest (Debian 13's kernel), sourced by scripts/vm/init.sh:
#   VM_BENCH=scripts/vm/bench-transports.sh VM_KERNELS=trixie VM_TIMEOUT=3600 scripts/vm-test.sh
# Under TCG, system calls and context switches cost more than on hardware
# and every row is slow alike: compare wall and CPU times as ratios inside
# the guest, never as hardware figures; memory figures and page counts are
# exact.
MIB=${BENCH_MIB:-128}
RUNS=${BENCH_RUNS:-1}
for m in fuse loop zram nbd ublk_drv; do modprobe "$m" || exit 1; done
echo "== $MIB MiB at 50% and 35%, $RUNS run(s)"
tmem bench pressure --workload-mib "$MIB" --levels 50,35 --runs "$RUNS" --passes 2 \
    --backends zram,tmem-fuse,tmem-ublk,tmem-nbd --json /tmp/transports.json || exit 1
