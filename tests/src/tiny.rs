//! Tiny random Hugging Face model directories.
//!
//! Weights are deliberately far from a trained model's "near identity" regime: norm weights are
//! random, attention is peaked, logits have a spread of a few units. That way a wrong rope, a
//! missing norm or a swapped tensor moves the logits by orders of magnitude more than the
//! comparison tolerance instead of hiding in the noise.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

/// Model family; decides `architectures`, `model_type`, whether q/k norms exist and, for the
/// mixtures of experts, how the expert tensors are named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen3,
    Mistral,
    /// Qwen3's attention with `mlp.gate` + `mlp.experts.{e}.{gate,up,down}_proj`.
    Qwen3Moe,
    /// Mistral's attention with `block_sparse_moe.gate` + `block_sparse_moe.experts.{e}.w1/w3/w2`.
    Mixtral,
}

/// The mixture-of-experts shape of a [`Arch::Qwen3Moe`] or [`Arch::Mixtral`] model.
#[derive(Clone, Debug, PartialEq)]
pub struct TinyMoe {
    pub experts: usize,
    pub top_k: usize,
    /// Qwen3-MoE's `moe_intermediate_size`; Mixtral's experts are `intermediate` wide.
    pub expert_intermediate: usize,
    /// Qwen3-MoE's `norm_topk_prob` (Mixtral always renormalises).
    pub norm_topk_prob: bool,
    /// Qwen3-MoE: layer `l` is sparse when `(l + 1) % decoder_sparse_step == 0` and `l` is not in
    /// `mlp_only_layers`.
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    /// Router rows of expert `e` are scaled by `1 + skew · e`, so some experts win far more
    /// often than others (uneven routing).
    pub skew: f64,
}

impl TinyMoe {
    /// Whether layer `l` of an `arch` model is a mixture of experts.
    pub fn is_moe_layer(&self, arch: Arch, l: usize) -> bool {
        arch == Arch::Mixtral
            || ((l + 1).is_multiple_of(self.decoder_sparse_step)
                && !self.mlp_only_layers.contains(&l))
    }
}

/// FFN activation (`hidden_act`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    Silu,
    Relu,
}

/// Storage dtype of every tensor in the safetensors files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    F16,
    BF16,
}

/// Llama-3 style `rope_scaling` parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// Everything that shapes a tiny model. Start from [`TinySpec::llama`] or [`TinySpec::qwen3`].
#[derive(Clone, Debug)]
pub struct TinySpec {
    pub arch: Arch,
    pub act: Act,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Explicit, written to config.json; may differ from `hidden / heads`.
    pub head_dim: usize,
    pub vocab: usize,
    pub tied: bool,
    pub dtype: WeightDtype,
    /// 1 = `model.safetensors`; more = HF sharded layout with an index.
    pub shards: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub seed: u64,
    pub llama3_rope_scaling: Option<Llama3RopeScaling>,
    /// Transformers v5 layout: `rope_parameters` holds `rope_theta` (and the llama3 scaling
    /// fields when present) instead of top-level `rope_theta` / `rope_scaling`.
    pub rope_theta_in_rope_parameters: bool,
    pub max_position_embeddings: usize,
    /// Written as `sliding_window` (Mistral); `None` writes `null`.
    pub sliding_window: Option<usize>,
    /// The experts of [`Arch::Qwen3Moe`] / [`Arch::Mixtral`]; `None` for dense families.
    pub moe: Option<TinyMoe>,
}

impl TinySpec {
    /// Llama, SiLU, MHA, f32, untied, one shard.
    pub fn llama() -> Self {
        TinySpec {
            arch: Arch::Llama,
            act: Act::Silu,
            hidden: 64,
            intermediate: 160,
            layers: 2,
            heads: 4,
            kv_heads: 4,
            head_dim: 16,
            vocab: 4096,
            tied: false,
            dtype: WeightDtype::F32,
            shards: 1,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-5,
            seed: 1,
            llama3_rope_scaling: None,
            rope_theta_in_rope_parameters: false,
            max_position_embeddings: 512,
            sliding_window: None,
            moe: None,
        }
    }

