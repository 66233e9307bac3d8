//! Whether the converter writes a certificate (the SKETCH section's gate rows, FORMAT.md §8), in
//! which encoding, and what one is worth: the fraction of a layer's cluster reads it avoids when
//! nothing is cached, recorded per layer in META (`certificate_saves`) so the runtime's planner
//! keeps it resident only where it saves more reads than its bytes would buy as neuron cache.
//!
//! `auto` judges each layer's certificate in bytes: of the sketch encodings that can prove the
//! rule (the bundle's own encoding, which is the exact gates; Q8_0; Q4_0), it writes the one whose
//! saved reads minus its bytes are largest with a quarter of the FFN cached, and none where even
//! with nothing cached it saves fewer bytes per token than it holds.

use anyhow::{bail, Result};
use leanstream::streaming::certify::SkipSet;
use leanstream::streaming::skip_rule::{Skip, SkipRule};
use leanstream_format::quant::{dequantize_row, quantize_row, QuantType};
use leanstream_format::sketch::SketchLayer;

/// Rows of the held-out profile the saving is measured on.
const SAVES_ROWS: usize = 256;
/// The neuron cache's share of the FFN at which `auto` ranks encodings (the "+25 % of the FFN"
/// budget the issue judges at); the runtime's planner decides again at its own share.
const RANK_CACHE_SHARE: f64 = 0.25;

/// `--certificate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertificateChoice {
    /// Per layer, the encoding that earns most (see the module header), or none; none under
    /// `gate_up`.
    Auto,
    Q8,
    Q4,
    None,
}

impl CertificateChoice {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "q8" => Ok(Self::Q8),
            "q4" => Ok(Self::Q4),
            "none" => Ok(Self::None),
            _ => bail!("--certificate must be auto, q8, q4 or none, got {s:?}"),
        }
    }

    /// The sketch encodings to weigh for bundles encoded as `bundle` (one for an explicit choice,
    /// which is written whatever it saves).
    pub fn encodings(self, bundle: QuantType) -> Vec<QuantType> {
        match self {
            Self::None => Vec::new(),
            Self::Q8 => vec![QuantType::Q8_0],
            Self::Q4 => vec![QuantType::Q4_0],
            Self::Auto => {
                // The bundle's own block encoding is the exact gates (no error); a float one
                // would cost more than the bundles' gate rows, so it is not a candidate.
                let mut v = Vec::new();
                if matches!(bundle, QuantType::Q4_0 | QuantType::Q4_1) {
                    v.push(bundle);
                }
                for q in [QuantType::Q8_0, QuantType::Q4_0] {
                    if !v.contains(&q) {
                        v.push(q);
                    }
                }
                v
            }
        }
    }

    /// Whether to write the gate sketch for a file whose skip rule is `rule`.
    pub fn wanted(self, rule: SkipRule) -> Result<bool> {
        match (self, rule) {
            (Self::None, _) => Ok(false),
            (Self::Auto, r) => Ok(r == SkipRule::Gate),
            (Self::Q8 | Self::Q4, SkipRule::Gate) => Ok(true),
            (Self::Q8 | Self::Q4, SkipRule::GateUp) => bail!(
                "--certificate q8/q4 cannot prove the gate_up rule of --sparsity target:F (a neuron's \
                 |act(g)·u| needs u, which a gate sketch does not bound): use --certificate none, \
                 or --sparsity threshold:F"
            ),
        }
    }
}

