//! The tensors a converted file stores, by Hugging Face name, and their quantization.

use anyhow::{Context, Result};
use leanstream::source::config::ModelConfig;
use leanstream_format::dense::DenseIndex;
use leanstream_format::ffn::{FfnIndex, PartTypes};
use leanstream_format::quant::{quantize_row, row_bytes, QuantType};
use leanstream_format::quant_scale::scale_row_pow2;

use crate::quant_choice::kept_parts;
use crate::source::Source;

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

/// How one layer's bundles are encoded, part by part, and the source's stored gate and up rows
/// where they are kept (`convert` of a GGUF file under `--quant auto`).
pub struct BundleRows {
    pub parts: PartTypes,
    /// The stored gate and up matrices (`[n, h]` in `parts.gate` and `parts.up`), copied row by
    /// row; `None` where the part is encoded afresh.
    stored: [Option<Vec<u8>>; 2],
    h: usize,
}

impl BundleRows {
    /// Every part encoded afresh as `q`.
    pub fn uniform(q: QuantType, h: usize) -> Self {
        Self {
            parts: PartTypes::uniform(q),
            stored: [None, None],
            h,
        }
    }

    /// Layer `l`'s parts as the source stores them ([`kept_parts`]): its gate and up rows copied,
    /// its down columns encoded afresh. `fallback` encodes what the format has no type for.
    pub fn kept(
        source: &Source,
        l: usize,
        h: usize,
        n: usize,
        fallback: QuantType,
    ) -> Result<Self> {
        let [gate, up, down] = ffn_names(l);
        let gate = source.stored(&gate, &[n, h])?;
        let up = source.stored(&up, &[n, h])?;
        let down = source.stored(&down, &[h, n])?.map(|(q, _)| q);
        let types = [gate.as_ref().map(|g| g.0), up.as_ref().map(|u| u.0), down];
        let parts = kept_parts(types, fallback, h);
        let keep = |s: Option<(QuantType, Vec<u8>)>, q| s.filter(|s| s.0 == q).map(|s| s.1);
        Ok(Self {
            stored: [keep(gate, parts.gate), keep(up, parts.up)],
            parts,
            h,
        })
    }

    /// Bytes of the gate row, the up row and the down column.
    pub fn row_bytes(&self) -> Result<[usize; 3]> {
        Ok(self.parts.row_bytes(self.h)?)
    }

    /// Neuron `i`'s gate row: the stored one, or row `i` of `gate` (`[n, h]` f32) encoded.
    pub fn gate(&self, i: usize, gate: &[f32]) -> Result<Vec<u8>> {
        self.row(0, self.parts.gate, i, gate, 0)
    }

    /// Neuron `i`'s up row, `up` being the f32 rows scaled by `2^scale[i]` (the `gate_up` rule's
    /// rescaling, [`crate::sparsity::rescale`] with powers of two): a stored row gets the same
    /// factor in its scale fields, exactly.
    pub fn up(&self, i: usize, up: &[f32], scale: &[i32]) -> Result<Vec<u8>> {
        self.row(1, self.parts.up, i, up, scale.get(i).copied().unwrap_or(0))
    }

    /// Neuron `i`'s down column, taken from `down` (`[h, n]` f32) and encoded.
    pub fn down(&self, i: usize, down: &[f32], n: usize) -> Result<Vec<u8>> {
        let column: Vec<f32> = (0..self.h).map(|r| down[r * n + i]).collect();
        quantize_rows(self.parts.down, &column, self.h, "a down column")
    }

    fn row(&self, part: usize, q: QuantType, i: usize, f32s: &[f32], k: i32) -> Result<Vec<u8>> {
        let h = self.h;
        let values = &f32s[i * h..(i + 1) * h];
        if let Some(stored) = &self.stored[part] {
            let rb = row_bytes(q, h)?;
            let mut row = stored[i * rb..(i + 1) * rb].to_vec();
            if k == 0 || scale_row_pow2(q, &mut row, h, k).is_some() {
                return Ok(row);
            }
        }
        quantize_rows(q, values, h, "an FFN row")
    }
}

/// META's `dense_quant` (FORMAT.md §4.1): the one encoding of the 2-D dense tensors other than the
/// routers (which stay f32), or `mixed` where they differ (a GGUF file's, kept as stored).
pub fn dense_quant_name(index: &DenseIndex) -> String {
    let mut kinds = index
        .tensors
        .iter()
        .filter(|t| t.shape.len() == 2 && !t.name.ends_with(".mlp.gate.weight"))
        .map(|t| t.qtype);
    one_name(kinds.next(), kinds)
}

/// META's `ffn_quant`: the one encoding of every bundle part, or `mixed`.
pub fn ffn_quant_name(ffn: &FfnIndex) -> String {
    let mut kinds = ffn
        .layers
        .iter()
        .filter(|l| l.neurons() > 0)
        .flat_map(|l| [l.qtypes.gate, l.qtypes.up, l.qtypes.down]);
    one_name(kinds.next(), kinds)
}

fn one_name(first: Option<QuantType>, mut rest: impl Iterator<Item = QuantType>) -> String {
    match first {
        Some(q) if rest.all(|r| r == q) => q.name().into(),
        Some(_) => "mixed".into(),
        None => "f32".into(),
    }
}
