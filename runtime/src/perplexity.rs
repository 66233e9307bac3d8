//! Perplexity of a token sequence: consecutive windows, each from an empty cache, every token after
//! the first of its window scored.

use anyhow::{bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::generate::PROMPT_CHUNK;
use crate::kv_cache::KvCache;
use crate::model::LanguageModel;

#[derive(Debug, Clone, Serialize)]
pub struct Perplexity {
    pub perplexity: f64,
    /// Tokens scored.
    pub tokens: usize,
    /// Mean negative log-likelihood in nats.
    pub mean_nll: f64,
}

/// Scores `ids` in windows of `window` tokens; a last window shorter than 2 tokens is dropped.
pub fn perplexity(
    mut model: impl LanguageModel,
    ids: &[u32],
    window: usize,
    progress: bool,
) -> Result<Perplexity> {
    if window < 2 {
        bail!("the perplexity window must hold at least 2 tokens");
    }
    let windows: Vec<&[u32]> = ids.chunks(window).filter(|w| w.len() >= 2).collect();
    if windows.is_empty() {
        bail!("the text has fewer than 2 tokens: nothing to score");
    }
    let bar = if progress {
        ProgressBar::new(windows.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "perplexity {bar:40} {pos}/{len} windows  {elapsed} (eta {eta})  ppl {msg}",
        )
        .expect("valid template"),
    );
    let vocab = model.config().vocab_size;
    let mut cache = KvCache::new(model.config(), window);
    let (mut nll, mut scored) = (0.0f64, 0usize);
    for w in windows {
        cache.clear();
        for (c, chunk) in w.chunks(PROMPT_CHUNK).enumerate() {
            let logits = model.forward(chunk, &mut cache, true)?;
            for (i, row) in logits.chunks_exact(vocab).enumerate() {
                let next = c * PROMPT_CHUNK + i + 1;
                if next < w.len() {
                    nll -= log_softmax_at(row, w[next] as usize);
                    scored += 1;
                }
            }
        }
        bar.inc(1);
        bar.set_message(format!("{:.3}", (nll / scored as f64).exp()));
    }
    bar.finish_and_clear();
    let mean_nll = nll / scored as f64;
    Ok(Perplexity {
        perplexity: mean_nll.exp(),
        tokens: scored,
        mean_nll,
    })
}

/// `log softmax(row)`, in f64.
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
    let norm = max + sum.ln();
    row.iter().map(|&l| l as f64 - norm).collect()
}

/// `log softmax(row)[target]`, in f64.
fn log_softmax_at(row: &[f32], target: usize) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
    row[target] as f64 - max - sum.ln()
}

#[cfg(test)]
mod tests {
    use super::log_softmax_at;

    #[test]
    fn log_softmax_is_normalised() {
        let row = [1000.0f32, 999.0, -5.0];
        let total: f64 = (0..3).map(|i| log_softmax_at(&row, i).exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
        assert!(
            (log_softmax_at(&row, 0) - -(1.0 + (-1f64).exp() + (-1005f64).exp()).ln()).abs()
                < 1e-12
        );
    }
}
