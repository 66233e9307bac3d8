//! The large dense weights (embedding, attention projections, output head) and the
//! [`DenseWeights`] trait through which a forward pass reads them, from DRAM or from flash.

use anyhow::Result;

use super::Attention;
use crate::kernels::Weight;
use crate::source::config::ModelConfig;

/// The large dense weights held in DRAM: the embedding, every block's attention projections and
/// the output head (`None` when tied to the embedding).
pub struct Projections {
    pub embed: Weight,
    pub attention: Vec<Attention>,
    pub lm_head: Option<Weight>,
}

/// Where one forward pass gets the large dense weights from: the model's own [`Projections`], or a
/// source that reads some of them from flash as they are needed
/// ([`crate::streaming::DenseStream`]). Either way the same kernels run on the same encoded bytes,
/// so the results are the same.
pub trait DenseWeights {
    /// Writes the embedding rows of `tokens` (each checked to be in the vocabulary) into `out`
    /// (`tokens.len() × hidden`). Called first in every forward pass.
    fn embed(&mut self, tokens: &[u32], out: &mut [f32]) -> Result<()>;
    /// Layer `l`'s attention projections; layers are asked for in order, once per pass.
    fn attention(&mut self, l: usize) -> Result<&Attention>;
    /// `logits (rows × vocab) = xn (rows × hidden) · headᵀ`.
    fn head(&mut self, xn: &[f32], rows: usize, logits: &mut [f32]) -> Result<()>;
    /// Whether [`head`](Self::head) over several rows gives every row bitwise what it gives that
    /// row alone (block encodings: each row on the integer kernels), so that a batch of decoded
    /// tokens may pass the head once; float heads sum several rows in another order.
    fn head_rows_bitwise(&self) -> bool {
        false
    }
}

impl DenseWeights for &Projections {
    fn embed(&mut self, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        self.embed.rows_f32(tokens, out);
        Ok(())
    }

    fn attention(&mut self, l: usize) -> Result<&Attention> {
        Ok(&self.attention[l])
    }

    fn head(&mut self, xn: &[f32], rows: usize, logits: &mut [f32]) -> Result<()> {
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        head.matmul_t(xn, rows, logits);
        Ok(())
    }

    fn head_rows_bitwise(&self) -> bool {
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        head.qtype().is_block()
    }
}

impl Projections {
    /// Reads the projections through `mat` (`name`, `rows`, `cols`).
    pub fn load(
        c: &ModelConfig,
        mat: impl Fn(&str, usize, usize) -> Result<Weight>,
    ) -> Result<Self> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let attention = (0..c.num_layers)
            .map(|i| {
                let p = format!("model.layers.{i}.self_attn");
                Ok(Attention {
                    wq: mat(&format!("{p}.q_proj.weight"), c.num_heads * hd, h)?,
                    wk: mat(&format!("{p}.k_proj.weight"), c.num_kv_heads * hd, h)?,
                    wv: mat(&format!("{p}.v_proj.weight"), c.num_kv_heads * hd, h)?,
                    wo: mat(&format!("{p}.o_proj.weight"), h, c.num_heads * hd)?,
                })
            })
            .collect::<Result<_>>()?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(mat("lm_head.weight", c.vocab_size, h)?)
        };
        Ok(Self {
            embed: mat("model.embed_tokens.weight", c.vocab_size, h)?,
            attention,
            lm_head,
        })
    }

    pub(super) fn bytes(&self) -> usize {
        let attention: usize = self
            .attention
            .iter()
            .map(|a| a.wq.bytes() + a.wk.bytes() + a.wv.bytes() + a.wo.bytes())
            .sum();
        self.embed.bytes() + attention + self.lm_head.as_ref().map_or(0, Weight::bytes)
    }
}
