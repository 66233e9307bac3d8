//! The model configuration a file carries in its META section: the shape and options the forward
//! pass needs. Converters fill it from their source format (Hugging Face `config.json`, GGUF).

use serde::{Deserialize, Serialize};

use crate::FormatError;

/// Model families the engine implements. They share the Llama block; Qwen3 adds per-head q/k norms,
/// Mistral a sliding attention window and Qwen2 biases on the query, key and value projections.
/// Gemma 2 and 3 scale the embedding by `sqrt(hidden_size)` and put a second RMSNorm after
/// attention and after the FFN (their `post_attention_layernorm` and `post_feedforward_layernorm`;
/// the FFN's input norm is `pre_feedforward_layernorm`); Gemma 3 adds Qwen3's q/k norms. Phi-3 is
/// Llama's block (its fused projections are split when read). Since 1.8: Gemma2, Gemma3, Phi3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    Llama,
    Qwen3,
    Mistral,
    Qwen2,
    Gemma2,
    Gemma3,
    Phi3,
}

impl Architecture {
    /// Gemma's sqrt(hidden)-scaled embedding and norms around both attention and FFN.
    pub fn is_gemma(self) -> bool {
        matches!(self, Architecture::Gemma2 | Architecture::Gemma3)
    }
}

/// FFN activation applied to the gate projection; a neuron's coefficient on its down column is
/// [`Activation::coef`] of its gate and up values.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Activation {
    Silu,
    Relu,
    /// GELU in its tanh approximation (`gelu_pytorch_tanh`, Gemma's GeGLU). Since 1.8.
    GeluTanh,
    /// FATReLU (ProSparse's `fatrelu`): `z` where `z ≥ threshold`, else 0; `threshold ≥ 0`, and
    /// with 0 it is ReLU. Since 1.9.
    FatRelu {
        threshold: f32,
    },
    /// dReLU (TurboSparse, Bamboo): ReLU on the gate *and* on the up projection, so the
    /// coefficient is `relu(g) · relu(u)`. Since 1.9.
    DRelu,
}

impl Activation {
    /// The activation of a gate value `x`.
    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::Relu | Activation::DRelu => x.max(0.0),
            Activation::FatRelu { threshold } => {
                if x >= threshold {
                    x
                } else {
                    0.0
                }
            }
            Activation::GeluTanh => {
                // sqrt(2/π)
                const K: f32 = 0.797_884_6;
                0.5 * x * (1.0 + (K * (x + 0.044_715 * x * x * x)).tanh())
            }
        }
    }

    /// A neuron's coefficient on its down column from its activation `a = apply(g)` and up value
    /// `u`: `a · u`, and for dReLU `max(a · u, 0)`, which is `relu(g) · relu(u)` (`a ≥ 0`, so the
    /// product's sign is `u`'s) — the form a kernel that computes `a · u` can be corrected to.
    #[inline]
    pub fn coef(self, a: f32, u: f32) -> f32 {
        match self {
            Activation::DRelu => (a * u).max(0.0),
            _ => a * u,
        }
    }

    /// Whether `apply(g)` is exactly 0 for every gate value at or below 0 and below the FATReLU
    /// threshold — the ReLU family, whose neurons the gate alone proves silent, exactly.
    pub fn is_relu_like(self) -> bool {
        matches!(
            self,
            Activation::Relu | Activation::FatRelu { .. } | Activation::DRelu
        )
    }
}

/// Phi-3's LongRoPE (`rope_type: "longrope"` or `"su"`): each rotary frequency is divided by its
/// factor, the long ones when the context is longer than `original_max_position_embeddings`, the
/// short ones otherwise, and cos and sin are multiplied by `attention_factor`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LongRope {
    pub short_factor: Vec<f32>,
    pub long_factor: Vec<f32>,
    pub original_max_position_embeddings: usize,
    pub attention_factor: f32,
}

/// Llama-3 style rope frequency scaling (`rope_type: "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

