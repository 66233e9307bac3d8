#!/usr/bin/env python3
"""Writes tiny tokenizers of the kinds LeanStream reads, with reference ids, into
tests/fixtures/tokenizers/ (tests/tests/integration/tokenizers.rs checks them).

- spm-bpe: a SentencePiece BPE model with byte fallback, trained with Llama 2's settings, written
  as tokenizer.json in Llama 2's form (Prepend + Replace normalizer), Mistral's (Metaspace
  pre-tokenizer) and Gemma's (no space prefix), and as GGUF metadata (`llama`) with and without
  `add_space_prefix`, and as Phi-3's (turn markers as control tokens);
- unigram: a SentencePiece Unigram model with byte fallback as a Unigram tokenizer.json;
- llama3, qwen2, qwen35, tekken: byte-level BPE trained with `tokenizers` behind Llama 3's,
  Qwen2's, Qwen3.5's and Mistral Tekken's split regexes, as tokenizer.json and as GGUF metadata
  (`gpt2` with `llama-bpe` / `qwen2` / `qwen35` / `tekken`).

References: the `tokenizers` library's ids and decoded text for every tokenizer.json (the Llama 2
form is also checked against SentencePiece's own ids), and llama.cpp's ids for every
GGUF file (libllama, through scripts/lib/llama-tokenize-json.c, built here with cc).

Needs sentencepiece, tokenizers and gguf (llama.cpp's gguf-py) in a virtual environment, and a
llama.cpp build (scripts/build-llamacpp.sh). Usage: make-tokenizer-fixtures.py [--llama-cpp DIR],
DIR holding the sources in src/ and libllama in build/bin/ (default: build-llamacpp.sh's folder).
"""

import argparse
import io
import json
import os
import subprocess
import tempfile
from pathlib import Path

import gguf
import jinja2.sandbox
import sentencepiece as spm
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "tokenizers"

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Training text: a few languages, code, numbers and whitespace runs, repeated with variations.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, that a single man in possession of a good fortune",
    "must be in want of a wife. They'll say we'd DONE it, and I'm sure you've HEARD.",
    "Le renard brun rapide saute par-dessus le chien paresseux. Ça coûte 12,50 € à l'été.",
    "Der schnelle braune Fuchs springt über den faulen Hund. Äpfel, Öl und Übermut.",
    "El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la niña?",
    "Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир!",
    "日本語のテキストを書きます。東京は大きい都市です。",
    "中文文本。我们今天去公园散步。",
    "def main():\n    for i in range(10):\n        print(i * 2)\n\treturn None\n",
    "In 2026 the price rose from 1,234.56 to 78901 units (3.14159%).",
    "  two spaces, three   spaces,\ttabs\t\tand\nnew\n\nlines  \n",
    "Emoji: 👍 🎉 ❤️ and the end.",
]
CORPUS = [s for i in range(40) for s in SENTENCES[i % 3 :] + [f"line {i}: {SENTENCES[i % len(SENTENCES)]}"]]

TEXTS = [
    "",
    " ",
    "Hello world",
    " Hello  world,   said the\tcat.",
    "trailing spaces   ",
    "one\ntwo\n\nthree \n\n\n four",
    "windows\r\nline ends\r\n",
    "Digits: 7 42 123 1234 12345 3.14159 1,000,000",
    "They'LL say we'd DONE it; I'm sure you've HEARD.",
    "Ça coûte 12,50 € à l'été — Äpfel Übermut ñandú",
    "Привет, мир! 日本語のテキスト、中文。 مرحبا नमस्ते 한국어",
    "Emoji 👍🏽 👨\u200d👩\u200d👧 🇫🇷 ∀x∈ℝ: x² ≥ 0 ½ \u00a0\u200b",
    "    indented code():\n\treturn x",
]


