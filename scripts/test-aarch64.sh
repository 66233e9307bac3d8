#!/usr/bin/env bash
# Proves the aarch64 build under emulation (no ARM machine needed): cross-builds the runtime's
# kernel tests and the `leanstream` binary for aarch64-unknown-linux-gnu and runs them under
# qemu-aarch64, on a CPU model with dotprod and i8mm (`-cpu max`) and on one without
# (`-cpu cortex-a72`), so both branches of the kernel detection run:
#
#  1. the kernel tests (every encoding: dot, axpy, mat-vec, mat-mat, bundle FFN, against f64
#     references) with each kernel set forced in turn through LEANSTREAM_KERNELS (neon-dotprod
#     where the CPU has it, neon, portable); forcing neon-dotprod on the CPU without it must fail
#     with the error that names the choices;
#  2. end to end on the embedded model, converted here (x86) to q8 and q4 files: the perplexity of
#     the start of data/heldout-head.txt (--policy resident: one token at a time, through the
#     mat-vec and bundle kernels) and a greedy text with each step's top-2 logit margin, under each
#     NEON kernel set, equal bit for bit to the x86 run with the portable kernels (the NEON kernels
#     give the portable ones' bits: runtime/src/kernels/neon.rs says why); the difference to the
#     x86 run with its fastest kernels (AVX-512 or AVX2: another summation order) is reported next
#     to the difference between x86's own kernel sets; and a streaming run under a budget (--flash
#     ufs4, most of the FFN on flash) equal to `resident` on the same CPU bit for bit.
#
# Installs what it needs (Debian: qemu-user, gcc-aarch64-linux-gnu; rustup: the target) and fails
# loudly if it cannot; never skips. The cross build has its own target directory
# ($LEANSTREAM_AARCH64_TARGET_DIR, default target/aarch64-cross) so the x86 one is not disturbed.
# Prints a summary table of the runs (and writes it as JSON to $LEANSTREAM_AARCH64_REPORT if set).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=aarch64-unknown-linux-gnu
SYSROOT=/usr/aarch64-linux-gnu
CROSS_DIR="${LEANSTREAM_AARCH64_TARGET_DIR:-target/aarch64-cross}"
TOKENS=48
PROMPT="It was a fine morning, and Emma"

die() {
  echo "test-aarch64: FAILED: $*" >&2
  exit 1
}
say() { echo "test-aarch64: $*" >&2; }

# --- Tools ---------------------------------------------------------------------------------------
apt_install() {
  local runner=()
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || die "$* missing and not root (no sudo): install Debian's $* and re-run"
    runner=(sudo -n)
  fi
  command -v apt-get >/dev/null || die "$* missing and no apt-get: install $* (qemu-user, an aarch64 gcc cross linker) and re-run"
  say "installing $*"
  DEBIAN_FRONTEND=noninteractive "${runner[@]}" apt-get install -y --no-install-recommends "$@" >&2 ||
    { "${runner[@]}" apt-get update >&2 && DEBIAN_FRONTEND=noninteractive "${runner[@]}" apt-get install -y --no-install-recommends "$@" >&2; } ||
    die "could not install $*"
}
command -v qemu-aarch64 >/dev/null || apt_install qemu-user
command -v aarch64-linux-gnu-gcc >/dev/null || apt_install gcc-aarch64-linux-gnu libc6-dev-arm64-cross
[ -e "$SYSROOT/lib/ld-linux-aarch64.so.1" ] || apt_install libc6-dev-arm64-cross
command -v qemu-aarch64 >/dev/null || die "qemu-aarch64 still missing after installing qemu-user"
command -v aarch64-linux-gnu-gcc >/dev/null || die "aarch64-linux-gnu-gcc still missing"
rustup target list --installed | grep -qx "$TARGET" || rustup target add "$TARGET" >&2 ||
  die "rustup target add $TARGET failed"
command -v python3 >/dev/null || die "python3 is needed to compare the runs' JSON"

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
unset LEANSTREAM_KERNELS

qemu() { # CPU, then the command
  local cpu=$1
  shift
  qemu-aarch64 -L "$SYSROOT" -cpu "$cpu" "$@"
}

