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
# Prompt processing too, when llama.cpp's llama-bench is there (scripts/build-llamacpp.sh builds
# it; LLAMA_BENCH=FILE names another): leanstream's prefill tokens/s of a PROMPT_TOKENS-token
# prompt (default 512; held-out English) beside `llama-bench -p PROMPT_TOKENS -n 0`.
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

prompt_tokens="${PROMPT_TOKENS:-512}"
llama_bench="${LLAMA_BENCH:-${LEANSTREAM_CACHE:-$HOME/.cache/leanstream}/llamacpp-build/build/bin/llama-bench}"
# About PROMPT_TOKENS tokens of held-out English (about 0.75 words a token).
long_prompt="$(tr -s '[:space:]' ' ' < "$root/data/heldout.txt" | cut -d' ' -f1-$((prompt_tokens * 3 / 4)))"

leanstream_prefill() { # THREADS -> "PROMPT_TOKENS TOK/S"
    "$leanstream" run --model "$ours_model" -p "$long_prompt" -n 1 --temp 0 --threads "$1" \
        --ctx $((prompt_tokens * 2)) --json 2>/dev/null |
        python3 -c 'import json, sys; r = json.load(sys.stdin); print(r["prompt_tokens"], r["prompt_tokens_per_s"])'
}

llamacpp_prefill() { # THREADS -> TOK/S
    LD_LIBRARY_PATH="$(dirname "$llama_bench")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "$llama_bench" -m "$model" -p "$prompt_tokens" -n 0 -t "$1" -r 1 -o json 2>/dev/null |
        python3 -c 'import json, sys; print(json.load(sys.stdin)[0]["avg_ts"])'
}

median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for ((r = 1; r <= rounds; r++)); do
    for t in $threads; do
        leanstream_rate "$t" >> "$tmp/leanstream.$t"
        llamacpp_rate "$model" "$prompt" "$tokens" "$t" >> "$tmp/llamacpp.$t"
        if [[ -x "$llama_bench" ]]; then
            leanstream_prefill "$t" >> "$tmp/leanstream-pp.$t"
            llamacpp_prefill "$t" >> "$tmp/llamacpp-pp.$t"
        fi
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

if [[ -x "$llama_bench" ]]; then
    echo
    echo "prompt processing: leanstream's $(cut -d' ' -f1 < "$tmp/leanstream-pp.${threads%% *}" | head -1)-token prompt, llama-bench -p $prompt_tokens; median of $rounds"
    printf '%-8s %16s %16s %8s\n' threads "leanstream pp/s" "llama.cpp pp/s" ratio
    for t in $threads; do
        ours="$(cut -d' ' -f2 < "$tmp/leanstream-pp.$t" | median)"
        theirs="$(median < "$tmp/llamacpp-pp.$t")"
        printf '%-8s %16.1f %16.1f %8.2f\n' "$t" "$ours" "$theirs" \
            "$(python3 -c "print($ours / $theirs)")"
    done
else
    echo "no llama-bench at $llama_bench (scripts/build-llamacpp.sh builds it): prompt processing not compared"
fi
