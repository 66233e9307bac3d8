//! Refine sparsity (`--sparsity refine`): a resident one-bit sketch of each layer's gate rows
//! scores every neuron of a token's layer before any bundle is read, and only the neurons with
//! the highest scores — a fixed share of the layer, `keep` — are candidates: their clusters are
//! read (a cluster none of whose neurons is kept is not) and the bundle kernel computes them; the
//! others are skipped, gate, up and down rows alike. Nothing proves a skipped neuron inactive:
//! this trades quality for reads (measured with `leanstream perplexity`).
//!
//! A neuron's contribution is `act(g)·u·d`; the score estimates `|act(g)·u|` as `|act(ĝ)·û|`.
//! Where the file has the layer's input directions (INPUT_BASIS, FORMAT.md §9.1: the few
//! directions that hold most of the calibration inputs' energy), the input's part in them is
//! scored exactly, from each row's coordinates in them (int8, one scale per row), and only the
//! rest by the sketch: `ĝ = a·z + sketch(w − Dᵀa)·(x − Dᵀz)`, `z = D·x`, `a = D·w`. Otherwise `ĝ`
//! is the sketch's alone. The sketch ([`SignSketch`]) keeps the signs of the rows after a fixed
//! rotation, which the input gets too. The choice depends only on the layer's input and the file,
//! so every policy — `resident` included — computes the same neurons, and streaming output in
//! this mode equals `resident`'s in this mode bit for bit. The layer's skip rule then applies to
//! the neurons kept, as in every mode.
//!
//! The sketch is built when the model opens, from one pass over the FFN bundles (what it costs
//! resident is counted in the memory plan): one bit per gate and up value, 2/13.5 (15 %) of a
//! q4_0 FFN's bytes, 2/25.5 (7.8 %) of a q8_0 one's, plus with directions two bytes per neuron
//! and direction and the directions (SmolLM2: 32 directions, 9 % of its bundles' bytes; a 7B shape
//! in q4_0: 64, 3.3 %).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use leanstream_format::input_basis::BasisLayer;
use leanstream_format::model_config::Activation;
use leanstream_format::quant::dequantize_row;

use crate::kernels::bundles::{ClusterRows, NeuronRows};
use crate::kernels::dot;
use crate::kernels::sketch::{quantize_i8, SignSketch, SketchInput};

use super::plan::LayerPlan;

/// One layer's refine sketch.
pub struct RefineSketch {
    gate: SignSketch,
    up: SignSketch,
    act: Activation,
    /// The layer's input directions, where the file has them.
    exact: Option<ExactPart>,
}

/// The part of the score taken exactly: the input's coordinates in the layer's directions
/// against each row's.
struct ExactPart {
    rank: usize,
    /// `rank × hidden`, direction `k` at `k·hidden`.
    directions: Vec<f32>,
    /// Each neuron's gate row's coordinates (`n × rank`, int8) and their scale.
    gate: Coordinates,
    up: Coordinates,
}

/// Rows' coordinates in the directions, int8 with one scale per row (`a ≈ scale·q`).
struct Coordinates {
    q: Vec<i8>,
    scale: Vec<f32>,
}

impl Coordinates {
    fn new(n: usize, rank: usize) -> Self {
        Self {
            q: vec![0; n * rank],
            scale: vec![0.0; n],
        }
    }

    /// Stores row `p`'s coordinates `a`.
    fn set(&mut self, p: usize, a: &[f32]) {
        self.scale[p] = quantize_i8(a, &mut self.q[p * a.len()..(p + 1) * a.len()]);
    }

    /// Row `p`'s coordinates' dot with `z`.
    #[inline]
    fn dot(&self, p: usize, z: &[f32]) -> f32 {
        let q = &self.q[p * z.len()..(p + 1) * z.len()];
        let mut acc = [0.0f32; 4];
        let mut chunks = q.chunks_exact(4).zip(z.chunks_exact(4));
        for (qc, zc) in &mut chunks {
            for k in 0..4 {
                acc[k] += qc[k] as f32 * zc[k];
            }
        }
        let tail = q.len() / 4 * 4;
        for (&qv, &zv) in q[tail..].iter().zip(&z[tail..]) {
            acc[0] += qv as f32 * zv;
        }
        self.scale[p] * ((acc[0] + acc[1]) + (acc[2] + acc[3]))
    }

    fn bytes(&self) -> usize {
        self.q.len() + 4 * self.scale.len()
    }
}

