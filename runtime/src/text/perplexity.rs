//! Perplexity of a token sequence: consecutive windows, each from an empty cache, every token after
//! the first of its window scored. Also the same pass for a model and a reference side by side
//! (KL divergence and top-1 agreement of their next-token distributions), which the runtime
//! reports for sparse policies and the converter for its threshold.

use anyhow::{bail, Result};
use serde::Serialize;

use crate::model::kv_cache::KvCache;
use crate::model::LanguageModel;
use crate::text::generate::PROMPT_CHUNK;
use crate::text::sampler::argmax;

#[derive(Debug, Clone, Serialize)]
pub struct Perplexity {
    pub perplexity: f64,
    /// Tokens scored.
    pub tokens: usize,
    /// Mean negative log-likelihood in nats.
    pub mean_nll: f64,
}

/// A model's next-token distributions against a reference's, on the same positions.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// Positions scored.
    pub tokens: usize,
    pub perplexity: f64,
    pub reference_perplexity: f64,
    /// Mean KL(reference ‖ model) in nats per token.
    pub kl: f64,
    /// Fraction of positions where both put the same token first.
    pub top1_agreement: f64,
}

/// Sums what [`Comparison`] reports, one position at a time.
#[derive(Debug, Default)]
pub struct ComparisonAccum {
    n: usize,
    nll: f64,
    nll_reference: f64,
    kl: f64,
    agree: usize,
}

impl ComparisonAccum {
    /// Adds one position: both models' logits and the token that came next.
    pub fn add(&mut self, logits: &[f32], reference: &[f32], target: usize) {
        let (p, r) = (log_softmax(logits), log_softmax(reference));
        self.nll -= p[target];
        self.nll_reference -= r[target];
        self.kl += r
            .iter()
            .zip(&p)
            .map(|(a, b)| a.exp() * (a - b))
            .sum::<f64>();
        self.agree += (argmax(logits) == argmax(reference)) as usize;
        self.n += 1;
    }

    /// Adds the positions `other` holds (sums taken in the order of the calls: merge runs of
    /// positions in a fixed order for the same bits whatever ran them).
    pub fn merge(&mut self, other: &Self) {
        self.n += other.n;
        self.nll += other.nll;
        self.nll_reference += other.nll_reference;
        self.kl += other.kl;
        self.agree += other.agree;
    }

    /// The model's perplexity so far.
    pub fn perplexity(&self) -> f64 {
        (self.nll / self.n.max(1) as f64).exp()
    }

    pub fn finish(&self) -> Comparison {
        let n = self.n.max(1) as f64;
        Comparison {
            tokens: self.n,
            perplexity: (self.nll / n).exp(),
            reference_perplexity: (self.nll_reference / n).exp(),
            // Rounding can leave an identical pair at -1e-17; KL is never negative.
            kl: (self.kl / n).max(0.0),
            top1_agreement: self.agree as f64 / n,
        }
    }
}

/// Scores `ids` in windows of `window` tokens; a last window shorter than 2 tokens is dropped.
pub fn perplexity(
    model: impl LanguageModel,
    ids: &[u32],
    window: usize,
    progress: bool,
) -> Result<Perplexity> {
    perplexity_from(model, ids, window, 0, progress)
}

/// Scores `ids` in windows of `window` tokens, each from position `score_from` on: the next-token
/// predictions made at positions `score_from ..= window − 2` of each window. With `score_from` 0
/// every window counts, a last one shorter than 2 tokens dropped; above 0, only whole windows count,
/// as `llama-perplexity` does (it scores from `window / 2`), so that the two tools score the same
/// positions.
pub fn perplexity_from(
    mut model: impl LanguageModel,
    ids: &[u32],
    window: usize,
    score_from: usize,
    progress: bool,
) -> Result<Perplexity> {
    let (mut nll, mut scored) = (0.0f64, 0usize);
    let windows = Windows::new(window, score_from)?;
    for_each_position(&mut [&mut model], ids, windows, progress, |rows, target| {
        nll -= log_softmax_at(rows[0], target);
        scored += 1;
        (nll / scored as f64).exp()
    })?;
    let mean_nll = nll / scored as f64;
    Ok(Perplexity {
        perplexity: mean_nll.exp(),
        tokens: scored,
        mean_nll,
    })
}

/// Scores `ids` with `model` and `reference` in the same pass over the same windows.
pub fn compare(
    model: &mut dyn LanguageModel,
    reference: &mut dyn LanguageModel,
    ids: &[u32],
    window: usize,
    progress: bool,
) -> Result<Comparison> {
    compare_from(model, reference, ids, window, 0, progress)
}

/// [`compare`] on the positions [`perplexity_from`] scores.
pub fn compare_from(
    model: &mut dyn LanguageModel,
    reference: &mut dyn LanguageModel,
    ids: &[u32],
    window: usize,
    score_from: usize,
    progress: bool,
) -> Result<Comparison> {
    if model.config().vocab_size != reference.config().vocab_size {
        bail!(
            "the model and its reference have different vocabularies ({} and {} tokens)",
            model.config().vocab_size,
            reference.config().vocab_size
        );
    }
    let mut acc = ComparisonAccum::default();
    let windows = Windows::new(window, score_from)?;
    for_each_position(
        &mut [model, reference],
        ids,
        windows,
        progress,
        |rows, t| {
            acc.add(rows[0], rows[1], t);
            acc.perplexity()
        },
    )?;
    Ok(acc.finish())
}

/// Which positions of a text are scored: windows of `len` tokens, each from an empty cache, and
/// in each the predictions made at positions `score_from ..= len − 2`.
#[derive(Debug, Clone, Copy)]
struct Windows {
    len: usize,
    score_from: usize,
}

