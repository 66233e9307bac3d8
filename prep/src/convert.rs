//! `leanstream-prep convert`: profile, sparsify, place, train predictors, quantize and write one
//! checksummed file, one layer at a time.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use leanstream::kernels::{Matrix, Weight};
use leanstream::model::{Attention, DenseFfn, Model};
use leanstream::source::config::{Activation, ModelConfig};
use leanstream::streaming::default_predictor_rank;
use leanstream::streaming::skip_rule::{Skip, SkipRule};
use leanstream_format::container::{ContainerWriter, SectionKind};
use leanstream_format::dense::{DenseIndex, DenseTensor};
use leanstream_format::ffn::{Cluster, ClusterLayout, FfnIndex, FfnLayer};
use leanstream_format::meta::{LayerMeta, Meta};
use leanstream_format::predictor::{Predictor, PredictorInput, Predictors};
use leanstream_format::quant::{row_bytes, QuantType};
use leanstream_format::refine::{Refine, RefineLayer};
use leanstream_format::sketch::Sketch;
use serde::Serialize;

use crate::activity;
use crate::calib::{self, Calibration};
use crate::certificate::{self, CertificateChoice};
use crate::certificate_study;
use crate::memory_plan;
use crate::placement::{cluster_fill, place};
use crate::profile::{LayerProfile, Profiler, StreamRule};
use crate::source::Source;
use crate::sparsity::{
    allocate, auto_search, cost_curve, down_norms, level, level_thresholds, masks, pow2_norms,
    quantile, rescale, scores, AutoChoice, SparsityMode,
};
use crate::tensors::{dense_specs, ffn_names, quantize_rows, BundleRows};
use crate::train::{
    at_threshold, energies, massive, miss_threshold, normalise_rows, score_threshold, targets,
    top_k_quality, train, AtThreshold, TrainConfig, Trained,
};

/// Partners per cluster kept in the refine statistics.
const NEIGHBOURS: usize = 8;
/// The layout of the cluster extents the converter writes (FORMAT.md §6.3): split, format 1.6.
pub(crate) const LAYOUT: ClusterLayout = ClusterLayout::Split;
/// Predicted-active budget, as a multiple of the true active fraction, at which recall is judged
/// (and, under the `gate` rule, the own predictor's threshold).
const BUDGET_FACTOR: f32 = 1.5;
/// Under `gate_up`, the own predictor's threshold lets the active neurons it misses on the training
/// split carry at most this multiple of the squared contribution (`c²`, summed) the rule itself
/// skips there, so predicted mode adds at most about that much to exact mode's error in each layer.
const MISS_SHARE: f64 = 0.5;
/// The own predictor's output bias for a neuron it always names (its output weights zeroed):
/// `sigmoid(30)` is 1 in f32.
const ALWAYS_LOGIT: f32 = 30.0;

pub struct ConvertOptions {
    pub model_dir: PathBuf,
    pub source_name: String,
    pub output: PathBuf,
    pub quant: QuantType,
    /// Each tensor keeps the source's encoding where the file format has it (a GGUF file under
    /// `--quant auto`; [`crate::quant_choice`]); `quant` encodes the rest.
    pub keep: bool,
    pub sparsity: String,
    pub certificate: CertificateChoice,
    /// Measure every candidate certificate design on the held-out profile
    /// ([`crate::certificate_study`]); the file does not change.
    pub certificate_study: bool,
    pub calib: Option<PathBuf>,
    /// Calibration tokens (default: [`memory_plan::default_calib_tokens`]).
    pub calib_tokens: Option<usize>,
    pub predictor_rank: Option<usize>,
    /// Predictor training epochs (default: [`memory_plan::default_epochs`]).
    pub epochs: Option<usize>,
    pub cluster_kib: u32,
    pub progress: bool,
}

