//! The certificate judged in bytes (`convert --certificate-study`): for each candidate design of a
//! gate certificate, its resident bytes and the FFN bytes exact mode would read per token, on the
//! converter's held-out profile — so that a design is kept (and made a default) only where the
//! reads it saves are worth more than the neuron cache its bytes would otherwise buy.
//!
//! Every design gives, per neuron, an interval that provably holds the exact gate `g·x`: a decoded
//! approximation `a` of the gate row and error bounds `e_b ≥ ‖g_b − a_b‖` over blocks `b` of the
//! row (one block = the whole row), so `|g·x − a·x| ≤ Σ_b e_b‖x_b‖`. A cluster must be read when
//! any neuron's interval is not inside the rule's skip set. Designs:
//! - `q8`, `q4`: a Q8_0 / Q4_0 copy, one bound per neuron (what the SKETCH section holds today);
//! - `q4 + block bounds`, `2-bit + block bounds`, `1-bit + block bounds`: low-bit codes (Q4_0;
//!   ternary or sign times an f16 scale per 32 values) with an f16 bound per 32 values;
//! - `cluster centroid`: one Q8_0 row per cluster (the mean gate) and one radius, the same
//!   interval for all its neurons;
//! - `exact gates`: the bundles' own gate rows resident (no error);
//! - `exact gates of the coldest clusters`: the same for only the clusters where they save the most
//!   reads, as many as fit in [`SUBSET_SHARE`] of the layer's FFN bundle bytes (a gate row is a
//!   third of a bundle, so at most 30 % of the clusters): the side-data target of issue 16;
//! - `none`, and the `needed` oracle (the clusters holding a neuron the rule keeps).
//!
//! Under the `gate_up` rule no gate design proves anything (the rule needs `u`): they read every
//! uncached cluster, and only the oracle says what any certificate at all could save.
//!
//! Reads per token are modelled as the planner sees them: at a budget of the minimum plus a share
//! of the FFN, the certificate's bytes come out of the neuron cache, the cache holds the clusters
//! read most often, and every other cluster costs its bytes each time it is not proven silent.
//! The study measures; it does not change the file.

use anyhow::Result;
use leanstream::streaming::certify::SkipSet;
use leanstream::streaming::skip_rule::{Skip, SkipRule};
use leanstream_format::quant::{dequantize_row, quantize_row, row_bytes, QuantType};
use ndarray::Array2;
use serde::Serialize;

/// Held-out rows the study samples per layer.
const STUDY_ROWS: usize = 256;
/// Values per block of the block-bound designs (and of Q4_0 / Q8_0).
const BLOCK: usize = 32;
/// The share of a layer's FFN bundle bytes the exact gates of its coldest clusters may take.
const SUBSET_SHARE: f64 = 0.10;

/// One design's totals over the model.
#[derive(Debug, Clone, Serialize)]
pub struct DesignScore {
    pub design: String,
    pub resident_bytes: u64,
    /// `resident_bytes` as a share of the FFN bundle bytes.
    pub share_of_ffn: f64,
    /// Cluster reads it avoids with nothing cached (all layers' clusters, weighted by bytes).
    pub saves: f64,
    /// FFN bytes read per token with nothing cached.
    pub read_per_token: f64,
    /// FFN bytes read per token at the minimum + 25 % of the FFN (the certificate's bytes taken
    /// from the neuron cache; `None` when they exceed that 25 %).
    pub read_per_token_at_25: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Study {
    pub ffn_bytes: u64,
    pub rows_per_layer: usize,
    pub designs: Vec<DesignScore>,
}

/// The designs, in report order.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Design {
    Sketch(QuantType),
    Q4Blocks,
    Ternary,
    Sign,
    Centroid,
    Exact,
    ExactColdest,
    /// What the converter wrote for the layer (`--certificate`, per layer).
    Written,
    None,
    Needed,
}

impl Design {
    const ALL: [Design; 11] = [
        Design::Sketch(QuantType::Q8_0),
        Design::Sketch(QuantType::Q4_0),
        Design::Q4Blocks,
        Design::Ternary,
        Design::Sign,
        Design::Centroid,
        Design::Exact,
        Design::ExactColdest,
        Design::Written,
        Design::None,
        Design::Needed,
    ];