# Phi-3's turn markers: user-defined pieces of the SentencePiece models, control tokens in the
# Phi-3 GGUF file (whose special tokens swallow the whitespace after them, as llama.cpp decides by
# the model's name).
USER_SYMBOLS = ["<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"]
PHI3_TEXTS = ["<|user|>\n Hi <|end|>\n<|assistant|>\n", "a</s> b <|end|>  c<|endoftext|> d"]


def special_texts(bos, eos):
    """Texts with the special tokens in them, as a chat prompt has."""
    return [f"{bos}Hello{eos}", f"a {eos} b{bos}\n c"]


def train_spm(model_type, vocab_size, add_dummy_prefix=True):
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=buf,
        model_type=model_type,
        vocab_size=vocab_size,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        allow_whitespace_only_pieces=True,
        character_coverage=0.9995,
        hard_vocab_limit=False,
        max_sentence_length=10000,
        minloglevel=2,
        num_threads=1,
        user_defined_symbols=USER_SYMBOLS,
    )
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    return [Piece(sp, i) for i in range(sp.get_piece_size())], sp


SPM_NORMAL, SPM_UNKNOWN, SPM_CONTROL, SPM_USER, SPM_UNUSED, SPM_BYTE = 1, 2, 3, 4, 5, 6


class Piece:
    """One piece of a SentencePiece model: its text, score and type (as its model file has them)."""

    def __init__(self, sp, i):
        self.piece, self.score = sp.id_to_piece(i), sp.get_score(i)
        kinds = [(sp.is_unknown, SPM_UNKNOWN), (sp.is_control, SPM_CONTROL), (sp.is_unused, SPM_UNUSED),
                 (sp.is_byte, SPM_BYTE)]
        self.type = next((t for is_kind, t in kinds if is_kind(i)), SPM_NORMAL)
        if self.piece in USER_SYMBOLS:
            self.type = SPM_USER


def spm_added(pieces):
    return [
        {
            "id": i,
            "content": p.piece,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": p.type != SPM_USER,
        }
        for i, p in enumerate(pieces)
        if p.type in (SPM_CONTROL, SPM_UNKNOWN, SPM_USER)
    ]


def spm_bpe_json(pieces, style):
    """A SentencePiece BPE model as tokenizer.json: merges are every split of a piece into two
    pieces, ranked by the piece's score (as transformers' converter writes them)."""
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    merges = []
    for i, p in enumerate(pieces):
        for cut in range(1, len(p.piece)):
            left, right = p.piece[:cut], p.piece[cut:]
            if left in vocab and right in vocab:
                merges.append((i, left, right))
    merges.sort()
    model = models.BPE(
        vocab=vocab, merges=[(l, r) for _, l, r in merges], unk_token="<unk>", fuse_unk=True, byte_fallback=True
    )
    tok = Tokenizer(model)
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if style == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence(decode + [decoders.Strip(" ", 1, 0)])
    elif style == "mistral":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence(decode + [decoders.Strip(" ", 1, 0)])
    elif style == "gemma":
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.decoder = decoders.Sequence(decode)
    else:
        raise ValueError(style)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return with_added(tok, spm_added(pieces))


def unigram_json(pieces, sp):
    vocab = [(p.piece, p.score) for p in pieces]
    tok = Tokenizer(models.Unigram(vocab, unk_id=sp.unk_id(), byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="always"),
                                     decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    return with_added(tok, spm_added(pieces))


def with_added(tok, added):
    """The tokenizer's JSON with SentencePiece's control tokens as added tokens."""
    j = json.loads(tok.to_str())
    j["added_tokens"] = added
    return json.dumps(j, ensure_ascii=False)


def byte_level_json(regex, specials, bos, nfc, ignore_merges):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok.to_str()


def hf_cases(tokenizer_json, texts):
    tok = Tokenizer.from_str(tokenizer_json)
    cases = []
    for t in texts:
        ids = tok.encode(t, add_special_tokens=True).ids
        cases.append({"text": t, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True)})
    return cases


