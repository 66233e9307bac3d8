# Sourced by the llama.cpp comparison scripts: installs llama-cpp-python (PyPI; its install builds
# llama.cpp, about 10 minutes here) when missing.
install_llamacpp() {
    python3 -c "import llama_cpp" 2>/dev/null && return
    # Not a native build: on CPUs with AMX that one routes Q4 matrices through AMX, which crashes
    # (segfault in decode) in this project's VMs. The SIMD levels are those of this CPU.
    local flags="-DGGML_NATIVE=OFF" f
    for f in avx avx2 fma f16c avx512f avx512_vnni avx512_bf16 avx512vbmi; do
        if grep -qw "$f" /proc/cpuinfo; then
            case $f in
                avx512f) flags+=" -DGGML_AVX512=ON" ;;
                avx512vbmi) flags+=" -DGGML_AVX512_VBMI=ON" ;;
                *) flags+=" -DGGML_${f^^}=ON" ;;
            esac
        fi
    done
    echo "installing llama-cpp-python (builds llama.cpp: $flags) ..." >&2
    # --no-cache-dir: a wheel pip cached from a build with other CMAKE_ARGS would be reused as is.
    CMAKE_ARGS="$flags" pip install --quiet --no-cache-dir llama-cpp-python >&2
}

# Same measure as leanstream's tokens_per_s (with --ignore-eos): decode steps after the first
# generated token, never stopping at an end-of-sequence token.
# usage: llamacpp_rate MODEL.gguf PROMPT TOKENS THREADS
llamacpp_rate() {
    python3 - "$@" <<'EOF'
import os, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama

if os.environ.get("LLAMACPP_NO_REPACK") == "1":
    # The weights stay in the mapped file: no CPU repack copies (llama.cpp's use_extra_bufts).
    default = llama_cpp.llama_model_default_params
    def params():
        p = default()
        p.use_extra_bufts = False
        return p
    llama_cpp.llama_model_default_params = params
    import llama_cpp.llama
    llama_cpp.llama.llama_cpp.llama_model_default_params = params

path, prompt, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
vocab = llm.n_vocab()
def next_token():
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))
llm.eval(llm.tokenize(prompt.encode(), add_bos=True))
tok = next_token()
start = time.perf_counter()
for _ in range(n - 1):
    llm.eval([tok])
    tok = next_token()
print(f"{(n - 1) / (time.perf_counter() - start):.3g}")
EOF
}

# Prefill and decode rates of one run: the prompt text evaluated in batches of 512 tokens, then
# TOKENS greedy decode steps. Prints "PROMPT_TOKENS PREFILL_TOK_S DECODE_TOK_S".
# usage: llamacpp_prefill_decode MODEL.gguf PROMPT TOKENS THREADS
llamacpp_prefill_decode() {
    python3 - "$@" <<'EOF'
import sys, time
import numpy as np
from llama_cpp import Llama

path, prompt, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads,
            verbose=False)
vocab = llm.n_vocab()
ids = llm.tokenize(prompt.encode(), add_bos=True)
def next_token():
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))
start = time.perf_counter()
llm.eval(ids)
tok = next_token()
prefill = time.perf_counter() - start
start = time.perf_counter()
for _ in range(n - 1):
    llm.eval([tok])
    tok = next_token()
print(f"{len(ids)} {len(ids) / prefill:.4g} {(n - 1) / (time.perf_counter() - start):.4g}")
EOF
}
