#!/usr/bin/env bash
# A converted file and the GGUF of the same weights (`leanstream-prep synth ... --gguf`), each run
# cold inside a fresh cgroup v1 memory group whose limit counts the page cache: llama.cpp's
# llama-bench (scripts/build-llamacpp.sh) with its weights mmapped, repacked (its default) and not,
# against `leanstream run --sparsity certified`. Rounds interleave the two, so both see the same
# load from other processes.
#
# llama.cpp's decode rate is 12 / (16/tg16 − 4/tg4) from llama-bench's own tg figures (each run
# pays its first token's cold reads; the difference leaves them out, as leanstream's
# tokens_per_s does); where the first tokens' faults differ too much between runs that gives
# nonsense (a negative or impossible rate), so tg16 is printed beside it. At 2 GiB the repacked
# default is not run (it is killed while loading a 7B: it copies the weights).
#
# usage: scripts/llamabench-cgroup.sh FILE.lsb MODEL.gguf [LIMITS="2G 4G"] [ROUNDS=2] [LEANSTREAM=target/release/leanstream] [MODES=certified]
# MODES: the --sparsity values leanstream runs with, each in every round; `refine:F` runs
# `--sparsity refine --refine-keep F` (it trades quality: docs/cli.md).
# Needs a writable cgroup v1 memory controller (as the test suite's memory_cgroup test does).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
lsb="$1"
gguf="$2"
limits="${3:-2G 4G}"
rounds="${4:-2}"
leanstream="${5:-$root/target/release/leanstream}"
modes="${6:-certified}"
[[ -n "${5:-}" ]] || (cd "$root" && cargo build --release -q -p leanstream)
bench="$("$root/scripts/build-llamacpp.sh")/llama-bench"
prompt="The capital of France is"

# shellcheck source=lib/cgroup.sh
source "$root/scripts/lib/cgroup.sh"

# in_group BYTES CMD...: runs CMD in a fresh group limited to BYTES, removed after it.
in_group() {
    local g="$parent/leanstream-llamabench-$BASHPID-$RANDOM"
    mkdir "$g"
    echo "$1" > "$g/memory.limit_in_bytes"
    [[ -e "$g/memory.memsw.limit_in_bytes" ]] && echo "$1" > "$g/memory.memsw.limit_in_bytes"
    shift
    local status=0
    (echo "$BASHPID" > "$g/cgroup.procs" && "$@") || status=$?
    rmdir "$g" 2>/dev/null || true
    return "$status"
}

# tg BYTES REPACK N: llama-bench's tg rate of N tokens, run cold in a group of BYTES ("killed" if
# it did not finish).
tg() {
    cold "$gguf"
    in_group "$1" "$bench" -m "$gguf" -p 0 -n "$3" -t 1 -r 1 --no-warmup -lm mmap --repack "$2" 2>/dev/null |
        awk -F'|' -v t="tg$3" '$0 ~ t { split($(NF - 1), a, " "); print a[1] }' | grep . || echo killed
}

echo "$(basename "$lsb") against $(basename "$gguf"): 1 thread, ctx 512, cold page cache, $rounds round(s)"
for round in $(seq "$rounds"); do
    for limit in $limits; do
        bytes="$(numfmt --from=iec "$limit")"
        repacks="0 1"
        [[ "$limit" == 2G ]] && repacks="0"
        for repack in $repacks; do
            r4="$(tg "$bytes" "$repack" 4)"
            r16="$(tg "$bytes" "$repack" 16)"
            rate="$(python3 -c "import sys; a, b = map(float, sys.argv[1:]); print(f'{12 / (16 / b - 4 / a):.2f}')" "$r4" "$r16" 2>/dev/null || echo -)"
            echo "round $round, $limit: llama.cpp repack=$repack: $rate tok/s (tg4 $r4, tg16 $r16)"
        done
        for mode in $modes; do
            sparsity=(--sparsity "${mode%%:*}")
            [[ "$mode" == *:* ]] && sparsity+=(--refine-keep "${mode#*:}")
            cold "$lsb"
            in_group "$bytes" "$leanstream" run --model "$lsb" -p "$prompt" -n 16 --ignore-eos --temp 0 \
                --ctx 512 --threads 1 --flash none --memory "$bytes" "${sparsity[@]}" --json 2>/dev/null |
                python3 -c '
import json, sys
d = json.load(sys.stdin)
print("round %s, %s: leanstream %s: %.2f tok/s, %.0f MB read per token in %.0f reads (dense %.0f MB), cache hits %.2f (%d MiB lent by the KV cache), %d layers whole, I/O waited %.0f %%" % (
    sys.argv[1], sys.argv[2], sys.argv[3], d["tokens_per_s"], d["bytes_read_per_token"] / 1e6, d["reads_per_token"],
    d["dense_bytes_read_per_token"] / 1e6, d["cache_hit_rate"], d.get("kv_lent_bytes", 0) >> 20, d["whole_layers"],
    100 * d["io_wait_fraction"]))' "$round" "$limit" "$mode" ||
                echo "round $round, $limit: leanstream $mode failed"
        done
    done
done
