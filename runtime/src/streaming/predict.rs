//! Predictors as they stay resident: int8 weights (a quarter of f32), scored on the hot path. The
//! format crate's [`Predictor::scores`] on the file's f16 weights is the reference (prep trains
//! and evaluates with it); a test bounds the int8 path's distance from it.
//!
//! `W1` (`rank × input_dim`) keeps one scale per row; `W2` is stored transposed (`rank ×
//! outputs`) with one scale per row of that, i.e. per hidden unit, so the scales cost `2 · rank`
//! floats and the second layer is `rank` scaled row additions, which vectorize. The input stays
//! f32: a residual stream's outlier channels would ruin an int8 input.

use anyhow::{Context, Result};
use half::f16;
use leanstream_format::predictor::{normalise_input, normalise_input_into, Predictor};

use crate::storage::{AlignedBuf, IoQueue, Ticket};

/// The share of a layer's FFN bundle bytes its two predictors may hold resident by default.
pub const PREDICTOR_SHARE: f64 = 0.03;

/// Bytes an int8 predictor of this shape holds resident ([`QuantPredictor::bytes`]).
pub fn predictor_bytes(input_dim: usize, rank: usize, outputs: usize) -> u64 {
    (rank * (input_dim + outputs) + 8 * rank + 2 * (rank + outputs)) as u64
}

/// The converter's default rank: the largest at which a layer's look-ahead and own predictors
/// together, resident as int8, hold at most [`PREDICTOR_SHARE`] of its FFN bundle bytes
/// (`bundle_bytes` per neuron) — so every mode stays within it, predicted mode with both
/// resident included; at least `min`.
pub fn default_predictor_rank(
    input_dim: usize,
    outputs: usize,
    bundle_bytes: usize,
    min: usize,
) -> usize {
    let budget = PREDICTOR_SHARE * (outputs * bundle_bytes) as f64 / 2.0;
    let fixed = predictor_bytes(input_dim, 0, outputs) as f64;
    let per_rank =
        (predictor_bytes(input_dim, 1, outputs) - predictor_bytes(input_dim, 0, outputs)) as f64;
    (((budget - fixed) / per_rank).floor().max(0.0) as usize).max(min)
}

pub struct QuantPredictor {
    input_dim: usize,
    rank: usize,
    outputs: usize,
    /// A neuron is predicted active when its score is at or above this.
    pub threshold: f32,
    w1: Vec<i8>,
    w1_scale: Vec<f32>,
    b1: Vec<f16>,
    /// `W2` transposed: row `j` holds hidden unit `j`'s weight to every output.
    w2t: Vec<i8>,
    w2t_scale: Vec<f32>,
    b2: Vec<f16>,
}

/// Rows of `values` (each `len` long) as int8 with one scale per row: `q = round(v / s)`,
/// `s = max |v| / 127`.
fn quantize_rows(values: impl Iterator<Item = f32>, len: usize) -> (Vec<i8>, Vec<f32>) {
    let values: Vec<f32> = values.collect();
    let mut q = Vec::with_capacity(values.len());
    let mut scales = Vec::with_capacity(values.len() / len.max(1));
    for row in values.chunks(len.max(1)) {
        let max = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let s = if max > 0.0 { max / 127.0 } else { 1.0 };
        q.extend(
            row.iter()
                .map(|v| (v / s).round().clamp(-127.0, 127.0) as i8),
        );
        scales.push(s);
    }
    (q, scales)
}

/// `Σ w[i]·x[i]` in eight lanes (so it vectorizes).
fn dot_i8(w: &[i8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
    let (wr, xr) = (wc.remainder(), xc.remainder());
    for (w, x) in wc.zip(xc) {
        for k in 0..8 {
            acc[k] += w[k] as f32 * x[k];
        }
    }
    let tail: f32 = wr.iter().zip(xr).map(|(&w, &x)| w as f32 * x).sum();
    acc.iter().sum::<f32>() + tail
}

impl QuantPredictor {
    pub fn new(p: &Predictor) -> Self {
        let (d, r, n) = (p.input_dim as usize, p.rank as usize, p.outputs as usize);
        let (w1, w1_scale) = quantize_rows(p.w1.iter().copied(), d);
        let transposed = (0..r).flat_map(|j| (0..n).map(move |o| p.w2[o * r + j]));
        let (w2t, w2t_scale) = quantize_rows(transposed, n);
        let halves = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect();
        Self {
            input_dim: d,
            rank: r,
            outputs: n,
            threshold: p.threshold,
            w1,
            w1_scale,
            b1: halves(&p.b1),
            w2t,
            w2t_scale,
            b2: halves(&p.b2),
        }
    }

    /// Bytes it holds.
    pub fn bytes(&self) -> u64 {
        predictor_bytes(self.input_dim, self.rank, self.outputs)
    }

    /// Sigmoid scores for one input, RMS-normalised as in training, into `z`, with `xn` as
    /// scratch for the normalised input: no allocation once both have held as many values (the
    /// token loop keeps them).
    pub fn scores_into(&self, x: &[f32], xn: &mut Vec<f32>, z: &mut Vec<f32>) {
        normalise_input_into(x, xn);
        let (d, n) = (self.input_dim, self.outputs);
        z.clear();
        z.extend(self.b2.iter().map(|b| b.to_f32()));
        for j in 0..self.rank {
            let h = (dot_i8(&self.w1[j * d..(j + 1) * d], xn) * self.w1_scale[j]
                + self.b1[j].to_f32())
            .max(0.0);
            if h > 0.0 {
                let g = h * self.w2t_scale[j];
                for (z, &w) in z.iter_mut().zip(&self.w2t[j * n..(j + 1) * n]) {
                    *z += g * w as f32;
                }
            }
        }
        z.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp()));
    }
}

