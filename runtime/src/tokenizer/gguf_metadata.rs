//! A `tokenizer.json` as a GGUF file's `tokenizer.ggml.*` metadata, for writing a model as GGUF:
//! the inverse of [`super::gguf::from_gguf`] for the tokenizers llama.cpp reproduces.
//! - byte-level BPE (`gpt2`), with the pre-tokenizer type its split regex stands for (GPT-2's,
//!   digits then GPT-2's, Llama 3's, Qwen2's, Qwen3.5's, Tekken's);
//! - SentencePiece-style BPE with byte fallback (`llama`): `▁` for spaces through a Metaspace
//!   pre-tokenizer or a Replace normalizer, with or without a prepended `▁`; each piece scores
//!   minus the rank of the first merge that makes it, so merging the best-scoring piece first
//!   follows the merge order.

use std::collections::HashMap;

use anyhow::{bail, ensure, Context, Result};
use candle_core::quantized::gguf_file::Value;
use serde_json::Value as Json;

use super::from_json::GPT2_PATTERN;
use super::gguf::{TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED};

/// The split regexes of `tokenizer.json` files and llama.cpp's pre-tokenizer type for each.
const SPLITS: [(&str, &str); 5] = [
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "llama-bpe",
    ),
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "qwen2",
    ),
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "qwen35",
    ),
    (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "tekken",
    ),
    (GPT2_PATTERN, "gpt-2"),
];

/// The metadata of `tokenizer_json`. `vocab_size` rows of embedding need as many tokens: tokens
/// past the tokenizer's own are padding (`<pad_N>`, control tokens, never produced by tokenizing
/// text); returns the metadata and the number of padding tokens.
pub fn metadata_of(
    tokenizer_json: &[u8],
    vocab_size: Option<usize>,
) -> Result<(Vec<(String, Value)>, usize)> {
    let json: Json =
        serde_json::from_slice(tokenizer_json).context("the tokenizer is not valid JSON")?;
    let model = &json["model"];
    ensure!(
        model["type"] == "BPE",
        "only BPE tokenizers (byte-level, or SentencePiece-style with byte fallback) can be \
         written as GGUF metadata; this one is {}",
        model["type"]
    );
    let mut tokens = tokens_by_id(model)?;
    let own = tokens.len();
    let vocab_size = vocab_size.unwrap_or(own);
    ensure!(
        vocab_size >= own,
        "the tokenizer has {own} tokens, more than the model's vocabulary ({vocab_size})"
    );
    tokens.extend((own..vocab_size).map(|id| format!("<pad_{id}>")));
    let merges = merges(model)?;
    let added: HashMap<u64, bool> = json["added_tokens"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| Some((t["id"].as_u64()?, t["special"].as_bool().unwrap_or(true))))
        .collect();
    let byte_fallback = model["byte_fallback"].as_bool().unwrap_or(false);
    let unk = model["unk_token"].as_str();
    let types: Vec<i64> = tokens
        .iter()
        .enumerate()
        .map(|(id, text)| match added.get(&(id as u64)) {
            _ if id >= own => TOKEN_CONTROL,
            _ if Some(text.as_str()) == unk => TOKEN_UNKNOWN,
            Some(true) => TOKEN_CONTROL,
            Some(false) => TOKEN_USER_DEFINED,
            None if byte_fallback && is_byte_token(text) => TOKEN_BYTE,
            None => TOKEN_NORMAL,
        })
        .collect();

    let mut metadata = Vec::new();
    if byte_fallback {
        let space_prefix = space_prefix(&json)?;
        metadata.extend([
            ("tokenizer.ggml.model".into(), Value::String("llama".into())),
            (
                "tokenizer.ggml.add_space_prefix".into(),
                Value::Bool(space_prefix),
            ),
            (
                "tokenizer.ggml.scores".into(),
                Value::Array(
                    scores(&tokens, &merges)
                        .into_iter()
                        .map(Value::F32)
                        .collect(),
                ),
            ),
        ]);
        if let Some(unk) = unk {
            let id = tokens.iter().position(|t| t == unk);
            let id = id.with_context(|| format!("the unknown token {unk:?} is not a token"))?;
            metadata.push((
                "tokenizer.ggml.unknown_token_id".into(),
                Value::U32(id as u32),
            ));
        }
    } else {
        let pre = pre_type(&json["pre_tokenizer"])?;
        let merges = merges
            .iter()
            .map(|(l, r)| Value::String(format!("{l} {r}")));
        metadata.extend([
            ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
            ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
            (
                "tokenizer.ggml.merges".into(),
                Value::Array(merges.collect()),
            ),
        ]);
    }
    metadata.extend([
        (
            "tokenizer.ggml.add_bos_token".into(),
            Value::Bool(adds_bos(&json["post_processor"])),
        ),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.into_iter().map(|t| Value::I32(t as i32)).collect()),
        ),
    ]);
    Ok((metadata, vocab_size - own))
}

