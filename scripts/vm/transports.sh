# Sourced by scripts/vm/init.sh: `tmem swap up --transport nbd` (the
# kernel's NBD client set up by tmem itself over netlink, no nbd-client) on
# both Debian kernels, and `--transport ublk` (the kernel's ublk driver)
# where the kernel has it (Debian 13), with the same checks. Uses
# say/fail/job/lap from init.sh, coldjob, front_counter and no_front_left
# from fronts.sh.

# The NBD devices connected now (their pid file names a process).
nbd_connected() { for p in /sys/block/nbd*/pid; do [ -e "$p" ] && basename "${p%/pid}"; done | tr '\n' ' '; }

# The ublk devices that exist now.
ublk_present() { ls /sys/class/ublk-char 2> /dev/null | tr '\n' ' '; }

# The value of device counter $1 in `tmem stat --json` (the first device).
dev_counter() { tmem stat --json | tr -d ' \n' | grep -o "\"$1\":[0-9]*" | head -n 1 | tr -dc 0-9; }

nothing_left() {
    [ "$(tail -n +2 /proc/swaps)" = "" ] || fail "$1: swap left: $(cat /proc/swaps)"
    [ -z "$(nbd_connected)" ] || fail "$1: NBD devices left connected: $(nbd_connected)"
    [ -z "$(ublk_present)" ] || fail "$1: ublk devices left: $(ublk_present)"
    [ "$(losetup -a)" = "" ] || fail "$1: loop devices left: $(losetup -a)"
}

# The checks for transport $1: nbd or ublk.
transport_checks() {
T=$1
case "$T" in
    nbd) NODE=/dev/nbd NAME=NBD DOWN='NBD device .* disconnected' RECOVERED='disconnected the NBD device' ;;
    ublk) NODE=/dev/ublkb NAME=ublk DOWN='ublk device .* deleted' RECOVERED='deleted the ublk device' ;;
esac
nothing_left "before the $NAME transport"

# 1. Swap on the device: a job of 3x its memory.max swaps over it while
# the daemon is replaced twice; the kernel's reads and writes reach tmem,
# the device is handed over, no request fails, the job ends intact, and
# swap down removes the device.
tmem swap up --transport $T --front none > /tmp/up-$T.log 2>&1 || fail "tmem swap up --transport $T"
grep -E 'transport|NBD|ublk' /tmp/up-$T.log | sed 's/^/VM-TEST:   /'
swap_dev=$(tail -n +2 /proc/swaps | cut -d' ' -f1)
case "$swap_dev" in
    "$NODE"*) ;;
    *) fail "transport $T: swap is on '${swap_dev}', not a $NAME device" ;;
esac
say "swap: $(tail -n +2 /proc/swaps | tr '\n' ';')"
job "transport $T, two restarts" 192 &
JOB=$!
for n in 1 2; do
    sleep 3
    tmem swap restart > "/tmp/restart-$T-$n.log" 2>&1 || fail "tmem swap restart $n (transport $T): $(cat "/tmp/restart-$T-$n.log")"
    say "transport $T, restart $n: $(grep -E 'took over|took ublk|handed|ublk device' "/tmp/restart-$T-$n.log" | tr '\n' ';')"
    if [ "$T" = ublk ]; then
        grep -q "took ublk device" "/tmp/restart-$T-$n.log" || fail "transport $T, restart $n: no ublk device taken over"
        # The driver sees the predecessor's end within its io_timeout (1 s),
        # not the default 30 s (tmem_ublk::REQUEST_TIMEOUT_MS).
        took=$(grep -o 'user recovery, [0-9]* ms' "/tmp/restart-$T-$n.log" | tr -dc 0-9)
        [ "${took:-99999}" -lt 10000 ] || fail "transport $T, restart $n: the device was taken ${took:-?} ms after the predecessor was told to go"
    fi
done
wait_job "$JOB" 300 "transport $T: the job across restarts" || fail "transport $T: the job failed across restarts"
tmem stat | sed 's/^/VM-TEST:   /'
tmem stat | grep -q "$T $swap_dev" || fail "transport $T: tmem stat does not name the transport and $swap_dev"
reads=$(dev_counter read_ios)
writes=$(dev_counter write_ios)
failed=$(dev_counter failed_reads)$(dev_counter failed_writes)
say "transport $T: $reads reads and $writes writes served, failed (reads, writes): $failed"
[ "${reads:-0}" -gt 0 ] && [ "${writes:-0}" -gt 0 ] || fail "transport $T: the kernel's requests did not reach tmem"
[ "$failed" = 00 ] || fail "transport $T: requests failed across restarts"
tmem swap down > /tmp/down-$T.log 2>&1 || fail "tmem swap down (transport $T)"
grep -q "$DOWN" /tmp/down-$T.log || fail "transport $T: swap down did not remove the device: $(cat /tmp/down-$T.log)"
nothing_left "transport $T"

# 2. The daemon killed with pages in swap: swap down disconnects (NBD) or
# deletes (ublk) the device, failing the requests in flight or waiting,
# and swaps off; the pages it held are lost.
tmem swap up --transport $T --front none > /tmp/up-$T-kill.log 2>&1 || fail "tmem swap up --transport $T (kill)"
pid=$(tr -d ' \n' < /run/tmem/state.json | grep -o '"pid":[0-9]*' | tr -dc 0-9)
mkdir /sys/fs/cgroup/job || fail "mkdir job cgroup"
echo 48M > /sys/fs/cgroup/job/memory.max
sh -c 'echo $$ > /sys/fs/cgroup/job/cgroup.procs && exec /bin/coldhog 144 75 20' > /tmp/job.out 2>&1 &
JOB=$!
n=0
until [ "$(dev_counter stored_pages)" -gt 10000 ] 2> /dev/null; do
    n=$((n + 1))
    [ "$n" -gt 600 ] && fail "transport $T: the job put fewer than 10000 pages in swap in 60 s"
    sleep 0.1
