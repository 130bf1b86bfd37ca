#!/usr/bin/env bash
# Boots a stock Debian kernel in QEMU (TCG, no KVM needed) with cgroup v2
# only, and runs tmem there: `tmem serve nbd` under the kernel's NBD client
# (nbd-client), then `tmem swap up` (FUSE + loop) without flags; each time a
# 150 MiB job under memory.max=64M must finish intact, and `tmem swap down`
# must leave nothing. See scripts/vm/init.sh for what runs inside.
#
# The kernel is Debian bookworm's linux-image-*-cloud-amd64 (apt-get
# download, dpkg -x; not installed). The initramfs is built on the fly:
# busybox-static, the tmem release binary, util-linux's swap and loop tools
# and nbd-client with the libraries they link, nbd.ko, fuse.ko and loop.ko.
#
# Usage: scripts/vm-test.sh      (root not needed; a few minutes)
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=target/vm-test
TIMEOUT=${VM_TIMEOUT:-600}
mkdir -p "$WORK"

need=()
for p in qemu-system-x86 busybox-static nbd-client cpio gcc python3; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ "${#need[@]}" -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# The kernel: the package the cloud-amd64 metapackage points at.
image=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/ {print $2; exit}')
[ -n "$image" ] || { echo "vm-test: no linux-image-cloud-amd64 in apt's lists"; exit 1; }
kdir="$WORK/$image"
if [ ! -d "$kdir/boot" ]; then
    rm -rf "$kdir"; mkdir -p "$kdir"
    (cd "$WORK" && apt-get download "$image" 2>&1 | grep -v unsandboxed || true)
    dpkg -x "$WORK/${image}"_*.deb "$kdir"
fi
vmlinuz=$(ls "$kdir"/boot/vmlinuz-*)
kver=${vmlinuz##*/vmlinuz-}

echo "== building tmem (release)"
cargo build --release -p tmem --quiet

echo "== initramfs"
root="$WORK/initramfs"
rm -rf "$root"
mkdir -p "$root"/{bin,dev,proc,sys,run,tmp,lib/modules,etc}
cp /bin/busybox "$root/bin/busybox"
gcc -O2 -static -o "$root/bin/hog" scripts/vm/hog.c
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
for p in nbd-client losetup mkswap swapon swapoff umount mount; do copy "$p"; done
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
for m in drivers/block/nbd drivers/block/loop fs/fuse/fuse; do
    cp "$kdir/lib/modules/$kver/kernel/$m.ko" "$root/lib/modules/"
done
echo "root:x:0:0:root:/:/bin/sh" > "$root/etc/passwd"
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$WORK/initrd.gz"

echo "== booting $kver (TCG, cgroup_no_v1=all), at most ${TIMEOUT} s"
log="$WORK/console.log"
start=$(date +%s)
timeout "$TIMEOUT" qemu-system-x86_64 -accel tcg -m 1024 -smp 2 -nographic -no-reboot \
    -kernel "$vmlinuz" -initrd "$WORK/initrd.gz" \
    -append "console=ttyS0 cgroup_no_v1=all panic=-1 loglevel=3" </dev/null >"$log" 2>&1 || true
echo "== $(($(date +%s) - start)) s"
grep -a "VM-TEST" "$log" | sed -e 's/\r$//' -e 's/.*VM-TEST/VM-TEST/' || true
if grep -aq "VM-TEST: PASS" "$log"; then
    echo "vm-test: PASS"
else
    echo "vm-test: FAIL (console log: $log)"; tail -n 60 "$log"
    exit 1
fi
