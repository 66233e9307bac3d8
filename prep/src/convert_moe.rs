//! `leanstream-prep convert` of a mixture of experts (Qwen3-MoE, Mixtral) into format 1.5: the
//! dense tensors with each mixture layer's router (kept f32), the dense layers' FFNs and every
//! expert as neuron bundles in page-aligned clusters (FORMAT.md §6.5), and the routing profile
//! measured on the calibration text with the source model in f32. Nothing is calibrated inside the
//! experts yet: every threshold is 0 (the file computes exactly what the source does) and the
//! per-neuron side data (predictors, sketch, refine statistics) is empty.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use leanstream::kernels::{Matrix, Weight};
use leanstream::model::{
    expert_tensor_names, rms_norm, route, Choice, DenseFfn, FfnProbe, Model, MoeFfn,
};
use leanstream::source::config::{ModelConfig, MoeConfig};
use leanstream_format::container::{ContainerWriter, SectionKind};
use leanstream_format::expert::ExpertIndex;
use leanstream_format::ffn::{Cluster, FfnIndex, FfnLayer, PartTypes};
use leanstream_format::meta::{LayerMeta, Meta, Routing};
use leanstream_format::predictor::{Predictor, PredictorInput, Predictors};
use leanstream_format::quant::{quantize_row, row_bytes, QuantType};
use leanstream_format::refine::{Refine, RefineLayer};
use leanstream_format::sketch::{Sketch, SketchLayer};

use crate::calib::{self, Calibration, WINDOW};
use crate::certificate::CertificateChoice;
use crate::convert::{
    bar, check_block_shapes, whole, write_dense, write_index_sections, ConvertOptions, Phases,
    Summary, LAYOUT,
};
use crate::source::Source;
use crate::tensors::ffn_names;

