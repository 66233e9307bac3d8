//! Layer-by-layer profiling: the calibration windows advance through the model one layer at a
//! time, so memory holds the dense weights, the hidden states of the calibration tokens and one
//! layer's FFN activations — never every layer's at once.

use leanstream::kv_cache::KvCache;
use leanstream::model::{FfnProbe, Model};

use crate::calib::Calibration;

/// What one layer's FFN saw on every calibration token (rows = tokens of all windows in order).
pub struct LayerProfile {
    /// The residual stream entering the layer (`rows × hidden`).
    pub residual: Vec<f32>,
    /// The normalised FFN input (`rows × hidden`).
    pub ffn_input: Vec<f32>,
    /// Gate pre-activations (`rows × intermediate`).
    pub gate: Vec<f32>,
}

pub struct Profiler<'a> {
    /// Every weight but the FFNs, which [`Profiler::set_ffn`] installs one layer at a time.
    pub model: Model,
    calib: &'a Calibration,
    /// Hidden states of every window, dense model.
    dense: Vec<f32>,
    /// Hidden states of the held-out windows with sub-threshold neurons dropped.
    sparse: Vec<f32>,
    cache: KvCache,
}

impl<'a> Profiler<'a> {
    pub fn new(model: Model, calib: &'a Calibration) -> anyhow::Result<Self> {
        let mut dense = Vec::new();
        let mut sparse = Vec::new();
        for (w, &held) in calib.windows.iter().zip(&calib.heldout) {
            let x = model.embed(w)?;
            if held {
                sparse.extend_from_slice(&x);
            }
            dense.extend(x);
        }
        let cache = model.new_cache(crate::calib::WINDOW);
        Ok(Self {
            model,
            calib,
            dense,
            sparse,
            cache,
        })
    }

    /// Runs layer `l` of the dense model on every window and returns what its FFN saw.
    pub fn layer(&mut self, l: usize) -> LayerProfile {
        let c = self.model.config();
        let (h, n) = (c.hidden_size, c.intermediate_size);
        let rows = self.dense.len() / h;
        let residual = self.dense.clone();
        let mut ffn_input = vec![0.0; rows * h];
        let mut gate = vec![0.0; rows * n];
        let mut row = 0;
        for w in &self.calib.windows {
            let t = w.len();
            let x = &mut self.dense[row * h..(row + t) * h];
            let (fi, g) = (
                &mut ffn_input[row * h..(row + t) * h],
                &mut gate[row * n..(row + t) * n],
            );
            let mut probe = |p: FfnProbe| {
                fi.copy_from_slice(p.ffn_input);
                g.copy_from_slice(p.gate);
            };
            self.model.block(l, 0, x, &mut self.cache, Some(&mut probe));
            row += t;
        }
        LayerProfile {
            residual,
            ffn_input,
            gate,
        }
    }

    /// Runs layer `l` on the held-out windows with every neuron whose `|act(gate·x)|` is at most
    /// `threshold` dropped: the model as the runtime's sparse policies compute it.
    pub fn sparse_layer(&mut self, l: usize, threshold: f32) {
        let c = self.model.config();
        let (h, act) = (c.hidden_size, c.activation);
        let mut row = 0;
        for (w, &held) in self.calib.windows.iter().zip(&self.calib.heldout) {
            if !held {
                continue;
            }
            let t = w.len();
            let x = &mut self.sparse[row * h..(row + t) * h];
            let mut probe = |p: FfnProbe| {
                for g in p.gate.iter_mut() {
                    if act.apply(*g).abs() <= threshold {
                        *g = 0.0;
                    }
                }
            };
            self.model.block(l, 0, x, &mut self.cache, Some(&mut probe));
            row += t;
        }
    }

    /// Compares the sparse model with the dense one on the held-out windows (call after the last
    /// layer).
    pub fn quality(&self) -> SparsityQuality {
        let c = self.model.config();
        let (h, v) = (c.hidden_size, c.vocab_size);
        let mut q = Accum::default();
        let (mut drow, mut srow) = (0, 0);
        for (w, &held) in self.calib.windows.iter().zip(&self.calib.heldout) {
            let t = w.len();
            if held {
                let ld = self.model.logits(&self.dense[drow * h..(drow + t) * h]);
                let ls = self.model.logits(&self.sparse[srow * h..(srow + t) * h]);
                for i in 0..t - 1 {
                    q.add(
                        &ld[i * v..(i + 1) * v],
                        &ls[i * v..(i + 1) * v],
                        w[i + 1] as usize,
                    );
                }
                srow += t;
            }
            drow += t;
        }
        q.finish()
    }
}

/// Quality of the sparse model against the dense one on held-out calibration text.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SparsityQuality {
    pub tokens: usize,
    pub dense_perplexity: f64,
    pub sparse_perplexity: f64,
    /// Mean KL(dense ‖ sparse) of the next-token distributions, in nats.
    pub kl: f64,
    /// Fraction of positions where both pick the same most likely token.
    pub top1_agreement: f64,
}

#[derive(Default)]
struct Accum {
    n: usize,
    nll_dense: f64,
    nll_sparse: f64,
    kl: f64,
    agree: usize,
}

impl Accum {
    fn add(&mut self, dense: &[f32], sparse: &[f32], target: usize) {
        let (pd, ps) = (log_softmax(dense), log_softmax(sparse));
        self.nll_dense -= pd[target];
        self.nll_sparse -= ps[target];
        self.kl += pd
            .iter()
            .zip(&ps)
            .map(|(a, b)| a.exp() * (a - b))
            .sum::<f64>();
        self.agree += (argmax(dense) == argmax(sparse)) as usize;
        self.n += 1;
    }

    fn finish(self) -> SparsityQuality {
        let n = self.n.max(1) as f64;
        SparsityQuality {
            tokens: self.n,
            dense_perplexity: (self.nll_dense / n).exp(),
            sparse_perplexity: (self.nll_sparse / n).exp(),
            kl: self.kl / n,
            top1_agreement: self.agree as f64 / n,
        }
    }
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = row
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    row.iter().map(|&l| l as f64 - lse).collect()
}

fn argmax(row: &[f32]) -> usize {
    leanstream::sampler::argmax(row) as usize
}
