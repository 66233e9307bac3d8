//! Layer-by-layer profiling: the calibration windows advance through the model one layer at a
//! time, so memory holds the dense weights, the hidden states of the calibration tokens and one
//! layer's FFN activations — never every layer's at once.
//!
//! The windows are independent (each starts from an empty context), so each pass runs them on
//! every core, one KV cache per task; every window computes the same bits whatever the thread
//! count, and every sum over windows is taken in window order.

use std::borrow::Cow;

use leanstream::model::{Attention, FfnProbe, Model};
use leanstream::streaming::skip_rule::Skip;
use leanstream::text::perplexity::{Comparison, ComparisonAccum};
use rayon::prelude::*;

use crate::calib::{Calibration, WINDOW};
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
    /// The dense model's logits at the held-out positions [`Profiler::quality`] compares, kept
    /// from one call to the next while [`Profiler::keep_dense_logits`] says so (the `auto`
    /// search's rounds compare with the same dense output); empty until the first call.
    dense_logits: Option<Vec<f32>>,
    /// The f32 attention of the block uninstalled last, whose buffers the next install reuses.
    pub(crate) attention_spare: Option<Attention>,
}

/// Positions of a held-out window whose logits are compared at once: bounds the logits held
/// (two of these runs per task) and fixes the order of the sums, whatever the thread count.
pub(crate) const COMPARE_ROWS: usize = 32;

/// `buf` (rows of `width` values) cut into one slice per window of `lens` tokens, in order.
fn per_window<'s>(mut buf: &'s mut [f32], lens: &[usize], width: usize) -> Vec<&'s mut [f32]> {
    lens.iter()
        .map(|&t| {
            let (head, rest) = std::mem::take(&mut buf).split_at_mut(t * width);
            buf = rest;
            head
        })
        .collect()
}

impl<'a> Profiler<'a> {
    /// Profiles `model` on `calib`'s windows. Each window's FFN runs its f32 weights in one
    /// product over the window ([`Model::set_whole_products`]): a window always has the same
    /// tokens, so its bits do not change from pass to pass or with the thread count, and each
    /// weight is read once a window, not once per 16 tokens.
    pub fn new(mut model: Model, calib: &'a Calibration) -> anyhow::Result<Self> {
        model.set_whole_products(true);
        let mut p = Self {
            model,
            calib,
            dense: Vec::new(),
            sparse: Vec::new(),
            dense_logits: None,
            attention_spare: None,
        };
        p.restart()?;
        Ok(p)
    }

    /// Starts again from the embeddings (after a pass that only measured the dense model), with
    /// one sparse stream.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.dense.clear();
        if let Some(l) = &mut self.dense_logits {
            *l = Vec::new();
        }
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

    /// Calibration tokens (rows of a [`LayerProfile`]).
    pub fn rows(&self) -> usize {
        self.calib.tokens()
    }

    /// Bytes of the dense logits [`Profiler::quality`] can keep: the held-out positions it
    /// compares times the vocabulary, in f32.
    pub fn dense_logits_bytes(&self) -> u64 {
        let positions: usize = self
            .calib
            .windows
            .iter()
            .zip(&self.calib.heldout)
            .filter(|(_, &h)| h)
            .map(|(w, _)| w.len() - 1)
            .sum();
        4 * (positions * self.model.config().vocab_size) as u64
    }

