//! The model's tokenizer and streaming detokenization. A converted file's compact BPE tables
//! (BPE_VOCAB, [`byte_bpe`]) when it has them; otherwise `tokenizer.json`, or one rebuilt from GGUF
//! metadata, through the `tokenizers` crate (about ten times the JSON's size in memory).

pub mod chat_template;
pub mod gguf;

mod byte_bpe;
mod from_json;
mod gguf_metadata;
mod pre_split;

use std::path::Path;

use anyhow::{Context, Result};
use leanstream_format::LsbFile;

pub use from_json::bpe_vocab;

/// Bytes the tokenizer of a converted file holds once loaded, for the memory planner: the compact
/// tables and character classes exactly when the file has BPE_VOCAB; else the parse of
/// `tokenizer.json` through `tokenizers`, about eleven times the JSON in RSS (measured: 15.3 MiB
/// for SmolLM2's 1.56 MB, 2.5 MiB for the embedded model's 0.26 MB).
pub fn resident_bytes(file: &LsbFile) -> Result<u64> {
    let compact =
        LsbFile::read_bpe_vocab(&file.path)?.map(|v| byte_bpe::ByteBpe::new(v).heap_bytes());
    Ok(planned_bytes(compact, file))
}

fn planned_bytes(compact: Option<usize>, file: &LsbFile) -> u64 {
    const PARSED_PER_JSON_BYTE: u64 = 11;
    compact.map_or(
        PARSED_PER_JSON_BYTE * file.tokenizer_json.len() as u64,
        |b| b as u64,
    )
}

/// A text file for the tokenizer (a prompt, a perplexity corpus); it must be UTF-8.
pub fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", path.display()))
}

#[derive(Clone)]
pub struct Tokenizer {
    inner: Inner,
}

#[derive(Clone)]
enum Inner {
    Hf(Box<tokenizers::Tokenizer>),
    Compact(std::sync::Arc<byte_bpe::ByteBpe>),
}

impl Tokenizer {
    /// Loads `tokenizer.json` from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).with_context(|| {
            format!(
                "cannot read {}: the model directory needs tokenizer.json",
                path.display()
            )
        })?;
        Self::from_bytes(&bytes).with_context(|| format!("invalid tokenizer {}", path.display()))
    }

    /// The tokenizer of a converted file: its compact tables if it has them, else its
    /// `tokenizer.json`.
    pub fn from_lsb(path: &Path) -> Result<Self> {
        if let Some(vocab) = LsbFile::read_bpe_vocab(path)? {
            return Ok(Self::compact(vocab));
        }
        Self::from_bytes(&LsbFile::read_tokenizer_json(path)?)
            .with_context(|| format!("{}: the embedded tokenizer is invalid", path.display()))
    }

    /// The compact tokenizer over a file's BPE_VOCAB tables.
    pub fn compact(vocab: leanstream_format::bpe_vocab::BpeVocab) -> Self {
        Self {
            inner: Inner::Compact(std::sync::Arc::new(byte_bpe::ByteBpe::new(vocab))),
        }
    }

    /// Whether this is the compact tokenizer (not a parsed `tokenizer.json`).
    pub fn is_compact(&self) -> bool {
        matches!(self.inner, Inner::Compact(_))
    }

    /// Bytes the compact tokenizer holds in memory (its tables and character classes); `None`
    /// for a parsed `tokenizer.json`, whose size only the OS can tell.
    pub fn compact_bytes(&self) -> Option<usize> {
        match &self.inner {
            Inner::Compact(c) => Some(c.heap_bytes()),
            Inner::Hf(_) => None,
        }
    }

    /// [`resident_bytes`] of this tokenizer, loaded from `file`, without reading the file again.
    pub fn resident_bytes(&self, file: &LsbFile) -> u64 {
        planned_bytes(self.compact_bytes(), file)
    }

    /// Parses the contents of a `tokenizer.json`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Self::new(inner))
    }

    /// Wraps a tokenizer built in code (from a GGUF file's metadata).
    pub fn new(inner: tokenizers::Tokenizer) -> Self {
        Self {
            inner: Inner::Hf(Box::new(inner)),
        }
    }

    /// Token ids of `text`; with `special`, the tokenizer's post-processor adds its special tokens
    /// (BOS only where the model's tokenizer does).
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        match &self.inner {
            Inner::Hf(t) => {
                let enc = t
                    .encode(text, special)
                    .map_err(|e| anyhow::anyhow!("cannot tokenize: {e}"))?;
                Ok(enc.get_ids().to_vec())
            }
            Inner::Compact(c) => Ok(c.encode(text, special)),
        }
    }

    /// The tokenizer as `tokenizer.json` bytes (a converted file embeds it).
    pub fn to_json(&self) -> Result<Vec<u8>> {
        let Inner::Hf(t) = &self.inner else {
            anyhow::bail!("the compact tokenizer has no tokenizer.json");
        };
        let json = t
            .to_string(false)
            .map_err(|e| anyhow::anyhow!("cannot serialise the tokenizer: {e}"))?;
        Ok(json.into_bytes())
    }

    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.inner {
            Inner::Hf(t) => t
                .decode(ids, true)
                .map_err(|e| anyhow::anyhow!("cannot detokenize: {e}")),
            Inner::Compact(c) => Ok(c.decode(ids)),
        }
    }
}

/// Turns a growing token sequence into text pieces as soon as they are complete characters.
/// Decoding each token alone breaks multi-byte characters and word-joining spaces, so the text of
/// a small trailing window is decoded and only its new, complete suffix is emitted.
#[derive(Default)]
pub struct TextStream {
    tokens: Vec<u32>,
    prev_index: usize,
    current_index: usize,
}

impl TextStream {
    /// Adds a token; returns the text it completes, if any.
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> Result<Option<String>> {
        let before = tokenizer.decode(&self.tokens[self.prev_index..self.current_index])?;
        self.tokens.push(token);
        let after = tokenizer.decode(&self.tokens[self.prev_index..])?;
        if after.len() > before.len()
            && !after.ends_with('\u{FFFD}')
            && after.is_char_boundary(before.len())
        {
            let piece = after[before.len()..].to_string();
            self.prev_index = self.current_index;
            self.current_index = self.tokens.len();
            Ok(Some(piece))
        } else {
            Ok(None)
        }
    }

    /// Text of the tokens not yet emitted (at the end of generation).
    pub fn finish(&self, tokenizer: &Tokenizer) -> Result<Option<String>> {
        let before = tokenizer.decode(&self.tokens[self.prev_index..self.current_index])?;
        let after = tokenizer.decode(&self.tokens[self.prev_index..])?;
        if after.len() > before.len() && after.is_char_boundary(before.len()) {
            Ok(Some(after[before.len()..].to_string()))
        } else {
            Ok(None)
        }
    }
}