#[derive(Debug, Serialize)]
pub struct Summary {
    pub output: PathBuf,
    pub file_bytes: u64,
    pub dense_bytes: u64,
    pub ffn_bytes: u64,
    /// Bytes of a mixture's experts' bundles (0 for a dense model).
    pub expert_bytes: u64,
    pub quant: String,
    pub sparsity_mode: String,
    pub sparsity_rule: String,
    pub calib_tokens: usize,
    pub heldout_tokens: usize,
    pub cluster_neurons: Vec<usize>,
    pub layers: Vec<LayerMeta>,
    /// The sparse model (`perplexity`) against the dense one (`reference_perplexity`) on the
    /// held-out calibration windows; none for a mixture of experts (nothing is made sparse).
    pub quality: Option<leanstream::text::perplexity::Comparison>,
    /// The same in predicted mode (only the neurons the own predictors name, of those active).
    pub predicted_quality: Option<leanstream::text::perplexity::Comparison>,
    /// Each layer's own predictor at the file's threshold, on the held-out rows (none for a
    /// mixture).
    pub predicted: Vec<PredictedLayer>,
    /// What `--sparsity auto` chose and measured.
    pub sparsity_auto: Option<AutoChoice>,
    /// Each layer's certificate encoding (`none` where it has none).
    pub certificates: Vec<String>,
    /// `--certificate-study`: every candidate design's bytes and reads.
    pub certificate_study: Option<certificate_study::Study>,
    pub seconds: Phases,
    /// The peak memory stated before any work (none for a mixture of experts).
    pub memory_estimate: Option<memory_plan::Estimate>,
    /// The peak resident size the OS measured.
    pub peak_rss_bytes: Option<u64>,
}

/// A layer's own predictor as predicted mode uses it.
#[derive(Debug, Serialize)]
pub struct PredictedLayer {
    #[serde(flatten)]
    pub quality: AtThreshold,
    /// Neurons it always names ([`massive`]).
    pub always: usize,
}

#[derive(Debug, Default, Serialize)]
pub struct Phases {
    pub load: f64,
    pub dense: f64,
    pub allocate: f64,
    pub profile: f64,
    pub place: f64,
    pub train: f64,
    pub bundles: f64,
    pub finish: f64,
}

/// The smallest default predictor rank (a model so small that its share buys less).
pub(crate) const MIN_PREDICTOR_RANK: usize = 4;

