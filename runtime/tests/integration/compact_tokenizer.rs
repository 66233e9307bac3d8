//! The compact tokenizer (a file's BPE_VOCAB tables) gives the `tokenizers` crate's ids and text
//! for the embedded model and for SmolLM2 (its GGUF tokenizer, which llama.cpp's ids pin down) on a
//! long varied text: prose, code, digits, whitespace runs, special tokens, many scripts, and
//! characters only byte tokens cover.

use crate::support;

use std::path::PathBuf;

use leanstream::source::gguf::GgufFile;
use leanstream::tokenizer::gguf as gguf_tokenizer;
use leanstream::tokenizer::{bpe_vocab, Tokenizer};
use leanstream_format::bpe_vocab::BpeVocab;

/// The compact tokenizer as the runtime gets it: tables built from `json`, written and read back.
fn compact(json: &[u8]) -> Tokenizer {
    let bytes = bpe_vocab(json).expect("a supported tokenizer").encode();
    Tokenizer::compact(BpeVocab::from_bytes(&bytes).unwrap())
}

/// Characters drawn from many blocks (a fixed-seed generator): combining marks, rare scripts,
/// symbols, private use, unassigned code points, controls.
fn unicode_soup(n: usize) -> String {
    const BLOCKS: [(u32, u32); 12] = [
        (0x20, 0x7F),
        (0x80, 0x250),
        (0x300, 0x370),
        (0x370, 0x530),
        (0x590, 0x700),
        (0x900, 0xDFF),
        (0x1100, 0x11FF),
        (0x2000, 0x2BFF),
        (0x3000, 0x30FF),
        (0x4E00, 0x9FFF),
        (0xE000, 0xE0FF),
        (0x1F300, 0x1FAFF),
    ];
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..n)
        .filter_map(|_| {
            let (lo, hi) = BLOCKS[(next() % BLOCKS.len() as u64) as usize];
            let c = char::from_u32(lo + (next() % (hi - lo) as u64) as u32)?;
            // Runs of spaces and newlines between the characters.
            Some(match next() % 7 {
                0 => format!("{c} "),
                1 => format!("{c}\n  "),
                _ => c.to_string(),
            })
        })
        .collect()
}

/// Austen, the SmolLM2 fixture texts, a chat turn and the soup.
fn long_text(specials: &[&str]) -> String {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let austen = std::fs::read_to_string(root.join("data/heldout-head.txt")).unwrap();
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(support::fixture("smollm2-tokenizer.json")).unwrap())
            .unwrap();
    let mut text: String = austen.chars().take(20_000).collect();
    for case in cases["cases"].as_array().unwrap() {
        text.push_str(case["text"].as_str().unwrap());
        text.push('\n');
    }
    for s in specials {
        text.push_str(&format!("{s}user\nDigits 0123456789 and {s}{s}x {s} "));
    }
    text.push_str("fn main() {\n\tlet x = [1, 22, 333];\r\n    // 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u{10FFFF}\n}\n");
    text + &unicode_soup(3000)
}

fn assert_same(reference: &Tokenizer, compact: &Tokenizer, text: &str) {
    assert!(compact.is_compact() && !reference.is_compact());
    for special in [false, true] {
        let expected = reference.encode(text, special).unwrap();
        let ids = compact.encode(text, special).unwrap();
        if ids != expected {
            let at = ids
                .iter()
                .zip(&expected)
                .take_while(|(a, b)| a == b)
                .count();
            panic!(
                "ids differ at {at} of {}: {:?} vs {:?}",
                expected.len(),
                &ids[at..(at + 8).min(ids.len())],
                &expected[at..(at + 8).min(expected.len())]
            );
        }
        assert_eq!(
            compact.decode(&ids).unwrap(),
            reference.decode(&ids).unwrap()
        );
    }
    // Pieces of tokens: decoding a few ids at a time (as streaming output does) agrees too, broken
    // characters included.
    let ids = reference.encode(text, true).unwrap();
    for chunk in ids.chunks(3).take(2000) {
        assert_eq!(
            compact.decode(chunk).unwrap(),
            reference.decode(chunk).unwrap()
        );
    }
}

#[test]
fn embedded_model_ids_equal_tokenizers() {
    let json = std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/austen-relu/tokenizer.json"),
    )
    .unwrap();
    let reference = Tokenizer::from_bytes(&json).unwrap();
    assert_same(&reference, &compact(&json), &long_text(&["<|endoftext|>"]));
}

#[test]
fn smollm2_ids_equal_tokenizers_and_llama_cpp() {
    let gguf = gguf_tokenizer::from_gguf(&GgufFile::open(&support::smollm2()).unwrap()).unwrap();
    let json = gguf.tokenizer.to_json().unwrap();
    let compact = compact(&json);
    assert_same(
        &gguf.tokenizer,
        &compact,
        &long_text(&["<|im_start|>", "<|im_end|>", "<|endoftext|>"]),
    );
    // llama.cpp's own ids for the fixture texts.
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(support::fixture("smollm2-tokenizer.json")).unwrap())
            .unwrap();
    for case in cases["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let expected: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(compact.encode(text, true).unwrap(), expected, "{text:?}");
    }
}

#[test]
fn unsupported_tokenizers_are_refused_with_the_reason() {
    let json = std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/austen-relu/tokenizer.json"),
    )
    .unwrap();
    let mut v: serde_json::Value = serde_json::from_slice(&json).unwrap();
    v["normalizer"] = serde_json::json!({"type": "Lowercase"});
    let err = bpe_vocab(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert!(err.to_string().contains("normalizer"), "{err}");
    let mut v: serde_json::Value = serde_json::from_slice(&json).unwrap();
    v["pre_tokenizer"]["add_prefix_space"] = true.into();
    let err = bpe_vocab(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert!(err.to_string().contains("pre-tokenizer"), "{err}");
    let mut v: serde_json::Value = serde_json::from_slice(&json).unwrap();
    v["added_tokens"][0]["lstrip"] = true.into();
    let err = bpe_vocab(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert!(err.to_string().contains("lstrip"), "{err}");
}