/// Converts the mixture `source` (opened in `phases.load` seconds) as `opts` asks.
pub(crate) fn convert(
    opts: &ConvertOptions,
    source: Source,
    mut phases: Phases,
) -> Result<Summary> {
    let config = source.config.clone();
    let m = config.moe.clone().expect("a mixture's config");
    if opts.sparsity() != "auto" || opts.calibration.certificate == CertificateChoice::Q8 {
        bail!(
            "{}: --sparsity {} / --certificate: sparsity inside experts is not calibrated yet \
             (format 1.5 stores a mixture of experts exactly); drop --sparsity and --certificate",
            opts.model_dir.display(),
            opts.sparsity()
        );
    }
    check_block_shapes(&config, opts.quant)?;
    let get = |name: &str, shape: &[usize]| source.tensor(name, shape);
    let calib = Calibration::new(
        &source.tokenizer,
        opts.calibration.calib.as_deref(),
        &calib::default_text(config.activation),
        opts.calibration
            .calib_tokens
            .unwrap_or(crate::memory_plan::MAX_CALIB_TOKENS),
    )?;
    let (_, eval_rows) = calib.split_rows();
    let eval_prev = calib.previous(&eval_rows);

    let mut writer = ContainerWriter::create(&opts.output)
        .with_context(|| format!("cannot write {}", opts.output.display()))?;
    let t = Instant::now();
    // Dense tensors as the source stores them (`--quant auto` of a GGUF file); the experts in one
    // encoding.
    let stored = |name: &str, shape: &[usize]| match opts.keep {
        true => source.stored(name, shape),
        false => Ok(None),
    };
    let dense = write_dense(&mut writer, &config, opts.quant, &whole(&get), &stored)?;
    phases.dense = t.elapsed().as_secs_f64();

    let (h, n, layers) = (
        config.hidden_size,
        config.intermediate_size,
        config.num_layers,
    );
    let bundle_bytes = 3 * row_bytes(opts.quant, h)?;
    let cluster =
        |neurons: usize| (opts.cluster_kib as usize * 1024 / bundle_bytes).clamp(1, neurons);
    let t = Instant::now();
    // The dense layers' FFNs (an empty FFN_INDEX layer for each mixture layer), then the experts
    // in the routing pass below, which loads them anyway.
    let mut ffn = FfnIndex::default();
    writer.begin_section(LAYOUT.ffn_data());
    for l in 0..layers {
        ffn.layers.push(if config.is_moe_layer(l) {
            FfnLayer {
                qtypes: PartTypes::uniform(opts.quant),
                hidden: h as u32,
                perm: Vec::new(),
                clusters: Vec::new(),
                layout: LAYOUT,
            }
        } else {
            let [gate, up, down] = ffn_names(l);
            let w = [
                get(&gate, &[n, h])?,
                get(&up, &[n, h])?,
                get(&down, &[h, n])?,
            ];
            write_bundles(&mut writer, opts.quant, &w, h, cluster(n))?
        });
    }
    writer.end_section();
    phases.bundles = t.elapsed().as_secs_f64();

    let bar = bar(opts.calibration.progress, layers as u64, "layers");
    let f32_matrix = |name: &str, rows: usize, cols: usize| -> Result<Weight> {
        Ok(Weight::F32(Matrix::new(
            rows,
            cols,
            get(name, &[rows, cols])?,
        )))
    };
    let mut model = Model::without_ffn(config.clone(), get, f32_matrix)?;
    let mut cache = model.new_cache(WINDOW);
    let mut x = Vec::new();
    for w in &calib.windows {
        x.extend(model.embed(w)?);
    }
    let rows = x.len() / h;
    let mut experts = ExpertIndex {
        layers: vec![Vec::new(); layers],
    };
    let mut layer_meta = Vec::with_capacity(layers);
    let mut cluster_neurons = Vec::with_capacity(layers);
    // The previous mixture layer and its choices per row, for its co-selection with the next.
    let mut last_mixture: Option<(usize, Vec<Vec<u32>>)> = None;
    // A mixture layer's look-ahead input (the runtime's): the residual after the previous layer's
    // attention, before its FFN; for the first layer, the residual entering it (the embedding).
    let mut lookahead_input = config.is_moe_layer(0).then(|| x.clone());
    writer.begin_section(LAYOUT.expert_data());
    for l in 0..layers {
        let moe = config.is_moe_layer(l);
        let t = Instant::now();
        bar.set_message(format!(
            "layer {l}: {}",
            if moe { "experts" } else { "dense" }
        ));
        let (neurons, routing) = if moe {
            let mut loaded = Vec::with_capacity(m.num_experts);
            for e in 0..m.num_experts {
                let [gate, up, down] = expert_tensor_names(config.architecture, l, e);
                let k = m.expert_intermediate_size;
                let w = [
                    get(&gate, &[k, h])?,
                    get(&up, &[k, h])?,
                    get(&down, &[h, k])?,
                ];
                experts.layers[l].push(write_bundles(&mut writer, opts.quant, &w, h, cluster(k))?);
                loaded.push(resident_ffn(w, k, h));
            }
            phases.bundles += t.elapsed().as_secs_f64();
            let router = f32_matrix(&router_source(&config, l), m.num_experts, h)?;
            let moe = MoeFfn {
                router,
                experts: loaded,
            };
            (m.expert_intermediate_size, Some(moe))
        } else {
            let [gate, up, down] = ffn_names(l);
            let w = [
                get(&gate, &[n, h])?,
                get(&up, &[n, h])?,
                get(&down, &[h, n])?,
            ];
            model.set_ffn(l, Some(resident_ffn(w, n, h)));
            (n, None)
        };
        cluster_neurons.push(cluster(neurons));
        let t = Instant::now();
        // The layer on every window, keeping its FFN input and, if the next layer is a mixture,
        // the residual after its attention (the next layer's look-ahead input).
        let residual = lookahead_input.take();
        let mut ffn_input = vec![0.0f32; if routing.is_some() { rows * h } else { 0 }];
        let next_mixture = l + 1 < layers && config.is_moe_layer(l + 1);
        let mut after_attention = vec![0.0f32; if next_mixture { rows * h } else { 0 }];
        // The router again, for the profile: the model holds its own copy.
        let router = match routing {
            Some(moe) => {
                model.set_experts(l, Some(moe));
                Some(f32_matrix(&router_source(&config, l), m.num_experts, h)?)
            }
            None => None,
        };
        let mut row = 0;
        for w in &calib.windows {
            let span = row * h..(row + w.len()) * h;
            let mut fi = ffn_input.get_mut(span.clone());
            let mut aa = after_attention.get_mut(span.clone());
            let mut probe = |p: FfnProbe| {
                if let Some(fi) = fi.as_deref_mut() {
                    fi.copy_from_slice(p.ffn_input);
                }
                if let Some(aa) = aa.as_deref_mut() {
                    aa.copy_from_slice(p.residual);
                }
            };
            let x = &mut x[span];
            model.block(l, 0, x, &mut cache, Some(&mut probe));
            row += w.len();
        }
        let routing = match (router, residual) {
            (Some(router), Some(residual)) => {
                let norm = get(
                    &format!("model.layers.{l}.post_attention_layernorm.weight"),
                    &[h],
                )?;
                let (routing, choices) = profile_routing(
                    &Probed {
                        router: &router,
                        ffn_norm: &norm,
                        eps: config.rms_norm_eps,
                        residual: &residual,
                        ffn_input: &ffn_input,
                    },
                    &m,
                    &eval_rows,
                    &eval_prev,
                );
                if let Some((before_layer, before)) = &last_mixture {
                    let earlier: &mut LayerMeta = &mut layer_meta[*before_layer];
                    let earlier = earlier.routing.as_mut().expect("a mixture layer's profile");
                    co_selection(earlier, before, &choices, &eval_rows);
                }
                last_mixture = Some((l, choices));
                Some(routing)
            }
            _ => None,
        };
        lookahead_input = next_mixture.then_some(after_attention);
        model.set_ffn(l, None);
        layer_meta.push(unmeasured(routing));
        phases.profile += t.elapsed().as_secs_f64();
        bar.inc(1);
    }
    writer.end_section();
    bar.finish_and_clear();

    let t = Instant::now();
    let (predictors, sketch, refine) = empty_side_data(layers, h);
    let relu = config.activation.is_relu_like();
    let meta = Meta {
        model: config.clone(),
        dense_quant: opts.quant.name().into(),
        ffn_quant: opts.quant.name().into(),
        sparsity_mode: if relu { "relu" } else { "threshold" }.into(),
        sparsity_target: (!relu).then_some(0.0),
        sparsity_rule: None,
        cluster_kib: opts.cluster_kib,
        layers: layer_meta.clone(),
        provenance: serde_json::json!({
            "source": opts.source_name,
            "converter": concat!("leanstream-prep ", env!("CARGO_PKG_VERSION")),
            "calib_tokens": calib.tokens(),
            "calib_text": calib::text_name(opts.calibration.calib.as_deref(), config.activation),
            "heldout_tokens": eval_rows.len(),
            "experts": "stored exactly: no sparsity is calibrated inside experts (format 1.5)",
        }),
        chat_template: source.chat_template.clone(),
        synthetic: None,
        layout_only: false,
    };
    finish_mixture(
        writer,
        &meta,
        &source.tokenizer_json,
        &dense,
        &ffn,
        (predictors, sketch, refine),
        &experts,
    )?;
    phases.finish = t.elapsed().as_secs_f64();
    Ok(Summary {
        file_bytes: std::fs::metadata(&opts.output)?.len(),
        output: opts.output.clone(),
        dense_bytes: dense.data_bytes(),
        ffn_bytes: ffn.bundle_bytes(),
        expert_bytes: experts.bundle_bytes(),
        quant: opts.quant.name().into(),
        sparsity_mode: meta.sparsity_mode,
        sparsity_rule: "gate".into(),
        calib_tokens: calib.tokens(),
        heldout_tokens: eval_rows.len(),
        cluster_neurons,
        layers: layer_meta,
        quality: None,
        predicted_quality: None,
        predicted: Vec::new(),
        sparsity_auto: None,
        certificates: Vec::new(),
        certificate_study: None,
        seconds: phases,
        memory_estimate: None,
        peak_rss_bytes: leanstream::platform::memory::peak_rss_bytes(),
    })
}