    /// Whether [`Profiler::quality`] keeps the dense logits for its next calls (computed by the
    /// first; the same bits as computing them each time); `false` frees them.
    pub fn keep_dense_logits(&mut self, keep: bool) {
        self.dense_logits = keep.then(Vec::new);
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
        let lens: Vec<usize> = self.calib.windows.iter().map(Vec::len).collect();
        let tasks = per_window(&mut self.dense, &lens, h)
            .into_iter()
            .zip(per_window(&mut ffn_input, &lens, h))
            .zip(per_window(&mut gate, &lens, n))
            .zip(per_window(&mut coef, &lens, n));
        // One KV cache per task: its pages are taken as the layer runs, given back when it ends.
        let model = &self.model;
        tasks.collect::<Vec<_>>().into_par_iter().for_each_init(
            || model.new_cache(WINDOW),
            |cache, (((x, fi), g), cf)| {
                let mut probe = |p: FfnProbe| {
                    fi.copy_from_slice(p.ffn_input);
                    g.copy_from_slice(p.gate);
                    for ((c, &g), &u) in cf.iter_mut().zip(p.gate.iter()).zip(p.up) {
                        *c = act.coef(act.apply(g), u);
                    }
                };
                model.block(l, 0, x, cache, Some(&mut probe));
            },
        );
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
        let held: Vec<&[u32]> = self
            .calib
            .windows
            .iter()
            .zip(&self.calib.heldout)
            .filter(|(_, &h)| h)
            .map(|(w, _)| w.as_slice())
            .collect();
        let lens: Vec<usize> = held.iter().map(|w| w.len()).collect();
        let mut sparse = std::mem::take(&mut self.sparse);
        let tasks: Vec<_> = sparse
            .iter_mut()
            .zip(rules)
            .flat_map(|(stream, rule)| {
                per_window(stream, &lens, h)
                    .into_iter()
                    .map(move |x| (rule, x))
            })
            .collect();
        let model = &self.model;
        tasks.into_par_iter().for_each_init(
            || model.new_cache(WINDOW),
            |cache, (rule, x)| {
                let skip = rule.skip;
                let t = x.len() / h;
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
                model.block(l, 0, x, cache, Some(&mut probe));
            },
        );
        self.sparse = sparse;
    }

    /// Compares each sparse stream with the dense model on the held-out windows (call after the
    /// last layer). The held-out positions go in runs of [`COMPARE_ROWS`] on every core, each run
    /// compared with every stream; the runs' sums are added in order, whatever the thread count.
    pub fn quality(&mut self) -> Vec<Comparison> {
        let c = self.model.config();
        let (h, v) = (c.hidden_size, c.vocab_size);
        // Each run: its window's tokens, first position, rows in the dense and sparse states, and
        // positions.
        let mut runs = Vec::new();
        let (mut drow, mut srow) = (0, 0);
        for (w, &held) in self.calib.windows.iter().zip(&self.calib.heldout) {
            let t = w.len();
            if held {
                for i0 in (0..t - 1).step_by(COMPARE_ROWS) {
                    let len = (i0 + COMPARE_ROWS).min(t - 1) - i0;
                    runs.push((w.as_slice(), i0, drow + i0, srow + i0, len));
                }
                srow += t;
            }
            drow += t;
        }
        let cached = self.dense_logits.as_deref().filter(|l| !l.is_empty());
        let keep = self.dense_logits.is_some() && cached.is_none();
        let mut first = 0;
        let firsts: Vec<usize> = runs
            .iter()
            .map(|r| {
                first += r.4;
                first - r.4
            })
            .collect();
        let (model, dense, sparse) = (&self.model, &self.dense, &self.sparse);
        let compared: Vec<(Vec<f32>, Vec<ComparisonAccum>)> = runs
            .into_par_iter()
            .zip(firsts)
            .map(|((w, i0, d, s, len), first)| {
                let ld = match cached {
                    Some(l) => Cow::Borrowed(&l[first * v..(first + len) * v]),
                    None => Cow::Owned(model.logits(&dense[d * h..(d + len) * h])),
                };
                let accs = sparse
                    .iter()
                    .map(|stream| {
                        let ls = model.logits(&stream[s * h..(s + len) * h]);
                        let mut acc = ComparisonAccum::default();
                        for i in 0..len {
                            acc.add(
                                &ls[i * v..(i + 1) * v],
                                &ld[i * v..(i + 1) * v],
                                w[i0 + i + 1] as usize,
                            );
                        }
                        acc
                    })
                    .collect();
                (if keep { ld.into_owned() } else { Vec::new() }, accs)
            })
            .collect();
        let mut q: Vec<ComparisonAccum> = sparse.iter().map(|_| Default::default()).collect();
        let mut kept = Vec::with_capacity(if keep { first * v } else { 0 });
        for (ld, run) in compared {
            kept.extend(ld);
            for (q, acc) in q.iter_mut().zip(&run) {
                q.merge(acc);
            }
        }
        if keep {
            self.dense_logits = Some(kept);
        }
        q.iter().map(ComparisonAccum::finish).collect()
    }
}