fn tokens_by_id(model: &Json) -> Result<Vec<String>> {
    let vocab = model["vocab"]
        .as_object()
        .context("the tokenizer has no model.vocab")?;
    let mut tokens = vec![None; vocab.len()];
    for (text, id) in vocab {
        let slot = id
            .as_u64()
            .and_then(|id| tokens.get_mut(id as usize))
            .with_context(|| format!("token {text:?} has id {id}, outside 0..{}", vocab.len()))?;
        *slot = Some(text.clone());
    }
    tokens
        .into_iter()
        .enumerate()
        .map(|(id, t)| t.with_context(|| format!("no token has id {id}")))
        .collect()
}

fn merges(model: &Json) -> Result<Vec<(String, String)>> {
    model["merges"]
        .as_array()
        .context("the tokenizer has no model.merges")?
        .iter()
        .map(|m| match m {
            Json::String(s) => s
                .split_once(' ')
                .map(|(l, r)| (l.to_string(), r.to_string()))
                .with_context(|| format!("merge {s:?} is not two tokens")),
            Json::Array(pair) if pair.len() == 2 => Ok((
                pair[0].as_str().unwrap_or_default().to_string(),
                pair[1].as_str().unwrap_or_default().to_string(),
            )),
            other => bail!("merge {other} is neither \"a b\" nor [a, b]"),
        })
        .collect()
}

/// `<0xNN>`, a byte-fallback token.
fn is_byte_token(text: &str) -> bool {
    text.len() == 6 && text.starts_with("<0x") && text.ends_with('>')
}

/// Minus the rank of the first merge that makes each token; tokens no merge makes score lowest.
fn scores(tokens: &[String], merges: &[(String, String)]) -> Vec<f32> {
    let mut first: HashMap<String, usize> = HashMap::new();
    for (rank, (l, r)) in merges.iter().enumerate() {
        first.entry(format!("{l}{r}")).or_insert(rank);
    }
    let unmade = -(merges.len() as f32) - 1.0;
    tokens
        .iter()
        .map(|t| first.get(t).map_or(unmade, |&rank| -(rank as f32)))
        .collect()
}

/// Whether spaces become `▁` with one prepended (Llama 2, Mistral) or without (Gemma); anything
/// else is not SentencePiece-style.
fn space_prefix(json: &Json) -> Result<bool> {
    let replaces_spaces =
        |n: &Json| n["type"] == "Replace" && n["pattern"]["String"] == " " && n["content"] == "▁";
    let normalizer = &json["normalizer"];
    let steps: Vec<&Json> = match normalizer["type"].as_str() {
        Some("Sequence") => normalizer["normalizers"]
            .as_array()
            .into_iter()
            .flatten()
            .collect(),
        Some(_) => vec![normalizer],
        None => Vec::new(),
    };
    let pre = &json["pre_tokenizer"];
    match steps.as_slice() {
        [p, r] if p["type"] == "Prepend" && p["prepend"] == "▁" && replaces_spaces(r) => Ok(true),
        [r] if replaces_spaces(r) => Ok(false),
        [] if pre["type"] == "Metaspace" && pre["replacement"] == "▁" => {
            Ok(pre["prepend_scheme"] != "never" && pre["add_prefix_space"] != false)
        }
        _ => bail!(
            "a byte-fallback BPE tokenizer is written as SentencePiece, which needs spaces as ▁ \
             (a Metaspace pre-tokenizer, or a Replace normalizer after an optional Prepend); this \
             one has normalizer {normalizer} and pre-tokenizer {pre}"
        ),
    }
}

/// llama.cpp's pre-tokenizer type for a byte-level BPE pre-tokenizer.
fn pre_type(pre: &Json) -> Result<&'static str> {
    let byte_level = |p: &Json, regex: bool| {
        p["type"] == "ByteLevel" && p["use_regex"].as_bool().unwrap_or(true) == regex
    };
    fn split(p: &Json) -> Option<&str> {
        (p["type"] == "Split" && p["behavior"] == "Isolated" && p["invert"] != true)
            .then(|| p["pattern"]["Regex"].as_str())
            .flatten()
    }
    let name = |regex: &str| SPLITS.iter().find(|(r, _)| *r == regex).map(|(_, n)| *n);
    let steps = pre["pretokenizers"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    let found = if byte_level(pre, true) {
        Some("gpt-2")
    } else {
        match steps {
            [s, b] if byte_level(b, false) => split(s).and_then(name),
            [d, s, b] if byte_level(b, false) && split(d) == Some(r"\p{N}") => {
                (split(s) == Some(GPT2_PATTERN)).then_some("smollm")
            }
            [d, b] if d["type"] == "Digits" && d["individual_digits"] == true => {
                byte_level(b, true).then_some("smollm")
            }
            _ => None,
        }
    };
    found.with_context(|| {
        format!(
            "its pre-tokenizer has no llama.cpp type (GPT-2's, Llama 3's, Qwen2's, Qwen3.5's and \
             Tekken's splits have): {pre}"
        )
    })
}

/// Whether the post-processor puts a special token before the text.
fn adds_bos(post: &Json) -> bool {
    let steps = match post["type"].as_str() {
        Some("Sequence") => post["processors"].as_array().cloned().unwrap_or_default(),
        _ => vec![post.clone()],
    };
    steps.iter().any(|p| {
        p["type"] == "TemplateProcessing"
            && p["single"]
                .as_array()
                .and_then(|s| s.first())
                .is_some_and(|first| first.get("SpecialToken").is_some())
    })
}
