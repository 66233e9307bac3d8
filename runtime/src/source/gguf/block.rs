//! What llama.cpp's `gemma2`, `gemma3` and `phi3` files add to the Llama block: Gemma's windows,
//! rope bases, soft-caps and sandwich norms, Phi-3's LongRoPE factors and fused projections.
//! llama.cpp's converter has already added Gemma's 1 to every norm weight (`(1 + w)` RMSNorm),
//! so the weights are read as they are.

use anyhow::{bail, Result};
use candle_core::quantized::gguf_file::Value;

use super::GgufFile;
use crate::source::config::{Architecture, BlockOptions, LongRope};

/// A GGUF tensor's name, and for a slice of a fused tensor its first row and the fused rows.
pub(super) type Location = (String, Option<(usize, usize)>);

impl GgufFile {
    /// The sliding window and the block options of a file of `arch` (`general.architecture`).
    pub(super) fn block_options(
        &self,
        arch: &str,
        architecture: Architecture,
        hidden: usize,
        heads: usize,
    ) -> Result<(Option<usize>, BlockOptions)> {
        let key = |k: &str| format!("{arch}.{k}");
        let layers = self.required_usize(&key("block_count"))?;
        let window = self
            .usize(&key("attention.sliding_window"))?
            .filter(|&w| w > 0);
        match architecture {
            Architecture::Gemma2 | Architecture::Gemma3 => {
                let gemma2 = architecture == Architecture::Gemma2;
                // llama.cpp's defaults: Gemma 2 always has a window (4096 unless given), sliding
                // every other layer; Gemma 3 one only when given, 5 sliding layers in 6.
                let window = if gemma2 {
                    window.or(Some(4096))
                } else {
                    window
                };
                let full = match window {
                    Some(_) => {
                        self.full_attention_layers(arch, layers, if gemma2 { 2 } else { 6 })?
                    }
                    None => Vec::new(),
                };
                // llama.cpp scales the 27B models' queries by hidden/heads, the others' by head size.
                let big = (gemma2 && layers == 46) || (!gemma2 && layers == 62);
                let block = BlockOptions {
                    full_attention_layers: full,
                    rope_local_theta: match (gemma2, window) {
                        (false, Some(_)) => {
                            Some(self.f32(&key("rope.freq_base_swa"))?.unwrap_or(10000.0))
                        }
                        _ => self.f32(&key("rope.freq_base_swa"))?,
                    },
                    longrope: None,
                    query_pre_attn_scalar: big.then(|| (hidden / heads) as f32),
                    attn_logit_softcap: self.f32(&key("attn_logit_softcapping"))?,
                    final_logit_softcap: self.f32(&key("final_logit_softcapping"))?,
                };
                Ok((window, block))
            }
            Architecture::Phi3 => {
                let longrope = match self.content.tensor_infos.get("rope_factors_long.weight") {
                    None => None,
                    Some(info) => {
                        let half = info.shape.elem_count();
                        let original = self
                            .usize(&key("rope.scaling.original_context_length"))?
                            .ok_or_else(|| {
                                anyhow::anyhow!(
                                    "{}",
                                    self.missing(&key("rope.scaling.original_context_length"))
                                )
                            })?;
                        Some(LongRope {
                            short_factor: self.tensor_f32("rope_factors_short.weight", &[half])?,
                            long_factor: self.tensor_f32("rope_factors_long.weight", &[half])?,
                            original_max_position_embeddings: original,
                            attention_factor: self
                                .f32(&key("rope.scaling.attn_factor"))?
                                .unwrap_or(1.0),
                        })
                    }
                };
                let block = BlockOptions {
                    longrope,
                    ..BlockOptions::default()
                };
                Ok((window, block))
            }
            _ => Ok((None, BlockOptions::default())),
        }
    }

