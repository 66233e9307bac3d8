//! Building the compact tables (FORMAT.md §4.5) from a `tokenizer.json`, at convert time. Only
//! tokenizers the compact encoder reproduces exactly are accepted: byte-level BPE with no
//! normalizer, the GPT-2 split (alone, or after isolating digits), a byte-level decoder and a
//! BOS/EOS template at most. Anything else is refused with the reason, and the file keeps only
//! `tokenizer.json` (the runtime then parses it, as before).

use std::collections::HashMap;

use anyhow::{bail, ensure, Context, Result};
use leanstream_format::bpe_vocab::{AddedToken, BpeVocab, Merge, PreSplit, NO_TOKEN};
use serde_json::Value;

use super::Tokenizer;

/// GPT-2's split pattern, as `tokenizers`' ByteLevel pre-tokenizer and llama.cpp's `gpt-2` use it.
pub(crate) const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// A text of every kind the encoders treat differently: contractions, runs of spaces, tabs and
/// newlines, digits, punctuation, accents, other scripts, emoji (bytes no merge covers).
const CHECK_TEXT: &str =
    "It's 2026-12-01; they'll say  \"we'd\"\tDON'T\n\n  x = 3.14159 * 42,000!\r\n\
    café naïve Ærø Łódź — “quotes” …\u{a0}日本語のテキスト、中文。Привет, мир! مرحبا नमस्ते 한국어 \
    👍🏽 👨\u{200d}👩\u{200d}👧 🇫🇷 ∀x∈ℝ: x² ≥ 0 ½ ١٢٣ \u{200b}\u{feff}   ";

/// The compact tables of `tokenizer.json`, or why they cannot reproduce it. Besides the checks of
/// each setting, the result must give the `tokenizers` crate's ids and text on a varied sample
/// (with every added token in it).
pub fn bpe_vocab(json: &[u8]) -> Result<BpeVocab> {
    let vocab = build(json)?;
    let reference = Tokenizer::from_bytes(json)?;
    let compact = Tokenizer::compact(vocab.clone());
    let mut text = CHECK_TEXT.to_string();
    for a in &vocab.added {
        text.push_str(&a.content);
        text.push_str(" a ");
    }
    for special in [false, true] {
        let ids = reference.encode(&text, special)?;
        ensure!(
            compact.encode(&text, special)? == ids,
            "the compact tokenizer's ids differ from tokenizer.json's on the check text"
        );
        ensure!(
            compact.decode(&ids)? == reference.decode(&ids)?,
            "the compact tokenizer's text differs from tokenizer.json's on the check text"
        );
    }
    Ok(vocab)
}

fn build(json: &[u8]) -> Result<BpeVocab> {
    let v: Value = serde_json::from_slice(json).context("tokenizer.json is not JSON")?;
    for key in ["truncation", "padding", "normalizer"] {
        ensure!(v[key].is_null(), "it has a {key}");
    }
    let model = &v["model"];
    ensure!(
        model["type"] == "BPE",
        "its model is {}, not BPE",
        model["type"]
    );
    for key in [
        "dropout",
        "unk_token",
        "continuing_subword_prefix",
        "end_of_word_suffix",
    ] {
        ensure!(model[key].is_null(), "its BPE model sets {key}");
    }
    for key in ["byte_fallback", "ignore_merges"] {
        ensure!(
            !model[key].as_bool().unwrap_or(false),
            "its BPE model sets {key}"
        );
    }
    let pre_split = pre_split(&v["pre_tokenizer"])?;
    ensure!(
        v["decoder"]["type"] == "ByteLevel",
        "its decoder is {}, not ByteLevel",
        v["decoder"]["type"]
    );

    let vocab: HashMap<&str, u32> = model["vocab"]
        .as_object()
        .context("the BPE vocabulary is not an object")?
        .iter()
        .map(|(k, id)| Ok((k.as_str(), id_of(id)?)))
        .collect::<Result<_>>()?;
    // Added tokens get their vocabulary id, or the next free one (as `tokenizers` assigns them).
    let mut next = vocab.len() as u32;
    let mut added = Vec::new();
    let mut added_ids: HashMap<String, u32> = HashMap::new();
    for t in v["added_tokens"].as_array().into_iter().flatten() {
        let content = t["content"]
            .as_str()
            .context("an added token has no content")?;
        if content.is_empty() {
            continue;
        }
        for key in ["single_word", "lstrip", "rstrip"] {
            ensure!(
                !t[key].as_bool().unwrap_or(false),
                "added token {content:?} sets {key}"
            );
        }
        ensure!(
            !added_ids.contains_key(content),
            "added token {content:?} is listed twice"
        );
        let id = vocab.get(content).copied().unwrap_or_else(|| {
            next += 1;
            next - 1
        });
        added_ids.insert(content.to_string(), id);
        added.push(AddedToken {
            id,
            special: t["special"].as_bool().unwrap_or(false),
            normalized: t["normalized"].as_bool().unwrap_or(true),
            content: content.to_string(),
        });
    }

    // Every id's decoded bytes: its characters mapped back to bytes, or its UTF-8 when one is not
    // a byte-level character (as the ByteLevel decoder does).
    let count = vocab
        .values()
        .chain(added_ids.values())
        .max()
        .map_or(0, |m| m + 1) as usize;
    let mut text: Vec<Option<&str>> = vec![None; count];
    for (&s, &id) in &vocab {
        text[id as usize] = Some(s);
    }
    for a in &added {
        text[a.id as usize].get_or_insert(a.content.as_str());
    }
    let char_byte = char_to_byte();
    let (mut blob, mut ends) = (Vec::new(), Vec::with_capacity(count));
    for (id, t) in text.iter().enumerate() {
        let t = t.with_context(|| format!("token id {id} has no text"))?;
        let bytes: Option<Vec<u8>> = t.chars().map(|c| char_byte.get(&c).copied()).collect();
        blob.extend(bytes.unwrap_or_else(|| t.as_bytes().to_vec()));
        ends.push(u32::try_from(blob.len()).context("the vocabulary is too large")?);
    }
    // A byte without a token is dropped: the BPE model has no unknown token (checked above).
    let byte_tokens = (0..=255u8)
        .map(|b| {
            let c = byte_to_char(b).to_string();
            vocab.get(c.as_str()).copied().unwrap_or(NO_TOKEN)
        })
        .collect();

    let token = |s: &str| {
        vocab
            .get(s)
            .copied()
            .with_context(|| format!("merge token {s:?} is not in the vocabulary"))
    };
    let mut merges = Vec::new();
    for (rank, m) in model["merges"]
        .as_array()
        .context("the BPE merges are not a list")?
        .iter()
        .enumerate()
    {
        let (left, right) = match m {
            Value::Array(pair) if pair.len() == 2 => (
                pair[0].as_str().context("a merge is not text")?,
                pair[1].as_str().context("a merge is not text")?,
            ),
            Value::String(s) => s
                .split_once(' ')
                .filter(|(_, r)| !r.contains(' '))
                .with_context(|| format!("merge {s:?} is not two tokens"))?,
            other => bail!("merge {other} is not two tokens"),
        };
        merges.push(Merge {
            left: token(left)?,
            right: token(right)?,
            rank: rank as u32,
            result: token(&format!("{left}{right}"))?,
        });
    }
    // A pair listed twice keeps its last rank, as in `tokenizers`' merge map.
    merges.sort_by_key(|m| (m.left, m.right, m.rank));
    merges.reverse();
    merges.dedup_by_key(|m| (m.left, m.right));
    merges.reverse();

    let (prefix, suffix) = template(&v["post_processor"])?;
    Ok(BpeVocab {
        pre_split,
        blob,
        ends,
        byte_tokens,
        merges,
        added,
        prefix,
        suffix,
    })
}

