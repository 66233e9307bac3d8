//! The model configuration a file carries in its META section: the shape and options the forward
//! pass needs. Converters fill it from their source format (Hugging Face `config.json`, GGUF).

use serde::{Deserialize, Serialize};

use crate::FormatError;

/// Model families the engine implements. They share the Llama block; Qwen3 adds per-head q/k norms
/// and Mistral a sliding attention window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    Llama,
    Qwen3,
    Mistral,
}

/// FFN activation applied to the gate projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Activation {
    Silu,
    Relu,
}

impl Activation {
    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::Relu => x.max(0.0),
        }
    }
}

/// Llama-3 style rope frequency scaling (`rope_type: "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
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
    /// Attend only to this many most recent positions (Mistral); `None` = full causal attention.
    pub sliding_window: Option<usize>,
    pub tie_word_embeddings: bool,
    /// Per-head RMSNorm on queries and keys before rope (Qwen3).
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
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
        Ok(())
    }

    /// Query heads that share one key/value head.
    pub fn gqa_group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}
