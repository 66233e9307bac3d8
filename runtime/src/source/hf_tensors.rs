//! Tensors of a Hugging Face checkpoint as the engine reads them: Gemma's RMSNorm weights `w`
//! stored for `(1 + w)` become `1 + w` (so every norm is `x / rms · w`, as llama.cpp's converter
//! also writes them), and Phi-3's fused `qkv_proj` and `gate_up_proj` are split into the separate
//! q, k, v, gate and up matrices the other families store.

use anyhow::Result;

use crate::source::config::{Architecture, ModelConfig};
use crate::source::safetensors_dir::SafetensorsDir;

/// Tensor `name` of shape `shape` of the model `c` in `dir`, as f32.
pub fn tensor(
    dir: &SafetensorsDir,
    c: &ModelConfig,
    name: &str,
    shape: &[usize],
) -> Result<Vec<f32>> {
    if let Some((fused, first, rows)) = fused_rows(dir, c, name, shape) {
        let all = dir.tensor_f32(&fused, &[rows, shape[1]])?;
        return Ok(all[first * shape[1]..(first + shape[0]) * shape[1]].to_vec());
    }
    let mut t = dir.tensor_f32(name, shape)?;
    if c.architecture.is_gemma() && name.ends_with("norm.weight") {
        // f32 addition, as transformers' `1.0 + self.weight.float()`.
        t.iter_mut().for_each(|w| *w += 1.0);
    }
    Ok(t)
}

/// Phi-3's split: (fused tensor, first row, its rows) for a q/k/v or gate/up name the checkpoint
/// does not hold by itself.
fn fused_rows(
    dir: &SafetensorsDir,
    c: &ModelConfig,
    name: &str,
    shape: &[usize],
) -> Option<(String, usize, usize)> {
    if c.architecture != Architecture::Phi3 || dir.contains(name) {
        return None;
    }
    let (prefix, part) = name
        .rsplit_once(".self_attn.")
        .or_else(|| name.rsplit_once(".mlp."))?;
    let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let n = shape[0];
    let (fused, first, rows) = match part {
        "q_proj.weight" => ("self_attn.qkv_proj", 0, qd + 2 * kvd),
        "k_proj.weight" => ("self_attn.qkv_proj", qd, qd + 2 * kvd),
        "v_proj.weight" => ("self_attn.qkv_proj", qd + kvd, qd + 2 * kvd),
        "gate_proj.weight" => ("mlp.gate_up_proj", 0, 2 * n),
        "up_proj.weight" => ("mlp.gate_up_proj", n, 2 * n),
        _ => return None,
    };
    Some((format!("{prefix}.{fused}.weight"), first, rows))
}
