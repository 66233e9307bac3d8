//! Calibration data: the text prep profiles the model on, cut into windows and split into a
//! training part (thresholds, placement, predictors) and a held-out part (every reported number).

use std::path::Path;

use anyhow::{bail, Context, Result};
use leanstream::tokenizer::Tokenizer;

/// The calibration text shipped with the repository (public-domain English prose).
pub const DEFAULT_CALIB: &str = include_str!("../../data/calib.txt");

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
    /// Tokenizes `text` (or the default text) and keeps the first `max_tokens` tokens.
    pub fn new(tokenizer: &Tokenizer, file: Option<&Path>, max_tokens: usize) -> Result<Self> {
        let text = match file {
            Some(p) => {
                let bytes = std::fs::read(p)
                    .with_context(|| format!("cannot read calibration text {}", p.display()))?;
                String::from_utf8(bytes)
                    .with_context(|| format!("{} is not UTF-8 text", p.display()))?
            }
            None => DEFAULT_CALIB.to_string(),
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
