#!/usr/bin/env bash
# The quality cost of threshold sparsity on SmolLM2-135M-Instruct (issue [E] item 5): converts the
# cached GGUF at each threshold, then scores the start of data/heldout.txt (text no conversion saw)
# in certified and predicted modes against the dense weights of the same file, in one pass each
# (`leanstream perplexity --reference dense`), and prints a Markdown table.
#
#   bash scripts/sparsity-quality.sh                  # thresholds 0.3 0.5 0.7, q8, 16384 calib tokens
#   THRESHOLDS="0.5" EVAL_BYTES=4096 bash scripts/sparsity-quality.sh
#   bash scripts/sparsity-quality.sh --table          # only print the table of what OUT holds
#
# Environment: THRESHOLDS, CALIB_TOKENS, EVAL_BYTES (bytes of data/heldout.txt scored; ASCII, so
# about 4 bytes per token), CTX, EXTRA_CONVERT (more convert flags), BUILD=0 (use the binaries in
# target/release as they are), OUT (work folder, kept:
# the .lsb files and every JSON report), LEANSTREAM_SMOLLM2 (the GGUF; default: the cache that
# scripts/fetch-smollm2.sh fills).
set -euo pipefail
cd "$(dirname "$0")/.."

GGUF=${LEANSTREAM_SMOLLM2:-${LEANSTREAM_CACHE:-$HOME/.cache/leanstream}/SmolLM2-135M-Instruct.Q4_1.gguf}
THRESHOLDS=${THRESHOLDS:-"0.3 0.5 0.7"}
CALIB_TOKENS=${CALIB_TOKENS:-16384}
EVAL_BYTES=${EVAL_BYTES:-8192}
CTX=${CTX:-512}
EXTRA_CONVERT=${EXTRA_CONVERT:-}
OUT=${OUT:-target/sparsity-quality}

table() {
    python3 - "$OUT" "$THRESHOLDS" <<'EOF'
import json, sys
out, thresholds = sys.argv[1], sys.argv[2].split()
print("| threshold | mode | ppl | Δppl | KL (nats/token) | top-1 agreement | active fraction | predictor recall |")
print("|---|---|---|---|---|---|---|---|")
for t in thresholds:
    for mode in ("certified", "predicted"):
        v = json.load(open(f"{out}/ppl-t{t}-{mode}.json"))
        d = 100 * (v["perplexity"] / v["reference_perplexity"] - 1)
        print(f"| {t} | {mode} | {v['perplexity']:.3f} | {d:+.1f} % | {v['kl']:.4f} | "
              f"{v['top1_agreement']:.3f} | {v['active_fraction']:.3f} | {v['predictor_recall']:.3f} |")
v = json.load(open(f"{out}/ppl-t{thresholds[0]}-certified.json"))
print(f"\ndense: perplexity {v['reference_perplexity']:.3f} over {v['tokens']} tokens "
      f"(windows of {v['ctx']})")
for t in thresholds:
    q = json.load(open(f"{out}/convert-t{t}.json"))["quality"]
    d = 100 * (q["perplexity"] / q["reference_perplexity"] - 1)
    secs = open(f"{out}/convert-t{t}.seconds").read().strip()
    print(f"threshold {t}: converted in {secs} s; convert's own held-out check "
          f"{q['reference_perplexity']:.3f} -> {q['perplexity']:.3f} ({d:+.1f} %) over "
          f"{q['tokens']} calibration tokens")
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
[[ ${BUILD:-1} == 0 ]] || cargo build --release -q -p leanstream -p leanstream-prep
mkdir -p "$OUT"
text=$OUT/heldout-$EVAL_BYTES.txt
head -c "$EVAL_BYTES" data/heldout.txt >"$text"

for t in $THRESHOLDS; do
    lsb=$OUT/smollm2-q8-t$t.lsb
    start=$SECONDS
    # shellcheck disable=SC2086 # EXTRA_CONVERT holds several flags
    target/release/leanstream-prep convert "$GGUF" -o "$lsb" --quant q8 --sparsity "threshold:$t" \
        --calib-tokens "$CALIB_TOKENS" $EXTRA_CONVERT --json >"$OUT/convert-t$t.json"
    echo "$((SECONDS - start))" >"$OUT/convert-t$t.seconds"
    for mode in certified predicted; do
        target/release/leanstream perplexity --model "$lsb" --file "$text" --ctx "$CTX" \
            --sparsity "$mode" --reference dense --json >"$OUT/ppl-t$t-$mode.json"
    done
done

table