/// One layer's certificate as the converter writes it: of `encodings`, the sketch of the bundle
/// gate rows `gates` (stored order, each `h` values encoded as `bundle`) that earns most against its bytes
/// with a quarter of the layer's `ffn_bytes` cached, and what it saves (`certificate_saves`). With
/// several encodings (`auto`) a layer whose best saves fewer bytes than it holds even with nothing
/// cached gets no certificate (no rows, saves `None`); a single encoding is written as asked.
#[allow(clippy::too_many_arguments)]
pub fn build(
    gates: &[Vec<u8>],
    bundle: QuantType,
    h: usize,
    encodings: &[QuantType],
    skip: Skip,
    x: &[f32],
    rows: &[usize],
    cluster_size: usize,
    ffn_bytes: u64,
) -> Result<(SketchLayer, Option<f32>)> {
    let empty = |qtype| SketchLayer {
        qtype,
        hidden: h as u32,
        rows: Vec::new(),
        err_norm: Vec::new(),
    };
    let mut best: Option<(f64, SketchLayer, f32)> = None;
    for &q in encodings {
        let mut layer = empty(q);
        for g in gates {
            add_sketch_row(&mut layer, q, bundle, g, h)?;
        }
        let s = saves(&layer, skip, x, rows, cluster_size)?;
        let bytes = (layer.rows.len() + 8 * layer.err_norm.len()) as f64;
        let value = s as f64 * ffn_bytes as f64 * (1.0 - RANK_CACHE_SHARE) - bytes;
        let earns = s as f64 * ffn_bytes as f64 > bytes;
        if (encodings.len() == 1 || earns) && best.as_ref().is_none_or(|b| value > b.0) {
            best = Some((value, layer, s));
        }
    }
    Ok(match best {
        Some((_, layer, s)) => (layer, Some(s)),
        None => (empty(QuantType::Q8_0), None),
    })
}

/// Appends the sketch of one bundle gate row: its `sketch_q` copy and the error norm against the
/// row as the bundle (`bundle_q`) stores it.
pub(crate) fn add_sketch_row(
    s: &mut SketchLayer,
    sketch_q: QuantType,
    bundle_q: QuantType,
    gate_bytes: &[u8],
    h: usize,
) -> Result<()> {
    let mut exact = vec![0.0f32; h];
    dequantize_row(bundle_q, gate_bytes, &mut exact)?;
    let sk = quantize_row(sketch_q, &exact)?;
    let mut approx = vec![0.0f32; h];
    dequantize_row(sketch_q, &sk, &mut approx)?;
    let err = exact
        .iter()
        .zip(&approx)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    s.rows.extend(sk);
    // Round up so the bound stays a bound after the f32 conversion.
    s.err_norm
        .push((err * (1.0 + 1e-6)) as f32 + f32::MIN_POSITIVE);
    Ok(())
}

