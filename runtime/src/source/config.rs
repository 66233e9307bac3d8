//! Model configuration from a Hugging Face `config.json`. The struct itself belongs to the file
//! format (a converted file carries it), so it is defined in `leanstream-format`.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

pub use leanstream_format::model_config::{
    Activation, Architecture, BlockOptions, Llama3RopeScaling, LongRope, ModelConfig, MoeConfig,
};

/// `eos_token_id` is an integer, a list, or null in the wild.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    fn into_vec(self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![id],
            TokenIds::Many(ids) => ids,
        }
    }
}

#[derive(Debug, Deserialize)]
struct RopeParameters {
    rope_theta: Option<f32>,
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    factor: Option<f32>,
    low_freq_factor: Option<f32>,
    high_freq_factor: Option<f32>,
    original_max_position_embeddings: Option<usize>,
    // Phi-3's LongRoPE.
    long_factor: Option<Vec<f32>>,
    short_factor: Option<Vec<f32>>,
    attention_factor: Option<f32>,
    partial_rotary_factor: Option<f32>,
}

/// The subset of Hugging Face's `config.json` fields the engine reads.
#[derive(Debug, Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    /// One [`RopeParameters`], or (Gemma 3 in transformers 5) one per layer type.
    rope_parameters: Option<serde_json::Value>,
    rope_scaling: Option<RopeParameters>,
    hidden_act: Option<String>,
    /// ProSparse's FATReLU threshold (`hidden_act: "fatrelu"`).
    hidden_act_param: Option<f32>,
    // Gemma 2 and 3.
    hidden_activation: Option<String>,
    query_pre_attn_scalar: Option<f32>,
    attn_logit_softcapping: Option<f32>,
    final_logit_softcapping: Option<f32>,
    layer_types: Option<Vec<String>>,
    sliding_window_pattern: Option<usize>,
    rope_local_base_freq: Option<f32>,
    // Phi-3.
    original_max_position_embeddings: Option<usize>,
    partial_rotary_factor: Option<f32>,
    tie_word_embeddings: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    bos_token_id: Option<TokenIds>,
    eos_token_id: Option<TokenIds>,
    // Mixture of experts: Qwen3-MoE names the expert count `num_experts`, Mixtral
    // `num_local_experts`.
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    shared_expert_intermediate_size: Option<usize>,
    // SmolLM3's NoPE layers.
    no_rope_layers: Option<Vec<u8>>,
    no_rope_layer_interval: Option<usize>,
}

/// The mixture-of-experts part of a config: Qwen3-MoE's (`num_experts`, `moe_intermediate_size`,
/// `norm_topk_prob`, `decoder_sparse_step`, `mlp_only_layers`) or Mixtral's (`num_local_experts`,
/// experts as wide as `intermediate_size`, always renormalised).
fn moe_config(hf: &HfConfig, mixtral: bool) -> Result<MoeConfig> {
    if hf.shared_expert_intermediate_size.is_some_and(|n| n > 0) {
        bail!("shared experts (shared_expert_intermediate_size) are not supported");
    }
    let missing = |f: &str| anyhow::anyhow!("a mixture-of-experts config needs {f}");
    let experts_per_token = hf
        .num_experts_per_tok
        .ok_or_else(|| missing("num_experts_per_tok"))?;
    if mixtral {
        return Ok(MoeConfig {
            num_experts: hf
                .num_local_experts
                .ok_or_else(|| missing("num_local_experts"))?,
            experts_per_token,
            expert_intermediate_size: hf.intermediate_size,
            norm_topk_prob: true,
            dense_layers: Vec::new(),
        });
    }
    let step = hf.decoder_sparse_step.unwrap_or(1);
    if step == 0 {
        bail!("decoder_sparse_step must be at least 1");
    }
    let mlp_only = hf.mlp_only_layers.clone().unwrap_or_default();
    Ok(MoeConfig {
        // transformers 5 writes Qwen3-MoE's expert count as `num_local_experts`, as Mixtral's.
        num_experts: hf
            .num_experts
            .or(hf.num_local_experts)
            .ok_or_else(|| missing("num_experts (or num_local_experts)"))?,
        experts_per_token,
        expert_intermediate_size: hf
            .moe_intermediate_size
            .ok_or_else(|| missing("moe_intermediate_size"))?,
        norm_topk_prob: hf.norm_topk_prob.unwrap_or(false),
        dense_layers: (0..hf.num_hidden_layers)
            .filter(|l| mlp_only.contains(l) || !(l + 1).is_multiple_of(step))
            .collect(),
    })
}