/// What Gemma 2, Gemma 3 and Phi-3 add to the Llama block; the default adds nothing. Since 1.8.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BlockOptions {
    /// Layers that attend to every position although `sliding_window` is set (Gemma's global
    /// layers), ascending. Since 1.8.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub full_attention_layers: Vec<usize>,
    /// The rope base of the sliding-window layers when it differs from `rope_theta` (Gemma 3's
    /// `rope_local_base_freq`). Since 1.8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_local_theta: Option<f32>,
    /// Phi-3's LongRoPE frequency factors. Since 1.8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub longrope: Option<LongRope>,
    /// Attention scores are `q·k / sqrt(query_pre_attn_scalar)` (Gemma); `None` = `head_dim`.
    /// Since 1.8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_pre_attn_scalar: Option<f32>,
    /// Attention scores become `cap · tanh(score / cap)` before the softmax (Gemma 2). Since 1.8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_logit_softcap: Option<f32>,
    /// Output logits become `cap · tanh(logit / cap)` (Gemma 2). Since 1.8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_logit_softcap: Option<f32>,
}

impl BlockOptions {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub activation: Activation,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Per-frequency divisors of the rotary inverse frequencies (`head_dim/2` of them), as GGUF
    /// files of Llama 3.1 and later carry them in `rope_freqs.weight`; `None` = all 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_freq_factors: Option<Vec<f32>>,
    /// Layers whose attention uses no rotary embedding (SmolLM3's NoPE layers), ascending.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub no_rope_layers: Vec<usize>,
    /// Attend only to this many most recent positions (Mistral); `None` = full causal attention.
    pub sliding_window: Option<usize>,
    /// What Gemma and Phi-3 add to the block (keys at this level of the JSON). Since 1.8.
    #[serde(flatten)]
    pub block: BlockOptions,
    pub tie_word_embeddings: bool,
    /// Per-head RMSNorm on queries and keys before rope (Qwen3).
    pub qk_norm: bool,
    /// Biases added to the query, key and value projections (Qwen2, `attention_bias`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qkv_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// A mixture of experts in place of the dense FFN (in the layers it names); `None` = dense.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
}

/// A sparse mixture-of-experts FFN (Qwen3-MoE, Mixtral): a router `[experts, hidden]` scores the
/// experts, the `experts_per_token` best by softmax probability each run a SwiGLU/ReLU FFN of
/// `expert_intermediate_size` neurons, and their outputs are summed weighted by those
/// probabilities (renormalised over the chosen ones when `norm_topk_prob`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub expert_intermediate_size: usize,
    pub norm_topk_prob: bool,
    /// Layers whose FFN is the plain dense one of `intermediate_size` neurons (Qwen3-MoE's
    /// `mlp_only_layers` and the layers `decoder_sparse_step` skips), ascending.
    #[serde(default)]
    pub dense_layers: Vec<usize>,
}

