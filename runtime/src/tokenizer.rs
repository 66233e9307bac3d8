//! The model's tokenizer (`tokenizer.json`, or one rebuilt from GGUF metadata, through the
//! `tokenizers` crate) and streaming detokenization.

use std::path::Path;

use anyhow::{Context, Result};

/// A text file for the tokenizer (a prompt, a perplexity corpus); it must be UTF-8.
pub fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", path.display()))
}

#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
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

    /// Parses the contents of a `tokenizer.json`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Self::new(inner))
    }

    /// Wraps a tokenizer built in code (from a GGUF file's metadata).
    pub fn new(inner: tokenizers::Tokenizer) -> Self {
        Self { inner }
    }

    /// Token ids of `text`; with `special`, the tokenizer's post-processor adds its special tokens
    /// (BOS only where the model's tokenizer does).
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, special)
            .map_err(|e| anyhow::anyhow!("cannot tokenize: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The tokenizer as `tokenizer.json` bytes (a converted file embeds it).
    pub fn to_json(&self) -> Result<Vec<u8>> {
        let json = self
            .inner
            .to_string(false)
            .map_err(|e| anyhow::anyhow!("cannot serialise the tokenizer: {e}"))?;
        Ok(json.into_bytes())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| anyhow::anyhow!("cannot detokenize: {e}"))
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
