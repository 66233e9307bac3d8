//! Certified skipping: a neuron may be skipped without reading its bundle only when the resident
//! gate sketch *proves* it inactive. The sketch gives `ĝ` with `|g − ĝ| ≤ β = err_norm · ‖x‖₂`
//! (Cauchy–Schwarz), so the exact gate lies in `[ĝ − β, ĝ + β]`; the neuron is skipped iff every
//! value in that interval has `|act(g)| ≤ threshold` — the same rule the file's sparsity applies
//! to the exact gate, so certified output equals the `resident` policy's.
//!
//! The certificate is optional (format 1.3: a SKETCH layer may hold no rows), and it proves only
//! the `gate` rule: under `gate_up` a neuron is inactive when `|act(g)·u|` is small, and the only
//! bound on `u` without its row, `‖up‖·‖x‖`, is about √hidden too loose to exclude anything. A
//! layer without a certificate treats every uncached cluster as a candidate: it is read and the
//! exact values in its bundles decide, so output is still exactly `resident`'s.

use anyhow::Result;
use leanstream_format::sketch::{SketchEntry, SketchLayer};

use crate::kernels::{Operand, QMatrix, RowKernels};
use crate::source::config::Activation;
use crate::streaming::plan::ClusterRef;
use crate::streaming::skip_rule::{Skip, SkipRule};

/// One layer's resident certificate: the gate sketch rows (stored order), their error bounds and
/// their own norms, and the gate values the rule skips.
pub struct Certificate {
    sketch: QMatrix,
    err: Vec<f32>,
    norm: Vec<f32>,
    skip: SkipSet,
}

impl Certificate {
    /// The layer's certificate, or `None` when the file has none for it or the rule is not one a
    /// gate sketch can prove (`gate_up`). Takes the rows over from `layer`.
    pub fn new(layer: &mut SketchLayer, skip: Skip, neurons: usize) -> Result<Option<Self>> {
        if !Self::proves(layer.err_norm.len(), skip) {
            return Ok(None);
        }
        debug_assert_eq!(layer.err_norm.len(), neurons);
        let h = layer.hidden as usize;
        let sketch = QMatrix::new(neurons, h, layer.qtype, std::mem::take(&mut layer.rows))?;
        let mut row = vec![0.0f32; h];
        let norm = (0..neurons)
            .map(|p| {
                sketch.dequantize_row(p, &mut row);
                row.iter().map(|v| v * v).sum::<f32>().sqrt()
            })
            .collect();
        Ok(Some(Self {
            sketch,
            err: std::mem::take(&mut layer.err_norm),
            norm,
            skip: SkipSet::new(skip.act, skip.threshold),
        }))
    }

    /// Resident bytes: the rows, their error bounds and norms.
    pub fn bytes(&self) -> usize {
        self.sketch.bytes() + 8 * self.err.len()
    }

    /// What [`Certificate::new`] would keep resident for the file's layer `entry` under `skip`
    /// (before reading its rows), or `None` when it would give no certificate.
    pub fn resident_bytes(entry: &SketchEntry, skip: Skip) -> Option<u64> {
        Self::proves(entry.neurons as usize, skip).then(|| entry.bytes() + 4 * entry.neurons as u64)
    }

    /// A sketch layer of `neurons` rows gives a certificate: it has rows, and the rule is one a
    /// gate sketch can prove.
    fn proves(neurons: usize, skip: Skip) -> bool {
        neurons > 0 && skip.rule == SkipRule::Gate
    }

