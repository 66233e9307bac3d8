//! `leanstream-prep inspect`: what a converted file holds, its sizes and predictor quality.

use leanstream_format::ffn::PartTypes;
use leanstream_format::meta::{LayerMeta, Meta};
use leanstream_format::LsbFile;
use serde_json::{json, Value};

/// The statistics a synthetic file is compared on with its source, by name.
const COMPARED: [&str; 8] = [
    "active_fraction",
    "hot10_share",
    "token_overlap",
    "group_fill",
    "predictor_recall",
    "predictor_precision",
    "lookahead_recall",
    "lookahead_precision",
];

fn stat(l: &LayerMeta, name: &str) -> Option<f32> {
    let a = l.activity;
    Some(match name {
        "active_fraction" => 1.0 - l.sparsity,
        "hot10_share" => a?.hot10_share,
        "token_overlap" => a?.token_overlap,
        "group_fill" => a?.group_fill,
        "predictor_recall" => l.predictor_recall,
        "predictor_precision" => l.predictor_precision,
        "lookahead_recall" => l.lookahead_recall,
        "lookahead_precision" => l.lookahead_precision,
        _ => return None,
    })
}

/// For a synthetic file: each layer's measured statistics next to its source layer's, with the
/// relative difference, and the largest one. Null for other files.
pub fn comparison(m: &Meta) -> Value {
    let Some(syn) = &m.synthetic else {
        return Value::Null;
    };
    let mut worst = (0.0f32, String::new());
    let layers: Vec<Value> = m
        .layers
        .iter()
        .zip(&syn.source_layer)
        .enumerate()
        .map(|(l, (lm, &sl))| {
            let src = &syn.source_layers[sl];
            let mut stats = serde_json::Map::new();
            for name in COMPARED {
                let (a, b) = (stat(lm, name), stat(src, name));
                let rel = match (a, b) {
                    (Some(a), Some(b)) if b != 0.0 => Some((a - b).abs() / b.abs()),
                    _ => None,
                };
                if let Some(r) = rel.filter(|r| *r > worst.0) {
                    worst = (r, format!("{name} of layer {l}"));
                }
                stats.insert(
                    name.into(),
                    json!({"synthetic": a, "source": b, "rel_diff": rel}),
                );
            }
            json!({"layer": l, "source_layer": sl, "stats": stats})
        })
        .collect();
    json!({
        "shape": syn.shape,
        "source": syn.source,
        "layers": layers,
        "max_rel_diff": worst.0,
        "max_rel_diff_at": worst.1,
    })
}

/// A table of [`comparison`]: synthetic / source for every statistic.
pub fn print_comparison(v: &Value) {
    if v.is_null() {
        return;
    }
    println!(
        "  planted from {} (synthetic / source, held-out tokens of each):",
        v["source"].as_str().unwrap_or("")
    );
    println!("  layer src  active       hot10        overlap      group fill   own recall   own prec     ahead recall ahead prec");
    for l in v["layers"].as_array().into_iter().flatten() {
        let mut line = format!("  {:>5} {:>3}", l["layer"], l["source_layer"]);
        for name in COMPARED {
            let s = &l["stats"][name];
            let f = |k: &str| s[k].as_f64().unwrap_or(f64::NAN);
            line += &format!("  {:.3}/{:.3}", f("synthetic"), f("source"));
        }
        println!("{line}");
    }
    println!(
        "  largest relative difference: {:.1} % ({})",
        100.0 * v["max_rel_diff"].as_f64().unwrap_or(f64::NAN),
        v["max_rel_diff_at"].as_str().unwrap_or("")
    );
}

