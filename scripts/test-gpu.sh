#!/usr/bin/env bash
# The `gpu` feature's tests (docs/gpu.md) on Mesa's lavapipe, a Vulkan implementation that runs on
# the CPU: installs the Vulkan loader and Mesa's Vulkan drivers when they are missing (Debian
# packages), then builds the runtime with `--features gpu` and runs its GPU tests there. Any GPU of
# the machine is left out, so that the result is the same on every machine.
set -euo pipefail
cd "$(dirname "$0")/.."

icd() { ls /usr/share/vulkan/icd.d/lvp_icd.*.json 2>/dev/null | head -n1; }
if [ -z "$(icd)" ] || ! ldconfig -p | grep -q 'libvulkan\.so\.1'; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
fi
export VK_DRIVER_FILES="$(icd)" VK_ICD_FILENAMES="$(icd)"
cargo test --release -p leanstream --features gpu --lib -- gpu::
