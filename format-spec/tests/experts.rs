//! A mixture-of-experts file (format 1.5) written section by section and read back: the experts'
//! index and bytes round-trip, each expert is one readable range checked by its clusters'
//! checksums, `verify` names a damaged expert cluster, the header says 1.5 while a dense file
//! stays at the lowest minor its features need, and files whose experts disagree with their
//! configuration are refused with what is wrong.

use std::path::{Path, PathBuf};

use leanstream_format::container::{read_at, ContainerWriter, SectionKind};
use leanstream_format::dense::DenseIndex;
use leanstream_format::expert::ExpertIndex;
use leanstream_format::ffn::{Cluster, ClusterLayout, FfnIndex, FfnLayer};
use leanstream_format::file::check_extent;
use leanstream_format::meta::{LayerMeta, Meta, Routing};
use leanstream_format::model_config::ModelConfig;
use leanstream_format::predictor::{Predictor, PredictorInput, Predictors};
use leanstream_format::quant::{quantize_row, QuantType};
use leanstream_format::refine::{Refine, RefineLayer};
use leanstream_format::sketch::{Sketch, SketchLayer};
use leanstream_format::{verify, LsbFile};

const H: usize = 32;
/// Layer 0 is dense (4 neurons), layer 1 a mixture of 3 experts of 3 neurons.
const DENSE_NEURONS: usize = 4;
const EXPERTS: usize = 3;
const EXPERT_NEURONS: usize = 3;
/// Neurons per cluster.
const CLUSTER: usize = 2;

fn path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

fn config(moe: bool) -> ModelConfig {
    let mut v = serde_json::json!({
        "architecture": "Qwen3", "activation": "Silu", "hidden_size": H,
        "intermediate_size": DENSE_NEURONS, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
        "head_dim": 16, "vocab_size": 8, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": null, "sliding_window": null,
        "tie_word_embeddings": true, "qk_norm": true, "bos_token_id": null, "eos_token_ids": []
    });
    if moe {
        v["moe"] = serde_json::json!({
            "num_experts": EXPERTS, "experts_per_token": 2,
            "expert_intermediate_size": EXPERT_NEURONS, "norm_topk_prob": true,
            "dense_layers": [0]
        });
    }
    serde_json::from_value(v).unwrap()
}

/// A neuron's bundle: three Q8_0 rows whose values depend on `seed`.
fn bundle(seed: usize) -> Vec<u8> {
    (0..3)
        .flat_map(|part| {
            let row: Vec<f32> = (0..H)
                .map(|j| ((seed * 31 + part * 7 + j) % 17) as f32 - 8.0)
                .collect();
            quantize_row(QuantType::Q8_0, &row).unwrap()
        })
        .collect()
}

/// Writes `neurons` bundles (`seed0 + i`) in reverse stored order as clusters of the open section.
fn write_ffn(w: &mut ContainerWriter, neurons: usize, seed0: usize) -> (FfnLayer, Vec<Vec<u8>>) {
    let perm: Vec<u32> = (0..neurons as u32).rev().collect();
    let (mut clusters, mut extents) = (Vec::new(), Vec::new());
    for (ci, chunk) in perm.chunks(CLUSTER).enumerate() {
        let bytes: Vec<u8> = chunk
            .iter()
            .flat_map(|&i| bundle(seed0 + i as usize))
            .collect();
        let (offset, extent_size, checksum) = w.write_extent(&bytes).unwrap();
        clusters.push(Cluster {
            first: (ci * CLUSTER) as u32,
            count: chunk.len() as u32,
            offset,
            extent_size,
            checksum,
        });
        extents.push(bytes);
    }
    let layer = FfnLayer {
        qtypes: leanstream_format::ffn::PartTypes::uniform(QuantType::Q8_0),
        hidden: H as u32,
        perm,
        clusters,
        // The bundles back to back, as before 1.6: the file stays at the lowest minor it needs.
        layout: ClusterLayout::Interleaved,
    };
    (layer, extents)
}

/// A rank-0 predictor of `outputs` neurons (0: the empty predictor a mixture's file may have).
fn predictor(l: usize, input: PredictorInput, outputs: usize) -> Predictor {
    Predictor {
        source_layer: l as u32,
        input,
        input_dim: H as u32,
        rank: 0,
        outputs: outputs as u32,
        threshold: 0.0,
        w1: Vec::new(),
        b1: Vec::new(),
        w2: Vec::new(),
        b2: vec![0.0; outputs],
    }
}

