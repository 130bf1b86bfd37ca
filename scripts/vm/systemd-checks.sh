#!/bin/bash
# Runs in the guest of scripts/vm-systemd.sh (Debian 12, systemd as PID 1),
# from a oneshot unit (scripts/vm/tmem-vm-checks.service): installs tmem's
# .deb and checks its unit. Prints "VM-SYSTEMD: NAME: ok|FAIL (SECONDS s)"
# per check, with the evidence after a failure, then "VM-SYSTEMD: PASS" or
# "VM-SYSTEMD: FAIL NAMES". A failed check does not stop the later ones.
#
# tmem's devices are found, not assumed: its loop devices are those backed
# by a file under /run/tmem, and the front in front of them (the default
# configuration's `kind = "auto"` may pick zram, with the loop device as
# its backing_dev) is the "node" of `tmem stat --json`; swap may be on either.
set -u
export PATH=/usr/sbin:/usr/bin:/sbin:/bin SYSTEMD_COLORS=0 SYSTEMD_PAGER=
RUN=/run/tmem
failed=()
say() { echo "VM-SYSTEMD: $*"; }
main_pid() { systemctl show -p MainPID --value tmem; }
state() { systemctl is-active tmem 2>/dev/null; }
result() { systemctl show -p Result --value tmem; }
now() { echo "${EPOCHREALTIME/[.,]/}"; }
# Seconds since a now(), with a tenth.
since() { local d=$(($(now) - $1)); echo "$((d / 1000000)).$((d / 100000 % 10))"; }
# poll SECS CMD...: runs CMD every 0.2 s until it succeeds; fails once SECS
# seconds have gone by.
poll() {
    local end=$(($(now) + $1 * 1000000))
    shift
    until "$@"; do
        [ "$(now)" -lt "$end" ] || return 1
        sleep 0.2
    done
}

# tmem's block devices now, one a line: its loop devices and its front's.
tmem_devs() {
    losetup -n -O NAME,BACK-FILE 2>/dev/null | awk -v run="$RUN/" 'index($2, run) == 1 {print $1}'
    tmem stat --json 2>/dev/null | sed -n 's|.*"node": *"\(/dev/[^"]*\)".*|\1|p'
}
# Every device tmem was seen to use, for the check that a stop leaves none.
SEEN=""
remember() { SEEN=$(printf '%s\n' $SEEN $(tmem_devs) | sort -u); }
# The swap areas on tmem's devices, one a line.
tmem_swaps() {
    local devs; devs=$(tmem_devs)
    [ -n "$devs" ] || return 0
    awk 'NR > 1 {print $1}' /proc/swaps | grep -Fx -f <(echo "$devs") || true
}
swap_on() { [ -n "$(tmem_swaps)" ]; }
# Swap on within 30 s: once a job has ended, the daemon may be emptying the
# idle area (swapoff, mkswap, swapon: it is off for those three commands).
swap_comes_on() { poll 30 swap_on; }
# Swap in use, all areas, in KiB.
swapped_kib() { awk 'NR > 1 {s += $4} END {print s + 0}' /proc/swaps; }
gone() { ! kill -0 "$1" 2>/dev/null; }
# job_end PID: waits for a job started in the background (at most 300 s;
# a job whose swap died may never end) and returns its exit status.
job_end() {
    poll 300 gone "$1" || { echo "the job (pid $1) still runs 300 s later"; kill -KILL "$1"; return 124; }
    wait "$1"
}
not_active() { [ "$(state)" != active ]; }
pid_changed_from() { local p; p=$(main_pid); [ "$p" != "$1" ] && [ "$p" != 0 ]; }

evidence() {
    echo "--- systemctl status tmem"
    systemctl status tmem --no-pager -l -n 0 2>&1
    echo "--- journalctl -u tmem -n 50"
    journalctl -u tmem -n 50 --no-pager -o short-monotonic 2>&1
    echo "--- /proc/swaps, losetup -a, tmem's mounts"
    cat /proc/swaps; losetup -a; grep " $RUN" /proc/mounts
    echo "---"
}
# The checks to run (tmem_vm_checks=NAME,NAME on the kernel's command line,
# from VM_CHECKS); all where absent.
ONLY=$(sed -n 's/.*tmem_vm_checks=\([^ ]*\).*/\1/p' /proc/cmdline)
# check NAME FUNCTION [ARGS]: runs it in this shell, prints its last line
# when it passes, all it printed and the evidence when it fails.
check() {
    local name=$1 t out=/tmp/check.out
    shift
    [ -z "$ONLY" ] || [[ ",$ONLY," == *",$name,"* ]] || return 0
    t=$(now)
    if "$@" >"$out" 2>&1; then
        say "$name: ok ($(since "$t") s)$([ -s "$out" ] && echo "; $(tail -n 1 "$out")")"
    else
        say "$name: FAIL ($(since "$t") s)$([ -s "$out" ] && echo "; $(tail -n 1 "$out")")"
        head -n -1 "$out"
        evidence
        failed+=("$name")
    fi
    remember
}

