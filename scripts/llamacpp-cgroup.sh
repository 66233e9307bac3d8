#!/usr/bin/env bash
# llama.cpp (mmap) and leanstream (streaming) on the same real model, each inside the same memory
# cgroup limit, reading the real disk from a cold page cache: the limit runs from 100 % down to
# 60 % of llama.cpp's own unconstrained peak (its process memory plus the page cache it fills,
# which the kernel charges to the group). Prints tokens/s of both and their ratio at each limit.
#
# usage: scripts/llamacpp-cgroup.sh [MODEL.gguf] [TOKENS=32] [THREADS=1] [CONVERT_ARGS...]
# MODEL defaults to SmolLM2-135M-Instruct Q4_1 (scripts/fetch-smollm2.sh); leanstream runs the file
# `leanstream-prep convert MODEL CONVERT_ARGS` writes (default: --quant q4 --sparsity
# threshold:0.3, the least lossy sparsity measured on SmolLM2), or LSB=FILE when set (a file already
# converted from MODEL). PCTS lists the limits in % of llama.cpp's own peak (default: 100 down to
# 30); LIMITS lists them in bytes instead (IEC suffixes: LIMITS="2G 4G"), as for the synthetic 7B
# (`leanstream-prep synth ... --gguf MODEL.gguf`, then LSB= the synthetic file). Needs a writable cgroup v1 memory controller (as the test suite's memory_cgroup test does);
# installs llama-cpp-python if missing.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
model="${1:-$("$root/scripts/fetch-smollm2.sh")}"
tokens="${2:-32}"
threads="${3:-1}"
shift $(($# < 3 ? $# : 3))
convert_args=("$@")
[[ ${#convert_args[@]} -gt 0 ]] || convert_args=(--quant q4 --sparsity threshold:0.3)
prompt="The capital of France is"

# shellcheck source=lib/llamacpp.sh
source "$root/scripts/lib/llamacpp.sh"
install_llamacpp
(cd "$root" && cargo build --release -q -p leanstream -p leanstream-prep)
leanstream="$root/target/release/leanstream"

tmp="$(mktemp -d)"
groups=()
cleanup() {
    for g in "${groups[@]}"; do rmdir "$g" 2>/dev/null || true; done
    rm -rf "$tmp"
}
trap cleanup EXIT
lsb="${LSB:-$tmp/model.lsb}"
[[ -n "${LSB:-}" ]] || "$root/target/release/leanstream-prep" convert "$model" -o "$lsb" "${convert_args[@]}" >&2

# shellcheck source=lib/cgroup.sh
source "$root/scripts/lib/cgroup.sh"

# new_group LIMIT: a fresh group with that limit (0 = none); prints its path.
new_group() {
    local g="$parent/leanstream-llamacpp-$$-${#groups[@]}"
    mkdir "$g"
    if [[ "$1" -gt 0 ]]; then
        echo "$1" > "$g/memory.limit_in_bytes"
        [[ -e "$g/memory.memsw.limit_in_bytes" ]] && echo "$1" > "$g/memory.memsw.limit_in_bytes"
    fi
    echo "$g"
}

# in_group GROUP CMD...: runs CMD inside GROUP.
in_group() {
    local g="$1"
    shift
    (echo "$BASHPID" > "$g/cgroup.procs" && "$@")
}

leanstream_rate() {
    "$leanstream" run --model "$lsb" -p "$prompt" -n "$tokens" --ignore-eos --temp 0 --threads "$threads" \
        --ctx 512 --flash none --memory "$1" --json 2>"$tmp/leanstream.err" |
        python3 -c 'import json, sys; print("%.3g" % json.load(sys.stdin)["tokens_per_s"])'
}

cold "$model"
g="$(new_group 0)"
groups+=("$g")
in_group "$g" llamacpp_rate "$model" "$prompt" "$tokens" "$threads" > /dev/null
peak="$(cat "$g/memory.max_usage_in_bytes")"
# (The refused run exits 1: that is the point, so the pipeline's status is not checked.)
minimum="$( ("$leanstream" run --model "$lsb" -p x --memory 1 --ctx 512 2>&1 || true) |
    sed -n 's/.*below the minimum of \([^ ]* [A-Za-z]*\).*/\1/p')"
echo "$(basename "$model"): llama.cpp unconstrained peak $((peak >> 20)) MiB (process and page cache);"
echo "leanstream's minimum at ctx 512: $minimum; $tokens tokens greedy, $threads thread(s), cold page cache"
printf '%-7s %10s %16s %16s %8s\n' limit MiB "llama.cpp tok/s" "leanstream tok/s" ratio
# "LABEL BYTES" per limit.
limits=()
if [[ -n "${LIMITS:-}" ]]; then
    for l in $LIMITS; do limits+=("$l $(numfmt --from=iec "$l")"); done
else
    for pct in ${PCTS:-100 90 80 70 60 50 40 30}; do limits+=("$pct% $((peak * pct / 100))"); done
fi
for entry in "${limits[@]}"; do
    read -r label limit <<< "$entry"
    cold "$model"
    g="$(new_group "$limit")"
    groups+=("$g")
    theirs="$(in_group "$g" llamacpp_rate "$model" "$prompt" "$tokens" "$threads" 2>/dev/null || echo killed)"
    cold "$lsb"
    g="$(new_group "$limit")"
    groups+=("$g")
    # The budget is a cap on peak RSS (measured at 86-95 % of it at the minimum), and O_DIRECT
    # reads leave no page cache to charge: leanstream gets the limit itself as its budget.
    ours="$(in_group "$g" leanstream_rate "$limit" || echo "fails: $(grep -o 'below the minimum of [^ ]* [A-Za-z]*' "$tmp/leanstream.err" || tail -c 60 "$tmp/leanstream.err")")"
    ratio="$(python3 -c "import sys; a, b = sys.argv[1:]; print(f'{float(a) / float(b):.2f}')" "$ours" "$theirs" 2>/dev/null || echo -)"
    printf '%-7s %10d %16s %16s %8s\n' "$label" $((limit >> 20)) "$theirs" "$ours" "$ratio"
done
