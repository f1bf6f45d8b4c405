#!/usr/bin/env bash
# Coverage-guided fuzzing on the stable toolchain: builds the libFuzzer
# targets with the instrumentation cargo-fuzz uses in its `--sanitizer none`
# mode (sancov inline 8-bit counters, PC table, compare tracing; no
# sanitizer: that part needs nightly), then runs each for SECONDS.
#
#   crates/fuzz/fuzz.sh [SECONDS] [TARGET...]     (default: 30, every target)
#
# Each run starts from the seed corpus in crates/fuzz/corpus/TARGET (read
# only) and writes new inputs to a scratch directory. A crash stops the run
# with a non-zero status; its input is kept in target/fuzz/artifacts/TARGET/
# and becomes a regression test once copied to
# crates/fuzz/regressions/TARGET/ (tests/corpus.rs runs those in every
# `cargo test`). Needs a C++ compiler (libFuzzer is built from source).
set -euo pipefail
cd "$(dirname "$0")/../.."

seconds="${1:-30}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(superblock checkpoint_image checkpoint_delta spill_table journal_records mount extent_pages)
fi

host="$(rustc -vV | sed -n 's/^host: //p')"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR_FUZZ:-target/fuzz}"
# --target keeps these flags off build scripts and proc macros.
export RUSTFLAGS="-Cpasses=sancov-module \
-Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares \
--cfg fuzzing -Cdebug-assertions -Coverflow-checks"
cargo build --release --locked -p iomapfs-fuzz --features libfuzzer --bins --target "$host"

status=0
for t in "${targets[@]}"; do
    bin="$CARGO_TARGET_DIR/$host/release/fuzz_$t"
    scratch="$(mktemp -d)"
    artifacts="$CARGO_TARGET_DIR/artifacts/$t"
    mkdir -p "$artifacts"
    log="$scratch/log"
    set +e
    "$bin" "$scratch" "crates/fuzz/corpus/$t" \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$artifacts/" -print_final_stats=1 >"$log" 2>&1
    rc=$?
    set -e
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" || true)
    cov=$( (grep -o 'cov: [0-9]*' "$log" || true) | tail -1 | sed 's/cov: //')
    echo "fuzz: $t: ${execs:-0} executions in ${seconds}s, coverage ${cov:-?} edges, exit $rc"
    if [ $rc -ne 0 ]; then
        tail -40 "$log"
        echo "fuzz: $t FAILED; the input is in $artifacts/ (copy it to crates/fuzz/regressions/$t/)"
        status=1
    fi
    rm -rf "$scratch"
done
exit $status
