//! Training and evaluating the sparsity predictors: a low-rank MLP `x̂ → rank R → neurons` (ReLU
//! between, sigmoid out) per layer and input, fitted with Adam on a positive-weighted binary
//! cross-entropy (a missed active neuron costs more than a wasted read) on the training rows, and
//! judged on the held-out rows.

use leanstream_format::predictor::normalise_input;
use ndarray::{Array1, Array2, ArrayView2, Axis};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rayon::slice::ParallelSliceMut;

use crate::sparsity::{from_order_key, order_key};

#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub rank: usize,
    pub epochs: usize,
    pub batch: usize,
    pub lr: f32,
    /// Weight of the positive (active) class in the loss.
    pub pos_weight: f32,
    pub seed: u64,
}

/// A trained predictor in the original neuron order.
pub struct Trained {
    pub w1: Array2<f32>,
    pub b1: Array1<f32>,
    pub w2: Array2<f32>,
    pub b2: Array1<f32>,
}

/// Held-out quality at a fixed budget of `k` predicted-active neurons per token.
#[derive(Debug, Clone, Copy, Default)]
pub struct Quality {
    pub recall: f32,
    pub precision: f32,
}

/// Divides each row by its RMS: predictors see inputs of one scale whatever the layer.
pub fn normalise_rows(x: &[f32], d: usize, rows: &[usize]) -> Array2<f32> {
    let data: Vec<f32> = rows
        .iter()
        .flat_map(|&r| normalise_input(&x[r * d..(r + 1) * d]))
        .collect();
    Array2::from_shape_vec((rows.len(), d), data).expect("rows × d values")
}

/// 0/1 targets of `rows`.
pub fn targets(masks: &[bool], n: usize, rows: &[usize]) -> Array2<f32> {
    Array2::from_shape_fn((rows.len(), n), |(i, j)| {
        masks[rows[i] * n + j] as u8 as f32
    })
}

/// Each active entry's `c²` (what missing it adds to the squared error of the layer's output,
/// down columns being unit norm under `gate_up`), 0 where inactive.
pub fn energies(coef: &[f32], masks: &[bool], n: usize, rows: &[usize]) -> Array2<f32> {
    Array2::from_shape_fn((rows.len(), n), |(i, j)| {
        let k = rows[i] * n + j;
        if masks[k] {
            coef[k] * coef[k]
        } else {
            0.0
        }
    })
}

/// The neurons whose contribution on some training token carries more energy (`c²`, from
/// [`energies`]) than a mean token's whole FFN output: massive activations (typically on a
/// window's first tokens), rare enough that a predictor misses them, large enough that one miss
/// derails the stream.
pub fn massive(energy: &Array2<f32>) -> Vec<usize> {
    let mean_row = energy.sum() as f64 / energy.nrows().max(1) as f64;
    (0..energy.ncols())
        .filter(|&j| energy.column(j).iter().any(|&e| e as f64 > mean_row))
        .collect()
}

impl Trained {
    /// Sigmoid scores for a batch of normalised inputs.
    pub fn scores(&self, x: ArrayView2<f32>) -> Array2<f32> {
        let h = (x.dot(&self.w1.t()) + &self.b1).mapv(|v| v.max(0.0));
        (h.dot(&self.w2.t()) + &self.b2).mapv(sigmoid)
    }
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// [`sigmoid`] through [`fast_exp`]: within a few ulp of it, and vectorizable (training's inner
/// loop evaluates one per neuron, row and step; the scores that set thresholds use [`sigmoid`]).
#[inline(always)]
fn fast_sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + fast_exp(-z))
}

/// Turns a row of logits less their bias `z` into the loss gradient at the logits, given the
/// targets `t` (0/1), the bias `b`, the positive weight `w` and the batch's `1 / rows`.
fn loss_grad(z: &mut [f32], t: &[f32], b: &[f32], w: f32, scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { loss_grad_avx2(z, t, b, w, scale) };
        return;
    }
    loss_grad_plain(z, t, b, w, scale);
}

/// [`loss_grad`] compiled for 8 lanes: the same operations in the same order (no fused
/// multiply-adds), so the same results as the plain build.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn loss_grad_avx2(z: &mut [f32], t: &[f32], b: &[f32], w: f32, scale: f32) {
    loss_grad_plain(z, t, b, w, scale);
}

#[inline(always)]
fn loss_grad_plain(z: &mut [f32], t: &[f32], b: &[f32], w: f32, scale: f32) {
    for ((z, &t), &b) in z.iter_mut().zip(t).zip(b) {
        let p = fast_sigmoid(*z + b);
        *z = (p * (w * t + 1.0 - t) - w * t) * scale;
    }
}

