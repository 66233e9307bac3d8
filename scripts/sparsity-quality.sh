#!/usr/bin/env bash
# The quality cost of SwiGLU sparsity on SmolLM2-135M-Instruct (issue [K] item 6): converts the
# cached GGUF with `--sparsity target:F` (the gate_up rule, F allocated across layers) at each F and
# with the old |silu(gate)| rule (`threshold:F`) at 0.5, each calibrated on the converter's default
# text (for SwiGLU models the varied one: prose, Python source and technical English; data/README.md)
# unless EXTRA_CONVERT says `--calib FILE`, then scores two texts the calibration never
# saw — the start of data/heldout-head.txt and a text of another kind (the GPL-3 licence, from
# /usr/share/common-licenses) — in exact (certified) and predicted modes against the dense weights
# of the same file (`leanstream perplexity --reference dense`, one pass each), and the FFN bytes
# read per token at the planner's minimum + 25 % of the FFN on the `ufs4` profile. Prints a
# Markdown table.
#
#   bash scripts/sparsity-quality.sh                  # F = 0.3 0.4 0.5 0.6, q8, 16384 calib tokens
#   TARGETS="0.5" OLD="" EVAL_BYTES=4096 bash scripts/sparsity-quality.sh
#   bash scripts/sparsity-quality.sh --table          # only print the table of what OUT holds
#
# Environment: TARGETS (empty for none), OLD (old-rule fractions, default 0.5; empty for none), CALIB_TOKENS,
# EVAL_BYTES (bytes of each text scored; about 4 bytes per token), CTX, EXTRA_CONVERT (more
# convert flags), OTHER_TEXT (the second text), BIN (folder of the binaries, default
# target/release), BUILD=0 (use the binaries in BIN as they are), OUT (work folder, kept: the .lsb
# files and every JSON report), LEANSTREAM_SMOLLM2 (the
# GGUF; default: the cache that scripts/fetch-smollm2.sh fills).
set -euo pipefail
cd "$(dirname "$0")/.."

GGUF=${LEANSTREAM_SMOLLM2:-${LEANSTREAM_CACHE:-$HOME/.cache/leanstream}/SmolLM2-135M-Instruct.Q4_1.gguf}
TARGETS=${TARGETS-"0.3 0.4 0.5 0.6"}
OLD=${OLD-"0.5"}
CALIB_TOKENS=${CALIB_TOKENS:-16384}
EVAL_BYTES=${EVAL_BYTES:-8192}
CTX=${CTX:-512}
EXTRA_CONVERT=${EXTRA_CONVERT:-}
OTHER_TEXT=${OTHER_TEXT:-/usr/share/common-licenses/GPL-3}
OUT=${OUT:-target/sparsity-quality}
BIN=${BIN:-target/release}

# Each configuration: NAME:--sparsity value.
configs() {
    for f in $TARGETS; do echo "target:$f"; done
    for f in $OLD; do echo "threshold:$f"; done
}

table() {
    python3 - "$OUT" "$(configs | tr '\n' ' ')" <<'EOF'
import json, sys
out, configs = sys.argv[1], sys.argv[2].split()
texts = [("heldout", "heldout-head"), ("other", "GPL-3")]
print("| --sparsity | rule | text | mode | perplexity | vs dense | KL (nats/token) | top-1 | "
      "active fraction | FFN MB read/token at +25 % |")
print("|---|---|---|---|---|---|---|---|---|---|")
for c in configs:
    name = c.replace(":", "")
    rule = "\\|silu(g)·u\\|" if c.startswith("target") else "\\|silu(g)\\|"
    for key, label in texts:
        for mode in ("certified", "predicted"):
            v = json.load(open(f"{out}/ppl-{name}-{key}-{mode}.json"))
            d = 100 * (v["perplexity"] / v["reference_perplexity"] - 1)
            s = json.load(open(f"{out}/read-{name}-{key}-{mode}.json"))
            mb = s["ffn_bytes_per_token"] / 1e6
            shown = "exact" if mode == "certified" else mode
            print(f"| {c} | {rule} | {label} | {shown} | {v['perplexity']:.3f} | {d:+.1f} % | "
                  f"{v['kl']:.4f} | {v['top1_agreement']:.3f} | {v['active_fraction']:.3f} | "
                  f"{mb:.2f} |")
for key, label in texts:
    v = json.load(open(f"{out}/ppl-{configs[0].replace(':', '')}-{key}-certified.json"))
    print(f"\n{label}: dense perplexity {v['reference_perplexity']:.3f} over {v['tokens']} tokens "
          f"(windows of {v['ctx']})", end="")
print()
for c in configs:
    name = c.replace(":", "")
    q = json.load(open(f"{out}/convert-{name}.json"))
    secs = open(f"{out}/convert-{name}.seconds").read().strip()
    fr = [1 - l["sparsity"] for l in q["layers"]]
    print(f"{c}: converted in {secs} s; held-out active fraction per layer "
          f"{min(fr):.2f}–{max(fr):.2f} (mean {sum(fr) / len(fr):.3f})")
EOF
}

if [[ ${1:-} == --table ]]; then
    table
    exit 0
fi
if [[ ! -f $GGUF ]]; then
    echo "error: $GGUF is missing: run scripts/fetch-smollm2.sh (or set LEANSTREAM_SMOLLM2)" >&2
    exit 1
fi
if [[ ! -f $OTHER_TEXT ]]; then
    echo "error: $OTHER_TEXT is missing: set OTHER_TEXT to a text the calibration never saw" >&2
    exit 1
fi
# The test build makes both binaries with the dependencies' features the test suite uses (another
# selection would compile every dependency again).
[[ ${BUILD:-1} == 0 ]] || cargo test --release --workspace --no-run -q
mkdir -p "$OUT"
head -c "$EVAL_BYTES" data/heldout-head.txt >"$OUT/text-heldout.txt"
head -c "$EVAL_BYTES" "$OTHER_TEXT" >"$OUT/text-other.txt"

for c in $(configs); do
    name=${c//:/}
    lsb=$OUT/smollm2-q8-$name.lsb
    start=$SECONDS
    # shellcheck disable=SC2086 # EXTRA_CONVERT holds several flags
    "$BIN/leanstream-prep" convert "$GGUF" -o "$lsb" --quant q8 --sparsity "$c" \
        --calib-tokens "$CALIB_TOKENS" $EXTRA_CONVERT --json >"$OUT/convert-$name.json"
    echo "$((SECONDS - start))" >"$OUT/convert-$name.seconds"
    budget=$("$BIN/leanstream-prep" inspect "$lsb" --json |
        python3 -c 'import json,sys; v=json.load(sys.stdin); print(v["min_memory_dense_resident_bytes"] + v["ffn_bytes"] // 4)')
    for key in heldout other; do
        for mode in certified predicted; do
            "$BIN/leanstream" perplexity --model "$lsb" --file "$OUT/text-$key.txt" \
                --ctx "$CTX" --sparsity "$mode" --reference dense --json \
                >"$OUT/ppl-$name-$key-$mode.json"
            "$BIN/leanstream" perplexity --model "$lsb" --file "$OUT/text-$key.txt" \
                --ctx "$CTX" --sparsity "$mode" --memory "$budget" --flash ufs4 --json |
                python3 -c 'import json,sys
v = json.load(sys.stdin)
print(json.dumps({"ffn_bytes_per_token": v["bytes_read_per_token"], "report": v}))' \
                >"$OUT/read-$name-$key-$mode.json"
        done
    done
done

table
