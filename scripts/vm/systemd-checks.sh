#!/bin/bash
# Runs in the guest of scripts/vm-systemd.sh, as a oneshot unit under
# systemd (PID 1): installs tmem's .deb and checks its unit. Prints
# "VM-TEST: systemd: NAME: ok|FAIL (...)" per check, then
# "VM-TEST: systemd: PASS" or "VM-TEST: systemd: FAIL NAMES".
set -u
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
failed=()
say() { echo "VM-TEST: systemd: $*"; }
main_pid() { systemctl show -p MainPID --value tmem; }
state() { systemctl is-active tmem 2>/dev/null; }
# Polls CMD for up to SECS seconds.
until_ok() {
    local secs=$1; shift
    local end=$((SECONDS + secs))
    until "$@"; do
        [ "$SECONDS" -lt "$end" ] || return 1
        sleep 0.5
    done
}
evidence() {
    systemctl status tmem --no-pager -l 2>&1 | tail -n 25
    journalctl -u tmem -n 40 --no-pager 2>&1
    swapon --show
    tail -n 20 /run/tmem/daemon.log 2>/dev/null
}
# check NAME CMD...: runs CMD (a function), reports it and its time.
check() {
    local name=$1 t=$SECONDS out
    shift
    if out=$("$@" 2>&1); then
        say "$name: ok ($((SECONDS - t)) s)${out:+; $(tail -n 1 <<<"$out")}"
    else
        say "$name: FAIL ($((SECONDS - t)) s)"
        echo "$out"
        evidence
        failed+=("$name")
    fi
}
swap_on() { [ "$(swapon --show --noheadings | wc -l)" -gt 0 ]; }

enable_now() {
    dpkg -i /data/tmem_*.deb >/dev/null || return 1
    systemctl daemon-reload
    systemctl enable --now tmem || return 1
    [ "$(state)" = active ] || { echo "not active: $(state)"; return 1; }
    swap_on || { echo "no swap is on"; return 1; }
    tmem stat >/dev/null || return 1
    echo "active, pid $(main_pid), swap on $(swapon --show=NAME --noheadings | tr '\n' ' ')"
}

oom_score() {
    local v; v=$(cat "/proc/$(main_pid)/oom_score_adj")
    [ "$v" = -1000 ] || { echo "oom_score_adj $v"; return 1; }
    echo "oom_score_adj -1000"
}

# swapped_kib: swap in use, all areas.
swapped_kib() { awk 'NR > 1 {s += $4} END {print s + 0}' /proc/swaps; }
# under_job ACTION: a checksum job swaps in a 64 MiB cgroup while ACTION
# (reload or restart) runs; the job must end OK, the unit active with a
# new main process, swap still on.
under_job() {
    local action=$1 before after out=/tmp/job-$1.out job
    before=$(main_pid)
    systemd-run --quiet --scope -p MemoryMax=64M -p MemorySwapMax=infinity /data/hog 160 >"$out" 2>&1 &
    job=$!
    local end=$((SECONDS + 300))
    until [ "$(swapped_kib)" -gt 32768 ]; do
        if ! kill -0 "$job" 2>/dev/null || [ "$SECONDS" -ge "$end" ]; then
            echo "the job never swapped 32 MiB: $(cat "$out"); $(dmesg | tail -n 5)"
            kill "$job" 2>/dev/null
            return 1
        fi
        sleep 0.5
    done
    systemctl "$action" tmem || { echo "systemctl $action failed"; wait "$job"; return 1; }
    wait "$job" || { echo "the job failed: $(cat "$out")"; return 1; }
    grep -q '^OK' "$out" || { echo "the job: $(cat "$out")"; return 1; }
    after=$(main_pid)
    [ "$(state)" = active ] || { echo "not active after $action: $(state)"; return 1; }
    [ "$after" != "$before" ] && [ "$after" != 0 ] || { echo "MainPID $before -> $after"; return 1; }
    kill -0 "$before" 2>/dev/null && { echo "the old daemon $before still runs"; return 1; }
    swap_on || { echo "swap went off"; return 1; }
    echo "MainPID $before -> $after, job $(cat "$out")"
}

watchdog() {
    local pid
    mkdir -p /run/systemd/system/tmem.service.d
    printf '[Service]\nWatchdogSec=5s\nTimeoutAbortSec=5s\n' > /run/systemd/system/tmem.service.d/watchdog.conf
    systemctl daemon-reload
    systemctl restart tmem || return 1
    pid=$(main_pid)
    kill -STOP "$pid"
    until_ok 60 test "$(systemctl show -p Result --value tmem)" = watchdog || { echo "no watchdog result"; return 1; }
    # SIGABRT waits in the stopped process: let it die of it.
    kill -CONT "$pid"
    until_ok 30 eval '! kill -0 '"$pid"' 2>/dev/null' || { echo "pid $pid outlived its watchdog"; return 1; }
    rm /run/systemd/system/tmem.service.d/watchdog.conf
    systemctl daemon-reload
    systemctl reset-failed tmem
    systemctl start tmem || return 1
    [ "$(state)" = active ] && swap_on || { echo "not back: $(state)"; return 1; }
    echo "Result=watchdog; started again as pid $(main_pid)"
}

stop_clean() {
    local left
    systemctl stop tmem || return 1
    [ "$(state)" = inactive ] || { echo "state $(state)"; return 1; }
    pgrep -x tmem && { echo "a tmem process is left"; return 1; }
    swap_on && { echo "swap left: $(swapon --show)"; return 1; }
    [ -z "$(losetup -a)" ] || { echo "loop devices left: $(losetup -a)"; return 1; }
    grep -q tmem /proc/mounts && { echo "a mount is left: $(grep tmem /proc/mounts)"; return 1; }
    for z in /sys/block/zram*; do
        [ -e "$z" ] || continue
        [ "$(cat "$z/disksize")" = 0 ] || { echo "${z##*/} is still set up"; return 1; }
    done
    left=$(ls /run/tmem | grep -v -x -e daemon.lock -e daemon.log || true)
    [ -z "$left" ] || { echo "left in /run/tmem: $left"; return 1; }
    echo "nothing left; /run/tmem: $(ls /run/tmem | tr '\n' ' ')"
}

say "systemd $(systemctl --version | head -1 | cut -d' ' -f2), kernel $(uname -r), booted in $(cut -d' ' -f1 /proc/uptime) s"
check enable-now enable_now
check oom-score oom_score
check reload-under-job under_job reload
check restart-under-job under_job restart
check watchdog watchdog
check stop-clean stop_clean
if [ "${#failed[@]}" -eq 0 ]; then
    say PASS
else
    say "FAIL ${failed[*]}"
fi