def gguf_header(w):
    """The hyper-parameters libllama reads even for a vocabulary alone."""
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_block_count(1)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)


def spm_gguf(path, pieces, sp, add_space_prefix, name=None):
    """With `name`, the user-defined pieces are control tokens (as in Phi-3's files)."""
    w = gguf.GGUFWriter(str(path), "llama")
    gguf_header(w)
    if name:
        w.add_name(name)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([p.piece.encode() for p in pieces])
    w.add_token_scores([p.score for p in pieces])
    w.add_token_types([SPM_CONTROL if name and p.type == SPM_USER else p.type for p in pieces])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(add_space_prefix)
    write(w)


def bpe_gguf(path, tokenizer_json, pre, bos, eos):
    """The vocabulary ends with `</s>` typed as normal text, as Qwen2's files have it (llama.cpp
    treats it as a control token all the same)."""
    j = json.loads(tokenizer_json)
    vocab = j["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    if "</s>" not in vocab:
        tokens.append("</s>")
    special = {a["id"] for a in j["added_tokens"]}
    w = gguf.GGUFWriter(str(path), "llama")
    gguf_header(w)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([t.encode() for t in tokens])
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]])
    w.add_bos_token_id(vocab[bos])
    w.add_eos_token_id(vocab[eos])
    write(w)


def write(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_cpp_cases(tool, path, texts):
    out = subprocess.run(
        [tool, str(path)], input=b"".join(t.encode() + b"\0" for t in texts), capture_output=True, check=True
    )
    ids = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert len(ids) == len(texts), out.stderr.decode()
    return [{"text": t, "ids": i} for t, i in zip(texts, ids)]


def build_tool(llama_cpp, dest):
    tool = Path(dest) / "llama-tokenize-json"
    src, lib = llama_cpp / "src", llama_cpp / "build" / "bin"
    subprocess.run(
        ["cc", "-O1", "-o", str(tool), str(ROOT / "scripts/lib/llama-tokenize-json.c"),
         f"-I{src}/include", f"-I{src}/ggml/include", f"-L{lib}", "-lllama", f"-Wl,-rpath,{lib}"],
        check=True,
    )
    return str(tool)


# Chat templates: llama.cpp's copies of the models' own (models/templates/), and two short ones
# written out here (Gemma 3's, which folds the system prompt into the first user turn, and
# Mistral 7B Instruct v0.1's).
TEMPLATES = {
    "llama-3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "llama-3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "phi-3.5": ("microsoft-Phi-3.5-mini-instruct.jinja", "<s>", "<|endoftext|>"),
    "gemma-2": ("google-gemma-2-2b-it.jinja", "<bos>", "<eos>"),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>"),
    "gemma-3": (None, "<bos>", "<eos>"),
    "mistral-7b-v0.1": (None, "<s>", "</s>"),
}
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
MISTRAL_V01_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
CONVERSATIONS = {
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": " Say 2+2. "},
    ],
    "user": [{"role": "user", "content": "Hi"}],
}


