#!/usr/bin/env bash
# Times every test binary of the workspace: builds them once (`cargo test --release --workspace
# --no-run`, timed), then runs each with `--test-threads ${THREADS:-2}` from its package's folder,
# as `cargo test` would, and prints one line per binary, slowest first: seconds, exit status,
# package, target and its `test result:` line. Logs land in target/test-times/.
#
#   scripts/time-tests.sh [CARGO TEST ARGS...]     e.g. -p leanstream-tests
set -uo pipefail
cd "$(dirname "$0")/.."
logs=target/test-times
mkdir -p "$logs"
LEANSTREAM_SMOLLM2="${LEANSTREAM_SMOLLM2:-$(bash scripts/fetch-smollm2.sh)}"
export LEANSTREAM_SMOLLM2
start=$(date +%s.%N)
cargo test --release --workspace --no-run --message-format=json "$@" >"$logs/build.json" 2>"$logs/build.log" || {
    tail -20 "$logs/build.log"
    exit 1
}
echo "build: $(echo "$(date +%s.%N) - $start" | bc) s"
python3 - "$logs/build.json" >"$logs/binaries.tsv" <<'PY'
import json, os, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        t = m["target"]
        print(m["executable"], os.path.dirname(m["manifest_path"]), t["name"], t["kind"][0], sep="\t")
PY
total=$(date +%s.%N)
while IFS=$'\t' read -r exe dir name kind; do
    log="$logs/$(basename "$dir")-$name-$kind.log"
    s=$(date +%s.%N)
    (cd "$dir" && "$exe" --test-threads "${THREADS:-2}") >"$log" 2>&1
    rc=$?
    printf "%7.1f\t%s\t%s\t%s(%s)\t%s\n" "$(echo "$(date +%s.%N) - $s" | bc)" "$rc" "$(basename "$dir")" \
        "$name" "$kind" "$(grep -E '^test result:' "$log" | tail -1)"
done <"$logs/binaries.tsv" | sort -rn
echo "tests: $(echo "$(date +%s.%N) - $total" | bc) s"
