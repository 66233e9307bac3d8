//! A resident model's whole decode step on the GPU (docs/gpu.md): every block's norms, q/k/v/o
//! projections (in their stored encodings, through the mat-vec shaders), Qwen3's q/k norms, the
//! rotary embedding, attention over a KV cache held in GPU buffers (f32), the dense FFN, the
//! residual adds, the final norm and the head, recorded into one compute pass per token; the
//! logits and the token's keys and values come back in one read. The embedding row is looked up
//! on the CPU and written with the position's rotary table before the pass.
//!
//! The caller's [`KvCache`] stays the reference: each token's keys and values are stored in it as
//! the CPU would, and the GPU's copy follows the cache it was last given (a cache it has not seen,
//! or one that changed behind its back, is uploaded again from [`KvCache::save`]).

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use leanstream_format::ffn::PartTypes;
use leanstream_format::quant::{QuantType, BLOCK_LEN};
use wgpu::util::DeviceExt;

use super::pool::{NeuronPool, PoolLayer, PoolTarget, StreamedFfn};
use super::{f32_bytes, input_words, Dispatch, Gpu, GpuWeights};
use crate::kernels::bundles::ClusterRows;
use crate::kernels::Weight;
use crate::model::kv_cache::KvCache;
use crate::model::{Attention, DenseFfn, FfnBackend, FfnWeights, Model, TokenScratch};
use crate::source::config::{Activation, ModelConfig};
use crate::streaming::skip_rule::{Skip, SkipRule};

const NORM: &str = include_str!("shaders/norm.wgsl");
const HEAD_NORM: &str = include_str!("shaders/headnorm.wgsl");
const Q8: &str = include_str!("shaders/q8.wgsl");
const ROPE: &str = include_str!("shaders/rope.wgsl");
const ATTEND: &str = include_str!("shaders/attend.wgsl");
const ACT: &str = include_str!("shaders/act.wgsl");
const SELECT: &str = include_str!("shaders/select.wgsl");
const REDUCE: &str = include_str!("shaders/reduce.wgsl");
const KERNELS: [(&str, &str); 8] = [
    ("norm", NORM),
    ("headnorm", HEAD_NORM),
    ("q8", Q8),
    ("rope", ROPE),
    ("attend", ATTEND),
    ("act", ACT),
    ("select", SELECT),
    ("reduce", REDUCE),
];

/// Runs of the active-neuron list a bundle FFN's down update sums apart, then adds in order
/// (`down.wgsl`): enough workgroups to fill a GPU on a narrow model.
const DOWN_SLICES: usize = 16;

/// One layer's FFN as a converted file stores it, for [`GpuLayers::upload_bundles`]: every
/// neuron's gate row, up row and down column (`hidden` values each, in the layer's encodings),
/// each part's rows end to end in stored order, and the file's skip rule.
pub struct BundleParts {
    pub qtypes: PartTypes,
    pub neurons: usize,
    pub hidden: usize,
    /// Gate rows, up rows, down columns.
    pub parts: [Vec<u8>; 3],
    pub skip: Skip,
}

/// One layer's FFN weights, to upload.
enum FfnSource<'a> {
    Dense(&'a DenseFfn),
    Bundles(BundleParts),
    /// Computed on the CPU between the GPU's attention steps ([`GpuLayers::upload_attention`]).
    Cpu,
    /// Computed on the GPU from the clusters the CPU streams into the neuron pool
    /// ([`GpuLayers::upload_streamed`]), under this skip rule.
    Pooled(Skip),
}

/// Why `model`'s decode step cannot run on the GPU, or `None` when it can.
pub fn unsupported(model: &Model) -> Option<String> {
    if let Some(why) = unsupported_config(model.config()) {
        return Some(why);
    }
    let why = if model.projections().is_none() {
        "the model holds no projections to upload".into()
    } else if let Some(l) = model
        .blocks()
        .iter()
        .position(|l| !matches!(l.ffn, Some(FfnWeights::Dense(_))))
    {
        format!("layer {l} has no resident dense FFN")
    } else {
        return None;
    };
    Some(why)
}

/// Why a decode step of a model configured as `c` cannot run on the GPU, whatever holds its
/// weights, or `None` when it can.
pub fn unsupported_config(c: &ModelConfig) -> Option<String> {
    let why = if c.architecture.is_gemma() {
        format!(
            "{:?}'s block (scaled embedding, norms after attention and FFN, soft-capping) is not \
             on the GPU yet",
            c.architecture
        )
    } else if c.moe.is_some() {
        "a mixture of experts is not on the GPU yet".into()
    } else if c.qkv_bias && c.qk_norm {
        "q/k/v biases with q/k norms are not on the GPU".into()
    } else if c.block.attn_logit_softcap.is_some() || c.block.final_logit_softcap.is_some() {
        "soft-capping is not on the GPU yet".into()
    } else if c.block.rope_local_theta.is_some() {
        "a second rope for the sliding-window layers is not on the GPU yet".into()
    } else if c.num_layers == 0
        || !c.head_dim.is_multiple_of(2)
        || c.num_kv_heads == 0
        || !c.num_heads.is_multiple_of(c.num_kv_heads)
    {
        format!(
            "{} heads of {} over {} KV heads cannot be laid out",
            c.num_heads, c.head_dim, c.num_kv_heads
        )
    } else {
        return None;
    };
    Some(why)
}

/// The activations' buffers of one token's step.
struct Buffers {
    /// The residual stream (hidden), written with the embedding row before each step.
    x: wgpu::Buffer,
    /// A norm's output (hidden).
    xn: wgpu::Buffer,
    q: wgpu::Buffer,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    /// Attention's output (heads · d).
    att: wgpu::Buffer,
    gate: wgpu::Buffer,
    up: wgpu::Buffer,
    /// A bundle FFN's active neurons (stored positions, or rows in the neuron pool) and their
    /// coefficients, in stored order (`select.wgsl`).
    idx: wgpu::Buffer,
    /// The map `select.wgsl` binds for a layer whose bundles are not pooled (one word, unread).
    no_map: wgpu::Buffer,
    vals: wgpu::Buffer,
    /// Every bundle layer's neuron scores (`[layer][neuron]`).
    scores: wgpu::Buffer,
    /// Per layer: its active neurons' count, 1, 1 (the indirect dispatches' workgroups).
    ind: wgpu::Buffer,
    /// The down update's runs (`DOWN_SLICES × hidden`).
    partial: wgpu::Buffer,
    /// The q8 form of a block-encoded mat-vec's input (the longest input's words).
    q8: wgpu::Buffer,
    logits: wgpu::Buffer,
    /// This token's keys and values of every layer (`[layer][k | v][kv_heads · d]`).
    kv_out: wgpu::Buffer,
    /// The position's rotary table (d/2 cosines, then d/2 sines).
    table: wgpu::Buffer,
    /// The position and the length attended over (`rope.wgsl`'s `Step`).
    step: wgpu::Buffer,
    /// The logits, then `kv_out`, then (with bundle layers) `ind` and, when recorded, `scores`,
    /// read back once a token.
    readback: wgpu::Buffer,
}

