//! The tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata, rebuilt as a `tokenizers`
//! tokenizer whose ids equal llama.cpp's for the same file (prompt text parsed with special tokens,
//! as llama.cpp does with `parse_special`):
//! - `gpt2`: byte-level BPE over the vocabulary and merges, after llama.cpp's pre-tokenizer regexes
//!   for the file's `tokenizer.ggml.pre` type;
//! - `llama`: SentencePiece BPE: spaces become `▁` (one is prepended), the highest-scoring pair
//!   of adjacent pieces merges first, and characters outside the vocabulary fall back to byte
//!   tokens.

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, DecoderWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

pub use super::gguf_metadata::metadata_of;
use crate::source::gguf::GgufFile;
use crate::tokenizer::Tokenizer;
use leanstream_format::meta::ChatTemplate;

/// A GGUF file's tokenizer, the tokens that end a generation and the chat template.
pub struct GgufTokenizer {
    pub tokenizer: Tokenizer,
    pub eos_token_ids: Vec<u32>,
    pub chat_template: Option<ChatTemplate>,
}

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
pub(crate) const TOKEN_NORMAL: i64 = 1;
pub(crate) const TOKEN_UNKNOWN: i64 = 2;
pub(crate) const TOKEN_CONTROL: i64 = 3;
pub(crate) const TOKEN_USER_DEFINED: i64 = 4;
pub(crate) const TOKEN_BYTE: i64 = 6;

/// Tokens that end a turn in common chat formats. llama.cpp stops at them and treats them as
/// control tokens even where a file types them as normal text (Qwen2's `</s>`), so they are
/// matched in prompts and left out of decoded text here too.
const END_OF_GENERATION: [&str; 14] = [
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "</s>",
    "<EOT>",
    "_<EOT>",
    "<eos>",
];

/// Reads the tokenizer of `file`.
pub fn from_gguf(file: &GgufFile) -> Result<GgufTokenizer> {
    let path = file.path().display();
    let tokens = strings(file, "tokenizer.ggml.tokens")?
        .with_context(|| format!("{path}: missing metadata tokenizer.ggml.tokens"))?;
    let types = integers(file, "tokenizer.ggml.token_type")?;
    let model = file
        .str("tokenizer.ggml.model")?
        .with_context(|| format!("{path}: missing metadata tokenizer.ggml.model"))?;
    let (mut inner, default_add_bos) = match model {
        "gpt2" => byte_level_bpe(file, &tokens)?,
        "llama" => (sentencepiece_bpe(file, &tokens)?, true),
        other => bail!(
            "{path}: tokenizer model {other:?} is not supported (gpt2 byte-level BPE and llama \
             SentencePiece are)"
        ),
    };
    // Matched in the raw text, before normalization, as llama.cpp does; control and unknown
    // tokens are left out of decoded text, user-defined ones are not.
    let types: Vec<i64> = (0..tokens.len())
        .map(|id| match types.get(id) {
            _ if END_OF_GENERATION.contains(&tokens[id].as_str()) => TOKEN_CONTROL,
            Some(&t) => t,
            None => TOKEN_NORMAL,
        })
        .collect();
    let rstrip = strips_right(file)?;
    let added = |kinds: &[i64]| -> Vec<AddedToken> {
        tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| kinds.contains(t))
            .map(|(text, _)| {
                AddedToken::from(text.clone(), true)
                    .normalized(false)
                    .rstrip(rstrip(text))
            })
            .collect()
    };
    let specials = added(&[TOKEN_UNKNOWN, TOKEN_CONTROL]);
    let user_defined: Vec<AddedToken> = added(&[TOKEN_USER_DEFINED])
        .into_iter()
        .map(|t| t.special(false))
        .collect();
    inner
        .add_special_tokens(specials)
        .and_then(|_| inner.add_tokens(user_defined))
        .map_err(|e| anyhow::anyhow!("{path}: cannot add the special tokens: {e}"))?;

    let token_id = |key: &str| -> Result<Option<u32>> {
        match file.u32(key)? {
            Some(id) if id as usize >= tokens.len() => {
                bail!("{path}: {key} = {id} is outside the vocabulary")
            }
            id => Ok(id),
        }
    };
    let bos = token_id("tokenizer.ggml.bos_token_id")?;
    let eos = token_id("tokenizer.ggml.eos_token_id")?;
    let add_bos = file
        .bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(default_add_bos);
    let add_eos = file.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    // What `encode(text, true)` adds around the text, as llama.cpp's `add_special`.
    let mut single = vec!["$A".to_string()];
    let mut special_ids = Vec::new();
    for (add, id, what) in [(add_bos, bos, "BOS"), (add_eos, eos, "EOS")] {
        if add {
            let id = id.with_context(|| {
                format!("{path}: the tokenizer adds a {what} token but names none")
            })?;
            let text = tokens[id as usize].clone();
            special_ids.push((text.clone(), id));
            if what == "BOS" {
                single.insert(0, text);
            } else {
                single.push(text);
            }
        }
    }
    if !special_ids.is_empty() {
        let processor = TemplateProcessing::builder()
            .try_single(single)
            .and_then(|b| {
                b.special_tokens(special_ids)
                    .build()
                    .map_err(|e| e.to_string())
            })
            .map_err(|e| anyhow::anyhow!("{path}: cannot build the BOS/EOS template: {e}"))?;
        inner.with_post_processor(Some(processor));
    }

    let mut eos_token_ids: Vec<u32> = [
        eos,
        token_id("tokenizer.ggml.eot_token_id")?,
        token_id("tokenizer.ggml.eom_token_id")?,
    ]
    .into_iter()
    .flatten()
    .collect();
    eos_token_ids.extend(
        tokens
            .iter()
            .enumerate()
            .filter(|(_, text)| END_OF_GENERATION.contains(&text.as_str()))
            .map(|(id, _)| id as u32),
    );
    eos_token_ids.sort_unstable();
    eos_token_ids.dedup();
    let text = |id: Option<u32>| id.map(|id| tokens[id as usize].clone());
    let chat_template = file
        .str("tokenizer.chat_template")?
        .map(|template| ChatTemplate {
            template: template.to_string(),
            bos_token: text(bos),
            eos_token: text(eos),
        });
    Ok(GgufTokenizer {
        tokenizer: Tokenizer::new(inner),
        eos_token_ids,
        chat_template,
    })
}