/// The file described as one JSON object.
pub fn describe(f: &LsbFile) -> Value {
    let m = &f.meta;
    // As the runtime holds them (int8), both per layer: what predicted mode keeps resident.
    let predictor_bytes: u64 = f
        .predictors
        .own
        .iter()
        .chain(&f.predictors.lookahead)
        .map(|p| {
            leanstream::streaming::predictor_bytes(
                p.input_dim as usize,
                p.rank as usize,
                p.outputs as usize,
            )
        })
        .sum();
    let extents: Vec<u64> = f
        .ffn
        .layers
        .iter()
        .flat_map(|l| l.clusters.iter().map(|c| c.extent_size))
        .collect();
    let layers: Vec<Value> = m
        .layers
        .iter()
        .zip(&f.ffn.layers)
        .enumerate()
        .map(|(l, (lm, fl))| {
            let mut v = serde_json::to_value(lm).expect("serialisable");
            // A mixture layer's clusters are its experts'.
            let experts = f.experts.layers.get(l).map_or(&[][..], Vec::as_slice);
            let first = experts.first().unwrap_or(fl);
            v["clusters"] = (fl.clusters.len()
                + experts.iter().map(|x| x.clusters.len()).sum::<usize>())
            .into();
            v["neurons_per_cluster"] = first.clusters.first().map_or(0, |c| c.count).into();
            v["experts"] = experts.len().into();
            v["encoding"] = parts_json(&fl.qtypes);
            v
        })
        .collect();
    // Each dense tensor's encoding, in file order.
    let dense_encodings: Vec<Value> = f
        .dense
        .tensors
        .iter()
        .map(|t| json!({"name": t.name, "encoding": t.qtype.name()}))
        .collect();
    let mixture = m.model.moe.is_some();
    let experts = m.model.moe.as_ref().map(|moe| {
        let sizes: Vec<u64> = (0..f.experts.layers.len())
            .flat_map(|l| (0..f.experts.layers[l].len()).map(move |e| (l, e)))
            .map(|(l, e)| f.expert_extent(l, e).1)
            .collect();
        json!({
            "num_experts": moe.num_experts,
            "experts_per_token": moe.experts_per_token,
            "expert_intermediate_size": moe.expert_intermediate_size,
            "norm_topk_prob": moe.norm_topk_prob,
            "dense_layers": moe.dense_layers,
            "expert_bytes": f.experts.bundle_bytes(),
            // What one read of a whole expert fetches (its clusters' extents), on average.
            "expert_extent_bytes": sizes.iter().sum::<u64>() / sizes.len().max(1) as u64,
        })
    });
    json!({
        "path": f.path,
        "format_version": format!("{}.{}", f.header.version_major, f.header.version_minor),
        // How each cluster orders its rows (FORMAT.md §6.3): split since 1.6.
        "cluster_layout": f.cluster_layout().name(),
        "file_bytes": f.header.file_size,
        "architecture": m.model.architecture,
        "activation": m.model.activation,
        "layers_count": m.model.num_layers,
        "hidden_size": m.model.hidden_size,
        "intermediate_size": m.model.intermediate_size,
        "quant": m.ffn_quant,
        "dense_quant": m.dense_quant,
        "dense_encodings": dense_encodings,
        "sparsity_mode": m.sparsity_mode,
        "sparsity_target": m.sparsity_target,
        "sparsity_rule": m.sparsity_rule.as_deref().unwrap_or("gate"),
        "layout_only": m.layout_only,
        "dense_bytes": f.dense.data_bytes(),
        "ffn_bytes": f.ffn.bundle_bytes(),
        "sketch_bytes": f.sketch.bytes(),
        "predictor_bytes": predictor_bytes,
        // Each layer's FFN input directions (INPUT_BASIS, format 1.10), where the file has them.
        "input_basis": LsbFile::read_input_basis(&f.path).ok().flatten().map(|b| json!({
            "rank": b.layers.iter().map(|l| l.rank()).collect::<Vec<_>>(),
            "captured": b.layers.iter().map(|l| l.captured).collect::<Vec<_>>(),
        })),
        "cluster_bytes": extents.iter().sum::<u64>() / extents.len().max(1) as u64,
        // At ctx 512: the least `--memory` a run accepts (the dense weights the planner may stream
        // streaming), and the least with every dense weight resident (the neuron cache empty).
        // Mixtures are planned by the expert stream (`synth` states their minimum): none here.
        "min_memory_bytes": (!mixture).then(|| leanstream::streaming::streaming_minimum_memory(&f.path, 512.min(m.model.max_position_embeddings)).ok()).flatten(),
        "min_memory_dense_resident_bytes": (!mixture).then(|| leanstream::streaming::minimum_memory(&f.path, 512.min(m.model.max_position_embeddings)).ok()).flatten(),
        "experts": experts,
        "sections": f.section_sizes().into_iter().map(|(n, s)| json!({"name": n, "bytes": s})).collect::<Vec<_>>(),
        "provenance": m.provenance,
        "layers": layers,
        "comparison": comparison(m),
    })
}

