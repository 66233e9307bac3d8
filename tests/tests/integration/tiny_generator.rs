//! The generator itself: deterministic, shard layout equivalent to one file, HF config fields.

use std::path::Path;

use leanstream_tests::reference::{Breakage, ReferenceModel};
use leanstream_tests::tiny::{
    random_ids, write_tiny_model, Llama3RopeScaling, TinySpec, WeightDtype,
};
use leanstream_tests::{fresh_dir, max_rel_diff};
use serde_json::Value;

fn tmp(name: &str) -> std::path::PathBuf {
    fresh_dir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("tiny-{name}"),
    )
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn same_seed_gives_identical_files() {
    let spec = TinySpec::qwen3();
    let (a, b) = (tmp("det-a"), tmp("det-b"));
    write_tiny_model(&a, &spec).unwrap();
    write_tiny_model(&b, &spec).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert_eq!(
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
            "{f}"
        );
    }
}

#[test]
fn sharded_model_equals_single_file() {
    let one = TinySpec {
        dtype: WeightDtype::BF16,
        ..TinySpec::qwen3()
    };
    let three = TinySpec {
        shards: 3,
        ..one.clone()
    };
    let (d1, d3) = (tmp("shard-1"), tmp("shard-3"));
    write_tiny_model(&d1, &one).unwrap();
    write_tiny_model(&d3, &three).unwrap();

    let index = read_json(&d3.join("model.safetensors.index.json"));
    let map = index["weight_map"].as_object().unwrap();
    let mut files: Vec<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
    files.sort();
    files.dedup();
    assert_eq!(
        files,
        [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors"
        ]
    );
    assert!(!d3.join("model.safetensors").exists());
    assert!(map.contains_key("model.layers.1.self_attn.k_norm.weight"));
    assert!(
        !map.contains_key("lm_head.weight"),
        "tied model has no lm_head"
    );

    let ids = random_ids(5, 16, one.vocab);
    let a = ReferenceModel::load(&d1)
        .unwrap()
        .logits(&ids, Breakage::None)
        .unwrap();
    let b = ReferenceModel::load(&d3)
        .unwrap()
        .logits(&ids, Breakage::None)
        .unwrap();
    assert_eq!(max_rel_diff(&a, &b), 0.0);
}

#[test]
fn config_uses_hf_field_names() {
    let spec = TinySpec {
        rope_theta_in_rope_parameters: true,
        llama3_rope_scaling: Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        }),
        ..TinySpec::llama()
    };
    let dir = tmp("config");
    write_tiny_model(&dir, &spec).unwrap();
    let c = read_json(&dir.join("config.json"));
    assert_eq!(c["architectures"][0], "LlamaForCausalLM");
    assert_eq!(c["model_type"], "llama");
    assert_eq!(c["head_dim"], spec.head_dim);
    assert_eq!(c["hidden_act"], "silu");
    assert_eq!(c["eos_token_id"], 0);
    assert!(c["bos_token_id"].is_null());
    assert!(c.get("rope_theta").is_none() && c.get("rope_scaling").is_none());
    assert_eq!(c["rope_parameters"]["rope_type"], "llama3");
    assert_eq!(c["rope_parameters"]["rope_theta"], spec.rope_theta);

    let m = TinySpec::mistral();
    let dir = tmp("config-mistral");
    write_tiny_model(&dir, &m).unwrap();
    let c = read_json(&dir.join("config.json"));
    assert_eq!(c["architectures"][0], "MistralForCausalLM");
    assert_eq!(c["sliding_window"], m.sliding_window.unwrap());
    assert_eq!(c["rope_theta"], m.rope_theta);
}
