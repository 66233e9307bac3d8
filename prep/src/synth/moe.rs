//! `synth` of a mixture-of-experts shape (Qwen3-30B-A3B): random experts, and routers planted so
//! that routing has a profile's statistics — per layer, how unevenly the experts are chosen
//! (`expert_freq`, sorted, spread over this shape's experts) and how many of a token's experts the
//! previous token also chose (`token_reuse`).
//!
//! The residual stream is the dense synth's (see [`super::dense`]): a bias channel, a fast part
//! (the token's own) and a slow part (a moving average over the last few tokens), the same entering
//! every layer, since later attentions write nothing and the experts' outputs are tiny. A router
//! row is `b_e` on the bias channel, a random direction over the fast part weighted `cos α`, and
//! one over the slow part weighted `sin α`: the biases set how often each expert wins (fitted to
//! the target frequencies), α how much routing follows the slow part that consecutive tokens
//! share (solved for the target reuse). Since the residual hardly changes between layers, the next
//! layer's router sees almost its own input early: the look-ahead (layer `l`'s router on the
//! residual after layer `l − 1`'s attention, as the runtime computes it) sees layer 0's output from
//! layer 1 on, and its recall on this file is near 1 there, an upper bound for real models, whose
//! recall the trained tiny mixture measures.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use leanstream::model::{route, Choice};
use leanstream::tokenizer::Tokenizer;
use leanstream_format::container::{ContainerWriter, SectionKind};
use leanstream_format::dense::DenseIndex;
use leanstream_format::expert::ExpertIndex;
use leanstream_format::ffn::{FfnIndex, FfnLayer, PartTypes};
use leanstream_format::meta::{Meta, Routing, Synthetic};
use leanstream_format::quant::{row_bytes, QuantType};
use leanstream_format::LsbFile;
use rand::seq::SliceRandom;
use rayon::prelude::*;

use super::dense::{rng_for, uniform, Layout};
use super::plant::solve_increasing;
use super::{kept_for_inputs, layer0_inputs, tensor_bytes, write_tensor, SynthArgs};
use crate::calib::{Calibration, DEFAULT_CALIB};
use crate::convert::{bar, check_block_shapes, LAYOUT};
use crate::convert_moe::{
    co_selection, empty_side_data, encode_bundles, finish_mixture, unmeasured, write_extents,
};
use crate::tensors::dense_specs;

/// Scale of the experts' down columns: an expert's output is ~1e-2 of the residual, so the stream
/// (and the routing the routers were planted on) stays that of layer 0 through every layer.
const DOWN_SCALE: f32 = 0.03;

/// The context the summary states the planner's minimum at (the target: ctx 512).
const MINIMUM_CTX: usize = 512;

/// Token reuse planted when the profile has no mixture layers and `--token-reuse` is not given.
const DEFAULT_TOKEN_REUSE: f32 = 0.3;

/// Tensor id of the experts' weights in [`rng_for`] (above any dense tensor index).
const EXPERT_TENSOR: u64 = 1 << 40;

/// What one layer's routing was planted with and reached (recorded in the provenance).
#[derive(Debug, Clone, serde::Serialize)]
struct Planted {
    /// Weight of the slow part in the routers (radians: 0 = fast part only).
    alpha: f64,
    target_token_reuse: f32,
    /// On the calibration rows the routers were fitted on.
    fitted_token_reuse: f32,
    /// Largest over smallest target expert frequency.
    target_freq_ratio: f32,
}