/// A layer's weights on the GPU.
struct LayerWeights {
    wq: GpuWeights,
    wk: GpuWeights,
    wv: GpuWeights,
    wo: GpuWeights,
    /// `None`: the FFN runs on the CPU ([`GpuLayers::upload_attention`]).
    ffn: Option<GpuFfn>,
    attn_norm: wgpu::Buffer,
    ffn_norm: wgpu::Buffer,
    /// Qwen3's q and k norms.
    qk_norm: Option<(wgpu::Buffer, wgpu::Buffer)>,
    /// q, k and v biases (zeros without).
    bias: wgpu::Buffer,
}

/// A layer's FFN on the GPU: its gate, up and down matrices, or a converted file's bundles as
/// three matrices of rows (gate rows, up rows, down columns, in stored order, or in the neuron
/// pool's slots with the layer's `map`) with the file's skip rule (`skip`).
struct GpuFfn {
    gate: GpuWeights,
    up: GpuWeights,
    down: GpuWeights,
    skip: Option<Skip>,
    map: Option<wgpu::Buffer>,
}

/// The KV cache on the GPU for contexts of `capacity` positions, with the step's dispatches that
/// bind it.
struct Cache {
    capacity: usize,
    /// Each layer's keys and values, `[kv_head][position][d]` f32.
    keys_values: Vec<(wgpu::Buffer, wgpu::Buffer)>,
    /// Every query head's scores (`heads × capacity`).
    _scores: wgpu::Buffer,
    /// The whole step, in order.
    dispatches: Vec<Dispatch>,
    /// Where each layer's dispatches start, and where its FFN's start (with the FFN on the CPU,
    /// the layer's end); then where the final norm's start.
    layer_starts: Vec<(usize, usize)>,
    head_start: usize,
    /// Positions whose keys and values the buffers hold, and a fingerprint of each position's
    /// last-layer values as the caller's cache stores them ([`fingerprint`]).
    len: usize,
    prints: Vec<u64>,
}

/// A model's decode step on the GPU: its weights, activation buffers and (once a cache has been
/// seen) its KV cache.
pub struct GpuLayers {
    gpu: Arc<Gpu>,
    layers: Vec<LayerWeights>,
    head: GpuWeights,
    final_norm: wgpu::Buffer,
    b: Buffers,
    cache: Option<Cache>,
    /// Bytes on the GPU before the KV cache.
    bytes: usize,
    /// The host's copies of the rotary table and the read-back values.
    table: Vec<f32>,
    kv: Vec<f32>,
    /// The residual stream on the host, where the FFN runs on the CPU.
    x: Vec<f32>,
    /// Whether the layers' FFNs run on the CPU ([`GpuLayers::upload_attention`]).
    cpu_ffn: bool,
    /// Where they stream into the GPU ([`GpuLayers::upload_streamed`]): the neuron pool, the
    /// FFN input on the host and the layer's scores read back.
    pool: Option<NeuronPool>,
    xn: Vec<f32>,
    layer_scores: Vec<f32>,
    /// Whether the layers' FFNs are bundles (their counts are read back).
    bundles: bool,
    /// The last step's active neurons per layer (bundle layers; empty otherwise).
    active: Vec<u32>,
    /// Whether each step's neuron scores are read back, and the last step's (`[layer][neuron]`).
    record: bool,
    scores: Vec<f32>,
    /// The steps' spans, while kept for a timeline ([`GpuLayers::record_spans`]).
    spans: Option<Vec<GpuSpan>>,
}

/// One span of a step on the timeline (`leanstream bench --trace`): on the GPU, from a
/// submission to its results read back, or on the host between two submissions.
#[derive(Debug, Clone, Copy)]
pub struct GpuSpan {
    /// The layer; `None` for the whole step, or the final norm and head after the layers.
    pub layer: Option<u32>,
    pub what: SpanKind,
    pub start: Instant,
    pub end: Instant,
}

/// What a [`GpuSpan`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    /// The GPU computing a layer's attention.
    Attention,
    /// The GPU computing a layer's FFN from the neuron pool.
    Ffn,
    /// The host between the submissions: the engine's choice, the reads it waits for and the
    /// uploads into the pool, or (`--gpu-ffn cpu`) the FFN on the CPU.
    Host,
    /// The GPU computing the whole step, or the final norm and head after the layers.
    Step,
}

impl GpuLayers {
    /// Uploads `model`'s weights (each as stored) and makes the step's buffers; an error that says
    /// why when the GPU cannot hold them or `model` has a feature the step lacks.
    pub fn upload(gpu: Arc<Gpu>, model: &Model) -> Result<Self> {
        if let Some(why) = unsupported(model) {
            bail!("{why}");
        }
        let p = model.projections().expect("checked by unsupported()");
        let head = p.lm_head.as_ref().unwrap_or(&p.embed);
        Self::upload_from(gpu, model, &p.attention, head, |l| {
            match &model.blocks()[l].ffn {
                Some(FfnWeights::Dense(ffn)) => Ok(FfnSource::Dense(ffn)),
                _ => bail!("layer {l} has no resident dense FFN"),
            }
        })
    }

    /// Uploads a converted file's decode step: `model`'s norms (a model of norms only), the
    /// `attention` projections and the output `head`, and each layer's FFN as `bundles(l)` gives
    /// it, in its stored encodings. Each token's FFN runs the file's skip rule over every neuron
    /// on the GPU and computes the up rows and down columns of the active ones only.
    pub fn upload_bundles(
        gpu: Arc<Gpu>,
        model: &Model,
        attention: &[Attention],
        head: &Weight,
        mut bundles: impl FnMut(usize) -> Result<BundleParts>,
    ) -> Result<Self> {
        if let Some(why) = unsupported_config(model.config()) {
            bail!("{why}");
        }
        Self::upload_from(gpu, model, attention, head, |l| {
            bundles(l).map(FfnSource::Bundles)
        })
    }

    /// Uploads the dense half of a decode step — `model`'s norms (a model of norms only), the
    /// `attention` projections and the output `head` — and leaves every layer's FFN to the CPU:
    /// each [`step`](Self::step) reads the residual stream back after a layer's attention, hands
    /// it to the CPU's FFN ([`CpuFfn`]: a streaming model's reads from flash run meanwhile) and
    /// writes the result back for the next layer.
    pub fn upload_attention(
        gpu: Arc<Gpu>,
        model: &Model,
        attention: &[Attention],
        head: &Weight,
    ) -> Result<Self> {
        if let Some(why) = unsupported_config(model.config()) {
            bail!("{why}");
        }
        Self::upload_from(gpu, model, attention, head, |_| Ok(FfnSource::Cpu))
    }

