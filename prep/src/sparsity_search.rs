//! The fraction of neurons each layer skips, found before the calibration's main pass: per-layer
//! cost curves from one dense pass, then for `auto` the held-out perplexity of candidate fractions
//! ([`auto_search`]), measured on sparse streams that advance through the layers together.

use std::path::Path;

use anyhow::Result;
use leanstream::streaming::skip_rule::{Skip, SkipRule};
use leanstream::text::perplexity::Comparison;

use crate::calibrate::install;
use crate::convert::uninstall;
use crate::memory_plan::per_token_bytes;
use crate::profile::{Profiler, StreamRule};
use crate::progress::Phase;
use crate::sparsity::{
    allocate, auto_rounds, auto_search, cost_curve, level, level_thresholds, scores, AutoChoice,
    SparsityMode,
};
use crate::spill::Spill;
use crate::stored::Stored;

/// The fraction of neurons each layer skips: none for `relu`, the target everywhere for a uniform
/// mode, else [`allocate`]d from each layer's cost curve, measured in one dense pass over the
/// calibration text before the real one; for `auto`, at the fraction [`auto_search`] picks (then
/// also returned). Where it can, the dense pass writes each layer's profile to a [`Spill`] at
/// `spill`, returned for the main pass to read back (the profiler then keeps the dense model's
/// output); else the profiler starts again from the embeddings.
pub fn layer_fractions(
    mode: SparsityMode,
    profiler: &mut Profiler,
    stored: &Stored,
    train_rows: &[usize],
    spill: &Path,
    progress: bool,
) -> Result<Fractions> {
    let c = profiler.model.config().clone();
    let (h, n, layers) = (c.hidden_size, c.intermediate_size, c.num_layers);
    let fraction = match mode {
        SparsityMode::Relu => return Ok(Fractions::uniform(0.0, layers)),
        SparsityMode::Threshold(f)
        | SparsityMode::Target {
            fraction: f,
            allocate: false,
        } => return Ok(Fractions::uniform(f, layers)),
        SparsityMode::Target { fraction, .. } => Some(fraction),
        SparsityMode::Auto => None,
    };
    // The main pass's rule (`gate_up`) needs no gate pre-activations.
    let rows = profiler.rows() as u64;
    let spill_bytes = 4 * rows * (2 * h + n) as u64 * layers as u64;
    let mut spill = Spill::create(spill, spill_bytes);
    if progress {
        match &spill {
            Some(_) => eprintln!(
                "the dense pass keeps each layer's profile for the main pass: {} MiB of \
                 temporary disk",
                spill_bytes >> 20
            ),
            None => eprintln!(
                "note: too little free disk to keep the layer profiles ({} MiB); the main pass \
                 computes them again",
                spill_bytes >> 20
            ),
        }
    }
    let mut phase = Phase::start(progress, "sparsity curves", layers);
    let (mut curves, mut thresholds) = (Vec::with_capacity(layers), Vec::with_capacity(layers));
    for l in 0..layers {
        let (weights, _) = stored.ffn(l)?;
        let down = weights[2].clone();
        install(profiler, stored, l, weights)?;
        let mut prof = profiler.layer(l);
        let score = scores(mode.rule(), c.activation, &prof.gate, &prof.coef);
        let t = level_thresholds(&score, n, train_rows);
        curves.push(cost_curve(
            &score,
            &prof.coef,
            &down,
            &prof.residual,
            h,
            train_rows,
            &t,
        ));
        thresholds.push(t);
        if let Some(s) = spill.as_mut() {
            prof.gate = Vec::new();
            s.put(l, &prof)?;
        }
        drop(prof);
        uninstall(profiler, l);
        phase.step();
    }
    phase.finish();
    // Each fraction the search measured, with its comparison.
    let mut measured: Vec<(f32, Comparison)> = Vec::new();
    let auto = match fraction {
        Some(_) => None,
        // The profiler now holds the dense model's output on every window. Every round compares
        // with its logits: kept between rounds where they take no more memory than the main
        // pass's calibration state, which is not held yet.
        None => {
            let calibration = profiler.rows() as u64 * per_token_bytes(&c);
            profiler.keep_dense_logits(profiler.dense_logits_bytes() <= calibration);
            // One phase for every round: its estimate assumes the most rounds.
            let mut phase = Phase::start(progress, "sparsity search", auto_rounds() * layers);
            let auto = auto_search(|fractions| {
                let q = heldout_quality(
                    profiler,
                    stored,
                    mode.rule(),
                    &curves,
                    &thresholds,
                    fractions,
                    &mut phase,
                )?;
                measured.extend(fractions.iter().copied().zip(q.iter().cloned()));
                Ok(q.iter()
                    .map(|q| q.perplexity / q.reference_perplexity - 1.0)
                    .collect())
            })?;
            phase.finish();
            profiler.keep_dense_logits(false);
            Some(auto)
        }
    };
    if spill.is_none() {
        profiler.restart()?;
    }
    let fraction = fraction
        .or(auto.as_ref().map(|a| a.fraction))
        .expect("set above");
    let exact = measured
        .into_iter()
        .find(|(f, _)| *f == fraction)
        .map(|(_, q)| q);
    Ok(Fractions {
        layers: allocate(&curves, fraction),
        auto,
        spill,
        exact,
    })
}

/// What [`layer_fractions`] found.
pub struct Fractions {
    /// Each layer's fraction of neurons skipped.
    pub layers: Vec<f32>,
    /// What `auto` chose and measured.
    pub auto: Option<AutoChoice>,
    /// The dense pass's layer profiles, for the main pass to read back.
    pub spill: Option<Spill>,
    /// The held-out comparison of exact mode at these fractions, where the search measured it (the
    /// main pass's exact stream would compute the same bits again).
    pub exact: Option<Comparison>,
}

impl Fractions {
    fn uniform(fraction: f32, layers: usize) -> Self {
        Self {
            layers: vec![fraction; layers],
            auto: None,
            spill: None,
            exact: None,
        }
    }
}

/// The held-out comparison with the dense model of each of `fractions`,
/// [`allocate`]d by `curves` at the `thresholds` of the dense pass that measured them (the ones the
/// file would get): one pass through the layers with a sparse stream per fraction, after a dense
/// pass through every layer.
fn heldout_quality(
    profiler: &mut Profiler,
    stored: &Stored,
    rule: SkipRule,
    curves: &[Vec<f64>],
    thresholds: &[Vec<f32>],
    fractions: &[f32],
    phase: &mut Phase,
) -> Result<Vec<Comparison>> {
    let c = profiler.model.config().clone();
    let allocations: Vec<Vec<f32>> = fractions.iter().map(|&f| allocate(curves, f)).collect();
    profiler.restart_sparse(fractions.len())?;
    for (l, t) in thresholds.iter().enumerate() {
        let (weights, _) = stored.ffn(l)?;
        install(profiler, stored, l, weights)?;
        let skips: Vec<StreamRule> = allocations
            .iter()
            .map(|a| {
                StreamRule::exact(Skip {
                    act: c.activation,
                    rule,
                    threshold: t[level(a[l])],
                })
            })
            .collect();
        profiler.sparse_layer(l, &skips);
        uninstall(profiler, l);
        phase.step();
    }
    Ok(profiler.quality())
}
