//! The dense f32 transformer: Llama-family block (RMSNorm, rotary GQA attention, SwiGLU or ReLU
//! FFN) with Qwen3's q/k norms and Mistral's sliding window. This is the reference path every
//! streaming policy must reproduce. One file per block type: [`attention`], the FFN ([`dense_ffn`])
//! and the mixture of experts that may replace it ([`moe`]); this file loads the weights and runs
//! the layer loop.

pub mod kv_cache;
pub mod rope;

mod attention;
mod batch;
mod dense_ffn;
mod language_model;
mod moe;
mod norm;
mod projections;

use std::path::Path;
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use leanstream_format::quant::QuantType;

use crate::kernels::{Matrix, Weight};
use crate::model::kv_cache::{KvCache, KvType};
use crate::model::rope::Rope;
use crate::source::config::ModelConfig;
use crate::source::safetensors_dir::SafetensorsDir;

pub use attention::Attention;
pub use batch::recycle;
use dense_ffn::Ffn;
pub use dense_ffn::{DenseFfn, FfnBackend, FfnProbe};
pub use language_model::{decode_each, install, LanguageModel, OnPool};
pub use moe::{expert_tensor_names, route, router_tensor_name, Choice, MoeFfn, MoeScratch};
pub use norm::rms_norm;
pub use projections::{DenseWeights, Projections};

/// The small weights of one transformer block (its attention projections are in [`Projections`]).
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// Query, key and value biases, concatenated (`heads·d + 2·kv_heads·d`; Qwen2).
    pub qkv_bias: Option<Vec<f32>>,
    /// Gemma's norm of the attention output before it joins the residual stream.
    pub attn_post_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    /// Gemma's norm of the FFN output before it joins the residual stream.
    pub ffn_post_norm: Option<Vec<f32>>,
    /// `None` when the FFN streams from flash through an [`FfnBackend`].
    pub ffn: Option<FfnWeights>,
}

/// A block's resident FFN weights.
pub enum FfnWeights {
    Dense(DenseFfn),
    Experts(MoeFfn),
}

impl FfnWeights {
    fn bytes(&self) -> usize {
        match self {
            FfnWeights::Dense(f) => f.bytes(),
            FfnWeights::Experts(m) => m.bytes(),
        }
    }
}

/// A model held in DRAM; the streaming runtime builds it without its projections and passes a
/// [`DenseWeights`] source to each forward pass instead.
pub struct Model {
    config: ModelConfig,
    /// `None` when a [`DenseWeights`] source provides them.
    projections: Option<Projections>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    rope: Rope,
    /// The sliding-window layers' rope when it differs (Gemma 3).
    rope_local: Option<Rope>,
    /// The storage of the caches [`Model::new_cache`] makes (f32 unless set: the reference).
    kv: KvType,
    /// The buffers of a decoded token's forward pass, kept for the next one (taken while in use:
    /// a second caller on another thread makes its own).
    decode: Mutex<Option<Buffers>>,
    /// The same for a batch of decoded tokens ([`Model::forward_batch_with`]), sized for the
    /// largest batch so far: a step of that many rows or fewer allocates nothing.
    batch: Mutex<Option<BatchBuffers>>,
    /// Whether a call's f32 weights multiply all its rows in one product
    /// ([`Model::set_whole_products`]).
    whole_products: bool,
}

/// A batched step's buffers: room for `rows` rows.
struct BatchBuffers {
    rows: usize,
    x: Vec<f32>,
    s: Scratch,
    positions: Vec<usize>,
    /// One row's logits, where a float head takes the rows one at a time.
    row: Vec<f32>,
}

/// A forward call's residual stream and scratch space.
struct Buffers {
    x: Vec<f32>,
    s: Scratch,
}

/// One token's scratch for [`Model::ffn_token`], kept between calls (no allocation per token).
pub struct TokenScratch(Scratch);

