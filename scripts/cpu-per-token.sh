#!/usr/bin/env bash
# CPU time (user + sys) per decoded token of `leanstream run` under several policies on one file:
# the task-clock of a LONG-token run minus that of a SHORT-token run, divided by the tokens
# between, so start-up and the prompt cancel out. CPU time, not the wall clock: on a shared
# machine a process that waits for a CPU is not charged for it. Rounds alternate the policies so
# that load from other processes hits each alike; prints each round and the medians.
#
# usage: scripts/cpu-per-token.sh MODEL.lsb [POLICIES="resident dense"] [LONG=160] [SHORT=16] [ROUNDS=3]
# The kernels are the best this CPU has unless LEANSTREAM_KERNELS says (avx512, avx2, portable).
# LEANSTREAM_BIN=FILE times that binary instead of this checkout's (an A/B of two builds).
# Needs `perf` (Debian: apt-get install linux-perf).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
model="${1:?usage: scripts/cpu-per-token.sh MODEL.lsb [POLICIES] [LONG] [SHORT] [ROUNDS]}"
policies="${2:-resident dense}"
long="${3:-160}"
short="${4:-16}"
rounds="${5:-3}"
[[ -f "$model" ]] || { echo "no such file: $model" >&2; exit 2; }
((long > short)) || { echo "LONG ($long) must exceed SHORT ($short)" >&2; exit 2; }
command -v perf > /dev/null || { echo "perf is missing: apt-get install linux-perf" >&2; exit 2; }
if [[ -n "${LEANSTREAM_BIN:-}" ]]; then
    leanstream="$LEANSTREAM_BIN"
else
    (cd "$root" && cargo build --release -q -p leanstream)
    leanstream="$root/target/release/leanstream"
fi

# Milliseconds of task-clock for one greedy run of $2 tokens with policy $1.
task_ms() {
    perf stat -x, -e task-clock -- "$leanstream" run --model "$model" --policy "$1" -n "$2" \
        --ignore-eos --temp 0 --threads 1 --ctx 1024 -p "It was a fine morning, and" \
        2>&1 > /dev/null | awk -F, '$3 == "task-clock" { print $1 }'
}

median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "$(basename "$model"), kernels ${LEANSTREAM_KERNELS:-best}, 1 thread: ms of CPU per decoded token (-n $long minus -n $short)"
for ((r = 1; r <= rounds; r++)); do
    line="round $r:"
    for p in $policies; do
        ms="$(python3 -c "print(f'{($(task_ms "$p" "$long") - $(task_ms "$p" "$short")) / ($long - $short):.3f}')")"
        echo "$ms" >> "$tmp/$p"
        line+=" $p $ms"
    done
    echo "$line"
done
for p in $policies; do
    echo "median $p: $(median < "$tmp/$p") ms"
done