/// `e^x` by range reduction to `x = k·ln 2 + r`, `|r| ≤ ln 2 / 2`, and a degree-6 polynomial
/// (Cephes' `expf` coefficients), in plain arithmetic the compiler vectorizes: relative error
/// about 2e-7. Clamped to `e^-87` … `e^88` (normal floats).
#[inline(always)]
fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 · 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * LOG2E + ROUND;
    let k = shifted - ROUND;
    let r = x - k * LN2_HI - k * LN2_LO;
    let r2 = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e = p * r2 + r + 1.0;
    // `k` sits in the low mantissa bits of `shifted` (whose exponent field is ROUND's): `2^k`
    // from integer arithmetic alone, no float-to-int conversion.
    let k_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    e * f32::from_bits(k_bits.wrapping_add(127) << 23)
}

/// Fits a predictor of `y` (`rows × n`, 0/1) from `x` (`rows × d`, normalised).
pub fn train(x: &Array2<f32>, y: &Array2<f32>, cfg: &TrainConfig) -> Trained {
    let (rows, d) = x.dim();
    let n = y.ncols();
    let r = cfg.rank;
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let mut init = |rows: usize, cols: usize, scale: f32| {
        Array2::from_shape_fn((rows, cols), |_| rng.random_range(-scale..scale))
    };
    let mut w1 = init(r, d, (3.0 / d as f32).sqrt());
    let mut w2 = init(n, r, (3.0 / r as f32).sqrt() * 0.1);
    let mut b1 = Array1::<f32>::zeros(r);
    // Start from each neuron's base rate so training spends its steps on the input dependence.
    let freq = y.mean_axis(Axis(0)).expect("rows > 0");
    let mut b2 = freq.mapv(|f| {
        let f = f.clamp(1e-3, 1.0 - 1e-3);
        (f / (1.0 - f)).ln()
    });
    let mut adam = [
        Adam::new(r * d),
        Adam::new(r),
        Adam::new(n * r),
        Adam::new(n),
    ];
    let mut order: Vec<usize> = (0..rows).collect();
    let w = cfg.pos_weight;
    for _ in 0..cfg.epochs {
        order.shuffle(&mut rng);
        for batch in order.chunks(cfg.batch) {
            let xb = x.select(Axis(0), batch);
            let h = (xb.dot(&w1.t()) + &b1).mapv(|v| v.max(0.0));
            let mut dz = h.dot(&w2.t());
            let scale = 1.0 / batch.len() as f32;
            let b2s = b2.as_slice().expect("contiguous");
            // The loss gradient at the logits, one contiguous row at a time (the targets read in
            // place, not gathered): a loop the compiler vectorizes, exp included.
            for (mut zrow, &r) in dz.outer_iter_mut().zip(batch) {
                let zrow = zrow.as_slice_mut().expect("standard layout");
                let trow = y.row(r);
                loss_grad(
                    zrow,
                    trow.as_slice().expect("standard layout"),
                    b2s,
                    w,
                    scale,
                );
            }
            let gw2 = dz.t().dot(&h);
            let gb2 = dz.sum_axis(Axis(0));
            let mut dh = dz.dot(&w2);
            ndarray::Zip::from(&mut dh).and(&h).for_each(|g, &a| {
                if a <= 0.0 {
                    *g = 0.0;
                }
            });
            let gw1 = dh.t().dot(&xb);
            let gb1 = dh.sum_axis(Axis(0));
            let [a1, ab1, a2, ab2] = &mut adam;
            a1.step(
                w1.as_slice_mut().expect("contiguous"),
                gw1.as_standard_layout().as_slice().expect("c"),
                cfg.lr,
            );
            ab1.step(
                b1.as_slice_mut().expect("contiguous"),
                gb1.as_slice().expect("c"),
                cfg.lr,
            );
            a2.step(
                w2.as_slice_mut().expect("contiguous"),
                gw2.as_standard_layout().as_slice().expect("c"),
                cfg.lr,
            );
            ab2.step(
                b2.as_slice_mut().expect("contiguous"),
                gb2.as_slice().expect("c"),
                cfg.lr,
            );
        }
    }
    Trained { w1, b1, w2, b2 }
}

/// Adam with the usual defaults (β₁ 0.9, β₂ 0.999, ε 1e-8).
struct Adam {
    m: Vec<f32>,
    v: Vec<f32>,
    t: i32,
}

impl Adam {
    fn new(n: usize) -> Self {
        Self {
            m: vec![0.0; n],
            v: vec![0.0; n],
            t: 0,
        }
    }

