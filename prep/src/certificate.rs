//! Whether the converter writes a certificate (the SKETCH section's gate rows, FORMAT.md §8), and
//! what one is worth: the fraction of a layer's cluster reads it avoids when nothing is cached,
//! recorded per layer in META (`certificate_saves`) so the runtime's planner keeps it resident only
//! where it saves more reads than its bytes would buy as neuron cache.

use anyhow::{bail, Result};
use leanstream::certify::SkipSet;
use leanstream::skip_rule::{Skip, SkipRule};
use leanstream_format::quant::dequantize_row;
use leanstream_format::sketch::SketchLayer;

/// Rows of the held-out profile the saving is measured on.
const SAVES_ROWS: usize = 256;

/// `--certificate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertificateChoice {
    /// A Q8_0 gate sketch where the rule is one it can prove (`gate`), none under `gate_up`.
    Auto,
    Q8,
    None,
}

impl CertificateChoice {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "q8" => Ok(Self::Q8),
            "none" => Ok(Self::None),
            _ => bail!("--certificate must be auto, q8 or none, got {s:?}"),
        }
    }

    /// Whether to write the gate sketch for a file whose skip rule is `rule`.
    pub fn wanted(self, rule: SkipRule) -> Result<bool> {
        match (self, rule) {
            (Self::None, _) => Ok(false),
            (Self::Auto, r) => Ok(r == SkipRule::Gate),
            (Self::Q8, SkipRule::Gate) => Ok(true),
            (Self::Q8, SkipRule::GateUp) => bail!(
                "--certificate q8 cannot prove the gate_up rule of --sparsity target:F (a neuron's \
                 |act(g)·u| needs u, which a gate sketch does not bound): use --certificate none, \
                 or --sparsity threshold:F"
            ),
        }
    }
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
    use leanstream::config::Activation;
    use leanstream_format::quant::{quantize_row, QuantType};

    #[test]
    fn choices_follow_the_rule() {
        let c = |s| CertificateChoice::parse(s).unwrap();
        assert!(c("auto").wanted(SkipRule::Gate).unwrap());
        assert!(!c("auto").wanted(SkipRule::GateUp).unwrap());
        assert!(!c("none").wanted(SkipRule::Gate).unwrap());
        assert!(c("q8").wanted(SkipRule::Gate).unwrap());
        assert!(c("q8").wanted(SkipRule::GateUp).is_err());
        assert!(CertificateChoice::parse("q2").is_err());
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
