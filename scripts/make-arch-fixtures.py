#!/usr/bin/env python3
"""Writes tiny random models of the architectures LeanStream reads, with transformers' own
per-token log-probabilities as the reference, into tests/fixtures/arch/.

Needs transformers (5.x) and torch (CPU is enough) in a virtual environment outside the repository,
e.g. `python3 -m venv ~/.cache/leanstream/venv && ~/.cache/leanstream/venv/bin/pip install torch
transformers safetensors gguf`. GGUF versions come from llama.cpp's own convert_hf_to_gguf.py: pass
the llama.cpp source folder with --llama-cpp (the PyPI sdist of llama-cpp-python vendors it under
vendor/llama.cpp: `pip download --no-binary :all: --no-deps llama-cpp-python`).

Every model uses the 4096-token byte-level BPE tokenizer of models/austen-relu so that the GGUF
converter has a vocabulary to write; the reference scores a fixed sequence of token ids (stored in
the JSON), so the comparison does not depend on any tokenizer.

Quantized fixtures: each model of QUANTIZED is made again at the widths llama.cpp's K-quants need
(rows that are multiples of 256), converted to F32 GGUF and quantized by llama.cpp's own
`llama-quantize` (pass its bin folder with --llama-bin; scripts/build-llamacpp.sh prints it) to each
of QUANT_TYPES, committed as NAME.TYPE.gguf. Each is dequantized back to F32 by llama-quantize, and
NAME.quant.json records, per file, its tensors' GGML types and a digest of every dequantized tensor
(so the test checks its own decoding against llama.cpp's without a 9 MB F32 file per type).

Sparsity-native models (SPARSE_NATIVE, PowerInfer-2's kinds): transformers has neither ProSparse's
FATReLU nor Bamboo/TurboSparse's dReLU, so each is built as its plain family with ReLU, its MLPs'
(or, for TurboSparse-Mixtral, its experts') forward replaced by the checkpoint's own (FATReLU `g if g >= t else 0` on the gate; ReLU on gate and
up), the reference computed with that forward (checked to differ from the plain one), and
config.json rewritten as the real checkpoints declare themselves. bamboo's GGUF is written with the
gguf package (no llama.cpp converter knows PowerInfer's `bamboo` architecture) in llama.cpp's
layout: llama tensor names, q/k rows permuted as llama.cpp's converter does.

Usage: make-arch-fixtures.py [--llama-cpp DIR] [--llama-bin DIR] [--only NAME,...]
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "arch"
TOKENIZER = ROOT / "models" / "austen-relu" / "tokenizer.json"
VOCAB = 4096
SEQ_LEN = 48
SEED = 20261204

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=None,
)

# name -> (config class, extra config, GGUF pre-tokenizer name or None for no GGUF)
MODELS = {
    # Llama 3.1/3.2: llama3 rope scaling, which llama.cpp writes as rope_freqs.weight. A small
    # original context puts the head's frequencies on all three sides of the llama3 band.
    "llama3": (
        "LlamaConfig",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        "llama-bpe",
    ),
    # SmolLM3: every fourth layer without rope (NoPE), as llama.cpp's smollm3 graph assumes.
    "smollm3": (
        "SmolLM3Config",
        dict(rope_theta=5000000.0, num_hidden_layers=4, no_rope_layer_interval=4),
        "llama-bpe",
    ),
    # Qwen2 / Qwen2.5: biases on q, k and v.
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, use_sliding_window=False), "qwen2"),
    # Qwen3-MoE as transformers 5 saves it (num_local_experts / num_experts, rope_parameters).
    "qwen3moe": (
        "Qwen3MoeConfig",
        dict(
            rope_theta=1000000.0,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        "qwen2",
    ),
    # Gemma 2: GeGLU (tanh GELU), sqrt(hidden)-scaled embedding, (1 + w) RMSNorm, sandwich norms,
    # attention and final logit soft-capping (caps low enough to bend random logits), every other
    # layer attending through a window shorter than the scored sequence.
    "gemma2": (
        "Gemma2Config",
        dict(
            rope_theta=10000.0,
            query_pre_attn_scalar=16,
            sliding_window=16,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
        ),
        "llama-bpe",
    ),
    # Gemma 3 (text): q/k norms, five sliding layers with the local rope base, then one global.
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=6,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            query_pre_attn_scalar=16,
            sliding_window=16,
        ),
        "llama-bpe",
    ),
    # Phi-3.5: fused qkv_proj and gate_up_proj, LongRoPE whose long factors apply since the scored
    # sequence is longer than the original context.
    "phi3": (
        "Phi3Config",
        dict(
            max_position_embeddings=256,
            original_max_position_embeddings=32,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],
                original_max_position_embeddings=32,
            ),
            sliding_window=None,
        ),
        "llama-bpe",
    ),
}


# The FATReLU threshold of the prosparse fixture (ProSparse's own is 0.01; a larger one zeroes a
# measurable share of these random gates).
FATRELU_THRESHOLD = 0.25

# name -> (config class, extra config, config.json as the checkpoint declares itself, FFN)
SPARSE_NATIVE = {
    # ProSparse's ReLU-fied Llama 2: SparseLlamaForCausalLM, FATReLU with hidden_act_param.
    "prosparse": (
        "LlamaConfig",
        dict(rope_theta=10000.0, hidden_act="relu"),
        dict(
            architectures=["SparseLlamaForCausalLM"],
            model_type="sparsellama",
            hidden_act="fatrelu",
            hidden_act_param=FATRELU_THRESHOLD,
        ),
        "fatrelu",
    ),
    # Bamboo / TurboSparse-Mistral: BambooForCausalLM, hidden_act "relu" on gate and up (dReLU).
    "bamboo": (
        "MistralConfig",
        dict(rope_theta=10000.0, hidden_act="relu", sliding_window=None),
        dict(architectures=["BambooForCausalLM"], model_type="bamboo"),
        "drelu",
    ),
    # TurboSparse-Mixtral: TurboSparseMixtralForCausalLM, Mixtral's mixture with dReLU experts.
    "turbosparse-mixtral": (
        "MixtralConfig",
        dict(
            rope_theta=10000.0,
            hidden_act="relu",
            sliding_window=None,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        dict(architectures=["TurboSparseMixtralForCausalLM"], model_type="turbosparsemixtral"),
        "drelu-experts",
    ),
}


def sparse_forward(mlp, ffn):
    """The checkpoint's own MLP forward: ProSparse's FATReLU or Bamboo's dReLU."""
    def fatrelu(x):
        g = mlp.gate_proj(x)
        return mlp.down_proj(torch.where(g >= FATRELU_THRESHOLD, g, torch.zeros_like(g)) * mlp.up_proj(x))

    def drelu(x):
        return mlp.down_proj(torch.relu(mlp.gate_proj(x)) * torch.relu(mlp.up_proj(x)))

    def drelu_experts(x, top_k_index, top_k_weights):
        # Mixtral's expert loop (transformers' MixtralExperts) with ReLU on gate and up.
        ex = mlp.experts
        out = torch.zeros_like(x)
        for e in range(ex.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            gate, up = torch.nn.functional.linear(x[tok], ex.gate_up_proj[e]).chunk(2, dim=-1)
            h = torch.nn.functional.linear(torch.relu(gate) * torch.relu(up), ex.down_proj[e])
            out.index_add_(0, tok, h * top_k_weights[tok, pos, None])
        return out

    return {"fatrelu": fatrelu, "drelu": drelu, "drelu-experts": drelu_experts}[ffn]


def tokens():
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(1, VOCAB, (SEQ_LEN,), generator=g).tolist()


def make(name, cls, extra, out, std=0.08, ffn=None, declared=None):
    torch.manual_seed(SEED)
    cfg = getattr(transformers, cls)(**{**COMMON, **extra})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init at std 0.02 makes near-uniform logits; larger weights make the test sharper.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif n.endswith(".bias"):
                p.normal_(0.0, 0.5)
            else:
                p.uniform_(0.5, 1.5)
    model.eval()
    ids = tokens()
    if ffn:
        with torch.no_grad():
            plain = model(torch.tensor([ids])).logits[0]
        for layer in model.model.layers:
            if ffn == "drelu-experts":
                layer.mlp.experts.forward = sparse_forward(layer.mlp, ffn)
            else:
                layer.mlp.forward = sparse_forward(layer.mlp, ffn)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    if declared:
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(declared)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.copy(TOKENIZER, out / "tokenizer.json")
    if cls.startswith(("Gemma", "Phi3")):
        # Else AutoTokenizer picks the family's own tokenizer class, which adds special tokens.
        (out / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}\n')
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    if ffn:
        moved = (logits - plain.double()).abs().max().item()
        assert moved > 1e-2, f"{name}: the {ffn} forward changes nothing ({moved})"
    logp = torch.log_softmax(logits, dim=-1)
    per_token = [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    nll = -sum(per_token) / len(per_token)
    ref = {
        "architecture": name,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "token_ids": ids,
        "log_probs": per_token,
        "perplexity": math.exp(nll),
    }
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(f"{name}: perplexity {ref['perplexity']:.6f} over {len(per_token)} tokens")


WRAPPER = """
import sys
sys.argv = [sys.argv[0]] + sys.argv[2:]
pre = sys.argv.pop()
sys.path.insert(0, {src!r})
sys.path.insert(1, {src!r} + '/gguf-py')
import conversion.base as base
# The fixtures' tokenizer is not one of llama.cpp's known ones; name the pre-tokenizer its model has.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
# Gemma 2's and Phi-3's converters read a SentencePiece tokenizer.model; the fixtures have BPE.
import conversion.gemma, conversion.phi
conversion.gemma.Gemma2Model.set_vocab = base.TextModel._set_vocab_gpt2
conversion.phi.Phi3MiniModel.set_vocab = base.TextModel._set_vocab_gpt2
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def gguf(src, folder, pre, out):
    code = WRAPPER.format(src=str(src))
    subprocess.run(
        [sys.executable, "-c", code, "x", str(folder), "--outtype", "f32", "--outfile", str(out), pre],
        check=True,
    )


# Quantized variants: name -> (model of MODELS, widths replacing COMMON's). Hidden 256 and FFN 512
# so that llama-quantize really writes K-quants (it falls back to other types for narrower rows).
# The widths llama.cpp's K-quants hold (rows of 256: hidden 256, FFN 512, 4 heads of 64).
K_WIDTHS = dict(hidden_size=256, intermediate_size=512, head_dim=64, max_position_embeddings=256)

QUANTIZED = {
    "llama-k": ("llama3", K_WIDTHS),
    "qwen2-k": ("qwen2", K_WIDTHS),
    "smollm3-k": ("smollm3", K_WIDTHS),
    "gemma2-k": ("gemma2", {**K_WIDTHS, "query_pre_attn_scalar": 64}),
    # LongRoPE's factors, one per rotary frequency of a 64-wide head.
    "phi3-k": (
        "phi3",
        {
            **K_WIDTHS,
            "rope_parameters": dict(
                rope_type="longrope",
                rope_theta=10000.0,
                short_factor=[1.0 + 0.05 * i for i in range(32)],
                long_factor=[1.0 + 0.6 * i for i in range(32)],
                original_max_position_embeddings=32,
            ),
        },
    ),
}
QUANT_TYPES = ["Q8_0", "Q4_K_M", "Q6_K"]
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}


def digest(values):
    """sum of bits(x_i) * (2i + 1) mod 2^64 over the little-endian f32 values in file order: any
    one changed value changes it (the weights are odd); tests/tests/integration/quant_fixtures.rs
    computes the same."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype="<f4").reshape(-1).view("<u4").astype(np.uint64)
    weights = np.arange(bits.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    with np.errstate(over="ignore"):
        return int(np.sum(bits * weights, dtype=np.uint64))


def quantize(llama_cpp, llama_bin, name, base, widths):
    import tempfile

    sys.path.insert(0, str(Path(llama_cpp) / "gguf-py"))
    import gguf as gguf_py

    cls, extra, pre = MODELS[base]
    quantize_bin = Path(llama_bin) / "llama-quantize"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # Four times as wide: half the spread keeps the logits as sharp as the 64-wide models'.
        make(name, cls, {**extra, **widths}, tmp / name, std=0.03)
        f32 = tmp / f"{name}.f32.gguf"
        gguf(llama_cpp, tmp / name, pre, f32)
        record = {"source": base, "widths": widths, "token_ids": tokens(), "files": {}}
        for qtype in QUANT_TYPES:
            out = OUT / f"{name}.{qtype.lower()}.gguf"
            subprocess.run([str(quantize_bin), str(f32), str(out), qtype], check=True,
                           stdout=subprocess.DEVNULL)
            back = tmp / f"{name}.{qtype}.dequantized.gguf"
            subprocess.run([str(quantize_bin), "--allow-requantize", str(out), str(back), "F32"],
                           check=True, stdout=subprocess.DEVNULL)
            types = {t.name: GGML_TYPE_NAMES.get(int(t.tensor_type), str(int(t.tensor_type)))
                     for t in gguf_py.GGUFReader(out).tensors}
            digests = {t.name: str(digest(t.data)) for t in gguf_py.GGUFReader(back).tensors}
            record["files"][out.name] = {"types": types, "dequantized_f32": digests}
            print(f"{out.name}: {out.stat().st_size} bytes, types {sorted(set(types.values()))}")
        (OUT / f"{name}.quant.json").write_text(json.dumps(record, indent=1) + "\n")


def bamboo_gguf(folder, out):
    """The bamboo fixture as an F32 GGUF of PowerInfer's architecture name in llama.cpp's layout."""
    import gguf as gguf_py
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(folder / "model.safetensors")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def permute(t, n):
        # llama.cpp's converter: rotate-half rows to interleaved pairs, per head.
        return t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    wr = gguf_py.GGUFWriter(str(out), "bamboo")
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(heads)
    wr.add_head_count_kv(kv_heads)
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    wr.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    wr.add_rope_dimension_count(cfg["head_dim"])
    wr.add_eos_token_id(cfg["eos_token_id"])
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    wr.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    wr.add_tensor("output_norm.weight", w["model.norm.weight"])
    for l in range(cfg["num_hidden_layers"]):
        for hf, gg in names.items():
            t = w[f"model.layers.{l}.{hf}.weight"]
            if hf == "self_attn.q_proj":
                t = permute(t, heads)
            elif hf == "self_attn.k_proj":
                t = permute(t, kv_heads)
            wr.add_tensor(f"blk.{l}.{gg}.weight", t)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path)
    ap.add_argument("--llama-bin", type=Path)
    ap.add_argument("--only")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    OUT.mkdir(parents=True, exist_ok=True)
    for name, (cls, extra, pre) in MODELS.items():
        if only and name not in only:
            continue
        folder = OUT / name
        make(name, cls, extra, folder)
        if args.llama_cpp and pre:
            gguf(args.llama_cpp, folder, pre, OUT / f"{name}.f32.gguf")
    for name, (cls, extra, declared, ffn) in SPARSE_NATIVE.items():
        if only and name not in only:
            continue
        folder = OUT / name
        make(name, cls, extra, folder, ffn=ffn, declared=declared)
        if name == "bamboo":
            bamboo_gguf(folder, OUT / f"{name}.f32.gguf")
    for name, (base, widths) in QUANTIZED.items():
        if only and name not in only:
            continue
        if args.llama_cpp and args.llama_bin:
            quantize(args.llama_cpp, args.llama_bin, name, base, widths)


if __name__ == "__main__":
    main()