    fn step(&mut self, p: &mut [f32], g: &[f32], lr: f32) {
        const B1: f32 = 0.9;
        const B2: f32 = 0.999;
        self.t += 1;
        let (c1, c2) = (1.0 - B1.powi(self.t), 1.0 - B2.powi(self.t));
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(&mut self.m).zip(&mut self.v) {
            *m = B1 * *m + (1.0 - B1) * g;
            *v = B2 * *v + (1.0 - B2) * g * g;
            *p -= lr * (*m / c1) / ((*v / c2).sqrt() + 1e-8);
        }
    }
}

/// Recall and precision of choosing the `k` highest-scoring neurons of each row.
pub fn top_k_quality(scores: ArrayView2<f32>, y: &Array2<f32>, k: usize) -> Quality {
    let (mut hit, mut active) = (0usize, 0usize);
    let n = scores.ncols();
    let k = k.clamp(1, n);
    let mut idx: Vec<usize> = (0..n).collect();
    for (s, t) in scores.outer_iter().zip(y.outer_iter()) {
        idx.select_nth_unstable_by(k - 1, |&a, &b| s[b].total_cmp(&s[a]));
        hit += idx[..k].iter().filter(|&&j| t[j] > 0.5).count();
        active += t.iter().filter(|&&v| v > 0.5).count();
    }
    let rows = scores.nrows().max(1);
    Quality {
        recall: if active == 0 {
            1.0
        } else {
            hit as f32 / active as f32
        },
        precision: hit as f32 / (k * rows) as f32,
    }
}

/// The largest threshold at which the active entries a predictor scores below it (its misses)
/// carry at most `budget` of `energy` (`rows × n`: what missing each entry costs, 0 where
/// inactive). Sampled like [`crate::sparsity::quantile`].
pub fn miss_threshold(scores: &Array2<f32>, energy: &Array2<f32>, budget: f64) -> f32 {
    const SAMPLE: usize = 1 << 22;
    let stride = scores.len().div_ceil(SAMPLE).max(1);
    // Sorted by score, ties by energy (positive: its bits sort as it does), as one integer each:
    // one order whatever the thread count.
    let mut active: Vec<u64> = scores
        .iter()
        .zip(energy.iter())
        .step_by(stride)
        .filter(|(_, &e)| e > 0.0)
        .map(|(&s, &e)| (u64::from(order_key(s)) << 32) | u64::from(e.to_bits()))
        .collect();
    active.par_sort_unstable();
    let budget = budget / stride as f64;
    let mut missed = 0.0f64;
    for &k in &active {
        let (s, e) = (from_order_key((k >> 32) as u32), f32::from_bits(k as u32));
        missed += e as f64;
        if missed > budget {
            return s;
        }
    }
    // Everything may be missed: predict nothing.
    f32::INFINITY
}

/// Recall, precision and the predicted fraction of a predictor at `threshold`, with the share of
/// `energy` its misses carry.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct AtThreshold {
    pub recall: f32,
    pub precision: f32,
    pub predicted: f32,
    pub missed_energy: f32,
}

pub fn at_threshold(
    scores: &Array2<f32>,
    y: &Array2<f32>,
    energy: &Array2<f32>,
    threshold: f32,
) -> AtThreshold {
    let (mut hit, mut active, mut predicted) = (0usize, 0usize, 0usize);
    let (mut missed, mut total) = (0.0f64, 0.0f64);
    ndarray::Zip::from(scores)
        .and(y)
        .and(energy)
        .for_each(|&s, &t, &e| {
            let (p, a) = (s >= threshold, t > 0.5);
            predicted += p as usize;
            active += a as usize;
            hit += (p && a) as usize;
            total += e as f64;
            if a && !p {
                missed += e as f64;
            }
        });
    AtThreshold {
        recall: hit as f32 / active.max(1) as f32,
        precision: hit as f32 / predicted.max(1) as f32,
        predicted: predicted as f32 / scores.len().max(1) as f32,
        missed_energy: (missed / total.max(f64::MIN_POSITIVE)) as f32,
    }
}