# --- Builds: only what runs ----------------------------------------------------------------------
t0=$(date +%s)
# The host binaries through the test suite's build (the form CI has just built, so this is a no-op
# there; `cargo build -p ...` would resolve other dependency features and recompile them).
say "host (x86) leanstream and leanstream-prep"
cargo test --release --workspace --no-run >&2
HOST_LS=target/release/leanstream
HOST_PREP=target/release/leanstream-prep
say "cross build: leanstream (bin) and its unit tests for $TARGET in $CROSS_DIR"
t_cross=$(date +%s)
# (no debug line tables in the cross build: less to compile and link, the same code)
export CARGO_PROFILE_RELEASE_DEBUG=false
# Dependencies these runs never exercise at length are optimized less: GGUF reading (candle-core:
# the runs read converted files), chat templates, argument and config parsing, the HTTP server,
# and the C part of zstd and the tokenizer's regexes (small inputs here); not gemm, whose f16
# kernels' inline assembly needs the optimizer's inlining to compile for aarch64. They still compile for aarch64; the kernels and everything on the token path (leanstream,
# gemm's f32 kernels, rayon, half, xxhash) keep the release settings, so the bits compared below are
# the release build's. Measured on a fresh target directory (the binary alone): 504 s of compiler
# CPU time before, 219 s after.
lighter=()
for p in candle-core minijinja minijinja-contrib clap_builder toml tiny_http zip typed-path; do
  lighter+=(--config "profile.release.package.$p.opt-level=0")
done
for p in zstd-sys tokenizers regex-automata fancy-regex; do
  lighter+=(--config "profile.release.package.$p.opt-level=1")
done
cross=(--release --target "$TARGET" --target-dir "$CROSS_DIR" -p leanstream "${lighter[@]}")
cargo build "${cross[@]}" --bin leanstream >&2
ARM_LS="$CROSS_DIR/$TARGET/release/leanstream"
test_out=$(cargo test "${cross[@]}" --lib --no-run 2>&1) || { echo "$test_out" >&2; die "cross build of the unit tests"; }
ARM_TESTS=$(echo "$test_out" | sed -n 's/.*Executable unittests src\/lib.rs (\(.*\))$/\1/p' | tail -1)
[ -x "$ARM_TESTS" ] || { echo "$test_out" >&2; die "unit-test binary not found in cargo's output"; }
[ "$(od -An -tx1 -j18 -N2 "$ARM_LS" | tr -d " ")" = b700 ] ||
  die "$ARM_LS is not an aarch64 binary"
unset CARGO_PROFILE_RELEASE_DEBUG
t_build=$(($(date +%s) - t0)) t_cross=$(($(date +%s) - t_cross))
say "builds took ${t_build}s (the cross build ${t_cross}s)"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/leanstream-aarch64.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
RESULTS="$WORK/results.jsonl"
: >"$RESULTS"
record() { echo "$1" >>"$RESULTS"; }

# --- Detection ----------------------------------------------------------------------------------
# The unforced binary must pick neon-dotprod on `max` and neon on cortex-a72; forcing a set the CPU
# lacks must be refused with the error naming the choices.
check_detected() { # CPU, expected set
  local got
  got=$(qemu "$1" "$ARM_LS" run --model models/austen-relu -p "Emma" -n 1 --json 2>"$WORK/err" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["kernels"])') ||
    { cat "$WORK/err" >&2; die "run under -cpu $1"; }
  [ "$got" = "$2" ] || die "-cpu $1 picked $got, expected $2"
  say "-cpu $1: detected $got"
}
check_detected max neon-dotprod
check_detected cortex-a72 neon
if LEANSTREAM_KERNELS=neon-dotprod qemu cortex-a72 "$ARM_LS" run --model models/austen-relu -p Emma -n 1 \
  >/dev/null 2>"$WORK/err"; then
  die "forcing neon-dotprod on cortex-a72 (no dotprod) was accepted"
fi
grep -q 'LEANSTREAM_KERNELS=neon-dotprod: this CPU does not run those kernels; it runs neon, portable' "$WORK/err" ||
  { cat "$WORK/err" >&2; die "forcing neon-dotprod on cortex-a72: unexpected error"; }
say "-cpu cortex-a72: forcing neon-dotprod is refused: $(cat "$WORK/err")"