    fn name(self, bundle: QuantType) -> String {
        match self {
            Design::Sketch(q) => format!("{} sketch, one bound per neuron", q.name()),
            Design::Q4Blocks => "q4_0 sketch + f16 bound per 32 values".into(),
            Design::Ternary => "2-bit (ternary) + f16 scale and bound per 32 values".into(),
            Design::Sign => "1-bit (sign) + f16 scale and bound per 32 values".into(),
            Design::Centroid => "cluster centroid (q8_0) + one radius per cluster".into(),
            Design::Exact => format!("exact gates ({} as in the bundles)", bundle.name()),
            Design::ExactColdest => format!(
                "exact gates of the clusters they save most in, within {:.0} % of the FFN",
                100.0 * SUBSET_SHARE
            ),
            Design::Written => "as written (--certificate, per layer)".into(),
            Design::None => "none".into(),
            Design::Needed => "needed (oracle: no certificate could read less)".into(),
        }
    }
}

/// One layer's measurements: per design, its bytes and per cluster the fraction of rows on which
/// the cluster must be read (not proven silent) when it is not cached.
pub struct LayerStudy {
    bytes: Vec<u64>,
    read: Vec<Vec<f32>>,
    cluster_bytes: Vec<u64>,
}

/// What one layer needs measured.
pub struct LayerInput<'a> {
    /// The gate rows as the bundles store them, stored order.
    pub gates: &'a [Vec<u8>],
    pub bundle: QuantType,
    pub hidden: usize,
    pub skip: Skip,
    /// FFN inputs, `rows × hidden`.
    pub x: &'a [f32],
    pub rows: &'a [usize],
    /// The rule's decisions, `rows × n` in original neuron order, and the stored order.
    pub mask: &'a [bool],
    pub perm: &'a [u32],
    pub cluster_size: usize,
    pub bundle_bytes: usize,
    /// The encoding of the certificate the converter wrote for the layer, if any.
    pub written: Option<QuantType>,
}

pub fn layer(inp: &LayerInput) -> Result<LayerStudy> {
    let (h, n) = (inp.hidden, inp.gates.len());
    let mut gates = Array2::<f32>::zeros((n, h));
    for (p, g) in inp.gates.iter().enumerate() {
        dequantize_row(
            inp.bundle,
            g,
            gates.row_mut(p).as_slice_mut().expect("contiguous"),
        )?;
    }
    let step = inp.rows.len().div_ceil(STUDY_ROWS).max(1);
    let rows: Vec<usize> = inp.rows.iter().copied().step_by(step).collect();
    let x = Array2::from_shape_fn((rows.len(), h), |(r, j)| inp.x[rows[r] * h + j]);
    let norm_of = |per: usize| {
        Array2::from_shape_fn((rows.len(), h / per), |(r, b)| {
            x.row(r)
                .iter()
                .skip(b * per)
                .take(per)
                .map(|v| v * v)
                .sum::<f32>()
                .sqrt()
        })
    };
    let (whole, per_block) = (norm_of(h), norm_of(BLOCK));
    let clusters = n.div_ceil(inp.cluster_size);
    let cluster_bytes: Vec<u64> = (0..clusters)
        .map(|c| (inp.cluster_size.min(n - c * inp.cluster_size) * inp.bundle_bytes) as u64)
        .collect();
    let set = SkipSet::new(inp.skip.act, inp.skip.threshold);
    let (mut bytes, mut read): (Vec<u64>, Vec<Vec<f32>>) = (Vec::new(), Vec::new());
    for design in Design::ALL {
        let (b, r) = match design {
            Design::Written => {
                let same = match inp.written {
                    Some(q) if q == inp.bundle => Design::Exact,
                    Some(q) => Design::Sketch(q),
                    None => Design::None,
                };
                match Design::ALL.iter().position(|&d| d == same) {
                    Some(i) if i < bytes.len() => (bytes[i], read[i].clone()),
                    _ => (0, vec![1.0; clusters]),
                }
            }
            Design::None => (0, vec![1.0; clusters]),
            Design::Needed => (0, needed(inp, &rows, clusters)),
            Design::ExactColdest => {
                let exact = &read[Design::ALL
                    .iter()
                    .position(|&d| d == Design::Exact)
                    .expect("exact gates come first")];
                coldest(exact, &cluster_bytes, inp)?
            }
            // A gate certificate cannot prove `|act(g)·u|` small: it bounds g, not u.
            _ if inp.skip.rule != SkipRule::Gate => {
                let (_, _, b) = approximate(design, &gates, inp)?;
                (b, vec![1.0; clusters])
            }
            _ => {
                let (approx, err, b) = approximate(design, &gates, inp)?;
                let norms = if err.ncols() == 1 { &whole } else { &per_block };
                debug_assert_eq!(err.ncols(), norms.ncols());
                let s = approx.dot(&x.t());
                let bound = err.dot(&norms.t());
                let mut r = vec![0.0f32; clusters];
                for (c, rc) in r.iter_mut().enumerate() {
                    let ps = c * inp.cluster_size..((c + 1) * inp.cluster_size).min(n);
                    let unproven = (0..rows.len())
                        .filter(|&k| {
                            ps.clone().any(|p| {
                                let (g, e) = (s[[p, k]], bound[[p, k]] * 1.001 + 1e-6);
                                !set.contains(g - e, g + e)
                            })
                        })
                        .count();
                    *rc = unproven as f32 / rows.len().max(1) as f32;
                }
                (b, r)
            }
        };
        bytes.push(b);
        read.push(r);
    }
    Ok(LayerStudy {
        bytes,
        read,
        cluster_bytes,
    })
}

