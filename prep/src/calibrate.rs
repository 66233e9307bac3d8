//! `leanstream-prep calibrate FILE`: profile a converted file's own weights on the calibration
//! text, then write it again with the learned neuron order, thresholds, certificates, predictors
//! and statistics — one layer at a time, the bundles moved as stored (never encoded twice). The
//! output replaces its target atomically (written beside it, synced, renamed), so FILE may be its
//! own output. `convert` is the layout pass ([`crate::layout`]) followed by this.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Result};
use leanstream::kernels::{Matrix, Weight};
use leanstream::model::{Attention, DenseFfn};
use leanstream::streaming::default_predictor_rank;
use leanstream::streaming::skip_rule::{Skip, SkipRule};
use leanstream::tokenizer::Tokenizer;
use leanstream_format::container::{ContainerWriter, SectionKind};
use leanstream_format::dense::DenseIndex;
use leanstream_format::ffn::{FfnIndex, FfnLayer};
use leanstream_format::input_basis::InputBasis;
use leanstream_format::meta::{LayerMeta, Meta};
use leanstream_format::predictor::{PredictorInput, Predictors};
use leanstream_format::refine::Refine;
use leanstream_format::sketch::Sketch;

use crate::activity;
use crate::calib::{self, Calibration};
use crate::certificate::{self, CertificateChoice};
use crate::certificate_study;
use crate::convert::{
    refine_stats, remove_stale, sibling, to_predictor, uninstall, write_index_sections, Phases,
    PredictedLayer, Summary, ALWAYS_LOGIT, LAYOUT, MIN_PREDICTOR_RANK,
};
use crate::convert_moe::write_clusters;
use crate::input_basis;
use crate::memory_plan;
use crate::placement::{cluster_fill, place};
use crate::profile::{LayerProfile, Profiler, StreamRule};
use crate::progress::Phase;
use crate::sparsity::{masks, quantile, scores, SparsityMode};
use crate::sparsity_search::{layer_fractions, Fractions};
use crate::stored::Stored;
use crate::train::{
    at_threshold, energies, massive, miss_threshold, normalise_rows, score_threshold, targets,
    top_k_quality, train, TrainConfig,
};
use leanstream::kernels::grouped_cluster;

/// Predicted-active budget, as a multiple of the true active fraction, at which recall is judged
/// (and, under the `gate` rule, the own predictor's threshold).
const BUDGET_FACTOR: f32 = 1.5;
/// Under `gate_up`, the own predictor's threshold lets the active neurons it misses on the training
/// split carry at most this multiple of the squared contribution (`c²`, summed) the rule itself
/// skips there, so predicted mode adds at most about that much to exact mode's error in each layer.
const MISS_SHARE: f64 = 0.5;

#[derive(Clone)]
pub struct CalibrateOptions {
    /// The sparsity mode (`convert --sparsity`); none: what the layout pass was given, else auto.
    pub sparsity: Option<String>,
    pub certificate: CertificateChoice,
    pub certificate_study: bool,
    pub calib: Option<PathBuf>,
    pub calib_tokens: Option<usize>,
    pub predictor_rank: Option<usize>,
    pub epochs: Option<usize>,
    pub progress: bool,
}

