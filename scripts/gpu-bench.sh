#!/usr/bin/env bash
# Decode tok/s on the GPU against the CPU, on the same files and the same tokens, for a machine
# with a GPU (docs/gpu.md, "Measuring"). Makes what it measures from the repository alone (no
# download): the embedded model, its q4 conversion, and a synthetic Llama-2-7B-shaped pair of
# LAYERS layers planted from the embedded model's activity (`leanstream-prep synth`). For each file
# (converted files also streamed: `--policy leanstream --memory ffn:10% --flash ufs4`, from an
# emulated phone's flash, with the GPU's FFN from its neuron pool and, as `leanstream/cpu-ffn`,
# with the FFN on the CPU and the attention on the GPU)
# it runs the same greedy generation with and without LEANSTREAM_GPU=1, ROUNDS times interleaved,
# and prints a table (median tok/s, the ratio, whether the tokens are the same, where the step
# ran; for the streamed runs the share of the device's busy time that computing hid, 1 −
# io_wait/io_busy from `--json`, CPU / GPU) after the CPU, the GPU and the Vulkan driver it found;
# then, from `leanstream bench --trace` timelines of the streamed 7B-shaped file, how its reads
# overlapped the GPU's submissions and the host's work between them (scripts/gpu-overlap.py).
#
# usage: scripts/gpu-bench.sh [LAYERS=4] [TOKENS=64] [ROUNDS=3]
# BIN_DIR=DIR takes `leanstream` (built with `--features gpu`) and `leanstream-prep` from DIR
# instead of building them; WORK=DIR keeps the made files there (default: a temporary folder).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
layers="${1:-4}"
tokens="${2:-64}"
rounds="${3:-3}"
if [[ -z "${BIN_DIR:-}" ]]; then
    (cd "$root" && cargo build --release -q -p leanstream --features gpu && cargo build --release -q -p leanstream-prep)
    BIN_DIR="$root/target/release"
fi
ls="$BIN_DIR/leanstream"
prep="$BIN_DIR/leanstream-prep"
work="${WORK:-$(mktemp -d)}"
mkdir -p "$work"
[[ -n "${WORK:-}" ]] || trap 'rm -rf "$work"' EXIT

echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) cores"
command -v nvidia-smi >/dev/null && echo "GPU: $(nvidia-smi -L | head -1)"
echo "Vulkan driver: ${VK_DRIVER_FILES:-${VK_ICD_FILENAMES:-as the Vulkan loader finds it}}"

embedded="$root/models/austen-relu"
[[ -e "$work/austen-q4.lsb" ]] ||
    "$prep" convert "$embedded" -o "$work/austen-q4.lsb" --quant q4 --calib-tokens 2048 --cluster-kib 8 >/dev/null 2>"$work/err" ||
        { cat "$work/err" >&2; exit 1; }
[[ -e "$work/7b.lsb" ]] ||
    "$prep" synth --shape llama2-7b --quant q4 --layers "$layers" --profile-from "$work/austen-q4.lsb" \
        --gguf "$work/7b.gguf" -o "$work/7b.lsb" >/dev/null 2>"$work/err" ||
        { cat "$work/err" >&2; exit 1; }

# One generation: prints "TOK/S TOKENS-DIGEST HIDDEN UPLOADS" (UPLOADS: clusters uploaded into the
# GPU's neuron pool per token, prompt included, or -) and leaves its `gpu:` line in $work/line.
generate() { # GPU(0/1) MODEL POLICY [FLAGS...]; FFN=cpu keeps a streamed FFN on the CPU
    LEANSTREAM_GPU="$1" LEANSTREAM_GPU_FFN="${FFN:-gpu}" "$ls" run --model "$2" --policy "$3" "${@:4}" -p "It was a fine morning, and Emma" \
        -n "$tokens" --ignore-eos --temp 0 --kv f32 --ctx 512 --json 2>"$work/err" |
        python3 -c 'import json, sys, hashlib; r = json.load(sys.stdin)
busy, wait = r.get("io_busy_fraction", 0), r.get("io_wait_fraction", 0)
hidden = "%.2f" % (1 - wait / busy) if busy > 0 else "-"
pool = r.get("gpu", {}).get("pool_uploads")
tokens = r["prompt_tokens"] + r["generated_tokens"]
uploads = "%.1f" % (pool / tokens) if pool is not None else "-"
print(r["tokens_per_s"], hashlib.md5(str(r["tokens"]).encode()).hexdigest()[:8], hidden, uploads)' ||
        { cat "$work/err" >&2; exit 1; }
    grep -m1 '^gpu:' "$work/err" >"$work/line" || echo "gpu: (no line)" >"$work/line"
}
median() { tr ' ' '\n' | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

echo
echo "$tokens tokens decoded, greedy, f32 KV cache, ctx 512; median of $rounds interleaved rounds"
echo
echo "| file | policy | CPU tok/s | GPU tok/s | GPU / CPU | same tokens | reads hidden (CPU / GPU) | pool uploads / token | where the GPU step ran |"
echo "|---|---|---|---|---|---|---|---|---|"
stream=(--memory ffn:10% --flash ufs4)
for run in "$embedded:dense" "$work/austen-q4.lsb:resident" "$work/austen-q4.lsb:leanstream" \
    "$work/austen-q4.lsb:leanstream/cpu-ffn" "$work/7b.gguf:dense" "$work/7b.lsb:resident" \
    "$work/7b.lsb:leanstream" "$work/7b.lsb:leanstream/cpu-ffn"; do
    model="${run%:*}" label="${run##*:}" flags=()
    policy="${label%/*}"
    export FFN=gpu
    [[ "$label" == */cpu-ffn ]] && FFN=cpu
    [[ "$policy" == leanstream ]] && flags=("${stream[@]}")
    cpu=() gpu=() same=yes
    for ((r = 0; r < rounds; r++)); do
                read -r c cd ch _ < <(generate 0 "$model" "$policy" "${flags[@]}")
        read -r g gd gh gu < <(generate 1 "$model" "$policy" "${flags[@]}")
        cpu+=("$c") gpu+=("$g")
        [[ "$cd" == "$gd" ]] || same=no
    done
    c="$(echo "${cpu[*]}" | median)" g="$(echo "${gpu[*]}" | median)"
        printf '| %s | %s | %.2f | %.2f | %.2f× | %s | %s / %s | %s | %s |\n' "$(basename "$model")" "$label" "$c" "$g" \
        "$(python3 -c "print($g / $c)")" "$same" "$ch" "$gh" "$gu" "$(cut -c1-120 "$work/line")"
done

# The overlap from a timeline: the streamed 7B-shaped file on the GPU, its FFN from the neuron pool
# and on the CPU, each run's reads against the GPU's submissions and the host's work between them.
echo
echo "Reads against the GPU's work, from \`leanstream bench --trace\` (7b.lsb, --memory ffn:10%, --flash ufs4, $tokens tokens):"
echo
for ffn in gpu cpu; do
    LEANSTREAM_GPU=1 LEANSTREAM_GPU_FFN="$ffn" "$ls" bench --model "$work/7b.lsb" --policy leanstream \
        --memory ffn:10% --flash ufs4 --tokens "$tokens" --trace "$work/trace-$ffn.json" >/dev/null 2>"$work/err" ||
        { cat "$work/err" >&2; exit 1; }
    echo "FFN on the $ffn:"
    python3 "$root/scripts/gpu-overlap.py" "$work/trace-$ffn.json"
    echo
done
