//! Calibration data: the text prep profiles the model on, cut into windows and split into a
//! training part (thresholds, placement, predictors) and a held-out part (every reported number).

use std::borrow::Cow;
use std::path::Path;

use anyhow::{bail, Context, Result};
use leanstream::source::config::Activation;
use leanstream::tokenizer::Tokenizer;

/// The calibration text shipped with the repository (public-domain English prose): the default
/// for ReLU models (their exact skip needs no calibrated threshold) and for `synth`'s source.
pub const DEFAULT_CALIB: &str = include_str!("../../data/calib.txt");

/// Python source with its docstrings (Python 3.11's `argparse.py`, PSF licence; data/README.md).
const CALIB_CODE: &str = include_str!("../../data/calib-code.txt");

/// Technical English (this project's format specification as of commit afed27b).
const CALIB_TECHNICAL: &str = include_str!("../../data/calib-technical.txt");

/// Characters of each text per turn of [`varied_text`].
const VARIED_BLOCK: usize = 1024;

/// The text a model is calibrated on when no `--calib` is given: ReLU-family models (ReLU,
/// FATReLU, dReLU) the prose of data/calib.txt. SwiGLU models get the varied
/// text ([`varied_text`]): their per-layer thresholds and predictors are fitted to the text, and
/// predictors fitted to prose alone miss far more on other text (SmolLM2 `target:0.5` predicted on
/// the GPL-3 licence: +120 % prose-only, +8 % varied; docs/results.md, "Varied calibration text").
pub fn default_text(activation: Activation) -> Cow<'static, str> {
    match activation.is_relu_like() {
        true => Cow::Borrowed(DEFAULT_CALIB),
        false => Cow::Owned(varied_text()),
    }
}

/// The calibration text's name in META's provenance: `--calib`'s file, or which default.
pub fn text_name(file: Option<&Path>, activation: Activation) -> String {
    match (file, activation.is_relu_like()) {
        (Some(p), _) => p.display().to_string(),
        (None, true) => "default: data/calib.txt (prose)".into(),
        (None, false) => "default: varied (1024-character turns of data/calib.txt, \
                                     data/calib-code.txt and data/calib-technical.txt)"
            .into(),
    }
}

/// Prose, Python source and technical English in turns of [`VARIED_BLOCK`] characters (a text
/// that has run out is left out of later turns), so any prefix of the text — the converter keeps
/// the first `--calib-tokens` tokens — holds all three kinds in equal parts.
pub fn varied_text() -> String {
    interleave(&[DEFAULT_CALIB, CALIB_CODE, CALIB_TECHNICAL], VARIED_BLOCK)
}

fn interleave(texts: &[&str], block: usize) -> String {
    let mut rests: Vec<&str> = texts.to_vec();
    let mut out = String::with_capacity(texts.iter().map(|t| t.len()).sum());
    while rests.iter().any(|r| !r.is_empty()) {
        for rest in &mut rests {
            let end = rest
                .char_indices()
                .nth(block)
                .map_or(rest.len(), |(i, _)| i);
            out.push_str(&rest[..end]);
            *rest = &rest[end..];
        }
    }
    out
}

/// Tokens per calibration window (each starts from an empty context).
pub const WINDOW: usize = 256;

/// Every `HELDOUT_EVERY`-th window is held out.
const HELDOUT_EVERY: usize = 5;

pub struct Calibration {
    /// Token windows, each `WINDOW` tokens (the last may be shorter).
    pub windows: Vec<Vec<u32>>,
    /// Whether window `i` is held out.
    pub heldout: Vec<bool>,
}

impl Calibration {
    /// Tokenizes the text of `file` (or else `default`) and keeps the first `max_tokens` tokens.
    pub fn new(
        tokenizer: &Tokenizer,
        file: Option<&Path>,
        default: &str,
        max_tokens: usize,
    ) -> Result<Self> {
        let text = match file {
            Some(p) => {
                let bytes = std::fs::read(p)
                    .with_context(|| format!("cannot read calibration text {}", p.display()))?;
                String::from_utf8(bytes)
                    .with_context(|| format!("{} is not UTF-8 text", p.display()))?
            }
            None => default.to_string(),
        };
        let mut ids = tokenizer.encode(&text, false)?;
        ids.truncate(max_tokens);
        let windows: Vec<Vec<u32>> = ids
            .chunks(WINDOW)
            .filter(|w| w.len() >= 2)
            .map(<[u32]>::to_vec)
            .collect();
        let mut heldout: Vec<bool> = (0..windows.len())
            .map(|i| i % HELDOUT_EVERY == HELDOUT_EVERY - 1)
            .collect();
        if windows.len() < 2 {
            bail!(
                "the calibration text gives {} tokens; at least two windows of {WINDOW} are needed",
                ids.len()
            );
        }
        if !heldout.iter().any(|h| *h) {
            *heldout.last_mut().expect("two windows") = true;
        }
        Ok(Self { windows, heldout })
    }

    pub fn tokens(&self) -> usize {
        self.windows.iter().map(Vec::len).sum()
    }

    /// For each of `rows`, the row before it in the same window, if any.
    pub fn previous(&self, rows: &[usize]) -> Vec<Option<usize>> {
        let mut starts = std::collections::HashSet::new();
        let mut row = 0;
        for w in &self.windows {
            starts.insert(row);
            row += w.len();
        }
        crate::activity::previous_rows(rows, |r| starts.contains(&r))
    }

    /// Row indices (token positions over all windows, concatenated) of the training and held-out
    /// parts.
    pub fn split_rows(&self) -> (Vec<usize>, Vec<usize>) {
        let (mut train, mut held) = (Vec::new(), Vec::new());
        let mut row = 0;
        for (w, &h) in self.windows.iter().zip(&self.heldout) {
            let dst = if h { &mut held } else { &mut train };
            dst.extend(row..row + w.len());
            row += w.len();
        }
        (train, held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_varied_text_takes_turns_of_whole_characters_until_every_text_is_used() {
        let mixed = interleave(&["aébc", "12", "xyzw"], 2);
        assert_eq!(mixed, "aé12xybczw");
        let varied = varied_text();
        assert_eq!(
            varied.len(),
            DEFAULT_CALIB.len() + CALIB_CODE.len() + CALIB_TECHNICAL.len()
        );
        // The first turns: 1024 characters of each text, in order.
        let prose: String = DEFAULT_CALIB.chars().take(VARIED_BLOCK).collect();
        let code: String = CALIB_CODE.chars().take(VARIED_BLOCK).collect();
        assert!(varied.starts_with(&(prose + &code)));
        assert!(CALIB_CODE.starts_with("# Author: Steven J. Bethard"));
        assert!(CALIB_TECHNICAL.starts_with("# LeanStream file format"));
        assert_eq!(default_text(Activation::Relu), DEFAULT_CALIB);
        assert_eq!(default_text(Activation::Silu), varied);
    }
}
