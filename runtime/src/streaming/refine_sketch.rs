//! Refine sparsity (`--sparsity refine`): a resident one-bit sketch of each layer's gate rows
//! scores every neuron of a token's layer before any bundle is read, and only the neurons with
//! the highest scores — a fixed share of the layer, `keep` — are candidates: their clusters are
//! read (a cluster none of whose neurons is kept is not) and the bundle kernel computes them; the
//! others are skipped, gate, up and down rows alike. Nothing proves a skipped neuron inactive:
//! this trades quality for reads (measured with `leanstream perplexity`).
//!
//! A neuron's contribution is `act(g)·u·d`; the score estimates `|act(g)·u|` as `|act(ĝ)·û|`,
//! `ĝ` and `û` the one-bit sketches' gate and up values ([`SignSketch`]: the signs of the rows
//! after a fixed rotation, which the input gets too). The choice depends only on the layer's input
//! and the file, so every policy — `resident` included — computes the same neurons, and streaming
//! output in this mode equals `resident`'s in this mode bit for bit. The layer's skip rule then
//! applies to the neurons kept, as in every mode.
//!
//! The sketch is built when the model opens, from one pass over the FFN bundles (what the resident
//! sketch costs is counted in the memory plan): one bit per gate and up value, 2/13.5 (15 %) of a
//! q4_0 FFN's bytes, 2/25.5 (7.8 %) of a q8_0 one's.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use leanstream_format::model_config::Activation;
use leanstream_format::quant::dequantize_row;

use crate::kernels::bundles::{ClusterRows, NeuronRows};
use crate::kernels::sketch::{SignSketch, SketchInput};

use super::plan::LayerPlan;

/// One layer's refine sketch.
pub struct RefineSketch {
    gate: SignSketch,
    up: SignSketch,
    act: Activation,
}

/// A token's scratch for scoring (kept between layers and tokens: the token loop does not
/// allocate it).
#[derive(Default)]
pub struct RefineScratch {
    input: SketchInput,
    scores: Vec<f32>,
    order: Vec<u32>,
}

impl RefineSketch {
    /// Builds layer `plan`'s sketch from its bundles in the file at `path`.
    pub fn build(path: &Path, plan: &LayerPlan) -> Result<Self> {
        let file = File::open(path).with_context(|| {
            format!("{}: cannot open to build the refine sketch", path.display())
        })?;
        let layout = &plan.layout;
        let h = layout.hidden;
        let n = plan.cluster_of.len();
        let (gq, uq) = (layout.qtypes.gate, layout.qtypes.up);
        let mut gate = SignSketch::zeros(n, h);
        let mut row = vec![0.0f32; h];
        let mut up_sketch = SignSketch::zeros(n, h);
        let mut buf = Vec::new();
        let mut up = vec![0.0f32; h];
        let mut scratch = SketchInput::default();
        for cl in &plan.clusters {
            buf.resize(cl.size as usize, 0);
            file.read_exact_at(&mut buf, cl.offset).with_context(|| {
                format!(
                    "{}: cannot read the cluster at offset {} for the refine sketch",
                    path.display(),
                    cl.offset
                )
            })?;
            let rows = ClusterRows::new(layout, &buf, cl.count)?;
            for i in 0..cl.count {
                let p = cl.first + i;
                dequantize_row(gq, rows.gate(i), &mut row)
                    .with_context(|| format!("{}: gate row {p}", path.display()))?;
                gate.set_row_with(p, &row, &mut scratch);
                dequantize_row(uq, rows.up(i), &mut up)
                    .with_context(|| format!("{}: up row {p}", path.display()))?;
                up_sketch.set_row_with(p, &up, &mut scratch);
            }
        }
        ensure!(n > 0, "{}: a layer without FFN neurons", path.display());
        Ok(Self {
            gate,
            up: up_sketch,
            act: plan.skip.act,
        })
    }

    /// Resident bytes.
    pub fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes()
    }

    /// How many of `n` neurons a keep share of `keep` computes: at least one.
    pub fn kept(n: usize, keep: f32) -> usize {
        // The share is an f32 (0.3 is 0.300000012): a hair below whole counts as whole.
        ((keep as f64 * n as f64 - 1e-4).ceil() as usize).clamp(1, n)
    }

    /// Marks in `candidate` (cleared) the `kept(n, keep)` neurons with the highest scores for the
    /// layer input `x`, ties to the lower stored position.
    pub fn candidates(
        &self,
        x: &[f32],
        keep: f32,
        scratch: &mut RefineScratch,
        candidate: &mut Vec<bool>,
    ) {
        let n = self.gate.rows();
        self.gate.prepare(x, &mut scratch.input);
        let scores = &mut scratch.scores;
        scores.clear();
        scores.extend((0..n).map(|p| {
            let g = self.gate.dot(p, &scratch.input);
            let u = self.up.dot(p, &scratch.input);
            self.act.coef(self.act.apply(g), u).abs()
        }));
        let order = &mut scratch.order;
        order.clear();
        order.extend(0..n as u32);
        let k = Self::kept(n, keep);
        candidate.clear();
        candidate.resize(n, false);
        if k < n {
            let by = |a: &u32, b: &u32| {
                let (sa, sb) = (scores[*a as usize], scores[*b as usize]);
                sb.total_cmp(&sa).then(a.cmp(b))
            };
            order.select_nth_unstable_by(k - 1, by);
        }
        for &p in &order[..k] {
            candidate[p as usize] = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_counts() {
        assert_eq!(RefineSketch::kept(10, 0.5), 5);
        assert_eq!(RefineSketch::kept(10, 0.31), 4);
        assert_eq!(RefineSketch::kept(10, 0.0), 1);
        assert_eq!(RefineSketch::kept(10, 1.0), 10);
    }

    #[test]
    fn candidates_are_the_top_scores() {
        let (n, h) = (40, 16);
        let w: Vec<f32> = (0..n * h)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 11.0 * (1 + i / h) as f32)
            .collect();
        let sketch = RefineSketch {
            gate: SignSketch::new(n, h, |p, o| o.copy_from_slice(&w[p * h..(p + 1) * h])),
            up: SignSketch::new(n, h, |p, o| o.copy_from_slice(&w[((p + 3) % n) * h..][..h])),
            act: Activation::Silu,
        };
        let x: Vec<f32> = (0..h).map(|i| (i as f32 - 7.5) / 4.0).collect();
        let mut scratch = RefineScratch::default();
        let mut cand = Vec::new();
        sketch.candidates(&x, 0.3, &mut scratch, &mut cand);
        assert_eq!(cand.iter().filter(|&&c| c).count(), 12);
        let scores = scratch.scores.clone();
        let min_kept = (0..n)
            .filter(|&p| cand[p])
            .map(|p| scores[p])
            .fold(f32::INFINITY, f32::min);
        let max_skipped = (0..n)
            .filter(|&p| !cand[p])
            .map(|p| scores[p])
            .fold(0.0f32, f32::max);
        assert!(min_kept >= max_skipped, "{min_kept} < {max_skipped}");
        // The same input gives the same choice.
        let mut again = Vec::new();
        sketch.candidates(&x, 0.3, &mut scratch, &mut again);
        assert_eq!(cand, again);
    }
}