    /// Uploads a streaming model's decode step: `model`'s norms (a model of norms only), the
    /// `attention` projections and the output `head`, and a neuron pool of `slots` clusters for
    /// the `layers`' bundles (their encodings, clusters and skip rules), fewer where the GPU's
    /// budget holds fewer beside the step and a KV cache of `ctx` positions, filled as the CPU
    /// streams them: each [`step`](Self::step) reads the residual stream back after a layer's
    /// attention, the CPU's engine ([`StreamedFfn`]) chooses the layer's clusters from it, reads
    /// those it lacks and uploads those the pool lacks, and the GPU computes the FFN from the
    /// pool under the skip rule, the neurons the engine skipped left out.
    pub fn upload_streamed(
        gpu: Arc<Gpu>,
        model: &Model,
        attention: &[Attention],
        head: &Weight,
        layers: Vec<(PoolLayer, Skip)>,
        slots: usize,
        ctx: usize,
    ) -> Result<Self> {
        if let Some(why) = unsupported_config(model.config()) {
            bail!("{why}");
        }
        let skips: Vec<Skip> = layers.iter().map(|l| l.1).collect();
        let pool_layers = layers.into_iter().map(|l| l.0).collect();
        let pool = Some((pool_layers, slots, ctx));
        Self::upload_with(gpu, model, attention, head, pool, |l| {
            Ok(FfnSource::Pooled(skips[l]))
        })
    }

