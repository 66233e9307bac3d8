//! Validates the f64 reference against candle-transformers, an independent implementation,
//! so that the reference can then be trusted to judge the engine.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::{llama, mixtral, qwen3, qwen3_moe};
use leanstream_tests::reference::{Breakage, ReferenceModel};
use leanstream_tests::tiny::{
    random_ids, write_tiny_model, Act, Llama3RopeScaling, TinySpec, WeightDtype,
};
use leanstream_tests::{fresh_dir, logit_stats, max_rel_diff, LOGIT_TOL};

const PROMPT_LEN: usize = 72;

fn model_dir(name: &str, spec: &TinySpec) -> PathBuf {
    let dir = fresh_dir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("candle-{name}"),
    );
    write_tiny_model(&dir, spec).expect("write tiny model");
    dir
}

fn safetensors_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    files
}

fn var_builder(dir: &Path) -> VarBuilder<'static> {
    // SAFETY: the files are written by this test and not modified while mapped.
    unsafe {
        VarBuilder::from_mmaped_safetensors(&safetensors_files(dir), DType::F32, &Device::Cpu)
            .unwrap()
    }
}

fn token(id: u32) -> Tensor {
    Tensor::new(&[id], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
}

/// Candle's Llama, fed one token at a time through its KV cache.
fn candle_llama_logits(dir: &Path, ids: &[u32]) -> Vec<Vec<f64>> {
    let cfg: llama::LlamaConfig =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let cfg = cfg.into_config(false);
    let model = llama::Llama::load(var_builder(dir), &cfg).unwrap();
    let mut cache = llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu).unwrap();
    ids.iter()
        .enumerate()
        .map(|(pos, &id)| {
            let l = model.forward(&token(id), pos, &mut cache).unwrap();
            l.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .into_iter()
                .map(f64::from)
                .collect()
        })
        .collect()
}

/// Candle's Qwen3, fed one token at a time through its KV cache.
fn candle_qwen3_logits(dir: &Path, ids: &[u32]) -> Vec<Vec<f64>> {
    let cfg: qwen3::Config =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let mut model = qwen3::ModelForCausalLM::new(&cfg, var_builder(dir)).unwrap();
    ids.iter()
        .enumerate()
        .map(|(pos, &id)| {
            let l = model.forward(&token(id), pos).unwrap();
            l.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .into_iter()
                .map(f64::from)
                .collect()
        })
        .collect()
}

fn logits_f64(l: Tensor) -> Vec<f64> {
    l.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

/// Candle's Qwen3-MoE, fed one token at a time through its KV cache. Candle reads
/// `decoder_sparse_step` but not `mlp_only_layers`, so the models given to it leave that empty.
fn candle_qwen3_moe_logits(dir: &Path, ids: &[u32]) -> Vec<Vec<f64>> {
    let cfg: qwen3_moe::Config =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let mut model = qwen3_moe::ModelForCausalLM::new(&cfg, var_builder(dir)).unwrap();
    ids.iter()
        .enumerate()
        .map(|(pos, &id)| logits_f64(model.forward(&token(id), pos).unwrap()))
        .collect()
}

/// Candle's Mixtral. It applies the sliding window only through the mask of a multi-token
/// forward (a cached decode attends to everything), and that mask keeps `sliding_window + 1`
/// positions where Hugging Face keeps `sliding_window`; so every prefix runs from scratch, with
/// the window given as one less, and the last position's logits are kept.
fn candle_mixtral_logits(dir: &Path, ids: &[u32]) -> Vec<Vec<f64>> {
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let window = json["sliding_window"].as_u64().unwrap();
    json["sliding_window"] = serde_json::json!(window - 1);
    json["use_flash_attn"] = serde_json::json!(false);
    let cfg: mixtral::Config = serde_json::from_value(json).unwrap();
    let vb = var_builder(dir);
    (1..=ids.len())
        .map(|n| {
            let mut model = mixtral::Model::new(&cfg, vb.clone()).unwrap();
            let input = Tensor::new(&ids[..n], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            logits_f64(model.forward(&input, 0).unwrap())
        })
        .collect()
}

fn check(name: &str, dir: &Path, candle: Vec<Vec<f64>>, ids: &[u32]) {
    let reference = ReferenceModel::load(dir)
        .unwrap()
        .logits(ids, Breakage::None)
        .unwrap();
    let (std, pmax) = logit_stats(&reference);
    let rel = max_rel_diff(&reference, &candle);
    eprintln!(
        "{name}: max rel diff vs candle {rel:.3e} (logit std {std:.2}, mean max prob {pmax:.3})"
    );
    assert!(
        rel < LOGIT_TOL,
        "{name}: reference and candle disagree: {rel:.3e}"
    );
    // A trivial model (flat logits) would make the comparison meaningless.
    assert!(
        std > 0.5 && pmax < 0.9,
        "{name}: model too trivial: std {std}, pmax {pmax}"
    );
}

#[test]
fn llama_silu_gqa_untied_f32_matches_candle() {
    let spec = TinySpec {
        kv_heads: 2,
        seed: 11,
        ..TinySpec::llama()
    };
    let dir = model_dir("llama-silu", &spec);
    let ids = random_ids(101, PROMPT_LEN, spec.vocab);
    check("llama silu", &dir, candle_llama_logits(&dir, &ids), &ids);
}

#[test]
fn llama3_rope_scaling_tied_f16_matches_candle() {
    // Short original context so the low/smooth/high frequency bands all occur within the prompt.
    let spec = TinySpec {
        hidden: 128,
        heads: 8,
        kv_heads: 4,
        head_dim: 16,
        tied: true,
        dtype: WeightDtype::F16,
        seed: 12,
        rope_theta: 10_000.0,
        llama3_rope_scaling: Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        }),
        ..TinySpec::llama()
    };
    let dir = model_dir("llama3-scaling", &spec);
    let ids = random_ids(102, PROMPT_LEN, spec.vocab);
    check(
        "llama3 rope scaling",
        &dir,
        candle_llama_logits(&dir, &ids),
        &ids,
    );
}