    /// Marks in `candidate` the neurons the sketch cannot prove inactive. The exact gate is `w·x̃` (x̃ the q8 input for
    /// block bundles, x for float ones); the sketch gives `ŝ·x̃` and `|w − ŝ| ≤ e`, so
    /// `|w·x̃ − ŝ·x̃| ≤ e‖x̃‖`, plus `(‖ŝ‖ + e)‖x − x̃‖` for float bundles, plus a float-rounding
    /// slack. The neurons of `cached` clusters are all candidates: their exact gates cost no read,
    /// so the sketch, which only decides what to read, is not computed for them.
    pub fn candidates(
        &self,
        clusters: &[ClusterRef],
        x: &Operand,
        float_bundles: bool,
        cached: impl Fn(usize) -> bool,
        candidate: &mut Vec<bool>,
    ) {
        let n = self.err.len();
        let q8 = x.q8();
        let h = x.x.len();
        let (mut xq2, mut d2, mut x2) = (0.0f64, 0.0f64, 0.0f64);
        for i in 0..h {
            let v = q8.value(i) as f64;
            xq2 += v * v;
            d2 += (v - x.x[i] as f64).powi(2);
            x2 += (x.x[i] as f64).powi(2);
        }
        let (xq, dx) = (xq2.sqrt() as f32, d2.sqrt() as f32);
        let slack = 4.0 * h as f32 * f32::EPSILON;
        let norm = xq.max(x2.sqrt() as f32);
        let k = RowKernels::best();
        candidate.clear();
        candidate.resize(n, true);
        for (ci, cl) in clusters.iter().enumerate() {
            if cached(ci) {
                continue;
            }
            let range = cl.first..cl.first + cl.count;
            for (p, c) in range.clone().zip(&mut candidate[range]) {
                let g = k.dot(self.sketch.qtype, self.sketch.row(p), x);
                let (e, s) = (self.err[p], self.norm[p]);
                let w = s + e;
                let mut beta = e * xq + slack * w * norm;
                if float_bundles {
                    beta += w * dx;
                }
                *c = !self.skip.contains(g - beta, g + beta);
            }
        }
    }
}

/// The gate values whose activation is skippable (`|act(g)| ≤ threshold`), as disjoint closed
/// intervals.
#[derive(Debug, Clone)]
pub struct SkipSet {
    intervals: Vec<(f32, f32)>,
}

impl SkipSet {
    pub fn new(act: Activation, threshold: f32) -> Self {
        let intervals = match act {
            // relu(g) ≤ t ⇔ g ≤ t (t ≥ 0); dReLU's gate is ReLU's.
            Activation::Relu | Activation::DRelu => vec![(f32::NEG_INFINITY, threshold.max(0.0))],
            // fatrelu(g) = 0 for g < τ and g ≤ t for g ≥ τ (≥ 0): g ≤ t, or g < τ.
            Activation::FatRelu { threshold: tau } => {
                let t = threshold.max(0.0);
                vec![(
                    f32::NEG_INFINITY,
                    if t >= tau { t } else { tau.next_down() },
                )]
            }
            Activation::Silu => dip_intervals(silu, threshold as f64),
            Activation::GeluTanh => dip_intervals(gelu_tanh, threshold as f64),
        };
        Self { intervals }
    }