    fn upload_from<'a>(
        gpu: Arc<Gpu>,
        model: &Model,
        attention: &[Attention],
        head: &Weight,
        ffn: impl FnMut(usize) -> Result<FfnSource<'a>>,
    ) -> Result<Self> {
        Self::upload_with(gpu, model, attention, head, None, ffn)
    }

    fn upload_with<'a>(
        gpu: Arc<Gpu>,
        model: &Model,
        attention: &[Attention],
        head: &Weight,
        pool: Option<(Vec<PoolLayer>, usize, usize)>,
        ffn: impl FnMut(usize) -> Result<FfnSource<'a>>,
    ) -> Result<Self> {
        let built = gpu.scoped(|| Self::build(gpu.clone(), model, attention, head, pool, ffn))?;
        // Every kernel of the step, built now: an adapter that rejects one keeps the layers on
        // the CPU from the start.
        for (name, source) in KERNELS {
            gpu.kernel(name, source)?;
        }
        for f in built.layers.iter().filter_map(|l| l.ffn.as_ref()) {
            if f.skip.is_some() {
                gpu.gather_pipeline(f.up.qtype)?;
                gpu.down_pipeline(f.down.qtype)?;
            }
            if f.map.is_some() {
                gpu.mapped_pipeline(f.gate.qtype)?;
                gpu.mapped_pipeline(f.up.qtype)?;
            }
        }
        Ok(built)
    }

    fn build<'a>(
        gpu: Arc<Gpu>,
        model: &Model,
        attention: &[Attention],
        head: &Weight,
        pool: Option<(Vec<PoolLayer>, usize, usize)>,
        mut ffn_of: impl FnMut(usize) -> Result<FfnSource<'a>>,
    ) -> Result<Self> {
        let c = model.config();
        let (h, hd, n) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
        // Every buffer is charged against the budget before it is made.
        let charge = gpu.charge("the decode step's weights and buffers");
        let up_w = |w: &Weight| {
            charge.take(super::weight_bytes(w) as u64)?;
            gpu.upload_weights(w)
        };
        let init = |label, data: &[f32]| {
            charge.take(4 * data.len().max(1) as u64)?;
            Ok::<_, anyhow::Error>(gpu.storage_init(label, data))
        };
        if attention.len() != c.num_layers || model.blocks().len() != c.num_layers {
            bail!(
                "{} layers of attention for a model of {} layers",
                attention.len(),
                c.num_layers
            );
        }
        let per_dim = gpu.limits.max_compute_workgroups_per_dimension as usize;
        let pool = match pool {
            Some((layers, slots, ctx)) => {
                if layers.len() != c.num_layers {
                    bail!(
                        "{} streamed layers for a model of {} layers",
                        layers.len(),
                        c.num_layers
                    );
                }
                let reserve = step_reserve(c, attention, head, ctx);
                Some(NeuronPool::new(&gpu, layers, h, slots, reserve, &charge)?)
            }
            None => None,
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for (l, (layer, attn)) in model.blocks().iter().zip(attention).enumerate() {
            let ffn = match ffn_of(l)? {
                FfnSource::Cpu => None,
                FfnSource::Dense(ffn) => Some(GpuFfn {
                    gate: up_w(&ffn.gate)?,
                    up: up_w(&ffn.up)?,
                    down: up_w(&ffn.down)?,
                    skip: None,
                    map: None,
                }),
                FfnSource::Pooled(skip) => {
                    let pool = pool.as_ref().expect("a pooled layer has a pool");
                    let ([gate, up, down], map) = pool.layer(&gpu, l)?;
                    if gate.rows != n {
                        bail!("layer {l} has {} neurons, the model {n}", gate.rows);
                    }
                    check_bundles(l, n, per_dim, skip)?;
                    Some(GpuFfn {
                        gate,
                        up,
                        down,
                        skip: Some(skip),
                        map: Some(map.clone()),
                    })
                }
                FfnSource::Bundles(b) => {
                    if b.neurons != n || b.hidden != h {
                        bail!(
                            "layer {l} has {} neurons of {} values, the model {n} of {h}",
                            b.neurons,
                            b.hidden
                        );
                    }
                    check_bundles(l, n, per_dim, b.skip)?;
                    let [g, u, d] = &b.parts;
                    let rows = |bytes: &[u8], qtype| {
                        charge.take(bytes.len() as u64)?;
                        gpu.upload_rows(bytes, n, h, qtype)
                    };
                    Some(GpuFfn {
                        gate: rows(g, b.qtypes.gate)?,
                        up: rows(u, b.qtypes.up)?,
                        down: rows(d, b.qtypes.down)?,
                        skip: Some(b.skip),
                        map: None,
                    })
                }
            };
            let mut bias = layer.qkv_bias.clone().unwrap_or_default();
            bias.resize(qd + 2 * kvd, 0.0);
            layers.push(LayerWeights {
                wq: up_w(&attn.wq)?,
                wk: up_w(&attn.wk)?,
                wv: up_w(&attn.wv)?,
                wo: up_w(&attn.wo)?,
                ffn,
                attn_norm: init("attn_norm", &layer.attn_norm)?,
                ffn_norm: init("ffn_norm", &layer.ffn_norm)?,
                qk_norm: match (&layer.q_norm, &layer.k_norm) {
                    (Some(qn), Some(kn)) => Some((init("q_norm", qn)?, init("k_norm", kn)?)),
                    _ => None,
                },
                bias: init("bias", &bias)?,
            });
        }
        let head = up_w(head)?;
        let bundles = layers
            .iter()
            .any(|l| l.ffn.as_ref().is_some_and(|f| f.skip.is_some()));
        let cpu_ffn = layers.iter().all(|l| l.ffn.is_none());
        let final_norm = init("final_norm", model.final_norm())?;
        let kv_words = 2 * c.num_layers * kvd;
        let q8_words = [h, qd, n]
            .into_iter()
            .filter(|&len| len.is_multiple_of(BLOCK_LEN))
            .map(|len| input_words(QuantType::Q8_0, len))
            .max()
            .unwrap_or(0)
            .max(1);
        let vocab = c.vocab_size;
        let f = |label, words: usize| {
            charge.take(4 * words.max(1) as u64)?;
            Ok::<_, anyhow::Error>(gpu.scratch(label, words))
        };
        let raw = |label, bytes: u64, usage| {
            charge.take(bytes)?;
            Ok::<_, anyhow::Error>(gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage,
                mapped_at_creation: false,
            }))
        };
        // The bundle layers' buffers (one word each without).
        let (list, score_words, ind_words, partial_words) = match bundles {
            true => (n, c.num_layers * n, 3 * c.num_layers, DOWN_SLICES * h),
            false => (1, 1, 3, 1),
        };
        // At least the residual stream, which a step with the FFN on the CPU reads per layer, and
        // with a pool the layer's scores after it.
        let readback_words = (vocab + kv_words + if bundles { ind_words + score_words } else { 0 })
            .max(h + if pool.is_some() { n } else { 0 });
        let b = Buffers {
            x: f("x", h)?,
            xn: f("xn", h)?,
            q: f("q", qd)?,
            k: f("k", kvd)?,
            v: f("v", kvd)?,
            att: f("att", qd)?,
            gate: f("gate", n)?,
            up: f("up", n)?,
            idx: f("idx", list)?,
            no_map: f("no_map", 1)?,
            vals: f("vals", list)?,
            scores: f("scores", score_words)?,
            ind: raw(
                "ind",
                4 * ind_words as u64,
                wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::INDIRECT
                    | wgpu::BufferUsages::COPY_SRC,
            )?,
            partial: f("partial", partial_words)?,
            q8: f("q8", q8_words)?,
            logits: f("logits", vocab)?,
            kv_out: f("kv_out", kv_words)?,
            table: f("table", hd)?,
            step: raw(
                "step",
                16,
                wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            )?,
            readback: raw(
                "readback",
                4 * readback_words as u64,
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            )?,
        };
        let small = layers.iter().flat_map(|l| {
            [&l.attn_norm, &l.ffn_norm, &l.bias]
                .into_iter()
                .chain(l.qk_norm.iter().flat_map(|(q, k)| [q, k]))
        });
        let activations = [
            &b.x,
            &b.xn,
            &b.q,
            &b.k,
            &b.v,
            &b.att,
            &b.gate,
            &b.up,
            &b.idx,
            &b.no_map,
            &b.vals,
            &b.scores,
            &b.ind,
            &b.partial,
            &b.q8,
            &b.logits,
            &b.kv_out,
            &b.table,
            &b.step,
            &b.readback,
            &final_norm,
        ];
        let weights = layers.iter().flat_map(|l| {
            let ffn = l.ffn.iter().flat_map(|f| [&f.gate, &f.up, &f.down]);
            [&l.wq, &l.wk, &l.wv, &l.wo].into_iter().chain(ffn)
        });
        let bytes = weights.chain([&head]).map(|w| w.bytes).sum::<usize>()
            + small
                .chain(activations)
                .map(|b| b.size() as usize)
                .sum::<usize>()
            + pool.as_ref().map_or(0, |p| p.bytes as usize);
        debug_assert_eq!(charge.held(), bytes as u64, "every buffer charged");
        Ok(Self {
            gpu,
            layers,
            head,
            final_norm,
            b,
            cache: None,
            bytes,
            table: vec![0.0; hd],
            kv: vec![0.0; kv_words],
            x: Vec::with_capacity(h),
            cpu_ffn: cpu_ffn && pool.is_none(),
            pool,
            xn: vec![0.0; h],
            layer_scores: Vec::with_capacity(n),
            bundles,
            active: Vec::new(),
            record: false,
            scores: Vec::new(),
            spans: None,
        })
    }

    /// Bytes on the GPU, without the KV cache.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Starts keeping each step's spans for a timeline ([`take_spans`](Self::take_spans)).
    pub fn record_spans(&mut self) {
        self.spans.get_or_insert_with(Vec::new);
    }

    /// The spans kept since [`record_spans`](Self::record_spans) (which goes on keeping them).
    pub fn take_spans(&mut self) -> Vec<GpuSpan> {
        self.spans.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The neuron pool's slots, where the FFN streams into it.
    pub fn pool_slots(&self) -> Option<usize> {
        self.pool.as_ref().map(NeuronPool::slots)
    }

    /// Bytes of the neuron pool (0 without one).
    pub fn pool_bytes(&self) -> u64 {
        self.pool.as_ref().map_or(0, |p| p.bytes)
    }

    /// Clusters uploaded into the neuron pool so far (0 without one).
    pub fn pool_uploads(&self) -> u64 {
        self.pool.as_ref().map_or(0, |p| p.uploads)
    }

    /// The last step's active neurons per layer, where the layers' FFNs are bundles (empty
    /// otherwise).
    pub fn active(&self) -> &[u32] {
        &self.active
    }

    /// Whether each step reads back every neuron's score besides (for a test: the GPU's decisions
    /// and how near each was to the threshold).
    pub fn record_scores(&mut self, on: bool) {
        self.record = on && self.bundles;
    }

    /// The last step's neuron scores (`[layer][neuron]`, stored order) while
    /// [`record_scores`](Self::record_scores) is on; empty otherwise.
    pub fn scores(&self) -> &[f32] {
        &self.scores
    }

    /// Makes the GPU's KV cache hold what `cache` holds: kept when it is the cache of the last
    /// steps (or a prefix of it), uploaded again otherwise; new buffers when the capacity changes.
    /// An error when the GPU cannot hold a cache of that capacity.
    pub fn sync(&mut self, model: &Model, cache: &KvCache) -> Result<()> {
        let capacity = cache.capacity();
        if self.cache.as_ref().is_none_or(|c| c.capacity != capacity) {
            self.cache = None;
            let made = self
                .gpu
                .scoped(|| self.make_cache(model, capacity))
                .with_context(|| format!("a KV cache of {capacity} positions on the GPU"))?;
            self.cache = Some(made);
        }
        let gc = self.cache.as_mut().expect("made above");
        let len = cache.len();
        if len == 0 {
            gc.len = 0;
            return Ok(());
        }
        let (layers, hd) = (model.config().num_layers, model.config().head_dim);
        if len <= gc.len && gc.prints[len - 1] == fingerprint(cache, layers, hd, len - 1) {
            gc.len = len;
            return Ok(());
        }
        self.upload_cache(model, cache)
    }

    /// Writes the positions of `cache` into the GPU's buffers (each decoded to f32).
    fn upload_cache(&mut self, model: &Model, cache: &KvCache) -> Result<()> {
        let c = model.config();
        let hd = c.head_dim;
        let gc = self.cache.as_mut().expect("synced");
        let len = cache.len();
        let mut vals = vec![0.0f32; len * hd];
        for (l, (keys, values)) in gc.keys_values.iter().enumerate() {
            for (is_keys, buf) in [(true, keys), (false, values)] {
                for head in 0..c.num_kv_heads {
                    cache.decode_head(l, is_keys, head, &mut vals);
                    let at = 4 * (head * gc.capacity * hd) as u64;
                    self.gpu.queue.write_buffer(buf, at, f32_bytes(&vals));
                }
            }
        }
        gc.len = len;
        for pos in 0..len {
            gc.prints[pos] = fingerprint(cache, c.num_layers, hd, pos);
        }
        Ok(())
    }

    /// The KV buffers for `capacity` positions and the step's dispatches over them.
    fn make_cache<'s>(&'s self, model: &Model, capacity: usize) -> Result<Cache> {
        let g = &*self.gpu;
        let c = model.config();
        let (h, hd, n) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (nh, nkv) = (c.num_heads, c.num_kv_heads);
        let kvd = nkv * hd;
        let layer_bytes = 4 * (nkv * capacity.max(1) * hd) as u64;
        let scores_bytes = 4 * (nh * capacity.max(1)) as u64;
        // The cache's buffers, charged after the step's own.
        let charge = g.charge("the decode step and its KV cache");
        charge.take(self.bytes as u64)?;
        charge.take(2 * c.num_layers as u64 * layer_bytes + scores_bytes)?;
        let max = g.max_matrix_bytes();
        if layer_bytes.max(scores_bytes) > max {
            bail!(
                "a layer's keys for {capacity} positions ({layer_bytes} bytes) are larger than the \
                 GPU's largest storage buffer ({max} bytes)"
            );
        }
        let kv_buf = |label| {
            g.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: layer_bytes,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        };
        let keys: Vec<_> = (0..c.num_layers).map(|_| kv_buf("keys")).collect();
        let values: Vec<_> = (0..c.num_layers).map(|_| kv_buf("values")).collect();
        let scores = g.scratch("scores", nh * capacity.max(1));

        let [norm, head_norm, q8, rope, attend, act, select, reduce] =
            KERNELS.map(|(name, source)| g.kernel(name, source));
        let (norm, head_norm, q8, rope, attend, act, select, reduce) = (
            norm?, head_norm?, q8?, rope?, attend?, act?, select?, reduce?,
        );
        let b = &self.b;
        let eps = c.rms_norm_eps.to_bits();
        let per_dim = g.limits.max_compute_workgroups_per_dimension;
        let groups = |invocations: usize| -> Result<(u32, u32)> {
            let gx = invocations.div_ceil(64).max(1);
            if gx > per_dim as usize {
                bail!("{invocations} invocations are more than one dispatch takes here");
            }
            Ok((gx as u32, 1))
        };
        let mut d = Vec::new();
        let norm_of = |x: &wgpu::Buffer, w: &wgpu::Buffer, len: usize| {
            g.dispatch(
                "norm",
                &norm,
                &[x, w, &b.xn],
                &p8([len as u32, eps]),
                (1, 1),
            )
        };
        // `x` (of `cols` values) quantized into `b.q8`, unless `quantized` says it holds it.
        let quantize = |d: &mut Vec<Dispatch>,
                        cols: usize,
                        x: &wgpu::Buffer,
                        quantized: &mut bool|
         -> Result<()> {
            if !*quantized {
                let blocks = (cols / BLOCK_LEN) as u32;
                let scales = (cols / 4) as u32;
                d.push(g.dispatch(
                    "q8",
                    &q8,
                    &[x, &b.q8],
                    &p8([blocks, scales, scales + blocks]),
                    groups(blocks as usize)?,
                ));
                *quantized = true;
            }
            Ok(())
        };
        // `w · x` into `out` (added to it with `accumulate`), `x` quantized first for a block
        // encoding; `quantized` says whether `b.q8` already holds this `x`.
        // What `w`'s mat-vec shaders read for the input `x`: `x`, or for a block encoding its q8
        // form (quantized into `b.q8` unless `quantized` says it holds it).
        let input_for = |d: &mut Vec<Dispatch>,
                         w: &GpuWeights,
                         x: &'s wgpu::Buffer,
                         quantized: &mut bool|
         -> Result<&'s wgpu::Buffer> {
            if w.qtype.is_block() {
                quantize(d, w.cols, x, quantized)?;
                Ok(&b.q8)
            } else {
                Ok(x)
            }
        };
        let matvec = |d: &mut Vec<Dispatch>,
                      w: &GpuWeights,
                      x: &'s wgpu::Buffer,
                      quantized: &mut bool,
                      out: &wgpu::Buffer,
                      accumulate: bool|
         -> Result<()> {
            let input = input_for(d, w, x, quantized)?;
            d.push(g.matvec_dispatch(w, input, out, accumulate));
            Ok(())
        };
        let (act_kind, threshold) = act_params(c.activation);
        let scale = match c.block.query_pre_attn_scalar {
            Some(s) => (1.0 / (s as f64).sqrt()) as f32,
            None => 1.0 / (hd as f32).sqrt(),
        };
        let mut layer_starts = Vec::with_capacity(self.layers.len());
        for (l, lw) in self.layers.iter().enumerate() {
            let start = d.len();
            d.push(norm_of(&b.x, &lw.attn_norm, h));
            let mut quantized = false;
            matvec(&mut d, &lw.wq, &b.xn, &mut quantized, &b.q, false)?;
            matvec(&mut d, &lw.wk, &b.xn, &mut quantized, &b.k, false)?;
            matvec(&mut d, &lw.wv, &b.xn, &mut quantized, &b.v, false)?;
            if let Some((qn, kn)) = &lw.qk_norm {
                d.push(g.dispatch(
                    "headnorm",
                    &head_norm,
                    &[&b.q, &b.k, qn, kn],
                    &p8([hd as u32, eps, nh as u32]),
                    ((nh + nkv) as u32, 1),
                ));
            }
            d.push(g.dispatch(
                "rope",
                &rope,
                &[
                    &b.q, &b.k, &b.v, &lw.bias, &b.table, &keys[l], &values[l], &b.kv_out, &b.step,
                ],
                &p8([
                    nh as u32,
                    nkv as u32,
                    hd as u32,
                    capacity as u32,
                    c.uses_rope(l) as u32,
                    (2 * l * kvd) as u32,
                ]),
                groups((nh + nkv) * hd / 2 + kvd)?,
            ));
            d.push(g.dispatch(
                "attend",
                &attend,
                &[&b.q, &keys[l], &values[l], &scores, &b.att, &b.step],
                &p8([
                    nh as u32,
                    (nh / nkv) as u32,
                    hd as u32,
                    capacity as u32,
                    scale.to_bits(),
                    c.window(l).map_or(0, |w| w.min(u32::MAX as usize) as u32),
                ]),
                (nh as u32, 1),
            ));
            matvec(&mut d, &lw.wo, &b.att, &mut false, &b.x, true)?;
            layer_starts.push((start, d.len()));
            let Some(GpuFfn {
                gate,
                up,
                down,
                skip,
                map,
            }) = &lw.ffn
            else {
                continue;
            };
            d.push(norm_of(&b.x, &lw.ffn_norm, h));
            let mut quantized = false;
            let Some(skip) = skip else {
                matvec(&mut d, gate, &b.xn, &mut quantized, &b.gate, false)?;
                matvec(&mut d, up, &b.xn, &mut quantized, &b.up, false)?;
                d.push(g.dispatch(
                    "act",
                    &act,
                    &[&b.gate, &b.up],
                    &p8([n as u32, act_kind, threshold.to_bits()]),
                    groups(n)?,
                ));
                matvec(&mut d, down, &b.gate, &mut false, &b.x, true)?;
                continue;
            };
            // The bundles: every neuron's gate (and under `gate_up` its up value), the skip
            // rule listing the active neurons, their up rows (under `gate`) and down columns.
            let gate_up = skip.rule == SkipRule::GateUp;
            // A pooled layer computes the neurons its map does not skip, from their pool rows.
            let mut rows = |d: &mut Vec<Dispatch>, w: &GpuWeights, out| -> Result<()> {
                match map {
                    None => matvec(d, w, &b.xn, &mut quantized, out, false),
                    Some(map) => {
                        let input = input_for(d, w, &b.xn, &mut quantized)?;
                        d.push(g.mapped_dispatch(w, input, out, map)?);
                        Ok(())
                    }
                }
            };
            rows(&mut d, gate, &b.gate)?;
            if gate_up {
                rows(&mut d, up, &b.up)?;
            }
            let (kind, fat) = act_params(skip.act);
            d.push(g.dispatch(
                "select",
                &select,
                &[
                    &b.gate,
                    &b.up,
                    &b.idx,
                    &b.vals,
                    &b.scores,
                    &b.ind,
                    map.as_ref().unwrap_or(&b.no_map),
                ],
                &p8([
                    n as u32,
                    kind,
                    fat.to_bits(),
                    gate_up as u32,
                    skip.threshold.to_bits(),
                    l as u32,
                    map.is_some() as u32,
                ]),
                (1, 1),
            ));
            if !gate_up {
                let input = input_for(&mut d, up, &b.xn, &mut quantized)?;
                d.push(g.gather_dispatch(
                    up,
                    input,
                    &b.vals,
                    &b.idx,
                    skip.act == Activation::DRelu,
                    (&b.ind, 12 * l as u64),
                )?);
            }
            d.push(g.dispatch(
                "down",
                &g.down_pipeline(down.qtype)?,
                &[&down.buffer, &b.idx, &b.vals, &b.ind, &b.partial],
                &p8([
                    h as u32,
                    down.row_bytes as u32,
                    DOWN_SLICES as u32,
                    l as u32,
                    down.slots.neurons,
                    down.slots.stride,
                ]),
                (h.div_ceil(64) as u32, DOWN_SLICES as u32),
            ));
            d.push(g.dispatch(
                "reduce",
                &reduce,
                &[&b.x, &b.partial],
                &p8([h as u32, DOWN_SLICES as u32]),
                groups(h)?,
            ));
        }
        let head_start = d.len();
        d.push(norm_of(&b.x, &self.final_norm, h));
        matvec(&mut d, &self.head, &b.xn, &mut false, &b.logits, false)?;
        Ok(Cache {
            capacity,
            keys_values: keys.into_iter().zip(values).collect(),
            _scores: scores,
            dispatches: d,
            layer_starts,
            head_start,
            len: 0,
            prints: vec![0; capacity],
        })
    }

    /// One token at position `pos` (the synced cache's length), whose embedding row is
    /// `embedding`: its logits into `logits`, its keys and values of every layer stored in
    /// `cache` (whose length the caller advances). With the FFN on the CPU
    /// ([`upload_attention`](Self::upload_attention)) `host` is the CPU's FFN, computing it layer
    /// by layer between the GPU's attention steps; with the FFN streamed into the neuron pool
    /// ([`upload_streamed`](Self::upload_streamed)) it is the engine that streams it; otherwise
    /// [`HostFfn::None`].
    pub fn step(
        &mut self,
        model: &Model,
        embedding: &[f32],
        cache: &mut KvCache,
        logits: &mut [f32],
        host: HostFfn<'_>,
    ) -> Result<()> {
        let c = model.config();
        let pos = cache.len();
        let gc = self
            .cache
            .as_ref()
            .context("the GPU's KV cache is not synced")?;
        if gc.len != pos || pos >= gc.capacity {
            bail!(
                "the GPU's KV cache holds {} positions of {}, the step is at {pos}",
                gc.len,
                gc.capacity
            );
        }
        if embedding.len() != c.hidden_size {
            bail!(
                "an embedding row of {} values for a model of {}",
                embedding.len(),
                c.hidden_size
            );
        }
        let wanted = match (self.cpu_ffn, self.pool.is_some()) {
            (true, _) => "the CPU's FFN",
            (_, true) => "the engine that streams the FFN",
            _ => "nothing",
        };
        let given = match host {
            HostFfn::None => "nothing",
            HostFfn::Cpu(_) => "the CPU's FFN",
            HostFfn::Streamed(_) => "the engine that streams the FFN",
        };
        if wanted != given {
            bail!("this step takes {wanted}, not {given}");
        }
        model.rope_table(0, pos, gc.capacity, &mut self.table);
        let (g, b) = (&*self.gpu, &self.b);
        let q = &g.queue;
        q.write_buffer(&b.x, 0, f32_bytes(embedding));
        q.write_buffer(&b.table, 0, f32_bytes(&self.table));
        let step = [pos as u32, pos as u32 + 1, 0, 0];
        q.write_buffer(&b.step, 0, &step.map(u32::to_le_bytes).concat());
        let record = |d: &[Dispatch]| {
            let mut enc = g
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
                for d in d {
                    d.record(&mut pass);
                }
            }
            enc
        };
        let x_bytes = 4 * embedding.len() as u64;
        let rest = match host {
            HostFfn::None => 0,
            HostFfn::Streamed(engine) => {
                // Per layer: the attention on the GPU, the residual stream read back, the engine's
                // choice of neurons from it (their clusters read, and uploaded where the pool lacks
                // them), the FFN on the GPU from the pool, the stream and the scores read back.
                let (x, xn) = (&mut self.x, &mut self.xn);
                x.clear();
                x.extend_from_slice(embedding);
                let pool = self.pool.as_mut().expect("checked above");
                let spans = &mut self.spans;
                for (l, &(start, ffn_start)) in gc.layer_starts.iter().enumerate() {
                    let end = gc.layer_starts.get(l + 1).map_or(gc.head_start, |s| s.0);
                    engine.begin_layer(l, x)?;
                    let t0 = Instant::now();
                    let mut enc = record(&gc.dispatches[start..ffn_start]);
                    enc.copy_buffer_to_buffer(&b.x, 0, &b.readback, 0, x_bytes);
                    q.submit([enc.finish()]);
                    g.read_back(&b.readback, x_bytes, |bytes| read_f32(bytes, x))?;
                    let t1 = Instant::now();
                    model.ffn_input(l, x, xn);
                    pool.begin();
                    let mut target = PoolStep {
                        gpu: g,
                        pool: &mut *pool,
                        b,
                        dispatches: &gc.dispatches[ffn_start..end],
                        l,
                        x: &mut *x,
                        scores: &mut self.layer_scores,
                        ran: None,
                    };
                    engine.ffn_on_gpu(l, xn, &mut target)?;
                    let t4 = Instant::now();
                    let (t2, t3) = target.ran.unwrap_or((t4, t4));
                    keep(
                        spans,
                        l,
                        [
                            (SpanKind::Attention, t0, t1),
                            (SpanKind::Host, t1, t2),
                            (SpanKind::Ffn, t2, t3),
                            (SpanKind::Host, t3, t4),
                        ],
                    );
                }
                gc.head_start
            }
            HostFfn::Cpu(CpuFfn { backend, scratch }) => {
                // Per layer: the attention on the GPU, the residual stream read back, the FFN on the
                // CPU, the stream written back. The next layer's reads from flash, queued when its
                // input is known, run while the GPU computes its attention.
                let x = &mut self.x;
                x.clear();
                x.extend_from_slice(embedding);
                for (l, &(start, end)) in gc.layer_starts.iter().enumerate() {
                    backend.begin_layer(l, x)?;
                    let t0 = Instant::now();
                    let mut enc = record(&gc.dispatches[start..end]);
                    enc.copy_buffer_to_buffer(&b.x, 0, &b.readback, 0, x_bytes);
                    q.submit([enc.finish()]);
                    g.read_back(&b.readback, x_bytes, |bytes| read_f32(bytes, x))?;
                    let t1 = Instant::now();
                    model.ffn_token(l, x, &mut *backend, &mut *scratch)?;
                    q.write_buffer(&b.x, 0, f32_bytes(x));
                    let t2 = Instant::now();
                    let spans = &mut self.spans;
                    keep(
                        spans,
                        l,
                        [(SpanKind::Attention, t0, t1), (SpanKind::Host, t1, t2)],
                    );
                }
                gc.head_start
            }
        };
        let t0 = Instant::now();
        let mut enc = record(&gc.dispatches[rest..]);
        let logit_bytes = b.logits.size();
        let kv_bytes = b.kv_out.size();
        let ind_bytes = b.ind.size();
        let mut read = logit_bytes + kv_bytes;
        enc.copy_buffer_to_buffer(&b.logits, 0, &b.readback, 0, None);
        enc.copy_buffer_to_buffer(&b.kv_out, 0, &b.readback, logit_bytes, None);
        if self.bundles {
            enc.copy_buffer_to_buffer(&b.ind, 0, &b.readback, read, None);
            read += ind_bytes;
            if self.record {
                enc.copy_buffer_to_buffer(&b.scores, 0, &b.readback, read, None);
                read += b.scores.size();
            }
        }
        q.submit([enc.finish()]);
        let (kv, active, scores) = (&mut self.kv, &mut self.active, &mut self.scores);
        let (bundles, recorded) = (self.bundles, self.record);
        g.read_back(&b.readback, read, |view| {
            let (lb, rest) = view.split_at(logit_bytes as usize);
            let (kb, rest) = rest.split_at(kv_bytes as usize);
            read_f32(lb, logits);
            read_f32(kb, kv);
            if bundles {
                let (ib, sb) = rest.split_at(ind_bytes as usize);
                active.clear();
                active.extend(
                    ib.chunks_exact(12)
                        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])),
                );
                scores.clear();
                if recorded {
                    scores.resize(sb.len() / 4, 0.0);
                    read_f32(sb, scores);
                }
            }
        })?;
        if let Some(spans) = &mut self.spans {
            let end = Instant::now();
            spans.push(GpuSpan {
                layer: None,
                what: SpanKind::Step,
                start: t0,
                end,
            });
        }
        let kvd = c.num_kv_heads * c.head_dim;
        for (l, kv) in self.kv.chunks_exact(2 * kvd).enumerate() {
            let (k, v) = kv.split_at(kvd);
            cache.store(l, pos, k, v);
        }
        let gc = self.cache.as_mut().expect("checked above");
        gc.prints[pos] = fingerprint(cache, c.num_layers, c.head_dim, pos);
        gc.len = pos + 1;
        Ok(())
    }
}