/// Queues the read of a predictor kept on flash: its record (`extent`: file offset and size) as
/// whole pages at `priority`. Redeem it with [`active_from_read`].
pub(super) fn read_predictor(io: &IoQueue, extent: (u64, u64), priority: u32) -> Ticket {
    let page = AlignedBuf::ALIGN as u64;
    let (offset, len) = extent;
    let start = offset / page * page;
    let end = (offset + len).div_ceil(page) * page;
    io.submit(start, (end - start) as usize, priority)
}

/// The active set of a predictor read with [`read_predictor`], scored with the f32 reference.
/// For the metrics of a predictor that decides nothing in the run, so is not resident.
pub(super) fn active_from_read(
    io: &IoQueue,
    read: Ticket,
    extent: (u64, u64),
    x: &[f32],
) -> Result<Vec<bool>> {
    let page = AlignedBuf::ALIGN as u64;
    let (offset, len) = extent;
    let buf = io
        .wait(read)
        .with_context(|| format!("cannot read a predictor from {}", io.device().name()))?;
    let at = (offset - offset / page * page) as usize;
    let p = Predictor::from_record(&buf[at..at + len as usize])
        .with_context(|| format!("{}: a damaged predictor", io.device().name()))?;
    Ok(above(&p.scores(&normalise_input(x)), p.threshold))
}

/// Which scores reach the threshold (a predictor's "active" set).
pub(super) fn above(scores: &[f32], threshold: f32) -> Vec<bool> {
    let mut set = Vec::new();
    above_into(scores, threshold, &mut set);
    set
}

/// [`above`] into `set` (resized).
pub(super) fn above_into(scores: &[f32], threshold: f32, set: &mut Vec<bool>) {
    set.clear();
    set.extend(scores.iter().map(|&s| s >= threshold));
}

#[cfg(test)]
mod tests {
    use super::*;
    use leanstream_format::predictor::PredictorInput;

    /// A predictor of SmolLM2's shape at a small rank, with weights of trained magnitudes.
    fn predictor(d: usize, r: usize, n: usize) -> Predictor {
        let wave = |len: usize, k: f32, a: f32| {
            (0..len)
                .map(|i| a * ((i as f32) * k).sin() * (1.0 + ((i as f32) * 0.013).cos()))
                .collect::<Vec<_>>()
        };
        Predictor {
            source_layer: 0,
            input: PredictorInput::Residual,
            input_dim: d as u32,
            rank: r as u32,
            outputs: n as u32,
            threshold: 0.5,
            w1: wave(r * d, 0.37, 0.15),
            b1: wave(r, 1.3, 0.5),
            w2: wave(n * r, 0.71, 0.8),
            b2: wave(n, 2.1, 1.5),
        }
    }

    #[test]
    fn default_rank_keeps_two_predictors_within_their_share() {
        // SmolLM2 in q4_0: 576 → 1536 neurons of 3 × 324 bytes.
        let (d, n, bundle) = (576, 1536, 972);
        let r = default_predictor_rank(d, n, bundle, 1);
        let ffn = (n * bundle) as f64;
        assert!(2.0 * predictor_bytes(d, r, n) as f64 <= PREDICTOR_SHARE * ffn);
        assert!(2.0 * predictor_bytes(d, r + 1, n) as f64 > PREDICTOR_SHARE * ffn);
        assert_eq!(r, 9);
        assert_eq!(default_predictor_rank(64, 128, 3, 4), 4, "the floor");
    }

    #[test]
    fn int8_scores_match_the_f32_reference() {
        let (d, r, n) = (576, 9, 1536);
        let p = predictor(d, r, n);
        let q = QuantPredictor::new(&p);
        let held = q.w1.len() + q.w2t.len() + 4 * (q.w1_scale.len() + q.w2t_scale.len());
        assert_eq!(q.bytes() as usize, held + 2 * (q.b1.len() + q.b2.len()));
        let (mut worst, mut sum) = (0.0f32, 0.0f32);
        let (mut flips, mut total) = (0, 0);
        for t in 0..16 {
            // An input with one outlier channel, as residual streams have.
            let mut x: Vec<f32> = (0..d)
                .map(|i| ((i * (t + 3)) as f32 * 0.61).sin())
                .collect();
            x[t * 7] = 40.0;
            let (mut xn, mut fast) = (Vec::new(), Vec::new());
            q.scores_into(&x, &mut xn, &mut fast);
            let reference = p.scores(&normalise_input(&x));
            assert_eq!(fast.len(), n);
            for (a, b) in fast.iter().zip(&reference) {
                worst = worst.max((a - b).abs());
                sum += (a - b).abs();
                // Decisions differ only for scores near the threshold.
                if (*a >= 0.5) != (*b >= 0.5) {
                    flips += 1;
                    assert!((b - 0.5).abs() < 0.05, "{a} vs {b}");
                }
                total += 1;
            }
            let active = above(&fast, 0.5).iter().filter(|&&a| a).count();
            assert!(
                active > n / 10 && active < n * 9 / 10,
                "{active} of {n} active"
            );
        }
        // A weight moves by at most half a step, a 254th of its row's largest (here up to 1.6 in
        // W2, 0.3 in W1 against an input with a 40× outlier): up to about 0.2 in the logit, 0.05
        // in the score, and far less on average.
        assert!(worst < 0.05, "largest score difference {worst}");
        assert!(
            sum / (total as f32) < 0.005,
            "mean score difference {}",
            sum / total as f32
        );
        assert!(flips * 100 < total, "{flips} of {total} decisions differ");
        eprintln!(
            "int8 vs f32: largest score difference {worst}, {flips}/{total} decisions differ"
        );
    }
}
