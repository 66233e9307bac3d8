#!/usr/bin/env bash
# Builds llama.cpp's llama-quantize, llama-bench and llama-perplexity from the llama.cpp that the
# PyPI sdist of llama-cpp-python vendors, and prints the folder that holds them.
#
# The build is cached outside the repository ($LEANSTREAM_CACHE, else ~/.cache/leanstream, under
# llamacpp-build/): a second run prints the folder at once. Not a native build (AMX routes Q4
# matrices through a path that crashes in this project's VMs): the SIMD levels are this CPU's.
# Installs cmake from PyPI when missing. Needs python3, pip and a C++ compiler.
# usage: scripts/build-llamacpp.sh [JOBS=2]
set -euo pipefail

jobs="${1:-2}"
cache="${LEANSTREAM_CACHE:-$HOME/.cache/leanstream}/llamacpp-build"
bin="$cache/build/bin"
targets=(llama-quantize llama-bench llama-perplexity)

have_all() {
    local t
    for t in "${targets[@]}"; do [[ -x "$bin/$t" ]] || return 1; done
}
if have_all; then
    echo "$bin"
    exit 0
fi

mkdir -p "$cache"
if ! command -v cmake >/dev/null; then
    echo "installing cmake from PyPI ..." >&2
    pip install --quiet cmake >&2
fi
if [[ ! -f "$cache/src/CMakeLists.txt" ]]; then
    tmp="$(mktemp -d "$cache/.sdist.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    # An sdist already in the cache (as the llama.cpp comparison scripts leave it), else PyPI's.
    # `--no-binary llama-cpp-python`, not `:all:`: its build dependencies (cmake, ...) as wheels.
    sdist="$(ls "$cache"/../llamacpp/llama_cpp_python-*.tar.gz 2>/dev/null | tail -1 || true)"
    if [[ -z "$sdist" ]]; then
        echo "fetching the llama-cpp-python sdist (vendors llama.cpp) ..." >&2
        pip download --quiet --no-binary llama-cpp-python --no-deps llama-cpp-python -d "$tmp" >&2
        sdist="$(ls "$tmp"/llama_cpp_python-*.tar.gz)"
    fi
    tar -xzf "$sdist" -C "$tmp"
    rm -rf "$cache/src"
    mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$cache/src"
fi

flags=(-DGGML_NATIVE=OFF -DGGML_AMX=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release)
for f in avx avx2 fma f16c avx512f avx512_vnni avx512_bf16 avx512vbmi; do
    if grep -qw "$f" /proc/cpuinfo; then
        case $f in
            avx512f) flags+=(-DGGML_AVX512=ON) ;;
            avx512vbmi) flags+=(-DGGML_AVX512_VBMI=ON) ;;
            *) flags+=("-DGGML_${f^^}=ON") ;;
        esac
    fi
done
echo "building llama.cpp (${flags[*]}) ..." >&2
cmake -S "$cache/src" -B "$cache/build" "${flags[@]}" >&2
cmake --build "$cache/build" -j "$jobs" --target "${targets[@]}" >&2
have_all
echo "$bin"
