//! Tokenizers of every kind the runtime reads, against reference ids: SentencePiece BPE with byte
//! fallback (Llama 2's, Mistral's and Gemma's `tokenizer.json`, GGUF `llama` with and without the
//! space prefix, and Phi-3's, whose special tokens swallow the whitespace after them),
//! SentencePiece Unigram, and byte-level BPE behind Llama 3's, Qwen2's, Qwen3.5's and Mistral
//! Tekken's split regexes (`tokenizer.json`, GGUF `llama-bpe` / `qwen2` / `qwen35` / `tekken`;
//! the GGUF files also hold a `</s>` typed as text, which llama.cpp matches as a control token).
//! The `tokenizers` library gave the ids and text of each `tokenizer.json`, llama.cpp the ids of
//! each GGUF file (scripts/make-tokenizer-fixtures.py trained the tokenizers and wrote both).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use leanstream::source::gguf::GgufFile;
use leanstream::tokenizer::{gguf as gguf_tokenizer, TextStream, Tokenizer};

const JSON: [&str; 8] = [
    "spm-bpe-llama2.json",
    "spm-bpe-mistral.json",
    "spm-bpe-gemma.json",
    "unigram.json",
    "llama3.json",
    "qwen2.json",
    "qwen35.json",
    "tekken.json",
];
const GGUF: [&str; 7] = [
    "spm-bpe.gguf",
    "spm-bpe-no-prefix.gguf",
    "spm-bpe-phi3.gguf",
    "llama3.gguf",
    "qwen2.gguf",
    "qwen35.gguf",
    "tekken.gguf",
];

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tokenizers")
}

struct Case {
    text: String,
    ids: Vec<u32>,
    /// The `tokenizers` library's decoded text, special tokens left out (`tokenizer.json` only).
    decoded: Option<String>,
}

fn cases(name: &str) -> Vec<Case> {
    let path = dir().join("expected.json");
    let all: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("expected.json")).unwrap();
    let cases = all[name]["cases"].as_array().expect(name);
    assert!(cases.len() >= 15, "{name}: {} cases", cases.len());
    cases
        .iter()
        .map(|c| Case {
            text: c["text"].as_str().unwrap().to_string(),
            ids: serde_json::from_value(c["ids"].clone()).unwrap(),
            decoded: c["decoded"].as_str().map(str::to_string),
        })
        .collect()
}

fn from_json(name: &str) -> Result<Tokenizer> {
    Tokenizer::from_bytes(&std::fs::read(dir().join(name))?).with_context(|| name.to_string())
}

/// The tokenizer of a fixture GGUF file, or of the file at an absolute path.
fn from_gguf(name: impl AsRef<Path>) -> Result<Tokenizer> {
    Ok(gguf_tokenizer::from_gguf(&GgufFile::open(&dir().join(name))?)?.tokenizer)
}

/// The text streamed token by token, as `run` prints it.
fn streamed(tokenizer: &Tokenizer, ids: &[u32]) -> Result<String> {
    let mut stream = TextStream::default();
    let mut text = String::new();
    for &id in ids {
        text.extend(stream.push(tokenizer, id)?);
    }
    text.extend(stream.finish(tokenizer)?);
    Ok(text)
}

/// Checks `tokenizer` against the reference ids of `name`, and its text (whole and streamed)
/// against `text` of each case, where that gives one.
fn check(name: &str, tokenizer: &Tokenizer, text: impl Fn(&Case) -> Option<String>) -> Result<()> {
    for case in cases(name) {
        let ids = tokenizer.encode(&case.text, true)?;
        assert_eq!(ids, case.ids, "{name}: ids of {:?}", case.text);
        if let Some(text) = text(&case) {
            assert_eq!(tokenizer.decode(&ids)?, text, "{name}: {:?}", case.text);
            assert_eq!(streamed(tokenizer, &ids)?, text, "{name}: streamed");
        }
    }
    Ok(())
}

#[test]
fn tokenizer_json_gives_the_tokenizers_librarys_ids_and_text() -> Result<()> {
    for name in JSON {
        check(name, &from_json(name)?, |case| {
            Some(
                case.decoded
                    .clone()
                    .expect("tokenizer.json cases have text"),
            )
        })?;
    }
    Ok(())
}

#[test]
fn gguf_metadata_gives_llama_cpps_ids_and_the_text_back() -> Result<()> {
    for name in GGUF {
        // Every text without special tokens in it comes back whole (byte fallback and byte level
        // cover every character).
        check(name, &from_gguf(name)?, |case| {
            (!case.text.contains('<')).then(|| case.text.clone())
        })?;
    }
    Ok(())
}