/// Which special tokens swallow the whitespace after them: for Phi-3 (by `general.name`, as
/// llama.cpp decides) all of them but `<unk>`, `<s>` and `<|endoftext|>`; for other models none.
fn strips_right(file: &GgufFile) -> Result<impl Fn(&str) -> bool> {
    let name = file.str("general.name")?.unwrap_or("").to_lowercase();
    let phi3 = name.contains("phi-3") || name.contains("phi3");
    Ok(move |text: &str| phi3 && !matches!(text, "<unk>" | "<s>" | "<|endoftext|>"))
}

/// How llama.cpp pre-tokenizes for one `tokenizer.ggml.pre` type.
struct PreTokenizer {
    /// Regexes applied one after the other, each splitting the pieces of the previous one.
    regexes: &'static [&'static str],
    /// A piece that is itself a token skips the merges.
    ignore_merges: bool,
    /// Whether a BOS token is added when the file does not say (`tokenizer.ggml.add_bos_token`).
    add_bos: bool,
}

fn pre_tokenizer(pre: &str) -> Option<PreTokenizer> {
    const GPT2: &str =
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
    const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    // Qwen3.5's: combining marks join letters.
    const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    // Mistral's Tekken (Nemo, Small 3): words split before capitals, single digits.
    const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    let plain = |regexes| PreTokenizer {
        regexes,
        ignore_merges: false,
        add_bos: false,
    };
    Some(match pre {
        "llama-bpe" | "llama3" | "llama-v3" => PreTokenizer {
            regexes: &[LLAMA3],
            ignore_merges: true,
            add_bos: true,
        },
        "tekken" => PreTokenizer {
            regexes: &[TEKKEN],
            ignore_merges: true,
            add_bos: true,
        },
        "dbrx" | "smaug-bpe" => plain(&[LLAMA3]),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "stablelm2" => plain(&[QWEN2]),
        "qwen35" => plain(&[QWEN35]),
        // Single digits first, then GPT-2's split.
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" => plain(&[r"\p{N}", GPT2]),
        "gpt-2" | "gpt2" | "mpt" | "olmo" | "phi-2" => plain(&[GPT2]),
        _ => return None,
    })
}

