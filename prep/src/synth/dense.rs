//! The synthetic model's residual stream and dense weights. The residual has three parts: a bias
//! channel (dimension 0, constant 1 in every embedding, so a gate row's entry there is the
//! neuron's bias), a fast part (the token's own random embedding) and a slow part that layer 0's
//! attention writes: a moving average of the fast parts of the last few tokens. The average comes
//! from a query and key that read only the bias channel, so the attention score depends on the
//! distance alone (through RoPE) and the weights fall off as a Gaussian of width
//! [`KERNEL_TOKENS`]. Every later layer's attention output projection is zero, and FFN outputs are
//! tiny, so every layer's FFN sees the same input distribution.

use std::ops::Range;

use anyhow::{bail, Result};
use leanstream::source::config::ModelConfig;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Residual dimensions `0..BIAS_BLOCK` form the bias block: the bias channel and 31 zeros, so a
/// gate row's bias sits alone in its quantization block.
pub const BIAS_BLOCK: usize = 32;
/// Width (in tokens) of the Gaussian moving average that forms the slow part.
pub const KERNEL_TOKENS: f64 = 4.0;

/// Where the parts of the residual live.
#[derive(Debug, Clone)]
pub struct Layout {
    pub h: usize,
    pub head_dim: usize,
    /// Dimensions of the fast (token) part.
    pub fast: Range<usize>,
    /// Dimensions of the slow (moving-average) part.
    pub slow: Range<usize>,
    /// The RoPE pair the layer-0 query and key use.
    pub rope_pair: usize,
    /// Amplitude of that query and key after normalisation (score = amp² cos(θΔ) / √d).
    pub qk_amp: f32,
    /// Gain of layer 0's output projection (brings the average to unit scale).
    pub out_gain: f32,
}

impl Layout {
    pub fn new(c: &ModelConfig) -> Result<Self> {
        let h = c.hidden_size;
        if h < 4 * BIAS_BLOCK || !h.is_multiple_of(2 * BIAS_BLOCK) {
            bail!("hidden size {h} is too small for a synthetic model (at least 128, a multiple of 64)");
        }
        let fast = BIAS_BLOCK..h / 2;
        let live = (h / 2 - BIAS_BLOCK).min(c.num_kv_heads * c.head_dim);
        // The slowest rotation that stays below half a turn over the context: the score then
        // falls monotonically with distance.
        let ctx = c.max_position_embeddings.min(4096) as f64;
        let half = c.head_dim / 2;
        let theta = |j: usize| (c.rope_theta as f64).powf(-2.0 * j as f64 / c.head_dim as f64);
        let rope_pair = (0..half)
            .find(|&j| theta(j) * ctx <= 0.9 * std::f64::consts::PI)
            .unwrap_or(half - 1);
        // exp(β cos θΔ) ≈ e^β exp(-βθ²Δ²/2): a Gaussian of width KERNEL_TOKENS.
        let beta = 1.0 / (KERNEL_TOKENS * theta(rope_pair)).powi(2);
        let qk_amp = (beta * (c.head_dim as f64).sqrt()).sqrt() as f32;
        let weights: Vec<f64> = (0..64)
            .map(|d| (-(d as f64).powi(2) / (2.0 * KERNEL_TOKENS * KERNEL_TOKENS)).exp())
            .collect();
        let sum: f64 = weights.iter().sum();
        let out_gain = (1.0 / weights.iter().map(|w| (w / sum).powi(2)).sum::<f64>()).sqrt() as f32;
        Ok(Self {
            h,
            head_dim: c.head_dim,
            fast,
            slow: h / 2..h / 2 + live,
            rope_pair,
            qk_amp,
            out_gain,
        })
    }

    /// RMS of an embedding row: the bias 1 and unit-variance fast entries.
    fn embed_rms(&self) -> f32 {
        ((1.0 + self.fast.len() as f32) / self.h as f32).sqrt()
    }
}

/// A deterministic generator for one (tensor, row).
pub fn rng_for(seed: u64, a: u64, b: u64) -> StdRng {
    let mut z =
        seed ^ a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    StdRng::seed_from_u64(z ^ (z >> 31))
}

/// Fills `out` with independent uniform values of variance `scale²` (zeros for a scale of zero:
/// a planted share of 0 or 1 leaves one part of a vector empty).
pub fn uniform(rng: &mut impl Rng, out: &mut [f32], scale: f32) {
    assert!(
        scale.is_finite() && scale >= 0.0,
        "uniform: scale {scale} is not a finite non-negative number"
    );
    if scale == 0.0 {
        out.fill(0.0);
        return;
    }
    let a = 3f32.sqrt() * scale;
    out.iter_mut().for_each(|v| *v = rng.random_range(-a..a));
}

/// Row `r` of the dense tensor `name` (shape `[rows, cols]` or `[cols]`), layer `layer` if any.
pub fn dense_row(
    lay: &Layout,
    c: &ModelConfig,
    seed: u64,
    tensor: u64,
    name: &str,
    r: usize,
    out: &mut [f32],
) {
    out.fill(0.0);
    let d = lay.head_dim;
    let first = name.starts_with("model.layers.0.");
    let part = name.rsplit('.').nth(1).unwrap_or("");
    let rng = || rng_for(seed, tensor, r as u64);
    match part {
        "embed_tokens" => {
            out[0] = 1.0;
            uniform(&mut rng(), &mut out[lay.fast.clone()], 1.0);
        }
        "input_layernorm" | "post_attention_layernorm" | "norm" => out.fill(1.0),
        "q_norm" | "k_norm" => {
            out.fill(1.0);
            if first {
                out[lay.rope_pair] = lay.qk_amp / (d as f32).sqrt();
            }
        }
        "q_proj" | "k_proj" if first => {
            if r % d == lay.rope_pair {
                // With q/k norms the amplitude comes from their weights.
                out[0] = if c.qk_norm {
                    1.0
                } else {
                    lay.qk_amp * lay.embed_rms()
                };
            }
        }
        "v_proj" if first => {
            if r < lay.slow.len() {
                out[lay.fast.start + r] = 1.0;
            }
        }
        "o_proj" if first => {
            if lay.slow.contains(&r) {
                let s = r - lay.slow.start;
                let (g, m) = (s / d, s % d);
                out[g * c.gqa_group() * d + m] = lay.out_gain;
            }
        }
        "o_proj" => {}
        _ => uniform(&mut rng(), out, 1.0 / (out.len() as f32).sqrt()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_has_its_variance_and_zero_scale_gives_zeros() {
        let mut rng = rng_for(7, 1, 2);
        let mut v = vec![1.0f32; 20_000];
        uniform(&mut rng, &mut v, 0.5);
        let var = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64;
        assert!((var / 0.25 - 1.0).abs() < 0.05, "variance {var}");
        // A planted share of 0 or 1 (a layer whose overlap needs no slow part) scales a part by 0.
        uniform(&mut rng, &mut v, 0.0);
        assert!(v.iter().all(|x| *x == 0.0));
    }
}
