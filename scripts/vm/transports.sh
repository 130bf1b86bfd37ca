# Sourced by scripts/vm/init.sh: `tmem swap up --transport nbd`, the
# kernel's NBD client set up by tmem itself over netlink (no nbd-client),
# on both Debian kernels. Uses say/fail/job from init.sh, coldjob,
# front_counter and no_front_left from fronts.sh.

# The NBD devices connected now (their pid file names a process).
nbd_connected() { for p in /sys/block/nbd*/pid; do [ -e "$p" ] && basename "${p%/pid}"; done | tr '\n' ' '; }

# The value of device counter $1 in `tmem stat --json` (the first device).
dev_counter() { tmem stat --json | tr -d ' \n' | grep -o "\"$1\":[0-9]*" | head -n 1 | tr -dc 0-9; }

nothing_left() {
    [ "$(tail -n +2 /proc/swaps)" = "" ] || fail "$1: swap left: $(cat /proc/swaps)"
    [ -z "$(nbd_connected)" ] || fail "$1: NBD devices left connected: $(nbd_connected)"
    [ "$(losetup -a)" = "" ] || fail "$1: loop devices left: $(losetup -a)"
}

nothing_left "before the NBD transport"

# 1. Swap on /dev/nbdN: a job of 3x its memory.max swaps over NBD while
# the daemon is replaced twice; the kernel's reads and writes reach tmem,
# the device is handed over, no request fails, the job ends intact, and
# swap down disconnects the device.
tmem swap up --transport nbd --front none > /tmp/up-nbd.log 2>&1 || fail "tmem swap up --transport nbd"
grep -E 'transport|NBD' /tmp/up-nbd.log | sed 's/^/VM-TEST:   /'
swap_dev=$(tail -n +2 /proc/swaps | cut -d' ' -f1)
case "$swap_dev" in
    /dev/nbd*) ;;
    *) fail "transport nbd: swap is on '${swap_dev}', not an NBD device" ;;
esac
say "swap: $(tail -n +2 /proc/swaps | tr '\n' ';')"
job "transport nbd, two restarts" 192 &
JOB=$!
for n in 1 2; do
    sleep 3
    tmem swap restart > "/tmp/restart-nbd-$n.log" 2>&1 || fail "tmem swap restart $n (transport nbd): $(cat "/tmp/restart-nbd-$n.log")"
    say "transport nbd, restart $n: $(grep -m1 -E 'took over|handed' "/tmp/restart-nbd-$n.log")"
done
wait "$JOB" || fail "transport nbd: the job failed across restarts"
tmem stat | sed 's/^/VM-TEST:   /'
tmem stat | grep -q "nbd $swap_dev" || fail "transport nbd: tmem stat does not name the transport and $swap_dev"
reads=$(dev_counter read_ios)
writes=$(dev_counter write_ios)
failed=$(dev_counter failed_reads)$(dev_counter failed_writes)
say "transport nbd: $reads reads and $writes writes served, failed (reads, writes): $failed"
[ "${reads:-0}" -gt 0 ] && [ "${writes:-0}" -gt 0 ] || fail "transport nbd: the kernel's requests did not reach tmem"
[ "$failed" = 00 ] || fail "transport nbd: requests failed across restarts"
tmem swap down > /tmp/down-nbd.log 2>&1 || fail "tmem swap down (transport nbd)"
grep -q 'NBD device .* disconnected' /tmp/down-nbd.log || fail "transport nbd: swap down did not disconnect the device"
nothing_left "transport nbd"

# 2. The daemon killed with pages in swap: swap down disconnects the
# device (failing the requests in flight) and swaps off; the pages it held
# are lost.
tmem swap up --transport nbd --front none > /tmp/up-nbd-kill.log 2>&1 || fail "tmem swap up --transport nbd (kill)"
pid=$(tr -d ' \n' < /run/tmem/state.json | grep -o '"pid":[0-9]*' | tr -dc 0-9)
mkdir /sys/fs/cgroup/job || fail "mkdir job cgroup"
echo 48M > /sys/fs/cgroup/job/memory.max
sh -c 'echo $$ > /sys/fs/cgroup/job/cgroup.procs && exec /bin/coldhog 144 75 20' > /tmp/job.out 2>&1 &
JOB=$!
n=0
until [ "$(dev_counter stored_pages)" -gt 10000 ] 2> /dev/null; do
    n=$((n + 1))
    [ "$n" -gt 600 ] && fail "transport nbd: the job put fewer than 10000 pages in swap in 60 s"
    sleep 0.1
