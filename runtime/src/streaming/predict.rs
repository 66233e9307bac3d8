//! Predictor scores on the device's hot path. The format crate's [`Predictor::scores`] is the
//! reference (prep trains and evaluates with it); here the same arithmetic runs on the runtime's
//! SIMD dot product, since every token scores one or two predictors per layer.

use leanstream_format::predictor::{normalise_input, Predictor};

use crate::kernels::dot;

/// A predictor's sigmoid scores for one input, RMS-normalised as in training.
pub(super) fn predictor_scores(p: &Predictor, x: &[f32]) -> Vec<f32> {
    let x = normalise_input(x);
    let (d, r) = (p.input_dim as usize, p.rank as usize);
    let hidden: Vec<f32> =
        p.w1.chunks_exact(d)
            .zip(&p.b1)
            .map(|(row, b)| (dot(row, &x) + b).max(0.0))
            .collect();
    p.w2.chunks_exact(r)
        .zip(&p.b2)
        .map(|(row, b)| 1.0 / (1.0 + (-(dot(row, &hidden) + b)).exp()))
        .collect()
}

/// Which scores reach the threshold (a predictor's "active" set).
pub(super) fn above(scores: &[f32], threshold: f32) -> Vec<bool> {
    scores.iter().map(|&s| s >= threshold).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use leanstream_format::predictor::PredictorInput;

    #[test]
    fn matches_the_format_reference() {
        let (d, r, o) = (48, 12, 37);
        let wave = |n: usize, k: f32| (0..n).map(|i| ((i as f32) * k).sin()).collect::<Vec<_>>();
        let p = Predictor {
            source_layer: 0,
            input: PredictorInput::Residual,
            input_dim: d as u32,
            rank: r as u32,
            outputs: o as u32,
            threshold: 0.5,
            w1: wave(r * d, 0.37),
            b1: wave(r, 1.3),
            w2: wave(o * r, 0.71),
            b2: wave(o, 2.1),
        };
        let x = wave(d, 0.9).iter().map(|v| 3.0 * v).collect::<Vec<_>>();
        let fast = predictor_scores(&p, &x);
        let reference = p.scores(&normalise_input(&x));
        assert_eq!(fast.len(), o);
        for (a, b) in fast.iter().zip(&reference) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        // Not all alike: the test would notice a scoring that ignores its input.
        assert!(above(&fast, 0.5).iter().any(|&a| a) && !above(&fast, 0.5).iter().all(|&a| a));
    }
}
