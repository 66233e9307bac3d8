#!/usr/bin/env bash
# Aggregate throughput of `leanstream serve` with 1 slot against SLOTS slots (`--parallel`): CLIENTS
# clients ask at once for TOKENS greedy tokens each (--ignore-eos is not an API field, so the
# prompts are ones that do not end early; the script checks every reply's token count), and the
# script reports each run's aggregate tok/s (completion tokens of all clients / wall time from the
# first request to the last reply), p50/p99 latency, and the ratio of the medians. Rounds
# alternate 1 slot and SLOTS slots so that load from other processes hits both alike. Each
# concurrent reply is also checked against the same prompt's reply alone (greedy: bit for bit).
#
# usage: scripts/load-test.sh MODEL [MEMORY] [SLOTS=8] [CLIENTS=8] [TOKENS=48] [ROUNDS=3]
#   MEMORY: the --memory both servers run under (default: half the model file's size); `none`: no
#   --memory (a GGUF file then runs dense, its weights as stored).
# Both servers run with --ctx ${CTX:-128} --kv ${KV:-q8_0}: every slot's KV cache is counted in
# --memory, and f32 caches of a long context would leave no room for eight (at half of SmolLM2's
# converted file, eight q8_0 caches of 256 positions do not fit beside the minimum; 128 positions
# hold these prompts and their replies).
# LEANSTREAM_BIN=FILE runs that binary instead of this checkout's release build.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
model="${1:?usage: scripts/load-test.sh MODEL [MEMORY] [SLOTS] [CLIENTS] [TOKENS] [ROUNDS]}"
[[ -f "$model" ]] || { echo "no such file: $model" >&2; exit 2; }
memory="${2:-$(($(stat -c %s "$model") / 2))}"
budget=(--memory "$memory")
[[ "$memory" == none ]] && budget=()
slots="${3:-8}"
clients="${4:-8}"
tokens="${5:-48}"
rounds="${6:-3}"
if [[ -n "${LEANSTREAM_BIN:-}" ]]; then
    leanstream="$LEANSTREAM_BIN"
else
    (cd "$root" && cargo build --release -q -p leanstream)
    leanstream="$root/target/release/leanstream"
fi
tmp="$(mktemp -d)"
server=""
cleanup() {
    [[ -n "$server" ]] && kill "$server" 2> /dev/null || true
    rm -rf "$tmp"
}
trap cleanup EXIT

# Starts a server with $1 slots; sets $server and $addr.
start() {
    "$leanstream" serve --model "$model" ${budget[@]+"${budget[@]}"} --ctx "${CTX:-128}" --kv "${KV:-q8_0}" --port 0 --temp 0 \
        --parallel "$1" --queue 64 2> "$tmp/log" &
    server=$!
    for _ in $(seq 600); do
        addr="$(sed -n 's|.*http://\([^/]*\)/v1.*|\1|p' "$tmp/log" | head -1)"
        [[ -n "$addr" ]] && return
        kill -0 "$server" 2> /dev/null || { cat "$tmp/log" >&2; exit 1; }
        sleep 0.1
    done
    echo "the server did not start" >&2
    exit 1
}

stop() {
    kill "$server" 2> /dev/null || true
    wait "$server" 2> /dev/null || true
    server=""
}

echo "model $model, --memory $memory, $clients clients x $tokens tokens, 1 vs $slots slots"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cpus"
: > "$tmp/results"
for round in $(seq "$rounds"); do
    for n in 1 "$slots"; do
        start "$n"
        python3 "$root/scripts/lib/load_clients.py" "$addr" "$clients" "$tokens" "$n" \
            >> "$tmp/results"
        tail -1 "$tmp/results" | python3 -c 'import json, sys; r = json.load(sys.stdin); r.pop("texts"); print(json.dumps(r))'
        grep -h "requests at once\|note:" "$tmp/log" || true
        stop
    done
done
python3 - "$tmp/results" "$slots" << 'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
slots = int(sys.argv[2])
med = lambda n: statistics.median(r["tok_per_s"] for r in runs if r["slots"] == n)
one, many = med(1), med(slots)
print(f"median aggregate tok/s: 1 slot {one:.1f}, {slots} slots {many:.1f}: {many / one:.2f}x")
texts = runs[0]["texts"]
differ = [r["slots"] for r in runs if r["texts"] != texts]
if differ:
    sys.exit(f"replies differ between runs (slots {differ}): batching changed a greedy reply")
print(f"every run gave the same {len(texts)} replies (1 slot: each served alone)")
PY
