//! One synthetic FFN layer: gate rows built from shared and private directions so that, on the
//! layer's real inputs, each neuron fires as often as its source counterpart, with the source's
//! co-activation, token overlap and predictability; biases set from the measured pre-activations;
//! predictors constructed (not trained) from the same directions; everything measured on the
//! held-out rows afterwards.

use leanstream::kernels::QMatrix;
use leanstream::source::config::Activation;
use leanstream_format::meta::{Activity, LayerMeta};
use leanstream_format::quant::{dequantize_row, quantize_row, row_bytes, QuantType};
use ndarray::{s, Array1, Array2, ArrayView2, Axis};
use rayon::prelude::*;

use super::dense::{rng_for, uniform, Layout, BIAS_BLOCK};
use super::plant;
use crate::activity::{self, GROUP};
use crate::placement::cluster_fill;
use crate::train::{score_threshold, targets, top_k_quality, Trained};

/// Scale of the down columns: the FFN writes almost nothing back, so the input distribution the
/// gates were planted for holds at every depth.
const DOWN_SCALE: f32 = 1e-5;
/// Logistic approximation of the normal CDF: Φ(x) ≈ sigmoid(1.702 x).
const PROBIT: f32 = 1.702;
/// Predicted-active budget as a multiple of the active fraction (as in `convert`).
const BUDGET_FACTOR: f32 = 1.5;

/// What every layer shares: the FFN input rows, the look-ahead inputs, and their statistics.
pub struct Inputs {
    /// FFN input rows (`rows × h`), the same for every layer.
    pub x: Vec<f32>,
    /// Look-ahead inputs, RMS-normalised: the embeddings (layers 0, 1) and the residual after
    /// layer 0 (later layers).
    pub embed_hat: Vec<f32>,
    pub resid_hat: Vec<f32>,
    pub train: Vec<usize>,
    pub eval: Vec<usize>,
    pub eval_prev: Vec<Option<usize>>,
    /// RMS of the fast and slow parts of `x`, and their lag-1 correlations.
    pub sigma: (f32, f32),
    pub rho: (f64, f64),
}

/// The targets for one layer: the source layer's measurements and per-neuron frequencies.
pub struct Target<'a> {
    pub meta: &'a LayerMeta,
    pub activity: Activity,
    pub freq: Vec<f32>,
}

/// The knobs chosen for a layer (recorded in the file's provenance).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Knobs {
    pub group_share: f64,
    pub slow_share: f64,
    pub predictable_share: f64,
    pub lookahead_noise: f64,
}

pub struct Built {
    /// Bundles `[gate | up | down]` in stored order.
    pub bundles: Vec<Vec<u8>>,
    pub masks: Vec<bool>,
    pub gates: Vec<f32>,
    pub own: Trained,
    pub own_threshold: f32,
    pub lookahead: Trained,
    pub lookahead_threshold: f32,
    pub meta: LayerMeta,
    pub knobs: Knobs,
}

pub struct Params {
    pub h: usize,
    pub n: usize,
    pub rank: usize,
    pub quant: QuantType,
    pub act: Activation,
    pub threshold: f32,
    /// The pre-activation above which `|act| > threshold`.
    pub z_on: f32,
    pub cluster_size: usize,
    pub seed: u64,
    pub layer: usize,
}

/// A random direction over the fast and slow parts, whitened so that its dot product with an
/// input row has unit variance, a share `slow` of it from the slow part.
fn mixed(lay: &Layout, inp: &Inputs, slow: f64, seed: u64, a: u64, b: u64) -> Vec<f32> {
    let mut v = vec![0.0f32; lay.h];
    let mut rng = rng_for(seed, a, b);
    let (sf, ss) = inp.sigma;
    let f = ((1.0 - slow) as f32).sqrt() / (sf * (lay.fast.len() as f32).sqrt());
    uniform(&mut rng, &mut v[lay.fast.clone()], f);
    let s = (slow as f32).sqrt() / (ss * (lay.slow.len() as f32).sqrt());
    uniform(&mut rng, &mut v[lay.slow.clone()], s);
    v
}

fn unit_coeffs(k: usize, seed: u64, a: u64, b: u64) -> Vec<f32> {
    let mut rng = rng_for(seed, a, b);
    let v: Vec<f32> = (0..k).map(|_| plant::gaussian(&mut rng) as f32).collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-9);
    v.into_iter().map(|x| x / norm).collect()
}