/// Per-call scratch space for a chunk of `t` tokens.
struct Scratch {
    /// Each position's rotary tables: `head_dim/2` cosines, then as many sines.
    rope: Vec<f32>,
    /// The same for the sliding-window layers' rope, when they have their own (else empty).
    rope_local: Vec<f32>,
    /// One head's attention scores (up to the cache's capacity).
    scores: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    moe: MoeScratch,
}

impl Scratch {
    fn new(c: &ModelConfig, t: usize) -> Self {
        let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        Self {
            rope: vec![0.0; t * c.head_dim],
            rope_local: match c.block.rope_local_theta {
                Some(_) => vec![0.0; t * c.head_dim],
                None => Vec::new(),
            },
            scores: Vec::new(),
            xn: vec![0.0; t * c.hidden_size],
            q: vec![0.0; t * qd],
            k: vec![0.0; t * kvd],
            v: vec![0.0; t * kvd],
            att: vec![0.0; t * qd],
            proj: vec![0.0; t * c.hidden_size],
            gate: vec![0.0; t * c.intermediate_size],
            up: vec![0.0; t * c.intermediate_size],
            moe: MoeScratch::new(c, t),
        }
    }
}

impl Model {
    /// Loads a Hugging Face model directory (`config.json` + safetensors).
    pub fn load(dir: &Path) -> Result<Self> {
        let config = crate::source::config::from_hf_dir(dir)?;
        let tensors = SafetensorsDir::open(dir)?;
        let c = config.clone();
        Self::from_hf_tensors(config, |name, shape| {
            crate::source::hf_tensors::tensor(&tensors, &c, name, shape)
        })
    }

    /// Builds the model from tensors named as in Hugging Face checkpoints; `get` returns a tensor
    /// as f32 after checking its shape.
    pub fn from_hf_tensors(
        config: ModelConfig,
        get: impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
    ) -> Result<Self> {
        Self::from_hf_weights(config, &get, |name, rows, cols| {
            Ok(Weight::F32(Matrix::new(
                rows,
                cols,
                get(name, &[rows, cols])?,
            )))
        })
    }

    /// As [`from_hf_tensors`](Self::from_hf_tensors), with the weight matrices from `mat`
    /// (`name`, `rows`, `cols`), which may keep them encoded as stored (GGUF blocks).
    pub fn from_hf_weights(
        config: ModelConfig,
        get: impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
        mat: impl Fn(&str, usize, usize) -> Result<Weight>,
    ) -> Result<Self> {
        Self::build(config, get, mat, true)
    }

    /// Everything but the FFN weights, which an [`FfnBackend`] provides.
    pub fn without_ffn(
        config: ModelConfig,
        get: impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
        mat: impl Fn(&str, usize, usize) -> Result<Weight>,
    ) -> Result<Self> {
        Self::build(config, get, mat, false)
    }

    /// Only the norms: the projections come from a [`DenseWeights`] source passed to
    /// [`forward_with`](Self::forward_with), the FFNs from an [`FfnBackend`].
    pub fn norms_only(
        config: ModelConfig,
        get: impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
    ) -> Result<Self> {
        let layers = Self::layers(
            &config,
            &get,
            None::<fn(&str, usize, usize) -> Result<Weight>>,
        )?;
        Self::assemble(config, None, layers, &get)
    }

    fn build(
        config: ModelConfig,
        get: impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
        mat: impl Fn(&str, usize, usize) -> Result<Weight>,
        with_ffn: bool,
    ) -> Result<Self> {
        let projections = Projections::load(&config, &mat)?;
        let layers = Self::layers(&config, &get, with_ffn.then_some(&mat))?;
        Self::assemble(config, Some(projections), layers, &get)
    }