fn id_of(v: &Value) -> Result<u32> {
    v.as_u64()
        .and_then(|id| u32::try_from(id).ok())
        .with_context(|| format!("token id {v} is not a u32"))
}

/// The pre-split the pre-tokenizer amounts to, if it is one the compact encoder has.
fn pre_split(p: &Value) -> Result<PreSplit> {
    let byte_level = |p: &Value, regex: bool| {
        p["type"] == "ByteLevel"
            && !p["add_prefix_space"].as_bool().unwrap_or(true)
            && p["use_regex"].as_bool().unwrap_or(true) == regex
    };
    let split = |p: &Value, pattern: &str| {
        p["type"] == "Split"
            && p["pattern"]["Regex"] == pattern
            && p["behavior"] == "Isolated"
            && !p["invert"].as_bool().unwrap_or(false)
    };
    if byte_level(p, true) {
        return Ok(PreSplit::Gpt2);
    }
    if p["type"] == "Sequence" {
        let steps = p["pretokenizers"].as_array().map_or(&[][..], Vec::as_slice);
        match steps {
            [a, b] if split(a, GPT2_PATTERN) && byte_level(b, false) => return Ok(PreSplit::Gpt2),
            [a, b, c] if split(a, r"\p{N}") && split(b, GPT2_PATTERN) && byte_level(c, false) => {
                return Ok(PreSplit::DigitsThenGpt2)
            }
            _ => {}
        }
    }
    bail!("its pre-tokenizer is not one the compact tokenizer has: {p}")
}

/// The ids a BOS/EOS template puts before and after the text.
fn template(p: &Value) -> Result<(Vec<u32>, Vec<u32>)> {
    if p.is_null() || p["type"] == "ByteLevel" {
        return Ok((Vec::new(), Vec::new()));
    }
    ensure!(
        p["type"] == "TemplateProcessing",
        "its post-processor is {}",
        p["type"]
    );
    let (mut prefix, mut suffix, mut seen_text) = (Vec::new(), Vec::new(), false);
    for piece in p["single"]
        .as_array()
        .context("the template has no single form")?
    {
        if piece["Sequence"]["id"] == "A" {
            ensure!(!seen_text, "the template repeats the text");
            seen_text = true;
        } else if let Some(name) = piece["SpecialToken"]["id"].as_str() {
            let ids = p["special_tokens"][name]["ids"]
                .as_array()
                .with_context(|| format!("the template's token {name:?} has no ids"))?;
            for id in ids {
                if seen_text { &mut suffix } else { &mut prefix }.push(id_of(id)?);
            }
        } else {
            bail!("the template has an unknown piece {piece}");
        }
    }
    ensure!(seen_text, "the template leaves out the text");
    Ok((prefix, suffix))
}

/// GPT-2's byte-to-character map: printable Latin-1 bytes stand for themselves, the others for
/// the characters from U+0100 on, in byte order.
pub(crate) fn byte_to_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return b as char;
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).expect("a valid code point")
}

fn char_to_byte() -> HashMap<char, u8> {
    (0..=255u8).map(|b| (byte_to_char(b), b)).collect()
}
