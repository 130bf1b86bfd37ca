#!/bin/busybox sh
# /init of the VM test (scripts/vm-test.sh), the same on every kernel:
# cgroup v2 only, a probe of the kernel's zram, nbd, ublk and zswap, tmem
# over the kernel's NBD client and over FUSE + loop, a job under memory.max.
/bin/busybox --install -s /bin
# kmod's, not busybox's (this shell runs its own applets before any in PATH;
# kmod reads compressed and built-in modules). /sbin/modprobe, which the
# kernel runs to load a module on demand, is kmod's too.
modprobe() { /usr/sbin/modprobe "$@"; }
rmmod() { /usr/sbin/rmmod "$@"; }
export PATH=/usr/local/bin:/usr/bin:/usr/sbin:/bin:/sbin RUST_LOG=warn
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs run /run
mount -t tmpfs tmp /tmp
mkdir -p /sys/fs/cgroup && mount -t cgroup2 cgroup2 /sys/fs/cgroup
# As systemd does (sys-kernel-debug.mount): the zram front's reclaim reads
# zram's block_state there.
mount -t debugfs debugfs /sys/kernel/debug
ip link set lo up

say() { echo "VM-TEST: $*"; }
fail() { say "FAIL: $*"; for f in /tmp/*.log; do echo "--- $f"; tail -n 30 "$f"; done; poweroff -f; }
# The seconds a step took (guest clock; TCG keeps it to the host's).
lap_t=$(cut -d' ' -f1 /proc/uptime)
lap() { t=$(cut -d' ' -f1 /proc/uptime); say "time: $1 $(awk "BEGIN {print $t - $lap_t}") s (up $t s)"; lap_t=$t; }
wait_for() { n=0; while [ ! -e "$1" ]; do n=$((n + 1)); [ "$n" -gt 600 ] && fail "no $1 after 60 s"; sleep 0.1; done; }

say "kernel $(uname -r): $(cat /proc/version)"
say "cgroup layout: $(grep cgroup /proc/mounts | tr '\n' ';')"
say "memory controller: $(cat /sys/fs/cgroup/cgroup.controllers)"
echo +memory > /sys/fs/cgroup/cgroup.subtree_control || fail "cannot enable the memory controller"

# 0. The kernel facts later tests depend on. tmem_vm_probe=require on the
# command line (Debian 13's kernel) fails the run where one is missing;
# tmem_vm_probe=report (Debian 12's) only prints them.
probe_mode=report
case " $(cat /proc/cmdline) " in *" tmem_vm_probe=require "*) probe_mode=require ;; esac
# tmem_vm_smokes=1: this guest also runs the checks that do not depend on
# the kernel (tmem serve nbd under nbd-client, the pressure bench). Only
# one guest of a run gets them, so that the guests, which run at once, end
# at about the same time.
smokes=0
case " $(cat /proc/cmdline) " in *" tmem_vm_smokes=1 "*) smokes=1 ;; esac
missing=""
# fact NAME yes|no DETAIL [required]
fact() {
    say "probe: $1: $2${3:+ ($3)}"
    [ "$2" = yes ] || [ "$4" != required ] || missing="$missing; $1"
}
yn() { if "$@"; then echo yes; else echo no; fi; }
say "probe: kernel $(uname -r), mode $probe_mode"
if modprobe zram num_devices=0 2> /tmp/probe.err; then
    fact "modprobe zram" yes "" required
    id=$(cat /sys/class/zram-control/hot_add 2> /tmp/probe.err)
    zdev=/sys/block/zram$id
    if [ -n "$id" ] && [ -d "$zdev" ]; then
        fact "zram hot_add" yes "zram$id" required
        for a in backing_dev writeback writeback_limit bd_stat idle; do
            fact "zram $a attribute" "$(yn test -e "$zdev/$a")" "" required
        done
        algs=$(cat "$zdev/comp_algorithm")
        fact "zram comp_algorithm lists zstd" "$(yn eval 'echo "$algs" | tr -d "[]" | tr " " "\n" | grep -qx zstd')" "$algs" required
        fact "zram algorithm_params attribute" "$(yn test -e "$zdev/algorithm_params")" ""
        if echo zstd 2> /dev/null > "$zdev/comp_algorithm"; then z=yes; else z=no; fi
        fact "zram zstd selectable" "$z" "$(cat "$zdev/comp_algorithm")"
        echo 16M > "$zdev/disksize" || fail "probe: zram disksize"
        if echo all 2> /dev/null > "$zdev/idle"; then i=yes; else i=no; fi
        fact "zram idle all accepted" "$i" ""
        # Age-based idle marking: CONFIG_ZRAM_TRACK_ENTRY_ACTIME since 6.8,
        # CONFIG_ZRAM_MEMORY_TRACKING before.
        if echo 60 2> /tmp/probe.err > "$zdev/idle"; then i=yes; else i=no; fi
        fact "zram idle <seconds> accepted" "$i" "$(tr -d '\n' < /tmp/probe.err)" required
        # A write the kernel refuses must read as refused here.
        echo 1x 2> /dev/null > "$zdev/idle" && fail "probe: zram idle took '1x'; cannot tell accepted from refused"
        echo 1 > "$zdev/reset"
        echo "$id" > /sys/class/zram-control/hot_remove || fail "probe: zram hot_remove"
    else
        fact "zram hot_add" no "$(cat /tmp/probe.err)" required
    fi
    rmmod zram || fail "probe: rmmod zram"
else
    fact "modprobe zram" no "$(tr '\n' ' ' < /tmp/probe.err)" required
fi
if modprobe nbd 2> /tmp/probe.err; then n=yes; else n=no; fi
fact "modprobe nbd" "$n" "$(tr '\n' ' ' < /tmp/probe.err)" required
if modprobe ublk_drv 2> /tmp/probe.err; then
    fact "modprobe ublk_drv" yes "/dev/ublk-control $(yn test -c /dev/ublk-control)" required
    rmmod ublk_drv || fail "probe: rmmod ublk_drv"
else
    fact "modprobe ublk_drv" no "$(tr '\n' ' ' < /tmp/probe.err)" required
fi
p=/sys/module/zswap/parameters
fact "zswap shrinker_enabled parameter" "$(yn test -e $p/shrinker_enabled)" \
    "$(for f in enabled shrinker_enabled compressor zpool; do [ -e $p/$f ] && printf '%s=%s ' $f "$(cat $p/$f)"; done)" required
fact "cgroup v2 only" "$(yn eval '! grep -q " cgroup " /proc/mounts && grep -q " /sys/fs/cgroup cgroup2 " /proc/mounts')" "$(grep -o 'cgroup_no_v1=[^ ]*' /proc/cmdline)" required
mkdir /sys/fs/cgroup/probe || fail "probe: mkdir cgroup"
fact "memory.zswap.max in a non-root cgroup" "$(yn test -e /sys/fs/cgroup/probe/memory.zswap.max)" \
    "$(cat /sys/fs/cgroup/probe/memory.zswap.max 2> /dev/null)" required
rmdir /sys/fs/cgroup/probe
if [ -z "$missing" ]; then
    say "probe: all required facts hold"
elif [ "$probe_mode" = require ]; then
    fail "probe: missing on $(uname -r): ${missing#; }"
else
    say "probe: missing here (reported only): ${missing#; }"
fi

lap "boot and probe"

# Prints the kernel stacks of tmem's threads, once, if a `tmem ... down`
# runs past 120 s: a hang that the guest's timeout would otherwise end
# with nothing said.
# hang_dump [PID...]: the kernel stacks of tmem's threads and of the PIDs
# given, the daemon's log and dmesg.
hang_dump() {
    for q in $(pidof tmem) "$@"; do
        say "hang: $q: $(tr '\0' ' ' < "/proc/$q/cmdline")"
        for t in /proc/"$q"/task/*; do say "hang: $q/${t##*/} $(cat "$t/comm"): $(tr '\n' ' ' < "$t/stack")"; done
    done
    for log in /run/tmem*/daemon.log; do tail -n 40 "$log" | sed "s|^|VM-TEST: hang: $log: |"; done
    dmesg | tail -n 30 | sed 's/^/VM-TEST: hang: dmesg: /'
}
hang_watch() {
    while sleep 10; do
        for p in $(pidof tmem); do
            case "$(tr '\0' ' ' < "/proc/$p/cmdline" 2> /dev/null)" in *" down"*) ;; *) continue ;; esac
            age=$(($(cut -d. -f1 /proc/uptime) - $(awk '{print int($22 / 100)}' "/proc/$p/stat")))
            [ "$age" -gt 120 ] || continue
            hang_dump
            return
        done
    done
}
# wait_job PID SECS WHAT: waits for a background job; past SECS, dumps the
# stacks (hang_dump, the job's own included) and fails.
wait_job() {
    end=$(($(cut -d. -f1 /proc/uptime) + $2))
    while kill -0 "$1" 2> /dev/null; do
        if [ "$(cut -d. -f1 /proc/uptime)" -gt "$end" ]; then
            hang_dump $(cat /sys/fs/cgroup/job/cgroup.procs 2> /dev/null)
            fail "$3: still running after $2 s"
        fi
        sleep 0.1
    done
    wait "$1"
}
hang_watch &