    /// Qwen3 with GQA, q/k norm, tied embeddings and `head_dim != hidden / heads`.
    pub fn qwen3() -> Self {
        TinySpec {
            arch: Arch::Qwen3,
            hidden: 96,
            intermediate: 192,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            tied: true,
            rope_theta: 1_000_000.0,
            rms_norm_eps: 1e-6,
            ..TinySpec::llama()
        }
    }

    /// Mistral, SiLU, GQA, with a sliding window.
    pub fn mistral() -> Self {
        TinySpec {
            arch: Arch::Mistral,
            heads: 4,
            kv_heads: 2,
            sliding_window: Some(24),
            ..TinySpec::llama()
        }
    }

    /// Qwen3-MoE: 8 experts of 48 neurons, top-2 without renormalisation, layer 0 dense by
    /// `mlp_only_layers`, skewed routing.
    pub fn qwen3_moe() -> Self {
        TinySpec {
            arch: Arch::Qwen3Moe,
            layers: 3,
            moe: Some(TinyMoe {
                experts: 8,
                top_k: 2,
                expert_intermediate: 48,
                norm_topk_prob: false,
                decoder_sparse_step: 1,
                mlp_only_layers: vec![0],
                skew: 0.25,
            }),
            ..TinySpec::qwen3()
        }
    }

    /// Mixtral: 8 experts of `intermediate` neurons, top-2, a sliding window, skewed routing.
    pub fn mixtral() -> Self {
        TinySpec {
            arch: Arch::Mixtral,
            intermediate: 32,
            moe: Some(TinyMoe {
                experts: 8,
                top_k: 2,
                expert_intermediate: 32,
                norm_topk_prob: true,
                decoder_sparse_step: 1,
                mlp_only_layers: Vec::new(),
                skew: 0.25,
            }),
            ..TinySpec::mistral()
        }
    }
}

impl Arch {
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Arch::Llama => ("LlamaForCausalLM", "llama"),
            Arch::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
            Arch::Mistral => ("MistralForCausalLM", "mistral"),
            Arch::Qwen3Moe => ("Qwen3MoeForCausalLM", "qwen3_moe"),
            Arch::Mixtral => ("MixtralForCausalLM", "mixtral"),
        }
    }

    /// Per-head q/k RMSNorm (the Qwen3 family).
    pub fn qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe)
    }
}

/// Workspace `models/` directory (holds the real tokenizer we copy).
pub fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models")
}

/// Pseudo-random token ids in `[0, vocab)`; prompts need no tokenizer.
pub fn random_ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// Standard normal via Box-Muller (rand 0.9 has no Normal without rand_distr).
fn normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>(); // (0, 1]
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

