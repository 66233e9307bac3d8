#!/usr/bin/env python3
"""Checks LeanStream's GGUF tokenizer against llama.cpp's own tokenizer (not run by CI).

Needs llama-cpp-python (`pip install llama-cpp-python==0.3.36`, which builds llama.cpp from
source: several minutes on 2 cores) and the SmolLM2 GGUF (scripts/fetch-smollm2.sh).

1. SmolLM2-135M-Instruct: every text in TEXTS through llama.cpp (llama_tokenize with
   add_special and parse_special, as `leanstream run` tokenizes a prompt) and through
   `cargo run --example gguf_tokenize`; with --write-fixture the (text, ids) pairs become
   runtime/tests/fixtures/smollm2-tokenizer.json, which runtime/tests/smollm2.rs checks.
2. llama.cpp's vocabulary-only test files (models/ggml-vocab-*.gguf in the llama-cpp-python
   sdist, fetched with pip) for the other supported tokenizer types: TEXTS plus llama.cpp's own
   test strings (the .inp files beside them).

Prints one line per tokenizer and exits 1 on any difference.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from llama_cpp import Llama, __version__ as LLAMA_CPP_PYTHON_VERSION

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "runtime/tests/fixtures/smollm2-tokenizer.json"
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Vocabulary files of llama.cpp's test suite, one per tokenizer type LeanStream supports.
VOCABS = [
    "llama-bpe",
    "qwen2",
    "gpt-2",
    "starcoder",
    "refact",
    "command-r",
    "mpt",
    "llama-spm",
    "phi-3",
]

TEXTS = [
    "",
    " ",
    "The capital of France is",
    "Hello world",
    " Hello world",
    "Hello  world,   said   the\tcat.",
    "trailing spaces   ",
    "   leading spaces",
    "one\ntwo\n\nthree\n\n\n\nfour",
    "windows\r\nline\r\nends\r\n",
    "\n\n\n",
    "\t\ttabs\t and\u00a0no-break\u2009thin spaces",
    "Digits: 0 7 42 123 1234 12345 3.14159 1,000,000 2026-11-30 0x1F 1e-9",
    "Phone +44 (0)20 7946 0958, order #A-1234/56.",
    "\u201cSmart quotes,\u201d she said\u2014then \u2018paused\u2019\u2026 \u00abguillemets\u00bb \u2013 dash",
    "I'm sure you've seen it; they'll say we'd DON'T and It'S.",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00c6r\u00f8sk\u00f8bing Stra\u00dfe \u0141\u00f3d\u017a \u0130stanbul",
    "e\u0301 (combining accent) vs \u00e9 (precomposed)",
    "Emoji: \U0001F44D \U0001F44D\U0001F3FD \U0001F468\u200d\U0001F469\u200d\U0001F467 \U0001F1EB\U0001F1F7 \u2764\ufe0f \U0001F600\U0001F600",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002\u4e2d\u6587\u6587\u672c\uff0c\u5168\u89d2\u6807\u70b9\uff01",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u03ba\u03cc\u03c3\u03bc\u03b5",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 \u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e \ud55c\uad6d\uc5b4",
    "Math: \u2200x \u2208 \u211d, x\u00b2 \u2265 0; \u221a2 \u2248 1.414; \u00bd + \u00bc = \u00be",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\nif x != None && y <= 3:\n\tpass",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "https://example.org/path?q=1&r=two#frag user@example.com",
    "!!!???...---___***///\\\\|||~~~```",
    "A\u200bzero\u200bwidth\ufeffBOM",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_start|> spaced <|im_end|>",
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def smollm2_path():
    if os.environ.get("LEANSTREAM_SMOLLM2"):
        return Path(os.environ["LEANSTREAM_SMOLLM2"])
    cache = os.environ.get("LEANSTREAM_CACHE") or Path.home() / ".cache/leanstream"
    return Path(cache) / SMOLLM2


def heldout_paragraph():
    text = (ROOT / "data/heldout-head.txt").read_text(encoding="utf-8")
    return text[:3000]


def llama_cpp_ids(gguf, texts):
    llm = Llama(str(gguf), vocab_only=True, verbose=False)
    return [llm.tokenize(t.encode("utf-8"), add_bos=True, special=True) for t in texts]


def leanstream_ids(gguf, texts):
    out = subprocess.run(
        ["cargo", "run", "--quiet", "--release", "-p", "leanstream", "--example", "gguf_tokenize", "--", str(gguf)],
        input=json.dumps(texts).encode(),
        capture_output=True,
        cwd=ROOT,
    )
    if out.returncode != 0:
        return None, out.stderr.decode()
    return json.loads(out.stdout), None


def compare(label, gguf, texts):
    expected = llama_cpp_ids(gguf, texts)
    ours, error = leanstream_ids(gguf, texts)
    if ours is None:
        print(f"{label}: LeanStream failed: {error.strip()}")
        return expected, False
    bad = [(t, e, o) for t, e, o in zip(texts, expected, ours) if e != o]
    print(f"{label}: {len(texts) - len(bad)}/{len(texts)} texts give llama.cpp's ids")
    for t, e, o in bad[:5]:
        print(f"  {t[:60]!r}\n    llama.cpp  {e[:24]}\n    leanstream {o[:24]}")
    return expected, not bad


def vocab_files(dest):
    """llama.cpp's ggml-vocab-*.gguf test files from the sdist of the installed llama-cpp-python."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", "llama-cpp-python",
         f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(dest)],
        check=True,
    )
    sdist = next(Path(dest).glob("llama_cpp_python-*.tar.gz"))
    wanted = {f"ggml-vocab-{v}.gguf" for v in VOCABS} | {f"ggml-vocab-{v}.gguf.inp" for v in VOCABS}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if name in wanted and "/vendor/llama.cpp/models/" in member.name:
                member.name = name
                tar.extract(member, dest, filter="data")
    return Path(dest)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-fixture", action="store_true", help=f"write {FIXTURE.relative_to(ROOT)}")
    parser.add_argument("--vocab-dir", help="use ggml-vocab-*.gguf files from here instead of fetching the sdist")
    parser.add_argument("--skip-vocabs", action="store_true", help="check SmolLM2 only")
    args = parser.parse_args()

    ok = True
    gguf = smollm2_path()
    if not gguf.is_file():
        sys.exit(f"{gguf} is missing: run scripts/fetch-smollm2.sh")
    texts = TEXTS + [heldout_paragraph()]
    expected, good = compare("smollm2 (gpt2 / smollm)", gguf, texts)
    ok &= good
    if args.write_fixture:
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        header = {
            "about": "llama.cpp's ids for these texts with SmolLM2's GGUF tokenizer: llama_tokenize with "
            f"add_special and parse_special, llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}. "
            "Written by scripts/check-gguf-tokenizer.py --write-fixture.",
            "gguf": SMOLLM2,
            "gguf_sha256": sha256(gguf),
        }
        # One case per line keeps the file readable and its diffs small.
        lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in header.items()]
        cases = ",\n".join(
            "  " + json.dumps({"text": t, "ids": ids}, ensure_ascii=False) for t, ids in zip(texts, expected)
        )
        FIXTURE.write_text("{\n" + "\n".join(lines) + '\n "cases": [\n' + cases + "\n ]\n}\n", encoding="utf-8")
        print(f"wrote {FIXTURE}")

    if not args.skip_vocabs:
        with tempfile.TemporaryDirectory() as tmp:
            vocab_dir = Path(args.vocab_dir) if args.vocab_dir else vocab_files(tmp)
            for v in VOCABS:
                path = vocab_dir / f"ggml-vocab-{v}.gguf"
                inp = path.with_name(path.name + ".inp")
                llama_tests = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n") if inp.exists() else []
                _, good = compare(v, path, TEXTS + llama_tests)
                ok &= good
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