/// Calibrates `input` into `output` (which may be `input`).
pub fn calibrate(
    input: &Path,
    output: &Path,
    opts: &CalibrateOptions,
    mut phases: Phases,
) -> Result<Summary> {
    let t = Instant::now();
    let stored = Stored::open(input)?;
    let config = stored.config().clone();
    let file_meta = stored.file.meta.clone();
    let sparsity = opts.sparsity.clone().unwrap_or_else(|| {
        file_meta.provenance["sparsity"]
            .as_str()
            .unwrap_or("auto")
            .to_string()
    });
    let mut mode = SparsityMode::parse(&sparsity, config.activation)?;
    let rule = mode.rule();
    let stored_rule = SkipRule::parse(file_meta.sparsity_rule.as_deref()).unwrap_or(SkipRule::Gate);
    if rule != stored_rule {
        bail!(
            "{} stores its FFN for the {} rule, and --sparsity {sparsity} needs the {} rule: \
             calibrate it with a mode of its rule (gate: relu or threshold:F; gate_up: auto or \
             target:F), or convert the source model again with --sparsity {sparsity}",
            input.display(),
            stored_rule.name(),
            rule.name()
        );
    }
    // The gate rows' encoding: the certificate's candidates (its exact gates) depend on it.
    let quant = stored.file.ffn.layers[0].qtypes.gate;
    let with_certificate = opts.certificate.wanted(rule)?;
    let encodings = if with_certificate {
        opts.certificate.encodings(quant)
    } else {
        Vec::new()
    };
    let tokenizer = Tokenizer::from_bytes(&stored.file.tokenizer_json)?;
    let calib = Calibration::new(
        &tokenizer,
        opts.calib.as_deref(),
        &calib::default_text(config.activation),
        opts.calib_tokens
            .unwrap_or_else(|| memory_plan::default_calib_tokens(&config)),
    )?;
    drop(tokenizer);
    let model = stored.profiling_model()?;
    let table_q = stored
        .file
        .dense
        .tensors
        .iter()
        .find(|t| t.name == "model.embed_tokens.weight")
        .map_or(quant, |t| t.qtype);
    let estimate = memory_plan::estimate(&config, table_q, calib.tokens(), 0);
    if opts.progress {
        eprintln!(
            "{} calibration tokens; peak memory about {} MiB (estimate: embedding and head {} \
             MiB, one block {} MiB, calibration state {} MiB)",
            calib.tokens(),
            estimate.total >> 20,
            estimate.model >> 20,
            estimate.block >> 20,
            estimate.calibration >> 20
        );
    }
    let epochs = opts
        .epochs
        .unwrap_or_else(|| memory_plan::default_epochs(calib.tokens()));
    phases.load += t.elapsed().as_secs_f64();

    let mut writer = ContainerWriter::create(output)?;
    let t = Instant::now();
    let dense = copy_dense(&mut writer, &stored)?;
    phases.dense += t.elapsed().as_secs_f64();

    let (h, n) = (config.hidden_size, config.intermediate_size);
    let act = config.activation;
    let (train_rows, eval_rows) = calib.split_rows();
    let eval_prev = calib.previous(&eval_rows);
    let bundle_bytes: usize = stored.file.ffn.layers[0].row_bytes().iter().sum();
    let rank = opts
        .predictor_rank
        .unwrap_or_else(|| default_predictor_rank(h, n, bundle_bytes, MIN_PREDICTOR_RANK));
    let mut profiler = Profiler::new(model, &calib)?;
    let t = Instant::now();
    // The layer profiles the dense pass keeps on disk for the main pass, if any, beside the output.
    remove_stale(output, "profile");
    let Fractions {
        layers: fractions,
        auto,
        mut spill,
        exact: searched,
    } = layer_fractions(
        mode,
        &mut profiler,
        &stored,
        &train_rows,
        &sibling(output, "profile"),
        opts.progress,
    )?;
    phases.allocate += t.elapsed().as_secs_f64();
    if let Some(a) = &auto {
        mode = SparsityMode::Target {
            fraction: a.fraction,
            allocate: true,
        };
        let tried: Vec<String> = a
            .tried
            .iter()
            .map(|(f, c)| format!("{f:.2}: {:+.1} %", 100.0 * c))
            .collect();
        eprintln!(
            "--sparsity auto: target:{:.2}, the largest fraction whose perplexity on the held-out \
             calibration windows is within {:.0} % of the dense model's ({:+.1} %; tried {})",
            a.fraction,
            100.0 * a.max_cost,
            100.0 * a.cost,
            tried.join(", ")
        );
    }
    // Held-out streams: predicted mode (the file's thresholds and its own predictors) and, unless
    // the search measured it, exact mode (the thresholds alone).
    profiler.restart_sparse(if searched.is_some() { 1 } else { 2 })?;
    let mut phase = Phase::start(opts.progress, "calibrate", config.num_layers);
    let mut ffn = FfnIndex::default();
    let (mut predictors, mut sketch, mut refine) =
        (Predictors::default(), Sketch::default(), Refine::default());
    let mut basis = InputBasis::default();
    let mut layer_meta = Vec::new();
    let mut predicted = Vec::new();
    let mut cluster_neurons = Vec::new();
    let (mut studies, mut certificates) = (Vec::new(), Vec::new());
    let mut prev_residual: Option<Vec<f32>> = None;
    writer.begin_section(LAYOUT.ffn_data());
    for (l, &fraction) in fractions.iter().enumerate() {
        phase.message(format!("layer {l}: profile"));
        let t = Instant::now();
        let ([gate, up, down], bundles) = stored.ffn(l)?;
        let (row_bytes, bundle_bytes) = (bundles.row_bytes, bundles.bundle_bytes());
        let parts = stored.file.ffn.layers[l].qtypes;
        let cluster_size =
            grouped_cluster::cluster_neurons(file_meta.cluster_kib, bundle_bytes, n, parts);
        install(&mut profiler, &stored, l, [gate, up, down])?;
        // What the layer's FFN saw (computed, or as the dense pass computed it); the gate
        // pre-activations only give the scores, so they go at once (each `rows × n` array of f32
        // is the bulk of the converter's memory).
        let LayerProfile {
            residual,
            ffn_input,
            gate: pre,
            coef,
        } = match spill.as_mut() {
            Some(s) => s.take(l)?,
            None => profiler.layer(l),
        };
        let score = scores(rule, act, &pre, &coef);
        drop(pre);
        let thr = match mode {
            SparsityMode::Relu => 0.0,
            _ => quantile(&score, n, &train_rows, fraction),
        };
        let skip = Skip {
            act,
            rule,
            threshold: thr,
        };
        let mask = masks(&score, thr);
        phases.profile += t.elapsed().as_secs_f64();

        phase.message(format!("layer {l}: place"));
        let t = Instant::now();
        let perm = place(&mask, n, &train_rows, cluster_size);
        let identity: Vec<u32> = (0..n as u32).collect();
        let fill = cluster_fill(&mask, n, &eval_rows, &perm, cluster_size);
        let fill_unordered = cluster_fill(&mask, n, &eval_rows, &identity, cluster_size);
        phases.place += t.elapsed().as_secs_f64();

        phase.message(format!("layer {l}: train"));
        let t = Instant::now();
        let y_train = targets(&mask, n, &train_rows);
        let y_eval = targets(&mask, n, &eval_rows);
        let active_frac = y_train.mean().unwrap_or(0.0);
        let k = ((BUDGET_FACTOR * active_frac * n as f32).ceil() as usize).clamp(1, n);
        let cfg = TrainConfig {
            rank,
            epochs,
            batch: 128,
            lr: 3e-3,
            pos_weight: 3.0,
            seed: l as u64,
        };
        let source_layer = l.saturating_sub(1);
        let lookahead_input = prev_residual.as_deref().unwrap_or(&residual);
        // Fits a predictor of the layer's activity from `x`; the scores it gives the training
        // and held-out rows are kept only where wanted (`rows × n` each).
        let fit = |x: &[f32]| {
            let xt = normalise_rows(x, h, &train_rows);
            let trained = train(&xt, &y_train, &cfg);
            let train_scores = trained.scores(xt.view());
            drop(xt);
            let eval_scores = trained.scores(normalise_rows(x, h, &eval_rows).view());
            let quality = top_k_quality(eval_scores.view(), &y_eval, k);
            let thr = score_threshold(&train_scores, k as f32 / n as f32);
            (trained, quality, thr, train_scores, eval_scores)
        };
        // The two predictors are independent: one per core where there are two.
        let ((mut own, own_q, budget_thr, mut own_train, mut own_eval), (look, look_q, look_thr)) =
            rayon::join(
                || fit(&ffn_input),
                || {
                    let (t, q, thr, _, _) = fit(lookahead_input);
                    (t, q, thr)
                },
            );
        // Predicted mode drops a missed active neuron however large, so for SwiGLU (the
        // `gate_up` rule, and the `gate` rule on |silu(g)|, whose misses cost as much) the own
        // predictor always names the neurons with massive contributions and its threshold is set
        // by what its misses carry rather than by a budget. ReLU (and FATReLU, dReLU) keeps the
        // budget: `relu(g) = 0` is exact, and its misses are the rule's own small gates.
        let e_eval = energies(&coef, &mask, n, &eval_rows);
        let by_contribution = rule == SkipRule::GateUp || !act.is_relu_like();
        let (own_thr, always) = if by_contribution {
            let e_train = energies(&coef, &mask, n, &train_rows);
            let always = massive(&e_train);
            for &j in &always {
                own.w2.row_mut(j).fill(0.0);
                own.b2[j] = ALWAYS_LOGIT;
                own_train.column_mut(j).fill(1.0);
                own_eval.column_mut(j).fill(1.0);
            }
            let skipped: f64 = train_rows
                .iter()
                .flat_map(|&r| r * n..(r + 1) * n)
                .filter(|&i| !mask[i])
                .map(|i| (coef[i] as f64).powi(2))
                .sum();
            let thr = miss_threshold(&own_train, &e_train, MISS_SHARE * skipped);
            (thr, always.len())
        } else {
            (budget_thr, 0)
        };
        drop((own_train, coef));
        predicted.push(PredictedLayer {
            quality: at_threshold(&own_eval, &y_eval, &e_eval, own_thr),
            always,
        });
        let predicted_rule = StreamRule {
            skip,
            predictor: Some((&own, own_thr)),
        };
        match searched {
            Some(_) => profiler.sparse_layer(l, &[predicted_rule]),
            None => profiler.sparse_layer(l, &[predicted_rule, StreamRule::exact(skip)]),
        }
        let freq = y_train.mean_axis(ndarray::Axis(0)).expect("rows");
        // Every row scored by the neuron's training frequency: a view, not a `rows × n` copy.
        let static_scores = freq.broadcast(y_eval.dim()).expect("n columns");
        let static_q = top_k_quality(static_scores, &y_eval, k);
        predictors.own.push(to_predictor(
            own,
            &perm,
            l,
            PredictorInput::FfnInput,
            own_thr,
        ));
        predictors.lookahead.push(to_predictor(
            look,
            &perm,
            source_layer,
            PredictorInput::Residual,
            look_thr,
        ));
        phases.train += t.elapsed().as_secs_f64();

        phase.message(format!("layer {l}: bundles"));
        let t = Instant::now();
        let gate_rows: Vec<Vec<u8>> = if with_certificate || opts.certificate_study {
            perm.iter()
                .map(|&i| bundles.gate(i as usize).to_vec())
                .collect()
        } else {
            Vec::new()
        };
        let extents = perm.chunks(cluster_size).map(|chunk| {
            let mut extent = Vec::with_capacity(chunk.len() * bundle_bytes);
            for &i in chunk {
                extent.extend_from_slice(bundles.bundle(i as usize));
            }
            LAYOUT.arrange(&extent, row_bytes)
        });
        let clusters = write_clusters(&mut writer, n, cluster_size, extents)?;
        drop(bundles);
        let (sketch_layer, certificate_saves) = certificate::build(
            &gate_rows,
            parts.gate,
            h,
            &encodings,
            skip,
            &ffn_input,
            &eval_rows,
            cluster_size,
            (n * bundle_bytes) as u64,
        )?;
        if opts.certificate_study {
            studies.push(certificate_study::layer(&certificate_study::LayerInput {
                gates: &gate_rows,
                bundle: parts.gate,
                hidden: h,
                skip,
                x: &ffn_input,
                rows: &eval_rows,
                mask: &mask,
                perm: &perm,
                cluster_size,
                bundle_bytes,
                written: (!sketch_layer.err_norm.is_empty()).then_some(sketch_layer.qtype),
            })?);
        }
        certificates.push(if sketch_layer.err_norm.is_empty() {
            "none".to_string()
        } else {
            sketch_layer.qtype.name().to_string()
        });
        sketch.layers.push(sketch_layer);
        refine.layers.push(refine_stats(
            &mask,
            &score,
            n,
            &train_rows,
            &perm,
            cluster_size,
        ));
        basis.layers.push(input_basis::principal_directions(
            &ffn_input,
            h,
            &train_rows,
            input_basis::rank_for(h),
        ));
        ffn.layers.push(FfnLayer {
            qtypes: parts,
            hidden: h as u32,
            perm,
            clusters,
            layout: LAYOUT,
        });
        phases.bundles += t.elapsed().as_secs_f64();

        let eval_sparsity = 1.0 - y_eval.mean().unwrap_or(0.0);
        let perm = &ffn.layers.last().expect("pushed above").perm;
        layer_meta.push(LayerMeta {
            threshold: thr,
            sparsity: eval_sparsity,
            predictor_recall: own_q.recall,
            predictor_precision: own_q.precision,
            lookahead_recall: look_q.recall,
            lookahead_precision: look_q.precision,
            static_recall: static_q.recall,
            cluster_fill: fill,
            cluster_fill_unordered: fill_unordered,
            activity: Some(activity::measure(&mask, n, &eval_rows, &eval_prev, perm)),
            certificate_saves,
            routing: None,
        });
        cluster_neurons.push(cluster_size);
        prev_residual = Some(residual);
        uninstall(&mut profiler, l);
        phase.step();
    }
    writer.end_section();
    phase.finish();
    drop(spill);

    let t = Instant::now();
    let mut streams = profiler.quality().into_iter();
    let predicted_quality = streams.next().expect("the predicted stream");
    let quality = searched
        .or_else(|| streams.next())
        .expect("the exact stream");
    let meta = Meta {
        model: config.clone(),
        dense_quant: file_meta.dense_quant.clone(),
        ffn_quant: file_meta.ffn_quant.clone(),
        sparsity_mode: mode.name().into(),
        sparsity_target: mode.target(),
        sparsity_rule: (rule != SkipRule::Gate).then(|| rule.name().into()),
        cluster_kib: file_meta.cluster_kib,
        layers: layer_meta.clone(),
        provenance: serde_json::json!({
            "source": file_meta.provenance["source"],
            "converter": concat!("leanstream-prep ", env!("CARGO_PKG_VERSION")),
            "calib_tokens": calib.tokens(),
            "calib_text": calib::text_name(opts.calib.as_deref(), config.activation),
            "heldout_tokens": eval_rows.len(),
            "predictor_rank": rank,
            "epochs": epochs,
            "sparsity_quality": quality,
            "predicted_quality": predicted_quality,
            "sparsity_auto": auto,
        }),
        chat_template: file_meta.chat_template.clone(),
        synthetic: None,
        layout_only: false,
    };
    let side = (predictors, sketch, refine);
    write_index_sections(
        &mut writer,
        &meta,
        &stored.file.tokenizer_json,
        &dense,
        &ffn,
        &side,
    )?;
    writer.add_section(SectionKind::InputBasis, &basis.encode(), false)?;
    writer.finish()?;
    phases.finish += t.elapsed().as_secs_f64();
    Ok(Summary {
        file_bytes: std::fs::metadata(output)?.len(),
        output: output.to_path_buf(),
        dense_bytes: dense.data_bytes(),
        ffn_bytes: ffn.bundle_bytes(),
        expert_bytes: 0,
        quant: file_meta.ffn_quant.clone(),
        sparsity_mode: mode.name().into(),
        sparsity_rule: rule.name().into(),
        calib_tokens: calib.tokens(),
        heldout_tokens: eval_rows.len(),
        cluster_neurons,
        layers: layer_meta,
        quality: Some(quality),
        predicted_quality: Some(predicted_quality),
        predicted,
        sparsity_auto: auto,
        certificates,
        certificate_study: opts
            .certificate_study
            .then(|| certificate_study::summarise(&studies, quant)),
        seconds: phases,
        memory_estimate: Some(estimate),
        peak_rss_bytes: leanstream::platform::memory::peak_rss_bytes(),
    })
}

