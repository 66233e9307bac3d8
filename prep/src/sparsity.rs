//! Which neurons count as active, and the per-layer thresholds that make it so.
//!
//! - `relu`: ReLU's exact zero test (`gate` rule, threshold 0).
//! - `threshold:F`: the `gate` rule `|act(g)| ≤ t`, each layer's `t` the F-quantile of `|act(g)|`
//!   (CATS style; kept for comparison and older files).
//! - `target:F`: the `gate_up` rule `|act(g)·u| ≤ t` — a neuron's coefficient on its down column,
//!   with the up and down rows rescaled at conversion so that `|act(g)·u|` is the norm of what the
//!   neuron adds (see [`down_norms`]). The skipped fraction F is allocated across layers greedily,
//!   TEAL-like: each layer's cost curve (the error its skipped neurons add to the residual stream,
//!   relative to the stream) is measured on the dense model, and each step of sparsity goes to the
//!   layer where it costs least until the mean over layers is F.
//! - `auto` (SwiGLU): `target:F` at the largest F whose held-out perplexity cost against the dense
//!   model is at most [`AUTO_MAX_COST`], found by bisection ([`auto_search`]).

use leanstream::source::config::Activation;
use leanstream::streaming::skip_rule::SkipRule;
use leanstream_format::quant_scale::nearest_pow2_exponent;
use rayon::prelude::*;

/// `auto` for SiLU models: the largest target whose perplexity on the held-out calibration windows
/// is at most this much above the dense model's (with the thresholds the file gets, i.e. what
/// exact mode computes).
pub const AUTO_MAX_COST: f64 = 0.02;
/// `auto`'s candidates: the multiples of [`AUTO_STEP`] up to [`AUTO_MAX`].
const AUTO_STEP: f32 = 0.05;
const AUTO_MAX: f32 = 0.8;
/// Allocation step and the largest fraction one layer may be given.
const STEP: f32 = 0.025;
const MAX_LAYER_FRACTION: f32 = 0.9;
/// Rows of the calibration profile a cost curve is measured on.
const CURVE_ROWS: usize = 256;

/// How neurons are declared skippable.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SparsityMode {
    /// Active iff act(gate·x) ≠ 0: exact for ReLU-family models (ReLU, FATReLU, dReLU).
    Relu,
    /// `gate` rule, the same fraction skipped in every layer.
    Threshold(f32),
    /// `gate_up` rule, the fraction allocated across layers (`allocate`) or uniform.
    Target { fraction: f32, allocate: bool },
    /// `gate_up` rule, allocated, at the fraction [`auto_search`] picks.
    Auto,
}

impl SparsityMode {
    /// Parses `auto`, `relu`, `threshold:F`, `target:F` or `target-uniform:F` (`auto` is relu for
    /// ReLU models, else [`SparsityMode::Auto`]).
    pub fn parse(s: &str, act: Activation) -> anyhow::Result<Self> {
        let fraction = |prefix: &str| {
            s.strip_prefix(prefix)
                .and_then(|v| v.parse::<f32>().ok())
                .filter(|f| (0.0..1.0).contains(f))
        };
        match s {
            "auto" if act.is_relu_like() => Ok(Self::Relu),
            "auto" => Ok(Self::Auto),
            "relu" if act.is_relu_like() => Ok(Self::Relu),
            "relu" => anyhow::bail!(
                "--sparsity relu needs a ReLU-family model (ReLU, FATReLU, dReLU); this one uses \
                 {act:?}: use target:F"
            ),
            _ => {
                if let Some(f) = fraction("threshold:") {
                    Ok(Self::Threshold(f))
                } else if let Some(f) = fraction("target:") {
                    Ok(Self::Target {
                        fraction: f,
                        allocate: true,
                    })
                } else if let Some(f) = fraction("target-uniform:") {
                    Ok(Self::Target {
                        fraction: f,
                        allocate: false,
                    })
                } else {
                    anyhow::bail!(
                        "--sparsity must be auto, relu, target:F, target-uniform:F or threshold:F \
                         with 0 <= F < 1, got {s:?}"
                    )
                }
            }
        }
    }

