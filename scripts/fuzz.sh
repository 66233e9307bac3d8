#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 60), one after another, on the seed corpora in
# fuzz/corpus/ (new inputs the fuzzer finds are kept in fuzz/corpus-local/, not committed).
# Crashes land in fuzz/artifacts/<target>/; turn each into a regression test of the normal suite.
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`). The toolchain is stable: RUSTC_BOOTSTRAP=1 lets it
# take cargo-fuzz's nightly flags, and --sanitizer none avoids a sanitizer runtime stable lacks.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds="${1:-60}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(lsb_file hf_config gguf gguf_tokenizer)
fi
export RUSTC_BOOTSTRAP=1
for t in "${targets[@]}"; do
    mkdir -p "corpus-local/$t"
    echo "== $t: ${seconds}s"
    cargo fuzz run --sanitizer none "$t" "corpus-local/$t" "corpus/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=20 -print_final_stats=1 \
        2>&1 | tee "corpus-local/$t.log" | grep -E "^(#[0-9]+ +DONE|stat::|==|SUMMARY|.*panicked)" || true
    if grep -qE "panicked|ERROR: libFuzzer|SUMMARY" "corpus-local/$t.log"; then
        echo "!! $t found a crash: see fuzz/corpus-local/$t.log and fuzz/artifacts/$t/"
        exit 1
    fi
done
