#!/bin/busybox sh
# /init of the VM test (scripts/vm-test.sh): cgroup v2 only, tmem over the
# kernel's NBD client and over FUSE + loop, a job under memory.max.
/bin/busybox --install -s /bin
export PATH=/usr/local/bin:/usr/bin:/usr/sbin:/bin:/sbin RUST_LOG=warn
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs run /run
mount -t tmpfs tmp /tmp
mkdir -p /sys/fs/cgroup && mount -t cgroup2 cgroup2 /sys/fs/cgroup
ip link set lo up

say() { echo "VM-TEST: $*"; }
fail() { say "FAIL: $*"; for f in /tmp/*.log; do echo "--- $f"; tail -n 30 "$f"; done; poweroff -f; }
wait_for() { n=0; while [ ! -e "$1" ]; do n=$((n + 1)); [ "$n" -gt 600 ] && fail "no $1 after 60 s"; sleep 0.1; done; }

say "kernel $(uname -r)"
say "cgroup layout: $(grep cgroup /proc/mounts | tr '\n' ';')"
say "memory controller: $(cat /sys/fs/cgroup/cgroup.controllers)"
for m in nbd fuse loop; do insmod "/lib/modules/$m.ko" || fail "insmod $m"; done
echo +memory > /sys/fs/cgroup/cgroup.subtree_control || fail "cannot enable the memory controller"

# A 150 MiB job in a group limited to 64 MiB: it must swap, and finish intact.
job() {
    mkdir /sys/fs/cgroup/job || fail "mkdir job cgroup"
    echo 64M > /sys/fs/cgroup/job/memory.max
    sh -c 'echo $$ > /sys/fs/cgroup/job/cgroup.procs && exec /bin/hog 150' > /tmp/job.out 2>&1
    rc=$?
    say "$1: job exit $rc, $(cat /tmp/job.out), peak $(cat /sys/fs/cgroup/job/memory.peak), events $(tr '\n' ' ' < /sys/fs/cgroup/job/memory.events)"
    rmdir /sys/fs/cgroup/job
    [ "$rc" = 0 ] && grep -q '^OK ' /tmp/job.out || fail "$1: the job failed"
}

# 1. tmem serve nbd, the kernel's NBD client, swap on /dev/nbd0.
tmem serve nbd --size 512M --pool-limit 256M --tcp 127.0.0.1:10809 --runtime-dir /run/tmem-nbd > /tmp/serve.log 2>&1 &
SERVE=$!
wait_for /run/tmem-nbd/ctl.sock
nbd-client -N disk0 -b 4096 127.0.0.1 10809 /dev/nbd0 > /tmp/nbd-client.log 2>&1 || fail "nbd-client"
mkswap /dev/nbd0 > /dev/null && swapon /dev/nbd0 || fail "swapon /dev/nbd0"
say "swap: $(tail -n +2 /proc/swaps | tr '\n' ';')"
job "nbd"
tmem stat --runtime-dir /run/tmem-nbd | sed 's/^/VM-TEST:   /' || fail "tmem stat (nbd)"
stored=$(tmem stat --json --runtime-dir /run/tmem-nbd | grep -m1 '"stored_pages"' | tr -dc 0-9)
say "nbd: pages stored after the job: $stored"
swapoff /dev/nbd0 || fail "swapoff /dev/nbd0"
nbd-client -d /dev/nbd0 > /dev/null 2>&1
kill "$SERVE"; wait "$SERVE" || fail "tmem serve nbd did not stop cleanly"

# 2. tmem swap up (FUSE + loop), without flags.
tmem swap up > /tmp/up.log 2>&1 || fail "tmem swap up"
say "swap: $(tail -n +2 /proc/swaps | tr '\n' ';')"
job "swap up"
tmem stat --counters | grep -E ' (stored_pages|succ_puts|succ_gets|pool_limit_hit|write_ios|read_ios) ' | sed 's/^/VM-TEST:   /' || fail "tmem stat --counters"
tmem swap down > /tmp/down.log 2>&1 || fail "tmem swap down"

# 3. The pressure bench on cgroup v2 (small: TCG is slow).
tmem bench pressure --workload-mib 96 --levels 100,50 --runs 1 --passes 1 --backends tmem --json /tmp/pressure.json > /tmp/pressure.log 2>&1 || fail "tmem bench pressure"
say "bench pressure: $(grep -o '"cgroup_layout": *"[a-z0-9]*"' /tmp/pressure.json)"
grep -A3 'wall time' /tmp/pressure.log | sed 's/^/VM-TEST:   /'

# Nothing left behind.
[ "$(tail -n +2 /proc/swaps)" = "" ] || fail "swap left: $(cat /proc/swaps)"
[ "$(losetup -a)" = "" ] || fail "loop devices left: $(losetup -a)"
grep -q fuse /proc/mounts && fail "mounts left: $(grep fuse /proc/mounts)"
[ -d /sys/fs/cgroup/job ] && fail "cgroup left"
say "PASS"
poweroff -f