def render_templates(llama_cpp):
    """Each template rendered as transformers renders it (jinja2 with trim_blocks and
    lstrip_blocks), or the error it raises."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    (OUT / "templates").mkdir(exist_ok=True)
    out = {}
    for name, (file, bos, eos) in TEMPLATES.items():
        if file:
            source = (llama_cpp / "src/models/templates" / file).read_text(encoding="utf-8")
        else:
            source = GEMMA3_TEMPLATE if name == "gemma-3" else MISTRAL_V01_TEMPLATE
        (OUT / "templates" / f"{name}.jinja").write_text(source, encoding="utf-8")
        renders = {}
        for conv, messages in CONVERSATIONS.items():
            try:
                text = env.from_string(source).render(
                    messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
                )
                renders[conv] = {"text": text}
            except jinja2.exceptions.TemplateError as e:
                renders[conv] = {"error": str(e)}
        out[name] = {"bos_token": bos, "eos_token": eos, "renders": renders}
    return {"conversations": CONVERSATIONS, "templates": out}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache = Path(os.environ.get("LEANSTREAM_CACHE", Path.home() / ".cache/leanstream"))
    parser.add_argument("--llama-cpp", default=str(cache / "llamacpp-build"))
    args = parser.parse_args()
    llama_cpp = Path(args.llama_cpp)
    OUT.mkdir(parents=True, exist_ok=True)
    expected = {}

    def add(name, cases, source):
        expected[name] = {"source": source, "cases": cases}

    with tempfile.TemporaryDirectory() as tmp:
        tool = build_tool(llama_cpp, tmp)
        spm_texts = TEXTS + special_texts("<s>", "</s>") + PHI3_TEXTS

        pieces, sp = train_spm("bpe", 700)
        for style in ["llama2", "mistral", "gemma"]:
            j = spm_bpe_json(pieces, style)
            (OUT / f"spm-bpe-{style}.json").write_text(j, encoding="utf-8")
            cases = hf_cases(j, spm_texts)
            if style == "llama2":
                for c in cases[: len(TEXTS)]:
                    want = [1] + sp.encode(c["text"]) if c["text"] else [1]
                    assert c["ids"] == want, (style, c["text"], c["ids"], want)
            add(f"spm-bpe-{style}.json", cases, "tokenizers")
        for prefix in [True, False]:
            name = "spm-bpe.gguf" if prefix else "spm-bpe-no-prefix.gguf"
            spm_gguf(OUT / name, pieces, sp, prefix)
            add(name, llama_cpp_cases(tool, OUT / name, spm_texts), "llama.cpp")
        spm_gguf(OUT / "spm-bpe-phi3.gguf", pieces, sp, True, name="Phi3 tiny")
        add("spm-bpe-phi3.gguf", llama_cpp_cases(tool, OUT / "spm-bpe-phi3.gguf", spm_texts), "llama.cpp")

        pieces, sp = train_spm("unigram", 700)
        j = unigram_json(pieces, sp)
        (OUT / "unigram.json").write_text(j, encoding="utf-8")
        add("unigram.json", hf_cases(j, spm_texts), "tokenizers")

        for name, regex, specials, bos, eos, pre, nfc in [
            ("llama3", LLAMA3_REGEX, ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
             "<|begin_of_text|>", "<|eot_id|>", "llama-bpe", False),
            ("qwen2", QWEN2_REGEX, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
             None, "<|im_end|>", "qwen2", True),
            ("qwen35", QWEN35_REGEX, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
             None, "<|im_end|>", "qwen35", True),
            ("tekken", TEKKEN_REGEX, ["<unk>", "<s>", "</s>"], "<s>", "</s>", "tekken", False),
        ]:
            j = byte_level_json(regex, specials, bos, nfc, ignore_merges=name in ("llama3", "tekken"))
            (OUT / f"{name}.json").write_text(j, encoding="utf-8")
            texts = TEXTS + special_texts(bos or specials[1], eos) + ["x</s> y"]
            add(f"{name}.json", hf_cases(j, texts), "tokenizers")
            bpe_gguf(OUT / f"{name}.gguf", j, pre, bos or specials[0], eos)
            add(f"{name}.gguf", llama_cpp_cases(tool, OUT / f"{name}.gguf", texts), "llama.cpp")

    lines = [
        f"  {json.dumps(name)}: {{\"source\": {json.dumps(v['source'])}, \"cases\": [\n"
        + ",\n".join("    " + json.dumps(c, ensure_ascii=False) for c in v["cases"])
        + "\n  ]}"
        for name, v in expected.items()
    ]
    (OUT / "expected.json").write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")
    chat = json.dumps(render_templates(llama_cpp), ensure_ascii=False, indent=1)
    (OUT / "chat.json").write_text(chat + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