fn layer_meta(routing: Option<Routing>) -> LayerMeta {
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

/// What the writer put in the file: the experts' index and each expert cluster's bytes.
struct Written {
    experts: ExpertIndex,
    expert_bytes: Vec<Vec<Vec<u8>>>,
}

/// Writes a two-layer file: a mixture (layer 1) when `moe`, else two dense layers. `edit` may
/// change the configuration written to META and the expert index written to EXPERT_INDEX.
fn write(out: &Path, moe: bool, edit: impl FnOnce(&mut ModelConfig, &mut ExpertIndex)) -> Written {
    let mut config = config(moe);
    let mut w = ContainerWriter::create(out).unwrap();
    w.begin_section(SectionKind::DenseData);
    w.end_section();
    w.begin_section(SectionKind::FfnData);
    let mut ffn = FfnIndex::default();
    for l in 0..2 {
        let neurons = if moe && l == 1 { 0 } else { DENSE_NEURONS };
        ffn.layers.push(write_ffn(&mut w, neurons, 100 * l).0);
    }
    w.end_section();
    let mut experts = ExpertIndex {
        layers: vec![Vec::new(); 2],
    };
    let mut expert_bytes = Vec::new();
    if moe {
        w.begin_section(SectionKind::ExpertData);
        for e in 0..EXPERTS {
            let (x, bytes) = write_ffn(&mut w, EXPERT_NEURONS, 1000 + 10 * e);
            experts.layers[1].push(x);
            expert_bytes.push(bytes);
        }
        w.end_section();
    }
    let written = Written {
        experts: experts.clone(),
        expert_bytes,
    };
    edit(&mut config, &mut experts);
    let routing = Routing {
        expert_freq: vec![1.0, 0.75, 0.25],
        token_reuse: 0.5,
        lookahead_recall: 0.875,
        next_partners: Vec::new(),
        next_partner_share: Vec::new(),
    };
    let meta = Meta {
        model: config,
        dense_quant: "q8_0".into(),
        ffn_quant: "q8_0".into(),
        sparsity_mode: "threshold".into(),
        sparsity_target: Some(0.0),
        sparsity_rule: None,
        cluster_kib: 4,
        layers: vec![layer_meta(None), layer_meta(moe.then_some(routing))],
        provenance: serde_json::Value::Null,
        chat_template: None,
        synthetic: None,
        layout_only: false,
    };
    let mut predictors = Predictors::default();
    let (mut sketch, mut refine) = (Sketch::default(), Refine::default());
    for (l, layer) in ffn.layers.iter().enumerate() {
        // A mixture's file may leave every layer's side data empty; a dense file may not.
        let (neurons, clusters) = match moe {
            true => (0, 0),
            false => (layer.neurons(), layer.clusters.len()),
        };
        predictors
            .lookahead
            .push(predictor(l, PredictorInput::Residual, neurons));
        predictors
            .own
            .push(predictor(l, PredictorInput::FfnInput, neurons));
        sketch.layers.push(SketchLayer {
            qtype: QuantType::Q8_0,
            hidden: H as u32,
            rows: Vec::new(),
            err_norm: Vec::new(),
        });
        refine.layers.push(RefineLayer {
            cluster_freq: vec![0.0; clusters],
            neighbours: vec![Vec::new(); clusters],
            neuron_freq: vec![0.0; neurons],
            neuron_mag: vec![0.0; neurons],
        });
    }
    w.require_minor(meta.minor_version().max(sketch.minor_version()));
    w.add_section(
        SectionKind::Meta,
        &serde_json::to_vec(&meta).unwrap(),
        false,
    )
    .unwrap();
    w.add_section(SectionKind::Tokenizer, b"{}", true).unwrap();
    w.add_section(
        SectionKind::DenseIndex,
        &DenseIndex::default().encode(),
        false,
    )
    .unwrap();
    w.add_section(SectionKind::FfnIndex, &ffn.encode(), false)
        .unwrap();
    w.add_section(SectionKind::Predictors, &predictors.encode(), false)
        .unwrap();
    w.add_section(SectionKind::Sketch, &sketch.encode(), false)
        .unwrap();
    w.add_section(SectionKind::Refine, &refine.encode(), false)
        .unwrap();
    if moe {
        w.add_section(SectionKind::ExpertIndex, &experts.encode(), false)
            .unwrap();
    }
    w.finish().unwrap();
    written
}

#[test]
fn experts_round_trip_and_each_is_one_checked_read() {
    let out = path("experts-round-trip.lsb");
    let written = write(&out, true, |_, _| {});
    let f = LsbFile::open(&out).unwrap();
    assert_eq!(f.header.version_minor, 5, "a file with experts is 1.5");
    assert_eq!(f.experts, written.experts);
    assert!(
        f.experts.layers[0].is_empty(),
        "the dense layer has no experts"
    );
    assert_eq!(
        f.ffn.layers[1].neurons(),
        0,
        "the mixture layer's FFN_INDEX is empty"
    );
    assert_eq!(
        f.meta.layers[1].routing.as_ref().unwrap().expert_freq,
        vec![1.0, 0.75, 0.25]
    );
    let mut file = std::fs::File::open(&out).unwrap();
    for (e, clusters) in written.expert_bytes.iter().enumerate() {
        // The whole expert in one read, then each cluster checked by its own checksum.
        let (offset, size) = f.expert_extent(1, e);
        assert_eq!(offset % 4096, 0);
        let bytes = read_at(&mut file, &out, offset, size).unwrap();
        for (c, want) in clusters.iter().enumerate() {
            let (at, extent) = f.expert_cluster_extent(1, e, c);
            let part = &bytes[(at - offset) as usize..(at - offset + extent) as usize];
            let cluster = &f.experts.layers[1][e].clusters[c];
            check_extent(part, cluster.checksum, || format!("expert {e} cluster {c}")).unwrap();
            assert_eq!(&part[..want.len()], &want[..], "expert {e} cluster {c}");
        }
        let last = f.experts.layers[1][e].clusters.len() - 1;
        let (at, extent) = f.expert_cluster_extent(1, e, last);
        assert_eq!(
            at + extent,
            offset + size,
            "the expert ends with its last cluster"
        );
    }
    assert_eq!(verify(&out, |_, _| {}).unwrap(), f.header.file_size);

    // One changed byte in expert 2's second cluster: verify names it.
    let (at, _) = f.expert_cluster_extent(1, 2, 1);
    let mut bytes = std::fs::read(&out).unwrap();
    bytes[at as usize + 5] ^= 1;
    let damaged = path("experts-damaged.lsb");
    std::fs::write(&damaged, &bytes).unwrap();
    let err = verify(&damaged, |_, _| {}).unwrap_err().to_string();
    assert!(err.contains("layer 1 expert 2 cluster 1"), "{err}");
}

#[test]
fn a_dense_file_stays_below_1_5() {
    let out = path("experts-dense.lsb");
    write(&out, false, |_, _| {});
    let f = LsbFile::open(&out).unwrap();
    assert_eq!(
        f.header.version_minor, 3,
        "only the empty SKETCH layers (1.3)"
    );
    assert!(f.experts.layers.is_empty());
    assert!(f.header.section(SectionKind::ExpertIndex).is_none());
}

#[test]
fn experts_that_disagree_with_the_config_are_refused() {
    let refused = |name: &str, edit: &dyn Fn(&mut ModelConfig, &mut ExpertIndex)| {
        let out = path(name);
        write(&out, true, edit);
        LsbFile::open(&out).unwrap_err().to_string()
    };
    let err = refused("experts-count.lsb", &|c, _| {
        c.moe.as_mut().unwrap().num_experts = 4;
    });
    assert!(err.contains("layer 1 has 3 experts"), "{err}");
    let err = refused("experts-size.lsb", &|c, _| {
        c.moe.as_mut().unwrap().expert_intermediate_size = 2;
    });
    assert!(err.contains("layer 1 expert 0 disagrees"), "{err}");
    // Layer 1 declared dense: its FFN_INDEX layer (empty) is then wrong.
    let err = refused("experts-dense-layer.lsb", &|c, _| {
        c.moe.as_mut().unwrap().dense_layers = vec![0, 1];
    });
    assert!(err.contains("FFN_INDEX"), "{err}");
    // Experts without a mixture in the config.
    let err = refused("experts-no-moe.lsb", &|c, _| c.moe = None);
    assert!(
        err.contains("FFN_INDEX") || err.contains("no mixture"),
        "{err}"
    );
    // An index whose extents do not tile EXPERT_DATA.
    let err = refused("experts-tiling.lsb", &|_, x| {
        x.layers[1].pop();
    });
    assert!(err.contains("EXPERT_INDEX"), "{err}");
}