    /// The layers without a window: from `attention.sliding_window_pattern` (one flag per layer,
    /// true = sliding, or every `n`-th layer full) or llama.cpp's default `every` for the family.
    fn full_attention_layers(&self, arch: &str, layers: usize, every: usize) -> Result<Vec<usize>> {
        let k = format!("{arch}.attention.sliding_window_pattern");
        if let Some(flags) = self.array(&k)? {
            if flags.len() != layers {
                bail!(
                    "{}: {k} has {} entries for {layers} layers",
                    self.path.display(),
                    flags.len()
                );
            }
            let mut full = Vec::new();
            for (l, f) in flags.iter().enumerate() {
                match f {
                    Value::Bool(false) => full.push(l),
                    Value::Bool(true) => {}
                    v => return Err(self.wrong_type(&k, v, "an array of bools")),
                }
            }
            return Ok(full);
        }
        let every = self.usize(&k)?.unwrap_or(every);
        Ok(match every {
            // llama.cpp: a pattern of 0 makes every layer sliding.
            0 => Vec::new(),
            n => (0..layers).filter(|l| (l + 1).is_multiple_of(n)).collect(),
        })
    }

    /// Where Hugging Face tensor `name` (of `shape`) lies in a file of these families, when not
    /// where the other families keep it: Gemma's `post_attention_layernorm` is
    /// `post_attention_norm`, its `pre_feedforward_layernorm` `ffn_norm` and
    /// `post_feedforward_layernorm` `post_ffw_norm`; Phi-3's q, k and v are rows of `attn_qkv`,
    /// its gate and up the two halves of `ffn_up`, given as (first row, rows of the fused tensor).
    pub(super) fn block_location(&self, name: &str, shape: &[usize]) -> Result<Option<Location>> {
        let Some((layer, part)) = name
            .strip_prefix("model.layers.")
            .and_then(|n| n.split_once('.'))
        else {
            return Ok(None);
        };
        let blk = |t: &str| format!("blk.{layer}.{t}.weight");
        let has = |t: &str| self.content.tensor_infos.contains_key(&blk(t));
        let arch = self.architecture()?;
        if arch.is_gemma() {
            let norm = match part {
                "post_attention_layernorm.weight" => "post_attention_norm",
                "pre_feedforward_layernorm.weight" => "ffn_norm",
                "post_feedforward_layernorm.weight" => "post_ffw_norm",
                _ => return Ok(None),
            };
            return Ok(Some((blk(norm), None)));
        }
        if arch != Architecture::Phi3 {
            return Ok(None);
        }
        if part.starts_with("self_attn.") && !has("attn_q") {
            let (q_heads, kv_heads) = self.head_counts()?;
            let head_dim = self.config_head_dim()?;
            let (qd, kvd) = (q_heads * head_dim, kv_heads * head_dim);
            let at = match part {
                "self_attn.q_proj.weight" => 0,
                "self_attn.k_proj.weight" => qd,
                "self_attn.v_proj.weight" => qd + kvd,
                _ => return Ok(None),
            };
            return Ok(Some((blk("attn_qkv"), Some((at, qd + 2 * kvd)))));
        }
        if part.starts_with("mlp.") && !has("ffn_gate") {
            let n = shape[0];
            let at = match part {
                "mlp.gate_proj.weight" => 0,
                "mlp.up_proj.weight" => n,
                _ => return Ok(None),
            };
            return Ok(Some((blk("ffn_up"), Some((at, 2 * n)))));
        }
        Ok(None)
    }

    /// The head size as [`GgufFile::config`] reads it.
    fn config_head_dim(&self) -> Result<usize> {
        let arch = self.required_str("general.architecture")?;
        let heads = self.required_usize(&format!("{arch}.attention.head_count"))?;
        Ok(match self.usize(&format!("{arch}.attention.key_length"))? {
            Some(d) => d,
            None => self
                .required_usize(&format!("{arch}.embedding_length"))?
                .checked_div(heads)
                .unwrap_or(0),
        })
    }
}
