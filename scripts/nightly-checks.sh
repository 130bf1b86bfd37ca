#!/usr/bin/env bash
# The checks that need the nightly toolchain: Miri on the unsafe core, and
# the fuzz targets (type-checked; FUZZ_SECONDS=N builds and runs each for N
# s). scripts/test.sh runs this beside the test run, at nice 19: the tests
# mostly wait on the kernel, and these two only compile and interpret.
# Usage: scripts/nightly-checks.sh   (TMEM_REQUIRE as in scripts/test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

step() { echo "== $* (at ${SECONDS} s of the nightly checks)"; }
prune() {
    echo "disk: target $(du -sh target 2>/dev/null | cut -f1), free $(df -h --output=avail . | tail -1 | tr -d ' ')"
    if [ -n "${CI:-}" ]; then rm -rf "$@"; fi
}

# Miri checks the unsafe core (spans, allocator, grouped blocks) for
# undefined behaviour; it needs the nightly toolchain's miri component. The
# index (shard) has no unsafe code of its own.
step "Miri: tmem-core mem, alloc, group"
if rustup +nightly component list --installed 2>/dev/null | grep -q '^miri' \
    || rustup +nightly component add miri rust-src >/dev/null 2>&1; then
    cargo +nightly miri test -p tmem-core --lib -- mem:: alloc:: group::
elif [[ ",${TMEM_REQUIRE-}," == *",miri,"* || ",${TMEM_REQUIRE-}," == *",all,"* ]]; then
    echo "Miri is not available (rustup +nightly component add miri), but TMEM_REQUIRE requires it" >&2
    exit 1
else
    echo "SKIP: Miri is not available (rustup +nightly component add miri)"
fi
prune target/miri

# cargo-fuzz needs nightly flags; use the nightly toolchain where installed,
# otherwise let stable accept them.
step "fuzz targets (type-check; FUZZ_SECONDS=N builds and runs each for N s)"
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    FUZZ=(cargo +nightly fuzz)
else
    export RUSTC_BOOTSTRAP=1
    FUZZ=(cargo fuzz)
fi
# Both fuzz projects share one target directory, so dependencies build once.
# Without a run, a type-check (same flags, no code generation) is what CI
# needs to know: a build of the instrumented targets took 4 min of its time.
export CARGO_TARGET_DIR="$PWD/target/fuzz"
for dir in fuzz crates/tmem-nbd/fuzz; do
    if [ "${FUZZ_SECONDS:-0}" -gt 0 ]; then
        (cd "$dir" && "${FUZZ[@]}" build)
        for t in $(cd "$dir" && "${FUZZ[@]}" list); do
            (cd "$dir" && "${FUZZ[@]}" run "$t" -- -max_total_time="$FUZZ_SECONDS")
        done
    else
        (cd "$dir" && "${FUZZ[@]}" check)
    fi
done
prune target/fuzz
