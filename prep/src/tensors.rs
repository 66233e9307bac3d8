//! The tensors a converted file stores, by Hugging Face name, and their quantization.

use anyhow::{Context, Result};
use leanstream::source::config::ModelConfig;
use leanstream_format::quant::{quantize_row, QuantType};

/// A dense (non-FFN) tensor: name and shape `[rows, cols]` or `[len]`.
pub struct DenseSpec {
    /// Its name in the file.
    pub name: String,
    /// Its name in the source model (a router's differs: FORMAT.md §5.3).
    pub source: String,
    pub shape: Vec<usize>,
    /// A mixture's router: kept f32, since a rounding would change which experts run.
    pub router: bool,
}

impl DenseSpec {
    fn new(name: String, shape: &[usize]) -> Self {
        Self {
            source: name.clone(),
            name,
            shape: shape.to_vec(),
            router: false,
        }
    }

    /// Vectors (norm weights) stay f32: they are tiny and every element matters.
    pub fn is_vector(&self) -> bool {
        self.shape.len() == 1
    }

    /// Stored f32 whatever the file's quantization: vectors and routers.
    pub fn stays_f32(&self) -> bool {
        self.is_vector() || self.router
    }
}

/// Every dense tensor of the model, in file order: embeddings, then each layer's attention and
/// norms (contiguous, so a layer streams with one sequential read), then the final norm and head.
pub fn dense_specs(c: &ModelConfig) -> Vec<DenseSpec> {
    let (h, hd) = (c.hidden_size, c.head_dim);
    let mut v = vec![DenseSpec::new(
        "model.embed_tokens.weight".into(),
        &[c.vocab_size, h],
    )];
    for i in 0..c.num_layers {
        let p = format!("model.layers.{i}");
        v.push(DenseSpec::new(format!("{p}.input_layernorm.weight"), &[h]));
        v.push(DenseSpec::new(
            format!("{p}.self_attn.q_proj.weight"),
            &[c.num_heads * hd, h],
        ));
        v.push(DenseSpec::new(
            format!("{p}.self_attn.k_proj.weight"),
            &[c.num_kv_heads * hd, h],
        ));
        v.push(DenseSpec::new(
            format!("{p}.self_attn.v_proj.weight"),
            &[c.num_kv_heads * hd, h],
        ));
        v.push(DenseSpec::new(
            format!("{p}.self_attn.o_proj.weight"),
            &[h, c.num_heads * hd],
        ));
        if c.qk_norm {
            v.push(DenseSpec::new(
                format!("{p}.self_attn.q_norm.weight"),
                &[hd],
            ));
            v.push(DenseSpec::new(
                format!("{p}.self_attn.k_norm.weight"),
                &[hd],
            ));
        }
        if c.qkv_bias {
            for (proj, rows) in [
                ("q", c.num_heads * hd),
                ("k", c.num_kv_heads * hd),
                ("v", c.num_kv_heads * hd),
            ] {
                v.push(DenseSpec::new(
                    format!("{p}.self_attn.{proj}_proj.bias"),
                    &[rows],
                ));
            }
        }
        v.push(DenseSpec::new(
            format!("{p}.post_attention_layernorm.weight"),
            &[h],
        ));
        // Gemma: the attention output's norm above, and the FFN's input and output norms.
        if c.architecture.is_gemma() {
            for norm in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                v.push(DenseSpec::new(format!("{p}.{norm}.weight"), &[h]));
            }
        }
        if let Some(m) = c.moe.as_ref().filter(|_| c.is_moe_layer(i)) {
            v.push(DenseSpec {
                name: leanstream_format::expert::router_name(i),
                source: leanstream::model::router_tensor_name(c.architecture, i),
                shape: vec![m.num_experts, h],
                router: true,
            });
        }
    }
    v.push(DenseSpec::new("model.norm.weight".into(), &[h]));
    if !c.tie_word_embeddings {
        v.push(DenseSpec::new("lm_head.weight".into(), &[c.vocab_size, h]));
    }
    v
}

/// Names of layer `l`'s FFN matrices: gate `[n, h]`, up `[n, h]`, down `[h, n]`.
pub fn ffn_names(l: usize) -> [String; 3] {
    let p = format!("model.layers.{l}.mlp");
    [
        format!("{p}.gate_proj.weight"),
        format!("{p}.up_proj.weight"),
        format!("{p}.down_proj.weight"),
    ]
}

/// Encodes a row-major matrix (or vector) row by row.
pub fn quantize_rows(qtype: QuantType, data: &[f32], cols: usize, name: &str) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for row in data.chunks_exact(cols) {
        out.extend(
            quantize_row(qtype, row).with_context(|| format!("cannot encode {name} as {qtype}"))?,
        );
    }
    Ok(out)
}
