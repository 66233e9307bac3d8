#!/usr/bin/env bash
# Dense decode tokens/s of leanstream and llama.cpp on the same GGUF file, thread count and prompt,
# greedy. Runs alternate (leanstream, llama.cpp, leanstream, ...) so that load from other processes
# hits both alike; the median of each and their ratio are reported.
#
# usage: scripts/bench-vs-llamacpp.sh [MODEL.gguf] [TOKENS=128] [ROUNDS=5] [THREADS="1 2"]
# MODEL defaults to SmolLM2-135M-Instruct Q4_1 (scripts/fetch-smollm2.sh). llama.cpp comes from
# PyPI's llama-cpp-python, whose install builds it (about 10 minutes here); installed if missing.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
model="${1:-$("$root/scripts/fetch-smollm2.sh")}"
tokens="${2:-128}"
rounds="${3:-5}"
threads="${4:-1 2}"
prompt="The capital of France is"

if ! python3 -c "import llama_cpp" 2>/dev/null; then
    # Not a native build: on CPUs with AMX that one routes Q4 matrices through AMX, which crashes
    # (segfault in decode) in this project's VMs. The SIMD levels are those of this CPU.
    flags="-DGGML_NATIVE=OFF"
    for f in avx avx2 fma f16c avx512f avx512_vnni avx512_bf16 avx512vbmi; do
        if grep -qw "$f" /proc/cpuinfo; then
            case $f in
                avx512f) flags+=" -DGGML_AVX512=ON" ;;
                avx512vbmi) flags+=" -DGGML_AVX512_VBMI=ON" ;;
                *) flags+=" -DGGML_${f^^}=ON" ;;
            esac
        fi
    done
    echo "installing llama-cpp-python (builds llama.cpp: $flags) ..." >&2
    CMAKE_ARGS="$flags" pip install --quiet llama-cpp-python >&2
fi
(cd "$root" && cargo build --release -q -p leanstream)
leanstream="$root/target/release/leanstream"

leanstream_rate() {
    "$leanstream" run --model "$model" -p "$prompt" -n "$tokens" --temp 0 --threads "$1" \
        --ctx 512 --json 2>/dev/null |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["tokens_per_s"])'
}

# Same measure as leanstream's tokens_per_s: decode steps after the first generated token.
llamacpp_rate() {
    python3 - "$model" "$prompt" "$tokens" "$1" <<'EOF'
import sys, time
import numpy as np
from llama_cpp import Llama

path, prompt, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
vocab = llm.n_vocab()
def next_token():
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))
llm.eval(llm.tokenize(prompt.encode(), add_bos=True))
tok = next_token()
start = time.perf_counter()
for _ in range(n - 1):
    llm.eval([tok])
    tok = next_token()
print((n - 1) / (time.perf_counter() - start))
EOF
}

median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for ((r = 1; r <= rounds; r++)); do
    for t in $threads; do
        leanstream_rate "$t" >> "$tmp/leanstream.$t"
        llamacpp_rate "$t" >> "$tmp/llamacpp.$t"
    done
done

echo "$(basename "$model"): $tokens tokens greedy, median of $rounds interleaved runs"
printf '%-8s %16s %16s %8s\n' threads "leanstream tok/s" "llama.cpp tok/s" ratio
for t in $threads; do
    ours="$(median < "$tmp/leanstream.$t")"
    theirs="$(median < "$tmp/llamacpp.$t")"
    printf '%-8s %16.1f %16.1f %8.2f\n' "$t" "$ours" "$theirs" \
        "$(python3 -c "print($ours / $theirs)")"
done
