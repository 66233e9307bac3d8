//! Rotary position embedding in Hugging Face's "rotate half" layout: dimension `i` of a head is
//! rotated together with dimension `i + head_dim/2`.

use crate::source::config::{Llama3RopeScaling, ModelConfig};

/// Inverse frequencies of one head, with Llama-3 scaling applied when configured.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// LongRoPE's frequencies for contexts longer than the original one: (those, original).
    long: Option<(Vec<f32>, usize)>,
    /// LongRoPE's attention factor, multiplying cos and sin (1 otherwise).
    mscale: f32,
}

/// `1 / theta^(2i/d)` for the `d/2` frequencies of a head of `d` dimensions.
fn base_frequencies(theta: f32, head_dim: usize) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| 1.0 / (theta as f64).powf(2.0 * i as f64 / head_dim as f64))
        .collect()
}

/// `inv_freq[i] / factors[i]` in f32 (a missing factor is 1).
fn divided(inv_freq: &[f64], factors: &[f32]) -> Vec<f32> {
    let factor = |i: usize| factors.get(i).map_or(1.0, |&d| d as f64);
    inv_freq
        .iter()
        .enumerate()
        .map(|(i, &f)| (f / factor(i)) as f32)
        .collect()
}

impl Rope {
    /// The rope of the sliding-window layers when their base differs (Gemma 3's local rope, which
    /// no scaling applies to); `None` when every layer uses [`Rope::new`]'s.
    pub fn local(config: &ModelConfig) -> Option<Self> {
        let theta = config.block.rope_local_theta?;
        Some(Self {
            inv_freq: divided(&base_frequencies(theta, config.head_dim), &[]),
            long: None,
            mscale: 1.0,
        })
    }

    pub fn new(config: &ModelConfig) -> Self {
        let mut inv_freq = base_frequencies(config.rope_theta, config.head_dim);
        if let Some(l) = &config.block.longrope {
            return Self {
                inv_freq: divided(&inv_freq, &l.short_factor),
                long: Some((
                    divided(&inv_freq, &l.long_factor),
                    l.original_max_position_embeddings,
                )),
                mscale: l.attention_factor,
            };
        }
        if let Some(s) = &config.rope_scaling {
            scale_llama3(&mut inv_freq, s);
        }
        // GGUF's per-frequency divisors (llama.cpp: theta = pos * base^(-2i/d) / factor[i]).
        if let Some(factors) = &config.rope_freq_factors {
            for (f, &d) in inv_freq.iter_mut().zip(factors) {
                *f /= d as f64;
            }
        }
        Self {
            inv_freq: inv_freq.into_iter().map(|f| f as f32).collect(),
            long: None,
            mscale: 1.0,
        }
    }

    /// The cos and sin tables for one position into `cos` and `sin`, `head_dim/2` entries each,
    /// in a context of `ctx` positions (LongRoPE's long factors apply past the original context,
    /// as llama.cpp chooses them).
    pub fn tables_into(&self, pos: usize, ctx: usize, cos: &mut [f32], sin: &mut [f32]) {
        let inv_freq = match &self.long {
            Some((long, original)) if ctx > *original => long,
            _ => &self.inv_freq,
        };
        for ((f, c), s) in inv_freq.iter().zip(cos).zip(sin) {
            // The factor is 1 unless LongRoPE sets it, and x · 1 is x.
            let angle = pos as f32 * f;
            *c = angle.cos() * self.mscale;
            *s = angle.sin() * self.mscale;
        }
    }

    /// Rotates every head in `heads` (concatenated, `head_dim` each) in place.
    pub fn apply(heads: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = head_dim / 2;
        for head in heads.chunks_exact_mut(head_dim) {
            let (lo, hi) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (lo[i], hi[i]);
                lo[i] = a * cos[i] - b * sin[i];
                hi[i] = b * cos[i] + a * sin[i];
            }
        }
    }
}

/// Llama-3 frequency scaling: long wavelengths are slowed by `factor`, short ones kept, and the band
/// between interpolated smoothly.
fn scale_llama3(inv_freq: &mut [f64], s: &Llama3RopeScaling) {
    let orig = s.original_max_position_embeddings as f64;
    let (low, high) = (s.low_freq_factor as f64, s.high_freq_factor as f64);
    let low_freq_wavelen = orig / low;
    let high_freq_wavelen = orig / high;
    for f in inv_freq.iter_mut() {
        let wavelen = 2.0 * std::f64::consts::PI / *f;
        if wavelen > low_freq_wavelen {
            *f /= s.factor as f64;
        } else if wavelen >= high_freq_wavelen {
            let smooth = (orig / wavelen - low) / (high - low);
            *f = (1.0 - smooth) * *f / s.factor as f64 + smooth * *f;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_preserves_norm_and_position_zero_is_identity() {
        let head_dim = 8;
        let rope = Rope {
            inv_freq: vec![1.0, 0.1, 0.01, 0.001],
            long: None,
            mscale: 1.0,
        };
        let orig: Vec<f32> = (0..head_dim).map(|i| i as f32 - 3.5).collect();
        let tables = |pos| {
            let (mut c, mut s) = (vec![0.0; head_dim / 2], vec![0.0; head_dim / 2]);
            rope.tables_into(pos, 16, &mut c, &mut s);
            (c, s)
        };
        let (c0, s0) = tables(0);
        let mut x = orig.clone();
        Rope::apply(&mut x, head_dim, &c0, &s0);
        assert_eq!(x, orig);
        let (c, s) = tables(7);
        Rope::apply(&mut x, head_dim, &c, &s);
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((norm(&x) - norm(&orig)).abs() < 1e-4);
        // Pair (0, 4) rotated by angle 7 * 1.0.
        let (a, b) = (orig[0], orig[4]);
        assert!((x[0] - (a * 7f32.cos() - b * 7f32.sin())).abs() < 1e-5);
    }
}
