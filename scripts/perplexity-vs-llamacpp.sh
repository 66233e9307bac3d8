#!/usr/bin/env bash
# Perplexity of leanstream and llama.cpp's `llama-perplexity` on the same GGUF file and the same
# positions of the same text, beside the file dequantized to F32 by `llama-quantize`: how far
# each tool's quantized run is from its own F32 run, and how far the two tools are from each
# other.
#
# usage: scripts/perplexity-vs-llamacpp.sh MODEL.gguf [TEXT=data/heldout-head.txt] [CTX=512]
# `llama-perplexity -c CTX` scores, in each whole CTX-token chunk, the predictions from position
# CTX/2 on; leanstream scores the same ones with `--score-from CTX/2` (docs/cli.md). The GGUF
# must not ask for a start token (tokenizer.ggml.add_bos_token false, as SmolLM2's), or
# llama.cpp replaces each chunk's first token with it. Both run dense on 2 threads; the F32 copy
# is written beside MODEL once (MODEL-f32.gguf). llama.cpp's tools come from
# scripts/build-llamacpp.sh.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
model="${1:?usage: $0 MODEL.gguf [TEXT] [CTX]}"
text="${2:-$root/data/heldout-head.txt}"
ctx="${3:-512}"
bin="$("$root/scripts/build-llamacpp.sh")"
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
(cd "$root" && cargo build --release -q -p leanstream)
leanstream="$root/target/release/leanstream"

f32="${model%.gguf}-f32.gguf"
if [[ ! -f "$f32" ]]; then
    log="$(mktemp)"
    if ! "$bin/llama-quantize" --allow-requantize "$model" "$f32" F32 >"$log" 2>&1; then
        cat "$log" >&2
        echo "llama-quantize could not write $f32 (its output above)" >&2
        exit 1
    fi
    rm -f "$log"
fi

ours() { # MODEL -> PERPLEXITY TOKENS
    "$leanstream" perplexity --model "$1" --policy dense --file "$text" --ctx "$ctx" \
        --score-from $((ctx / 2)) --threads 2 --json 2>/dev/null |
        python3 -c 'import json, sys; r = json.load(sys.stdin); print(r["perplexity"], r["tokens"])'
}

theirs() { # MODEL -> PERPLEXITY
    # The final estimate: "Final estimate: PPL = 12.3456 +/- 0.1234".
    "$bin/llama-perplexity" -m "$1" -f "$text" -c "$ctx" -b "$ctx" -t 2 2>&1 |
        sed -n 's/.*Final estimate: PPL = \([0-9.]*\).*/\1/p'
}

read -r ours_q ours_tokens < <(ours "$model")
read -r ours_f _ < <(ours "$f32")
theirs_q="$(theirs "$model")"
theirs_f="$(theirs "$f32")"
if [[ -z "$theirs_q" || -z "$theirs_f" ]]; then
    echo "llama-perplexity printed no final estimate (the text needs at least 2 × $ctx tokens)" >&2
    exit 1
fi
python3 - "$ours_q" "$ours_f" "$theirs_q" "$theirs_f" "$ours_tokens" "$(basename "$model")" <<'EOF'
import sys
oq, of, tq, tf = map(float, sys.argv[1:5])
tokens, name = sys.argv[5], sys.argv[6]
print(f"{name}: {tokens} positions scored by both tools")
print("| tool | quantized | F32 | quantized vs F32 |")
print("|---|---|---|---|")
print(f"| leanstream | {oq:.4f} | {of:.4f} | {oq / of - 1:+.2e} |")
print(f"| llama.cpp | {tq:.4f} | {tf:.4f} | {tq / tf - 1:+.2e} |")
print(f"| leanstream vs llama.cpp | {oq / tq - 1:+.2e} | {of / tf - 1:+.2e} | |")
EOF