#[test]
fn qwen3_gqa_qk_norm_bf16_sharded_matches_candle() {
    let spec = TinySpec {
        dtype: WeightDtype::BF16,
        shards: 2,
        seed: 13,
        ..TinySpec::qwen3()
    };
    assert_ne!(spec.head_dim, spec.hidden / spec.heads);
    let dir = model_dir("qwen3-silu", &spec);
    let ids = random_ids(103, PROMPT_LEN, spec.vocab);
    check("qwen3 silu", &dir, candle_qwen3_logits(&dir, &ids), &ids);
}

#[test]
fn qwen3_relu_untied_f32_matches_candle() {
    let spec = TinySpec {
        act: Act::Relu,
        tied: false,
        seed: 14,
        ..TinySpec::qwen3()
    };
    let dir = model_dir("qwen3-relu", &spec);
    let ids = random_ids(104, PROMPT_LEN, spec.vocab);
    check("qwen3 relu", &dir, candle_qwen3_logits(&dir, &ids), &ids);
}

#[test]
fn qwen3_moe_top2_sparse_step_matches_candle() {
    let mut spec = TinySpec {
        seed: 15,
        layers: 2,
        ..TinySpec::qwen3_moe()
    };
    let moe = spec.moe.as_mut().unwrap();
    // Layer 0 dense by the step, layer 1 sparse; see candle_qwen3_moe_logits.
    moe.decoder_sparse_step = 2;
    moe.mlp_only_layers.clear();
    let dir = model_dir("qwen3-moe", &spec);
    let ids = random_ids(105, PROMPT_LEN, spec.vocab);
    check("qwen3-moe", &dir, candle_qwen3_moe_logits(&dir, &ids), &ids);
}

#[test]
fn qwen3_moe_renormalised_bf16_matches_candle() {
    let mut spec = TinySpec {
        seed: 16,
        layers: 2,
        dtype: WeightDtype::BF16,
        ..TinySpec::qwen3_moe()
    };
    let moe = spec.moe.as_mut().unwrap();
    moe.norm_topk_prob = true;
    moe.top_k = 3;
    moe.mlp_only_layers.clear();
    let dir = model_dir("qwen3-moe-norm", &spec);
    let ids = random_ids(106, PROMPT_LEN, spec.vocab);
    check(
        "qwen3-moe renormalised",
        &dir,
        candle_qwen3_moe_logits(&dir, &ids),
        &ids,
    );
}

#[test]
fn mixtral_top2_sliding_window_matches_candle() {
    let spec = TinySpec {
        seed: 17,
        ..TinySpec::mixtral()
    };
    assert!(spec.sliding_window.unwrap() < PROMPT_LEN);
    let dir = model_dir("mixtral", &spec);
    let ids = random_ids(107, PROMPT_LEN, spec.vocab);
    check("mixtral", &dir, candle_mixtral_logits(&dir, &ids), &ids);
}
