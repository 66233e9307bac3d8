//! Rotary position embedding in Hugging Face's "rotate half" layout: dimension `i` of a head is
//! rotated together with dimension `i + head_dim/2`.

use crate::source::config::{Llama3RopeScaling, ModelConfig};

/// Inverse frequencies of one head, with Llama-3 scaling applied when configured.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(config: &ModelConfig) -> Self {
        let half = config.head_dim / 2;
        let theta = config.rope_theta as f64;
        let mut inv_freq: Vec<f64> = (0..half)
            .map(|i| 1.0 / theta.powf(2.0 * i as f64 / config.head_dim as f64))
            .collect();
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
        }
    }

    /// The cos and sin tables for one position into `cos` and `sin`, `head_dim/2` entries each.
    pub fn tables_into(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        for ((f, c), s) in self.inv_freq.iter().zip(cos).zip(sin) {
            let angle = pos as f32 * f;
            *c = angle.cos();
            *s = angle.sin();
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
        };
        let orig: Vec<f32> = (0..head_dim).map(|i| i as f32 - 3.5).collect();
        let tables = |pos| {
            let (mut c, mut s) = (vec![0.0; head_dim / 2], vec![0.0; head_dim / 2]);
            rope.tables_into(pos, &mut c, &mut s);
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
