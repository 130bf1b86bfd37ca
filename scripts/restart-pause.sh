#!/bin/bash
# How long `tmem swap restart` stops a swapping job (issue 26).
#
#   scripts/restart-pause.sh HEAP_MIB LIMIT_MIB MODES ROUNDS
#
# Brings swap up in its own runtime directory, runs a Python job with
# HEAP_MIB of text-like heap in a cgroup-v1 memory cgroup of LIMIT_MIB that
# reads its heap in 1 MiB chunks over and over, restarts the daemon ROUNDS
# times, each in the next of MODES (comma-separated, in turn: precopy: as a successor does by default; memfd: the index all in
# the pause, as one from before pre-copy would ask,
# TMEM_FAULT_HANDOVER_NO_PRECOPY; stream: as one from before zero-copy
# hand-over would ask, TMEM_FAULT_HANDOVER_STREAMED; both need a build with
# fault injection),
# prints each restart's step lines and /proc/meminfo around them, then the
# job's longest chunk read, and takes everything down. UP_FLAGS adds flags
# to `swap up` (e.g. UP_FLAGS="--fuse-uring 2"). Root; uses the release
# binary (cargo build --release -p tmem --features tmem-daemon/fault-injection).
set -u
heap=$1 limit=$2 modes=$3 rounds=$4
tmem=${TMEM:-$(dirname "$0")/../target/release/tmem}
rd=/run/tmem-restart-pause-$$
cg=/sys/fs/cgroup/memory/tmem-restart-pause-$$
work=$(mktemp -d)
job=""
cleanup() {
    touch "$work/stop"
    [ -n "$job" ] && wait "$job" 2>/dev/null
    "$tmem" swap down --runtime-dir "$rd" >/dev/null 2>&1
    # swap down leaves the lock and the log for a later swap up: this
    # directory has no later one.
    rm -rf "$rd"
    rmdir "$cg" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT
cat > "$work/job.py" <<'PY'
import os, random, sys, time
n, stop = int(sys.argv[1]), sys.argv[2]
words = [b"alpha ", b"beta ", b"gamma ", b"delta ", b"lorem ", b"ipsum ", b"tmem ", b"page "]
r = random.Random(1)
chunks = []
for _ in range(n):
    parts, size = [], 0
    while size < 1 << 20:
        w = words[r.randrange(8)] + str(r.randrange(100000)).encode() + b" "
        parts.append(w)
        size += len(w)
    chunks.append(bytearray(b"".join(parts)[: 1 << 20]))
print("READY", flush=True)
worst, passes = 0.0, 0
while not os.path.exists(stop):
    for c in chunks:
        t = time.monotonic()
        c[0] ^= 1
        sum(c[::4096])
        worst = max(worst, time.monotonic() - t)
    passes += 1
print("job: %d passes, longest 1 MiB chunk read %.1f ms" % (passes, worst * 1000), flush=True)
PY
# shellcheck disable=SC2086 # UP_FLAGS is a list of flags
"$tmem" swap up --runtime-dir "$rd" --size 8G --pool-limit 50% ${UP_FLAGS:-} > "$work/up.log" 2>&1 || { cat "$work/up.log"; exit 1; }
mkdir -p "$cg"
echo $((limit << 20)) > "$cg/memory.limit_in_bytes"
sh -c "echo \$\$ > $cg/cgroup.procs; exec python3 $work/job.py $heap $work/stop" > "$work/job.out" 2>&1 &
job=$!
until grep -q READY "$work/job.out"; do sleep 1; done
sleep 10
# CPU time so far: total and steal, in jiffies.
cpu() { awk '/^cpu /{t=0; for(i=2;i<=NF;i++) t+=$i; print t, $9}' /proc/stat; }
read -r cpu0 steal0 < <(cpu)
meminfo() { grep -E "^(MemAvailable|Mlocked|Shmem):" /proc/meminfo | tr -s ' ' | tr '\n' ' '; echo; }
IFS=, read -r -a mode_list <<< "$modes"
for round in $(seq 0 $((rounds - 1))); do
    mode=${mode_list[$((round % ${#mode_list[@]}))]}
    env=""
    [ "$mode" = stream ] && env="TMEM_FAULT_HANDOVER_STREAMED=1"
    [ "$mode" = memfd ] && env="TMEM_FAULT_HANDOVER_NO_PRECOPY=1"
    meminfo
    echo "restart $round ($mode):"
    env $env "$tmem" swap restart --runtime-dir "$rd" 2>&1 | grep -E "took over|mapped and locked"
    sleep 5
done
meminfo
touch "$work/stop"
wait "$job"
job=""
tail -1 "$work/job.out"
# Over io_uring: what each pause held and filled.
grep -h "FUSE over io_uring paused" "$rd/daemon.log" | sed 's/^/daemon log: /'
read -r cpu1 steal1 < <(cpu)
echo "CPU steal during the run: $(( (steal1 - steal0) * 1000 / (cpu1 - cpu0 + 1) / 10 )).$(( (steal1 - steal0) * 1000 / (cpu1 - cpu0 + 1) % 10 )) %"
