#!/usr/bin/env python3
"""Independent perplexity reference for SmolLM2-135M-Instruct (not run by CI).

llama.cpp (through llama-cpp-python 0.3.x, `pip install llama-cpp-python`) scores the same
windows as `leanstream perplexity --ctx 512`: the text is tokenized without BOS, cut into
consecutive windows of 512 tokens (a last window shorter than 2 tokens dropped), each window is
evaluated from an empty cache with the logits of every position, and every token after the first
of its window is scored. (llama.cpp's own `llama-perplexity` scores only the second half of each
window, so its numbers are not comparable.)

Two runs:
- `llama_cpp_f32`: the GGUF requantized by llama.cpp to all-F32 (llama_model_quantize, so
  llama.cpp's own dequantization of Q4_1/Q8_0), with an f32 KV cache: the same weights as
  LeanStream's dense f32 engine, so the perplexities should agree to float rounding;
- `llama_cpp_q4_1`: the file as shipped, llama.cpp's usual quantized kernels (activations rounded
  to 8 bits in its dot products), for context.

Writes runtime/tests/fixtures/smollm2-perplexity.json, which runtime/tests/smollm2.rs compares
with `leanstream perplexity` on the same part of the text.
"""

import argparse
import ctypes
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp
import llama_cpp.llama_cpp as llama_cpp_c
import numpy as np
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "runtime/tests/fixtures/smollm2-perplexity.json"
TEXT = "data/heldout-head.txt"
CTX = 512
GGML_TYPE_F32 = 0
LLAMA_FTYPE_ALL_F32 = 0


def without_extra_buffer_types():
    """Load weights into plain CPU buffers: a GGML_NATIVE build of llama.cpp sees AMX in this
    machine's CPUID, and its AMX matmul for Q4_1 crashes here (SIGSEGV in ggml_backend_amx_mul_mat).
    Llama() takes no option for it, so its default model parameters are wrapped."""
    default = llama_cpp_c.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp_c.llama_model_default_params = params


def smollm2_path():
    if os.environ.get("LEANSTREAM_SMOLLM2"):
        return Path(os.environ["LEANSTREAM_SMOLLM2"])
    cache = os.environ.get("LEANSTREAM_CACHE") or Path.home() / ".cache/leanstream"
    return Path(cache) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def to_f32(src, dst):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"llama_model_quantize to F32 failed ({rc})")


def perplexity(gguf, ids, threads):
    llm = Llama(
        str(gguf),
        n_ctx=CTX,
        n_batch=CTX,
        n_ubatch=CTX,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        flash_attn=False,
        verbose=False,
    )
    windows = [ids[i : i + CTX] for i in range(0, len(ids), CTX)]
    windows = [w for w in windows if len(w) >= 2]
    nll, scored = 0.0, 0
    start = time.time()
    for w in windows:
        llm.reset()
        llm.eval(w)
        logits = np.asarray(llm.scores[: len(w)], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll -= float(sum(logp[i, w[i + 1]] for i in range(len(w) - 1)))
        scored += len(w) - 1
    print(f"{gguf.name}: {scored} tokens scored in {time.time() - start:.1f} s", file=sys.stderr)
    mean = nll / scored
    return {"perplexity": math.exp(mean), "mean_nll": mean, "tokens": scored}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, default=9000, help=f"score the first BYTES bytes of {TEXT} (whole lines)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write-fixture", action="store_true", help=f"write {FIXTURE.relative_to(ROOT)}")
    args = parser.parse_args()

    without_extra_buffer_types()
    gguf = smollm2_path()
    if not gguf.is_file():
        sys.exit(f"{gguf} is missing: run scripts/fetch-smollm2.sh")
    text = (ROOT / TEXT).read_bytes()
    if args.bytes < len(text):
        text = text[: text.rindex(b"\n", 0, args.bytes) + 1]
    vocab = Llama(str(gguf), vocab_only=True, verbose=False)
    ids = vocab.tokenize(text, add_bos=False, special=True)
    result = {
        "about": "llama.cpp's perplexity of SmolLM2-135M-Instruct on the first text_bytes bytes of "
        f"{TEXT}, windows of {CTX} tokens scored like `leanstream perplexity`; llama_cpp_f32 runs "
        "the weights dequantized to F32 by llama.cpp (llama_model_quantize) with an F32 KV cache, "
        f"llama_cpp_q4_1 the file as shipped. llama-cpp-python {llama_cpp.__version__}. Written by "
        "scripts/smollm2-reference-perplexity.py --write-fixture.",
        "text": TEXT,
        "text_bytes": len(text),
        "ctx": CTX,
        "tokens": sum(len(w) - 1 for w in (ids[i : i + CTX] for i in range(0, len(ids), CTX)) if len(w) >= 2),
    }
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "smollm2-f32.gguf"
        to_f32(gguf, f32)
        result["llama_cpp_f32"] = perplexity(f32, ids, args.threads)
    result["llama_cpp_q4_1"] = perplexity(gguf, ids, args.threads)
    print(json.dumps(result, indent=1))
    if args.write_fixture:
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    main()