# A measurement instead of the checks (VM_BENCH of scripts/vm-test.sh),
# with VM_DISK's disk at /var/tmp where there is one.
if [ -e /bench.sh ]; then
    # A virtio block device (device id 2) on the bus: VM_DISK's disk.
    if grep -qx 0x0002 /sys/bus/virtio/devices/*/device 2>/dev/null; then
        modprobe virtio_blk || fail "modprobe virtio_blk"
        wait_for /dev/vda
        { mke2fs -q /dev/vda >/dev/null && modprobe ext4 && mkdir -p /var/tmp && mount -t ext4 /dev/vda /var/tmp; } \
            || fail "cannot mount the disk at /var/tmp"
        say "disk: /dev/vda at /var/tmp, $(df -k /var/tmp | awk 'NR == 2 {print $2}') KiB, ext2"
    fi
    (. /bench.sh) > /tmp/bench.out 2>&1
    rc=$?
    sed 's/^/VM-TEST: bench: /' /tmp/bench.out
    [ "$rc" = 0 ] || fail "the bench script exited with $rc"
    lap "bench"
    say "PASS"
    poweroff -f
fi

for m in nbd fuse loop; do modprobe "$m" || fail "modprobe $m"; done

# A job of $2 MiB (150 by default) in a group limited to 64 MiB: it must
# swap, and finish intact.
job() {
    mkdir /sys/fs/cgroup/job || fail "mkdir job cgroup"
    echo 64M > /sys/fs/cgroup/job/memory.max
    sh -c "echo \$\$ > /sys/fs/cgroup/job/cgroup.procs && exec /bin/hog ${2:-150}" > /tmp/job.out 2>&1
    rc=$?
    say "$1: job exit $rc, $(cat /tmp/job.out), peak $(cat /sys/fs/cgroup/job/memory.peak), events $(tr '\n' ' ' < /sys/fs/cgroup/job/memory.events)"
    rmdir /sys/fs/cgroup/job
    [ "$rc" = 0 ] && grep -q '^OK ' /tmp/job.out || fail "$1: the job failed"
}

# 1. tmem serve nbd, the kernel's NBD client, swap on /dev/nbd0.
if [ "$smokes" = 1 ]; then
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
lap "nbd"
else
    say "tmem serve nbd under nbd-client: checked in the other guest (tmem_vm_smokes)"
fi

# 2. tmem swap up without flags: --transport auto (ublk on Debian 13, FUSE +
# loop on Debian 12, whose cloud kernel has no ublk), --front
# auto, so zram in front where the kernel's zram has writeback (both
# Debian kernels).
tmem swap up > /tmp/up.log 2>&1 || fail "tmem swap up"
say "swap: $(tail -n +2 /proc/swaps | tr '\n' ';')"
job "swap up"
tmem stat --counters | grep -E ' (stored_pages|succ_puts|succ_gets|pool_limit_hit|write_ios|read_ios) ' | sed 's/^/VM-TEST:   /' || fail "tmem stat --counters"
tmem swap down > /tmp/down.log 2>&1 || fail "tmem swap down"

lap "swap up"

# 2a. The fronts: zram with writeback to tmem, a kill, zswap on cgroup v2.
. /fronts.sh
lap "fronts"

# 2b. The NBD and ublk transports: the kernel's NBD client set up by tmem
# itself, and ublk where the kernel has it (after the fronts, whose
# helpers they use for zram in front of them).
. /transports.sh

# 3. The pressure bench on cgroup v2 (small: TCG is slow).
if [ "$smokes" = 1 ]; then
tmem bench pressure --workload-mib 96 --levels 100,50 --runs 1 --passes 1 --backends tmem --json /tmp/pressure.json > /tmp/pressure.log 2>&1 || fail "tmem bench pressure"
say "bench pressure: $(grep -o '"cgroup_layout": *"[a-z0-9]*"' /tmp/pressure.json)"
grep -A3 'wall time' /tmp/pressure.log | sed 's/^/VM-TEST:   /'
lap "bench pressure"
else
    say "the pressure bench: run in the other guest (tmem_vm_smokes)"
fi

# Nothing left behind.
[ "$(tail -n +2 /proc/swaps)" = "" ] || fail "swap left: $(cat /proc/swaps)"
[ "$(losetup -a)" = "" ] || fail "loop devices left: $(losetup -a)"
grep -q fuse /proc/mounts && fail "mounts left: $(grep fuse /proc/mounts)"
[ -d /sys/fs/cgroup/job ] && fail "cgroup left"
say "PASS"
poweroff -f