/// Mean fraction, over held-out `rows` of the FFN input `x` (`rows × hidden`), of the layer's
/// clusters (runs of `cluster_size` stored positions) in which the sketch proves every neuron
/// inactive — the reads it saves when nothing is cached.
pub fn saves(
    layer: &SketchLayer,
    skip: Skip,
    x: &[f32],
    rows: &[usize],
    cluster_size: usize,
) -> Result<f32> {
    let h = layer.hidden as usize;
    let n = layer.err_norm.len();
    let mut sketch = vec![0.0f32; n * h];
    for (p, row) in sketch.chunks_exact_mut(h).enumerate() {
        dequantize_row(layer.qtype, layer.row(p), row)?;
    }
    let set = SkipSet::new(skip.act, skip.threshold);
    let clusters = n.div_ceil(cluster_size);
    let sample = rows.len().div_ceil(SAVES_ROWS).max(1);
    let (mut saved, mut counted) = (0usize, 0usize);
    for &r in rows.iter().step_by(sample) {
        let xr = &x[r * h..(r + 1) * h];
        let norm = xr.iter().map(|v| v * v).sum::<f32>().sqrt();
        let provable = |p: usize| {
            let g: f32 = sketch[p * h..(p + 1) * h]
                .iter()
                .zip(xr)
                .map(|(a, b)| a * b)
                .sum();
            let beta = layer.err_norm[p] * norm * 1.001;
            set.contains(g - beta, g + beta)
        };
        saved += (0..clusters)
            .filter(|&c| (c * cluster_size..((c + 1) * cluster_size).min(n)).all(provable))
            .count();
        counted += clusters;
    }
    Ok(saved as f32 / counted.max(1) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use leanstream::source::config::Activation;

    #[test]
    fn choices_follow_the_rule() {
        let c = |s| CertificateChoice::parse(s).unwrap();
        assert!(c("auto").wanted(SkipRule::Gate).unwrap());
        assert!(!c("auto").wanted(SkipRule::GateUp).unwrap());
        assert!(!c("none").wanted(SkipRule::Gate).unwrap());
        assert!(c("q8").wanted(SkipRule::Gate).unwrap());
        assert!(c("q8").wanted(SkipRule::GateUp).is_err());
        assert!(c("q4").wanted(SkipRule::Gate).unwrap());
        assert!(c("q4").wanted(SkipRule::GateUp).is_err());
        assert!(CertificateChoice::parse("q2").is_err());
        use QuantType::*;
        assert_eq!(c("auto").encodings(Q8_0), vec![Q8_0, Q4_0]);
        assert_eq!(c("auto").encodings(Q4_0), vec![Q4_0, Q8_0]);
        assert_eq!(c("auto").encodings(Q4_1), vec![Q4_1, Q8_0, Q4_0]);
        assert_eq!(c("auto").encodings(F32), vec![Q8_0, Q4_0]);
        assert_eq!(c("q4").encodings(Q8_0), vec![Q4_0]);
        assert!(c("none").encodings(Q8_0).is_empty());
    }

    /// Two clusters of two neurons, cluster 0 silent: both encodings prove it, so `auto` takes the
    /// cheaper Q4_0 when the reads are worth its bytes and nothing when they are not; an explicit
    /// encoding is written either way.
    #[test]
    fn auto_writes_the_encoding_that_earns_most_or_none() {
        let h = 32;
        let x = vec![1.0f32; h];
        let gates: Vec<Vec<u8>> = [-1.0f32, -0.5, 1.0, 0.5]
            .iter()
            .map(|&s| {
                let row: Vec<f32> = (0..h).map(|j| s * (1.0 + (j % 3) as f32 * 0.1)).collect();
                quantize_row(QuantType::Q8_0, &row).unwrap()
            })
            .collect();
        let skip = Skip {
            act: Activation::Relu,
            rule: SkipRule::Gate,
            threshold: 0.0,
        };
        let both = [QuantType::Q8_0, QuantType::Q4_0];
        let build = |encodings: &[QuantType], ffn| {
            build(
                &gates,
                QuantType::Q8_0,
                h,
                encodings,
                skip,
                &x,
                &[0],
                2,
                ffn,
            )
            .unwrap()
        };
        let (layer, saves) = build(&both, 1 << 20);
        assert_eq!((layer.qtype, saves), (QuantType::Q4_0, Some(0.5)));
        assert_eq!(layer.err_norm.len(), 4);
        // 4 rows × (18 + 8) bytes = 104: saving half of 200 bytes a token does not earn them.
        let (layer, saves) = build(&both, 200);
        assert!(layer.err_norm.is_empty() && layer.rows.is_empty());
        assert_eq!(saves, None);
        let (layer, saves) = build(&[QuantType::Q8_0], 200);
        assert_eq!((layer.qtype, saves), (QuantType::Q8_0, Some(0.5)));
    }

    #[test]
    fn a_relu_sketch_saves_the_clusters_it_proves_silent() {
        let h = 32;
        // Neurons 0-1 (cluster 0) have gate rows opposite to x; neurons 2-3 along it.
        let x = vec![1.0f32; h];
        let mut layer = SketchLayer {
            qtype: QuantType::Q8_0,
            hidden: h as u32,
            rows: Vec::new(),
            err_norm: Vec::new(),
        };
        for sign in [-1.0f32, -1.0, 1.0, 1.0] {
            layer
                .rows
                .extend(quantize_row(QuantType::Q8_0, &vec![sign; h]).unwrap());
            layer.err_norm.push(0.01);
        }
        let skip = Skip {
            act: Activation::Relu,
            rule: SkipRule::Gate,
            threshold: 0.0,
        };
        let s = saves(&layer, skip, &x, &[0], 2).unwrap();
        assert_eq!(s, 0.5);
    }
}
