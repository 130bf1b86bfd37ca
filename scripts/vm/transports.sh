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

# 1. Swap on /dev/nbdN: a job of 3x its memory.max ends intact, and the
# kernel's reads and writes reached tmem over the NBD sessions.
tmem swap up --transport nbd --front none > /tmp/up-nbd.log 2>&1 || fail "tmem swap up --transport nbd"
grep -E 'transport|NBD' /tmp/up-nbd.log | sed 's/^/VM-TEST:   /'
swap_dev=$(tail -n +2 /proc/swaps | cut -d' ' -f1)
case "$swap_dev" in
    /dev/nbd*) ;;
    *) fail "transport nbd: swap is on '${swap_dev}', not an NBD device" ;;
esac
say "swap: $(tail -n +2 /proc/swaps | tr '\n' ';')"
job "transport nbd" 192
tmem stat | sed 's/^/VM-TEST:   /'
tmem stat | grep -q "nbd $swap_dev" || fail "transport nbd: tmem stat does not name the transport and $swap_dev"
reads=$(dev_counter read_ios)
writes=$(dev_counter write_ios)
say "transport nbd: $reads reads and $writes writes served"
[ "${reads:-0}" -gt 0 ] && [ "${writes:-0}" -gt 0 ] || fail "transport nbd: the kernel's requests did not reach tmem"
tmem swap down > /tmp/down-nbd.log 2>&1 || fail "tmem swap down (transport nbd)"
grep -q 'NBD device .* disconnected' /tmp/down-nbd.log || fail "transport nbd: swap down did not disconnect the device"
nothing_left "transport nbd"

# 2. Restarts under load: a job of 3x its memory.max swaps over NBD while
# the daemon is replaced twice; the device is handed over, no request
# fails, and the job ends intact.
tmem swap up --transport nbd --front none > /tmp/up-nbd-restart.log 2>&1 || fail "tmem swap up --transport nbd (restart)"
swap_dev=$(tail -n +2 /proc/swaps | cut -d' ' -f1)
job "transport nbd, restarts" 192 &
JOB=$!
for n in 1 2; do
    sleep 3
    tmem swap restart > "/tmp/restart-nbd-$n.log" 2>&1 || fail "tmem swap restart $n (transport nbd): $(cat "/tmp/restart-nbd-$n.log")"
    say "transport nbd, restart $n: $(grep -m1 -E 'took over|handed' "/tmp/restart-nbd-$n.log")"
done
wait "$JOB" || fail "transport nbd: the job failed across restarts"
tmem stat | grep -q "nbd $swap_dev" || fail "transport nbd: after restarts, tmem stat does not name $swap_dev"
failed=$(dev_counter failed_reads)$(dev_counter failed_writes)
[ "$failed" = 00 ] || fail "transport nbd: requests failed across restarts (reads, writes: $failed)"
tmem swap down > /tmp/down-nbd-restart.log 2>&1 || fail "tmem swap down (transport nbd, after restarts)"
nothing_left "transport nbd after restarts"

# 3. The daemon killed: swap down swaps off and disconnects the device.
tmem swap up --transport nbd --front none > /tmp/up-nbd-kill.log 2>&1 || fail "tmem swap up --transport nbd (kill)"
pid=$(tr -d ' \n' < /run/tmem/state.json | grep -o '"pid":[0-9]*' | tr -dc 0-9)
kill -9 "$pid"
while [ -d "/proc/$pid" ]; do sleep 0.1; done
tmem swap down > /tmp/down-nbd-kill.log 2>&1 || fail "tmem swap down after a kill (transport nbd)"
grep -q 'disconnected the NBD device' /tmp/down-nbd-kill.log || fail "recovery did not disconnect the NBD device"
say "transport nbd, daemon killed: $(grep -E 'swapoff|NBD' /tmp/down-nbd-kill.log | tr '\n' ';')"
nothing_left "transport nbd after a kill"

# 4. zram in front of the NBD transport: zram's backing device is
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