impl ExactPart {
    /// `a = D·w` into `a`, then `w ← w − Dᵀ·a` (the row's part outside the directions). The
    /// coordinates are [`dot`]'s (fused multiply-adds in fixed lanes: the same bits on every
    /// CPU), the subtraction one multiply and one subtraction per value and direction, in order.
    fn split(&self, w: &mut [f32], a: &mut [f32]) {
        let h = w.len();
        for (ak, d) in a.iter_mut().zip(self.directions.chunks_exact(h)) {
            *ak = dot(d, w);
        }
        for (&ak, d) in a.iter().zip(self.directions.chunks_exact(h)) {
            w.iter_mut().zip(d).for_each(|(v, dv)| *v -= ak * dv);
        }
    }

    fn bytes(&self) -> usize {
        4 * self.directions.len() + self.gate.bytes() + self.up.bytes()
    }
}

/// A token's scratch for scoring (kept between layers and tokens: the token loop does not
/// allocate it).
#[derive(Default)]
pub struct RefineScratch {
    input: SketchInput,
    scores: Vec<f32>,
    order: Vec<u32>,
    /// The input's coordinates in the directions, and its part outside them.
    coords: Vec<f32>,
    residual: Vec<f32>,
}

/// Scratch for [`RefineSketch::set_row`].
#[derive(Default)]
struct RowScratch {
    rotation: SketchInput,
    coords: Vec<f32>,
}