/// Copies every dense tensor of `stored` as it is stored (checked on the way) into a new
/// DENSE_DATA of `writer`.
fn copy_dense(writer: &mut ContainerWriter, stored: &Stored) -> Result<DenseIndex> {
    writer.begin_section(leanstream_format::container::SectionKind::DenseData);
    let mut index = DenseIndex::default();
    for t in &stored.file.dense.tensors {
        let bytes = stored.dense_bytes(t)?;
        let (offset, extent_size, checksum) = writer.write_extent(&bytes)?;
        let mut t = t.clone();
        (t.offset, t.extent_size, t.checksum) = (offset, extent_size, checksum);
        index.tensors.push(t);
    }
    writer.end_section();
    Ok(index)
}

/// Installs layer `l` of `stored` in the profiler's model: its attention as stored and its FFN
/// (`[gate, up, down]`, decoded) in f32.
pub(crate) fn install(
    profiler: &mut Profiler,
    stored: &Stored,
    l: usize,
    [gate, up, down]: [Vec<f32>; 3],
) -> Result<()> {
    let c = stored.config();
    let (h, n) = (c.hidden_size, c.intermediate_size);
    // Attention in f32 while it is calibrated: the windows' products then run as one f32 `gemm`
    // each ([`Profiler::new`]) instead of the encoded rows' kernels (the block's memory estimate
    // counts attention in f32). The previous block's f32 buffers are reused: allocating and
    // freeing them block after block fragmented the heap enough that the peak grew with depth.
    let a = stored.attention(l)?;
    let spare = profiler.attention_spare.take();
    let mut spare = spare
        .map(|s| [s.wq, s.wk, s.wv, s.wo])
        .into_iter()
        .flatten();
    let mut f32 = |w: Weight| decoded(w, spare.next());
    let attention = Attention {
        wq: f32(a.wq),
        wk: f32(a.wk),
        wv: f32(a.wv),
        wo: f32(a.wo),
    };
    let model = &mut profiler.model;
    model.set_attention(l, attention);
    model.set_ffn(
        l,
        Some(DenseFfn {
            gate: Weight::F32(Matrix::new(n, h, gate)),
            up: Weight::F32(Matrix::new(n, h, up)),
            down: Weight::F32(Matrix::new(h, n, down)),
        }),
    );
    Ok(())
}

/// `w` in f32, decoded into `spare`'s buffer where there is one (an f32 weight stays as it is).
fn decoded(w: Weight, spare: Option<Weight>) -> Weight {
    let Weight::Encoded(q) = w else {
        return w;
    };
    let mut data = match spare {
        Some(Weight::F32(m)) => m.data,
        _ => Vec::new(),
    };
    data.clear();
    data.resize(q.rows * q.cols, 0.0);
    for (r, row) in data.chunks_exact_mut(q.cols).enumerate() {
        q.dequantize_row(r, row);
    }
    Weight::F32(Matrix::new(q.rows, q.cols, data))
}