pub fn build(p: &Params, lay: &Layout, inp: &Inputs, t: &Target) -> anyhow::Result<Built> {
    let (h, n) = (p.h, p.n);
    let rows = inp.x.len() / h;
    let tau = plant::taus(&t.freq);
    let active_frac = t.freq.iter().sum::<f32>() / n as f32;
    let k = ((BUDGET_FACTOR * active_frac * n as f32).ceil() as usize).clamp(1, n);
    let k_frac = k as f64 / n as f64;

    // Knobs on the latent model.
    let group_share = plant::solve_increasing(
        |c| plant::group_fill(&tau, GROUP, c),
        t.activity.group_fill as f64,
        0.0,
        0.98,
        24,
    );
    let (rho_fast, rho_slow) = inp.rho;
    let slow_share = plant::solve_increasing(
        |w| plant::overlap(&tau, w * rho_slow + (1.0 - w) * rho_fast),
        t.activity.token_overlap as f64,
        0.0,
        1.0,
        24,
    );
    let stride = n.div_ceil(2048);
    let tau_sub: Vec<f64> = tau.iter().copied().step_by(stride).collect();
    let predictable_share = plant::solve_increasing(
        |pi| plant::recall(&tau_sub, pi, k_frac, p.seed),
        t.meta.predictor_recall as f64,
        0.0,
        0.98,
        24,
    );
    let alpha = group_share.min(predictable_share);
    let (beta, delta) = (predictable_share - alpha, group_share - alpha);
    let private = (1.0 - group_share.max(predictable_share)).max(0.0);

    // The predictable basis, the group directions, and each neuron's coefficients on the basis.
    let basis_k = ((p.rank - 1) / 2).max(1);
    let tag = |what: u64| (p.layer as u64) << 8 | what;
    let basis = Array2::from_shape_vec(
        (basis_k, h),
        (0..basis_k)
            .flat_map(|i| mixed(lay, inp, slow_share, p.seed, tag(1), i as u64))
            .collect(),
    )
    .expect("k × h");
    let groups = n.div_ceil(GROUP);
    let coeffs = Array2::from_shape_vec(
        (n, basis_k),
        (0..n)
            .into_par_iter()
            .flat_map_iter(|i| {
                let g = unit_coeffs(basis_k, p.seed, tag(2), (i / GROUP) as u64);
                let own = unit_coeffs(basis_k, p.seed, tag(3), i as u64);
                (0..basis_k)
                    .map(move |j| (alpha.sqrt() as f32) * g[j] + (beta.sqrt() as f32) * own[j])
            })
            .collect(),
    )
    .expect("n × k");
    let group_dirs: Vec<Vec<f32>> = (0..groups)
        .into_par_iter()
        .map(|g| mixed(lay, inp, slow_share, p.seed, tag(4), g as u64))
        .collect();

    // Gate direction rows (bias 0), quantized.
    let rb = row_bytes(p.quant, h)?;
    let mut gate_bytes = vec![0u8; n * rb];
    const CHUNK: usize = 256;
    gate_bytes
        .par_chunks_mut(CHUNK * rb)
        .enumerate()
        .try_for_each(|(ci, out)| -> anyhow::Result<()> {
            let first = ci * CHUNK;
            let count = out.len() / rb;
            let shared = coeffs.slice(s![first..first + count, ..]).dot(&basis);
            for r in 0..count {
                let i = first + r;
                let mut row: Vec<f32> = shared.row(r).to_vec();
                let q = mixed(lay, inp, slow_share, p.seed, tag(5), i as u64);
                let g = &group_dirs[i / GROUP];
                for j in 0..h {
                    row[j] += (delta.sqrt() as f32) * g[j] + (private.sqrt() as f32) * q[j];
                }
                row[..BIAS_BLOCK].fill(0.0);
                out[r * rb..(r + 1) * rb].copy_from_slice(&quantize_row(p.quant, &row)?);
            }
            Ok(())
        })?;

    // Pre-activations without bias on every row, then the bias that gives each neuron its
    // frequency on the training rows.
    let mut zdir = vec![0.0f32; rows * n];
    QMatrix::new(n, h, p.quant, gate_bytes.clone())?.matmul_t(&inp.x, rows, &mut zdir);
    let x0: Vec<f32> = (0..rows).map(|r| inp.x[r * h]).collect();
    let bias_bytes = row_bytes(p.quant, BIAS_BLOCK)?;
    let bias: Vec<f32> = (0..n)
        .into_par_iter()
        .map(|i| {
            let mut v: Vec<f32> = inp
                .train
                .iter()
                .map(|&r| (p.z_on - zdir[r * n + i]) / x0[r])
                .collect();
            v.sort_unstable_by(f32::total_cmp);
            let on = (t.freq[i] * v.len() as f32).round() as usize;
            match on {
                0 => v[0] - 1.0,
                o if o >= v.len() => v[v.len() - 1] + 1.0,
                o => 0.5 * (v[o - 1] + v[o]),
            }
        })
        .collect();
    let mut bias_hat = vec![0.0f32; n];
    for i in 0..n {
        let mut block = [0.0f32; BIAS_BLOCK];
        block[0] = bias[i];
        let enc = quantize_row(p.quant, &block)?;
        let mut dec = [0.0f32; BIAS_BLOCK];
        dequantize_row(p.quant, &enc, &mut dec)?;
        bias_hat[i] = dec[0];
        gate_bytes[i * rb..i * rb + bias_bytes].copy_from_slice(&enc);
    }
    let mut gates = zdir.clone();
    for r in 0..rows {
        for i in 0..n {
            gates[r * n + i] += bias_hat[i] * x0[r];
        }
    }
    let masks: Vec<bool> = gates
        .iter()
        .map(|&g| p.act.apply(g).abs() > p.threshold)
        .collect();

    // Predictors: the own one reads the predictable part exactly; the look-ahead one reads its
    // own input through a basis blurred by noise until its recall matches the source's.
    let xa = Array2::from_shape_vec((rows, h), inp.x.clone()).expect("rows × h");
    let zdir_a = Array2::from_shape_vec((rows, n), zdir).expect("rows × n");
    let y_train = targets(&masks, n, &inp.train);
    let y_eval = targets(&masks, n, &inp.eval);
    let build_predictor =
        |input: ArrayView2<f32>, b: &Array2<f32>, gain: f32, bias_in: f32| -> Trained {
            let pred = input.dot(&b.t()).dot(&coeffs.t()) * gain;
            let resid = &zdir_a - &pred;
            let train_resid = resid.select(Axis(0), &inp.train);
            let sd = train_resid.std_axis(Axis(0), 0.0).mapv(|v| v.max(1e-3));
            let r1 = 2 * basis_k + 1;
            let mut w1 = Array2::<f32>::zeros((r1, h));
            w1[[0, 0]] = bias_in;
            for j in 0..basis_k {
                w1.row_mut(1 + 2 * j).assign(&b.row(j));
                w1.row_mut(2 + 2 * j).assign(&(-&b.row(j)));
            }
            let mut w2 = Array2::<f32>::zeros((n, r1));
            for i in 0..n {
                let s = PROBIT / sd[i];
                w2[[i, 0]] = s * bias_hat[i];
                for j in 0..basis_k {
                    w2[[i, 1 + 2 * j]] = s * gain * coeffs[[i, j]];
                    w2[[i, 2 + 2 * j]] = -s * gain * coeffs[[i, j]];
                }
            }
            Trained {
                w1,
                b1: Array1::zeros(r1),
                w2,
                b2: sd.mapv(|v| -PROBIT * p.z_on / v),
            }
        };
    let own = build_predictor(xa.view(), &basis, 1.0, 1.0);
    let own_train = own.scores(xa.select(Axis(0), &inp.train).view());
    let own_threshold = score_threshold(&own_train, k_frac as f32);
    let own_q = top_k_quality(
        own.scores(xa.select(Axis(0), &inp.eval).view()).view(),
        &y_eval,
        k,
    );

    let la_input = if p.layer <= 1 {
        &inp.embed_hat
    } else {
        &inp.resid_hat
    };
    let la = Array2::from_shape_vec((rows, h), la_input.clone()).expect("rows × h");
    let scale = part_scales(lay, &xa, &la, &inp.train);
    let noise = Array2::from_shape_vec(
        (basis_k, h),
        (0..basis_k)
            .flat_map(|i| mixed(lay, inp, slow_share, p.seed, tag(6), i as u64))
            .collect(),
    )
    .expect("k × h");
    let blurred = |nu: f64| -> (Array2<f32>, f32) {
        let mut b = &basis * ((1.0 - nu).sqrt() as f32) + &noise * (nu.sqrt() as f32);
        for mut row in b.axis_iter_mut(Axis(0)) {
            row.slice_mut(s![lay.fast.clone()])
                .mapv_inplace(|v| v * scale[1]);
            row.slice_mut(s![lay.slow.clone()])
                .mapv_inplace(|v| v * scale[2]);
        }
        (b, (1.0 - nu).sqrt() as f32)
    };
    let sample: Vec<usize> = inp
        .train
        .iter()
        .copied()
        .step_by(inp.train.len().div_ceil(256))
        .collect();
    let la_sample = la.select(Axis(0), &sample);
    let y_sample = targets(&masks, n, &sample);
    let la_recall = |nu: f64| {
        let (b, gain) = blurred(nu);
        let t = build_predictor(la.view(), &b, gain, scale[0]);
        top_k_quality(t.scores(la_sample.view()).view(), &y_sample, k).recall as f64
    };
    let lookahead_noise = 1.0
        - plant::solve_increasing(
            |keep| la_recall(1.0 - keep),
            t.meta.lookahead_recall as f64,
            0.0,
            1.0,
            8,
        );
    let (b, gain) = blurred(lookahead_noise);
    let lookahead = build_predictor(la.view(), &b, gain, scale[0]);
    let la_train = lookahead.scores(la.select(Axis(0), &inp.train).view());
    let lookahead_threshold = score_threshold(&la_train, k_frac as f32);
    let la_q = top_k_quality(
        lookahead
            .scores(la.select(Axis(0), &inp.eval).view())
            .view(),
        &y_eval,
        k,
    );

    // Measurements on the held-out rows.
    let freq = y_train.mean_axis(Axis(0)).expect("rows");
    let static_q = top_k_quality(freq.broadcast(y_eval.dim()).expect("n columns"), &y_eval, k);
    let identity: Vec<u32> = (0..n as u32).collect();
    let shuffled = shuffled_order(n, p.seed ^ tag(7));
    let meta = LayerMeta {
        threshold: p.threshold,
        sparsity: 1.0 - y_eval.mean().unwrap_or(0.0),
        predictor_recall: own_q.recall,
        predictor_precision: own_q.precision,
        lookahead_recall: la_q.recall,
        lookahead_precision: la_q.precision,
        static_recall: static_q.recall,
        cluster_fill: cluster_fill(&masks, n, &inp.eval, &identity, p.cluster_size),
        cluster_fill_unordered: cluster_fill(&masks, n, &inp.eval, &shuffled, p.cluster_size),
        activity: Some(activity::measure(
            &masks,
            n,
            &inp.eval,
            &inp.eval_prev,
            &identity,
        )),
        certificate_saves: None,
        routing: None,
    };

    // Bundles: gate (with bias), a random up row, a tiny random down column.
    let bundles: Vec<Vec<u8>> = (0..n)
        .into_par_iter()
        .map(|i| -> anyhow::Result<Vec<u8>> {
            let mut rng = rng_for(p.seed, tag(8), i as u64);
            let mut v = vec![0.0f32; h];
            let mut out = gate_bytes[i * rb..(i + 1) * rb].to_vec();
            uniform(&mut rng, &mut v, 1.0 / (h as f32).sqrt());
            out.extend(quantize_row(p.quant, &v)?);
            uniform(&mut rng, &mut v, DOWN_SCALE);
            out.extend(quantize_row(p.quant, &v)?);
            Ok(out)
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(Built {
        bundles,
        masks,
        gates,
        own,
        own_threshold,
        lookahead,
        lookahead_threshold,
        meta,
        knobs: Knobs {
            group_share,
            slow_share,
            predictable_share,
            lookahead_noise,
        },
    })
}

/// How much larger the bias channel, fast part and slow part are in `x` than in the look-ahead
/// input (0 where the look-ahead input has none of it).
fn part_scales(lay: &Layout, x: &Array2<f32>, la: &Array2<f32>, rows: &[usize]) -> [f32; 3] {
    let rms = |a: &Array2<f32>, cols: std::ops::Range<usize>| {
        let v = a.select(Axis(0), rows);
        let part = v.slice(s![.., cols]);
        (part.iter().map(|x| x * x).sum::<f32>() / part.len().max(1) as f32).sqrt()
    };
    let ratio = |cols: std::ops::Range<usize>| {
        let (a, b) = (rms(x, cols.clone()), rms(la, cols));
        if b > 1e-3 * a {
            a / b
        } else {
            0.0
        }
    };
    [
        ratio(0..1),
        ratio(lay.fast.clone()),
        ratio(lay.slow.clone()),
    ]
}

/// A random order of `0..n` (the "original" neuron order the placement is judged against).
pub fn shuffled_order(n: usize, seed: u64) -> Vec<u32> {
    use rand::seq::SliceRandom;
    let mut v: Vec<u32> = (0..n as u32).collect();
    v.shuffle(&mut rng_for(seed, 0, 0));
    v
}