/// The exact gates of the clusters `exact` (each cluster's read fraction with every gate resident)
/// proves silent most often, cluster by cluster while their rows and norms fit in
/// [`SUBSET_SHARE`] of the layer's bundle bytes: their bytes and the read fractions (the others
/// read whenever they are not cached).
fn coldest(exact: &[f32], cluster_bytes: &[u64], inp: &LayerInput) -> Result<(u64, Vec<f32>)> {
    let per_neuron = (row_bytes(inp.bundle, inp.hidden)? + 4) as u64;
    let budget = (SUBSET_SHARE * cluster_bytes.iter().sum::<u64>() as f64) as u64;
    let mut order: Vec<usize> = (0..exact.len()).collect();
    order.sort_by(|&a, &b| exact[a].total_cmp(&exact[b]));
    let (mut used, mut read) = (0u64, vec![1.0f32; exact.len()]);
    for c in order {
        let cost = per_neuron * cluster_bytes[c] / inp.bundle_bytes as u64;
        if exact[c] >= 1.0 || used + cost > budget {
            break;
        }
        used += cost;
        read[c] = exact[c];
    }
    Ok((used, read))
}

/// The fraction of `rows` on which each cluster holds a neuron the rule keeps.
fn needed(inp: &LayerInput, rows: &[usize], clusters: usize) -> Vec<f32> {
    let n = inp.perm.len();
    (0..clusters)
        .map(|c| {
            let ps = c * inp.cluster_size..((c + 1) * inp.cluster_size).min(n);
            let k = rows
                .iter()
                .filter(|&&r| ps.clone().any(|p| inp.mask[r * n + inp.perm[p] as usize]))
                .count();
            k as f32 / rows.len().max(1) as f32
        })
        .collect()
}