done
kill -9 "$pid"
while [ -d "/proc/$pid" ]; do sleep 0.1; done
# swapoff charges what it brings back to the job's group, which is at its
# limit and cannot swap now: swap down then refuses and says what to do
# (ENOMEM), and goes through once the limit is raised.
if ! tmem swap down > /tmp/down-nbd-kill.log 2>&1; then
    grep -q 'raise their memory.max' /tmp/down-nbd-kill.log || fail "swap down after a kill: no advice: $(cat /tmp/down-nbd-kill.log)"
    say "transport nbd, daemon killed: swap down refused with the job's group full: $(tail -n 1 /tmp/down-nbd-kill.log)"
    echo max > /sys/fs/cgroup/job/memory.max
    tmem swap down > /tmp/down-nbd-kill.log 2>&1 || fail "tmem swap down after a kill, the group's limit raised (transport nbd)"
fi
wait "$JOB"
rc=$?
rmdir /sys/fs/cgroup/job
say "transport nbd, daemon killed: job exit $rc ($(cat /tmp/job.out)); $(grep -E 'swapoff|NBD' /tmp/down-nbd-kill.log | tr '\n' ';')"
grep -q 'disconnected the NBD device' /tmp/down-nbd-kill.log || fail "recovery did not disconnect the NBD device"
# The job never passes its check: it gets SIGBUS on a lost page, or its
# group's OOM killer takes it first (its swap writes fail once the daemon
# is gone), and then its pages were freed before recovery looked.
grep -q '^OK ' /tmp/job.out && fail "transport nbd: the job passed its check with its swapped pages gone"
nothing_left "transport nbd after a kill"

# 3. zram in front of the NBD transport: zram's backing device is
# /dev/nbdN, and idle pages go down to tmem through it.
tmem swap up --transport nbd --front zram --front-limit 24M --front-idle-age 1 --front-fill 0 \
    > /tmp/up-nbd-zram.log 2>&1 || fail "tmem swap up --transport nbd --front zram"
grep -q 'backing_dev /dev/nbd' /tmp/up-nbd-zram.log || fail "transport nbd: zram's backing device is not the NBD device"
coldjob "transport nbd, front zram"
written=$(front_counter written_back)
say "transport nbd, front zram: $written pages written back to tmem over NBD, $(front_counter read_back) read back"
[ "${written:-0}" -gt 0 ] || fail "transport nbd, front zram: no page went down to tmem"
tmem swap down > /tmp/down-nbd-zram.log 2>&1 || fail "tmem swap down (transport nbd, front zram)"
no_front_left "transport nbd, front zram"
nothing_left "transport nbd, front zram"

# 4. A cache over NBD (`tmem cache up --transport nbd`): its /dev/nbdN
# reads what the backing file holds, and what is written through it
# reaches the file.
dd if=/dev/urandom of=/tmp/backing bs=1M count=32 2> /dev/null
tmem cache up --backing /tmp/backing --pool-limit 16M --transport nbd > /tmp/cache-nbd.log 2>&1 \
    || fail "tmem cache up --transport nbd"
cache_dev=$(tmem stat | grep -o 'nbd /dev/nbd[0-9]*' | cut -d' ' -f2)
[ -n "$cache_dev" ] || fail "cache over NBD: tmem stat names no NBD device"
dd if="$cache_dev" bs=1M count=32 2> /dev/null | cmp - /tmp/backing || fail "cache over NBD: $cache_dev differs from its backing file"
dd if=/dev/urandom of=/tmp/new bs=1M count=4 2> /dev/null
dd if=/tmp/new of="$cache_dev" bs=1M seek=8 conv=notrunc,fsync 2> /dev/null || fail "cache over NBD: a write to $cache_dev failed"
tmem cache down > /tmp/cache-down.log 2>&1 || fail "tmem cache down (transport nbd)"
dd if=/tmp/backing bs=1M skip=8 count=4 2> /dev/null | cmp - /tmp/new || fail "cache over NBD: what was written did not reach the backing file"
say "cache over NBD: $cache_dev read its backing file back and wrote 4 MiB through to it"
nothing_left "cache over NBD"
rm -f /tmp/backing /tmp/new
