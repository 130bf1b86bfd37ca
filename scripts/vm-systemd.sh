#!/usr/bin/env bash
# Boots Debian 12 with systemd as PID 1 in QEMU (TCG), cgroup v2 only,
# installs tmem's .deb there and checks its unit under real systemd
# (scripts/vm/systemd-checks.sh): `systemctl enable --now tmem`,
# OOMScoreAdjust, `systemctl reload` and `systemctl restart` under a
# swapping job (every page kept, a new main PID), the watchdog firing on a
# SIGSTOPped daemon, and `systemctl stop` leaving nothing behind.
#
# The guest: Debian 12's stock cloud kernel (fetched as scripts/vm-test.sh
# does) and a bookworm userland made by mmdebstrap (minbase, systemd,
# udev, kmod, util-linux, fuse3, procps), cached as a tarball under
# ~/.cache/tmem-vm keyed on its package list. The whole root file system
# is the initramfs (systemd runs from it as from a disk; no
# /etc/initrd-release), with the kernel's modules, the .deb, a static
# checksum job and a oneshot unit that runs the checks, prints them on the
# serial console and powers off.
#
# Usage: scripts/vm-systemd.sh        (root, for mmdebstrap; about 5 minutes)
#        VM_TIMEOUT=1200               (seconds for the guest)
set -eEuo pipefail
shopt -s inherit_errexit
trap 'echo "vm-systemd: failed (line $LINENO, exit $?): $BASH_COMMAND" >&2' ERR
cd "$(dirname "$0")/.."

WORK=target/vm-test
TIMEOUT=${VM_TIMEOUT:-1200}
MEMORY=1536
PACKAGES=systemd,systemd-sysv,udev,kmod,util-linux,fuse3,fonts-dejavu-core,procps
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/tmem-vm
mkdir -p "$WORK" "$CACHE"
[ "$(id -u)" -eq 0 ] || { echo "vm-systemd: needs root (mmdebstrap, and files owned by root in the guest)" >&2; exit 2; }

need=()
for p in qemu-system-x86 mmdebstrap cpio gcc kmod; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ "${#need[@]}" -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# shellcheck source=scripts/vm/lib.sh
source scripts/vm/lib.sh

root="$WORK/systemd-root"
log="$WORK/console-systemd.log"
qemu=""
# The QEMU started here (by pid: the `timeout` around it) and the staging
# files go, on success and failure alike; the caches and the log stay.
cleanup() {
    if [ -n "$qemu" ]; then kill "$qemu" 2>/dev/null || true; wait "$qemu" 2>/dev/null || true; fi
    rm -rf "$root" "$WORK/initrd-systemd.gz"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

echo "== the package (cargo deb -p tmem)"
cargo build --release -p tmem --quiet
cargo deb -p tmem --no-build --quiet >/dev/null
deb=$(ls -t target/debian/tmem_*.deb | head -1)

key=$(echo "bookworm minbase $PACKAGES" | sha256sum | cut -c1-16)
tarball="$CACHE/bookworm-systemd-$key.tar"
if [ ! -s "$tarball" ]; then
    echo "== mmdebstrap bookworm ($PACKAGES) -> $tarball"
    rm -f "$CACHE"/bookworm-systemd-*.tar
    mmdebstrap --quiet --format=tar --variant=minbase --include="$PACKAGES" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        bookworm "$tarball.tmp" http://deb.debian.org/debian
    mv "$tarball.tmp" "$tarball"
fi

kdir=$(fetch_kernel bookworm linux-image-cloud-amd64)
vmlinuz=$(ls "$kdir"/boot/vmlinuz-*)
kver=${vmlinuz##*/vmlinuz-}

echo "== root file system ($SECONDS s so far)"
rm -rf "$root"; mkdir -p "$root"
tar -C "$root" -xf "$tarball"
# Debian 12 merges /usr: /lib is a link to usr/lib.
stage_modules "$kdir" "$kver" "$root/usr"
printf '%s\n' fuse loop zram > "$root/etc/modules-load.d/tmem-vm.conf"
mkdir -p "$root/data"
cp "$deb" "$root/data/"
gcc -O2 -static -o "$root/data/hog" scripts/vm/hog.c
install -m 0755 scripts/vm/systemd-checks.sh "$root/data/checks.sh"
cat > "$root/etc/systemd/system/tmem-vm-checks.service" <<'EOF'
[Unit]
Description=tmem VM checks under systemd
After=multi-user.target
[Service]
Type=oneshot
TimeoutStartSec=infinity
ExecStart=/data/checks.sh
StandardOutput=tty
StandardError=tty
TTYPath=/dev/ttyS0
ExecStopPost=/bin/systemctl poweroff --force
[Install]
WantedBy=multi-user.target
EOF
ln -s /etc/systemd/system/tmem-vm-checks.service "$root/etc/systemd/system/multi-user.target.wants/"
# No login prompt on the console the checks print to.
ln -sf /dev/null "$root/etc/systemd/system/serial-getty@ttyS0.service"
echo tmem-vm > "$root/etc/hostname"
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$WORK/initrd-systemd.gz"
rm -rf "$root"

echo "== booting ${kdir##*/} ($kver) with systemd as PID 1 (TCG), at most $TIMEOUT s ($SECONDS s so far)"
start=$SECONDS
timeout "$TIMEOUT" qemu-system-x86_64 -accel tcg,thread=single -m "$MEMORY" -smp 2 -nographic -no-reboot \
    -kernel "$vmlinuz" -initrd "$WORK/initrd-systemd.gz" \
    -append "console=ttyS0 rdinit=/sbin/init systemd.unified_cgroup_hierarchy=1 panic=-1 loglevel=3 systemd.show_status=0" \
    </dev/null >"$log" 2>&1 &
qemu=$!
rc=0
wait "$qemu" || rc=$?
qemu=""
echo "== guest: $((SECONDS - start)) s$([ "$rc" = 124 ] && echo ", timed out")"
grep -a "VM-TEST" "$log" | sed -e 's/\r$//' -e 's/.*VM-TEST/VM-TEST/' || true
if grep -aq "VM-TEST: systemd: PASS" "$log"; then
    echo "vm-systemd: PASS ($SECONDS s in all)"
else
    echo "vm-systemd: FAIL (console log: $log)"; tail -n 80 "$log"
    exit 1
fi