pub(super) fn run(args: &SynthArgs, src: &LsbFile, started: Instant) -> Result<()> {
    let src_path = args.profile_from.display().to_string();
    let m0 = &src.meta.model;
    let mut config = args.shape.config(m0.bos_token_id, m0.eos_token_ids.clone());
    if let Some(l) = args.layers {
        config.num_layers = config.num_layers.min(l as usize);
    }
    let moe = config.moe.clone().expect("a mixture shape");
    if m0.vocab_size > config.vocab_size {
        bail!(
            "{src_path}: its vocabulary ({}) is larger than {}'s ({}); pick a source with at most \
             {} tokens",
            m0.vocab_size,
            args.shape.name(),
            config.vocab_size,
            config.vocab_size
        );
    }
    if let Some(r) = args.token_reuse.filter(|r| !(0.0..1.0).contains(r)) {
        bail!("--token-reuse {r}: give a share in [0, 1)");
    }
    check_block_shapes(&config, args.quant)?;
    row_bytes(args.quant, moe.expert_intermediate_size).with_context(|| {
        format!(
            "{}: experts of {} neurons have no whole {} blocks along their down rows",
            args.shape.name(),
            moe.expert_intermediate_size,
            args.quant.name()
        )
    })?;
    let lay = Layout::new(&config)?;
    let tokenizer = Tokenizer::from_bytes(&src.tokenizer_json)
        .with_context(|| format!("{src_path}: its tokenizer cannot be loaded"))?;
    let calib = Calibration::new(&tokenizer, None, DEFAULT_CALIB, args.calib_tokens as usize)?;
    let (h, layers, e_count, k, m) = (
        config.hidden_size,
        config.num_layers,
        moe.num_experts,
        moe.experts_per_token,
        moe.expert_intermediate_size,
    );
    let bar = bar(!args.json, 2 * layers as u64 + 1, "steps");

    // The FFN input every layer sees, from the embedding and layer 0's attention.
    bar.set_message("calibration inputs");
    let specs = dense_specs(&config);
    let mut kept = std::collections::HashMap::new();
    for (ti, spec) in specs.iter().enumerate() {
        if kept_for_inputs(&spec.name) {
            let (_, bytes) = tensor_bytes(&lay, &config, args, ti, spec)?;
            kept.insert(spec.name.clone(), (spec.shape.clone(), bytes));
        }
    }
    let inputs = layer0_inputs(&config, args.quant, kept, &calib)?;
    let train_prev = calib.previous(&inputs.train);

    // The profile's mixture layers (if any) give each layer its targets.
    let src_mixture: Vec<(usize, &Routing)> = src
        .meta
        .layers
        .iter()
        .enumerate()
        .filter_map(|(l, meta)| meta.routing.as_ref().map(|r| (l, r)))
        .collect();
    let mut routers = Vec::with_capacity(layers);
    let (mut planted, mut source_layer) = (Vec::new(), Vec::new());
    for l in 0..layers {
        bar.set_message(format!("router {l}"));
        let (freq, reuse, sl) = match src_mixture.get(l * src_mixture.len() / layers) {
            Some(&(sl, r)) => (
                spread(&r.expert_freq, e_count, k, args.seed ^ l as u64),
                args.token_reuse.unwrap_or(r.token_reuse),
                sl,
            ),
            None => (
                vec![k as f32 / e_count as f32; e_count],
                args.token_reuse.unwrap_or(DEFAULT_TOKEN_REUSE),
                l * src.meta.layers.len() / layers,
            ),
        };
        let (router, p) = plant_router(&lay, &inputs, &train_prev, &freq, reuse, k, args, l);
        routers.push(router);
        planted.push(p);
        source_layer.push(sl);
        bar.inc(1);
    }

    let mut writer = ContainerWriter::create(&args.output)
        .with_context(|| format!("cannot write {}", args.output.display()))?;
    bar.set_message("dense weights");
    writer.begin_section(SectionKind::DenseData);
    let mut dense = DenseIndex::default();
    for (ti, spec) in specs.iter().enumerate() {
        let (qtype, bytes) = match spec.name.strip_suffix(".mlp.gate.weight") {
            Some(p) if spec.router => {
                let l: usize = p["model.layers.".len()..]
                    .parse()
                    .expect("a router's layer");
                let bytes = routers[l]
                    .iter()
                    .flat_map(|v: &f32| v.to_le_bytes())
                    .collect();
                (QuantType::F32, bytes)
            }
            _ => tensor_bytes(&lay, &config, args, ti, spec)?,
        };
        dense
            .tensors
            .push(write_tensor(&mut writer, spec, qtype, &bytes)?);
    }
    writer.end_section();
    bar.inc(1);
    // Every layer is a mixture: FFN_INDEX has an empty layer for each.
    writer.begin_section(LAYOUT.ffn_data());
    writer.end_section();
    let ffn = FfnIndex {
        layers: (0..layers)
            .map(|_| FfnLayer {
                qtypes: PartTypes::uniform(args.quant),
                hidden: h as u32,
                perm: Vec::new(),
                clusters: Vec::new(),
                layout: LAYOUT,
            })
            .collect(),
    };

    let bundle_bytes = 3 * row_bytes(args.quant, h)?;
    let cluster = (args.cluster_kib as usize * 1024 / bundle_bytes).clamp(1, m);
    let mut experts = ExpertIndex {
        layers: Vec::with_capacity(layers),
    };
    writer.begin_section(LAYOUT.expert_data());
    for l in 0..layers {
        bar.set_message(format!("experts {l}"));
        // Two experts at a time per thread would hold 2 × 19 MB of f32: encode in parallel, write
        // in order.
        let encoded: Vec<Vec<Vec<u8>>> = (0..e_count)
            .into_par_iter()
            .map(|e| {
                let w = expert_weights(args.seed, l, e, h, m);
                encode_bundles(args.quant, &w, h, cluster)
            })
            .collect::<Result<_>>()?;
        let layer = encoded
            .iter()
            .map(|x| write_extents(&mut writer, args.quant, h, m, cluster, x))
            .collect::<Result<Vec<_>>>()?;
        experts.layers.push(layer);
        bar.inc(1);
    }
    writer.end_section();
    bar.finish_and_clear();

    // The routing profile on the held-out rows, from the stored routers (f32, as the runtime
    // computes it).
    let mut layer_meta = Vec::with_capacity(layers);
    let mut last: Option<Vec<Vec<u32>>> = None;
    for (l, router) in routers.iter().enumerate() {
        // The look-ahead's input: for layer 0 the residual entering it (the embedding); for later
        // layers the residual after the previous layer's attention, layer 0's output here.
        let entering = if l == 0 {
            &inputs.embed_hat
        } else {
            &inputs.resid_hat
        };
        let (routing, choices) =
            measure(router, &inputs, entering, h, e_count, k, moe.norm_topk_prob);
        layer_meta.push(unmeasured(Some(routing)));
        if let Some(before) = &last {
            let at = layer_meta.len() - 2;
            let earlier = layer_meta[at].routing.as_mut().expect("just set");
            co_selection(earlier, before, &choices, &inputs.eval);
        }
        last = Some(choices);
    }

    let (predictors, sketch, refine) = empty_side_data(layers, h);
    let meta = Meta {
        model: config.clone(),
        dense_quant: args.quant.name().into(),
        ffn_quant: args.quant.name().into(),
        sparsity_mode: "threshold".into(),
        sparsity_target: Some(0.0),
        sparsity_rule: None,
        cluster_kib: args.cluster_kib,
        layers: layer_meta,
        provenance: serde_json::json!({
            "source": src_path,
            "converter": concat!("leanstream-prep ", env!("CARGO_PKG_VERSION"), " synth"),
            "calib_tokens": calib.tokens(),
            "heldout_tokens": inputs.eval.len(),
            "experts": "random weights stored exactly: no sparsity inside experts (format 1.5)",
            "planted_routing": planted,
        }),
        chat_template: None,
        layout_only: false,
        synthetic: Some(Synthetic {
            shape: args.shape.name().into(),
            source: src_path.clone(),
            seed: args.seed,
            source_layer,
            source_layers: src.meta.layers.clone(),
        }),
    };
    finish_mixture(
        writer,
        &meta,
        &src.tokenizer_json,
        &dense,
        &ffn,
        (predictors, sketch, refine),
        &experts,
    )?;

    let gguf = match &args.gguf {
        Some(path) => Some(crate::gguf_export::export(&args.output, path, !args.json)?),
        None => None,
    };
    let routing: Vec<_> = meta
        .layers
        .iter()
        .map(|l| l.routing.as_ref().expect("a mixture layer"))
        .collect();
    let mean = |f: &dyn Fn(&Routing) -> f32| {
        routing.iter().map(|r| f(r)).sum::<f32>() / layers.max(1) as f32
    };
    // The planner's minimum at ctx 512 (default f16 KV) for this file, and for the shape at full
    // depth: the same planner with the file's layers repeated (they are alike), no file written.
    let kv = leanstream::model::kv_cache::KvType::default();
    let full_depth = args.shape.config(None, Vec::new()).num_layers;
    let minimum = leanstream::streaming::experts::minimum_memory(&args.output, MINIMUM_CTX, kv)?;
    let minimum_full = leanstream::streaming::experts::minimum_memory_at_depth(
        &args.output,
        MINIMUM_CTX,
        kv,
        full_depth,
    )?;
    let full_1gib = leanstream::streaming::experts::split_at_depth(
        &args.output,
        MINIMUM_CTX,
        kv,
        full_depth,
        Some(1 << 30),
    )
    .ok();
    let summary = serde_json::json!({
        "output": args.output,
        "full_depth_split_1gib": full_1gib,
        "minimum_memory_ctx512": minimum,
        "full_depth_layers": full_depth,
        "minimum_memory_full_depth_ctx512": minimum_full,
        "gguf": gguf,
        "shape": args.shape.name(),
        "layers": layers,
        "file_bytes": std::fs::metadata(&args.output)?.len(),
        "dense_bytes": dense.data_bytes(),
        "expert_bytes": experts.bundle_bytes(),
        "token_reuse": mean(&|r| r.token_reuse),
        "lookahead_recall": mean(&|r| r.lookahead_recall),
        "expert_freq_max": routing.iter().flat_map(|r| r.expert_freq.iter().copied()).fold(0.0f32, f32::max),
        "seconds": started.elapsed().as_secs_f64(),
        "peak_rss_bytes": leanstream::platform::memory::peak_rss_bytes(),
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!(
            "wrote {} ({:.2} GiB, {layers} layers of {}, experts {:.2} GiB) in {:.0} s, peak RSS \
             {:.0} MiB; held-out routing: token reuse {:.2}, look-ahead recall {:.2}",
            args.output.display(),
            summary["file_bytes"].as_f64().unwrap_or(0.0) / (1u64 << 30) as f64,
            args.shape.name(),
            experts.bundle_bytes() as f64 / (1u64 << 30) as f64,
            summary["seconds"].as_f64().unwrap_or(0.0),
            summary["peak_rss_bytes"].as_f64().unwrap_or(0.0) / (1u64 << 20) as f64,
            summary["token_reuse"].as_f64().unwrap_or(0.0),
            summary["lookahead_recall"].as_f64().unwrap_or(0.0),
        );
        println!(
            "planner minimum at ctx {MINIMUM_CTX} (f16 KV): {} for this file, {} at the shape's \
             full depth ({full_depth} layers)",
            leanstream::platform::memory_size::format_size(minimum),
            leanstream::platform::memory_size::format_size(minimum_full),
        );
        if let Some(done) = &gguf {
            crate::gguf_export::print(done);
        }
    }
    Ok(())
}

/// A profile's expert frequencies (any number of experts) spread over `e_count` experts: sorted,
/// read at evenly spaced quantiles, rescaled to sum `k`, and dealt to the experts in a seeded
/// random order.
fn spread(freq: &[f32], e_count: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut sorted = freq.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let n = sorted.len().max(1);
    // At least a small share each, so that every expert's bias has something to fit.
    let floor = 0.05 * k as f32 / e_count as f32;
    let mut out: Vec<f32> = (0..e_count)
        .map(|j| {
            sorted
                .get(j * n / e_count)
                .copied()
                .unwrap_or(0.0)
                .max(floor)
        })
        .collect();
    let sum: f32 = out.iter().sum();
    out.iter_mut().for_each(|f| *f *= k as f32 / sum);
    out.shuffle(&mut rng_for(seed, 7, 0));
    out
}

/// Expert `e` of layer `l`: gate and up rows of unit-scale entries over `√h`, down columns of
/// [`DOWN_SCALE`] over `√m` (`[gate m×h, up m×h, down h×m]`).
fn expert_weights(seed: u64, l: usize, e: usize, h: usize, m: usize) -> [Vec<f32>; 3] {
    let id = EXPERT_TENSOR + (l as u64) * 4096 + e as u64;
    let matrix = |part: u64, len: usize, scale: f32| {
        let mut v = vec![0.0f32; len];
        uniform(&mut rng_for(seed, id, part), &mut v, scale);
        v
    };
    let s = 1.0 / (h as f32).sqrt();
    [
        matrix(0, m * h, s),
        matrix(1, m * h, s),
        matrix(2, h * m, DOWN_SCALE / (m as f32).sqrt()),
    ]
}

/// Layer `l`'s router (`e_count × h`, row-major), planted so that on the calibration's training
/// rows each expert is chosen with frequency `freq` and consecutive tokens share `reuse` of their
/// experts (as nearly as the slow part's own correlation allows).
#[allow(clippy::too_many_arguments)]
fn plant_router(
    lay: &Layout,
    inputs: &super::layer::Inputs,
    train_prev: &[Option<usize>],
    freq: &[f32],
    reuse: f32,
    k: usize,
    args: &SynthArgs,
    l: usize,
) -> (Vec<f32>, Planted) {
    let (h, e_count) = (lay.h, freq.len());
    let rows = &inputs.train;
    // Random directions over the fast and the slow part, and their projections on every row
    // (scaled to unit RMS).
    let direction = |part: u64, e: usize, len: usize| {
        let mut v = vec![0.0f32; len];
        uniform(
            &mut rng_for(args.seed ^ 0x5EED, (l as u64) << 20 | e as u64, part),
            &mut v,
            1.0,
        );
        v
    };
    let fast: Vec<Vec<f32>> = (0..e_count)
        .map(|e| direction(0, e, lay.fast.len()))
        .collect();
    let slow: Vec<Vec<f32>> = (0..e_count)
        .map(|e| direction(1, e, lay.slow.len()))
        .collect();
    let project = |dirs: &[Vec<f32>], dims: std::ops::Range<usize>| -> (Vec<f32>, f32) {
        let z: Vec<f32> = rows
            .par_iter()
            .flat_map_iter(|&r| {
                let x = &inputs.x[r * h..(r + 1) * h][dims.clone()];
                dirs.iter()
                    .map(move |d| d.iter().zip(x).map(|(a, b)| a * b).sum::<f32>())
            })
            .collect();
        let rms = (z.iter().map(|v| v * v).sum::<f32>() / z.len().max(1) as f32).sqrt();
        (z, rms.max(1e-12))
    };
    let (zf, sf) = project(&fast, lay.fast.clone());
    let (zs, ss) = project(&slow, lay.slow.clone());
    let x0: Vec<f32> = rows.iter().map(|&r| inputs.x[r * h]).collect();
    let mean_x0 = x0.iter().sum::<f32>() / x0.len().max(1) as f32;
    let target_ln: Vec<f32> = freq.iter().map(|f| f.max(1e-6).ln()).collect();

    // For a mixing angle: the biases that give the target frequencies, and the reuse reached.
    let fit = |alpha: f64| -> (Vec<f32>, f32) {
        let (ca, sa) = ((alpha.cos() as f32) / sf, (alpha.sin() as f32) / ss);
        let mut bias = vec![0.0f32; e_count];
        let mut logits = vec![0.0f32; e_count];
        let mut chosen = vec![0usize; rows.len() * k];
        let mut top = Vec::with_capacity(e_count);
        for step in 0..48 {
            let mut count = vec![0usize; e_count];
            for (i, (zf, zs)) in zf
                .chunks_exact(e_count)
                .zip(zs.chunks_exact(e_count))
                .enumerate()
            {
                for e in 0..e_count {
                    logits[e] = ca * zf[e] + sa * zs[e] + bias[e] * x0[i];
                }
                top.clear();
                top.extend(0..e_count);
                top.select_nth_unstable_by(k - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
                for (j, &e) in top[..k].iter().enumerate() {
                    chosen[i * k + j] = e;
                    count[e] += 1;
                }
            }
            if step == 47 {
                break;
            }
            let n = rows.len().max(1) as f32;
            for e in 0..e_count {
                let got = (count[e] as f32 / n).max(0.5 / n).ln();
                bias[e] += 0.5 * (target_ln[e] - got) / mean_x0.max(1e-6);
            }
        }
        let position: std::collections::HashMap<usize, usize> =
            rows.iter().enumerate().map(|(i, &r)| (r, i)).collect();
        let (mut shared, mut pairs) = (0usize, 0usize);
        for (i, prev) in train_prev.iter().enumerate() {
            if let Some(p) = prev.and_then(|p| position.get(&p)) {
                let before = &chosen[p * k..(p + 1) * k];
                shared += chosen[i * k..(i + 1) * k]
                    .iter()
                    .filter(|e| before.contains(e))
                    .count();
                pairs += k;
            }
        }
        (bias, shared as f32 / pairs.max(1) as f32)
    };
    let alpha = solve_increasing(
        |a| fit(a).1 as f64,
        reuse as f64,
        0.0,
        std::f64::consts::FRAC_PI_2,
        10,
    );
    let (bias, fitted) = fit(alpha);
    let (ca, sa) = ((alpha.cos() as f32) / sf, (alpha.sin() as f32) / ss);
    let mut router = vec![0.0f32; e_count * h];
    for (e, row) in router.chunks_exact_mut(h).enumerate() {
        row[0] = bias[e];
        for (v, d) in row[lay.fast.clone()].iter_mut().zip(&fast[e]) {
            *v = ca * d;
        }
        for (v, d) in row[lay.slow.clone()].iter_mut().zip(&slow[e]) {
            *v = sa * d;
        }
    }
    let max = freq.iter().copied().fold(0.0f32, f32::max);
    let min = freq.iter().copied().fold(f32::INFINITY, f32::min);
    (
        router,
        Planted {
            alpha,
            target_token_reuse: reuse,
            fitted_token_reuse: fitted,
            target_freq_ratio: max / min.max(1e-9),
        },
    )
}

/// The routing profile (FORMAT.md §4.2) of a router on the held-out rows, and every row's chosen
/// experts; the look-ahead is this router on `entering` (the residual after the previous layer's
/// attention, or entering the first layer; normalised: the layer's norm is all ones here).
fn measure(
    router: &[f32],
    inputs: &super::layer::Inputs,
    entering: &[f32],
    h: usize,
    e_count: usize,
    k: usize,
    norm_topk_prob: bool,
) -> (Routing, Vec<Vec<u32>>) {
    let total = inputs.x.len() / h;
    let mut logits = vec![0.0f32; e_count];
    let mut chosen = vec![
        Choice {
            expert: 0,
            weight: 0.0
        };
        k
    ];
    let mut choose = |x: &[f32]| -> Vec<u32> {
        for (z, row) in logits.iter_mut().zip(router.chunks_exact(h)) {
            *z = row.iter().zip(x).map(|(a, b)| a * b).sum();
        }
        route(&logits, norm_topk_prob, &mut chosen);
        chosen.iter().map(|c| c.expert).collect()
    };
    let choices: Vec<Vec<u32>> = (0..total)
        .map(|r| choose(&inputs.x[r * h..(r + 1) * h]))
        .collect();
    let mut freq = vec![0.0f32; e_count];
    let (mut reused, mut followed, mut found) = (0usize, 0usize, 0usize);
    for (&r, prev) in inputs.eval.iter().zip(&inputs.eval_prev) {
        choices[r].iter().for_each(|&e| freq[e as usize] += 1.0);
        found += choose(&entering[r * h..(r + 1) * h])
            .iter()
            .filter(|e| choices[r].contains(e))
            .count();
        if let Some(p) = prev {
            reused += choices[r]
                .iter()
                .filter(|e| choices[*p].contains(e))
                .count();
            followed += k;
        }
    }
    freq.iter_mut()
        .for_each(|f| *f /= inputs.eval.len().max(1) as f32);
    let routing = Routing {
        expert_freq: freq,
        token_reuse: reused as f32 / followed.max(1) as f32,
        lookahead_recall: found as f32 / (k * inputs.eval.len()).max(1) as f32,
        next_partners: Vec::new(),
        next_partner_share: Vec::new(),
    };
    (routing, choices)
}