/// A layer's bundle encodings: `{"gate": "q4_k", "up": "q4_k", "down": "q6_k"}`.
fn parts_json(p: &PartTypes) -> Value {
    json!({"gate": p.gate.name(), "up": p.up.name(), "down": p.down.name()})
}

/// The encodings of [`describe`]: each layer's bundle parts, and the dense tensors grouped by
/// encoding (`q6_k: model.embed_tokens.weight, …`).
fn print_encodings(v: &Value) {
    let name = |x: &Value| x.as_str().unwrap_or("").to_string();
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for t in v["dense_encodings"].as_array().into_iter().flatten() {
        let (enc, tensor) = (name(&t["encoding"]), name(&t["name"]));
        match groups.iter_mut().find(|g| g.0 == enc) {
            Some(g) => g.1.push(tensor),
            None => groups.push((enc, vec![tensor])),
        }
    }
    for (enc, tensors) in groups {
        println!("  dense {enc}: {}", tensors.join(", "));
    }
    let layers: Vec<String> = v["layers"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, l)| {
            let e = &l["encoding"];
            format!(
                "{i}: gate {} up {} down {}",
                name(&e["gate"]),
                name(&e["up"]),
                name(&e["down"])
            )
        })
        .collect();
    println!("  FFN bundles: {}", layers.join("; "));
}