/// Why layer `l`'s bundles of `n` neurons cannot run on a GPU of `per_dim` workgroups a
/// dispatch under `skip`, if they cannot.
fn check_bundles(l: usize, n: usize, per_dim: usize, skip: Skip) -> Result<()> {
    if n > per_dim {
        bail!(
            "layer {l}'s {n} neurons are more than one dispatch takes here ({per_dim} workgroups)"
        );
    }
    if skip.threshold.is_nan() {
        bail!("layer {l}'s skip threshold is not a number");
    }
    Ok(())
}

/// About the bytes a streamed step takes on the GPU besides its neuron pool: the `attention`
/// projections and the `head` as stored, the norms and biases, the activations' buffers
/// (generously: the scores of every layer twice, the logits twice, 24 vectors of the widest
/// width) and the KV cache of `ctx` positions, for
/// [`NeuronPool::new`] to leave room for. The charges stay exact: a reserve too small makes an
/// upload fail, saying why, not overrun the budget.
fn step_reserve(c: &ModelConfig, attention: &[Attention], head: &Weight, ctx: usize) -> u64 {
    let weights = attention
        .iter()
        .flat_map(|a| [&a.wq, &a.wk, &a.wv, &a.wo])
        .chain([head])
        .map(|w| super::weight_bytes(w) as u64)
        .sum::<u64>();
    let (h, n, layers) = (c.hidden_size, c.intermediate_size, c.num_layers);
    let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let words = 2 * c.vocab_size
        + 4 * layers * kvd
        + 2 * layers * n
        + 24 * h.max(qd).max(n)
        + layers * (qd + 2 * kvd + 4 * h);
    let kv = 2 * layers * kvd * ctx + c.num_heads * ctx;
    weights + 4 * (words + kv) as u64
}

