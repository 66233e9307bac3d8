//! RMSNorm, the normalisation before attention, before the FFN, of q/k heads (Qwen3) and before
//! the output head.

use crate::kernels::dot;

/// `out = x / sqrt(mean(x²) + eps) * weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    for ((o, a), w) in out.iter_mut().zip(x).zip(weight) {
        *o = a * inv * w;
    }
}

pub(super) fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let inv = inv_rms(x, eps);
    x.iter_mut()
        .zip(weight)
        .for_each(|(a, w)| *a = *a * inv * w);
}

fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mean_sq = dot(x, x) / x.len() as f32;
    1.0 / (mean_sq + eps).sqrt()
}