pub fn convert(opts: &ConvertOptions) -> Result<Summary> {
    let mut phases = Phases::default();
    let t = Instant::now();
    let source = Source::open(&opts.model_dir)?;
    let config = source.config.clone();
    if config.moe.is_some() {
        phases.load = t.elapsed().as_secs_f64();
        return crate::convert_moe::convert(opts, source, phases);
    }
    let get = |name: &str, shape: &[usize]| source.tensor(name, shape);
    // The embedding, the head and the norms only: each block's attention and FFN are loaded
    // when the calibration reaches it and dropped after ([`install`]), so peak memory is the
    // embedding plus one block plus the profiling buffers, whatever the depth.
    let model = profiling_model(&config, &get)?;
    let (tokenizer, tokenizer_json) = (&source.tokenizer, &source.tokenizer_json);
    let mut mode = SparsityMode::parse(&opts.sparsity, config.activation)?;
    let rule = mode.rule();
    let with_certificate = opts.certificate.wanted(rule)?;
    let encodings = if with_certificate {
        opts.certificate.encodings(opts.quant)
    } else {
        Vec::new()
    };
    check_block_shapes(&config, opts.quant)?;
    let calib = Calibration::new(
        tokenizer,
        opts.calib.as_deref(),
        &calib::default_text(config.activation),
        opts.calib_tokens
            .unwrap_or_else(|| memory_plan::default_calib_tokens(&config)),
    )?;
    let estimate =
        memory_plan::estimate(&config, calib.tokens(), source.file_bytes(&opts.model_dir));
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
    phases.load = t.elapsed().as_secs_f64();

    let mut writer = ContainerWriter::create(&opts.output)
        .with_context(|| format!("cannot write {}", opts.output.display()))?;
    let t = Instant::now();
    let stored = |name: &str, shape: &[usize]| match opts.keep {
        true => source.stored(name, shape),
        false => Ok(None),
    };
    let dense = write_dense(&mut writer, &config, opts.quant, &get, &stored)?;
    phases.dense = t.elapsed().as_secs_f64();

    let (train_rows, eval_rows) = calib.split_rows();
    let eval_prev = calib.previous(&eval_rows);
    let bundle_bytes = 3 * row_bytes(opts.quant, config.hidden_size)?;
    let rank = opts.predictor_rank.unwrap_or_else(|| {
        default_predictor_rank(
            config.hidden_size,
            config.intermediate_size,
            bundle_bytes,
            MIN_PREDICTOR_RANK,
        )
    });
    let mut profiler = Profiler::new(model, &calib)?;
    let t = Instant::now();
    let (fractions, auto) = layer_fractions(
        mode,
        &mut profiler,
        &get,
        &train_rows,
        (opts.keep, opts.progress),
    )?;
    phases.allocate = t.elapsed().as_secs_f64();
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
    // Two held-out streams: exact mode (the file's thresholds) and predicted mode (also its own
    // predictors).
    profiler.restart_sparse(2)?;
    let bar = bar(opts.progress, config.num_layers as u64, "layers");
    let mut ffn = FfnIndex::default();
    let (mut predictors, mut sketch, mut refine) =
        (Predictors::default(), Sketch::default(), Refine::default());
    let mut layer_meta = Vec::new();
    let mut predicted = Vec::new();
    let mut cluster_neurons = Vec::new();
    let (mut studies, mut certificates) = (Vec::new(), Vec::new());
    let mut prev_residual: Option<Vec<f32>> = None;
    writer.begin_section(LAYOUT.ffn_data());
    let (h, n) = (config.hidden_size, config.intermediate_size);
    let act = config.activation;
    for (l, &fraction) in fractions.iter().enumerate() {
        bar.set_message(format!("layer {l}: profile"));
        let t = Instant::now();
        let (gate, up, down, up_scale) = ffn_weights(&get, l, h, n, rule, opts.keep)?;
        let rows = match opts.keep {
            true => BundleRows::kept(&source, l, h, n, opts.quant)?,
            false => BundleRows::uniform(opts.quant, h),
        };
        let row_bytes = rows.row_bytes()?;
        let bundle_bytes: usize = row_bytes.iter().sum();
        install(
            &mut profiler.model,
            &get,
            l,
            dense_ffn(&gate, &up, &down, h, n),
        )?;
        // What the layer's FFN saw; the gate pre-activations only give the scores, so they go
        // at once (each `rows × n` array of f32 is the bulk of the converter's memory).
        let LayerProfile {
            residual,
            ffn_input,
            gate: pre,
            coef,
        } = profiler.layer(l);
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

        bar.set_message(format!("layer {l}: place"));
        let t = Instant::now();
        let cluster_size = (opts.cluster_kib as usize * 1024 / bundle_bytes).clamp(1, n);
        let perm = place(&mask, n, &train_rows, cluster_size);
        let identity: Vec<u32> = (0..n as u32).collect();
        let fill = cluster_fill(&mask, n, &eval_rows, &perm, cluster_size);
        let fill_unordered = cluster_fill(&mask, n, &eval_rows, &identity, cluster_size);
        phases.place += t.elapsed().as_secs_f64();

        bar.set_message(format!("layer {l}: train"));
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
        // by what its misses carry rather than by a budget. ReLU keeps the budget: `relu(g) = 0`
        // is exact, and its misses are the rule's own small gates.
        let e_eval = energies(&coef, &mask, n, &eval_rows);
        let by_contribution = rule == SkipRule::GateUp || act != Activation::Relu;
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
        profiler.sparse_layer(
            l,
            &[
                StreamRule::exact(skip),
                StreamRule {
                    skip,
                    predictor: Some((&own, own_thr)),
                },
            ],
        );
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

        bar.set_message(format!("layer {l}: bundles"));
        let t = Instant::now();
        let mut gate_rows = Vec::new();
        let mut clusters = Vec::new();
        for (ci, chunk) in perm.chunks(cluster_size).enumerate() {
            let mut extent = Vec::with_capacity(chunk.len() * bundle_bytes);
            for &i in chunk {
                let i = i as usize;
                let g = rows.gate(i, &gate)?;
                extent.extend_from_slice(&g);
                if with_certificate || opts.certificate_study {
                    gate_rows.push(g);
                }
                extent.extend(rows.up(i, &up, &up_scale)?);
                extent.extend(rows.down(i, &down, n)?);
            }
            let extent = LAYOUT.arrange(&extent, row_bytes);
            let (offset, extent_size, checksum) = writer.write_extent(&extent)?;
            let first = (ci * cluster_size) as u32;
            clusters.push(Cluster {
                first,
                count: chunk.len() as u32,
                offset,
                extent_size,
                checksum,
            });
        }
        let (sketch_layer, certificate_saves) = certificate::build(
            &gate_rows,
            rows.parts.gate,
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
                bundle: rows.parts.gate,
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
        ffn.layers.push(FfnLayer {
            qtypes: rows.parts,
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
        bar.inc(1);
    }
    writer.end_section();
    bar.finish_and_clear();

    let t = Instant::now();
    let [quality, predicted_quality]: [_; 2] = profiler.quality().try_into().expect("two streams");
    let meta = Meta {
        model: config.clone(),
        dense_quant: crate::tensors::dense_quant_name(&dense),
        ffn_quant: crate::tensors::ffn_quant_name(&ffn),
        sparsity_mode: mode.name().into(),
        sparsity_target: mode.target(),
        sparsity_rule: (rule != SkipRule::Gate).then(|| rule.name().into()),
        cluster_kib: opts.cluster_kib,
        layers: layer_meta.clone(),
        provenance: serde_json::json!({
            "source": opts.source_name,
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
        chat_template: source.chat_template.clone(),
        synthetic: None,
    };
    let side = (predictors, sketch, refine);
    write_index_sections(&mut writer, &meta, tokenizer_json, &dense, &ffn, &side)?;
    writer.finish()?;
    phases.finish = t.elapsed().as_secs_f64();
    Ok(Summary {
        file_bytes: std::fs::metadata(&opts.output)?.len(),
        output: opts.output.clone(),
        dense_bytes: dense.data_bytes(),
        ffn_bytes: ffn.bundle_bytes(),
        expert_bytes: 0,
        quant: meta.ffn_quant.clone(),
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
            .then(|| certificate_study::summarise(&studies, opts.quant)),
        seconds: phases,
        memory_estimate: Some(estimate),
        peak_rss_bytes: leanstream::platform::memory::peak_rss_bytes(),
    })
}

/// An empty matrix: a block's attention projections while the calibration is elsewhere.
fn placeholder() -> Weight {
    Weight::F32(Matrix::new(0, 0, Vec::new()))
}

/// The model the calibration runs: embedding, head and norms in f32, every block's attention a
/// [`placeholder`] and no FFN until [`install`]ed.
pub(crate) fn profiling_model(
    config: &ModelConfig,
    get: &impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
) -> Result<Model> {
    Model::without_ffn(config.clone(), get, |name, rows, cols| {
        Ok(if name.contains(".self_attn.") {
            placeholder()
        } else {
            Weight::F32(Matrix::new(rows, cols, get(name, &[rows, cols])?))
        })
    })
}

/// Loads block `l`'s attention projections as f32 into `model` and installs `ffn`.
pub(crate) fn install(
    model: &mut Model,
    get: &impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
    l: usize,
    ffn: DenseFfn,
) -> Result<()> {
    let c = model.config();
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (q, kv) = (c.num_heads * hd, c.num_kv_heads * hd);
    let p = format!("model.layers.{l}.self_attn");
    let mat = |name: &str, rows: usize, cols: usize| -> Result<Weight> {
        let name = format!("{p}.{name}.weight");
        Ok(Weight::F32(Matrix::new(
            rows,
            cols,
            get(&name, &[rows, cols])?,
        )))
    };
    let attention = Attention {
        wq: mat("q_proj", q, h)?,
        wk: mat("k_proj", kv, h)?,
        wv: mat("v_proj", kv, h)?,
        wo: mat("o_proj", h, q)?,
    };
    model.set_attention(l, attention);
    model.set_ffn(l, Some(ffn));
    Ok(())
}

/// Drops block `l`'s attention and FFN weights from the profiler's model (see [`install`]) and
/// its keys and values.
pub(crate) fn uninstall(profiler: &mut Profiler, l: usize) {
    profiler.release_layer(l);
    let model = &mut profiler.model;
    model.set_ffn(l, None);
    let empty = Attention {
        wq: placeholder(),
        wk: placeholder(),
        wv: placeholder(),
        wo: placeholder(),
    };
    model.set_attention(l, empty);
}

/// Layer `l`'s gate, up and down weights as f32 (`n × h`, `n × h`, `h × n`); under the `gate_up`
/// rule with every up row scaled by its down column's norm and the column normalised, so the
/// rule's score is the norm of the neuron's contribution (see [`down_norms`]).
/// Layer `l`'s gate, up and down matrices in f32, rescaled for the `gate_up` rule
/// ([`rescale`]; by powers of two if `pow2`, so that stored up rows keep their encoding), and the
/// power of two each up row was scaled by (empty unless `pow2`).
type FfnWeights = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<i32>);

fn ffn_weights(
    get: &impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
    l: usize,
    h: usize,
    n: usize,
    rule: SkipRule,
    pow2: bool,
) -> Result<FfnWeights> {
    let [gate_name, up_name, down_name] = ffn_names(l);
    let gate = get(&gate_name, &[n, h])?;
    let mut up = get(&up_name, &[n, h])?;
    let mut down = get(&down_name, &[h, n])?;
    let mut exponents = Vec::new();
    if rule == SkipRule::GateUp {
        let mut norms = down_norms(&down, h, n);
        if pow2 {
            exponents = pow2_norms(&mut norms);
        }
        rescale(&mut up, &mut down, &norms, h);
    }
    Ok((gate, up, down, exponents))
}

fn dense_ffn(gate: &[f32], up: &[f32], down: &[f32], h: usize, n: usize) -> DenseFfn {
    DenseFfn {
        gate: Weight::F32(Matrix::new(n, h, gate.to_vec())),
        up: Weight::F32(Matrix::new(n, h, up.to_vec())),
        down: Weight::F32(Matrix::new(h, n, down.to_vec())),
    }
}

/// The fraction of neurons each layer skips: none for `relu`, the target everywhere for a uniform
/// mode, else [`allocate`]d from each layer's cost curve, measured in one dense pass over the
/// calibration text before the real one; for `auto`, at the fraction [`auto_search`] picks (then
/// also returned).
fn layer_fractions(
    mode: SparsityMode,
    profiler: &mut Profiler,
    get: &impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
    train_rows: &[usize],
    (pow2, progress): (bool, bool),
) -> Result<(Vec<f32>, Option<AutoChoice>)> {
    let c = profiler.model.config().clone();
    let (h, n, layers) = (c.hidden_size, c.intermediate_size, c.num_layers);
    let fraction = match mode {
        SparsityMode::Relu => return Ok((vec![0.0; layers], None)),
        SparsityMode::Threshold(f)
        | SparsityMode::Target {
            fraction: f,
            allocate: false,
        } => return Ok((vec![f; layers], None)),
        SparsityMode::Target { fraction, .. } => Some(fraction),
        SparsityMode::Auto => None,
    };
    let bar = bar(progress, layers as u64, "layers (allocation)");
    let (mut curves, mut thresholds) = (Vec::with_capacity(layers), Vec::with_capacity(layers));
    for l in 0..layers {
        let (gate, up, down, _) = ffn_weights(get, l, h, n, mode.rule(), pow2)?;
        install(
            &mut profiler.model,
            get,
            l,
            dense_ffn(&gate, &up, &down, h, n),
        )?;
        let prof = profiler.layer(l);
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
        uninstall(profiler, l);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let auto = match fraction {
        Some(_) => None,
        // The profiler now holds the dense model's output on every window.
        None => Some(auto_search(|fractions| {
            heldout_costs(
                profiler,
                get,
                mode.rule(),
                &curves,
                &thresholds,
                fractions,
                (pow2, progress),
            )
        })?),
    };
    profiler.restart()?;
    let fraction = fraction.or(auto.as_ref().map(|a| a.fraction));
    Ok((allocate(&curves, fraction.expect("set above")), auto))
}

/// The held-out perplexity cost (`perplexity / dense perplexity − 1`) of each of `fractions`,
/// [`allocate`]d by `curves` at the `thresholds` of the dense pass that measured them (the ones the
/// file would get): one pass through the layers with a sparse stream per fraction, after a dense
/// pass through every layer.
fn heldout_costs(
    profiler: &mut Profiler,
    get: &impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
    rule: SkipRule,
    curves: &[Vec<f64>],
    thresholds: &[Vec<f32>],
    fractions: &[f32],
    (pow2, progress): (bool, bool),
) -> Result<Vec<f64>> {
    let c = profiler.model.config().clone();
    let (h, n) = (c.hidden_size, c.intermediate_size);
    let allocations: Vec<Vec<f32>> = fractions.iter().map(|&f| allocate(curves, f)).collect();
    profiler.restart_sparse(fractions.len())?;
    let bar = bar(progress, c.num_layers as u64, "layers (auto)");
    for (l, t) in thresholds.iter().enumerate() {
        let (gate, up, down, _) = ffn_weights(get, l, h, n, rule, pow2)?;
        install(
            &mut profiler.model,
            get,
            l,
            dense_ffn(&gate, &up, &down, h, n),
        )?;
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
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(profiler
        .quality()
        .iter()
        .map(|q| q.perplexity / q.reference_perplexity - 1.0)
        .collect())
}

/// Writes the sections that follow a file's data — META, tokenizer, the dense and FFN indexes
/// and the per-neuron side data — raising the file's minor version to what they use. The one
/// writer of these sections for `convert`, its mixture-of-experts path and `synth`.
pub(crate) fn write_index_sections(
    writer: &mut ContainerWriter,
    meta: &Meta,
    tokenizer_json: &[u8],
    dense: &DenseIndex,
    ffn: &FfnIndex,
    (predictors, sketch, refine): &(Predictors, Sketch, Refine),
) -> Result<()> {
    writer.require_minor(meta.minor_version().max(sketch.minor_version()));
    writer.require_minor(dense.minor_version().max(ffn.minor_version()));
    writer.add_section(SectionKind::Meta, &serde_json::to_vec_pretty(meta)?, false)?;
    add_tokenizer(writer, tokenizer_json)?;
    writer.add_section(SectionKind::DenseIndex, &dense.encode(), false)?;
    writer.add_section(SectionKind::FfnIndex, &ffn.encode(), false)?;
    writer.add_section(SectionKind::Predictors, &predictors.encode(), false)?;
    writer.add_section(SectionKind::Sketch, &sketch.encode(), false)?;
    writer.add_section(SectionKind::Refine, &refine.encode(), false)?;
    Ok(())
}

/// Writes TOKENIZER, and BPE_VOCAB when the compact tokenizer reproduces `tokenizer.json` (else
/// says why on stderr: the runtime then parses `tokenizer.json`, about ten times its size).
fn add_tokenizer(writer: &mut ContainerWriter, json: &[u8]) -> Result<()> {
    writer.add_section(SectionKind::Tokenizer, json, true)?;
    match leanstream::tokenizer::bpe_vocab(json) {
        Ok(vocab) => writer.add_section(SectionKind::BpeVocab, &vocab.encode(), false)?,
        Err(e) => eprintln!(
            "note: the file gets no compact tokenizer ({e:#}); the runtime will parse tokenizer.json"
        ),
    }
    Ok(())
}

/// Block types need rows of whole blocks; say so before any work is done.
pub(crate) fn check_block_shapes(c: &ModelConfig, q: QuantType) -> Result<()> {
    for (what, n) in [
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("head_dim × heads", c.num_heads * c.head_dim),
    ] {
        row_bytes(q, n).with_context(|| {
            format!(
                "--quant {q} cannot encode this model ({what} = {n} is no multiple of {}, the \
                 values of one {q} block); use q8, q4_1 or f16",
                q.block_len()
            )
        })?;
    }
    Ok(())
}

/// Writes every dense tensor: as the source stores it where `stored` gives its encoded rows
/// ([`crate::source::Source::stored`]; not vectors or routers, which stay f32), else encoded as
/// `quant`.
pub(crate) fn write_dense(
    writer: &mut ContainerWriter,
    config: &ModelConfig,
    quant: QuantType,
    get: &impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
    stored: &impl Fn(&str, &[usize]) -> Result<Option<(QuantType, Vec<u8>)>>,
) -> Result<DenseIndex> {
    writer.begin_section(SectionKind::DenseData);
    let mut index = DenseIndex::default();
    for spec in dense_specs(config) {
        if !spec.stays_f32() {
            if let Some((qtype, bytes)) = stored(&spec.source, &spec.shape)? {
                index
                    .tensors
                    .push(write_tensor(writer, &spec, qtype, &bytes)?);
                continue;
            }
        }
        let data = get(&spec.source, &spec.shape)?;
        let qtype = if spec.stays_f32() {
            QuantType::F32
        } else {
            quant
        };
        let cols = *spec.shape.last().expect("shape");
        let bytes = quantize_rows(qtype, &data, cols, &spec.name)?;
        index
            .tensors
            .push(write_tensor(writer, &spec, qtype, &bytes)?);
    }
    writer.end_section();
    Ok(index)
}

/// Writes an encoded dense tensor as one extent of the open DENSE_DATA; returns its index entry.
pub(crate) fn write_tensor(
    writer: &mut ContainerWriter,
    spec: &crate::tensors::DenseSpec,
    qtype: QuantType,
    bytes: &[u8],
) -> Result<DenseTensor> {
    let (offset, extent_size, checksum) = writer.write_extent(bytes)?;
    Ok(DenseTensor {
        name: spec.name.clone(),
        qtype,
        shape: spec.shape.iter().map(|&d| d as u64).collect(),
        offset,
        size: bytes.len() as u64,
        extent_size,
        checksum,
    })
}

/// Cluster and neuron statistics in stored order.
pub(crate) fn refine_stats(
    mask: &[bool],
    score: &[f32],
    n: usize,
    rows: &[usize],
    perm: &[u32],
    cluster_size: usize,
) -> RefineLayer {
    let clusters = n.div_ceil(cluster_size);
    let mut active = ndarray::Array2::<f32>::zeros((rows.len(), clusters));
    let (mut freq, mut mag) = (vec![0.0f32; n], vec![0.0f32; n]);
    for (ri, &r) in rows.iter().enumerate() {
        for (p, &i) in perm.iter().enumerate() {
            let i = i as usize;
            if mask[r * n + i] {
                active[[ri, p / cluster_size]] = 1.0;
                freq[p] += 1.0;
                mag[p] += score[r * n + i];
            }
        }
    }
    for p in 0..n {
        if freq[p] > 0.0 {
            mag[p] /= freq[p];
        }
        freq[p] /= rows.len().max(1) as f32;
    }
    let co = active.t().dot(&active);
    let cluster_count: Vec<f32> = (0..clusters).map(|c| co[[c, c]]).collect();
    let k = NEIGHBOURS.min(clusters.saturating_sub(1));
    let neighbours = (0..clusters)
        .map(|c| {
            let mut others: Vec<(u32, f32)> = (0..clusters)
                .filter(|&o| o != c)
                .map(|o| {
                    (
                        o as u32,
                        if cluster_count[c] > 0.0 {
                            co[[c, o]] / cluster_count[c]
                        } else {
                            0.0
                        },
                    )
                })
                .collect();
            others.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            others.truncate(k);
            others
        })
        .collect();
    let denom = rows.len().max(1) as f32;
    RefineLayer {
        cluster_freq: cluster_count.iter().map(|c| c / denom).collect(),
        neighbours,
        neuron_freq: freq,
        neuron_mag: mag,
    }
}

/// Reorders a predictor's outputs into stored order and packs it for the file.
pub(crate) fn to_predictor(
    t: Trained,
    perm: &[u32],
    source_layer: usize,
    input: PredictorInput,
    threshold: f32,
) -> Predictor {
    let (rank, d) = t.w1.dim();
    let mut w2 = Vec::with_capacity(perm.len() * rank);
    let mut b2 = Vec::with_capacity(perm.len());
    for &i in perm {
        w2.extend(t.w2.row(i as usize).iter());
        b2.push(t.b2[i as usize]);
    }
    Predictor {
        source_layer: source_layer as u32,
        input,
        input_dim: d as u32,
        rank: rank as u32,
        outputs: perm.len() as u32,
        threshold,
        w1: t.w1.iter().copied().collect(),
        b1: t.b1.to_vec(),
        w2,
        b2,
    }
}

pub(crate) fn bar(show: bool, len: u64, what: &str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template(&format!(
            "{{bar:40}} {{pos}}/{{len}} {what}  {{elapsed}} (eta {{eta}})  {{msg}}"
        ))
        .expect("valid template"),
    );
    b
}