/// The source's name of layer `l`'s router (stored in the file as `model.layers.{l}.mlp.gate`).
fn router_source(c: &ModelConfig, l: usize) -> String {
    leanstream::model::router_tensor_name(c.architecture, l)
}

/// An FFN's f32 weights (gate and up `n × h`, down `h × n`) as the resident model holds them.
fn resident_ffn([gate, up, down]: [Vec<f32>; 3], n: usize, h: usize) -> DenseFfn {
    DenseFfn {
        gate: Weight::F32(Matrix::new(n, h, gate)),
        up: Weight::F32(Matrix::new(n, h, up)),
        down: Weight::F32(Matrix::new(h, n, down)),
    }
}

/// Writes an FFN (`[gate, up, down]` as f32, `n × h`, `n × h`, `h × n`) into the open data section
/// as bundles in their original order, cut into clusters of `cluster` neurons (FORMAT.md §6).
pub(crate) fn write_bundles(
    w: &mut ContainerWriter,
    q: QuantType,
    weights: &[Vec<f32>; 3],
    h: usize,
    cluster: usize,
) -> Result<FfnLayer> {
    let extents = encode_bundles(q, weights, h, cluster)?;
    write_extents(w, q, h, weights[0].len() / h, cluster, &extents)
}

/// The cluster extents (unpadded, in the [`LAYOUT`] the converter writes) of an FFN's bundles in
/// original order, `cluster` neurons each.
pub(crate) fn encode_bundles(
    q: QuantType,
    [gate, up, down]: &[Vec<f32>; 3],
    h: usize,
    cluster: usize,
) -> Result<Vec<Vec<u8>>> {
    let n = gate.len() / h;
    let mut column = vec![0.0f32; h];
    let mut extents = Vec::with_capacity(n.div_ceil(cluster));
    for first in (0..n).step_by(cluster) {
        let mut extent = Vec::with_capacity(cluster.min(n - first) * 3 * row_bytes(q, h)?);
        for i in first..(first + cluster).min(n) {
            for (r, c) in column.iter_mut().enumerate() {
                *c = down[r * n + i];
            }
            extent.extend(quantize_row(q, &gate[i * h..(i + 1) * h])?);
            extent.extend(quantize_row(q, &up[i * h..(i + 1) * h])?);
            extent.extend(quantize_row(q, &column)?);
        }
        extents.push(LAYOUT.arrange(&extent, [row_bytes(q, h)?; 3]));
    }
    Ok(extents)
}