    /// META `sparsity_mode`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Relu => "relu",
            Self::Threshold(_) | Self::Target { .. } | Self::Auto => "threshold",
        }
    }

    /// The mean fraction skipped (`None` for `relu`, and for `auto` until it is resolved).
    pub fn target(self) -> Option<f32> {
        match self {
            Self::Relu | Self::Auto => None,
            Self::Threshold(f) | Self::Target { fraction: f, .. } => Some(f),
        }
    }

    pub fn rule(self) -> SkipRule {
        match self {
            Self::Relu | Self::Threshold(_) => SkipRule::Gate,
            Self::Target { .. } | Self::Auto => SkipRule::GateUp,
        }
    }
}

/// What `auto` chose and what it measured on the way (fraction, held-out perplexity cost).
#[derive(Debug, Clone, serde::Serialize)]
pub struct AutoChoice {
    pub fraction: f32,
    pub cost: f64,
    pub max_cost: f64,
    pub tried: Vec<(f32, f64)>,
}

/// The largest fraction (a multiple of [`AUTO_STEP`], at most [`AUTO_MAX`]) whose cost is at
/// most [`AUTO_MAX_COST`], taking the cost to grow with the fraction: a bisection of the
/// candidates, one fraction measured per step (`costs` measures a batch of fractions in one pass
/// through the model; here a batch of one), so 4 or 5 passes of one sparse stream each. 0 (the
/// dense model, cost 0) when none passes.
pub fn auto_search(
    mut costs: impl FnMut(&[f32]) -> anyhow::Result<Vec<f64>>,
) -> anyhow::Result<AutoChoice> {
    let at = |k: usize| k as f32 * AUTO_STEP;
    let mut tried: Vec<(f32, f64)> = Vec::new();
    // Candidate `pass` passes (0: dense), `fail` fails (one past the last candidate).
    let (mut pass, mut fail) = (0usize, auto_candidates() + 1);
    let mut chosen = (0.0, 0.0);
    while fail - pass > 1 {
        let mid = (pass + fail) / 2;
        let cost = costs(&[at(mid)])?[0];
        tried.push((at(mid), cost));
        if cost <= AUTO_MAX_COST {
            pass = mid;
            chosen = (at(mid), cost);
        } else {
            fail = mid;
        }
    }
    tried.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(AutoChoice {
        fraction: chosen.0,
        cost: chosen.1,
        max_cost: AUTO_MAX_COST,
        tried,
    })
}

/// `auto`'s candidates other than 0.
fn auto_candidates() -> usize {
    (AUTO_MAX / AUTO_STEP).round() as usize
}

/// The most passes [`auto_search`] makes.
pub fn auto_rounds() -> usize {
    let (mut span, mut rounds) = (auto_candidates() + 1, 0);
    while span > 1 {
        span = span.div_ceil(2);
        rounds += 1;
    }
    rounds
}

/// At most this many scores are sorted to find a quantile.
const QUANTILE_SAMPLE: usize = 1 << 22;

/// The `fraction`-quantile of the training rows' scores (`rows × n`).
pub fn quantile(scores: &[f32], n: usize, train_rows: &[usize], fraction: f32) -> f32 {
    let mut s = quantile_sample(scores, n, train_rows);
    if s.is_empty() || fraction <= 0.0 {
        return 0.0;
    }
    let k = quantile_rank(s.len(), fraction);
    *s.select_nth_unstable_by(k, f32::total_cmp).1
}

/// The scores [`quantile`] ranks: every `stride`-th of the training rows', at most
/// [`QUANTILE_SAMPLE`].
fn quantile_sample(scores: &[f32], n: usize, train_rows: &[usize]) -> Vec<f32> {
    let total = train_rows.len() * n;
    let stride = total.div_ceil(QUANTILE_SAMPLE).max(1);
    train_rows
        .iter()
        .flat_map(|&r| scores[r * n..(r + 1) * n].iter())
        .step_by(stride)
        .copied()
        .collect()
}

/// The position of the `fraction`-quantile among `len` sorted values.
fn quantile_rank(len: usize, fraction: f32) -> usize {
    ((len as f64 * fraction as f64) as usize).min(len - 1)
}

