//! The layout pass: a model's weights written in the file format at once, without calibration
//! (FORMAT.md §4.1 `layout_only`). Bundles in their original order, every threshold 0, no
//! certificate, predictors that name every neuron: exact mode computes the dense model. It reads
//! each source tensor once, so it takes about the time of reading the source. `convert` writes it
//! first and calibrates it ([`crate::calibrate`]); `convert --layout-only` stops here, and
//! `leanstream-prep calibrate` finishes the same file later, in place.

use std::path::Path;

use anyhow::{Context, Result};
use leanstream::kernels::grouped_cluster::cluster_neurons;
use leanstream::streaming::skip_rule::SkipRule;
use leanstream_format::container::ContainerWriter;
use leanstream_format::ffn::FfnIndex;
use leanstream_format::meta::Meta;
use leanstream_format::predictor::{Predictor, PredictorInput, Predictors};
use leanstream_format::refine::{Refine, RefineLayer};
use leanstream_format::sketch::{Sketch, SketchLayer};

use crate::convert::{
    check_block_shapes, ffn_weights, write_dense, write_index_sections, ConvertOptions, EachRun,
    ALWAYS_LOGIT, LAYOUT,
};
use crate::convert_moe::{unmeasured, write_extents};
use crate::memory_plan::LAYOUT_RUN_ROWS;
use crate::progress::Phase;
use crate::source::Source;
use crate::sparsity::SparsityMode;
use crate::tensors::BundleRows;

/// Writes `source` to `output` as a layout-only file with `opts`' encoding, cluster size and the
/// skip rule of `opts.sparsity` (under `gate_up` the up rows and down columns are rescaled by the
/// down columns' norms, as a calibrated file of that rule stores them).
pub fn write_layout(opts: &ConvertOptions, source: &Source, output: &Path) -> Result<()> {
    let config = &source.config;
    let get = |name: &str, shape: &[usize]| source.tensor(name, shape);
    let mode = SparsityMode::parse(opts.sparsity(), config.activation)?;
    let rule = mode.rule();
    check_block_shapes(config, opts.quant)?;
    let mut writer = ContainerWriter::create(output)
        .with_context(|| format!("cannot write {}", output.display()))?;
    // The embedding and head in runs of rows, never whole in f32.
    let runs = |name: &str, shape: &[usize], each: EachRun| match shape {
        &[rows, cols] => source.tensor_rows(name, [rows, cols], LAYOUT_RUN_ROWS as usize, each),
        _ => each(&source.tensor(name, shape)?),
    };
    // A GGUF file's tensors as stored where the file format has their encoding (`--quant auto`).
    let stored = |name: &str, shape: &[usize]| match opts.keep {
        true => source.stored(name, shape),
        false => Ok(None),
    };
    let dense = write_dense(&mut writer, config, opts.quant, &runs, &stored)?;
    let (h, n, layers) = (
        config.hidden_size,
        config.intermediate_size,
        config.num_layers,
    );
    let mut phase = Phase::start(opts.calibration.progress, "layout", layers);
    let mut ffn = FfnIndex::default();
    writer.begin_section(LAYOUT.ffn_data());
    for l in 0..layers {
        // Kept gate and up rows are copied (up rows rescaled by powers of two under `gate_up`,
        // in their scale fields only); the calibration moves the bundles without encoding them
        // again, so a calibrated file stores exactly these bytes.
        let (gate, up, down, up_scale) = ffn_weights(&get, l, h, n, rule, opts.keep)?;
        let rows = match opts.keep {
            true => BundleRows::kept(source, l, h, n, opts.quant)?,
            false => BundleRows::uniform(opts.quant, h),
        };
        let row_bytes = rows.row_bytes()?;
        let cluster = cluster_neurons(opts.cluster_kib, row_bytes.iter().sum(), n, rows.parts);
        let mut extents = Vec::with_capacity(n.div_ceil(cluster));
        for first in (0..n).step_by(cluster) {
            let last = (first + cluster).min(n);
            let mut extent = Vec::with_capacity((last - first) * row_bytes.iter().sum::<usize>());
            for i in first..last {
                extent.extend(rows.gate(i, &gate)?);
                extent.extend(rows.up(i, &up, &up_scale)?);
                extent.extend(rows.down(i, &down, n)?);
            }
            extents.push(LAYOUT.arrange(&extent, row_bytes));
        }
        drop((gate, up, down));
        let mut layer = write_extents(&mut writer, opts.quant, h, n, cluster, &extents)?;
        layer.qtypes = rows.parts;
        ffn.layers.push(layer);
        phase.step();
    }
    writer.end_section();
    phase.finish();
    let meta = Meta {
        model: config.clone(),
        dense_quant: crate::tensors::dense_quant_name(&dense),
        ffn_quant: crate::tensors::ffn_quant_name(&ffn),
        sparsity_mode: mode.name().into(),
        sparsity_target: None,
        sparsity_rule: (rule != SkipRule::Gate).then(|| rule.name().into()),
        cluster_kib: opts.cluster_kib,
        layers: vec![unmeasured(None); layers],
        provenance: serde_json::json!({
            "source": opts.source_name,
            "converter": concat!("leanstream-prep ", env!("CARGO_PKG_VERSION")),
            "sparsity": opts.sparsity(),
        }),
        chat_template: source.chat_template.clone(),
        synthetic: None,
        layout_only: true,
    };
    let side = side_data(&ffn, h);
    // zstd's level 19 spends a second on SmolLM2's tokenizer; the calibration writes it again.
    writer.compression_level(3);
    write_index_sections(
        &mut writer,
        &meta,
        &source.tokenizer_json,
        &dense,
        &ffn,
        &side,
    )?;
    writer.finish()?;
    Ok(())
}

/// A layout-only file's per-layer side data (FORMAT.md §4.1 `layout_only`): predictors of rank 0
/// that name every neuron, no certificate, statistics of zeros with no neighbours.
fn side_data(ffn: &FfnIndex, h: usize) -> (Predictors, Sketch, Refine) {
    let (mut predictors, mut sketch, mut refine) =
        (Predictors::default(), Sketch::default(), Refine::default());
    for (l, layer) in ffn.layers.iter().enumerate() {
        let n = layer.neurons();
        let every = |source_layer: usize, input| Predictor {
            source_layer: source_layer as u32,
            input,
            input_dim: h as u32,
            rank: 0,
            outputs: n as u32,
            threshold: 0.5,
            w1: Vec::new(),
            b1: Vec::new(),
            w2: Vec::new(),
            b2: vec![ALWAYS_LOGIT; n],
        };
        predictors
            .lookahead
            .push(every(l.saturating_sub(1), PredictorInput::Residual));
        predictors.own.push(every(l, PredictorInput::FfnInput));
        sketch.layers.push(SketchLayer {
            qtype: layer.qtypes.gate,
            hidden: h as u32,
            rows: Vec::new(),
            err_norm: Vec::new(),
        });
        let clusters = layer.clusters.len();
        refine.layers.push(RefineLayer {
            cluster_freq: vec![0.0; clusters],
            neighbours: vec![Vec::new(); clusters],
            neuron_freq: vec![0.0; n],
            neuron_mag: vec![0.0; n],
        });
    }
    (predictors, sketch, refine)
}