    /// Each block's norms, and its FFN when `ffn_mat` is given.
    fn layers(
        c: &ModelConfig,
        get: &impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
        ffn_mat: Option<impl Fn(&str, usize, usize) -> Result<Weight>>,
    ) -> Result<Vec<Layer>> {
        let (h, hd, n) = (c.hidden_size, c.head_dim, c.intermediate_size);
        (0..c.num_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                let norm_opt = |name: &str| -> Result<Option<Vec<f32>>> {
                    if c.qk_norm {
                        Ok(Some(get(&format!("{p}.self_attn.{name}.weight"), &[hd])?))
                    } else {
                        Ok(None)
                    }
                };
                let ffn = match &ffn_mat {
                    Some(mat) if c.is_moe_layer(i) => {
                        Some(FfnWeights::Experts(MoeFfn::load(c, i, mat)?))
                    }
                    Some(mat) => Some(FfnWeights::Dense(DenseFfn {
                        gate: mat(&format!("{p}.mlp.gate_proj.weight"), n, h)?,
                        up: mat(&format!("{p}.mlp.up_proj.weight"), n, h)?,
                        down: mat(&format!("{p}.mlp.down_proj.weight"), h, n)?,
                    })),
                    None => None,
                };
                let qkv_bias = if c.qkv_bias {
                    let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
                    let mut b = get(&format!("{p}.self_attn.q_proj.bias"), &[qd])?;
                    b.extend(get(&format!("{p}.self_attn.k_proj.bias"), &[kvd])?);
                    b.extend(get(&format!("{p}.self_attn.v_proj.bias"), &[kvd])?);
                    Some(b)
                } else {
                    None
                };
                let norm = |name: &str| get(&format!("{p}.{name}.weight"), &[h]);
                // Gemma's `post_attention_layernorm` is the attention output's; Llama's is the
                // FFN input's.
                let (attn_post_norm, ffn_norm, ffn_post_norm) = if c.architecture.is_gemma() {
                    (
                        Some(norm("post_attention_layernorm")?),
                        norm("pre_feedforward_layernorm")?,
                        Some(norm("post_feedforward_layernorm")?),
                    )
                } else {
                    (None, norm("post_attention_layernorm")?, None)
                };
                Ok(Layer {
                    attn_norm: norm("input_layernorm")?,
                    q_norm: norm_opt("q_norm")?,
                    k_norm: norm_opt("k_norm")?,
                    qkv_bias,
                    attn_post_norm,
                    ffn_norm,
                    ffn_post_norm,
                    ffn,
                })
            })
            .collect()
    }

    fn assemble(
        config: ModelConfig,
        projections: Option<Projections>,
        layers: Vec<Layer>,
        get: &impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
    ) -> Result<Self> {
        let norm = get("model.norm.weight", &[config.hidden_size])?;
        let rope = Rope::new(&config);
        let rope_local = Rope::local(&config);
        Ok(Self {
            config,
            projections,
            layers,
            norm,
            rope,
            rope_local,
            kv: KvType::F32,
            decode: Mutex::new(None),
            batch: Mutex::new(None),
            whole_products: false,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The projections the model holds; `None` for one built with [`Model::norms_only`].
    pub fn projections(&self) -> Option<&Projections> {
        self.projections.as_ref()
    }

    /// Each block's norms and resident FFN weights (what the GPU backend uploads).
    pub fn blocks(&self) -> &[Layer] {
        &self.layers
    }

    /// The weights of the norm before the output head.
    pub fn final_norm(&self) -> &[f32] {
        &self.norm
    }

    /// The storage of the caches [`Model::new_cache`] makes.
    pub fn kv_type(&self) -> KvType {
        self.kv
    }

    /// Layer `l`'s rotary table of position `pos` in a context of `ctx` into `table`
    /// (`head_dim/2` cosines, then as many sines): what a decoded token's attention turns its
    /// queries and keys by.
    pub fn rope_table(&self, l: usize, pos: usize, ctx: usize, table: &mut [f32]) {
        let rope = match (self.config.window(l), &self.rope_local) {
            (Some(_), Some(local)) => local,
            _ => &self.rope,
        };
        let (cos, sin) = table.split_at_mut(self.config.head_dim / 2);
        rope.tables_into(pos, ctx, cos, sin);
    }

    /// Replaces block `l`'s attention projections and returns the ones it had: the converter
    /// holds one block's in f32 at a time and empty placeholders for the others (a model built
    /// with projections; panics otherwise).
    pub fn set_attention(&mut self, l: usize, attention: Attention) -> Attention {
        let projections = self
            .projections
            .as_mut()
            .expect("set_attention() needs a model built with its projections");
        std::mem::replace(&mut projections.attention[l], attention)
    }

    /// With `whole`, a call's f32 weights (attention projections and FFN) multiply all its rows in
    /// one product: each row's bits then depend on how many rows the call has (a prompt's
    /// chunking would change them), but the weights are read once per call instead of once per
    /// 16 rows. For calibration passes over fixed windows; off by default.
    pub fn set_whole_products(&mut self, whole: bool) {
        self.whole_products = whole;
    }

    /// Installs or drops layer `l`'s resident FFN (prep holds one layer's FFN at a time).
    pub fn set_ffn(&mut self, l: usize, ffn: Option<DenseFfn>) {
        self.layers[l].ffn = ffn.map(FfnWeights::Dense);
    }

    /// Installs or drops mixture layer `l`'s resident router and experts (prep profiles routing
    /// one layer at a time).
    pub fn set_experts(&mut self, l: usize, moe: Option<MoeFfn>) {
        self.layers[l].ffn = moe.map(FfnWeights::Experts);
    }

    /// The model with the linear weights of every block encoded as `layers` and the embedding
    /// (and untied output head) as `head`. `F32` keeps a weight on the f32 reference path. Routers
    /// stay as loaded: a rounding there would change which experts run, not just their output.
    pub fn quantize(mut self, layers: QuantType, head: QuantType) -> Result<Self> {
        for l in &mut self.layers {
            let ffns = match &mut l.ffn {
                None => &mut [][..],
                Some(FfnWeights::Dense(f)) => std::slice::from_mut(f),
                Some(FfnWeights::Experts(m)) => &mut m.experts[..],
            };
            for f in ffns {
                for w in [&mut f.gate, &mut f.up, &mut f.down] {
                    *w = w.quantize(layers)?;
                }
            }
        }
        if let Some(p) = &mut self.projections {
            for a in &mut p.attention {
                for w in [&mut a.wq, &mut a.wk, &mut a.wv, &mut a.wo] {
                    *w = w.quantize(layers)?;
                }
            }
            p.embed = p.embed.quantize(head)?;
            if let Some(h) = &mut p.lm_head {
                *h = h.quantize(head)?;
            }
        }
        Ok(self)
    }

    /// The model with its caches stored as `kv`.
    pub fn with_kv(self, kv: KvType) -> Self {
        Self { kv, ..self }
    }

    /// A KV cache for up to `ctx` positions.
    pub fn new_cache(&self, ctx: usize) -> KvCache {
        KvCache::new(&self.config, ctx, self.kv)
    }

    /// Bytes of weights held in DRAM.
    pub fn weight_bytes(&self) -> usize {
        let layer_bytes: usize = self
            .layers
            .iter()
            .map(|l| {
                l.ffn.as_ref().map_or(0, FfnWeights::bytes)
                    + 4 * (l.attn_norm.len() + l.ffn_norm.len())
                    + 4 * (l.q_norm.as_ref().map_or(0, Vec::len)
                        + l.k_norm.as_ref().map_or(0, Vec::len)
                        + l.attn_post_norm.as_ref().map_or(0, Vec::len)
                        + l.ffn_post_norm.as_ref().map_or(0, Vec::len)
                        + l.qkv_bias.as_ref().map_or(0, Vec::len))
            })
            .sum();
        self.projections.as_ref().map_or(0, Projections::bytes) + layer_bytes + 4 * self.norm.len()
    }

    /// Runs `tokens` at the positions following those already in `cache` and appends their keys and
    /// values. Returns the logits of every position (`tokens.len() × vocab`, row-major) when
    /// `all_logits`, else those of the last position only.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
    ) -> Result<Vec<f32>> {
        let mut logits = Vec::new();
        self.forward_with(tokens, cache, all_logits, None, None, &mut logits)?;
        Ok(logits)
    }

    /// [`forward`](Self::forward) into `logits` (resized), with the FFNs computed by `backend` and
    /// the projections taken from `dense`, when given. A single token (decoding) runs in buffers
    /// kept from the previous one: no allocation once they have grown.
    pub fn forward_with(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
        mut backend: Option<&mut dyn FfnBackend>,
        dense: Option<&mut dyn DenseWeights>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let t = tokens.len();
        let start = cache.len();
        if t == 0 {
            bail!("forward needs at least one token");
        }
        if start + t > cache.capacity() {
            bail!(
                "context full: {} positions needed, the cache holds {}",
                start + t,
                cache.capacity()
            );
        }
        let mut own;
        let dense: &mut dyn DenseWeights = match dense {
            Some(d) => d,
            None => {
                own = self.own()?;
                &mut own
            }
        };
        let kept = if t == 1 {
            self.decode.lock().expect("never poisoned").take()
        } else {
            None
        };
        let Buffers { mut x, mut s } = kept.unwrap_or_else(|| Buffers {
            x: Vec::new(),
            s: Scratch::new(&self.config, t),
        });
        // Grown once to the longest context: a decoded token's scores never reallocate.
        s.scores.clear();
        s.scores.reserve(cache.capacity());
        self.embed_into(tokens, dense, &mut x)?;
        self.rope_tables(start, t, cache.capacity(), &mut s);
        for l in 0..self.layers.len() {
            let ffn = match backend.as_deref_mut() {
                Some(b) => {
                    b.begin_layer(l, &x)?;
                    Ffn::Backend(b)
                }
                None => Ffn::Resident(None),
            };
            let attn = dense.attention(l)?;
            self.block_with(l, attn, start, &mut x, cache, &mut s, ffn)?;
        }
        cache.advance(t);
        let rows = if all_logits { t } else { 1 };
        let h = self.config.hidden_size;
        self.logits_with(&x[(t - rows) * h..], dense, &mut s.xn, logits)?;
        if t == 1 {
            *self.decode.lock().expect("never poisoned") = Some(Buffers { x, s });
        }
        Ok(())
    }

    /// The model's own projections; an error for a model built with [`Model::norms_only`].
    fn own(&self) -> Result<&Projections> {
        self.projections
            .as_ref()
            .context("this model was built without its projections: pass a DenseWeights source")
    }

    /// The embedding rows of `tokens` (`tokens.len() × hidden`).
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut x = Vec::new();
        self.embed_into(tokens, &mut self.own()?, &mut x)?;
        Ok(x)
    }

    fn embed_into(
        &self,
        tokens: &[u32],
        dense: &mut dyn DenseWeights,
        x: &mut Vec<f32>,
    ) -> Result<()> {
        let c = &self.config;
        if let Some(tok) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            bail!(
                "token id {tok} is outside the vocabulary ({} entries)",
                c.vocab_size
            );
        }
        x.clear();
        x.resize(tokens.len() * c.hidden_size, 0.0);
        dense.embed(tokens, x)?;
        // Gemma scales the embedding by sqrt(hidden), rounded to the activations' f32.
        if c.architecture.is_gemma() {
            let scale = (c.hidden_size as f64).sqrt() as f32;
            x.iter_mut().for_each(|v| *v *= scale);
        }
        Ok(())
    }

    /// Runs block `l` on the hidden states `x` (`t × hidden`) of positions `start..start+t`,
    /// storing their keys and values in `cache` (whose length is not advanced: the caller does that
    /// once every layer has run). `probe` sees the FFN input and gate pre-activations; prep
    /// profiles through it, one layer at a time.
    pub fn block(
        &self,
        l: usize,
        start: usize,
        x: &mut [f32],
        cache: &mut KvCache,
        probe: Option<&mut dyn FnMut(FfnProbe)>,
    ) {
        let t = x.len() / self.config.hidden_size;
        let mut s = Scratch::new(&self.config, t);
        self.rope_tables(start, t, cache.capacity(), &mut s);
        let attn = &self.own().expect("block() runs a resident model").attention[l];
        self.block_with(l, attn, start, x, cache, &mut s, Ffn::Resident(probe))
            .expect("a resident FFN cannot fail");
    }

    /// Scratch for [`ffn_token`](Self::ffn_token).
    pub fn token_scratch(&self) -> TokenScratch {
        TokenScratch(Scratch::new(&self.config, 1))
    }

    /// Layer `l`'s FFN half for one token: `x` (`hidden`, the residual stream after the layer's
    /// attention) gets the FFN of its norm from `backend`, as a forward pass adds it. What runs on
    /// the CPU when the GPU computes the attention (docs/gpu.md).
    pub fn ffn_token(
        &self,
        l: usize,
        x: &mut [f32],
        backend: &mut dyn FfnBackend,
        s: &mut TokenScratch,
    ) -> Result<()> {
        if x.len() != self.config.hidden_size || l >= self.layers.len() {
            bail!(
                "layer {l}'s FFN for {} values in a model of {} layers of {}",
                x.len(),
                self.layers.len(),
                self.config.hidden_size
            );
        }
        self.ffn_block(l, &self.layers[l], 1, x, &mut s.0, Ffn::Backend(backend))
    }

    /// Layer `l`'s FFN input: the residual stream `x` (one token) through the FFN norm, into
    /// `xn`, as [`Model::ffn_token`] hands it to its backend.
    pub fn ffn_input(&self, l: usize, x: &[f32], xn: &mut [f32]) {
        let c = &self.config;
        norm::rms_norm(x, &self.layers[l].ffn_norm, c.rms_norm_eps, xn);
    }

    /// Final norm and output head over the rows of `x` (`rows × hidden`).
    pub fn logits(&self, x: &[f32]) -> Vec<f32> {
        let mut own = self.own().expect("logits() runs a resident model");
        let (mut xn, mut logits) = (vec![0.0; x.len()], Vec::new());
        self.logits_with(x, &mut own, &mut xn, &mut logits)
            .expect("resident weights cannot fail");
        logits
    }

    /// The logits of the rows of `x` into `logits` (resized), with `xn` (at least `x`'s length)
    /// as scratch.
    fn logits_with(
        &self,
        x: &[f32],
        dense: &mut dyn DenseWeights,
        xn: &mut [f32],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let c = &self.config;
        let h = c.hidden_size;
        let rows = x.len() / h;
        let xn = &mut xn[..rows * h];
        for (src, dst) in x.chunks_exact(h).zip(xn.chunks_exact_mut(h)) {
            rms_norm(src, &self.norm, c.rms_norm_eps, dst);
        }
        logits.clear();
        logits.resize(rows * c.vocab_size, 0.0);
        dense.head(xn, rows, logits)?;
        if let Some(cap) = c.block.final_logit_softcap {
            logits.iter_mut().for_each(|v| *v = (*v / cap).tanh() * cap);
        }
        Ok(())
    }

    /// The rotary tables of positions `start..start + t` in a context of `ctx` into `s.rope` (and
    /// `s.rope_local`), `t × head_dim` each.
    fn rope_tables(&self, start: usize, t: usize, ctx: usize, s: &mut Scratch) {
        let half = self.config.head_dim / 2;
        let ropes = [(&self.rope, &mut s.rope)]
            .into_iter()
            .chain(self.rope_local.as_ref().map(|r| (r, &mut s.rope_local)));
        for (rope, tables) in ropes {
            for (p, table) in (start..start + t).zip(tables.chunks_exact_mut(2 * half)) {
                let (cos, sin) = table.split_at_mut(half);
                rope.tables_into(p, ctx, cos, sin);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn block_with(
        &self,
        l: usize,
        attn: &Attention,
        start: usize,
        x: &mut [f32],
        cache: &mut KvCache,
        s: &mut Scratch,
        ffn: Ffn,
    ) -> Result<()> {
        let layer = &self.layers[l];
        let t = x.len() / self.config.hidden_size;
        self.attention_block(l, layer, attn, start, x, cache, s);
        self.ffn_block(l, layer, t, x, s, ffn)
    }
}