/// Each neuron's score under `rule`: `|act(g)|` or `|act(g)·u|` (`coef` holds `act(g)·u`).
pub fn scores(rule: SkipRule, act: Activation, gate: &[f32], coef: &[f32]) -> Vec<f32> {
    match rule {
        SkipRule::Gate => gate.iter().map(|&g| act.apply(g).abs()).collect(),
        SkipRule::GateUp => coef.iter().map(|c| c.abs()).collect(),
    }
}

/// Activity of every (row, neuron): score above the threshold.
pub fn masks(scores: &[f32], threshold: f32) -> Vec<bool> {
    scores.iter().map(|&s| s > threshold).collect()
}

/// The norm of every down column (`down` is `hidden × n`, row-major). Scaling neuron `i`'s up row
/// by `‖d_i‖` and its down column by `1/‖d_i‖` leaves the FFN unchanged and makes `|act(g)·u|`
/// the norm of the neuron's contribution — the weight-informed score (WINA-like) the `gate_up`
/// rule then applies.
pub fn down_norms(down: &[f32], hidden: usize, n: usize) -> Vec<f32> {
    let mut sq = vec![0.0f64; n];
    for r in 0..hidden {
        for (s, &v) in sq.iter_mut().zip(&down[r * n..(r + 1) * n]) {
            *s += (v as f64) * (v as f64);
        }
    }
    sq.into_iter().map(|s| s.sqrt() as f32).collect()
}

/// Rounds each of [`down_norms`]' norms to the power of two nearest it (in log scale) and returns
/// the exponents: rescaling by a power of two is exact in a row's stored encoding
/// ([`leanstream_format::quant_scale`]), so `convert` keeps a GGUF's up rows as stored. Scores
/// then weigh each neuron's contribution within a factor of √2. A zero norm stays zero (exponent
/// 0: that neuron is not rescaled).
pub fn pow2_norms(norms: &mut [f32]) -> Vec<i32> {
    norms
        .iter_mut()
        .map(|d| {
            let k = nearest_pow2_exponent(*d).unwrap_or(0);
            if *d > 0.0 {
                *d = 2f32.powi(k);
            }
            k
        })
        .collect()
}

/// Applies [`down_norms`]'s rescaling in place (neurons with a zero column are left alone).
pub fn rescale(up: &mut [f32], down: &mut [f32], norms: &[f32], hidden: usize) {
    let n = norms.len();
    for (i, &d) in norms.iter().enumerate() {
        if d > 0.0 {
            up[i * hidden..(i + 1) * hidden]
                .iter_mut()
                .for_each(|v| *v *= d);
        }
    }
    for r in 0..hidden {
        for (v, &d) in down[r * n..(r + 1) * n].iter_mut().zip(norms) {
            if d > 0.0 {
                *v /= d;
            }
        }
    }
}

/// A layer's threshold at every fraction [`allocate`] may give it: `t[k]` skips `k·STEP` of the
/// training scores (the same [`quantile`] the converter's main pass takes).
pub fn level_thresholds(scores: &[f32], n: usize, train_rows: &[usize]) -> Vec<f32> {
    let levels = (MAX_LAYER_FRACTION / STEP).round() as usize;
    // One sort for every level: the same values `quantile` selects one at a time.
    let s = sorted(quantile_sample(scores, n, train_rows));
    (0..=levels)
        .map(|k| match k {
            0 => 0.0,
            _ if s.is_empty() => 0.0,
            _ => s[quantile_rank(s.len(), k as f32 * STEP)],
        })
        .collect()
}

/// `s` in [`f32::total_cmp`] order, sorted as integers of the same order (several times faster
/// than a comparison sort of floats) on every core: the same values, in the same order, whatever
/// the thread count.
fn sorted(s: Vec<f32>) -> Vec<f32> {
    let mut keys: Vec<u32> = s.into_iter().map(order_key).collect();
    keys.par_sort_unstable();
    keys.into_iter().map(from_order_key).collect()
}

/// `v`'s key in [`f32::total_cmp`] order, an integer (negative floats' bits reversed, positive
/// ones' above them): integers sort several times faster than a comparison sort of floats.
pub(crate) fn order_key(v: f32) -> u32 {
    let b = v.to_bits();
    b ^ (((b as i32 >> 31) as u32) | 0x8000_0000)
}

