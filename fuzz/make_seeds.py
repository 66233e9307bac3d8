#!/usr/bin/env python3
"""Writes the small seed files of the GGUF tokenizer fuzz target (run from fuzz/): GGUF v3 files
holding only tokenizer metadata, one per tokenizer model the runtime supports."""
import struct

U32, I32, F32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9


def s(text):
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def value(kind, v):
    if kind == U32:
        return struct.pack("<I", v)
    if kind == I32:
        return struct.pack("<i", v)
    if kind == F32:
        return struct.pack("<f", v)
    if kind == BOOL:
        return struct.pack("<B", v)
    if kind == STRING:
        return s(v)
    elem, items = v
    return struct.pack("<IQ", elem, len(items)) + b"".join(value(elem, x) for x in items)


def gguf(path, kvs):
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs))
    for key, kind, v in kvs:
        out += s(key) + struct.pack("<I", kind) + value(kind, v)
    out += b"\0" * (-len(out) % 32)
    open(path, "wb").write(out)


gpt2_tokens = ["<|endoftext|>", "<|im_start|>", "H", "e", "l", "o", "Ġ", "w", "He", "ll", "Ġw", "Hell"]
gguf("corpus/gguf_tokenizer/gpt2.gguf", [
    ("general.architecture", STRING, "llama"),
    ("tokenizer.ggml.model", STRING, "gpt2"),
    ("tokenizer.ggml.pre", STRING, "smollm"),
    ("tokenizer.ggml.tokens", ARRAY, (STRING, gpt2_tokens)),
    ("tokenizer.ggml.token_type", ARRAY, (I32, [3, 3] + [1] * (len(gpt2_tokens) - 2))),
    ("tokenizer.ggml.merges", ARRAY, (STRING, ["H e", "l l", "Ġ w", "He ll"])),
    ("tokenizer.ggml.bos_token_id", U32, 1),
    ("tokenizer.ggml.eos_token_id", U32, 0),
    ("tokenizer.ggml.add_bos_token", BOOL, 1),
])

spm_tokens = ["<unk>", "<s>", "</s>", "<0x00>", "<0x0A>", "▁", "▁H", "e", "l", "o", "▁w", "ll"]
gguf("corpus/gguf_tokenizer/llama-spm.gguf", [
    ("general.architecture", STRING, "llama"),
    ("tokenizer.ggml.model", STRING, "llama"),
    ("tokenizer.ggml.tokens", ARRAY, (STRING, spm_tokens)),
    ("tokenizer.ggml.scores", ARRAY, (F32, [0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0])),
    ("tokenizer.ggml.token_type", ARRAY, (I32, [2, 3, 3, 6, 6] + [1] * 7)),
    ("tokenizer.ggml.bos_token_id", U32, 1),
    ("tokenizer.ggml.eos_token_id", U32, 2),
    ("tokenizer.ggml.unknown_token_id", U32, 0),
    ("tokenizer.ggml.add_space_prefix", BOOL, 1),
])


def tiny_model_dir(d):
    """A one-layer Llama with a 40-token word-level tokenizer: converted (see below), the smallest
    LeanStream file that exercises every section."""
    import json, os, random
    os.makedirs(d, exist_ok=True)
    words = ["<unk>", "</s>"] + [w for w in "the a of to and in is was it he she that with for as on at by".split()]
    words += [f"w{i}" for i in range(40 - len(words))]
    vocab = {w: i for i, w in enumerate(words)}
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    json.dump(tok, open(f"{d}/tokenizer.json", "w"))
    h, n, v = 32, 64, len(words)
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": n,
        "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": h,
        "vocab_size": v, "hidden_act": "relu", "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "eos_token_id": 1,
    }
    json.dump(config, open(f"{d}/config.json", "w"))
    rng = random.Random(5)
    shapes = {
        "model.embed_tokens.weight": [v, h], "model.norm.weight": [h],
        "model.layers.0.input_layernorm.weight": [h],
        "model.layers.0.post_attention_layernorm.weight": [h],
        "model.layers.0.self_attn.q_proj.weight": [h, h], "model.layers.0.self_attn.k_proj.weight": [h, h],
        "model.layers.0.self_attn.v_proj.weight": [h, h], "model.layers.0.self_attn.o_proj.weight": [h, h],
        "model.layers.0.mlp.gate_proj.weight": [n, h], "model.layers.0.mlp.up_proj.weight": [n, h],
        "model.layers.0.mlp.down_proj.weight": [h, n],
    }
    header, data = {}, b""
    for name, shape in shapes.items():
        count = 1
        for s_ in shape:
            count *= s_
        values = [1.0] * count if len(shape) == 1 else [rng.gauss(0, 0.2) for _ in range(count)]
        raw = struct.pack(f"<{count}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    open(f"{d}/model.safetensors", "wb").write(struct.pack("<Q", len(hj)) + hj + data)
    text = " ".join(rng.choice(words[2:]) for _ in range(2000))
    open(f"{d}/calib.txt", "w").write(text)


# The LeanStream seed: after this script, run from the workspace root
#   target/release/leanstream-prep convert /tmp/leanstream-fuzz-tiny -o fuzz/corpus/lsb_file/tiny.lsb \
#       --quant q8 --calib /tmp/leanstream-fuzz-tiny/calib.txt --calib-tokens 512 --epochs 1
# then prefix it with the target's mode byte (0: read as is; 1: checksums recomputed first):
#   (printf '\x00'; cat fuzz/corpus/lsb_file/tiny.lsb) > fuzz/corpus/lsb_file/tiny-raw.lsb
#   (printf '\x01'; cat fuzz/corpus/lsb_file/tiny.lsb) > fuzz/corpus/lsb_file/tiny-repair.lsb
#   rm fuzz/corpus/lsb_file/tiny.lsb
tiny_model_dir("/tmp/leanstream-fuzz-tiny")