fn uniform(rng: &mut StdRng, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// A linear weight `[out, in]` ~ U(-gain/sqrt(in), gain/sqrt(in)).
fn linear(rng: &mut StdRng, out: usize, inp: usize, gain: f64) -> (Vec<usize>, Vec<f64>) {
    let a = gain / (inp as f64).sqrt();
    (vec![out, inp], uniform(rng, out * inp, -a, a))
}

fn norm_weight(rng: &mut StdRng, n: usize) -> (Vec<usize>, Vec<f64>) {
    (vec![n], uniform(rng, n, 0.5, 1.5))
}

fn encode(values: &[f64], dtype: WeightDtype) -> (Dtype, Vec<u8>) {
    match dtype {
        WeightDtype::F32 => (
            Dtype::F32,
            values
                .iter()
                .flat_map(|&v| (v as f32).to_le_bytes())
                .collect(),
        ),
        WeightDtype::F16 => (
            Dtype::F16,
            values
                .iter()
                .flat_map(|&v| half::f16::from_f64(v).to_le_bytes())
                .collect(),
        ),
        WeightDtype::BF16 => (
            Dtype::BF16,
            values
                .iter()
                .flat_map(|&v| half::bf16::from_f64(v).to_le_bytes())
                .collect(),
        ),
    }
}

/// All tensors in a fixed order, so a seed always gives the same model.
fn generate_tensors(spec: &TinySpec) -> Vec<(String, Vec<usize>, Vec<f64>)> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let (h, i, hd) = (spec.hidden, spec.intermediate, spec.head_dim);
    let q_out = spec.heads * hd;
    let kv_out = spec.kv_heads * hd;
    let mut out = Vec::new();

    // Small embeddings: the tied lm_head then gives logits with std ~2.5 regardless of `hidden`.
    let emb_std = 2.5 / (h as f64).sqrt();
    let emb: Vec<f64> = (0..spec.vocab * h)
        .map(|_| emb_std * normal(&mut rng))
        .collect();
    out.push((
        "model.embed_tokens.weight".to_string(),
        vec![spec.vocab, h],
        emb,
    ));

    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        let mut push = |name: &str, t: (Vec<usize>, Vec<f64>)| {
            out.push((format!("{p}.{name}.weight"), t.0, t.1));
        };
        push("input_layernorm", norm_weight(&mut rng, h));
        // Larger q/k gain makes attention clearly non-uniform.
        push("self_attn.q_proj", linear(&mut rng, q_out, h, 2.5));
        push("self_attn.k_proj", linear(&mut rng, kv_out, h, 2.5));
        push("self_attn.v_proj", linear(&mut rng, kv_out, h, 2.0));
        push("self_attn.o_proj", linear(&mut rng, h, q_out, 2.0));
        if spec.arch.qk_norm() {
            push("self_attn.q_norm", norm_weight(&mut rng, hd));
            push("self_attn.k_norm", norm_weight(&mut rng, hd));
        }
        push("post_attention_layernorm", norm_weight(&mut rng, h));
        match &spec.moe {
            Some(m) if m.is_moe_layer(spec.arch, l) => {
                let (block, [gate, up, down]) = match spec.arch {
                    Arch::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
                    _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
                };
                // A strong router (gain 4) so that routing is decisive, rows skewed per expert.
                let (shape, mut router) = linear(&mut rng, m.experts, h, 4.0);
                for (e, row) in router.chunks_exact_mut(h).enumerate() {
                    row.iter_mut().for_each(|v| *v *= 1.0 + m.skew * e as f64);
                }
                push(&format!("{block}.gate"), (shape, router));
                let n = m.expert_intermediate;
                for e in 0..m.experts {
                    let x = format!("{block}.experts.{e}");
                    push(&format!("{x}.{gate}"), linear(&mut rng, n, h, 2.0));
                    push(&format!("{x}.{up}"), linear(&mut rng, n, h, 2.0));
                    push(&format!("{x}.{down}"), linear(&mut rng, h, n, 2.0));
                }
            }
            _ => {
                push("mlp.gate_proj", linear(&mut rng, i, h, 2.0));
                push("mlp.up_proj", linear(&mut rng, i, h, 2.0));
                push("mlp.down_proj", linear(&mut rng, h, i, 2.0));
            }
        }
    }
    let (s, v) = norm_weight(&mut rng, h);
    out.push(("model.norm.weight".to_string(), s, v));
    if !spec.tied {
        let (s, v) = linear(&mut rng, spec.vocab, h, 4.0);
        out.push(("lm_head.weight".to_string(), s, v));
    }
    out
}

fn config_json(spec: &TinySpec) -> Value {
    let (arch_name, model_type) = spec.arch.names();
    let mut c = json!({
        "architectures": [arch_name],
        "model_type": model_type,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": match spec.act { Act::Silu => "silu", Act::Relu => "relu" },
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tied,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_position_embeddings,
        "eos_token_id": 0,
        "bos_token_id": null,
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": match spec.dtype {
            WeightDtype::F32 => "float32",
            WeightDtype::F16 => "float16",
            WeightDtype::BF16 => "bfloat16",
        },
    });
    let obj = c.as_object_mut().expect("object");
    let scaling = spec.llama3_rope_scaling.map(|s| {
        json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        })
    });
    if spec.rope_theta_in_rope_parameters {
        let mut rp = scaling.unwrap_or_else(|| json!({ "rope_type": "default" }));
        rp["rope_theta"] = json!(spec.rope_theta);
        obj.insert("rope_parameters".into(), rp);
    } else {
        obj.insert("rope_theta".into(), json!(spec.rope_theta));
        if let Some(s) = scaling {
            obj.insert("rope_scaling".into(), s);
        }
    }
    match spec.arch {
        Arch::Mistral | Arch::Mixtral => {
            obj.insert("sliding_window".into(), json!(spec.sliding_window));
        }
        Arch::Qwen3 | Arch::Qwen3Moe => {
            obj.insert("use_sliding_window".into(), json!(false));
            obj.insert("sliding_window".into(), Value::Null);
            obj.insert("max_window_layers".into(), json!(spec.layers));
        }
        Arch::Llama => {}
    }
    if let Some(m) = &spec.moe {
        obj.insert("num_experts_per_tok".into(), json!(m.top_k));
        if spec.arch == Arch::Mixtral {
            obj.insert("num_local_experts".into(), json!(m.experts));
        } else {
            obj.insert("num_experts".into(), json!(m.experts));
            obj.insert("moe_intermediate_size".into(), json!(m.expert_intermediate));
            obj.insert("norm_topk_prob".into(), json!(m.norm_topk_prob));
            obj.insert("decoder_sparse_step".into(), json!(m.decoder_sparse_step));
            obj.insert("mlp_only_layers".into(), json!(m.mlp_only_layers));
        }
    }
    c
}

fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f64>)],
    dtype: WeightDtype,
) -> Result<()> {
    let encoded: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| {
            let (dt, bytes) = encode(v, dtype);
            (n.clone(), s.clone(), dt, bytes)
        })
        .collect();
    let views = encoded
        .iter()
        .map(|(n, s, dt, b)| Ok((n.clone(), TensorView::new(*dt, s.clone(), b)?)))
        .collect::<Result<Vec<_>>>()?;
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    safetensors::serialize_to_file(views, Some(meta), path)
        .with_context(|| format!("writing {}", path.display()))
}

/// Writes config.json, the safetensors file(s) and tokenizer.json into `dir` (created if needed).
pub fn write_tiny_model(dir: &Path, spec: &TinySpec) -> Result<()> {
    if spec.shards == 0 {
        bail!("shards must be >= 1");
    }
    if spec.kv_heads == 0 || !spec.heads.is_multiple_of(spec.kv_heads) {
        bail!(
            "heads ({}) must be a multiple of kv_heads ({})",
            spec.heads,
            spec.kv_heads
        );
    }
    if !spec.head_dim.is_multiple_of(2) {
        bail!("head_dim must be even for rope");
    }
    if spec.arch == Arch::Llama && spec.sliding_window.is_some() {
        bail!("Llama has no sliding window");
    }
    let moe_arch = matches!(spec.arch, Arch::Qwen3Moe | Arch::Mixtral);
    if moe_arch != spec.moe.is_some() {
        bail!("experts (`moe`) go with the Qwen3Moe and Mixtral architectures, and only them");
    }
    if let Some(m) = &spec.moe {
        if spec.arch == Arch::Mixtral && m.expert_intermediate != spec.intermediate {
            bail!("Mixtral's experts are `intermediate` wide");
        }
        if m.top_k == 0 || m.top_k > m.experts || m.decoder_sparse_step == 0 {
            bail!("bad expert counts");
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;

    let config = serde_json::to_string_pretty(&config_json(spec))?;
    std::fs::write(dir.join("config.json"), config)?;

    let tensors = generate_tensors(spec);
    if spec.shards == 1 {
        write_safetensors(&dir.join("model.safetensors"), &tensors, spec.dtype)?;
    } else {
        let bytes_per = match spec.dtype {
            WeightDtype::F32 => 4,
            _ => 2,
        };
        // Contiguous chunks of the tensor list, so layers straddle shard boundaries.
        let per = tensors.len().div_ceil(spec.shards);
        if tensors.chunks(per).count() != spec.shards {
            bail!(
                "cannot split {} tensors into {} shards",
                tensors.len(),
                spec.shards
            );
        }
        let mut weight_map = BTreeMap::new();
        let mut total = 0usize;
        for (k, chunk) in tensors.chunks(per).enumerate() {
            let file = format!("model-{:05}-of-{:05}.safetensors", k + 1, spec.shards);
            write_safetensors(&dir.join(&file), chunk, spec.dtype)?;
            for (n, _, v) in chunk {
                weight_map.insert(n.clone(), file.clone());
                total += v.len() * bytes_per;
            }
        }
        let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)?,
        )?;
    }

    let tok = models_dir().join("austen-relu/tokenizer.json");
    std::fs::copy(&tok, dir.join("tokenizer.json"))
        .with_context(|| format!("copying {}", tok.display()))?;
    Ok(())
}