/// A design's decoded rows (`n × h`), error bounds (`n × 1` or `n × h/32`) and resident bytes.
fn approximate(
    design: Design,
    gates: &Array2<f32>,
    inp: &LayerInput,
) -> Result<(Array2<f32>, Array2<f32>, u64)> {
    let (n, h) = gates.dim();
    let blocks = h / BLOCK;
    let mut approx = Array2::<f32>::zeros((n, h));
    let per_block = !matches!(design, Design::Sketch(_) | Design::Centroid | Design::Exact);
    let mut err = Array2::<f32>::zeros((n, if per_block { blocks } else { 1 }));
    let bytes = match design {
        Design::Exact => {
            approx.assign(gates);
            // The rows and each one's norm (the runtime's rounding slack).
            (n * (row_bytes(inp.bundle, h)? + 4)) as u64
        }
        Design::Sketch(_) | Design::Q4Blocks => {
            let q = match design {
                Design::Sketch(q) => q,
                _ => QuantType::Q4_0,
            };
            for p in 0..n {
                let g = gates.row(p);
                let a = approx.row_mut(p).into_slice().expect("contiguous");
                dequantize_row(q, &quantize_row(q, g.as_slice().expect("contiguous"))?, a)?;
            }
            // The runtime keeps each row's error bound and norm (f32 each) beside it.
            let extra = if per_block { 2 * blocks + 4 } else { 8 };
            (n * (row_bytes(q, h)? + extra)) as u64
        }
        Design::Ternary | Design::Sign => {
            for p in 0..n {
                for b in 0..blocks {
                    let w: Vec<f32> = gates
                        .row(p)
                        .iter()
                        .skip(b * BLOCK)
                        .take(BLOCK)
                        .copied()
                        .collect();
                    let a = if design == Design::Sign {
                        sign_code(&w)
                    } else {
                        ternary_code(&w)
                    };
                    for (j, v) in a.into_iter().enumerate() {
                        approx[[p, b * BLOCK + j]] = v;
                    }
                }
            }
            // Codes (2 or 1 bits a value), an f16 scale and an f16 bound per block, a row norm.
            let code = if design == Design::Sign { 4 } else { 8 };
            (n * (blocks * (code + 4) + 4)) as u64
        }
        Design::Centroid => {
            let clusters = n.div_ceil(inp.cluster_size);
            for c in 0..clusters {
                let ps = c * inp.cluster_size..((c + 1) * inp.cluster_size).min(n);
                let mut mean = vec![0.0f32; h];
                for p in ps.clone() {
                    for (m, v) in mean.iter_mut().zip(gates.row(p)) {
                        *m += v / ps.len() as f32;
                    }
                }
                let mut centroid = vec![0.0f32; h];
                dequantize_row(
                    QuantType::Q8_0,
                    &quantize_row(QuantType::Q8_0, &mean)?,
                    &mut centroid,
                )?;
                for p in ps {
                    approx
                        .row_mut(p)
                        .assign(&ndarray::ArrayView1::from(&centroid));
                }
            }
            (clusters * (row_bytes(QuantType::Q8_0, h)? + 4)) as u64
        }
        Design::ExactColdest | Design::Written | Design::None | Design::Needed => {
            unreachable!("no rows of its own")
        }
    };
    if design != Design::Exact {
        for p in 0..n {
            let width = h / err.ncols();
            let row_errs: Vec<f32> = (0..err.ncols())
                .map(|b| {
                    let s: f64 = (b * width..(b + 1) * width)
                        .map(|j| ((gates[[p, j]] - approx[[p, j]]) as f64).powi(2))
                        .sum();
                    (s.sqrt() * (1.0 + 1e-6)) as f32
                })
                .collect();
            err.row_mut(p).assign(&ndarray::ArrayView1::from(&row_errs));
        }
        if design == Design::Centroid {
            // One radius per cluster: the largest distance of its rows from the centroid.
            for c in 0..n.div_ceil(inp.cluster_size) {
                let ps = c * inp.cluster_size..((c + 1) * inp.cluster_size).min(n);
                let r = ps.clone().map(|p| err[[p, 0]]).fold(0.0f32, f32::max);
                for p in ps {
                    err[[p, 0]] = r;
                }
            }
        }
    }
    Ok((approx, err, bytes))
}

/// `sign(w)·mean|w|`: the L2-best one-bit code with one scale.
fn sign_code(w: &[f32]) -> Vec<f32> {
    let d = w.iter().map(|v| v.abs()).sum::<f32>() / w.len() as f32;
    w.iter().map(|&v| if v < 0.0 { -d } else { d }).collect()
}

