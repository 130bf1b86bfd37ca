#!/usr/bin/env bash
# Boots two stock Debian kernels in QEMU (TCG, no KVM needed) with cgroup v2
# only, both at once, and runs the same checks on each: `tmem serve
# nbd` under the kernel's NBD client (nbd-client), then `tmem swap up` (FUSE
# + loop) without flags, then `tmem swap up --transport nbd` (the kernel's
# NBD client set up by tmem over netlink: two restarts under a job, a
# kill, zram in front of it, a cache over it); each time a job of 150 MiB (192 over NBD)
# under memory.max=64M must finish intact, and `tmem swap down` must leave
# nothing. Before those, a probe prints the kernel facts later tests
# depend on (zram writeback and idle age, nbd, ublk, zswap's shrinker,
# memory.zswap.max); on Debian 13 a missing one fails the run, on Debian 12
# it is only printed. See scripts/vm/init.sh for what runs inside.
#
# The kernels (apt-get download, dpkg -x; not installed):
#   bookworm  Debian 12, linux-image-cloud-amd64 (6.1), from the host's apt lists;
#   trixie    Debian 13, linux-image-amd64 (6.12), from apt lists of its own
#             under target/vm-test/apt-trixie (APT_CONFIG: the host's apt
#             configuration, sources and lists are neither read nor touched).
# Downloads are cached under target/vm-test/kernel-<suite>; the trixie lists
# are refreshed when a week old or when a download from them fails.
# The initramfs is built on the fly: busybox-static, the tmem release binary,
# util-linux's swap and loop tools, nbd-client and kmod with the libraries
# they link (one archive for both kernels), and per kernel its modules (nbd,
# loop, fuse, zram, ublk_drv, compressors, with what they depend on) under
# /lib/modules/<version> with a depmod index, for modprobe.
#
# Both kernels boot at once, each QEMU on one host thread (TCG
# thread=single, two vCPUs); VM_PARALLEL=0 boots them one after the other.
#
# Usage: scripts/vm-test.sh               (root not needed; about 6 minutes, more under load)
#        VM_KERNELS=trixie scripts/vm-test.sh   (one of them)
#        VM_TIMEOUT=900                   (seconds per kernel)
#        VM_PARALLEL=0                    (one kernel after the other)
#        VM_BENCH=scripts/vm/bench-fronts.sh VM_KERNELS=trixie VM_TIMEOUT=3600 scripts/vm-test.sh
#                                         (a measurement in the guest instead of the checks;
#                                          VM_FILES=... copied to /data, VM_MEMORY=MiB)
#        VM_DISK=MiB                      (a virtio disk of that size, ext2, mounted at
#                                          /var/tmp in the guest: the rows that swap to a
#                                          file or write back to one need it)
set -eEuo pipefail
shopt -s inherit_errexit
trap 'echo "vm-test: failed (line $LINENO, exit $?): $BASH_COMMAND" >&2' ERR
cd "$(dirname "$0")/.."

WORK=target/vm-test
# Per kernel. A passing guest takes 5 to 9.5 minutes here (2 CPUs, both at
# once, other builds running); the limit is for a guest that hangs.
TIMEOUT=${VM_TIMEOUT:-900}
KERNELS=${VM_KERNELS:-bookworm trixie}
PARALLEL=${VM_PARALLEL:-1}
# A measurement instead of the checks: this script runs in the guest after
# the probe (sourced, with the guest's modprobe), its output printed as
# "VM-TEST: bench:" lines; VM_FILES are copied to /data in the guest.
BENCH=${VM_BENCH:-}
FILES=${VM_FILES:-}
MEMORY=${VM_MEMORY:-1024}
DISK=${VM_DISK:-0}
mkdir -p "$WORK"
# Files of an older layout of this directory.
rm -rf "$WORK"/linux-image-* "$WORK/initramfs" "$WORK/initrd.gz" "$WORK/console.log"

# The host's packages (need_debs), kernels from apt (fetch_kernel) and
# their modules (modules_cpio).
# shellcheck source=scripts/vm/lib.sh
source scripts/vm/lib.sh
need_debs qemu-system-x86 busybox-static nbd-client cpio gcc python3 kmod