#[test]
fn byte_fallback_tokens_decode_to_utf8_only_once_a_character_is_whole() -> Result<()> {
    let tokenizer = from_gguf("spm-bpe.gguf")?;
    // Not in the training text: `▁`, then each of its four bytes as a <0xNN> token (llama.cpp's
    // ids).
    let ids = tokenizer.encode("🦀", false)?;
    assert_eq!(ids, [566, 247, 166, 173, 135]);
    let mut stream = TextStream::default();
    let pieces: Vec<Option<String>> = ids
        .iter()
        .map(|&id| stream.push(&tokenizer, id))
        .collect::<Result<_>>()?;
    // The prefix space is dropped from the text, and the character is held back until its last
    // byte arrives.
    assert_eq!(pieces, [None, None, None, None, Some("🦀".to_string())]);
    Ok(())
}

#[test]
fn an_unknown_gguf_pre_tokenizer_is_refused_by_name() -> Result<()> {
    let mut bytes = std::fs::read(dir().join("llama3.gguf"))?;
    let at = bytes
        .windows(9)
        .position(|w| w == b"llama-bpe")
        .expect("the pre-tokenizer's name");
    bytes[at..at + 9].copy_from_slice(b"llama-zzz");
    let tmp = std::env::temp_dir().join(format!("leanstream-pre-{}.gguf", std::process::id()));
    std::fs::write(&tmp, &bytes)?;
    let err = match gguf_tokenizer::from_gguf(&GgufFile::open(&tmp)?) {
        Ok(_) => panic!("an unknown pre-tokenizer was accepted"),
        Err(e) => format!("{e:#}"),
    };
    std::fs::remove_file(&tmp)?;
    assert!(err.contains("\"llama-zzz\""), "{err}");
    assert!(err.contains(&*tmp.to_string_lossy()), "{err}");
    assert!(err.contains("tokenizer.ggml.pre"), "{err}");
    Ok(())
}

/// `tokenizer.json` written as GGUF metadata (as `export-gguf` writes a model) and read back.
fn exported(json: &str, bos: u32, eos: u32) -> Result<Tokenizer> {
    use candle_core::quantized::gguf_file::{self, Value};
    let (mut metadata, padding) =
        gguf_tokenizer::metadata_of(&std::fs::read(dir().join(json))?, None)?;
    assert_eq!(padding, 0);
    metadata.extend([
        ("general.architecture".into(), Value::String("llama".into())),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(bos)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)),
    ]);
    let path = std::env::temp_dir().join(format!("leanstream-{}-{json}.gguf", std::process::id()));
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::fs::File::create(&path)?, &metadata, &[])?;
    let tokenizer = from_gguf(&path);
    std::fs::remove_file(&path)?;
    tokenizer
}

#[test]
fn tokenizer_json_written_as_gguf_gives_llama_cpps_ids() -> Result<()> {
    // Each `tokenizer.json` and the GGUF file llama.cpp tokenized the same vocabulary from.
    for (json, gguf, bos, eos) in [
        ("spm-bpe-llama2.json", "spm-bpe.gguf", 1, 2),
        ("spm-bpe-mistral.json", "spm-bpe.gguf", 1, 2),
        ("spm-bpe-gemma.json", "spm-bpe-no-prefix.gguf", 1, 2),
        ("llama3.json", "llama3.gguf", 0, 2),
        ("qwen2.json", "qwen2.gguf", 0, 2),
        ("qwen35.json", "qwen35.gguf", 0, 2),
        ("tekken.json", "tekken.gguf", 1, 2),
    ] {
        let tokenizer = exported(json, bos, eos)?;
        let mut checked = 0;
        // The reference GGUF files of byte-level BPE have an extra `</s>`.
        for case in cases(gguf).iter().filter(|c| !c.text.contains("</s>")) {
            let ids = tokenizer.encode(&case.text, true)?;
            assert_eq!(ids, case.ids, "{json} as GGUF: ids of {:?}", case.text);
            checked += 1;
        }
        assert!(checked >= 13, "{json}: {checked}");
    }
    let err = exported("unigram.json", 1, 2)
        .err()
        .expect("Unigram is refused");
    assert!(format!("{err:#}").contains("Unigram"), "{err:#}");
    Ok(())
}

#[test]
fn a_tokenizer_llama_cpp_cannot_reproduce_is_not_written_as_gguf() -> Result<()> {
    let refusal = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| -> String {
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir().join(name)).unwrap()).unwrap();
        edit(&mut json);
        let bytes = serde_json::to_vec(&json).unwrap();
        match gguf_tokenizer::metadata_of(&bytes, None) {
            Ok(_) => panic!("{name}: written although edited"),
            Err(e) => format!("{e:#}"),
        }
    };
    // A split regex llama.cpp has no pre-tokenizer type for.
    let err = refusal("llama3.json", &|j| {
        j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\s+".into()
    });
    assert!(
        err.contains("no llama.cpp type") && err.contains(r"\\p{L}+|\\s+"),
        "{err}"
    );
    // Byte fallback without `▁` for spaces is not SentencePiece.
    let err = refusal("spm-bpe-gemma.json", &|j| {
        j["normalizer"] = serde_json::Value::Null
    });
    assert!(err.contains("needs spaces as ▁"), "{err}");
    Ok(())
}