/// `d·t`, `t ∈ {−1, 0, 1}`, at the scale of a small grid that gives the least squared error.
fn ternary_code(w: &[f32]) -> Vec<f32> {
    let amax = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let code = |d: f32| -> Vec<f32> {
        w.iter()
            .map(|&v| {
                if d > 0.0 && v.abs() >= 0.5 * d {
                    d.copysign(v)
                } else {
                    0.0
                }
            })
            .collect()
    };
    (1..=10)
        .map(|i| code(amax * i as f32 / 10.0))
        .min_by(|a, b| {
            let sse = |c: &Vec<f32>| c.iter().zip(w).map(|(x, y)| (x - y).powi(2)).sum::<f32>();
            sse(a).total_cmp(&sse(b))
        })
        .expect("ten scales")
}

/// The model's totals: every design's bytes and reads, with nothing cached and at the minimum +
/// 25 % of the FFN.
pub fn summarise(layers: &[LayerStudy], bundle: QuantType) -> Study {
    let ffn: u64 = layers.iter().flat_map(|l| &l.cluster_bytes).sum();
    let designs = Design::ALL
        .iter()
        .enumerate()
        .map(|(d, design)| {
            let bytes: u64 = layers.iter().map(|l| l.bytes[d]).sum();
            let mut reads: Vec<(f64, u64)> = layers
                .iter()
                .flat_map(|l| {
                    l.read[d]
                        .iter()
                        .zip(&l.cluster_bytes)
                        .map(|(&r, &b)| (r as f64, b))
                })
                .collect();
            let read: f64 = reads.iter().map(|&(r, b)| r * b as f64).sum();
            let at_25 = (bytes <= ffn / 4).then(|| {
                // The cache keeps the clusters read most often (an ideal static cache).
                reads.sort_by(|a, b| b.0.total_cmp(&a.0));
                let mut room = ffn / 4 - bytes;
                let mut left = read;
                for &(r, b) in &reads {
                    if b > room {
                        break;
                    }
                    room -= b;
                    left -= r * b as f64;
                }
                left.max(0.0)
            });
            DesignScore {
                design: design.name(bundle),
                resident_bytes: bytes,
                share_of_ffn: bytes as f64 / ffn.max(1) as f64,
                saves: 1.0 - read / ffn.max(1) as f64,
                read_per_token: read,
                read_per_token_at_25: at_25,
            }
        })
        .collect();
    Study {
        ffn_bytes: ffn,
        rows_per_layer: STUDY_ROWS,
        designs,
    }
}