declare -A QEMU=()
# Cleanup, on success and failure alike: the QEMU started here (by pid: the
# `timeout` around it, which passes the signal on) and the staging files.
# The kernel cache, the apt lists and the console logs stay.
cleanup() {
    local pid
    for pid in "${QEMU[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
    rm -rf "$WORK/initramfs" "$WORK"/modules-* "$WORK"/*.cpio.gz "$WORK"/initrd-*.gz "$WORK"/disk-*.img
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

echo "== building tmem (release)"
cargo build --release -p tmem --quiet
# The block conformance suite through the kernel, run on each transport.
cargo build --release -p tmem-block --example node_conformance --quiet

echo "== initramfs (common part; $SECONDS s so far)"
root="$WORK/initramfs"
rm -rf "$root"
mkdir -p "$root"/{bin,sbin,dev,proc,sys,run,tmp,lib/modules,etc}
cp /bin/busybox "$root/bin/busybox"
gcc -O2 -static -o "$root/bin/hog" scripts/vm/hog.c
gcc -O2 -static -o "$root/bin/coldhog" scripts/vm/coldhog.c
install -m 0644 scripts/vm/fronts.sh "$root/fronts.sh"
install -m 0644 scripts/vm/transports.sh "$root/transports.sh"
install -m 0755 scripts/vm/init.sh "$root/init"
# The libraries a program or library links (none for a static one).
libs_of() { { ldd "$1" 2>/dev/null || true; } | { grep -o '/[^ ]*' || true; }; }
# Copies files to the same paths under the initramfs.
put() { for f in "$@"; do mkdir -p "$root$(dirname "$f")"; cp -Ln "$f" "$root$f"; done; }
# A program and every library it links, at the same paths.
copy() {
    local bin; bin=$(command -v "$1" || echo "$1")
    mkdir -p "$root$(dirname "$bin")"
    cp -L "$bin" "$root$bin"
    # shellcheck disable=SC2046
    put $(libs_of "$bin")
}
mkdir -p "$root/usr/local/bin"
cp target/release/tmem "$root/usr/local/bin/tmem"
# shellcheck disable=SC2046
put $(libs_of target/release/tmem)
cp target/release/examples/node_conformance "$root/bin/node-conformance"
# shellcheck disable=SC2046
put $(libs_of target/release/examples/node_conformance)
for p in nbd-client losetup mkswap swapon swapoff umount mount; do copy "$p"; done
# kmod's modprobe (busybox's knows neither compressed nor built-in modules),
# also where the kernel runs it to load a module on demand (/sbin/modprobe).
copy kmod
kmod=$(command -v kmod)
mkdir -p "$root/usr/sbin"
for t in modprobe insmod rmmod lsmod modinfo; do ln -sf "$kmod" "$root/usr/sbin/$t"; done
ln -sf "$kmod" "$root/sbin/modprobe"
# Python and the standard library, for the pressure bench's workload.
py=$(readlink -f /usr/bin/python3)
copy "$py"
ln -sf "$py" "$root/usr/bin/python3"
pylib=$(/usr/bin/python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
mkdir -p "$root$pylib"
tar -C "$pylib" --exclude=test --exclude=idlelib --exclude=tkinter --exclude=ensurepip --exclude=lib2to3 \
    --exclude=pydoc_data --exclude='config-*' --exclude=__pycache__ --exclude=site-packages -cf - . | tar -C "$root$pylib" -xf -
for so in "$root$pylib"/lib-dynload/*.so; do
    # shellcheck disable=SC2046
    put $(libs_of "$so")
done
echo "root:x:0:0:root:/:/bin/sh" > "$root/etc/passwd"
if [ -n "$BENCH" ]; then
    cp "$BENCH" "$root/bench.sh"
    mkdir -p "$root/data"
    # shellcheck disable=SC2086
    [ -z "$FILES" ] || cp $FILES "$root/data/"
fi
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$WORK/common.cpio.gz"
rm -rf "$root"

# Starts QEMU on one kernel, in the background (so that a signal to this
# script reaches the trap, and so the kill of QEMU, at once), to run
# scripts/vm/init.sh there.
#   start_vm SUITE KDIR PROBE_MODE
declare -A START=() KVER=()
start_vm() {
    local suite=$1 kdir=$2 probe=$3 smokes=$4 vmlinuz kver release
    case "$suite" in bookworm) release="Debian 12" ;; trixie) release="Debian 13" ;; esac
    vmlinuz=$(ls "$kdir"/boot/vmlinuz-*)
    kver=${vmlinuz##*/vmlinuz-}
    modules_cpio "$kdir" "$kver" "$WORK/modules-$suite.cpio.gz"
    cat "$WORK/common.cpio.gz" "$WORK/modules-$suite.cpio.gz" > "$WORK/initrd-$suite.gz"
    rm -f "$WORK/modules-$suite.cpio.gz"
    echo "== $suite ($release): booting ${kdir##*/} ($kver; TCG, cgroup_no_v1=all, probe: $probe, smokes: $smokes), at most ${TIMEOUT} s"
    local k v config=""
    for k in ZRAM ZRAM_WRITEBACK ZRAM_MEMORY_TRACKING ZRAM_TRACK_ENTRY_ACTIME ZSWAP BLK_DEV_NBD BLK_DEV_UBLK; do
        v=$(sed -n "s/^CONFIG_$k=//p" "$kdir"/boot/config-*)
        config+=" $k=${v:-n}"
    done
    echo "   config:$config"
    START[$suite]=$(date +%s)
    KVER[$suite]=$kver
    # A disk for the guest (VM_DISK): a sparse file, read and written past
    # the host's page cache (cache=none), formatted in the guest.
    local disk=()
    if [ "$DISK" != 0 ]; then
        rm -f "$WORK/disk-$suite.img"
        truncate -s "${DISK}M" "$WORK/disk-$suite.img"
        disk=(-drive "file=$WORK/disk-$suite.img,if=virtio,format=raw,cache=none")
    fi
    # thread=single: both vCPUs on one host thread. With a thread each
    # (MTTCG) every cmpxchg16b of the guest's allocator stops all vCPUs;
    # measured here with both guests at once, single took 265 and 284 CPU
    # seconds, MTTCG 384 and 383, and a 6.12 guest double-faulted once in
    # kmem_cache_alloc under MTTCG.
    timeout "$TIMEOUT" qemu-system-x86_64 -accel tcg,thread=single -m "$MEMORY" -smp 2 -nographic -no-reboot \
        "${disk[@]}" -kernel "$vmlinuz" -initrd "$WORK/initrd-$suite.gz" \
        -append "console=ttyS0 cgroup_no_v1=all panic=-1 loglevel=3 tmem_vm_probe=$probe tmem_vm_smokes=$smokes" \
        </dev/null >"$WORK/console-$suite.log" 2>&1 &
    QEMU[$suite]=$!
}

