#!/bin/sh
# Regenerate the built-in corpora crates/tmem-corpus/builtin/{python,java,cc,redis}.tcorp.
#
# 1. Capture 64 MiB of each program into $LARGE (default /var/tmp/tmem-corpus,
#    plain format; these larger captures are for benchmarks, not the repo),
#    using `tmem corpus capture` if the tmem CLI provides it, else the
#    tmem-corpus `capture` example.
# 2. Take a deterministic 512-page sample of each and write it zstd -19
#    compressed into this directory (example: `capture builtin --from`).
#
# Needs root (to read /proc/PID/mem of the spawned programs' children), and
# python3, a JDK (java + javac), gcc and redis-server.
# Usage: crates/tmem-corpus/builtin/regenerate.sh [MAX_BYTES]   (default 64M)
set -eu

MAX=${1:-64M}
LARGE=${LARGE:-/var/tmp/tmem-corpus}
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$ROOT"
mkdir -p "$LARGE"

cargo build --release -p tmem-corpus --example capture
EXAMPLE="$ROOT/target/release/examples/capture"

if cargo build --release -p tmem >/dev/null 2>&1 &&
    "$ROOT/target/release/tmem" corpus capture --help >/dev/null 2>&1; then
    for p in python java cc redis; do
        "$ROOT/target/release/tmem" corpus capture --spawn "$p" --max-bytes "$MAX" \
            --no-compress -o "$LARGE/$p.tcorp"
    done
else
    echo "tmem corpus capture not available; using the tmem-corpus capture example" >&2
    for p in python java cc redis; do
        "$EXAMPLE" --spawn "$p" --max-bytes "$MAX" --no-compress -o "$LARGE/$p.tcorp"
    done
fi

"$EXAMPLE" builtin --from "$LARGE"
"$EXAMPLE" stats "$ROOT"/crates/tmem-corpus/builtin/*.tcorp
