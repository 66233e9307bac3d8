#!/usr/bin/env bash
# Regenerates the C API's header, runtime/capi/include/leanstream.h, from runtime/capi/src/lib.rs
# with cbindgen (`cargo install cbindgen`). The header is checked in so that apps, and CI, build
# without cbindgen; runtime/capi/tests/c_example.rs checks that it declares every exported function.
set -euo pipefail
cd "$(dirname "$0")/../runtime/capi"
command -v cbindgen >/dev/null || { echo "cbindgen is not installed: cargo install cbindgen" >&2; exit 1; }
cbindgen --config cbindgen.toml --crate leanstream-capi --output include/leanstream.h.tmp
mv include/leanstream.h.tmp include/leanstream.h
echo "wrote runtime/capi/include/leanstream.h"