/// Keeps layer `l`'s `parts` (what, start, end) as spans, where they are kept.
fn keep<const N: usize>(
    spans: &mut Option<Vec<GpuSpan>>,
    l: usize,
    parts: [(SpanKind, Instant, Instant); N],
) {
    if let Some(spans) = spans {
        spans.extend(parts.map(|(what, start, end)| GpuSpan {
            layer: Some(l as u32),
            what,
            start,
            end,
        }));
    }
}

/// What the host does in a step, besides writing the token and reading the logits.
pub enum HostFfn<'a> {
    /// Nothing: the whole step is on the GPU.
    None,
    /// Each layer's FFN ([`GpuLayers::upload_attention`]).
    Cpu(CpuFfn<'a>),
    /// Each layer's choice of neurons and their streaming into the GPU's neuron pool
    /// ([`GpuLayers::upload_streamed`]).
    Streamed(&'a mut dyn StreamedFfn),
}

impl HostFfn<'_> {
    /// The same, borrowed again (one step at a time).
    pub fn reborrow(&mut self) -> HostFfn<'_> {
        match self {
            HostFfn::None => HostFfn::None,
            HostFfn::Cpu(cpu) => HostFfn::Cpu(cpu.reborrow()),
            HostFfn::Streamed(engine) => HostFfn::Streamed(&mut **engine),
        }
    }
}