# Waits for one of the QEMUs started to end, and prints its VM-TEST lines;
# adds its suite to `failed` if it did not pass.
failed=()
finish_vm() {
    local pid rc=0 suite s log
    wait -n -p pid "${QEMU[@]}" || rc=$?
    for s in "${!QEMU[@]}"; do [ "${QEMU[$s]}" = "$pid" ] && suite=$s; done
    unset "QEMU[$suite]"
    rm -f "$WORK/initrd-$suite.gz" "$WORK/disk-$suite.img"
    log="$WORK/console-$suite.log"
    echo "== $suite (${KVER[$suite]}): $(($(date +%s) - START[$suite])) s$([ "$rc" = 124 ] && echo ", timed out")"
    grep -a "VM-TEST" "$log" | sed -e 's/\r$//' -e 's/.*VM-TEST/VM-TEST/' || true
    if grep -aq "VM-TEST: PASS" "$log"; then
        echo "vm-test: $suite (${KVER[$suite]}): PASS"
    else
        echo "vm-test: $suite (${KVER[$suite]}): FAIL (console log: $log)"; tail -n 60 "$log"
        failed+=("$suite")
    fi
}

declare -A KDIR=() PROBE=()
for suite in $KERNELS; do
    case "$suite" in
        bookworm) KDIR[$suite]=$(fetch_kernel bookworm linux-image-cloud-amd64); PROBE[$suite]=report ;;
        trixie) KDIR[$suite]=$(fetch_kernel trixie linux-image-amd64); PROBE[$suite]=require ;;
        *) echo "vm-test: unknown kernel '$suite' (VM_KERNELS: bookworm, trixie)"; exit 2 ;;
    esac
done
# Both at once by default: each QEMU keeps one host CPU busy (thread=single).
begin=$(date +%s)
# The first kernel's guest also runs the kernel-independent checks (init.sh).
smokes=1
for suite in $KERNELS; do
    start_vm "$suite" "${KDIR[$suite]}" "${PROBE[$suite]}" "$smokes"
    smokes=0
    [ "$PARALLEL" = 1 ] || finish_vm
done
while [ "${#QEMU[@]}" -gt 0 ]; do finish_vm; done
rm -f "$WORK/common.cpio.gz"
echo "== $(($(date +%s) - begin)) s for $KERNELS ($([ "$PARALLEL" = 1 ] && echo "at once" || echo "one after the other")), $SECONDS s in all"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "vm-test: FAIL on ${failed[*]}"
    exit 1
fi
echo "vm-test: PASS ($KERNELS)"
