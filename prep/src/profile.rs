//! Layer-by-layer profiling: the calibration windows advance through the model one layer at a
//! time, so memory holds the dense weights, the hidden states of the calibration tokens and one
//! layer's FFN activations — never every layer's at once.

use leanstream::model::kv_cache::KvCache;
use leanstream::model::{FfnProbe, Model};
use leanstream::streaming::skip_rule::Skip;
use leanstream::text::perplexity::{Comparison, ComparisonAccum};

use crate::calib::Calibration;
use crate::train::{normalise_rows, Trained};

/// What one layer's FFN saw on every calibration token (rows = tokens of all windows in order).
pub struct LayerProfile {
    /// The residual stream entering the layer (`rows × hidden`).
    pub residual: Vec<f32>,
    /// The normalised FFN input (`rows × hidden`).
    pub ffn_input: Vec<f32>,
    /// Gate pre-activations (`rows × intermediate`).
    pub gate: Vec<f32>,
    /// Each neuron's coefficient on its down column, `act(gate·x)·(up·x)` (`rows × intermediate`).
    pub coef: Vec<f32>,
}

/// What a sparse stream computes of a layer: the neurons its skip rule keeps (exact mode) or, with
/// a predictor, only those of them the predictor names at its threshold (predicted mode, whose
/// misses are dropped however large).
#[derive(Clone, Copy)]
pub struct StreamRule<'a> {
    pub skip: Skip,
    pub predictor: Option<(&'a Trained, f32)>,
}

impl StreamRule<'_> {
    pub fn exact(skip: Skip) -> Self {
        Self {
            skip,
            predictor: None,
        }
    }
}

pub struct Profiler<'a> {
    /// The embedding, head and norms; each block's attention and FFN are installed while the
    /// calibration runs it (`convert::install`).
    pub model: Model,
    calib: &'a Calibration,
    /// Hidden states of every window, dense model.
    dense: Vec<f32>,
    /// Hidden states of the held-out windows with sub-threshold neurons dropped, one stream per
    /// set of thresholds being measured.
    sparse: Vec<Vec<f32>>,
    cache: KvCache,
}

impl<'a> Profiler<'a> {
    pub fn new(model: Model, calib: &'a Calibration) -> anyhow::Result<Self> {
        let cache = model.new_cache(crate::calib::WINDOW);
        let mut p = Self {
            model,
            calib,
            dense: Vec::new(),
            sparse: Vec::new(),
            cache,
        };
        p.restart()?;
        Ok(p)
    }

    /// Starts again from the embeddings (after a pass that only measured the dense model), with
    /// one sparse stream.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.dense.clear();
        for w in &self.calib.windows {
            let x = self.model.embed(w)?;
            self.dense.extend(x);
        }
        self.restart_sparse(1)
    }

    /// Starts `streams` sparse streams again from the embeddings, keeping the dense states (so
    /// after a dense pass through every layer, [`Profiler::quality`] compares with its output).
    pub fn restart_sparse(&mut self, streams: usize) -> anyhow::Result<()> {
        let mut held = Vec::new();
        for (w, &h) in self.calib.windows.iter().zip(&self.calib.heldout) {
            if h {
                held.extend(self.model.embed(w)?);
            }
        }
        self.sparse = vec![held; streams];
        Ok(())
    }

    /// Gives back the memory layer `l`'s keys and values took (the calibration is done with it).
    pub fn release_layer(&mut self, l: usize) {
        self.cache.release_layer(l);
    }

    /// Runs layer `l` of the dense model on every window and returns what its FFN saw.
    pub fn layer(&mut self, l: usize) -> LayerProfile {
        let c = self.model.config();
        let (h, n) = (c.hidden_size, c.intermediate_size);
        let rows = self.dense.len() / h;
        let residual = self.dense.clone();
        let mut ffn_input = vec![0.0; rows * h];
        let mut gate = vec![0.0; rows * n];
        let mut coef = vec![0.0; rows * n];
        let act = c.activation;
        let mut row = 0;
        for w in &self.calib.windows {
            let t = w.len();
            let x = &mut self.dense[row * h..(row + t) * h];
            let (fi, g, cf) = (
                &mut ffn_input[row * h..(row + t) * h],
                &mut gate[row * n..(row + t) * n],
                &mut coef[row * n..(row + t) * n],
            );
            let mut probe = |p: FfnProbe| {
                fi.copy_from_slice(p.ffn_input);
                g.copy_from_slice(p.gate);
                for ((c, &g), &u) in cf.iter_mut().zip(p.gate.iter()).zip(p.up) {
                    *c = act.coef(act.apply(g), u);
                }
            };
            self.model.block(l, 0, x, &mut self.cache, Some(&mut probe));
            row += t;
        }
        LayerProfile {
            residual,
            ffn_input,
            gate,
            coef,
        }
    }

    /// Runs layer `l` on the held-out windows of each sparse stream with every neuron its rule
    /// drops dropped: the model as the runtime's sparse modes compute it.
    pub fn sparse_layer(&mut self, l: usize, rules: &[StreamRule]) {
        assert_eq!(rules.len(), self.sparse.len(), "one rule per stream");
        let c = self.model.config();
        let (h, n) = (c.hidden_size, c.intermediate_size);
        for (stream, rule) in self.sparse.iter_mut().zip(rules) {
            let skip = rule.skip;
            let mut row = 0;
            for (w, &held) in self.calib.windows.iter().zip(&self.calib.heldout) {
                if !held {
                    continue;
                }
                let t = w.len();
                let x = &mut stream[row * h..(row + t) * h];
                let mut probe = |p: FfnProbe| {
                    let predicted = rule.predictor.map(|(predictor, threshold)| {
                        let x = normalise_rows(p.ffn_input, h, &(0..t).collect::<Vec<_>>());
                        predictor.scores(x.view()).mapv(|s| s >= threshold)
                    });
                    for (i, (g, &u)) in p.gate.iter_mut().zip(p.up).enumerate() {
                        let named = predicted.as_ref().is_none_or(|m| m[[i / n, i % n]]);
                        if !named || !skip.active(skip.score(skip.act.apply(*g), u)) {
                            *g = 0.0;
                        }
                    }
                };
                self.model.block(l, 0, x, &mut self.cache, Some(&mut probe));
                row += t;
            }
        }
    }

    /// Compares each sparse stream with the dense model on the held-out windows (call after the
    /// last layer).
    pub fn quality(&self) -> Vec<Comparison> {
        let c = self.model.config();
        let (h, v) = (c.hidden_size, c.vocab_size);
        let mut q: Vec<ComparisonAccum> = self.sparse.iter().map(|_| Default::default()).collect();
        let (mut drow, mut srow) = (0, 0);
        for (w, &held) in self.calib.windows.iter().zip(&self.calib.heldout) {
            let t = w.len();
            if held {
                let ld = self.model.logits(&self.dense[drow * h..(drow + t) * h]);
                for (q, stream) in q.iter_mut().zip(&self.sparse) {
                    let ls = self.model.logits(&stream[srow * h..(srow + t) * h]);
                    for i in 0..t - 1 {
                        q.add(
                            &ls[i * v..(i + 1) * v],
                            &ld[i * v..(i + 1) * v],
                            w[i + 1] as usize,
                        );
                    }
                }
                srow += t;
            }
            drow += t;
        }
        q.iter().map(ComparisonAccum::finish).collect()
    }
}