/// A layer of a step whose FFN streams into the neuron pool, as the engine drives it
/// ([`PoolTarget`]).
struct PoolStep<'a> {
    gpu: &'a Gpu,
    pool: &'a mut NeuronPool,
    b: &'a Buffers,
    /// The layer's FFN dispatches.
    dispatches: &'a [Dispatch],
    l: usize,
    /// The residual stream on the host, and the layer's scores read back.
    x: &'a mut Vec<f32>,
    scores: &'a mut Vec<f32>,
    /// When the FFN was submitted and when its results were back.
    ran: Option<(Instant, Instant)>,
}

impl PoolTarget for PoolStep<'_> {
    fn holds(&mut self, key: (u32, u32)) -> bool {
        self.pool.holds(key)
    }

    fn upload(&mut self, key: (u32, u32), rows: &ClusterRows) -> Result<()> {
        self.pool.upload(self.gpu, key, rows)
    }

    fn compute(&mut self, needed: &[usize], candidate: &[bool]) -> Result<&[f32]> {
        let (g, b, l) = (self.gpu, self.b, self.l);
        let n = candidate.len();
        let start = Instant::now();
        self.pool.write_map(g, l, needed, candidate)?;
        let mut enc = g
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            for d in self.dispatches {
                d.record(&mut pass);
            }
        }
        let x_bytes = 4 * self.x.len() as u64;
        let s_bytes = 4 * n as u64;
        enc.copy_buffer_to_buffer(&b.x, 0, &b.readback, 0, x_bytes);
        enc.copy_buffer_to_buffer(&b.scores, l as u64 * s_bytes, &b.readback, x_bytes, s_bytes);
        g.queue.submit([enc.finish()]);
        let (x, scores) = (&mut *self.x, &mut *self.scores);
        scores.resize(n, 0.0);
        g.read_back(&b.readback, x_bytes + s_bytes, |bytes| {
            let (xb, sb) = bytes.split_at(x_bytes as usize);
            read_f32(xb, x);
            read_f32(sb, scores);
        })?;
        self.ran = Some((start, Instant::now()));
        for (i, s) in scores.iter_mut().enumerate() {
            if !self.pool.computed(i) {
                *s = f32::NAN;
            }
        }
        Ok(scores)
    }
}