/// The float of an [`order_key`].
pub(crate) fn from_order_key(k: u32) -> f32 {
    f32::from_bits(if k & 0x8000_0000 != 0 {
        k ^ 0x8000_0000
    } else {
        !k
    })
}

/// The entry of [`level_thresholds`] for a fraction [`allocate`] returned.
pub fn level(fraction: f32) -> usize {
    (fraction / STEP).round() as usize
}

/// One layer's cost of skipping: `cost[k]` is the mean of `‖Σ_{skipped} c_i d_i‖² / ‖residual‖²`
/// over sampled rows when a fraction `k·STEP` of the neurons is skipped (`thresholds[k]`, from
/// [`level_thresholds`]).
pub fn cost_curve(
    scores: &[f32],
    coef: &[f32],
    down: &[f32],
    residual: &[f32],
    hidden: usize,
    train_rows: &[usize],
    thresholds: &[f32],
) -> Vec<f64> {
    let n = scores.len() / (residual.len() / hidden);
    let levels = thresholds.len() - 1;
    let sample = train_rows.len().div_ceil(CURVE_ROWS).max(1);
    let mut cost = vec![0.0f64; levels + 1];
    // Down columns as rows, read once per (row, neuron).
    let mut columns = vec![0.0f32; n * hidden];
    for j in 0..hidden {
        for i in 0..n {
            columns[i * hidden + j] = down[j * n + i];
        }
    }
    // Each sampled row's costs on every core, summed in row order: the same bits whatever the
    // thread count.
    let sampled: Vec<usize> = train_rows.iter().step_by(sample).copied().collect();
    let per_row: Vec<Vec<f64>> = sampled
        .par_iter()
        .map_init(
            || vec![0.0f32; (levels + 1) * hidden],
            |buckets, &r| {
                buckets.fill(0.0);
                for i in 0..n {
                    let s = scores[r * n + i];
                    // The first level whose threshold skips this neuron.
                    let k = thresholds.partition_point(|&t| t < s);
                    if k > levels {
                        continue;
                    }
                    let c = coef[r * n + i];
                    buckets[k * hidden..(k + 1) * hidden]
                        .iter_mut()
                        .zip(&columns[i * hidden..(i + 1) * hidden])
                        .for_each(|(b, d)| *b += c * d);
                }
                let res: f64 = residual[r * hidden..(r + 1) * hidden]
                    .iter()
                    .map(|v| (*v as f64).powi(2))
                    .sum::<f64>()
                    .max(1e-12);
                let mut err = vec![0.0f32; hidden];
                (0..=levels)
                    .map(|k| {
                        err.iter_mut()
                            .zip(&buckets[k * hidden..(k + 1) * hidden])
                            .for_each(|(e, b)| *e += b);
                        err.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / res
                    })
                    .collect()
            },
        )
        .collect();
    for row in &per_row {
        cost.iter_mut().zip(row).for_each(|(c, v)| *c += v);
    }
    let rows = per_row.len();
    cost.iter_mut().for_each(|c| *c /= rows.max(1) as f64);
    cost
}