    /// True when every gate value in `[lo, hi]` is skippable.
    pub fn contains(&self, lo: f32, hi: f32) -> bool {
        self.intervals.iter().any(|&(a, b)| a <= lo && hi <= b)
    }
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

fn gelu_tanh(g: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * g * (1.0 + (k * (g + 0.044_715 * g * g * g)).tanh())
}

/// SiLU and GELU dip below zero once, to a minimum at `g_min` < 0 (SiLU: g ≈ −1.278, value
/// ≈ −0.2785; GELU: g ≈ −0.752, value ≈ −0.170), rise through 0 at 0 and increase from there, and
/// tend to 0 far left. `|act(g)| ≤ t` holds on `[a, b]` around zero and, when `t` is below the
/// minimum's depth, also on `(−∞, a']` far left.
fn dip_intervals(act: fn(f64) -> f64, t: f64) -> Vec<(f32, f32)> {
    // The minimum, by golden-section search on [−4, 0] (both functions are unimodal there).
    let (mut lo, mut hi) = (-4.0f64, 0.0f64);
    for _ in 0..200 {
        let (m1, m2) = (lo + (hi - lo) * 0.382, lo + (hi - lo) * 0.618);
        if act(m1) < act(m2) {
            hi = m2;
        } else {
            lo = m1;
        }
    }
    let g_min = 0.5 * (lo + hi);
    if t <= 0.0 {
        // Only g = 0 gives exactly 0; a sketch interval is never a single point in practice.
        return vec![(0.0, 0.0)];
    }
    // Bisection for act(g) = target on a monotone bracket; rounds inward so the set stays sound.
    let solve = |mut lo: f64, mut hi: f64, target: f64, increasing: bool| {
        for _ in 0..200 {
            let mid = 0.5 * (lo + hi);
            if (act(mid) < target) == increasing {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        (lo, hi)
    };
    let (b, _) = solve(0.0, t.max(1.0) + 10.0, t, true);
    if t >= -act(g_min) {
        return vec![(f32::NEG_INFINITY, shrink_down(b))];
    }
    // Right branch of the dip: the activation increases from the minimum to 0 on [g_min, 0].
    let (_, a_hi) = solve(g_min, 0.0, -t, true);
    // Left branch: the activation decreases from 0 to the minimum on (−∞, g_min].
    let (a_left, _) = solve(-60.0, g_min, -t, false);
    vec![
        (f32::NEG_INFINITY, shrink_down(a_left)),
        (shrink_up(a_hi), shrink_down(b)),
    ]
}

/// The next f32 at or below `v` (so an interval computed in f64 stays inside the true set).
fn shrink_down(v: f64) -> f32 {
    let f = v as f32;
    if f as f64 > v {
        f32::from_bits(if f > 0.0 {
            f.to_bits() - 1
        } else {
            f.to_bits() + 1
        })
    } else {
        f
    }
}

fn shrink_up(v: f64) -> f32 {
    -shrink_down(-v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FATReLU's set ends at the larger of the rule's threshold and the largest gate below the
    /// activation's threshold, which the activation zeroes; dReLU's gate is ReLU's.
    #[test]
    fn fatrelu_and_drelu_skip_sets() {
        let tau = 0.25f32;
        let act = Activation::FatRelu { threshold: tau };
        let s = SkipSet::new(act, 0.0);
        assert!(s.contains(-3.0, tau.next_down()) && !s.contains(-3.0, tau));
        assert_eq!(act.apply(tau.next_down()), 0.0);
        assert_eq!(act.apply(tau), tau);
        let s = SkipSet::new(act, 0.5);
        assert!(s.contains(-3.0, 0.5) && !s.contains(0.0, 0.5f32.next_up()));
        let s = SkipSet::new(Activation::DRelu, 0.0);
        assert!(s.contains(-1.0, 0.0) && !s.contains(-1.0, 1e-6));
    }

    #[test]
    fn relu_skip_set() {
        let s = SkipSet::new(Activation::Relu, 0.0);
        assert!(s.contains(-3.0, -0.1));
        assert!(s.contains(-3.0, 0.0));
        assert!(!s.contains(-3.0, 0.01));
    }

    /// Sound: any interval the set accepts only holds skippable gates (dense sampling).
    #[test]
    fn silu_and_gelu_skip_sets_are_sound_and_tight() {
        for act in [Activation::Silu, Activation::GeluTanh] {
            for t in [0.05f32, 0.16, 0.2, 0.27, 0.3, 1.0] {
                let s = SkipSet::new(act, t);
                for &(a, b) in &s.intervals {
                    let lo = if a.is_finite() { a } else { -80.0 };
                    for i in 0..=2000 {
                        // (f32 rounding of the step could land just past b.)
                        let g = (lo + (b - lo) * i as f32 / 2000.0).min(b);
                        assert!(
                            act.apply(g).abs() <= t * (1.0 + 1e-5),
                            "{act:?} t {t}: g {g}"
                        );
                    }
                    // Tight: just outside the right end is not skippable.
                    assert!(act.apply(b + 1e-3).abs() > t, "{act:?} t {t}: end {b}");
                }
                assert!(s.contains(-0.01, 0.01));
                assert!(!s.contains(-0.01, 5.0));
            }
        }
        assert_eq!(SkipSet::new(Activation::Silu, 0.3).intervals.len(), 1);
        assert_eq!(SkipSet::new(Activation::Silu, 0.2).intervals.len(), 2);
        // GELU's dip is shallower (≈ −0.170): one interval from there, two below.
        assert_eq!(SkipSet::new(Activation::GeluTanh, 0.2).intervals.len(), 1);
        assert_eq!(SkipSet::new(Activation::GeluTanh, 0.16).intervals.len(), 2);
    }
}
