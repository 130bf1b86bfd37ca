#!/usr/bin/env bash
# Installs what the tests need (Debian/Ubuntu, as root or with sudo) and runs them all.
# Usage: scripts/test.sh            # install + fmt + clippy + tests (Miri and fuzz type-check beside them) + smoke bench
#        FUZZ_SECONDS=60 scripts/test.sh   # build each fuzz target and run it for that long
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

# What the run leaves behind, removed however it ends.
TMP_FILES=() TMP_DIRS=()
NIGHTLY_PGID=""
cleanup() {
    if [ -n "$NIGHTLY_PGID" ]; then kill -- "-$NIGHTLY_PGID" 2>/dev/null || true; fi
    rm -f "${TMP_FILES[@]}"
    rm -rf "${TMP_DIRS[@]}"
}
trap cleanup EXIT

# Debian packages: real programs for corpus capture (python3, java, gcc, redis),
# the kernel tools the tests drive, systemd-analyze and promtool.
PKGS=(python3 default-jdk-headless gcc redis-server util-linux iproute2 e2fsprogs qemu-utils qemu-system-x86 libnbd-bin fuse3 systemd prometheus fonts-dejavu-core busybox-static nbd-client cpio mmdebstrap kmod libclang-dev)
missing=()
for p in "${PKGS[@]}"; do
    # "install ok installed": a removed package whose configuration files
    # remain is known to dpkg -s, but not installed.
    [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "== apt-get install ${missing[*]}"
    $SUDO apt-get update -qq
    # A machine whose qemu-utils came from backports (qemu-img 10 on Debian
    # 12) cannot take the suite's own qemu-system-x86, which wants the
    # same version of qemu-system-common: take it from backports too, with
    # the suite added in private lists (the machine's sources stay as
    # they are).
    qemu_utils="$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null || true)"
    if [[ "$qemu_utils" == *~bpo* ]] && [ "$(dpkg-query -W -f='${Status}' qemu-system-x86 2>/dev/null)" != "install ok installed" ]; then
        . /etc/os-release
        BPO="$(mktemp -d)"
        TMP_DIRS+=("$BPO")
        mkdir -p "$BPO/sources" "$BPO/lists/partial"
        chmod -R a+rX "$BPO" # apt downloads as _apt
        cp /etc/apt/sources.list.d/*.sources "$BPO/sources/" 2>/dev/null || true
        printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: %s-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
            "$VERSION_CODENAME" > "$BPO/sources/backports.sources"
        BPO_APT=(-o "Dir::Etc::sourceparts=$BPO/sources" -o "Dir::State::Lists=$BPO/lists")
        $SUDO apt-get "${BPO_APT[@]}" update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get "${BPO_APT[@]}" -t "$VERSION_CODENAME-backports" \
            install -y -qq --no-install-recommends qemu-system-x86 >/dev/null
    fi
    # The whole list, not only what is missing: a package installed now may
    # need a newer version of one already there (qemu-system-x86 of
    # qemu-utils), and apt removes a package it was not asked to keep.
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${PKGS[@]}" >/dev/null
fi

# Cargo tools.
command -v cargo-nextest >/dev/null || cargo install cargo-nextest --locked
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
command -v cargo-deb >/dev/null || cargo install cargo-deb --locked

# CI builds from a clean checkout on a disk of unknown size: no incremental
# caches there, and each stage's build directory goes once nothing later
# needs it (prune), so the peak is one stage's build, not their sum.
if [ -n "${CI:-}" ]; then export CARGO_INCREMENTAL=0; fi
disk() { echo "disk: target $(du -sh target 2>/dev/null | cut -f1), free $(df -h --output=avail . | tail -1 | tr -d ' ')"; }
prune() {
    disk
    if [ -n "${CI:-}" ]; then rm -rf "$@"; fi
}

# Each step's header says how long the run has taken so far.
step() { echo "== $* (at ${SECONDS} s)"; }

step "cargo fmt --check"
cargo fmt --all --check
# clippy first: the test build after it reuses the proc macros and build
# scripts it compiled. (Beside the tests, at nice 19 in a directory of its
# own, it made the run longer: the test build alone then took 858 s from
# clean, against about 480 s after clippy, in CI rehearsal 19.)
step "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo nextest (build)"
# Tests that need root, a kernel feature or a tool skip with "SKIP: ..." where
# it is missing (tmem-testkit); CI has all of these, so there a skip fails the
# run instead of hiding a test. Override with e.g. TMEM_REQUIRE= (none) or
# TMEM_REQUIRE=tools on a machine that lacks some.
export TMEM_REQUIRE="${TMEM_REQUIRE-root,fuse,fuse-uring,loop,swap,zram,memcg,tools,miri,userfaultfd}"
cargo nextest run --workspace --no-run

# Miri and the fuzz targets beside the test run, at nice 19 in a session of
# their own (killed with it if this script ends first). The run mostly waits
# on the kernel; compiling beside the test *build* instead cost more than it
# hid (CI rehearsal 19: 858 s for the test build).
NIGHTLY_LOG="$(mktemp)"
TMP_FILES+=("$NIGHTLY_LOG")
setsid nice -n 19 scripts/nightly-checks.sh > "$NIGHTLY_LOG" 2>&1 &
NIGHTLY_PGID=$!

step "cargo nextest (run; Miri and the fuzz targets beside it)"
NEXTEST_LOG="$(mktemp)"
TMP_FILES+=("$NEXTEST_LOG")
cargo nextest run --workspace --no-fail-fast 2>&1 | tee "$NEXTEST_LOG"

step "doc tests"
cargo test --workspace --doc

prune target/debug

nightly_rc=0
wait "$NIGHTLY_PGID" || nightly_rc=$?
NIGHTLY_PGID=""
step "Miri and the fuzz targets (scripts/nightly-checks.sh), their output"
cat "$NIGHTLY_LOG"
[ "$nightly_rc" = 0 ] || { echo "scripts/nightly-checks.sh failed (exit $nightly_rc)" >&2; exit 1; }

# The Debian package: built (release), installed into a scratch root with
# its own dpkg database, run, and removed again.
step "Debian package (cargo deb -p tmem)"
cargo deb -p tmem
DEB="$(ls -t target/debian/tmem_*.deb | head -1)"
DEBROOT="$(mktemp -d)"
TMP_DIRS+=("$DEBROOT")
mkdir -p "$DEBROOT/var/lib/dpkg/updates" "$DEBROOT/var/lib/dpkg/info"
touch "$DEBROOT/var/lib/dpkg/status"
# The scratch root has none of the package's dependencies (libc, util-linux, fuse3).
dpkg --root="$DEBROOT" --force-depends --force-not-root -i "$DEB" >/dev/null
for f in usr/bin/tmem lib/systemd/system/tmem.service etc/tmem/tmem.toml usr/share/doc/tmem/README.md; do
    test -f "$DEBROOT/$f" || { echo "the package lacks /$f" >&2; exit 1; }
done
"$DEBROOT/usr/bin/tmem" --version
dpkg --root="$DEBROOT" --force-not-root -r tmem >/dev/null
test ! -e "$DEBROOT/usr/bin/tmem" || { echo "dpkg -r left /usr/bin/tmem" >&2; exit 1; }

# The README's main command and the other benches at smoke size, on the
# release build the package step made (on the test build, whose own crates
# are at opt-level 1, the store bench alone took 155 s).
step "smoke: tmem bench store (built-in corpus, 1 round; lz4, zstd:3+dict and recompression beside zram lz4)"
cargo run --release -q -p tmem -- bench store --rounds 1 --mix-only --codecs 'lz4,zstd:3+dict,lz4>zstd:1+dict' --zram lz4
step "smoke: tmem bench cache (48 MiB SQLite database on ext4, job at 50%)"; cargo run --release -q -p tmem -- bench cache --db-mib 48 --levels 50 --queries 100000 --json /tmp/cache.json
step "smoke: tmem bench tier (2000 pages; mem, three Redis servers, a three-master Redis Cluster)"
cargo run --release -q -p tmem -- bench tier --tiers mem,remote,remote-cluster --pages 2000 --latency-samples 200
step "smoke: tmem bench fault (32 MiB paged out and touched; zram, fuse-ram, tmem, tmem-run)"
cargo run --release -q -p tmem -- bench fault --mib 32 --backends zram,fuse-ram,tmem,tmem-run
step "smoke: tmem bench pressure --cold-share 50 (128 MiB at 50%; the front rows run in the VM test, where zram has writeback)"
cargo run --release -q -p tmem -- bench pressure --workload-mib 128 --levels 50 --runs 1 --passes 1 --cold-share 50 \
    --backends zram,tmem --allow-other-swap

# Stock Debian kernels in QEMU (TCG), cgroup v2 only: the transports, the
# fronts, tmem swap up, the pressure bench (reuses the release build of the
# package above). At the same time, Debian 12 with systemd as PID 1: the
# package's unit (enable, reload and restart under a swapping job, the
# watchdog, stop). Its root file system is built while the other guests
# run; its output follows theirs.
step "VM tests (scripts/vm-test.sh, and scripts/vm-systemd.sh beside it)"
SYSTEMD_LOG="$(mktemp)"
TMP_FILES+=("$SYSTEMD_LOG")
$SUDO env VM_DEB="$DEB" scripts/vm-systemd.sh > "$SYSTEMD_LOG" 2>&1 &
systemd_pid=$!
vm_rc=0
scripts/vm-test.sh || vm_rc=$?
systemd_rc=0
wait "$systemd_pid" || systemd_rc=$?
step "VM test under systemd (scripts/vm-systemd.sh), its output"
cat "$SYSTEMD_LOG"
[ "$vm_rc" = 0 ] || { echo "scripts/vm-test.sh failed (exit $vm_rc)" >&2; exit 1; }
[ "$systemd_rc" = 0 ] || { echo "scripts/vm-systemd.sh failed (exit $systemd_rc)" >&2; exit 1; }
disk

# One closing line for whoever reads the end of the log.
summary="$(grep -E '^ +Summary .* tests? run:' "$NEXTEST_LOG" | tail -1)"
passed="$(sed -nE 's/.* ([0-9]+) passed.*/\1/p' <<<"$summary")"
skipped="$(sed -nE 's/.* ([0-9]+) skipped.*/\1/p' <<<"$summary")"
echo "tests: ${passed:-0} passed, 0 failed, ${skipped:-0} skipped; the whole run took ${SECONDS} s"