impl ModelConfig {
    /// Checks the shape invariants the forward pass relies on, whatever file the config came from.
    pub fn validate(&self) -> Result<(), FormatError> {
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return Err(FormatError::config(format!(
                "the number of attention heads ({}) must be a positive multiple of the number of \
                 key/value heads ({})",
                self.num_heads, self.num_kv_heads
            )));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(FormatError::config(format!(
                "head_dim ({}) must be even and positive for rotary embeddings",
                self.head_dim
            )));
        }
        for (name, v) in [
            ("hidden size", self.hidden_size),
            ("intermediate (FFN) size", self.intermediate_size),
            ("number of layers", self.num_layers),
            ("vocabulary size", self.vocab_size),
        ] {
            if v == 0 {
                return Err(FormatError::config(format!("the {name} must be positive")));
            }
        }
        if let Activation::FatRelu { threshold } = self.activation {
            if !(threshold.is_finite() && threshold >= 0.0) {
                return Err(FormatError::config(format!(
                    "the FATReLU threshold ({threshold}) must be finite and at least 0"
                )));
            }
        }
        if let Some(f) = &self.rope_freq_factors {
            if f.len() != self.head_dim / 2 || f.iter().any(|&x| !(x.is_finite() && x > 0.0)) {
                return Err(FormatError::config(format!(
                    "{} rope frequency factors for head_dim {}: there must be head_dim/2 of them, \
                     each finite and positive",
                    f.len(),
                    self.head_dim
                )));
            }
        }
        if let Some(r) = &self.block.longrope {
            let half = self.head_dim / 2;
            let bad = |f: &[f32]| f.len() != half || f.iter().any(|&x| !(x.is_finite() && x > 0.0));
            if bad(&r.short_factor)
                || bad(&r.long_factor)
                || r.attention_factor.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
            {
                return Err(FormatError::config(format!(
                    "longrope: {} short and {} long factors for head_dim {}: there must be \
                     head_dim/2 of each, finite and positive, and a positive attention factor",
                    r.short_factor.len(),
                    r.long_factor.len(),
                    self.head_dim
                )));
            }
        }
        for (name, v) in [
            ("query_pre_attn_scalar", self.block.query_pre_attn_scalar),
            ("attention logit soft-cap", self.block.attn_logit_softcap),
            ("final logit soft-cap", self.block.final_logit_softcap),
            ("local rope base", self.block.rope_local_theta),
        ] {
            if v.is_some_and(|x| !(x.is_finite() && x > 0.0)) {
                return Err(FormatError::config(format!(
                    "the {name} ({v:?}) must be finite and positive"
                )));
            }
        }
        if self
            .block
            .full_attention_layers
            .iter()
            .any(|&l| l >= self.num_layers)
            || !self.block.full_attention_layers.is_sorted_by(|a, b| a < b)
        {
            return Err(FormatError::config(format!(
                "full-attention layers {:?} must be ascending layer indices below {}",
                self.block.full_attention_layers, self.num_layers
            )));
        }
        if self.no_rope_layers.iter().any(|&l| l >= self.num_layers)
            || !self.no_rope_layers.is_sorted_by(|a, b| a < b)
        {
            return Err(FormatError::config(format!(
                "layers without rope {:?} must be ascending layer indices below {}",
                self.no_rope_layers, self.num_layers
            )));
        }
        if let Some(m) = &self.moe {
            if m.num_experts == 0
                || m.experts_per_token == 0
                || m.experts_per_token > m.num_experts
                || m.expert_intermediate_size == 0
            {
                return Err(FormatError::config(format!(
                    "mixture of experts: {} experts of {} neurons with {} per token: the counts \
                     must be positive and at most all experts chosen per token",
                    m.num_experts, m.expert_intermediate_size, m.experts_per_token
                )));
            }
            if m.dense_layers.iter().any(|&l| l >= self.num_layers)
                || !m.dense_layers.is_sorted_by(|a, b| a < b)
            {
                return Err(FormatError::config(format!(
                    "mixture of experts: dense layers {:?} must be ascending layer indices below {}",
                    m.dense_layers, self.num_layers
                )));
            }
        }
        Ok(())
    }

    /// Whether layer `l`'s FFN is a mixture of experts.
    pub fn is_moe_layer(&self, l: usize) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| m.dense_layers.binary_search(&l).is_err())
    }

    /// The attention window of layer `l`: `sliding_window` unless `l` is a full-attention layer.
    pub fn window(&self, l: usize) -> Option<usize> {
        self.sliding_window
            .filter(|_| self.block.full_attention_layers.binary_search(&l).is_err())
    }

    /// The minor format version this configuration needs: 9 for what 1.9 added (the FATReLU and
    /// dReLU activations), 8 for what 1.8 added (Gemma 2 and 3, Phi-3, GELU, LongRoPE, per-layer
    /// windows, soft-capping), else 1.
    pub fn minor_version(&self) -> u16 {
        let v18 = matches!(
            self.architecture,
            Architecture::Gemma2 | Architecture::Gemma3 | Architecture::Phi3
        ) || self.activation == Activation::GeluTanh
            || !self.block.is_default();
        let v19 = matches!(
            self.activation,
            Activation::FatRelu { .. } | Activation::DRelu
        );
        if v19 {
            9
        } else if v18 {
            8
        } else {
            1
        }
    }

    /// Whether layer `l` rotates its queries and keys (all but SmolLM3's NoPE layers).
    pub fn uses_rope(&self, l: usize) -> bool {
        self.no_rope_layers.binary_search(&l).is_err()
    }

    /// Query heads that share one key/value head.
    pub fn gqa_group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

#[cfg(test)]
mod tests {
    use super::Activation;

    /// `gelu_pytorch_tanh` as torch 2.15 computes it in f32 (`F.gelu(x, approximate="tanh")`).
    #[test]
    fn gelu_tanh_matches_torch() {
        let torch = [
            (-6.0, -0.0),
            (-3.0, -0.003_637_433),
            (-1.0, -0.158_808),
            (-0.75, -0.170_039_47),
            (-0.5, -0.154_286),
            (0.0, 0.0),
            (0.5, 0.345_714),
            (1.0, 0.841_192),
            (3.0, 2.996_362_7),
            (6.0, 6.0),
        ];
        for (x, want) in torch {
            let got = Activation::GeluTanh.apply(x);
            assert!(
                (got - want).abs() <= 2.0 * f32::EPSILON * want.abs().max(1e-3),
                "gelu({x}) = {got}, torch {want}"
            );
        }
    }
}