# --- Kernel tests --------------------------------------------------------------------------------
# CPU:set pairs. The tests compare every set the CPU runs against f64; forcing sets the one the
# mat-mat, row-stream and bundle FFN paths use (and best_follows_the_environment checks it). Each
# set runs once: forced neon on -cpu max runs the same instructions as on cortex-a72 (52 s saved).
for run in max:neon-dotprod cortex-a72:neon cortex-a72:portable; do
  cpu=${run%%:*} set=${run#*:}
  say "kernel tests, -cpu $cpu, LEANSTREAM_KERNELS=$set"
  s=$(date +%s)
  LEANSTREAM_KERNELS=$set qemu "$cpu" "$ARM_TESTS" --test-threads 2 --nocapture kernels:: >"$WORK/kt" 2>"$WORK/kt.err" ||
    { cat "$WORK/kt" "$WORK/kt.err" >&2; die "kernel tests failed under -cpu $cpu with $set"; }
  grep -q 'test result: ok' "$WORK/kt" || { cat "$WORK/kt" >&2; die "no test result"; }
  n=$(sed -n 's/.*test result: ok\. \([0-9]*\) passed.*/\1/p' "$WORK/kt")
  [ "${n:-0}" -ge 10 ] || { cat "$WORK/kt" >&2; die "only ${n:-0} kernel tests ran"; }
  grep "^max-error " "$WORK/kt.err" | while read -r _ kernel isa qtype err; do
    record "{\"kind\":\"max-error\",\"cpu\":\"$cpu\",\"op\":\"$kernel\",\"kernels\":\"$isa\",\"qtype\":\"$qtype\",\"rel_err\":$err}"
  done
  record "{\"kind\":\"kernel-tests\",\"cpu\":\"$cpu\",\"kernels\":\"$set\",\"passed\":$n,\"seconds\":$(($(date +%s) - s))}"
done

# --- End to end ----------------------------------------------------------------------------------
compare() { # quant, kind, x86 portable json, x86 fastest json, arm json, cpu, set
  python3 - "$@" >>"$RESULTS" <<'EOF'
import json, sys
name, kind, port, fast, arm, cpu, kset = sys.argv[1:]
p, f, b = (json.load(open(x)) for x in (port, fast, arm))
if b.get("kernels") != kset:
    sys.exit(f"{name}: ran {b.get('kernels')}, expected {kset}")
out = {"kind": kind, "file": name, "cpu": cpu, "kernels": kset, "x86_fast": f["kernels"]}
if kind == "perplexity":
    if (b["perplexity"], b["tokens"]) != (p["perplexity"], p["tokens"]):
        sys.exit(f"{name} -cpu {cpu} {kset}: perplexity {b['perplexity']} over {b['tokens']} tokens, "
                 f"x86 portable {p['perplexity']} over {p['tokens']}: not bit for bit")
    rel = lambda x, y: abs(x["perplexity"] / y["perplexity"] - 1)
    out.update(arm=b["perplexity"], x86_portable=p["perplexity"], x86_fast_ppl=f["perplexity"],
               rel_vs_x86_fast=f"{rel(b, f):.2e}", x86_fast_vs_portable=f"{rel(f, p):.2e}",
               tokens=b["tokens"])
else:
    if (b["tokens"], b["top2_margins"]) != (p["tokens"], p["top2_margins"]):
        sys.exit(f"{name} -cpu {cpu} {kset}: greedy tokens or margins differ from x86 portable")
    # Against the fastest x86 set: where the texts part, and how close that choice was there.
    agree = 0
    while agree < min(len(b["tokens"]), len(f["tokens"])) and b["tokens"][agree] == f["tokens"][agree]:
        agree += 1
    out.update(tokens=len(b["tokens"]), agreed_with_x86_fast=agree)
    if agree < len(b["tokens"]):
        out["margin_where_parted"] = min(b["top2_margins"][agree], f["top2_margins"][agree])
print(json.dumps(out))
EOF
}

# The perplexity text: the first PPL_BYTES of data/heldout-head.txt (381 tokens, one ctx-512 window).
# Scored one token at a time by --policy resident, the whole file (16 952 tokens) would take tens of
# minutes per run under emulation; bit-for-bit equality needs no more text than this.
PPL_BYTES=1500
head -c "$PPL_BYTES" data/heldout-head.txt >"$WORK/heldout-prefix.txt"
for quant in q8 q4; do
  lsb="$WORK/austen-$quant.lsb"
  say "converting the embedded model to $quant (x86)"
  "$HOST_PREP" convert models/austen-relu -o "$lsb" --quant "$quant" --calib-tokens 2048 --cluster-kib 8 >/dev/null 2>"$WORK/err" ||
    { cat "$WORK/err" >&2; die "convert --quant $quant"; }
  ppl=(perplexity --model "$lsb" --file "$WORK/heldout-prefix.txt" --policy resident --json)
  gen=(run --model "$lsb" -p "$PROMPT" -n "$TOKENS" --temp 0 --repeat-penalty 1 --policy resident --json)
  # x86 with the portable kernels (what every NEON set must equal) and with its fastest.
  for x86 in portable fast; do
    force=$([ $x86 = portable ] && echo portable || true)
    LEANSTREAM_KERNELS=$force "$HOST_LS" "${ppl[@]}" >"$WORK/x86-$x86-ppl-$quant.json" ||
      die "x86 perplexity ($quant, $x86)"
    LEANSTREAM_KERNELS=$force "$HOST_LS" "${gen[@]}" >"$WORK/x86-$x86-gen-$quant.json" 2>/dev/null ||
      die "x86 greedy run ($quant, $x86)"
  done
  # (forced neon on -cpu max runs the same instructions as cortex-a72's detected neon; the kernel
  # tests above cover it)
  for run in max:neon-dotprod cortex-a72:neon; do
    cpu=${run%%:*} set=${run#*:}
    say "$quant end to end, -cpu $cpu, $set"
    for kind in ppl gen; do
      args=("${ppl[@]}") what=perplexity
      [ $kind = gen ] && args=("${gen[@]}") what=greedy
      out="$WORK/arm-$kind-$quant-$cpu-$set.json"
      LEANSTREAM_KERNELS=$set qemu "$cpu" "$ARM_LS" "${args[@]}" >"$out" 2>"$WORK/err" ||
        { cat "$WORK/err" >&2; die "aarch64 $what ($quant, -cpu $cpu, $set)"; }
      compare "$quant" "$what" "$WORK/x86-portable-$kind-$quant.json" "$WORK/x86-fast-$kind-$quant.json" \
        "$out" "$cpu" "$set" || die "$what ($quant, -cpu $cpu, $set)"
    done
  done
done

# Streaming under a budget on aarch64 (the q8 file, -cpu max, detected kernels): the planner's
# minimum there (qemu's own memory is part of the process) plus a quarter of the FFN bundles, the
# rest of the FFN streaming from an emulated UFS 4.0. Equal to resident token for token and in
# every margin (bit for bit).
lsb="$WORK/austen-q8.lsb"
# (the refusal exits non-zero: that is expected here, the pipeline must not fail on it)
min=$({ qemu max "$ARM_LS" run --model "$lsb" -p Emma -n 1 --memory 1 2>&1 >/dev/null || true; } |
  sed -n 's/.*minimum[^0-9]*\([0-9][0-9.]*\) MiB.*/\1/p' | head -1)
[ -n "$min" ] || die "could not read the planner's minimum from the refusal of --memory 1"
ffn=$("$HOST_PREP" inspect "$lsb" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["ffn_bytes"])')
budget=$(python3 -c "print(int($min * 2**20 + 0.25 * $ffn) + (1 << 20))")
say "streaming under --memory $budget (minimum $min MiB + a quarter of $ffn FFN bytes), --flash ufs4"
qemu max "$ARM_LS" run --model "$lsb" -p "$PROMPT" -n "$TOKENS" --temp 0 --repeat-penalty 1 \
  --policy leanstream --memory "$budget" --flash ufs4 --json >"$WORK/arm-stream.json" 2>"$WORK/err" ||
  { cat "$WORK/err" >&2; die "aarch64 streaming run"; }
python3 - "$WORK/arm-gen-q8-max-neon-dotprod.json" "$WORK/arm-stream.json" >>"$RESULTS" <<'EOF' || die "streaming != resident on aarch64"
import json, sys
r, s = (json.load(open(p)) for p in sys.argv[1:])
if s["kernels"] != r["kernels"]:
    sys.exit(f"kernels {s['kernels']} vs {r['kernels']}")
if s["tokens"] != r["tokens"] or s["top2_margins"] != r["top2_margins"]:
    sys.exit("streaming tokens or logits differ from resident")
if not s["bytes_read_per_token"] > 0:
    sys.exit("the streaming run read nothing from flash: the budget did not bind")
print(json.dumps({"kind": "streaming-vs-resident", "cpu": "max", "kernels": s["kernels"],
                  "tokens": len(s["tokens"]), "budget": s["memory_budget_bytes"],
                  "bytes_read_per_token": s["bytes_read_per_token"], "equal": True}))
EOF

total=$(($(date +%s) - t0))
record "{\"kind\":\"time\",\"build_seconds\":$t_build,\"cross_build_seconds\":$t_cross,\"total_seconds\":$total}"
[ -n "${LEANSTREAM_AARCH64_REPORT:-}" ] && cp "$RESULTS" "$LEANSTREAM_AARCH64_REPORT"
python3 - "$RESULTS" <<'EOF'
import json, sys
# Largest error per kernel, encoding, CPU and kernel set over every run, then the other records.
worst, cols = {}, []
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["kind"] != "max-error":
        continue
    col, row = f"{r['cpu']}/{r['kernels']}", (r["op"], r["qtype"])
    cols += [col] if col not in cols else []
    worst[row, col] = max(worst.get((row, col), 0.0), r["rel_err"])
print("max |kernel - f64| / sum|terms| (every run)")
print(f"{'kernel':26}{'type':6}" + "".join(f"{c:>24}" for c in cols))
for row in sorted({row for row, _ in worst}):
    print(f"{row[0]:26}{row[1]:6}" + "".join(
        f"{worst[row, c]:>24.2e}" if (row, c) in worst else f"{'-':>24}" for c in cols))
for line in open(sys.argv[1]):
    r = json.loads(line)
    k = r.pop("kind")
    if k != "max-error":
        print(f"{k:22} " + "  ".join(f"{a}={b}" for a, b in r.items()))
EOF
say "passed (${total}s, of which builds ${t_build}s)"