done
kill -9 "$pid"
while [ -d "/proc/$pid" ]; do sleep 0.1; done
# swapoff charges what it brings back to the job's group, which is at its
# limit and cannot swap now: swap down then refuses and says what to do
# (ENOMEM), and goes through once the limit is raised.
if ! tmem swap down > /tmp/down-$T-kill.log 2>&1; then
    grep -q 'raise their memory.max' /tmp/down-$T-kill.log || fail "swap down after a kill: no advice: $(cat /tmp/down-$T-kill.log)"
    say "transport $T, daemon killed: swap down refused with the job's group full: $(tail -n 1 /tmp/down-$T-kill.log)"
    echo max > /sys/fs/cgroup/job/memory.max
    tmem swap down > /tmp/down-$T-kill.log 2>&1 || fail "tmem swap down after a kill, the group's limit raised (transport $T)"
fi
wait "$JOB"
rc=$?
rmdir /sys/fs/cgroup/job
say "transport $T, daemon killed: job exit $rc ($(cat /tmp/job.out)); $(grep -E 'swapoff|NBD|ublk' /tmp/down-$T-kill.log | tr '\n' ';')"
grep -q "$RECOVERED" /tmp/down-$T-kill.log || fail "recovery did not remove the $NAME device: $(cat /tmp/down-$T-kill.log)"
# The job never passes its check: it gets SIGBUS on a lost page, or its
# group's OOM killer takes it first (its swap writes fail once the daemon
# is gone), and then its pages were freed before recovery looked.
grep -q '^OK ' /tmp/job.out && fail "transport $T: the job passed its check with its swapped pages gone"
nothing_left "transport $T after a kill"

# 3. zram in front of the transport: zram's backing device is the
# transport's, and idle pages go down to tmem through it.
tmem swap up --transport $T --front zram --front-limit 24M --front-idle-age 1 --front-fill 0 \
    > /tmp/up-$T-zram.log 2>&1 || fail "tmem swap up --transport $T --front zram"
grep -q "backing_dev $NODE" /tmp/up-$T-zram.log || fail "transport $T: zram's backing device is not the $NAME device"
coldjob "transport $T, front zram"
written=$(front_counter written_back)
say "transport $T, front zram: $written pages written back to tmem over $NAME, $(front_counter read_back) read back"
[ "${written:-0}" -gt 0 ] || fail "transport $T, front zram: no page went down to tmem"
tmem swap down > /tmp/down-$T-zram.log 2>&1 || fail "tmem swap down (transport $T, front zram)"
no_front_left "transport $T, front zram"
nothing_left "transport $T, front zram"

# 4. A cache over the transport (`tmem cache up --transport $T`): its device
# reads what the backing file holds, and what is written through it
# reaches the file.
dd if=/dev/urandom of=/tmp/backing bs=1M count=32 2> /dev/null
tmem cache up --backing /tmp/backing --pool-limit 16M --transport $T > /tmp/cache-$T.log 2>&1 \
    || fail "tmem cache up --transport $T"
cache_dev=$(tmem stat | grep -o "$T $NODE[0-9]*" | cut -d' ' -f2)
[ -n "$cache_dev" ] || fail "cache over $NAME: tmem stat names no $NAME device"
dd if="$cache_dev" bs=1M count=32 2> /dev/null | cmp - /tmp/backing || fail "cache over $NAME: $cache_dev differs from its backing file"
dd if=/dev/urandom of=/tmp/new bs=1M count=4 2> /dev/null
dd if=/tmp/new of="$cache_dev" bs=1M seek=8 conv=notrunc,fsync 2> /dev/null || fail "cache over $NAME: a write to $cache_dev failed"
tmem cache down > /tmp/cache-down.log 2>&1 || fail "tmem cache down (transport $T)"
dd if=/tmp/backing bs=1M skip=8 count=4 2> /dev/null | cmp - /tmp/new || fail "cache over $NAME: what was written did not reach the backing file"
say "cache over $NAME: $cache_dev read its backing file back and wrote 4 MiB through to it"
nothing_left "cache over $NAME"
rm -f /tmp/backing /tmp/new

# 5. The block conformance suite (tmem_block::conformance::check_data)
# through the kernel, on the transport's device: a cache over a sparse
# file reads as zeros, as a fresh device does.
truncate -s 16M /tmp/blank
tmem cache up --backing /tmp/blank --transport $T > /tmp/conformance-$T.log 2>&1 || fail "tmem cache up --transport $T (conformance)"
dev=$(tmem stat | grep -o "$T $NODE[0-9]*" | cut -d' ' -f2)
node-conformance "$dev" > /tmp/conformance.out 2>&1 || fail "the block conformance suite over $NAME: $(tail -n 5 /tmp/conformance.out)"
say "transport $T: $(cat /tmp/conformance.out)"
tmem cache down > /dev/null 2>&1 || fail "tmem cache down (transport $T, conformance)"
rm -f /tmp/blank
nothing_left "conformance over $NAME"
}

transport_checks nbd
if modprobe ublk_drv 2> /dev/null && [ -e /dev/ublk-control ]; then
    lap "transport nbd"
    transport_checks ublk
    lap "transport ublk"
else
    say "no ublk in this kernel ($(uname -r)): the ublk transport is checked on Debian 13's"
    lap "transport nbd"
fi