/// Prints the study as the converter's text summary does.
pub fn print(study: &Study) {
    let mib = |b: f64| b / (1u64 << 20) as f64;
    println!(
        "certificate designs (held-out rows; FFN {:.2} MiB; read = FFN MiB per token):",
        mib(study.ffn_bytes as f64)
    );
    println!("  resident MiB  share  saves  read (none cached)  read at +25 %  design");
    for d in &study.designs {
        let at = d
            .read_per_token_at_25
            .map_or("does not fit".to_string(), |r| format!("{:.3}", mib(r)));
        println!(
            "  {:>12.3}  {:>5.3}  {:>5.3}  {:>18.3}  {:>13}  {}",
            mib(d.resident_bytes as f64),
            d.share_of_ffn,
            d.saves,
            mib(d.read_per_token),
            at,
            d.design
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use leanstream::source::config::Activation;

    /// ReLU, two clusters of two neurons, x = ones: cluster 0's gates point away from x (silent),
    /// cluster 1's along it. Every design that is tight enough proves cluster 0 silent and never
    /// cluster 1; `none` reads both; the oracle reads cluster 1 only.
    #[test]
    fn designs_prove_only_silent_clusters() {
        let h = 64;
        let rows_f32: Vec<Vec<f32>> = [-1.0f32, -0.5, 1.0, 0.5]
            .iter()
            .map(|&s| (0..h).map(|j| s * (1.0 + (j % 3) as f32 * 0.1)).collect())
            .collect();
        let gates: Vec<Vec<u8>> = rows_f32
            .iter()
            .map(|r| quantize_row(QuantType::Q8_0, r).unwrap())
            .collect();
        let x = vec![1.0f32; h];
        let mask = vec![false, false, true, true];
        let perm = [0u32, 1, 2, 3];
        let inp = LayerInput {
            gates: &gates,
            bundle: QuantType::Q8_0,
            hidden: h,
            skip: Skip {
                act: Activation::Relu,
                rule: SkipRule::Gate,
                threshold: 0.0,
            },
            x: &x,
            rows: &[0],
            mask: &mask,
            perm: &perm,
            cluster_size: 2,
            bundle_bytes: 3 * row_bytes(QuantType::Q8_0, h).unwrap(),
            written: Some(QuantType::Q8_0),
        };
        let l = layer(&inp).unwrap();
        for (d, design) in Design::ALL.iter().enumerate() {
            let r = &l.read[d];
            assert_eq!(r[1], 1.0, "{design:?} never proves the active cluster");
            // The exact gates of cluster 0 (2 × 72 bytes) exceed 10 % of the layer's 4 bundles.
            let expected = if matches!(design, Design::None | Design::ExactColdest) {
                1.0
            } else {
                0.0
            };
            assert!(
                *design != Design::Written || l.bytes[d] == l.bytes[6],
                "written = exact"
            );
            assert_eq!(r[0], expected, "{design:?} on the silent cluster");
        }
        let gate_up = layer(&LayerInput {
            skip: Skip {
                rule: SkipRule::GateUp,
                ..inp.skip
            },
            ..inp
        })
        .unwrap();
        for (d, design) in Design::ALL.iter().enumerate() {
            let expected = if *design == Design::Needed { 0.0 } else { 1.0 };
            assert_eq!(gate_up.read[d][0], expected, "{design:?} under gate_up");
        }
        let s = summarise(&[l], QuantType::Q8_0);
        let by = |name: &str| {
            s.designs
                .iter()
                .find(|d| d.design.starts_with(name))
                .unwrap()
        };
        assert_eq!(by("none").saves, 0.0);
        assert_eq!(by("needed").saves, 0.5);
        assert_eq!(by("q8_0 sketch").resident_bytes, 4 * (68 + 8));
        assert_eq!(by("1-bit").resident_bytes, 4 * (2 * 8 + 4));
        assert_eq!(by("cluster").resident_bytes, 2 * (68 + 4));
    }

    /// The exact gates of the clusters proven silent most often, while they fit in 10 % of the
    /// layer's bundle bytes: 4 clusters of 2 neurons, a bundle 400 bytes, a gate row and its norm
    /// 72, so 320 bytes hold two clusters' gates (288).
    #[test]
    fn the_coldest_clusters_get_the_exact_gates_that_fit() {
        let inp = LayerInput {
            gates: &[],
            bundle: QuantType::Q8_0,
            hidden: 64,
            skip: Skip {
                act: Activation::Relu,
                rule: SkipRule::Gate,
                threshold: 0.0,
            },
            x: &[],
            rows: &[],
            mask: &[],
            perm: &[],
            cluster_size: 2,
            bundle_bytes: 400,
            written: None,
        };
        let (bytes, read) = coldest(&[0.2, 0.9, 0.0, 1.0], &[800; 4], &inp).unwrap();
        assert_eq!(bytes, 2 * 2 * 72);
        assert_eq!(read, [0.2, 1.0, 0.0, 1.0]);
        // A cluster never proven silent is not worth a byte.
        let (bytes, read) = coldest(&[1.0, 1.0, 0.5, 1.0], &[800; 4], &inp).unwrap();
        assert_eq!((bytes, read), (2 * 72, vec![1.0, 1.0, 0.5, 1.0]));
    }

    #[test]
    fn low_bit_codes_fit_their_block() {
        let w: Vec<f32> = (0..32).map(|i| (i as f32 - 15.5) / 10.0).collect();
        let s = sign_code(&w);
        assert!(s.iter().zip(&w).all(|(a, b)| a.signum() == b.signum()));
        let t = ternary_code(&w);
        let sse = |c: &[f32]| c.iter().zip(&w).map(|(x, y)| (x - y).powi(2)).sum::<f32>();
        assert!(sse(&t) < sse(&s), "ternary {} sign {}", sse(&t), sse(&s));
        assert!(sse(&t) < sse(&[0.0; 32]));
    }
}
