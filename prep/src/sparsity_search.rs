//! The fraction of neurons each layer skips, found before the calibration's main pass: per-layer
//! cost curves from one dense pass, then for `auto` the held-out perplexity of candidate fractions
//! ([`auto_search`]), measured on sparse streams that advance through the layers together.

use std::path::Path;

use anyhow::Result;
use leanstream::streaming::skip_rule::{Skip, SkipRule};

use crate::calibrate::install;
use crate::convert::uninstall;
use crate::profile::{Profiler, StreamRule};
use crate::progress::Phase;
use crate::sparsity::{
    allocate, auto_search, cost_curve, level, level_thresholds, scores, AutoChoice, SparsityMode,
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
) -> Result<(Vec<f32>, Option<AutoChoice>, Option<Spill>)> {
    let c = profiler.model.config().clone();
    let (h, n, layers) = (c.hidden_size, c.intermediate_size, c.num_layers);
    let fraction = match mode {
        SparsityMode::Relu => return Ok((vec![0.0; layers], None, None)),
        SparsityMode::Threshold(f)
        | SparsityMode::Target {
            fraction: f,
            allocate: false,
        } => return Ok((vec![f; layers], None, None)),
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
    let auto = match fraction {
        Some(_) => None,
        // The profiler now holds the dense model's output on every window.
        None => Some(auto_search(|fractions| {
            heldout_costs(
                profiler,
                stored,
                mode.rule(),
                &curves,
                &thresholds,
                fractions,
                progress,
            )
        })?),
    };
    if spill.is_none() {
        profiler.restart()?;
    }
    let fraction = fraction.or(auto.as_ref().map(|a| a.fraction));
    Ok((allocate(&curves, fraction.expect("set above")), auto, spill))
}

/// The held-out perplexity cost (`perplexity / dense perplexity − 1`) of each of `fractions`,
/// [`allocate`]d by `curves` at the `thresholds` of the dense pass that measured them (the ones the
/// file would get): one pass through the layers with a sparse stream per fraction, after a dense
/// pass through every layer.
fn heldout_costs(
    profiler: &mut Profiler,
    stored: &Stored,
    rule: SkipRule,
    curves: &[Vec<f64>],
    thresholds: &[Vec<f32>],
    fractions: &[f32],
    progress: bool,
) -> Result<Vec<f64>> {
    let c = profiler.model.config().clone();
    let allocations: Vec<Vec<f32>> = fractions.iter().map(|&f| allocate(curves, f)).collect();
    profiler.restart_sparse(fractions.len())?;
    let mut phase = Phase::start(progress, "sparsity search", c.num_layers);
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
    phase.finish();
    Ok(profiler
        .quality()
        .iter()
        .map(|q| q.perplexity / q.reference_perplexity - 1.0)
        .collect())
}
