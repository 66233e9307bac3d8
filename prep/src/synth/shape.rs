//! The published shapes a synthetic file copies (from each model's Hugging Face `config.json`).

use leanstream::source::config::{Activation, Architecture, ModelConfig, MoeConfig};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Shape {
    /// meta-llama/Llama-2-7b-hf: 4096 hidden, 11008 FFN, 32 layers, 32 heads / 32 KV heads.
    #[value(name = "llama2-7b")]
    Llama2_7b,
    /// Qwen/Qwen3-8B: 4096 hidden, 12288 FFN, 36 layers, 32 heads / 8 KV heads, q/k norms.
    #[value(name = "qwen3-8b")]
    Qwen3_8b,
    /// mistralai/Mistral-7B-v0.1: 4096 hidden, 14336 FFN, 32 layers, 32 heads / 8 KV heads.
    #[value(name = "mistral-7b")]
    Mistral7b,
    /// Qwen/Qwen3-30B-A3B: a mixture of experts, 2048 hidden, 48 layers, 128 experts of 768
    /// neurons, 8 chosen per token, 32 heads / 4 KV heads, q/k norms.
    #[value(name = "qwen3-30b-a3b")]
    Qwen3_30bA3b,
    /// A small Llama-shaped model for tests: 256 hidden, 1024 FFN, 4 layers.
    #[value(name = "tiny")]
    Tiny,
    /// A small Qwen3-MoE-shaped model for tests: 256 hidden, 4 layers, 16 experts of 128 neurons,
    /// 4 chosen per token.
    #[value(name = "tiny-moe")]
    TinyMoe,
}

impl Shape {
    pub fn name(self) -> &'static str {
        match self {
            Shape::Llama2_7b => "llama2-7b",
            Shape::Qwen3_8b => "qwen3-8b",
            Shape::Mistral7b => "mistral-7b",
            Shape::Qwen3_30bA3b => "qwen3-30b-a3b",
            Shape::Tiny => "tiny",
            Shape::TinyMoe => "tiny-moe",
        }
    }

    /// The configuration, with the source tokenizer's special tokens.
    pub fn config(self, bos: Option<u32>, eos: Vec<u32>) -> ModelConfig {
        let llama = |h, n, layers, heads, kv, head_dim, vocab, ctx| ModelConfig {
            architecture: Architecture::Llama,
            activation: Activation::Silu,
            hidden_size: h,
            intermediate_size: n,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim,
            vocab_size: vocab,
            max_position_embeddings: ctx,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            rope_freq_factors: None,
            no_rope_layers: Vec::new(),
            sliding_window: None,
            tie_word_embeddings: false,
            qk_norm: false,
            qkv_bias: false,
            bos_token_id: bos,
            eos_token_ids: eos.clone(),
            moe: None,
            block: Default::default(),
        };
        let qwen3 = |c: ModelConfig| ModelConfig {
            architecture: Architecture::Qwen3,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            qk_norm: true,
            ..c
        };
        // Qwen3-MoE: every layer a mixture (decoder_sparse_step 1, no mlp_only_layers).
        let moe = |num_experts, experts_per_token, expert_intermediate_size| MoeConfig {
            num_experts,
            experts_per_token,
            expert_intermediate_size,
            norm_topk_prob: true,
            dense_layers: Vec::new(),
        };
        match self {
            Shape::Llama2_7b => llama(4096, 11008, 32, 32, 32, 128, 32000, 4096),
            Shape::Qwen3_8b => qwen3(llama(4096, 12288, 36, 32, 8, 128, 151_936, 40960)),
            Shape::Mistral7b => ModelConfig {
                architecture: Architecture::Mistral,
                sliding_window: Some(4096),
                ..llama(4096, 14336, 32, 32, 8, 128, 32000, 32768)
            },
            Shape::Qwen3_30bA3b => ModelConfig {
                moe: Some(moe(128, 8, 768)),
                ..qwen3(llama(2048, 6144, 48, 32, 4, 128, 151_936, 40960))
            },
            Shape::Tiny => llama(256, 1024, 4, 4, 2, 64, 4096, 1024),
            Shape::TinyMoe => ModelConfig {
                moe: Some(moe(16, 4, 128)),
                ..qwen3(llama(256, 1024, 4, 4, 2, 64, 4096, 1024))
            },
        }
    }
}