impl RefineSketch {
    /// Builds layer `plan`'s sketch from its bundles in the file at `path`, with the layer's input
    /// directions where the file has them.
    pub fn build(path: &Path, plan: &LayerPlan, basis: Option<BasisLayer>) -> Result<Self> {
        let file = File::open(path).with_context(|| {
            format!("{}: cannot open to build the refine sketch", path.display())
        })?;
        let layout = &plan.layout;
        let h = layout.hidden;
        let n = plan.cluster_of.len();
        let (gq, uq) = (layout.qtypes.gate, layout.qtypes.up);
        if let Some(b) = &basis {
            ensure!(
                b.rank() == 0 || b.hidden == h,
                "{}: INPUT_BASIS has directions of width {} for a layer of width {h}; \
                 convert the model again",
                path.display(),
                b.hidden
            );
        }
        ensure!(n > 0, "{}: a layer without FFN neurons", path.display());
        let mut sketch = Self::zeros(n, h, plan.skip.act, basis);
        let (mut gate, mut up, mut buf) = (vec![0.0f32; h], vec![0.0f32; h], Vec::new());
        let mut scratch = RowScratch::default();
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
                dequantize_row(gq, rows.gate(i), &mut gate)
                    .with_context(|| format!("{}: gate row {p}", path.display()))?;
                dequantize_row(uq, rows.up(i), &mut up)
                    .with_context(|| format!("{}: up row {p}", path.display()))?;
                sketch.set_row(p, &mut gate, &mut up, &mut scratch);
            }
        }
        Ok(sketch)
    }

    /// A sketch of `n` zero neurons of width `h`, to fill with [`RefineSketch::set_row`]; with
    /// `basis`'s directions where it has some (of width `h`).
    fn zeros(n: usize, h: usize, act: Activation, basis: Option<BasisLayer>) -> Self {
        let exact = basis.filter(|b| b.rank() > 0).map(|b| {
            assert_eq!(b.hidden, h, "directions' width");
            let rank = b.rank();
            ExactPart {
                rank,
                directions: b.vectors,
                gate: Coordinates::new(n, rank),
                up: Coordinates::new(n, rank),
            }
        });
        Self {
            gate: SignSketch::zeros(n, h),
            up: SignSketch::zeros(n, h),
            act,
            exact,
        }
    }

    /// Sets neuron `p` from its gate and up rows (both overwritten: with directions, by their
    /// parts outside them).
    fn set_row(&mut self, p: usize, gate: &mut [f32], up: &mut [f32], scratch: &mut RowScratch) {
        if let Some(e) = self.exact.as_mut() {
            scratch.coords.resize(e.rank, 0.0);
            e.split(gate, &mut scratch.coords);
            e.gate.set(p, &scratch.coords);
            e.split(up, &mut scratch.coords);
            e.up.set(p, &scratch.coords);
        }
        self.gate.set_row_with(p, gate, &mut scratch.rotation);
        self.up.set_row_with(p, up, &mut scratch.rotation);
    }

    /// Resident bytes.
    pub fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.exact.as_ref().map_or(0, ExactPart::bytes)
    }

    /// How many input directions are scored exactly (0: the sketch alone).
    pub fn exact_rank(&self) -> usize {
        self.exact.as_ref().map_or(0, |e| e.rank)
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
        let scores = &mut scratch.scores;
        scores.clear();
        let (z, input) = (&mut scratch.coords, &mut scratch.input);
        match &self.exact {
            Some(e) => {
                let residual = &mut scratch.residual;
                residual.clear();
                residual.extend_from_slice(x);
                z.resize(e.rank, 0.0);
                e.split(residual, z);
                self.gate.prepare(residual, input);
                scores.extend((0..n).map(|p| {
                    let g = e.gate.dot(p, z) + self.gate.dot(p, input);
                    let u = e.up.dot(p, z) + self.up.dot(p, input);
                    self.act.coef(self.act.apply(g), u).abs()
                }));
            }
            None => {
                self.gate.prepare(x, input);
                scores.extend((0..n).map(|p| {
                    let g = self.gate.dot(p, input);
                    let u = self.up.dot(p, input);
                    self.act.coef(self.act.apply(g), u).abs()
                }));
            }
        }
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
            exact: None,
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

    /// A deterministic value in [-1, 1).
    fn noise(i: usize) -> f32 {
        ((i.wrapping_mul(2654435761) % 10007) as f32 / 10007.0) * 2.0 - 1.0
    }

    fn correlation(a: &[f32], b: &[f32]) -> f32 {
        let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
        let (ma, mb) = (mean(a), mean(b));
        let cov: f32 = a.iter().zip(b).map(|(x, y)| (x - ma) * (y - mb)).sum();
        let var = |v: &[f32], m: f32| v.iter().map(|x| (x - m).powi(2)).sum::<f32>();
        cov / (var(a, ma) * var(b, mb)).sqrt()
    }

    /// With the input's strong directions scored exactly, the scores follow the exact
    /// `|silu(g)·u|` far more closely than the sketch alone; an input that lies wholly in the
    /// directions is scored exactly up to the coordinates' int8 rounding.
    #[test]
    fn directions_score_the_strong_part_of_the_input_exactly() {
        let (n, h, rank) = (300, 64, 4);
        let w = |m: usize, p: usize, i: usize| noise(m * 1_000_003 + p * h + i);
        // Four orthonormal directions: pairs of axes mixed by (0.6, ±0.8).
        let mut vectors = vec![0.0f32; rank * h];
        for k in 0..rank {
            vectors[k * h + 2 * k] = 0.6;
            vectors[k * h + 2 * k + 1] = if k % 2 == 0 { 0.8 } else { -0.8 };
        }
        let basis = BasisLayer {
            hidden: h,
            captured: 0.9,
            vectors: vectors.clone(),
        };
        let build = |basis: Option<BasisLayer>| {
            let mut s = RefineSketch::zeros(n, h, Activation::Silu, basis);
            let mut scratch = RowScratch::default();
            for p in 0..n {
                let mut g: Vec<f32> = (0..h).map(|i| w(0, p, i)).collect();
                let mut u: Vec<f32> = (0..h).map(|i| w(1, p, i)).collect();
                s.set_row(p, &mut g, &mut u, &mut scratch);
            }
            s
        };
        let (plain, with) = (build(None), build(Some(basis)));
        assert_eq!((plain.exact_rank(), with.exact_rank()), (0, rank));
        assert_eq!(
            with.bytes(),
            plain.bytes() + 4 * rank * h + 2 * (n * rank + 4 * n)
        );
        let exact = |x: &[f32]| -> Vec<f32> {
            (0..n)
                .map(|p| {
                    let g: f32 = (0..h).map(|i| w(0, p, i) * x[i]).sum();
                    let u: f32 = (0..h).map(|i| w(1, p, i) * x[i]).sum();
                    Activation::Silu.coef(Activation::Silu.apply(g), u).abs()
                })
                .collect()
        };
        let scores = |s: &RefineSketch, x: &[f32]| {
            let mut scratch = RefineScratch::default();
            s.candidates(x, 0.5, &mut scratch, &mut Vec::new());
            scratch.scores
        };
        // Strong along the directions (as a language model's FFN input is), weak elsewhere.
        let along = [3.0f32, -2.5, 2.0, 1.5];
        let mut x: Vec<f32> = (0..h).map(|i| 0.15 * noise(i + 77)).collect();
        for (k, a) in along.iter().enumerate() {
            x.iter_mut()
                .zip(&vectors[k * h..])
                .for_each(|(v, d)| *v += a * d);
        }
        let want = exact(&x);
        let (c_plain, c_with) = (
            correlation(&scores(&plain, &x), &want),
            correlation(&scores(&with, &x), &want),
        );
        assert!(
            c_with > 0.97 && c_with > c_plain + 0.1,
            "with {c_with}, sketch alone {c_plain}"
        );
        // Wholly in the directions: exact but for rounding.
        let mut x = vec![0.0f32; h];
        for (k, a) in along.iter().enumerate() {
            x.iter_mut()
                .zip(&vectors[k * h..])
                .for_each(|(v, d)| *v += a * d);
        }
        let (got, want) = (scores(&with, &x), exact(&x));
        let top = want.iter().fold(0.0f32, |m, v| m.max(*v));
        for (p, (g, e)) in got.iter().zip(&want).enumerate() {
            assert!((g - e).abs() <= 0.03 * top, "neuron {p}: {g} against {e}");
        }
    }
}