/// A human-readable rendering of [`describe`].
pub fn print(v: &Value) {
    println!("{}", v["path"].as_str().unwrap_or(""));
    println!(
        "  format {} ({} clusters)  {:?} ({})  {} layers, hidden {}, FFN {}",
        v["format_version"].as_str().unwrap_or(""),
        v["cluster_layout"].as_str().unwrap_or(""),
        v["architecture"].as_str().unwrap_or(""),
        v["activation"].as_str().unwrap_or(""),
        v["layers_count"],
        v["hidden_size"],
        v["intermediate_size"]
    );
    if v["layout_only"] == true {
        println!(
            "  layout only: not calibrated (every neuron computed); `leanstream-prep calibrate \
             {}` learns its sparsity, neuron order and predictors in place",
            v["path"].as_str().unwrap_or("")
        );
    }
    println!(
        "  quant {}  sparsity {}{}  rule {} (a neuron is skipped when {} <= its layer's threshold)",
        v["quant"].as_str().unwrap_or(""),
        v["sparsity_mode"].as_str().unwrap_or(""),
        v["sparsity_target"]
            .as_f64()
            .map_or(String::new(), |t| format!(" (target fraction {t:.2})")),
        v["sparsity_rule"].as_str().unwrap_or(""),
        if v["sparsity_rule"] == "gate_up" {
            "|act(gate·x)·(up·x)|"
        } else {
            "|act(gate·x)|"
        }
    );
    if let Some(x) = v["experts"].as_object() {
        println!(
            "  mixture of experts: {} experts of {} neurons, {} per token (renormalised: {}), dense layers {}; one expert read = {} bytes",
            x["num_experts"],
            x["expert_intermediate_size"],
            x["experts_per_token"],
            x["norm_topk_prob"],
            x["dense_layers"],
            x["expert_extent_bytes"]
        );
    }
    print_encodings(v);
    for key in [
        "file_bytes",
        "dense_bytes",
        "ffn_bytes",
        "sketch_bytes",
        "predictor_bytes",
        "cluster_bytes",
    ] {
        println!("  {key:<16} {:>14}", v[key]);
    }
    if let Some(b) = v["input_basis"].as_object() {
        let ranks: Vec<u64> = b["rank"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_u64)
            .collect();
        let held: Vec<f64> = b["captured"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_f64)
            .collect();
        let (lo, hi) = held
            .iter()
            .fold((f64::INFINITY, 0.0f64), |(l, h), &c| (l.min(c), h.max(c)));
        println!(
            "  input directions: {} per layer, holding {:.0}–{:.0} % of the calibration inputs' energy (refine sparsity scores that part exactly)",
            ranks.iter().max().copied().unwrap_or(0),
            100.0 * lo,
            100.0 * hi
        );
    }
    if let (Some(least), Some(resident)) = (
        v["min_memory_bytes"].as_u64(),
        v["min_memory_dense_resident_bytes"].as_u64(),
    ) {
        println!(
            "  min_memory_bytes {least:>14}  (the least --memory a run accepts at ctx 512; \
             {resident} with every dense weight resident)"
        );
    }
    if !v["experts"].is_null() {
        println!(
            "  {:<16} {:>14}",
            "expert_bytes", v["experts"]["expert_bytes"]
        );
        // No sparsity is calibrated in a mixture's file yet: its layers have only a routing profile.
        print_routing(&v["layers"]);
        return;
    }
    println!("  layer  threshold  sparsity  certificate saves  own recall/prec  look-ahead recall/prec  static recall  cluster fill (unordered)  hot10  overlap  group fill");
    for (i, l) in v["layers"].as_array().into_iter().flatten().enumerate() {
        let f = |k: &str| l[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "  {i:>5}  {:>9.4}  {:>8.3}  {:>17}  {:>6.3}/{:<6.3}    {:>6.3}/{:<6.3}           {:>6.3}         {:.3} ({:.3})            {:.3}  {:.3}    {:.3}",
            f("threshold"),
            f("sparsity"),
            l["certificate_saves"]
                .as_f64()
                .map_or("none".to_string(), |s| format!("{s:.3}")),
            f("predictor_recall"),
            f("predictor_precision"),
            f("lookahead_recall"),
            f("lookahead_precision"),
            f("static_recall"),
            f("cluster_fill"),
            f("cluster_fill_unordered"),
            f("hot10_share"),
            f("token_overlap"),
            f("group_fill")
        );
    }
    print_routing(&v["layers"]);
    print_comparison(&v["comparison"]);
}

/// The routing profile of a mixture's layers (META `routing`), if any: per layer, the look-ahead
/// recall, the reuse between consecutive tokens and each expert's share of tokens.
pub fn print_routing(layers: &Value) {
    let routed: Vec<(usize, &Value)> = layers
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .filter(|(_, l)| l["routing"].is_object())
        .map(|(i, l)| (i, &l["routing"]))
        .collect();
    if routed.is_empty() {
        return;
    }
    println!(
        "  routing (held-out tokens): layer  look-ahead recall  token reuse  next-layer partner share (mean)  expert frequencies"
    );
    for (i, r) in routed {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        let freq: Vec<String> = r["expert_freq"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|x| format!("{:.2}", x.as_f64().unwrap_or(f64::NAN)))
            .collect();
        let shares: Vec<f64> = r["next_partner_share"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_f64())
            .collect();
        let partner = match shares.len() {
            0 => "-".to_string(),
            n => format!("{:.3}", shares.iter().sum::<f64>() / n as f64),
        };
        println!(
            "  {i:>31}  {:>17.3}  {:>11.3}  {partner:>31}  {}",
            f("lookahead_recall"),
            f("token_reuse"),
            freq.join(" ")
        );
    }
}
