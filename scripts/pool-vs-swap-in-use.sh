#!/bin/bash
# What a swap backend's pool holds against the swap the kernel counts in use
# (docs/PRESSURE.md, "Why tmem's pool is larger than zram's"). Root; cgroup v1
# memory controller (this VM).
#
#   scripts/pool-vs-swap-in-use.sh zram|tmem [SIZE [COLD%]]
#
# A 512 MiB job in a 192 MiB memory cgroup fills 1 MiB chunks with text-like
# pages, rewrites one byte of every page of its hot part (100-COLD %) for
# 15 s, then hashes everything (the hash depends on the parity of the
# passes, which flip a bit). Every 100 ms: the pool (zram or tmem
# mem_used_total), the pages it stores, and the swap in use (/proc/swaps).
# zram: a device hot-added for the run; tmem: `tmem swap up --front none`
# in its own runtime directory ($TMEM, default target/release/tmem). All of
# it is undone on exit.
set -eu
mode=$1 size=${2:-8G} cold=${3:-75}
TMEM=${TMEM:-target/release/tmem}
D=/run/tmem-pool-vs-swap-$$ CG=/sys/fs/cgroup/memory/tmem-pool-vs-swap-$$
job=$(mktemp /tmp/pool-vs-swap-XXXXXX.py)
id=""
cleanup() {
    [ -n "${pid:-}" ] && kill "$pid" 2> /dev/null && wait "$pid" 2> /dev/null
    if [ "$mode" = tmem ]; then "$TMEM" swap down --runtime-dir "$D" > /dev/null 2>&1 || true; rm -rf "$D"; fi
    if [ -n "$id" ]; then swapoff "/dev/zram$id" 2> /dev/null || true; echo "$id" > /sys/class/zram-control/hot_remove; fi
    rmdir "$CG" 2> /dev/null || true
    rm -f "$job"
}
trap cleanup EXIT
cat > "$job" << 'PY'
import sys, time, random, hashlib
mib, cold, secs = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
random.seed(3)
words = [bytes(random.choice(b"abcdefghijklmnop") for _ in range(random.randint(2, 9))) for _ in range(200)]
def page(i):
    r = random.Random(i)
    return (b" ".join(r.choice(words) for _ in range(900)) * 2)[:4096]
chunks = [bytearray(b"".join(page(c * 256 + k) for k in range(256))) for c in range(mib)]
t0, n = time.time(), 0
while time.time() - t0 < secs:
    for c in range(mib * cold // 100, mib):
        b = chunks[c]
        for k in range(0, len(b), 4096):
            b[k] ^= 1
    n += 1
h = hashlib.sha256()
for c in chunks:
    h.update(c)
print("passes", n, h.hexdigest()[:16], flush=True)
PY
mkdir "$CG"
echo $((192 << 20)) > "$CG/memory.limit_in_bytes"
if [ "$mode" = tmem ]; then
    "$TMEM" swap up --runtime-dir "$D" --size "$size" --front none --pool-limit 4G > /dev/null
    sample() { "$TMEM" stat --runtime-dir "$D" --json | python3 -c "import json,sys; d=json.load(sys.stdin)[0]; print(d['store']['mem_used_total'], d['store']['total']['stored_pages'])"; }
    area=$(losetup --associated "$D/dev/swap0" --noheadings --output NAME)
else
    id=$(cat /sys/class/zram-control/hot_add)
    echo lz4 > "/sys/block/zram$id/comp_algorithm"
    echo "$size" > "/sys/block/zram$id/disksize"
    mkswap "/dev/zram$id" > /dev/null
    swapon -p 100 "/dev/zram$id"
    sample() { read -r a _ c _ < "/sys/block/zram$id/mm_stat"; echo "$c" $((a / 4096)); }
    area=/dev/zram$id
fi
sh -c "echo \$\$ > $CG/cgroup.procs; exec python3 $job 512 $cold 15" > "$job.out" &
pid=$!
peak=0 peak_pages=0 peak_used=0
while kill -0 "$pid" 2> /dev/null; do
    read -r mem pages < <(sample)
    used=$(awk -v a="$area" '$1 == a {print $4 * 1024}' /proc/swaps)
    [ "$mem" -gt "$peak" ] && peak=$mem
    [ "$pages" -gt "$peak_pages" ] && peak_pages=$pages
    [ "${used:-0}" -gt "$peak_used" ] && peak_used=$used
    sleep 0.1
done
wait "$pid"
pid=""
echo "$mode --size $size, cold $cold %: job $(cat "$job.out"); peak pool $((peak >> 20)) MiB, peak pages stored $peak_pages, peak swap in use $((peak_used >> 20)) MiB"
rm -f "$job.out"
