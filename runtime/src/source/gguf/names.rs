//! Hugging Face tensor names → llama.cpp's GGUF names (llama, qwen2, qwen3, qwen3moe and the
//! Llama-named tensors of the other families; [`super::block`] has Gemma's and Phi-3's own).

/// The GGUF name of a Hugging Face tensor name (llama.cpp's naming for llama, qwen3 and
/// qwen3moe); an expert's name gives its layer's stack of experts.
pub fn gguf_name(hf_name: &str) -> Option<String> {
    gguf_location(hf_name).map(|(name, _)| name)
}

/// The GGUF tensor holding a Hugging Face tensor, and for an expert's matrix its index in the
/// stack: Qwen3-MoE's `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj` and Mixtral's
/// `block_sparse_moe.experts.{e}.w1` / `w3` / `w2` are `ffn_gate_exps` / `ffn_up_exps` /
/// `ffn_down_exps`, the routers (`mlp.gate`, `block_sparse_moe.gate`) `ffn_gate_inp`.
pub(super) fn gguf_location(hf_name: &str) -> Option<(String, Option<usize>)> {
    match moe_location(hf_name) {
        Some(found) => Some(found),
        None => dense_gguf_name(hf_name).map(|name| (name, None)),
    }
}

/// [`gguf_location`] for a router or an expert's matrix; `None` for any other name.
fn moe_location(hf_name: &str) -> Option<(String, Option<usize>)> {
    let (layer, part) = hf_name.strip_prefix("model.layers.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let part = part.strip_suffix(".weight")?;
    let block = part
        .strip_prefix("mlp.")
        .or_else(|| part.strip_prefix("block_sparse_moe."));
    if block == Some("gate") {
        return Some((format!("blk.{layer}.ffn_gate_inp.weight"), None));
    }
    if let Some((e, proj)) = block
        .and_then(|b| b.strip_prefix("experts."))
        .and_then(|b| b.split_once('.'))
    {
        let stack = match proj {
            "gate_proj" | "w1" => "ffn_gate_exps",
            "up_proj" | "w3" => "ffn_up_exps",
            "down_proj" | "w2" => "ffn_down_exps",
            _ => return None,
        };
        return Some((format!("blk.{layer}.{stack}.weight"), Some(e.parse().ok()?)));
    }
    None
}

fn dense_gguf_name(hf_name: &str) -> Option<String> {
    let fixed = match hf_name {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        // No Hugging Face tensor: Llama 3.1's rope scaling and Phi-3's LongRoPE factors as
        // llama.cpp writes them.
        "rope_freqs.weight" => Some("rope_freqs.weight"),
        "rope_factors_long.weight" => Some("rope_factors_long.weight"),
        "rope_factors_short.weight" => Some("rope_factors_short.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(name.to_string());
    }
    let (layer, part) = hf_name.strip_prefix("model.layers.")?.split_once('.')?;
    // Qwen2's q/k/v biases sit beside their weights.
    if let Some(proj) = part.strip_suffix(".bias") {
        let part = match proj {
            "self_attn.q_proj" => "attn_q",
            "self_attn.k_proj" => "attn_k",
            "self_attn.v_proj" => "attn_v",
            _ => return None,
        };
        let layer: usize = layer.parse().ok()?;
        return Some(format!("blk.{layer}.{part}.bias"));
    }
    let part = match part.strip_suffix(".weight")? {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    let layer: usize = layer.parse().ok()?;
    Some(format!("blk.{layer}.{part}.weight"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_llama_cpp() {
        assert_eq!(
            gguf_name("model.layers.12.self_attn.o_proj.weight").as_deref(),
            Some("blk.12.attn_output.weight")
        );
        assert_eq!(
            gguf_name("model.layers.0.self_attn.k_norm.weight").as_deref(),
            Some("blk.0.attn_k_norm.weight")
        );
        assert_eq!(
            gguf_name("lm_head.weight").as_deref(),
            Some("output.weight")
        );
        assert_eq!(gguf_name("model.layers.x.mlp.up_proj.weight"), None);
        assert_eq!(gguf_name("model.layers.0.mlp.experts.weight"), None);
        assert_eq!(
            gguf_name("model.layers.0.mlp.experts.x.up_proj.weight"),
            None
        );
    }

    #[test]
    fn experts_map_to_slices_of_their_stack() {
        let loc = |n: &str| gguf_location(n).unwrap();
        let stack = |name: &str, e| (name.to_string(), Some(e));
        assert_eq!(
            loc("model.layers.3.mlp.experts.7.down_proj.weight"),
            stack("blk.3.ffn_down_exps.weight", 7)
        );
        assert_eq!(
            loc("model.layers.0.block_sparse_moe.experts.1.w3.weight"),
            stack("blk.0.ffn_up_exps.weight", 1)
        );
        assert_eq!(
            loc("model.layers.2.block_sparse_moe.gate.weight"),
            ("blk.2.ffn_gate_inp.weight".to_string(), None)
        );
        assert_eq!(
            loc("model.layers.2.mlp.gate_proj.weight"),
            ("blk.2.ffn_gate.weight".to_string(), None)
        );
    }
}