/// Gemma's windows: `sliding_window` for the layers `layer_types` names `sliding_attention`, else
/// (older configs) every other layer from the first (Gemma 2) or all but every
/// `sliding_window_pattern`-th (Gemma 3, 6 by default); the other layers attend to everything.
fn gemma_windows(hf: &HfConfig, arch: Architecture) -> Result<(Option<usize>, Vec<usize>)> {
    let layers = hf.num_hidden_layers;
    let full: Vec<usize> = match &hf.layer_types {
        Some(types) if types.len() != layers => {
            bail!(
                "layer_types has {} entries for {layers} layers",
                types.len()
            )
        }
        Some(types) => {
            let mut full = Vec::new();
            for (l, t) in types.iter().enumerate() {
                match t.as_str() {
                    "full_attention" => full.push(l),
                    "sliding_attention" => {}
                    other => bail!(
                        "layer_types[{l}] = {other:?}: expected full_attention or \
                                    sliding_attention"
                    ),
                }
            }
            full
        }
        None => {
            let every = match arch {
                Architecture::Gemma2 => 2,
                _ => hf.sliding_window_pattern.unwrap_or(6),
            };
            if every == 0 {
                bail!("sliding_window_pattern must be at least 1");
            }
            (0..layers)
                .filter(|l| (l + 1).is_multiple_of(every))
                .collect()
        }
    };
    match hf.sliding_window {
        Some(w) if full.len() < layers => Ok((Some(w), full)),
        _ => Ok((None, Vec::new())),
    }
}

/// Phi-3's LongRoPE from `rope_scaling` (or `rope_parameters`): both factor lists, the original
/// context (there or at the top level) and the attention factor, given or as transformers derives
/// it: `sqrt(1 + ln(s) / ln(original))` for the scale `s = max_position_embeddings / original`.
fn long_rope(hf: &HfConfig, s: &RopeParameters) -> Result<LongRope> {
    let missing = |f: &str| anyhow::anyhow!("rope_scaling of type longrope lacks {f}");
    let original = s
        .original_max_position_embeddings
        .or(hf.original_max_position_embeddings)
        .ok_or_else(|| missing("original_max_position_embeddings"))?;
    let factor = match s.factor {
        Some(f) => f as f64,
        None => hf.max_position_embeddings.unwrap_or(original) as f64 / original as f64,
    };
    let attention_factor = match s.attention_factor {
        Some(a) => a,
        None if factor <= 1.0 => 1.0,
        None => (1.0 + factor.ln() / (original as f64).ln()).sqrt() as f32,
    };
    Ok(LongRope {
        short_factor: s
            .short_factor
            .clone()
            .ok_or_else(|| missing("short_factor"))?,
        long_factor: s
            .long_factor
            .clone()
            .ok_or_else(|| missing("long_factor"))?,
        original_max_position_embeddings: original,
        attention_factor,
    })
}

/// Reads and validates `config.json` in a model directory.
pub fn from_hf_dir(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "cannot read {}: a model directory needs the Hugging Face config.json",
            path.display()
        )
    })?;
    from_hf_json(&text).with_context(|| format!("invalid model config {}", path.display()))
}

