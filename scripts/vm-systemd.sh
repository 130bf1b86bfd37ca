#!/usr/bin/env bash
# Boots Debian 12 with systemd as PID 1 in QEMU (TCG, no KVM needed),
# cgroup v2 only, installs tmem's .deb there with dpkg -i and checks its
# unit under real systemd (scripts/vm/systemd-checks.sh): `systemctl enable
# --now tmem`, OOMScoreAdjust, `systemctl reload` and `systemctl restart`
# under a swapping checksum job (every page kept, a new main PID), the
# watchdog killing a SIGSTOPped daemon and the start after it, and
# `systemctl stop` leaving nothing behind.
#
# The guest:
#   kernel   Debian 12's linux-image-cloud-amd64, fetched and cached as
#            scripts/vm-test.sh does (scripts/vm/lib.sh), with its fuse,
#            loop and zram modules (and what they need) under
#            /lib/modules/<version> and a depmod index; systemd-modules-load
#            loads the three before tmem's unit starts;
#   userland bookworm by mmdebstrap (the Essential packages, systemd, udev,
#            kmod, util-linux, fuse3, fonts-dejavu-core, procps; no docs),
#            cached as a tarball under target/vm-systemd keyed on the package
#            list and options;
#   root     the whole root file system is the initramfs (systemd runs from
#            it as from a disk: there is no /etc/initrd-release);
#   /data    the .deb, the static checksum job (scripts/vm/hog.c) and the
#            checks, which a oneshot unit (scripts/vm/tmem-vm-checks.service)
#            runs after multi-user.target; they print "VM-SYSTEMD: ..." lines
#            on the serial console, then it powers off.
# The console log stays in target/vm-systemd/console-systemd.log.
#
# Usage: scripts/vm-systemd.sh               (root, for mmdebstrap and the guest's files; about
#                                             3.5 minutes, 35 s more for a first mmdebstrap)
#        VM_DEB=target/debian/tmem_....deb   (this package; default: build it with `cargo deb -p tmem`)
#        VM_TIMEOUT=900                      (seconds for the guest)
#        VM_CHECKS=enable-now,stop-clean     (only these checks, in their order: enable-now,
#                                             oom-score, stop-clean-with-front, start-without-front,
#                                             reload-under-job, restart-under-job, watchdog, stop-clean)
set -eEuo pipefail
shopt -s inherit_errexit
trap 'echo "vm-systemd: failed (line $LINENO, exit $?): $BASH_COMMAND" >&2' ERR
cd "$(dirname "$0")/.."

# A directory of its own (kernel cache included): scripts/test.sh runs
# this beside scripts/vm-test.sh, which cleans target/vm-test as it goes.
WORK=target/vm-systemd
# A passing guest takes about 3 minutes here; the limit is for one that hangs.
TIMEOUT=${VM_TIMEOUT:-900}
CHECKS=${VM_CHECKS:-}
MEMORY=1536
PACKAGES=systemd,systemd-sysv,udev,kmod,util-linux,fuse3,fonts-dejavu-core,procps
# essential: no apt in the guest (dpkg -i is all it needs). The merged-usr
# hook makes /bin, /lib... links into /usr itself, so that apt needs neither
# usrmerge nor the perl it pulls in.
MMDEBSTRAP=(--variant=essential --include="$PACKAGES"
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*'
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/lib/udev/hwdb.d/*')
if [ -d /usr/share/mmdebstrap/hooks/merged-usr ]; then
    MMDEBSTRAP+=(--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr)
fi
MIRROR=http://deb.debian.org/debian
mkdir -p "$WORK"
[ "$(id -u)" -eq 0 ] || { echo "vm-systemd: needs root (mmdebstrap, and files owned by root in the guest)" >&2; exit 2; }

# The host's packages (need_debs), the kernel (fetch_kernel) and its
# modules (stage_modules).
# shellcheck source=scripts/vm/lib.sh
source scripts/vm/lib.sh
need_debs qemu-system-x86 mmdebstrap cpio gcc kmod

root="$WORK/systemd-root"
initrd="$WORK/initrd-systemd.cpio"
log="$WORK/console-systemd.log"
qemu=""
# The QEMU started here (by pid: the `timeout` around it, which passes the
# signal on) and the staging files go, on success and failure alike; the
# caches and the console log stay.
cleanup() {
    if [ -n "$qemu" ]; then kill "$qemu" 2>/dev/null || true; wait "$qemu" 2>/dev/null || true; fi
    rm -rf "$root" "$initrd" "$WORK"/rootfs-bookworm-systemd-*.tar.tmp
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

deb=${VM_DEB:-}
if [ -z "$deb" ]; then
    echo "== the package (cargo deb -p tmem)"
    cargo deb -p tmem --quiet >/dev/null
    deb=$(ls -t target/debian/tmem_*.deb | head -1)
fi
[ -f "$deb" ] || { echo "vm-systemd: no package $deb" >&2; exit 2; }

t=$SECONDS
key=$(printf '%s\n' bookworm "$MIRROR" "${MMDEBSTRAP[@]}" | sha256sum | cut -c1-16)
tarball="$WORK/rootfs-bookworm-systemd-$key.tar"
if [ ! -s "$tarball" ]; then
    echo "== mmdebstrap bookworm ($PACKAGES) -> $tarball"
    rm -f "$WORK"/rootfs-bookworm-systemd-*.tar
    # Its hooks talk even with --quiet: the output is shown where it fails.
    mmdebstrap --quiet --format=tar "${MMDEBSTRAP[@]}" bookworm "$tarball.tmp" "$MIRROR" >"$WORK/mmdebstrap.log" 2>&1 \
        || { tail -n 40 "$WORK/mmdebstrap.log"; echo "vm-systemd: mmdebstrap failed (log: $WORK/mmdebstrap.log)" >&2; exit 1; }
    mv "$tarball.tmp" "$tarball"
    echo "== root file system: $((SECONDS - t)) s, $(du -h "$tarball" | cut -f1)"
else
    echo "== root file system: cached ($tarball, $(du -h "$tarball" | cut -f1))"
fi

kdir=$(fetch_kernel bookworm linux-image-cloud-amd64)
vmlinuz=$(ls "$kdir"/boot/vmlinuz-*)
kver=${vmlinuz##*/vmlinuz-}