# 1. The package, then the unit as a user starts it.
enable_now() {
    local swaps t dpkg
    t=$(now)
    dpkg -i /data/tmem_*.deb || { echo "dpkg -i failed"; return 1; }
    dpkg=$(since "$t")
    t=$(now)
    systemctl enable --now tmem || { echo "systemctl enable --now tmem failed"; return 1; }
    t=$(since "$t")
    [ "$(state)" = active ] || { echo "not active after enable --now: $(state)"; return 1; }
    tmem stat || { echo "tmem stat does not answer"; return 1; }
    swaps=$(tmem_swaps)
    [ -n "$swaps" ] || { echo "no swap on tmem's devices ($(tmem_devs | xargs)); swapon --show: $(swapon --show --noheadings)"; return 1; }
    echo "dpkg -i $dpkg s, enable --now $t s; active, MainPID $(main_pid), swap on $(echo $swaps) (tmem's devices: $(tmem_devs | xargs))"
}

# 2. OOMScoreAdjust=-1000 reaches the daemon.
oom_score() {
    local pid v
    pid=$(main_pid)
    v=$(cat "/proc/$pid/oom_score_adj") || { echo "no /proc/$pid (MainPID $pid)"; return 1; }
    [ "$v" = -1000 ] || { echo "oom_score_adj of MainPID $pid is $v"; return 1; }
    echo "MainPID $pid: oom_score_adj -1000"
}

# Pages in tmem's own pools (`tmem stat --json`), 0 without a daemon.
tmem_pages() {
    tmem stat --json 2>/dev/null | grep -o '"stored_pages": *[0-9]*' | grep -o '[0-9]*$' | sort -n | tail -1 | grep . || echo 0
}

# 3. From here on without a front: zram in front keeps a short job's pages
# until they are idle, and the hand-overs below must move pages of tmem's.
start_without_front() {
    sed -i '/^\[front\]/,/^\[/ s/^kind = .*/kind = "none"/' /etc/tmem/tmem.toml
    grep -A5 '^\[front\]' /etc/tmem/tmem.toml | grep -qx 'kind = "none"' || { echo "no [front] kind in the config"; return 1; }
    systemctl start tmem || { echo "systemctl start tmem failed"; return 1; }
    [ "$(state)" = active ] || { echo "not active: $(state)"; return 1; }
    swap_on || { echo "no swap on tmem's devices"; return 1; }
    echo "active, MainPID $(main_pid), swap on $(echo $(tmem_swaps))"
}

# 4, 5. A checksum job swaps in a cgroup held at 64 MiB (MemoryHigh: reclaim
# throttles the job rather than OOM-kill it while swap-out through FUSE is
# slow under TCG; MemoryMax=64M got one job OOM-killed) while `systemctl ACTION
# tmem` runs: the job must end OK, the unit stay active with a new main
# process, and swap stay on.
under_job() {
    local action=$1 before after out=/tmp/job-$1.out job rc=0 used t late="" pages
    before=$(main_pid)
    systemd-run --quiet --scope -p MemoryHigh=64M -p MemorySwapMax=infinity /data/hog 160 >"$out" 2>&1 &
    job=$!
    # Some swap in use (the job overshoots its limit by 96 MiB in all).
    if ! poll 300 eval '[ "$(swapped_kib)" -gt 16384 ] || gone '"$job"; then
        echo "the job never swapped 16 MiB in 300 s"; kill "$job"; job_end "$job"; return 1
    fi
    used=$(swapped_kib)
    if gone "$job"; then
        job_end "$job"; echo "the job ended before it swapped 16 MiB (exit $?): $(cat "$out")"; return 1
    fi
    # Without a front the job's swap is tmem's own.
    poll 60 eval '[ "$(tmem_pages)" -gt 1000 ]' || { echo "tmem's pools hold $(tmem_pages) pages"; kill "$job"; job_end "$job"; return 1; }
    pages=$(tmem_pages)
    t=$(now)
    if ! systemctl "$action" tmem; then
        echo "systemctl $action tmem failed ($(since "$t") s), with ${used} KiB swapped"
        job_end "$job"; echo "the job: exit $?, $(cat "$out")"
        return 1
    fi
    t=$(since "$t")
    # The main process as systemd had it when the command returned.
    after=$(main_pid)
    if [ "$after" = "$before" ] || [ "$after" = 0 ]; then
        poll 10 pid_changed_from "$before" && late=" (MainPID changed only after systemctl returned)"
        after=$(main_pid)
    fi
    job_end "$job" || rc=$?
    [ "$rc" = 0 ] && grep -q '^OK' "$out" || { echo "the job: exit $rc, $(cat "$out")"; return 1; }
    [ "$(state)" = active ] || { echo "not active after $action: $(state)"; return 1; }
    [ "$after" != "$before" ] && [ "$after" != 0 ] || { echo "MainPID $before -> $after"; return 1; }
    poll 10 gone "$before" || { echo "the old daemon $before still runs"; return 1; }
    swap_comes_on || { echo "no swap on tmem's devices after $action"; return 1; }
    echo "systemctl $action took $t s with $((used / 1024)) MiB swapped, $pages pages in tmem's pool; MainPID $before -> $after$late; job exit 0, $(cat "$out")"
}