/// Writes [`encode_bundles`]' extents of an FFN of `n` neurons into the open data section.
pub(crate) fn write_extents(
    w: &mut ContainerWriter,
    q: QuantType,
    h: usize,
    n: usize,
    cluster: usize,
    extents: &[Vec<u8>],
) -> Result<FfnLayer> {
    Ok(FfnLayer {
        qtypes: PartTypes::uniform(q),
        hidden: h as u32,
        perm: (0..n as u32).collect(),
        clusters: write_clusters(w, n, cluster, extents)?,
        layout: LAYOUT,
    })
}

/// Writes the extents of an FFN of `n` neurons in clusters of `cluster` (the last may be short),
/// in order, into the open data section, as each comes: their index entries.
pub(crate) fn write_clusters(
    w: &mut ContainerWriter,
    n: usize,
    cluster: usize,
    extents: impl IntoIterator<Item = impl AsRef<[u8]>>,
) -> Result<Vec<Cluster>> {
    let mut clusters = Vec::with_capacity(n.div_ceil(cluster.max(1)));
    for (ci, extent) in extents.into_iter().enumerate() {
        let (offset, extent_size, checksum) = w.write_extent(extent.as_ref())?;
        clusters.push(Cluster {
            first: (ci * cluster) as u32,
            count: cluster.min(n - ci * cluster) as u32,
            offset,
            extent_size,
            checksum,
        });
    }
    Ok(clusters)
}

/// What the routing pass kept of one mixture layer (rows = calibration tokens of all windows).
struct Probed<'a> {
    router: &'a Weight,
    ffn_norm: &'a [f32],
    eps: f32,
    /// The look-ahead's input (`rows × hidden`): the residual after the previous layer's
    /// attention, or entering the layer if it is the first.
    residual: &'a [f32],
    /// The layer's normalised FFN input (`rows × hidden`).
    ffn_input: &'a [f32],
}

/// The routing profile (FORMAT.md §4.2 `routing`) on `rows`, whose previous tokens in their window
/// are `prev`.
/// Also returns every row's chosen experts, for the co-selection with the next mixture layer.
fn profile_routing(
    p: &Probed,
    m: &MoeConfig,
    rows: &[usize],
    prev: &[Option<usize>],
) -> (Routing, Vec<Vec<u32>>) {
    let (e_count, k) = (m.num_experts, m.experts_per_token);
    let h = p.ffn_norm.len();
    let mut logits = vec![0.0f32; e_count];
    let mut chosen = vec![
        Choice {
            expert: 0,
            weight: 0.0
        };
        k
    ];
    let mut choose = |x: &[f32]| -> Vec<u32> {
        p.router.matmul_t(x, 1, &mut logits);
        route(&logits, m.norm_topk_prob, &mut chosen);
        chosen.iter().map(|c| c.expert).collect()
    };
    let total = p.ffn_input.len() / h;
    let choices: Vec<Vec<u32>> = (0..total)
        .map(|r| choose(&p.ffn_input[r * h..(r + 1) * h]))
        .collect();
    let mut freq = vec![0.0f32; e_count];
    let (mut reused, mut followed, mut found) = (0usize, 0usize, 0usize);
    let mut xn = vec![0.0f32; h];
    for (&r, prev) in rows.iter().zip(prev) {
        let now = &choices[r];
        now.iter().for_each(|&e| freq[e as usize] += 1.0);
        if let Some(before) = prev {
            reused += now.iter().filter(|e| choices[*before].contains(e)).count();
            followed += k;
        }
        rms_norm(&p.residual[r * h..(r + 1) * h], p.ffn_norm, p.eps, &mut xn);
        found += choose(&xn).iter().filter(|e| now.contains(e)).count();
    }
    let share = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f32 / b as f32 };
    freq.iter_mut().for_each(|f| *f /= rows.len().max(1) as f32);
    let routing = Routing {
        expert_freq: freq,
        token_reuse: share(reused, followed),
        lookahead_recall: share(found, k * rows.len()),
        next_partners: Vec::new(),
        next_partner_share: Vec::new(),
    };
    (routing, choices)
}