/// The score above which the top `fraction` of all (row, neuron) scores lie.
pub fn score_threshold(scores: &Array2<f32>, fraction: f32) -> f32 {
    let mut all: Vec<f32> = scores.iter().copied().collect();
    let k = ((all.len() as f64 * (1.0 - fraction as f64)) as usize).min(all.len() - 1);
    *all.select_nth_unstable_by(k, f32::total_cmp).1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_a_linearly_readable_pattern_better_than_frequency() {
        // Neuron j is active when input feature j % 4 is positive.
        let (rows, d, n) = (2000, 8, 16);
        let mut rng = StdRng::seed_from_u64(1);
        let x = Array2::from_shape_fn((rows, d), |_| rng.random_range(-1.0f32..1.0));
        let y = Array2::from_shape_fn((rows, n), |(i, j)| (x[[i, j % 4]] > 0.0) as u8 as f32);
        let cfg = TrainConfig {
            rank: 8,
            epochs: 30,
            batch: 64,
            lr: 1e-2,
            pos_weight: 1.0,
            seed: 2,
        };
        let t = train(&x, &y, &cfg);
        let q = top_k_quality(t.scores(x.view()).view(), &y, 8);
        // 0, 4, 8, 12 or 16 neurons fire (binomially); a perfect ranker's recall at k = 8 is
        // E[min(A, 8)] / E[A] = 6.5 / 8 = 0.8125.
        assert!(q.recall > 0.78, "recall {}", q.recall);
        // Every neuron fires half the time: a static set of 8 recalls about half.
        let static_scores = Array2::from_shape_fn((rows, n), |(_, j)| -(j as f32));
        assert!(top_k_quality(static_scores.view(), &y, 8).recall < 0.6);
    }

    #[test]
    fn miss_threshold_keeps_the_missed_energy_within_its_budget() {
        // One row: scores rise with the neuron; neurons 1, 3 and 4 are active with energies 4, 1, 9.
        let scores = Array2::from_shape_vec((1, 5), vec![0.1, 0.2, 0.3, 0.4, 0.5]).unwrap();
        let energy = Array2::from_shape_vec((1, 5), vec![0.0, 4.0, 0.0, 1.0, 9.0]).unwrap();
        let y = energy.mapv(|e| (e > 0.0) as u8 as f32);
        // Nothing may be missed: the lowest-scored active neuron is kept.
        assert_eq!(miss_threshold(&scores, &energy, 0.0), 0.2);
        // 4 may be missed: neuron 1 goes, neuron 3 (1 more) would exceed it.
        assert_eq!(miss_threshold(&scores, &energy, 4.0), 0.4);
        assert_eq!(miss_threshold(&scores, &energy, 5.0), 0.5);
        assert_eq!(miss_threshold(&scores, &energy, 14.0), f32::INFINITY);
        let a = at_threshold(&scores, &y, &energy, 0.4);
        assert_eq!((a.recall, a.precision, a.predicted), (2.0 / 3.0, 1.0, 0.4));
        assert!((a.missed_energy - 4.0 / 14.0).abs() < 1e-6);
    }

    #[test]
    fn fast_exp_matches_exp() {
        let mut worst = 0.0f64;
        for i in -87_000..88_000 {
            let x = i as f32 * 1e-3 + 0.000_37;
            let (a, b) = (fast_exp(x) as f64, (x as f64).exp());
            worst = worst.max(((a - b) / b).abs());
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(fast_sigmoid(0.0), 0.5);
        assert!(fast_sigmoid(-200.0) < 1e-37 && fast_sigmoid(200.0) == 1.0);
    }

    #[test]
    fn the_loss_gradient_is_the_same_on_every_build() {
        let mut rng = StdRng::seed_from_u64(3);
        let n = 1003;
        let z: Vec<f32> = (0..n).map(|_| rng.random_range(-40.0..40.0)).collect();
        let t: Vec<f32> = (0..n).map(|_| rng.random_range(0..2) as f32).collect();
        let b: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
        let (mut fast, mut plain) = (z.clone(), z.clone());
        loss_grad(&mut fast, &t, &b, 3.0, 1.0 / 128.0);
        loss_grad_plain(&mut plain, &t, &b, 3.0, 1.0 / 128.0);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fast), bits(&plain));
        // And the gradient itself: p·(w·t + 1 − t) − w·t, over the batch.
        for i in 0..n {
            let p = sigmoid(z[i] + b[i]);
            let want = (p * (3.0 * t[i] + 1.0 - t[i]) - 3.0 * t[i]) / 128.0;
            assert!(
                (plain[i] - want).abs() <= 1e-6 * want.abs().max(1e-3),
                "{i}"
            );
        }
    }

    #[test]
    fn massive_neurons_are_those_that_once_outweigh_a_mean_token() {
        // Mean row energy (2 + 2 + 20) / 3 = 8: only neuron 2's 18 exceeds it.
        let energy =
            Array2::from_shape_vec((3, 3), vec![1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 18.0])
                .unwrap();
        assert_eq!(massive(&energy), vec![2]);
        assert!(massive(&Array2::zeros((2, 3))).is_empty());
    }
}
