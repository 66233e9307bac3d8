#!/usr/bin/env bash
# Prefill and decode tok/s over thread counts: leanstream's `resident` and `dense` policies on a
# converted file, and llama.cpp on the GGUF it came from (the same weights), one run of each per
# thread count, interleaved. For a many-core machine; the table it prints goes into docs/results.md
# with the CPU line it prints first.
#
# usage: scripts/thread-scaling.sh FILE.lsb MODEL.gguf [THREADS="1 2 4 8 16"] [PROMPT_TOKENS=512]
#        [TOKENS=64]
# A 7B-shaped pair: `leanstream-prep synth --shape llama2-7b --layers 4 --profile-from SMOLLM2.lsb
#   --source-vocab --gguf 7b.gguf -o 7b.lsb` (SmolLM2's vocabulary is larger than the shape's).
# llama.cpp comes from PyPI's llama-cpp-python (built from source when missing); LLAMACPP_DIR=DIR
# takes it from DIR instead.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
file="${1:?usage: $0 FILE.lsb MODEL.gguf [THREADS] [PROMPT_TOKENS] [TOKENS]}"
gguf="${2:?usage: $0 FILE.lsb MODEL.gguf [THREADS] [PROMPT_TOKENS] [TOKENS]}"
cores="$(nproc)"
threads="${3:-$(for t in 1 2 4 8 16; do ((t <= cores)) && echo -n "$t "; done)}"
prompt_tokens="${4:-512}"
tokens="${5:-64}"

# shellcheck source=lib/llamacpp.sh
source "$root/scripts/lib/llamacpp.sh"
if [[ -n "${LLAMACPP_DIR:-}" ]]; then
    export PYTHONPATH="$LLAMACPP_DIR${PYTHONPATH:+:$PYTHONPATH}"
else
    install_llamacpp
fi
(cd "$root" && cargo build --release -q -p leanstream)
leanstream="${LEANSTREAM_BIN:-$root/target/release/leanstream}"

# About PROMPT_TOKENS tokens of held-out English (about 0.75 words a token).
prompt="$(tr -s '[:space:]' ' ' < "$root/data/heldout.txt" | cut -d' ' -f1-$((prompt_tokens * 3 / 4)))"

leanstream_rates() { # POLICY THREADS -> "PROMPT_TOKENS PREFILL DECODE"
    "$leanstream" run --model "$file" --policy "$1" --threads "$2" -p "$prompt" -n "$tokens" \
        --ignore-eos --temp 0 --ctx 1024 --json 2>/dev/null |
        python3 -c 'import json, sys; r = json.load(sys.stdin)
print(r["prompt_tokens"], r["prompt_tokens_per_s"], r["tokens_per_s"])'
}

echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $cores cores;" \
    "SIMD: $(grep -ow 'avx512_vnni\|avx512f\|avx2\|asimddp\|i8mm' /proc/cpuinfo | sort -u | xargs)"
echo "file: $(basename "$file") / $(basename "$gguf"); $tokens tokens decoded after the prompt"
echo
echo "| threads | prompt tokens | resident pp tok/s | dense pp tok/s | llama.cpp pp tok/s |" \
    "resident tg tok/s | dense tg tok/s | llama.cpp tg tok/s |"
echo "|---|---|---|---|---|---|---|---|"
for t in $threads; do
    read -r n r_pp r_tg < <(leanstream_rates resident "$t")
    read -r _ d_pp d_tg < <(leanstream_rates dense "$t")
    read -r _ l_pp l_tg < <(llamacpp_prefill_decode "$gguf" "$prompt" "$tokens" "$t")
    printf '| %s | %s | %.1f | %.1f | %.1f | %.2f | %.2f | %.2f |\n' \
        "$t" "$n" "$r_pp" "$d_pp" "$l_pp" "$r_tg" "$d_tg" "$l_tg"
done