/// Parses the text of a Hugging Face `config.json`.
pub fn from_hf_json(text: &str) -> Result<ModelConfig> {
    let hf: HfConfig = serde_json::from_str(text).context("config.json is not valid")?;
    let arch_name = hf
        .architectures
        .as_ref()
        .and_then(|a| a.first().cloned())
        .or_else(|| hf.model_type.clone())
        .unwrap_or_default();
    // Mixtures of experts share their family's attention: Qwen3-MoE is Qwen3's, Mixtral Mistral's.
    let (architecture, moe) = match arch_name.as_str() {
        // ProSparse's ReLU-fied Llama 2 (`SparseLlamaForCausalLM`, its own modelling code) is
        // Llama's block with a FATReLU gate.
        "LlamaForCausalLM" | "llama" | "SparseLlamaForCausalLM" | "sparsellama" => {
            (Architecture::Llama, None)
        }
        // Bamboo and TurboSparse-Mistral: Mistral's block with dReLU (their `hidden_act` is
        // "relu", applied by their modelling code to the gate and the up projection).
        "BambooForCausalLM" | "bamboo" => (Architecture::Mistral, None),
        "Qwen3ForCausalLM" | "qwen3" => (Architecture::Qwen3, None),
        "MistralForCausalLM" | "mistral" => (Architecture::Mistral, None),
        "Qwen2ForCausalLM" | "qwen2" => (Architecture::Qwen2, None),
        // SmolLM3 is Llama's block with some layers' rope left out (NoPE).
        "SmolLM3ForCausalLM" | "smollm3" => (Architecture::Llama, None),
        "Qwen3MoeForCausalLM" | "qwen3_moe" => (Architecture::Qwen3, Some(moe_config(&hf, false)?)),
        "MixtralForCausalLM" | "mixtral" => (Architecture::Mistral, Some(moe_config(&hf, true)?)),
        // TurboSparse-Mixtral: Mixtral's mixture whose experts are dReLU (`hidden_act` "relu" on
        // the gate and the up projection); its modelling code is its own.
        "TurboSparseMixtralForCausalLM" | "turbosparsemixtral" => {
            (Architecture::Mistral, Some(moe_config(&hf, true)?))
        }
        "Gemma2ForCausalLM" | "gemma2" => (Architecture::Gemma2, None),
        "Gemma3ForCausalLM" | "gemma3_text" => (Architecture::Gemma3, None),
        "Phi3ForCausalLM" | "phi3" => (Architecture::Phi3, None),
        other => bail!(
            "unsupported architecture {other:?}: LeanStream supports LlamaForCausalLM (Llama 2 \
             and 3.x, SmolLM2), SmolLM3ForCausalLM, Qwen2ForCausalLM (Qwen2, Qwen2.5), Qwen3ForCausalLM, \
             MistralForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, Gemma2ForCausalLM, \
             Gemma3ForCausalLM (text), Phi3ForCausalLM (Phi-3, Phi-3.5), SparseLlamaForCausalLM \
             (ProSparse), BambooForCausalLM (TurboSparse-Mistral) and \
             TurboSparseMixtralForCausalLM"
        ),
    };
    let act_name = hf.hidden_activation.as_deref().or(hf.hidden_act.as_deref());
    let dual_relu = matches!(
        arch_name.as_str(),
        "BambooForCausalLM" | "bamboo" | "TurboSparseMixtralForCausalLM" | "turbosparsemixtral"
    );
    let activation = match act_name.unwrap_or("silu") {
        "relu" if dual_relu => Activation::DRelu,
        other if dual_relu => bail!(
            "unsupported hidden_act {other:?} for {arch_name}: its FFN is dReLU, \"relu\" on the \
             gate and up projections"
        ),
        "silu" | "swish" => Activation::Silu,
        "relu" => Activation::Relu,
        "fatrelu" => {
            let t = hf.hidden_act_param.unwrap_or(0.0);
            if !(t.is_finite() && t >= 0.0) {
                bail!(
                    "hidden_act \"fatrelu\" with hidden_act_param {t}: the threshold must be \
                     finite and at least 0"
                );
            }
            // FATReLU at 0 is ReLU (`g ≥ 0 ? g : 0`).
            if t == 0.0 {
                Activation::Relu
            } else {
                Activation::FatRelu { threshold: t }
            }
        }
        "gelu_pytorch_tanh" | "gelu_tanh" => Activation::GeluTanh,
        other => bail!(
            "unsupported hidden_act {other:?}: supported are \"silu\", \"relu\", \"fatrelu\" \
             (with hidden_act_param) and \"gelu_pytorch_tanh\""
        ),
    };
    // Qwen2's q/k/v projections always carry biases (its config has no attention_bias key); its
    // output projection never does.
    let qkv_bias = architecture == Architecture::Qwen2;
    if (!qkv_bias && hf.attention_bias == Some(true)) || hf.mlp_bias == Some(true) {
        bail!(
            "attention_bias / mlp_bias = true is not supported for {arch_name} (only Qwen2's q/k/v \
             biases are)"
        );
    }
    let num_kv_heads = hf.num_key_value_heads.unwrap_or(hf.num_attention_heads);
    let head_dim = hf
        .head_dim
        .or_else(|| hf.hidden_size.checked_div(hf.num_attention_heads))
        .unwrap_or(0);
    // transformers 5 writes Gemma 3's rope per layer type: the global one and the sliding one.
    let by_type = |t: &str| -> Result<Option<RopeParameters>> {
        match hf.rope_parameters.as_ref().and_then(|p| p.get(t)) {
            Some(v) => Ok(Some(
                serde_json::from_value(v.clone())
                    .with_context(|| format!("rope_parameters.{t} is not valid"))?,
            )),
            None => Ok(None),
        }
    };
    let (rope_params, local_params) = match by_type("full_attention")? {
        Some(full) => (Some(full), by_type("sliding_attention")?),
        None => match &hf.rope_parameters {
            Some(v) => (
                Some(serde_json::from_value(v.clone()).context("rope_parameters is not valid")?),
                None,
            ),
            None => (None, None),
        },
    };
    let rope_params = rope_params.as_ref();
    let rope_theta = hf
        .rope_theta
        .or_else(|| rope_params.and_then(|p| p.rope_theta))
        .unwrap_or(10000.0);
    let scaling = hf.rope_scaling.as_ref().or(rope_params);
    let partial = hf
        .partial_rotary_factor
        .or_else(|| scaling.and_then(|s| s.partial_rotary_factor));
    if partial.is_some_and(|f| f != 1.0) {
        bail!(
            "partial_rotary_factor {partial:?} is not supported (only 1.0: rope over whole heads)"
        );
    }
    let mut longrope = None;
    let mut rope_freq_factors = None;
    let rope_scaling = match scaling.and_then(|s| s.rope_type.as_deref().or(s.kind.as_deref())) {
        None | Some("default") => None,
        Some("linear") => {
            let f = scaling
                .and_then(|s| s.factor)
                .context("linear rope_scaling lacks factor")?;
            rope_freq_factors = Some(vec![f; head_dim / 2]);
            None
        }
        Some("longrope" | "su") => {
            longrope = Some(long_rope(&hf, scaling.expect("checked above"))?);
            None
        }
        Some("llama3") => {
            let s = scaling.expect("checked above");
            let missing = |f: &str| anyhow::anyhow!("rope_scaling of type llama3 lacks {f}");
            Some(Llama3RopeScaling {
                factor: s.factor.ok_or_else(|| missing("factor"))?,
                low_freq_factor: s
                    .low_freq_factor
                    .ok_or_else(|| missing("low_freq_factor"))?,
                high_freq_factor: s
                    .high_freq_factor
                    .ok_or_else(|| missing("high_freq_factor"))?,
                original_max_position_embeddings: s
                    .original_max_position_embeddings
                    .ok_or_else(|| missing("original_max_position_embeddings"))?,
            })
        }
        Some(other) => {
            bail!("unsupported rope scaling type {other:?} (supported: llama3, linear, longrope)")
        }
    };
    let smollm3 = matches!(arch_name.as_str(), "SmolLM3ForCausalLM" | "smollm3");
    let sliding_window = match architecture {
        Architecture::Qwen3 | Architecture::Qwen2 if hf.use_sliding_window != Some(true) => None,
        _ if smollm3 && hf.use_sliding_window != Some(true) => None,
        _ => hf.sliding_window,
    };
    // SmolLM3: `no_rope_layers[l]` is 1 where layer l uses rope, else every
    // `no_rope_layer_interval`-th layer (4 by default) goes without.
    let no_rope_layers = if smollm3 {
        match &hf.no_rope_layers {
            Some(flags) if flags.len() != hf.num_hidden_layers => bail!(
                "no_rope_layers has {} entries for {} layers",
                flags.len(),
                hf.num_hidden_layers
            ),
            Some(flags) => (0..flags.len()).filter(|&l| flags[l] == 0).collect(),
            None => {
                let every = hf.no_rope_layer_interval.unwrap_or(4);
                if every == 0 {
                    bail!("no_rope_layer_interval must be at least 1");
                }
                (0..hf.num_hidden_layers)
                    .filter(|l| (l + 1).is_multiple_of(every))
                    .collect()
            }
        }
    } else {
        Vec::new()
    };
    let gemma = architecture.is_gemma();
    let (sliding_window, full_attention_layers) = if gemma {
        gemma_windows(&hf, architecture)?
    } else {
        (sliding_window, Vec::new())
    };
    let block = BlockOptions {
        full_attention_layers,
        rope_local_theta: match architecture {
            Architecture::Gemma3 => Some(
                local_params
                    .and_then(|p| p.rope_theta)
                    .or(hf.rope_local_base_freq)
                    .unwrap_or(10000.0),
            ),
            _ => None,
        },
        longrope,
        // Kept only where it differs from the head size, the scale every other model uses.
        query_pre_attn_scalar: hf
            .query_pre_attn_scalar
            .filter(|&s| gemma && s != head_dim as f32),
        attn_logit_softcap: hf.attn_logit_softcapping.filter(|_| gemma),
        final_logit_softcap: hf.final_logit_softcapping.filter(|_| gemma),
    };
    let config = ModelConfig {
        architecture,
        activation,
        hidden_size: hf.hidden_size,
        intermediate_size: hf.intermediate_size,
        num_layers: hf.num_hidden_layers,
        num_heads: hf.num_attention_heads,
        num_kv_heads,
        head_dim,
        vocab_size: hf.vocab_size,
        max_position_embeddings: hf.max_position_embeddings.unwrap_or(2048),
        rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
        rope_theta,
        rope_scaling,
        rope_freq_factors,
        no_rope_layers,
        sliding_window,
        tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
        qk_norm: matches!(architecture, Architecture::Qwen3 | Architecture::Gemma3),
        qkv_bias,
        bos_token_id: hf.bos_token_id.and_then(|b| b.into_vec().first().copied()),
        eos_token_ids: hf.eos_token_id.map(TokenIds::into_vec).unwrap_or_default(),
        moe,
        block,
    };
    config.validate()?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 1024,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 4096, "hidden_act": "relu", "rope_parameters": {"rope_theta": 5e5},
            "eos_token_id": [1, 2], "tie_word_embeddings": true
        })
    }

    /// ProSparse's config (`SparseLlamaForCausalLM`, `fatrelu` with its threshold in
    /// `hidden_act_param`) and Bamboo/TurboSparse-Mistral's (`BambooForCausalLM`, `relu`, applied to
    /// gate and up); an unknown activation names itself.
    #[test]
    fn parses_the_sparsity_native_activations() {
        let mut j = base();
        j["architectures"] = serde_json::json!(["SparseLlamaForCausalLM"]);
        j["hidden_act"] = "fatrelu".into();
        j["hidden_act_param"] = 0.01.into();
        let c = from_hf_json(&j.to_string()).unwrap();
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!(c.activation, Activation::FatRelu { threshold: 0.01 });
        assert_eq!(c.minor_version(), 9);
        j["hidden_act_param"] = 0.0.into();
        assert_eq!(
            from_hf_json(&j.to_string()).unwrap().activation,
            Activation::Relu
        );
        j["hidden_act_param"] = (-0.5).into();
        let e = format!("{:#}", from_hf_json(&j.to_string()).unwrap_err());
        assert!(e.contains("fatrelu") && e.contains("-0.5"), "{e}");
        let mut j = base();
        j["architectures"] = serde_json::json!(["BambooForCausalLM"]);
        j["sliding_window"] = 4096.into();
        let c = from_hf_json(&j.to_string()).unwrap();
        assert_eq!(c.architecture, Architecture::Mistral);
        assert_eq!(c.activation, Activation::DRelu);
        assert_eq!(c.sliding_window, Some(4096));
        j["hidden_act"] = "silu".into();
        let e = format!("{:#}", from_hf_json(&j.to_string()).unwrap_err());
        assert!(e.contains("\"silu\"") && e.contains("dReLU"), "{e}");
        let mut j = base();
        j["hidden_act"] = "squared_relu".into();
        let e = format!("{:#}", from_hf_json(&j.to_string()).unwrap_err());
        assert!(e.contains("\"squared_relu\""), "{e}");
    }

    #[test]
    fn parses_llama_with_rope_parameters() {
        let c = from_hf_json(&base().to_string()).unwrap();
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!(c.activation, Activation::Relu);
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.rope_theta, 5e5);
        assert_eq!(c.eos_token_ids, vec![1, 2]);
        assert_eq!(c.gqa_group(), 2);
    }

    #[test]
    fn parses_llama3_scaling() {
        let mut v = base();
        v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = from_hf_json(&v.to_string()).unwrap();
        assert_eq!(c.rope_scaling.unwrap().factor, 8.0);
    }

    #[test]
    fn rejects_unknown_architecture_by_name() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
        let err = from_hf_json(&v.to_string()).unwrap_err().to_string();
        assert!(err.contains("GPT2LMHeadModel"), "{err}");
    }

    #[test]
    fn parses_qwen3_moe_sparse_step_and_mlp_only_layers() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["Qwen3MoeForCausalLM"]);
        v["num_experts"] = serde_json::json!(8);
        v["num_experts_per_tok"] = serde_json::json!(2);
        v["moe_intermediate_size"] = serde_json::json!(64);
        v["decoder_sparse_step"] = serde_json::json!(2);
        v["mlp_only_layers"] = serde_json::json!([3]);
        let c = from_hf_json(&v.to_string()).unwrap();
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.num_experts, m.experts_per_token), (8, 2));
        assert_eq!(m.expert_intermediate_size, 64);
        assert!(!m.norm_topk_prob);
        // Layers 1 and 3 are sparse by the step, but 3 is listed as dense.
        assert_eq!(m.dense_layers, vec![0, 2, 3]);
        assert!(c.is_moe_layer(1) && !c.is_moe_layer(3));
    }

    #[test]
    fn parses_mixtral_and_rejects_bad_expert_counts() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["MixtralForCausalLM"]);
        v["num_local_experts"] = serde_json::json!(4);
        v["num_experts_per_tok"] = serde_json::json!(2);
        let c = from_hf_json(&v.to_string()).unwrap();
        assert_eq!(c.architecture, Architecture::Mistral);
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.num_experts, m.expert_intermediate_size), (4, 1024));
        assert!(m.norm_topk_prob && m.dense_layers.is_empty());
        v["num_experts_per_tok"] = serde_json::json!(5);
        let err = format!("{:#}", from_hf_json(&v.to_string()).unwrap_err());
        assert!(err.contains("5 per token"), "{err}");
    }

    #[test]
    fn parses_transformers5_qwen3_moe_names() {
        // transformers 5.x: `num_local_experts` and the rope base only in `rope_parameters`.
        let mut v = base();
        v["architectures"] = serde_json::json!(["Qwen3MoeForCausalLM"]);
        v["num_local_experts"] = serde_json::json!(8);
        v["num_experts_per_tok"] = serde_json::json!(2);
        v["moe_intermediate_size"] = serde_json::json!(64);
        v["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1e6});
        let c = from_hf_json(&v.to_string()).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen3);
        assert_eq!(c.rope_theta, 1e6);
        assert!(c.rope_scaling.is_none());
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.num_experts, m.experts_per_token), (8, 2));
        v.as_object_mut().unwrap().remove("num_local_experts");
        let err = format!("{:#}", from_hf_json(&v.to_string()).unwrap_err());
        assert!(err.contains("num_local_experts"), "{err}");
    }

    #[test]
    fn parses_qwen2_with_qkv_bias() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
        v["sliding_window"] = serde_json::json!(32);
        let c = from_hf_json(&v.to_string()).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen2);
        assert!(c.qkv_bias && !c.qk_norm);
        assert_eq!(c.sliding_window, None);
        let mut v = base();
        v["attention_bias"] = serde_json::json!(true);
        let err = format!("{:#}", from_hf_json(&v.to_string()).unwrap_err());
        assert!(err.contains("attention_bias"), "{err}");
    }

    #[test]
    fn refused_architectures_name_the_supported_ones() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]);
        let err = format!("{:#}", from_hf_json(&v.to_string()).unwrap_err());
        assert!(
            err.contains("GPTNeoXForCausalLM") && err.contains("Gemma2ForCausalLM"),
            "{err}"
        );
    }

    #[test]
    fn parses_smollm3_nope_layers() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["SmolLM3ForCausalLM"]);
        v["sliding_window"] = serde_json::json!(16);
        let c = from_hf_json(&v.to_string()).unwrap();
        assert_eq!(c.no_rope_layers, vec![3]);
        assert_eq!(c.sliding_window, None);
        assert!(c.uses_rope(2) && !c.uses_rope(3));
        v["no_rope_layers"] = serde_json::json!([0, 1, 0, 1]);
        assert_eq!(
            from_hf_json(&v.to_string()).unwrap().no_rope_layers,
            vec![0, 2]
        );
        v["no_rope_layers"] = serde_json::json!([1, 1]);
        assert!(from_hf_json(&v.to_string()).is_err());
    }

    #[test]
    fn parses_gemma_windows_scalars_and_caps() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["Gemma2ForCausalLM"]);
        v.as_object_mut().unwrap().remove("hidden_act");
        v["hidden_activation"] = serde_json::json!("gelu_pytorch_tanh");
        v["sliding_window"] = serde_json::json!(32);
        v["query_pre_attn_scalar"] = serde_json::json!(144);
        v["attn_logit_softcapping"] = serde_json::json!(50.0);
        v["final_logit_softcapping"] = serde_json::json!(30.0);
        let c = from_hf_json(&v.to_string()).unwrap();
        assert_eq!(c.activation, Activation::GeluTanh);
        // Without layer_types Gemma 2 slides in every other layer from the first.
        assert_eq!(c.block.full_attention_layers, vec![1, 3]);
        assert_eq!((c.window(0), c.window(1)), (Some(32), None));
        assert_eq!(c.block.query_pre_attn_scalar, Some(144.0));
        assert_eq!(c.block.attn_logit_softcap, Some(50.0));
        assert_eq!(c.block.final_logit_softcap, Some(30.0));
        assert_eq!(c.minor_version(), 8);
        // Gemma 3: five sliding layers in six by default, its local rope base, q/k norms; a
        // query_pre_attn_scalar equal to the head size is the default scale.
        v["architectures"] = serde_json::json!(["Gemma3ForCausalLM"]);
        v["num_hidden_layers"] = serde_json::json!(12);
        v["query_pre_attn_scalar"] = serde_json::json!(64);
        v["rope_local_base_freq"] = serde_json::json!(10000.0);
        let c = from_hf_json(&v.to_string()).unwrap();
        assert_eq!(c.block.full_attention_layers, vec![5, 11]);
        assert_eq!(c.block.rope_local_theta, Some(10000.0));
        assert_eq!(c.block.query_pre_attn_scalar, None);
        assert!(c.qk_norm);
        v["layer_types"] = serde_json::json!(vec!["full_attention"; 12]);
        assert_eq!(from_hf_json(&v.to_string()).unwrap().sliding_window, None);
        v["layer_types"] = serde_json::json!(vec!["chunked_attention"; 12]);
        let err = format!("{:#}", from_hf_json(&v.to_string()).unwrap_err());
        assert!(err.contains("chunked_attention"), "{err}");
        v["hidden_activation"] = serde_json::json!("gelu");
        let err = format!("{:#}", from_hf_json(&v.to_string()).unwrap_err());
        assert!(err.contains("gelu_pytorch_tanh"), "{err}");
    }

    #[test]
    fn parses_phi3_longrope_and_refuses_partial_rotary() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["Phi3ForCausalLM"]);
        v["max_position_embeddings"] = serde_json::json!(131072);
        v["original_max_position_embeddings"] = serde_json::json!(4096);
        let factors: Vec<f32> = (0..32).map(|i| 1.0 + i as f32).collect();
        // Phi-3.5's config.json as published (transformers 4).
        v["rope_scaling"] = serde_json::json!({"type": "longrope", "short_factor": factors,
            "long_factor": factors});
        let c = from_hf_json(&v.to_string()).unwrap();
        let l = c.block.longrope.as_ref().unwrap();
        assert_eq!(l.original_max_position_embeddings, 4096);
        assert_eq!(l.long_factor.len(), 32);
        // sqrt(1 + ln(32) / ln(4096)), as transformers and llama.cpp's converter compute it.
        assert!(
            (l.attention_factor - 1.190_238_1).abs() < 1e-6,
            "{}",
            l.attention_factor
        );
        v["rope_scaling"]["short_factor"] = serde_json::json!([1.0, 2.0]);
        assert!(from_hf_json(&v.to_string()).is_err());
        v["rope_scaling"]["short_factor"] = serde_json::json!(factors);
        v["partial_rotary_factor"] = serde_json::json!(0.75);
        let err = format!("{:#}", from_hf_json(&v.to_string()).unwrap_err());
        assert!(err.contains("partial_rotary_factor"), "{err}");
    }

    #[test]
    fn rejects_bad_head_grouping() {
        let mut v = base();
        v["num_key_value_heads"] = serde_json::json!(3);
        assert!(from_hf_json(&v.to_string()).is_err());
    }
}