t=$SECONDS
rm -rf "$root"; mkdir -p "$root"
tar -C "$root" -xf "$tarball"
# /lib is a link to usr/lib.
stage_modules "$kdir" "$kver" "$root/usr"
printf '%s\n' fuse loop zram > "$root/etc/modules-load.d/tmem-vm.conf"
mkdir -p "$root/data"
cp "$deb" "$root/data/"
gcc -O2 -static -o "$root/data/hog" scripts/vm/hog.c
install -m 0755 scripts/vm/systemd-checks.sh "$root/data/systemd-checks.sh"
install -m 0644 scripts/vm/tmem-vm-checks.service "$root/etc/systemd/system/"
ln -s /etc/systemd/system/tmem-vm-checks.service "$root/etc/systemd/system/multi-user.target.wants/"
# No login prompt on the console the checks print to.
ln -sf /dev/null "$root/etc/systemd/system/serial-getty@ttyS0.service"
echo tmem-vm > "$root/etc/hostname"
# Not a first boot (which would apply presets and may prompt on the console).
echo 0123456789abcdef0123456789abcdef > "$root/etc/machine-id"
# Uncompressed: the guest unpacks it faster than it would gunzip it.
(cd "$root" && find . | cpio -o -H newc --quiet) > "$initrd"
rm -rf "$root"
echo "== initramfs: $((SECONDS - t)) s, $(du -h "$initrd" | cut -f1)"

echo "== booting ${kdir##*/} ($kver) with systemd as PID 1 (TCG), at most $TIMEOUT s ($SECONDS s so far)"
rm -f "$log"
start=$SECONDS
timeout "$TIMEOUT" qemu-system-x86_64 -accel tcg,thread=single -m "$MEMORY" -smp 2 -nographic -no-reboot \
    -kernel "$vmlinuz" -initrd "$initrd" \
    -append "console=ttyS0 rdinit=/sbin/init systemd.unified_cgroup_hierarchy=1 panic=-1 loglevel=3 systemd.show_status=0${CHECKS:+ tmem_vm_checks=$CHECKS}" \
    </dev/null >"$log" 2>&1 &
qemu=$!
# The guest's lines as they come; a guest that printed its verdict but has
# not powered off a minute later is stopped.
lines() { { grep -a "VM-SYSTEMD: " "$log" || true; } | sed -e 's/\r$//' -e 's/.*VM-SYSTEMD: /VM-SYSTEMD: /'; }
shown=0 verdict=""
while kill -0 "$qemu" 2>/dev/null; do
    sleep 1
    now=$(lines)
    n=$(grep -c . <<<"$now" || true)
    if [ "$n" -gt "$shown" ]; then tail -n +"$((shown + 1))" <<<"$now"; shown=$n; fi
    if [ -z "$verdict" ] && grep -qE '^VM-SYSTEMD: (PASS|FAIL)' <<<"$now"; then verdict=$SECONDS; fi
    if [ -n "$verdict" ] && [ $((SECONDS - verdict)) -gt 60 ]; then
        echo "vm-systemd: the guest did not power off within 60 s of its last line: stopping it"
        kill "$qemu" 2>/dev/null || true
    fi
done
rc=0
wait "$qemu" || rc=$?
qemu=""
now=$(lines)
tail -n +"$((shown + 1))" <<<"$now" | grep . || true
echo "== guest: $((SECONDS - start)) s$([ "$rc" = 124 ] && echo ", timed out after $TIMEOUT s")"
rm -f "$initrd"
if grep -qx "VM-SYSTEMD: PASS" <<<"$now"; then
    echo "vm-systemd: PASS${CHECKS:+ (only $CHECKS)} ($SECONDS s in all)"
else
    echo "vm-systemd: FAIL (console log: $log)"
    # What the guest printed from the first failure on (the evidence), or
    # the end of the log where it printed no verdict.
    if grep -aq "VM-SYSTEMD: .*: FAIL" "$log"; then
        sed -n '/VM-SYSTEMD: .*: FAIL/,$p' "$log" | sed 's/\r$//' \
            | grep -avE 'VM-SYSTEMD: (checks took|PASS|FAIL)|reboot: Power down' | head -n 300 || true
    else
        tail -n 80 "$log"
    fi
    exit 1
fi