/// The CPU's half of a step whose FFN runs there: the FFN backend (a streaming model's engine)
/// and the token's scratch.
pub struct CpuFfn<'a> {
    pub backend: &'a mut dyn FfnBackend,
    pub scratch: &'a mut TokenScratch,
}

impl CpuFfn<'_> {
    /// The same, borrowed again (one step at a time).
    pub fn reborrow(&mut self) -> CpuFfn<'_> {
        CpuFfn {
            backend: &mut *self.backend,
            scratch: &mut *self.scratch,
        }
    }
}

/// `act.wgsl`'s and `select.wgsl`'s number for `act`, and its FATReLU threshold.
fn act_params(act: Activation) -> (u32, f32) {
    match act {
        Activation::Silu => (0, 0.0),
        Activation::Relu => (1, 0.0),
        Activation::GeluTanh => (2, 0.0),
        Activation::FatRelu { threshold } => (3, threshold),
        Activation::DRelu => (4, 0.0),
    }
}

/// Up to eight words of a kernel's uniform, zero after them.
fn p8<const N: usize>(words: [u32; N]) -> [u32; 8] {
    let mut p = [0; 8];
    p[..N].copy_from_slice(&words);
    p
}

fn read_f32(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// A hash of the values `cache` stores for its last layer's first KV head at `pos` (read through
/// attention over that one position, whose weight is exactly 1): it tells whether a cache still
/// holds what the GPU's copy was made from.
fn fingerprint(cache: &KvCache, layers: usize, hd: usize, pos: usize) -> u64 {
    thread_local! {
        static ROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    ROW.with_borrow_mut(|row| {
        row.clear();
        row.resize(2 * hd, 0.0);
        let (q, out) = row.split_at_mut(hd);
        let mut score = [0.0];
        cache.attend(layers - 1, 0, pos, pos + 1, q, 1.0, None, &mut score, out);
        let mut h = DefaultHasher::new();
        out.iter().for_each(|v| v.to_bits().hash(&mut h));
        h.finish()
    })
}

impl Gpu {
    /// `f` with the device's out-of-memory and validation errors caught: an error that says what
    /// the GPU reported rather than wgpu's default panic.
    fn scoped<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let memory = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let valid = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let out = f();
        let invalid = pollster::block_on(valid.pop());
        if let Some(e) = pollster::block_on(memory.pop()) {
            bail!("the GPU ran out of memory: {e}");
        }
        if let Some(e) = invalid {
            bail!("the GPU refused a buffer or binding: {e}");
        }
        out
    }

    /// A storage buffer holding `data`.
    fn storage_init(&self, label: &str, data: &[f32]) -> wgpu::Buffer {
        let data = if data.is_empty() { &[0.0][..] } else { data };
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: f32_bytes(data),
                usage: wgpu::BufferUsages::STORAGE,
            })
    }

    /// A zeroed storage buffer of `words` f32s that can be written and copied from.
    fn scratch(&self, label: &str, words: usize) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: 4 * words.max(1) as u64,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    }
}

/// `x`'s q8 form as `q8.wgsl` makes it on the GPU, in `common.wgsl`'s words: what a test compares
/// with the CPU's.
#[cfg(test)]
pub(super) fn quantize_on(gpu: &Gpu, x: &[f32]) -> Result<Vec<u32>> {
    let blocks = x.len() / BLOCK_LEN;
    let words = input_words(QuantType::Q8_0, x.len());
    let input = gpu.storage_init("x", x);
    let out = gpu.scratch("q8", words);
    let readback = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("readback"),
        size: 4 * words as u64,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let q8 = gpu.kernel("q8", Q8)?;
    let scales = (x.len() / 4) as u32;
    let d = gpu.dispatch(
        "q8",
        &q8,
        &[&input, &out],
        &p8([blocks as u32, scales, scales + blocks as u32]),
        (blocks.div_ceil(64) as u32, 1),
    );
    let mut enc = gpu
        .device
        .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
    {
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
        d.record(&mut pass);
    }
    enc.copy_buffer_to_buffer(&out, 0, &readback, 0, None);
    gpu.queue.submit([enc.finish()]);
    let slice = readback.slice(..);
    slice.map_async(wgpu::MapMode::Read, |_| ());
    gpu.device.poll(wgpu::PollType::wait_indefinitely())?;
    let view = slice.get_mapped_range()?;
    Ok(view
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}
