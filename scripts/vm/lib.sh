# Shared by scripts/vm-test.sh and scripts/vm-systemd.sh (sourced, with
# WORK set): the host's packages they need, stock Debian kernels from apt,
# unpacked and cached under $WORK/kernel-<suite>, and the modules a guest
# needs.

# Installs those of the Debian packages named that are missing (apt-get, as
# root or with sudo).
#   need_debs PACKAGE...
need_debs() {
    local p need=() SUDO=""
    for p in "$@"; do
        dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
    done
    if [ "${#need[@]}" -gt 0 ]; then
        [ "$(id -u)" -ne 0 ] && SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    fi
}

# apt for Debian 13: a configuration of its own (APT_CONFIG is read before
# anything else; Dir::Etc::main and ::parts then keep the host's out).
APTDIR="$PWD/$WORK/apt-trixie"
trixie_apt() {
    mkdir -p "$APTDIR"/{sources.list.d,conf.d,lists/partial,cache/archives/partial}
    touch "$APTDIR/status"
    cat > "$APTDIR/sources.list.d/trixie.sources" <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie trixie-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: trixie-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    cat > "$APTDIR/apt.conf" <<EOF
Dir::Etc::main "/dev/null";
Dir::Etc::parts "$APTDIR/conf.d";
Dir::Etc::sourcelist "/dev/null";
Dir::Etc::sourceparts "$APTDIR/sources.list.d";
Dir::Etc::preferences "/dev/null";
Dir::Etc::preferencesparts "$APTDIR/conf.d";
Dir::State "$APTDIR";
Dir::State::Lists "$APTDIR/lists";
Dir::State::status "$APTDIR/status";
Dir::Cache "$APTDIR/cache";
Debug::NoLocking "$([ "$(id -u)" -ne 0 ] && echo true || echo false)";
APT::Architecture "amd64";
APT::Architectures { "amd64"; };
Acquire::Languages "none";
Acquire::GzipIndexes "true";
Acquire::Retries "3";
EOF
}
apt_trixie() { APT_CONFIG="$APTDIR/apt.conf" "$@"; }
trixie_update() {
    echo "== apt-get update (trixie, lists in $APTDIR/lists)"
    apt_trixie apt-get update -qq 2>&1 | { grep -v unsandboxed || true; }
}

# The module directory of an unpacked kernel package: lib/modules/<version>
# (Debian 12) or usr/lib/modules/<version> (Debian 13).
moddir() {
    local d
    for d in "$1"/lib/modules/* "$1"/usr/lib/modules/*; do
        if [ -d "$d" ]; then echo "$d"; return; fi
    done
    echo "vm-test: no modules in $1" >&2; return 1
}

# Fetches a kernel package (cached) and prints its unpacked directory.
#   fetch_kernel SUITE METAPACKAGE
fetch_kernel() {
    local suite=$1 meta=$2 apt=() image cache kdir
    if [ "$suite" = trixie ]; then
        apt=(apt_trixie)
        trixie_apt
        if ! ls "$APTDIR"/lists/*_Packages* >/dev/null 2>&1 \
            || [ -n "$(find "$APTDIR/lists" -maxdepth 1 -name '*InRelease' -mtime +6)" ]; then
            trixie_update >&2
        fi
    fi
    # The package the metapackage points at.
    image=$("${apt[@]}" apt-cache depends "$meta" 2>/dev/null | awk '/Depends: linux-image-/ {print $2; exit}')
    [ -n "$image" ] || { echo "vm-test: no $meta in apt's lists ($suite)" >&2; return 1; }
    cache="$WORK/kernel-$suite"
    kdir="$cache/$image"
    if [ ! -e "$kdir/.unpacked" ]; then
        rm -rf "$kdir"; mkdir -p "$kdir"
        if ! ls "$cache/${image}"_*.deb >/dev/null 2>&1; then
            echo "== apt-get download $image ($suite)" >&2
            # A week-old list may name a version the mirror no longer has.
            (cd "$cache" && "${apt[@]}" apt-get download -q "$image" 2>&1 | { grep -v unsandboxed || true; }) >&2
            if ! ls "$cache/${image}"_*.deb >/dev/null 2>&1 && [ "$suite" = trixie ]; then
                trixie_update >&2
                image=$(apt_trixie apt-cache depends "$meta" | awk '/Depends: linux-image-/ {print $2; exit}')
                kdir="$cache/$image"; mkdir -p "$kdir"
                (cd "$cache" && apt_trixie apt-get download -q "$image" 2>&1 | { grep -v unsandboxed || true; }) >&2
            fi
        fi
        dpkg -x "$cache/${image}"_*.deb "$kdir"
        # The package has no module index (its postinst makes one): make one
        # here, for the dependencies of the modules the guest needs.
        local mods; mods=$(moddir "$kdir")
        depmod -b "${mods%/lib/modules/*}" "${mods##*/}"
        touch "$kdir/.unpacked"
        # Older kernels of this suite.
        find "$cache" -mindepth 1 -maxdepth 1 ! -name "${image}" ! -name "${image}_*.deb" -exec rm -rf {} +
    fi
    echo "$kdir"
}

# The modules a guest loads, with their dependencies, for one kernel, under
# DEST/lib/modules/KVER with a depmod index.
#   stage_modules KDIR KVER DEST
stage_modules() {
    local kdir=$1 kver=$2 stage=$3 src base m f rel deps
    src=$(moddir "$kdir")
    [ "${src##*/}" = "$kver" ] || { echo "vm-test: modules of ${src##*/}, not $kver, in $kdir" >&2; return 1; }
    # Absolute, as the paths modprobe prints.
    base=$(realpath "${src%/lib/modules/*}")
    mkdir -p "$stage/lib/modules/$kver"
    cp "$src"/modules.{builtin,builtin.modinfo,order} "$stage/lib/modules/$kver/"
    # ublk_drv is not in every kernel (Debian 12's cloud kernel has none):
    # the guest's probe reports it. virtio_blk and ext4 mount VM_DISK.
    for m in nbd loop fuse zram ublk_drv zstd lz4 lz4hc lzo lzo-rle virtio_blk ext4; do
        deps=$(modprobe -C /dev/null -d "$base" -S "$kver" --show-depends "$m" 2>&1) \
            || { echo "   ($m: $deps)"; continue; }
        for f in $(awk '$1 == "insmod" {print $2}' <<<"$deps"); do
            rel=${f#"$base"/}
            [ "$rel" != "$f" ] || { echo "vm-test: $f is not under $base" >&2; return 1; }
            mkdir -p "$(dirname "$stage/$rel")"
            cp "$f" "$stage/$rel"
        done
    done
    depmod -b "$stage" "$kver"
}

# The same as a second archive, appended to a guest's initramfs (the
# kernel unpacks both).
#   modules_cpio KDIR KVER OUT
modules_cpio() {
    local stage="$WORK/modules-$2"
    rm -rf "$stage"; mkdir -p "$stage"
    stage_modules "$1" "$2" "$stage"
    (cd "$stage" && find . | cpio -o -H newc --quiet | gzip -1) > "$3"
    rm -rf "$stage"
}
