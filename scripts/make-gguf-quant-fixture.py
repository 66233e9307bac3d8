#!/usr/bin/env python3
"""Writes runtime/tests/fixtures/quant-types.gguf (not run by CI).

One small tensor per GGML type LeanStream reads (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K), filled with random blocks, each under a llama tensor name, plus
`expected.<name>`: its values as llama.cpp's Python package `gguf` (pip install gguf) dequantizes
them, in Hugging Face row order. `blk.0.attn_q.weight` is stored with the row order llama.cpp's
converter gives query weights (2 heads), so the fixture also checks that it is undone.
runtime/tests/gguf_quant_types.rs compares LeanStream's dequantization with the expected values.
"""

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFWriter
from gguf.quants import dequantize

OUT = Path(__file__).resolve().parent.parent / "runtime/tests/fixtures/quant-types.gguf"
COLS = 256  # one k-quant block per row
HEADS, HEAD_DIM = 2, 4

# GGUF name, type, rows.
TENSORS = [
    ("token_embd.weight", T.F32, 2),
    ("output.weight", T.F16, 2),
    ("blk.0.attn_v.weight", T.BF16, 2),
    ("blk.0.attn_output.weight", T.Q4_0, 2),
    ("blk.0.ffn_gate.weight", T.Q4_1, 2),
    ("blk.0.ffn_up.weight", T.Q5_0, 2),
    ("blk.0.ffn_down.weight", T.Q5_1, 2),
    ("blk.1.attn_v.weight", T.Q8_0, 2),
    ("blk.1.attn_output.weight", T.Q4_K, 2),
    ("blk.1.ffn_gate.weight", T.Q5_K, 2),
    ("blk.1.ffn_up.weight", T.Q6_K, 2),
    ("blk.0.attn_q.weight", T.Q8_0, HEADS * HEAD_DIM),
]

# Byte offsets of the f16 scale fields in each block type; every other byte may take any value.
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}


def random_blocks(rng, qtype, rows):
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    if qtype == T.F32:
        return rng.standard_normal((rows, COLS)).astype(np.float32)
    if qtype == T.F16:
        return rng.standard_normal((rows, COLS)).astype(np.float16)
    if qtype == T.BF16:
        bits = (rng.standard_normal((rows, COLS)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8).reshape(rows, COLS * 2)
    blocks = rng.integers(0, 256, size=(rows * COLS // block_elems, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scale = (rng.uniform(0.001, 0.05, size=len(blocks)) * rng.choice([-1, 1], size=len(blocks))).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def converter_permute(rows, heads):
    """llama.cpp's converter order for query/key rows: (head, half, i) -> (head, i, half)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def main():
    rng = np.random.default_rng(20261130)
    writer = GGUFWriter(str(OUT), "llama")
    writer.add_uint32("llama.attention.head_count", HEADS)
    writer.add_uint32("llama.attention.head_count_kv", HEADS)
    for name, qtype, rows in TENSORS:
        stored = random_blocks(rng, qtype, rows)
        values = stored if qtype in (T.F32, T.F16) else dequantize(stored, qtype)
        values = np.asarray(values, dtype=np.float32).reshape(rows, COLS)
        if name == "blk.0.attn_q.weight":
            # `stored` is in the converter's order; Hugging Face order is the inverse permutation.
            order = converter_permute(np.arange(rows), HEADS)
            hf = np.empty_like(values)
            hf[order] = values
            values = hf
        if qtype in (T.F32, T.F16):
            writer.add_tensor(name, stored)
        else:
            writer.add_tensor(name, stored, raw_dtype=qtype)
        writer.add_tensor(f"expected.{name}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
