# Sourced by scripts/vm/init.sh: tmem behind the kernel's zram and zswap
# (`tmem swap up --front`), on a kernel with zram writeback (Debian 12 and
# 13) and cgroup v2. Uses say/fail from init.sh.

# A job of 3x its group's memory.max whose first 75 % goes cold.
# The group is removed afterwards unless it was there before.
coldjob() {
    made=no
    [ -d /sys/fs/cgroup/job ] || { mkdir /sys/fs/cgroup/job && made=yes; }
    echo 48M > /sys/fs/cgroup/job/memory.max
    sh -c 'echo $$ > /sys/fs/cgroup/job/cgroup.procs && exec /bin/coldhog 144 75 20' > /tmp/job.out 2>&1
    rc=$?
    say "$1: job exit $rc, $(cat /tmp/job.out), peak $(cat /sys/fs/cgroup/job/memory.peak), events $(tr '\n' ' ' < /sys/fs/cgroup/job/memory.events)"
    [ "$made" = yes ] && rmdir /sys/fs/cgroup/job
    [ "$rc" = 0 ] && grep -q '^OK ' /tmp/job.out || fail "$1: the job failed"
}

# The value of counter $1 in the front object of `tmem stat --json`.
front_counter() { tmem stat --json | tr -d ' \n' | grep -o "\"front\":{[^}]*}" | grep -o "\"$1\":[0-9]*" | tr -dc 0-9; }

zram_devices() { ls /sys/block | grep '^zram' | tr '\n' ' '; }

no_front_left() {
    [ "$(tail -n +2 /proc/swaps)" = "" ] || fail "$1: swap left: $(cat /proc/swaps)"
    [ -z "$(zram_devices)" ] || fail "$1: zram devices left: $(zram_devices)"
    [ "$(losetup -a)" = "" ] || fail "$1: loop devices left: $(losetup -a)"
}

# 1. --front zram: idle pages go down to tmem, some come back, the job is right.
tmem swap up --front zram --front-limit 24M --front-idle-age 1 --front-fill 0 > /tmp/up-zram.log 2>&1 \
    || fail "tmem swap up --front zram"
grep -E '^front:|in front|codec auto' /tmp/up-zram.log | sed 's/^/VM-TEST:   /'
# --codec auto: behind a front, tmem's store is the dense cold tier.
grep -q 'codec auto: zstd:3+dict' /tmp/up-zram.log || fail "front zram: codec auto did not pick zstd:3+dict: $(cat /tmp/up-zram.log)"
say "swap: $(tail -n +2 /proc/swaps | tr '\n' ';')"
coldjob "front zram"
tmem stat | sed 's/^/VM-TEST:   /'
written=$(front_counter written_back)
read=$(front_counter read_back)
pool=$(front_counter pool_bytes)
say "front zram: $written pages written back to tmem, $read read back; zram pool now $pool bytes"
[ "${written:-0}" -gt 0 ] || fail "front zram: no page went down to tmem"
# The job has ended: zram frees its blocks on tmem's device only in its
# own bitmap. The policy reclaims them: zram reads every block it still
# uses, and tmem drops the rest (RECLAIM_TICKS apart, so within 40 s).
i=0
while :; do
    stored=$(tmem stat --json | tr -d ' \n' | grep -o '"stored_pages":[0-9]*' | tr -dc '0-9\n' | sort -n | tail -1)
    live=$(cut -c1-8 /sys/block/zram*/bd_stat | tr -dc 0-9)
    reclaims=$(front_counter below_reclaims)
    [ "${reclaims:-0}" -gt 0 ] && [ "${stored:-1}" -le $((2 * ${live:-0} + 256)) ] && break
    i=$((i + 1))
    [ "$i" -lt 200 ] || fail "front zram: tmem still holds $stored pages 40 s after the job ended, zram $live below ($reclaims reclaims; $(grep 'front policy' /run/tmem/daemon.log | tail -2))"
    sleep 0.2
done
say "front zram: after the job, $reclaims reclaims below ($(front_counter below_reclaimed) pages); tmem holds $stored pages, zram counts $live below"
tmem swap down > /tmp/down-zram.log 2>&1 || fail "tmem swap down (front zram)"
grep -E 'zram' /tmp/down-zram.log | sed 's/^/VM-TEST:   /'
no_front_left "front zram"

# 2. The daemon killed with its zram front up: swap down resets and removes it.
tmem swap up --front zram --front-limit 24M > /tmp/up-kill.log 2>&1 || fail "tmem swap up --front zram (kill)"
pid=$(tr -d ' \n' < /run/tmem/state.json | grep -o '"pid":[0-9]*' | tr -dc 0-9)
kill -9 "$pid"
while [ -d "/proc/$pid" ]; do sleep 0.1; done
tmem swap down > /tmp/down-kill.log 2>&1 || fail "tmem swap down after a kill: $(cat /tmp/down-kill.log)"
grep -q 'removed its zram front' /tmp/down-kill.log || fail "recovery did not remove the zram front: $(cat /tmp/down-kill.log)"
say "front zram, daemon killed: $(grep 'zram front' /tmp/down-kill.log)"
no_front_left "front zram after a kill"

# 3. --front zswap with memory.zswap.max on the job's group (cgroup v2).
if [ -e /sys/module/zswap/parameters/enabled ]; then
    before=$(cat /sys/module/zswap/parameters/enabled /sys/module/zswap/parameters/max_pool_percent | tr '\n' ' ')
    mkdir /sys/fs/cgroup/job
    tmem swap up --front zswap --front-limit 16M --front-cgroup /sys/fs/cgroup/job > /tmp/up-zswap.log 2>&1 \
        || fail "tmem swap up --front zswap: $(cat /tmp/up-zswap.log)"
    [ "$(cat /sys/fs/cgroup/job/memory.zswap.max)" = 16777216 ] || fail "front zswap: memory.zswap.max is $(cat /sys/fs/cgroup/job/memory.zswap.max)"
    coldjob "front zswap"
    say "front zswap: $(grep -E '^(zswpout|zswpin|zswpwb) ' /proc/vmstat | tr '\n' ' ')"
    tmem swap down > /tmp/down-zswap.log 2>&1 || fail "tmem swap down (front zswap)"
    [ "$(cat /sys/fs/cgroup/job/memory.zswap.max)" = max ] || fail "front zswap: memory.zswap.max left at $(cat /sys/fs/cgroup/job/memory.zswap.max)"
    rmdir /sys/fs/cgroup/job
    after=$(cat /sys/module/zswap/parameters/enabled /sys/module/zswap/parameters/max_pool_percent | tr '\n' ' ')
    [ "$before" = "$after" ] || fail "front zswap: zswap left at '$after', was '$before'"
    no_front_left "front zswap"
else
    say "front zswap: not run: this kernel has no zswap ($(uname -r))"
fi
say "fronts: PASS"