/// Sets `earlier`'s co-selection with the next mixture layer, whose choices are `later` (both
/// per row; measured on `rows`).
pub(crate) fn co_selection(
    earlier: &mut Routing,
    before: &[Vec<u32>],
    after: &[Vec<u32>],
    rows: &[usize],
) {
    let e_count = earlier.expert_freq.len();
    let mut counts = vec![0usize; e_count * e_count];
    let mut chosen = vec![0usize; e_count];
    for &r in rows {
        for &e in &before[r] {
            chosen[e as usize] += 1;
            for &o in &after[r] {
                counts[e as usize * e_count + o as usize] += 1;
            }
        }
    }
    (earlier.next_partners, earlier.next_partner_share) = (0..e_count)
        .map(|e| {
            let row = &counts[e * e_count..(e + 1) * e_count];
            // The first of the most frequent (ties to the lower index); itself if never chosen.
            let best = (1..e_count).fold(0, |b, o| if row[o] > row[b] { o } else { b });
            let best = if chosen[e] == 0 { e } else { best };
            let share = if chosen[e] == 0 {
                0.0
            } else {
                row[best] as f32 / chosen[e] as f32
            };
            (best as u32, share)
        })
        .unzip();
}

/// A layer the converter does not calibrate (1.5: a mixture's layers): threshold 0, no
/// measurements, with its routing profile if it is a mixture layer.
pub(crate) fn unmeasured(routing: Option<Routing>) -> LayerMeta {
    LayerMeta {
        threshold: 0.0,
        sparsity: 0.0,
        predictor_recall: 0.0,
        predictor_precision: 0.0,
        lookahead_recall: 0.0,
        lookahead_precision: 0.0,
        static_recall: 0.0,
        cluster_fill: 0.0,
        cluster_fill_unordered: 0.0,
        activity: None,
        certificate_saves: None,
        routing,
    }
}

/// Writes a mixture's META, tokenizer and index sections after its data sections, and finishes
/// the file.
pub(crate) fn finish_mixture(
    mut writer: ContainerWriter,
    meta: &Meta,
    tokenizer_json: &[u8],
    dense: &leanstream_format::dense::DenseIndex,
    ffn: &FfnIndex,
    side: (Predictors, Sketch, Refine),
    experts: &ExpertIndex,
) -> Result<()> {
    write_index_sections(&mut writer, meta, tokenizer_json, dense, ffn, &side)?;
    writer.add_section(SectionKind::ExpertIndex, &experts.encode(), false)?;
    writer.finish()?;
    Ok(())
}

/// Empty predictors, sketch and refine statistics for every layer (FORMAT.md §6.5: a mixture's
/// file has no per-neuron side data in 1.5).
pub(crate) fn empty_side_data(layers: usize, h: usize) -> (Predictors, Sketch, Refine) {
    let (mut predictors, mut sketch, mut refine) =
        (Predictors::default(), Sketch::default(), Refine::default());
    for l in 0..layers {
        let empty = |source_layer: usize, input| Predictor {
            source_layer: source_layer as u32,
            input,
            input_dim: h as u32,
            rank: 0,
            outputs: 0,
            threshold: 0.0,
            w1: Vec::new(),
            b1: Vec::new(),
            w2: Vec::new(),
            b2: Vec::new(),
        };
        predictors
            .lookahead
            .push(empty(l.saturating_sub(1), PredictorInput::Residual));
        predictors.own.push(empty(l, PredictorInput::FfnInput));
        sketch.layers.push(SketchLayer {
            qtype: QuantType::Q8_0,
            hidden: h as u32,
            rows: Vec::new(),
            err_norm: Vec::new(),
        });
        refine.layers.push(RefineLayer {
            cluster_freq: Vec::new(),
            neighbours: Vec::new(),
            neuron_freq: Vec::new(),
            neuron_mag: Vec::new(),
        });
    }
    (predictors, sketch, refine)
}
