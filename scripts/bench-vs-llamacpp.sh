#!/usr/bin/env bash
# Dense decode tokens/s of leanstream and llama.cpp on the same GGUF file, thread count and prompt,
# greedy. Runs alternate (leanstream, llama.cpp, leanstream, ...) so that load from other processes
# hits both alike; the median of each and their ratio are reported.
#
# usage: scripts/bench-vs-llamacpp.sh [MODEL.gguf] [TOKENS=128] [ROUNDS=5] [THREADS="1 2"]
# MODEL defaults to SmolLM2-135M-Instruct Q4_1 (scripts/fetch-smollm2.sh). llama.cpp comes from
# PyPI's llama-cpp-python, whose install builds it (about 10 minutes here); installed if missing.
# LEANSTREAM_MODEL=FILE.lsb runs leanstream on that converted file (everything resident: its
# bundles, sparsity and all) instead of MODEL. LLAMACPP_DIR=DIR takes llama-cpp-python from DIR
# (`pip install --target DIR` with other CMAKE_ARGS, e.g. an AVX2-only build to set beside
# LEANSTREAM_KERNELS=avx2).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
model="${1:-$("$root/scripts/fetch-smollm2.sh")}"
tokens="${2:-128}"
rounds="${3:-5}"
threads="${4:-1 2}"
prompt="The capital of France is"

# shellcheck source=lib/llamacpp.sh
source "$root/scripts/lib/llamacpp.sh"
if [[ -n "${LLAMACPP_DIR:-}" ]]; then
    export PYTHONPATH="$LLAMACPP_DIR${PYTHONPATH:+:$PYTHONPATH}"
else
    install_llamacpp
fi
ours_model="${LEANSTREAM_MODEL:-$model}"
(cd "$root" && cargo build --release -q -p leanstream)
leanstream="$root/target/release/leanstream"

leanstream_rate() {
    "$leanstream" run --model "$ours_model" -p "$prompt" -n "$tokens" --ignore-eos --temp 0 --threads "$1" \
        --ctx 512 --json 2>/dev/null |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["tokens_per_s"])'
}

median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for ((r = 1; r <= rounds; r++)); do
    for t in $threads; do
        leanstream_rate "$t" >> "$tmp/leanstream.$t"
        llamacpp_rate "$model" "$prompt" "$tokens" "$t" >> "$tmp/llamacpp.$t"
    done
done

echo "leanstream: $(basename "$ours_model") (kernels ${LEANSTREAM_KERNELS:-best}), llama.cpp: $(basename "$model"): $tokens tokens greedy, median of $rounds interleaved runs"
printf '%-8s %16s %16s %8s\n' threads "leanstream tok/s" "llama.cpp tok/s" ratio
for t in $threads; do
    ours="$(median < "$tmp/leanstream.$t")"
    theirs="$(median < "$tmp/llamacpp.$t")"
    printf '%-8s %16.1f %16.1f %8.2f\n' "$t" "$ours" "$theirs" \
        "$(python3 -c "print($ours / $theirs)")"
done