impl Windows {
    fn new(len: usize, score_from: usize) -> Result<Self> {
        if len < 2 {
            bail!("the perplexity window must hold at least 2 tokens");
        }
        if score_from > len - 2 {
            bail!(
                "scoring from position {score_from} of a {len}-token window leaves nothing to \
                 score: choose a position below {}",
                len - 1
            );
        }
        Ok(Self { len, score_from })
    }

    /// The windows of `ids` that are scored.
    fn of<'a>(&self, ids: &'a [u32]) -> Result<Vec<&'a [u32]>> {
        let min_len = if self.score_from == 0 { 2 } else { self.len };
        let windows: Vec<&[u32]> = ids
            .chunks(self.len)
            .filter(|w| w.len() >= min_len)
            .collect();
        if windows.is_empty() {
            bail!(
                "the text has {} tokens, fewer than the {min_len} one window needs: nothing to score",
                ids.len()
            );
        }
        Ok(windows)
    }
}

/// Runs every model over the windows of `ids` and hands `score` each scored position: one logits
/// row per model and the next token. `score` returns the running perplexity for the progress bar.
fn for_each_position(
    models: &mut [&mut dyn LanguageModel],
    ids: &[u32],
    spec: Windows,
    progress: bool,
    mut score: impl FnMut(&[&[f32]], usize) -> f64,
) -> Result<()> {
    let (window, score_from) = (spec.len, spec.score_from);
    let windows = spec.of(ids)?;
    let bar = Progress::new(progress, windows.len() as u64);
    let vocab = models[0].config().vocab_size;
    let mut caches: Vec<KvCache> = models.iter().map(|m| m.new_cache(window)).collect();
    // A streaming model reads each cluster once per prompt chunk; scored one token at a time, it
    // reads what generation reads.
    let chunk_len = if models.iter().any(|m| m.scores_by_decoding()) {
        1
    } else {
        models
            .iter()
            .map(|m| m.prompt_chunk())
            .min()
            .unwrap_or(PROMPT_CHUNK)
    };
    for w in windows {
        caches.iter_mut().for_each(KvCache::clear);
        for (c, chunk) in w.chunks(chunk_len).enumerate() {
            let logits = models
                .iter_mut()
                .zip(&mut caches)
                .map(|(m, cache)| m.forward(chunk, cache, true))
                .collect::<Result<Vec<_>>>()?;
            for i in 0..chunk.len() {
                let next = c * chunk_len + i + 1;
                if next < w.len() && next > score_from {
                    let rows: Vec<&[f32]> = logits
                        .iter()
                        .map(|l| &l[i * vocab..(i + 1) * vocab])
                        .collect();
                    let ppl = score(&rows, w[next] as usize);
                    bar.set_message(format!("{ppl:.3}"));
                }
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(())
}

/// `ln Σ exp(row)`, in f64.
fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    max + row
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
}

/// `log softmax(row)`, in f64.
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let lse = log_sum_exp(row);
    row.iter().map(|&l| l as f64 - lse).collect()
}

/// `log softmax(row)[target]`, in f64.
fn log_softmax_at(row: &[f32], target: usize) -> f64 {
    row[target] as f64 - log_sum_exp(row)
}

/// The windows' progress bar on stderr (with the `cli` feature; without it, nothing is drawn).
struct Progress {
    #[cfg(feature = "cli")]
    bar: indicatif::ProgressBar,
}

impl Progress {
    #[cfg(feature = "cli")]
    fn new(shown: bool, windows: u64) -> Self {
        use indicatif::{ProgressBar, ProgressStyle};
        let bar = if shown {
            ProgressBar::new(windows)
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template(
                "perplexity {bar:40} {pos}/{len} windows  {elapsed} (eta {eta})  ppl {msg}",
            )
            .expect("valid template"),
        );
        Self { bar }
    }

    #[cfg(not(feature = "cli"))]
    fn new(_shown: bool, _windows: u64) -> Self {
        Self {}
    }

    fn set_message(&self, _message: String) {
        #[cfg(feature = "cli")]
        self.bar.set_message(_message);
    }

    fn inc(&self, _windows: u64) {
        #[cfg(feature = "cli")]
        self.bar.inc(_windows);
    }

    fn finish_and_clear(&self) {
        #[cfg(feature = "cli")]
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_is_normalised() {
        let row = [1000.0f32, 999.0, -5.0];
        let total: f64 = (0..3).map(|i| log_softmax_at(&row, i).exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
        assert!(
            (log_softmax_at(&row, 0) - -(1.0 + (-1f64).exp() + (-1005f64).exp()).ln()).abs()
                < 1e-12
        );
        assert_eq!(log_softmax(&row)[1], log_softmax_at(&row, 1));
    }

    #[test]
    fn comparison_of_known_distributions() {
        let mut acc = ComparisonAccum::default();
        // Reference (ln 3, 0) → p = (3/4, 1/4); model (0, 0) → q = (1/2, 1/2).
        let reference = [3f32.ln(), 0.0];
        acc.add(&[0.0, 0.0], &reference, 0);
        let kl = 0.75 * (0.75f64 / 0.5).ln() + 0.25 * (0.25f64 / 0.5).ln();
        let c = acc.finish();
        assert!((c.kl - kl).abs() < 1e-7, "{} vs {kl}", c.kl);
        assert!((c.perplexity - 2.0).abs() < 1e-12);
        assert!((c.reference_perplexity - 4.0 / 3.0).abs() < 1e-6);
        // argmax of a tie is the first token: both pick token 0.
        assert_eq!(c.top1_agreement, 1.0);
        acc.add(&[0.0, 1.0], &reference, 1);
        let c = acc.finish();
        assert_eq!(c.tokens, 2);
        assert_eq!(c.top1_agreement, 0.5);
    }
}
