#!/usr/bin/env bash
# The `gpu` feature's tests (docs/gpu.md) on Mesa's lavapipe, a Vulkan implementation that runs on
# the CPU: installs the Vulkan loader and Mesa's Vulkan drivers when they are missing (Debian
# packages), then builds the runtime with its `gpu` feature and runs its GPU tests there. Any GPU of
# the machine is left out, so that the result is the same on every machine.
set -euo pipefail
cd "$(dirname "$0")/.."

icd() { ls /usr/share/vulkan/icd.d/lvp_icd.*.json 2>/dev/null | head -n1; }
if [ -z "$(icd)" ] || ! ldconfig -p | grep 'libvulkan\.so\.1' >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
fi
export VK_DRIVER_FILES="$(icd)" VK_ICD_FILENAMES="$(icd)"
# `--workspace`, as CI's test step: the dependencies' features are then the ones that step built
# (`-p leanstream` alone, or leaving out the C API and the tests crate, would resolve some differently
# and rebuild them: 5 min 33 s against 2 min 51 s here); only wgpu's crates and the crates above the
# runtime are built again. Its GPU tests are named `gpu::`.
# The converted-file tests convert with `leanstream-prep`, found beside the test binary's folder: it
# comes from the test suite's own build (a no-op after CI's test step; `cargo build --bins` would
# resolve the dependencies' features without the dev-dependencies and build most of them again).
cargo test --release --workspace --no-run
cargo test --release --workspace --features leanstream/gpu --lib -- gpu::
