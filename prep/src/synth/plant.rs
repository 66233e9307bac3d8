//! Choosing the knobs that plant a statistic. A synthetic neuron's gate pre-activation is, over
//! tokens, a standard normal latent `z` (plus a bias that sets its frequency), built from parts
//! whose shares are the knobs: shared with its group (co-activation), readable by a rank-limited
//! predictor (accuracy), carried by the slowly varying part of the input (token overlap). Each knob
//! is found by bisection on this latent model; the built file is then measured, not trusted.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Standard normal CDF (Abramowitz–Stegun 7.1.26 through erfc, |error| < 1.5e-7).
pub fn normal_cdf(x: f64) -> f64 {
    let z = x.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * z);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let erfc = poly * (-z * z).exp();
    if x >= 0.0 {
        1.0 - 0.5 * erfc
    } else {
        0.5 * erfc
    }
}

/// The `x` with `normal_cdf(x) = p`, by bisection (p clamped away from 0 and 1).
pub fn normal_quantile(p: f64) -> f64 {
    let p = p.clamp(1e-6, 1.0 - 1e-6);
    let (mut lo, mut hi) = (-6.0f64, 6.0f64);
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if normal_cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// Latent thresholds: neuron `i` is active when its standard normal latent exceeds `tau[i]`.
pub fn taus(freq: &[f32]) -> Vec<f64> {
    freq.iter()
        .map(|&f| normal_quantile(1.0 - f as f64))
        .collect()
}

/// `∫ φ(s) g(s) ds` on a fixed grid over [-6, 6].
fn expect_normal(mut g: impl FnMut(f64) -> f64) -> f64 {
    const STEPS: usize = 96;
    let h = 12.0 / STEPS as f64;
    (0..=STEPS)
        .map(|i| {
            let s = -6.0 + i as f64 * h;
            let w = if i == 0 || i == STEPS { 0.5 } else { 1.0 };
            w * h * (-0.5 * s * s).exp() / (2.0 * std::f64::consts::PI).sqrt() * g(s)
        })
        .sum()
}

/// Expected group fill (active fraction of the touched groups of `group` consecutive neurons)
/// when the latents within a group share a common part of variance `c`.
pub fn group_fill(tau: &[f64], group: usize, c: f64) -> f64 {
    let (a, b) = (c.sqrt(), (1.0 - c).max(1e-9).sqrt());
    let (mut active, mut touched) = (0.0, 0.0);
    for g in tau.chunks(group) {
        active += g.iter().map(|&t| 1.0 - normal_cdf(t)).sum::<f64>() / g.len() as f64;
        touched +=
            1.0 - expect_normal(|s| g.iter().map(|&t| normal_cdf((t - a * s) / b)).product());
    }
    if touched > 0.0 {
        active / touched
    } else {
        0.0
    }
}

/// Expected token overlap (of a token's active neurons, the fraction active for the previous
/// token) when every latent has lag-1 correlation `rho`.
pub fn overlap(tau: &[f64], rho: f64) -> f64 {
    let rho = rho.clamp(0.0, 0.999_999);
    let (a, b) = (rho.sqrt(), (1.0 - rho).sqrt());
    let (mut both, mut active) = (0.0, 0.0);
    for &t in tau {
        both += expect_normal(|s| (1.0 - normal_cdf((t - a * s) / b)).powi(2));
        active += 1.0 - normal_cdf(t);
    }
    if active > 0.0 {
        both / active
    } else {
        0.0
    }
}

/// Monte-Carlo recall of a predictor that knows the share `pi` of every latent's variance and
/// picks, per token, the `k_frac · n` neurons most likely active.
pub fn recall(tau: &[f64], pi: f64, k_frac: f64, seed: u64) -> f64 {
    const TOKENS: usize = 128;
    let mut rng = StdRng::seed_from_u64(seed);
    let n = tau.len();
    let k = ((k_frac * n as f64).ceil() as usize).clamp(1, n);
    let (a, b) = (pi.sqrt(), (1.0 - pi).max(1e-9).sqrt());
    let (mut hits, mut active) = (0usize, 0usize);
    let mut score = vec![(0.0f64, false); n];
    for _ in 0..TOKENS {
        for (s, &t) in score.iter_mut().zip(tau) {
            let (y, e) = (gaussian(&mut rng), gaussian(&mut rng));
            *s = ((a * y - t) / b, a * y + b * e > t);
        }
        active += score.iter().filter(|s| s.1).count();
        score.select_nth_unstable_by(k - 1, |x, y| y.0.total_cmp(&x.0));
        hits += score[..k].iter().filter(|s| s.1).count();
    }
    if active == 0 {
        1.0
    } else {
        hits as f64 / active as f64
    }
}

/// A standard normal sample (Box–Muller).
pub fn gaussian(rng: &mut impl Rng) -> f64 {
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    let v: f64 = rng.random();
    (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

/// The `x ∈ [lo, hi]` where the increasing function `f` reaches `target` (an end if it never does).
pub fn solve_increasing(
    f: impl Fn(f64) -> f64,
    target: f64,
    lo: f64,
    hi: f64,
    iters: usize,
) -> f64 {
    let (mut lo, mut hi) = (lo, hi);
    if f(lo) >= target {
        return lo;
    }
    if f(hi) <= target {
        return hi;
    }
    for _ in 0..iters {
        let mid = 0.5 * (lo + hi);
        if f(mid) < target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latent_model_limits() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.96) - 0.975).abs() < 1e-4);
        assert!((normal_quantile(0.975) - 1.96).abs() < 1e-3);
        let tau = taus(&[0.2; 64]);
        // Independent tokens overlap by the frequency; identical tokens overlap fully.
        assert!((overlap(&tau, 0.0) - 0.2).abs() < 1e-3);
        assert!(overlap(&tau, 0.999_999) > 0.98);
        // Groups of 8 independent neurons at f = 0.2: fill = 0.2 / (1 - 0.8^8).
        let indep = 0.2 / (1.0 - 0.8f64.powi(8));
        assert!((group_fill(&tau, 8, 0.0) - indep).abs() < 1e-3);
        // Shared latents fill touched groups more (0.347 at c = 0.5, 0.583 at 0.9 by the same
        // quadrature in f64 elsewhere).
        assert!((group_fill(&tau, 8, 0.5) - 0.347).abs() < 2e-3);
        assert!((group_fill(&tau, 8, 0.9) - 0.583).abs() < 2e-3);
        // A predictor that knows nothing recalls k/n of the actives; one that knows all, all
        // (at k = 1.5 × the active count).
        assert!((recall(&tau, 0.0, 0.3, 1) - 0.3).abs() < 0.05);
        assert!(recall(&tau, 0.999, 0.3, 1) > 0.95);
        let c = solve_increasing(|c| group_fill(&tau, 8, c), 0.5, 0.0, 0.999, 30);
        assert!((group_fill(&tau, 8, c) - 0.5).abs() < 1e-3);
    }
}