/// Greedy allocation: every layer starts dense; each step of `STEP` goes to the layer whose cost
/// grows least by it, until the mean fraction reaches `target`. Returns each layer's fraction.
pub fn allocate(curves: &[Vec<f64>], target: f32) -> Vec<f32> {
    let layers = curves.len();
    let mut level = vec![0usize; layers];
    let steps = (target * layers as f32 / STEP).round() as usize;
    for _ in 0..steps {
        let best = (0..layers)
            .filter(|&l| level[l] + 1 < curves[l].len())
            .min_by(|&a, &b| {
                let d = |l: usize| curves[l][level[l] + 1] - curves[l][level[l]];
                // Ties go to the sparser-so-far layer last: spread evenly.
                d(a).total_cmp(&d(b)).then(level[a].cmp(&level[b]))
            });
        match best {
            Some(l) => level[l] += 1,
            None => break,
        }
    }
    level.iter().map(|&k| k as f32 * STEP).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorted_matches_total_cmp() {
        let mut v = vec![
            3.5,
            -0.0,
            0.0,
            -7.25,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-40,
            -1e-40,
            2.0,
            -2.0,
            f32::MAX,
            f32::MIN,
        ];
        v.extend((0..5000).map(|i| ((i * 7919) % 1013) as f32 * 0.37 - 150.0));
        let got = sorted(v.clone());
        v.sort_unstable_by(f32::total_cmp);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&v));
    }

    #[test]
    fn quantile_threshold_skips_the_target_fraction() {
        let n = 100;
        let gate: Vec<f32> = (0..10 * n)
            .map(|i| ((i * 37) % 1000) as f32 / 100.0 - 5.0)
            .collect();
        let rows: Vec<usize> = (0..10).collect();
        let s = scores(SkipRule::Gate, Activation::Silu, &gate, &[]);
        let t = quantile(&s, n, &rows, 0.3);
        let skipped = masks(&s, t).iter().filter(|a| !**a).count();
        assert!(
            (skipped as f64 / gate.len() as f64 - 0.3).abs() < 0.01,
            "{skipped}"
        );
        assert_eq!(quantile(&s, n, &rows, 0.0), 0.0);
    }

    #[test]
    fn rescaling_keeps_the_ffn_and_scores_by_contribution() {
        let (h, n) = (3, 2);
        let mut up = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        // Columns: neuron 0 = (3, 0, 4) (norm 5), neuron 1 = (0, 2, 0) (norm 2).
        let mut down = vec![3.0, 0.0, 0.0, 2.0, 4.0, 0.0];
        let norms = down_norms(&down, h, n);
        assert_eq!(norms, vec![5.0, 2.0]);
        let (up0, down0) = (up.clone(), down.clone());
        rescale(&mut up, &mut down, &norms, h);
        assert_eq!(down_norms(&down, h, n), vec![1.0, 1.0]);
        for i in 0..n {
            for j in 0..h {
                for r in 0..h {
                    let before = up0[i * h + j] * down0[r * n + i];
                    let after = up[i * h + j] * down[r * n + i];
                    assert!((before - after).abs() < 1e-5);
                }
            }
        }
    }

    #[test]
    fn allocation_gives_sparsity_where_it_costs_least() {
        // Layer 0 is cheap to sparsify, layer 1 expensive: the mean is met, layer 0 gets more.
        let levels = (MAX_LAYER_FRACTION / STEP).round() as usize + 1;
        let cheap: Vec<f64> = (0..levels).map(|k| 0.001 * k as f64).collect();
        let dear: Vec<f64> = (0..levels).map(|k| 0.1 * (k * k) as f64).collect();
        let f = allocate(&[cheap, dear.clone()], 0.5);
        assert!(((f[0] + f[1]) / 2.0 - 0.5).abs() < 1e-6, "{f:?}");
        assert!(f[0] > 0.85 && f[1] < 0.15, "{f:?}");
        // Equal convex curves: equal shares.
        let f = allocate(&[dear.clone(), dear], 0.3);
        assert!((f[0] - f[1]).abs() <= STEP + 1e-6, "{f:?}");
    }

    #[test]
    fn level_thresholds_are_the_quantiles_of_each_level() {
        let n = 64;
        let s: Vec<f32> = (0..40 * n).map(|i| ((i * 7919) % 1009) as f32).collect();
        let rows: Vec<usize> = (0..40).step_by(2).collect();
        let t = level_thresholds(&s, n, &rows);
        assert_eq!(t.len(), (MAX_LAYER_FRACTION / STEP).round() as usize + 1);
        for (k, &v) in t.iter().enumerate() {
            assert_eq!(v, quantile(&s, n, &rows, k as f32 * STEP), "level {k}");
        }
        assert!(t.windows(2).all(|w| w[0] <= w[1]));
        assert!(t[20] > 0.0);
    }

    #[test]
    fn cost_grows_with_the_fraction_skipped() {
        let (h, n, rows) = (4, 8, 6);
        let coef: Vec<f32> = (0..rows * n).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let s = scores(SkipRule::GateUp, Activation::Silu, &[], &coef);
        let down: Vec<f32> = (0..h * n).map(|i| ((i * 5) % 7) as f32 / 7.0).collect();
        let residual = vec![1.0f32; rows * h];
        let train: Vec<usize> = (0..rows).collect();
        let t = level_thresholds(&s, n, &train);
        let c = cost_curve(&s, &coef, &down, &residual, h, &train, &t);
        assert_eq!(c[0], 0.0);
        assert!(*c.last().unwrap() > 0.0);
    }

    /// `auto` finds the largest multiple of 0.05 within the cost by bisection, one fraction a
    /// pass, and 0 when nothing is cheap enough.
    #[test]
    fn auto_picks_the_largest_fraction_within_the_cost() {
        let mut batches = Vec::new();
        // cost = f²/10: 0.4 costs 0.016, 0.45 costs 0.02025.
        let c = auto_search(|fs| {
            batches.push(fs.to_vec());
            Ok(fs.iter().map(|&f| (f as f64).powi(2) / 10.0).collect())
        })
        .unwrap();
        assert!((c.fraction - 0.4).abs() < 1e-6, "{c:?}");
        assert!((c.cost - 0.016).abs() < 1e-6, "{c:?}");
        // 0.4 passes, 0.6, 0.5 and 0.45 fail.
        let want = [0.4, 0.6, 0.5, 0.45];
        assert_eq!(batches.len(), want.len(), "{batches:?}");
        for (b, w) in batches.iter().zip(want) {
            assert!(b.len() == 1 && (b[0] - w).abs() < 1e-6, "{batches:?}");
        }
        assert!(c.tried.windows(2).all(|w| w[0].0 < w[1].0), "{c:?}");
        // A cost that passes 0.45 (the SmolLM2 case): 0.4, 0.6, 0.5, 0.45 measured, 0.45 chosen.
        let c = auto_search(|fs| Ok(fs.iter().map(|&f| f64::from(f > 0.47)).collect())).unwrap();
        assert!((c.fraction - 0.45).abs() < 1e-6, "{c:?}");
        assert_eq!(c.tried.len(), 4, "{c:?}");
        // Steeper: only 0.05 and 0.1 fit under 0.2.
        let c = auto_search(|fs| Ok(fs.iter().map(|&f| f as f64 * 0.15).collect())).unwrap();
        assert!((c.fraction - 0.1).abs() < 1e-6, "{c:?}");
        // Nothing fits: dense.
        let c = auto_search(|fs| Ok(vec![1.0; fs.len()])).unwrap();
        assert_eq!((c.fraction, c.cost), (0.0, 0.0));
        assert_eq!(c.tried.len(), 4, "{c:?}");
        // Everything fits: the largest candidate, in the most passes.
        let c = auto_search(|fs| Ok(vec![0.0; fs.len()])).unwrap();
        assert!((c.fraction - 0.8).abs() < 1e-6, "{c:?}");
        assert_eq!(c.tried.len(), 5, "{c:?}");
        assert_eq!(auto_rounds(), 5);
    }

    #[test]
    fn parses_modes() {
        assert_eq!(
            SparsityMode::parse("auto", Activation::Relu).unwrap(),
            SparsityMode::Relu
        );
        assert_eq!(
            SparsityMode::parse("auto", Activation::Silu).unwrap(),
            SparsityMode::Auto
        );
        assert_eq!(
            SparsityMode::parse("threshold:0.7", Activation::Silu).unwrap(),
            SparsityMode::Threshold(0.7)
        );
        assert_eq!(
            SparsityMode::parse("target-uniform:0.4", Activation::Silu).unwrap(),
            SparsityMode::Target {
                fraction: 0.4,
                allocate: false
            }
        );
        assert_eq!(
            SparsityMode::parse("target:0.4", Activation::Silu)
                .unwrap()
                .rule(),
            SkipRule::GateUp
        );
        assert!(SparsityMode::parse("relu", Activation::Silu).is_err());
        for act in [Activation::FatRelu { threshold: 0.01 }, Activation::DRelu] {
            assert_eq!(
                SparsityMode::parse("auto", act).unwrap(),
                SparsityMode::Relu
            );
            assert_eq!(
                SparsityMode::parse("relu", act).unwrap(),
                SparsityMode::Relu
            );
        }
        assert!(SparsityMode::parse("threshold:1.5", Activation::Silu).is_err());
        assert!(SparsityMode::parse("target:x", Activation::Silu).is_err());
    }
}