# 6. A daemon that stops answering is killed by the watchdog, and the next
# start cleans up what it left.
DROPIN=/run/systemd/system/tmem.service.d/watchdog.conf
watchdog() {
    local pid t res
    mkdir -p "${DROPIN%/*}"
    printf '[Service]\nWatchdogSec=5s\n' > "$DROPIN"
    systemctl daemon-reload
    systemctl restart tmem || { echo "restart with WatchdogSec=5s failed"; watchdog_undo; return 1; }
    pid=$(main_pid)
    kill -STOP "$pid"
    t=$(now)
    if ! poll 30 not_active; then
        echo "still $(state) 30 s after SIGSTOP to MainPID $pid (Result=$(result))"
        kill -CONT "$pid"; watchdog_undo; return 1
    fi
    res=$(result)
    t=$(since "$t")
    # Where systemd did not wake it up itself to die of its SIGABRT.
    kill -CONT "$pid" 2>/dev/null
    if [ "$res" != watchdog ]; then
        echo "left active after $t s with Result=$res, not watchdog"; watchdog_undo; return 1
    fi
    poll 30 gone "$pid" || { echo "MainPID $pid outlived its watchdog by 30 s"; watchdog_undo; return 1; }
    watchdog_undo || return 1
    systemctl start tmem || { echo "systemctl start tmem after the watchdog failed"; return 1; }
    [ "$(state)" = active ] || { echo "not active after the start: $(state)"; return 1; }
    swap_comes_on || { echo "no swap on tmem's devices after the start"; return 1; }
    echo "Result=watchdog $t s after SIGSTOP; started again as MainPID $(main_pid), swap on $(echo $(tmem_swaps))"
}
watchdog_undo() {
    rm -f "$DROPIN"
    systemctl daemon-reload
    systemctl reset-failed tmem
}

# 2, 7. A stop leaves nothing of tmem's behind.
stop_clean() {
    local bad=() dev z left
    remember
    systemctl stop tmem || bad+=("systemctl stop tmem failed")
    [ "$(state)" = inactive ] || bad+=("state $(state), Result=$(result)")
    pgrep -a -x tmem && bad+=("a tmem process is left")
    for dev in $SEEN; do
        grep -q "^$dev " /proc/swaps && bad+=("swap is still on $dev")
        case "$dev" in
            /dev/loop*) losetup "$dev" >/dev/null 2>&1 && bad+=("$dev is still attached: $(losetup -n "$dev")") ;;
            /dev/zram*)
                z=/sys/block/${dev#/dev/}
                [ ! -e "$z" ] || [ "$(cat "$z/disksize")" = 0 ] || bad+=("${dev#/dev/} is still set up (disksize $(cat "$z/disksize"))") ;;
        esac
    done
    losetup -a | grep -F "$RUN/" && bad+=("a loop device on a file under $RUN is left")
    if grep " $RUN" /proc/mounts; then
        bad+=("a mount under $RUN is left")
        # Evidence: whether the mount was only busy for a moment.
        for m in $(awk -v run="$RUN" 'index($2, run) == 1 {print $2}' /proc/mounts); do
            if umount "$m"; then echo "(a plain umount $m now succeeds)"; else echo "(umount $m still fails)"; fi
        done
    fi
    left=$(ls -A "$RUN" 2>/dev/null | grep -v -x -e daemon.lock -e daemon.log | xargs)
    [ -z "$left" ] || bad+=("left in $RUN: $left")
    if [ "${#bad[@]}" -gt 0 ]; then
        printf '%s\n' "${bad[@]}" | sed ':a;N;$!ba;s/\n/; /g'
        return 1
    fi
    echo "no process, swap area, loop device or mount left of $(echo $SEEN); $RUN: $(ls -A "$RUN" | xargs)"
}

begin=$(now)
up=$(systemctl show -p ActiveEnterTimestampMonotonic --value multi-user.target)
say "systemd $(systemctl --version | head -1 | cut -d' ' -f2), kernel $(uname -r): multi-user.target reached $((up / 1000000)).$((up / 100000 % 10)) s after boot, checks start at $(cut -d' ' -f1 /proc/uptime) s"
check enable-now enable_now
check oom-score oom_score
check stop-clean-with-front stop_clean
check start-without-front start_without_front
check reload-under-job under_job reload
check restart-under-job under_job restart
check watchdog watchdog
check stop-clean stop_clean
say "checks took $(since "$begin") s"
if [ "${#failed[@]}" -eq 0 ]; then
    say PASS
else
    say "FAIL ${failed[*]}"
fi