/// Byte-level BPE (`tokenizer.ggml.model = gpt2`), and whether it adds a BOS token by default.
fn byte_level_bpe(file: &GgufFile, tokens: &[String]) -> Result<(tokenizers::Tokenizer, bool)> {
    let path = file.path().display();
    let pre = file.str("tokenizer.ggml.pre")?.unwrap_or("");
    let pre = pre_tokenizer(pre).with_context(|| {
        format!(
            "{path}: BPE pre-tokenizer type {pre:?} (tokenizer.ggml.pre) is not supported; \
             supported are llama-bpe, qwen2, qwen35, tekken, smollm, gpt-2 and their llama.cpp \
             aliases"
        )
    })?;
    let merges = strings(file, "tokenizer.ggml.merges")?
        .with_context(|| format!("{path}: missing metadata tokenizer.ggml.merges"))?
        .into_iter()
        .map(|m| {
            // The first token may itself be a space, so the separator is looked for after it.
            let first = m.chars().next().map_or(0, char::len_utf8);
            match m[first..].find(' ') {
                Some(i) => Ok((m[..first + i].to_string(), m[first + i + 1..].to_string())),
                None => bail!("{path}: merge {m:?} is not two tokens separated by a space"),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab(tokens), merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| anyhow::anyhow!("{path}: invalid BPE vocabulary or merges: {e}"))?;
    let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
    for regex in pre.regexes {
        let split = Split::new(
            SplitPattern::Regex(regex.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| anyhow::anyhow!("pre-tokenizer regex {regex:?}: {e}"))?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(PreTokenizerSequence::new(steps)));
    tokenizer.with_decoder(Some(ByteLevel::new(false, false, false)));
    Ok((tokenizer, pre.add_bos))
}

/// SentencePiece BPE (`tokenizer.ggml.model = llama`). llama.cpp merges the adjacent pair whose
/// concatenation is the highest-scoring vocabulary piece; as BPE merges that is every split of a
/// piece into two pieces, ranked by the piece's score.
fn sentencepiece_bpe(file: &GgufFile, tokens: &[String]) -> Result<tokenizers::Tokenizer> {
    let path = file.path().display();
    let scores = file
        .array("tokenizer.ggml.scores")?
        .with_context(|| format!("{path}: missing metadata tokenizer.ggml.scores"))?
        .iter()
        .map(|v| match v {
            Value::F32(x) => Ok(*x),
            other => bail!("{path}: tokenizer.ggml.scores holds {other:?}, expected floats"),
        })
        .collect::<Result<Vec<f32>>>()?;
    if scores.len() != tokens.len() {
        bail!(
            "{path}: {} scores for {} tokens",
            scores.len(),
            tokens.len()
        );
    }
    let vocab = vocab(tokens);
    let mut ranked = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        for (i, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(i);
            if vocab.contains_key(left) && vocab.contains_key(right) {
                ranked.push((scores[id], id, left.to_string(), right.to_string()));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let merges = ranked.into_iter().map(|(_, _, l, r)| (l, r)).collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = file.u32("tokenizer.ggml.unknown_token_id")? {
        let unk = tokens.get(unk as usize).with_context(|| {
            format!("{path}: the unknown token {unk} is outside the vocabulary")
        })?;
        builder = builder.unk_token(unk.clone());
    }
    let bpe = builder
        .build()
        .map_err(|e| anyhow::anyhow!("{path}: invalid SentencePiece vocabulary: {e}"))?;
    let space_prefix = file
        .bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    let escape = Replace::new(" ", "▁").expect("a literal pattern");
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new("▁", " ").expect("a literal pattern").into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if space_prefix {
        tokenizer
            .with_normalizer(Some(NormalizerSequence::new(vec![
                Prepend::new("▁".to_string()).into(),
                escape.into(),
            ])))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        decoders.push(Strip::new(' ', 1, 0).into());
    } else {
        tokenizer
            .with_normalizer(Some(escape))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tokenizer)
}

/// Token text → id. A text listed twice keeps its last id, as in llama.cpp.
fn vocab(tokens: &[String]) -> Vocab {
    tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect()
}

fn strings(file: &GgufFile, key: &str) -> Result<Option<Vec<String>>> {
    let Some(values) = file.array(key)? else {
        return Ok(None);
    };
    values
        .iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.clone()),
            other => bail!(
                "{}: {key} holds {other:?}, expected strings",
                file.path().display()
            ),
        })
        .collect::<Result<_>>()
        .map(Some)
}

/// An integer array; empty when the key is absent.
fn integers(file: &GgufFile, key: &str) -> Result<Vec<i64>> {
    let Some(values) = file.array(key)? else {
        return Ok(Vec::new());
    };
    values
        .iter()
        .map(|v| match *v {
            Value::I32(n) => Ok(n as i64),
            Value::U32(n) => Ok(n as i64),
            Value::I8(n) => Ok(n as i64),
            Value::U8(n) => Ok(n as i64),
            ref other => bail!(
                "{}: {key} holds {other:?}, expected integers",
                file.path().display()
            ),
        })
        .collect()
}
