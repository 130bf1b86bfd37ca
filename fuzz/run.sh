#!/usr/bin/env bash
# Builds every cargo-fuzz target of this project (tmem-core, tmem-ctl, tmem-uffd) and runs each for SECONDS
# (default 60). Needs a nightly toolchain and cargo-fuzz
# (`cargo install cargo-fuzz --locked`). Crashes are saved under
# fuzz/artifacts/TARGET/; re-run one with
#   cargo +nightly fuzz run TARGET fuzz/artifacts/TARGET/crash-...
set -euo pipefail

secs="${1:-60}"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

cargo +nightly fuzz build
status=0
for target in $(cargo +nightly fuzz list); do
    echo "=== $target: ${secs}s"
    if ! cargo +nightly fuzz run "$target" -- -max_total_time="$secs" -print_final_stats=1; then
        echo "=== $target: FAILED (see fuzz/artifacts/$target/)"
        status=1
    fi
done
exit "$status"
