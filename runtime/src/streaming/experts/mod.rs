//! A converted mixture of experts run under `--memory` (and, with room for every expert, as
//! `--policy resident`): the embeddings and attention resident as stored (their encoded bytes, run
//! by the quantized kernels; f32 files as f32), the norms, routers and any dense FFN layer as f32,
//! the experts on flash, read whole through the read queue into an expert cache ([`cache`]) as the exact
//! routing needs them and speculatively from the next layer's router ([`stream`]); the budget
//! sets the cache's slots ([`budget`]).

mod budget;
mod cache;
mod metrics;
mod oracle;
mod stream;

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use leanstream_format::quant::QuantType;
use leanstream_format::LsbFile;

use crate::kernels::{Matrix, QMatrix, Weight};
use crate::model::kv_cache::{KvCache, KvType};
use crate::model::{router_tensor_name, DenseFfn, DenseWeights, LanguageModel, Model};
use crate::source::config::ModelConfig;
use crate::source::lsb_dense;
use crate::storage::{open_device, FlashProfile, IoQueue};
use crate::streaming::dense_stream::{DenseStream, DenseTensors};
use crate::streaming::planner::{DenseSizes, DenseStreamed};
pub use budget::ExpertSplit;
pub use metrics::ExpertSummary;
pub use oracle::ExpertTrace;
use stream::{ExpertStream, LayerFfn, MixtureLayer};

/// How to open a streamed mixture.
#[derive(Clone, Debug)]
pub struct ExpertOptions {
    /// The hard cap on the process's memory; `None` = room for every expert.
    pub memory: Option<u64>,
    /// `None` reads the real file with direct I/O.
    pub flash: Option<FlashProfile>,
    pub ctx: usize,
    pub kv: KvType,
    /// What the caller's tokenizer holds.
    pub tokenizer_bytes: u64,
    /// Speculate with the next layer's router (`--no-lookahead` turns it off: the ablation).
    pub lookahead: bool,
    /// The expert oracle's knowledge (`bench`): the true experts of the tokens to come.
    pub oracle: Option<Arc<ExpertTrace>>,
}

/// A mixture of experts whose experts stream from flash.
pub struct ExpertModel {
    model: Model,
    stream: ExpertStream,
    /// The embedding, attention and head when the budget streams some of them.
    dense: Option<DenseStream>,
    /// Dense bytes read before the measured run.
    dense_base: u64,
    pub split: ExpertSplit,
    pub budget: Option<u64>,
    started: Instant,
    tokens: u64,
}

/// The most prompt tokens one forward call computes (the scratch is sized for it).
const CHUNK: usize = crate::text::generate::PROMPT_CHUNK;

/// The planner's input for `file` at `depth` layers: the file's own when `depth` is its layer
/// count; deeper, layer `d` a copy of the file's layer `d mod layers` (for a uniform shape such as
/// `synth`'s, what the full-depth file would need: its tensors, KV cache and experts).
fn plan_input(
    file: &LsbFile,
    tokenizer_bytes: u64,
    ctx: usize,
    kv: KvType,
    depth: usize,
) -> Result<budget::PlanInput> {
    let c = &file.meta.model;
    let moe = c.moe.as_ref().context("not a mixture of experts")?;
    let layers = c.num_layers.max(1);
    // How many of the `depth` layers copy the file's layer `l`.
    let copies = |l: usize| ((depth + layers - 1).saturating_sub(l) / layers) as u64;
    let times = |name: &str| {
        name.strip_prefix("model.layers.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|l| l.parse::<usize>().ok())
            .map_or(1, copies)
    };
    let f32_bytes = |n: usize| 4 * n as u64;
    // As held in memory: encoded as stored, or decoded to f32.
    let held = |t: &leanstream_format::dense::DenseTensor| {
        if kept_encoded(t) {
            t.size
        } else {
            f32_bytes(t.rows() * t.cols())
        }
    };
    let (mut dense, mut attention, mut other) = (0, 0, 0);
    for t in &file.dense.tensors {
        let n = times(&t.name);
        if is_attention_projection(&t.name) {
            attention += n * t.size;
            dense += n * held(t);
        } else if t.name == "model.embed_tokens.weight" || t.name == "lm_head.weight" {
            dense += n * held(t);
        } else {
            other += n * held(t);
        }
    }
    let sizes = DenseSizes {
        attention,
        ..DenseTensors::open(file)?.sizes(c)?
    };
    let dense_layers = (0..depth).filter(|&d| !c.is_moe_layer(d % layers)).count();
    let dense_ffn = dense_layers as u64 * f32_bytes(3 * c.intermediate_size * c.hidden_size);
    let (h, n, e, k) = (
        c.hidden_size,
        moe.expert_intermediate_size,
        moe.num_experts,
        moe.experts_per_token,
    );
    // Routing and running a chunk's experts, and the one expert decoded at a time where experts
    // are not run where they lie (f32 files).
    let decoded = if decodes_experts(file) { 3 * n * h } else { 0 };
    let moe_scratch = f32_bytes(CHUNK * (e + 2 * k + 3 * h + 2 * n) + decoded + h);
    // The model's scratch; without a dense FFN layer its FFN activations are never written (every
    // FFN runs in the expert stream), so they take no memory.
    let mut shape = c.clone();
    shape.num_layers = depth;
    if dense_layers == 0 {
        shape.intermediate_size = 0;
    }
    let base = crate::streaming::planner::baseline_overhead(tokenizer_bytes)
        + other
        + dense_ffn
        + KvCache::bytes_for(&shape, ctx, kv) as u64
        + crate::streaming::planner::scratch_bytes(&shape, CHUNK)
        + moe_scratch;
    let experts = (0..file.experts.layers.len())
        .map(|l| copies(l) * file.experts.layers[l].len() as u64)
        .sum::<u64>() as usize;
    let expert_bytes = (0..file.experts.layers.len())
        .flat_map(|l| (0..file.experts.layers[l].len()).map(move |e| (l, e)))
        .map(|(l, e)| file.expert_extent(l, e).1)
        .max()
        .unwrap_or(0);
    Ok(budget::PlanInput {
        base,
        dense,
        sizes,
        expert_bytes,
        experts,
        k,
    })
}

/// A query, key, value or output projection (FORMAT.md §5.3 names).
fn is_attention_projection(name: &str) -> bool {
    name.contains(".self_attn.")
        && ["q_proj", "k_proj", "v_proj", "o_proj"]
            .iter()
            .any(|p| name.ends_with(&format!(".{p}.weight")))
}

/// Whether some expert is stored in a type the bundle kernel does not run (f32, f16, bf16): it is
/// decoded to f32 matrices to run.
fn decodes_experts(file: &LsbFile) -> bool {
    file.experts
        .layers
        .iter()
        .flatten()
        .any(|x| !x.qtypes.all_block())
}

/// The budget split for `file` at `o`'s context (refused below the minimum, naming it).
fn plan(file: &LsbFile, o: &ExpertOptions) -> Result<ExpertSplit> {
    let input = plan_input(
        file,
        o.tokenizer_bytes,
        o.ctx,
        o.kv,
        file.meta.model.num_layers,
    )?;
    budget::split(&input, o.memory, &file.path.display().to_string())
}

/// The least `--memory` a streamed run of the mixture at `path` accepts at `ctx` with KV storage
/// `kv`: every dense weight streamed and [`ExpertSplit::min_slots`] expert slots.
pub fn minimum_memory(path: &Path, ctx: usize, kv: KvType) -> Result<u64> {
    let file = LsbFile::open(path)?;
    minimum_memory_at_depth(path, ctx, kv, file.meta.model.num_layers)
}

/// [`minimum_memory`] of the same shape at `depth` layers, layer `d` a copy of the file's layer
/// `d mod layers`: what the planner would state for the full-depth file of a shape written with
/// `synth --layers` (whose layers are alike), without writing it.
pub fn minimum_memory_at_depth(path: &Path, ctx: usize, kv: KvType, depth: usize) -> Result<u64> {
    Ok(split_at_depth(path, ctx, kv, depth, None)?.minimum)
}

/// The planner's split of `budget` (`None`: room for everything) for the shape of the mixture at
/// `path` at `depth` layers, deepened as [`minimum_memory_at_depth`] says.
pub fn split_at_depth(
    path: &Path,
    ctx: usize,
    kv: KvType,
    depth: usize,
    budget: Option<u64>,
) -> Result<ExpertSplit> {
    let file = LsbFile::open(path)?;
    let tokenizer = crate::tokenizer::resident_bytes(&file)?;
    let input = plan_input(&file, tokenizer, ctx, kv, depth)?;
    budget::split(&input, budget, &path.display().to_string())
}

/// Whether a dense tensor stays encoded in memory: a matrix stored in a quantized type, except
/// a router (kept f32 by the writer: a rounding would change which experts run).
fn kept_encoded(t: &leanstream_format::dense::DenseTensor) -> bool {
    t.qtype != QuantType::F32
        && t.shape.len() == 2
        // A router: FORMAT.md §5.3 names it `model.layers.{l}.mlp.gate.weight`.
        && !t.name.ends_with(".mlp.gate.weight")
}

/// The dense tensors [`kept_encoded`], by Hugging Face name: shape, type and stored bytes.
type EncodedTensors = HashMap<String, (Vec<usize>, QuantType, Vec<u8>)>;

/// Splits `file`'s dense tensors: those [`kept_encoded`] as their bytes, the rest (and any dense
/// FFN layer) decoded to f32 as [`lsb_dense::tensors`] gives them. With `streamed`, the embedding,
/// attention projections and head are left out (a [`DenseStream`] holds them).
fn resident_tensors(
    file: &LsbFile,
    streamed: bool,
) -> Result<(lsb_dense::Tensors, EncodedTensors)> {
    let path = &file.path;
    let skip = |name: &str| {
        streamed
            && (is_attention_projection(name)
                || name == "model.embed_tokens.weight"
                || name == "lm_head.weight")
    };
    let mut f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut encoded = EncodedTensors::new();
    for t in file
        .dense
        .tensors
        .iter()
        .filter(|t| kept_encoded(t) && !skip(&t.name))
    {
        let bytes = file.read_dense(&mut f, t)?;
        let shape = t.shape.iter().map(|&d| d as usize).collect();
        encoded.insert(t.name.clone(), (shape, t.qtype, bytes));
    }
    let decoded =
        lsb_dense::tensors_except(file, &|name| encoded.contains_key(name) || skip(name))?;
    Ok((decoded, encoded))
}

impl ExpertModel {
    /// Opens `file` (read from `path`): refuses a budget below the minimum, loads the resident
    /// part, and fills the expert cache with the profile's most chosen experts.
    pub fn open(path: &Path, file: LsbFile, o: &ExpertOptions) -> Result<Self> {
        let split = plan(&file, o)?;
        let config: ModelConfig = file.meta.model.clone();
        let moe = config.moe.clone().context("not a mixture of experts")?;
        let streams = split.dense_streamed != DenseStreamed::default();
        let (decoded, encoded) = resident_tensors(&file, streams)?;
        let tensors = RefCell::new(decoded);
        let encoded = RefCell::new(encoded);
        let take = |name: &str, shape: &[usize]| lsb_dense::take(&tensors, &file, name, shape);
        let mat = |name: &str, rows: usize, cols: usize| -> Result<Weight> {
            if let Some((shape, qtype, bytes)) = encoded.borrow_mut().remove(name) {
                if shape != [rows, cols] {
                    bail!(
                        "{}: tensor {name} has shape {shape:?}, the config implies {:?}",
                        path.display(),
                        [rows, cols]
                    );
                }
                return Ok(Weight::Encoded(
                    QMatrix::new(rows, cols, qtype, bytes)?.in_groups(),
                ));
            }
            Ok(Weight::F32(Matrix::new(
                rows,
                cols,
                take(name, &[rows, cols])?,
            )))
        };
        let (h, n) = (config.hidden_size, config.intermediate_size);
        let mut layers = Vec::with_capacity(config.num_layers);
        let mut prior = vec![0.0f32; config.num_layers * moe.num_experts];
        for l in 0..config.num_layers {
            let p = format!("model.layers.{l}");
            if !config.is_moe_layer(l) {
                layers.push(LayerFfn::Dense(DenseFfn {
                    gate: mat(&format!("{p}.mlp.gate_proj.weight"), n, h)?,
                    up: mat(&format!("{p}.mlp.up_proj.weight"), n, h)?,
                    down: mat(&format!("{p}.mlp.down_proj.weight"), h, n)?,
                }));
                continue;
            }
            let norm = format!("{p}.post_attention_layernorm.weight");
            let ffn_norm = tensors
                .borrow()
                .get(&norm)
                .map(|(_, v)| v.clone())
                .with_context(|| format!("{}: tensor {norm} is missing", path.display()))?;
            let experts = file.experts.layers[l].clone();
            let extents = (0..experts.len())
                .map(|e| file.expert_extent(l, e))
                .collect();
            if let Some(r) = &file.meta.layers[l].routing {
                let first = l * moe.num_experts;
                prior[first..first + r.expert_freq.len()].copy_from_slice(&r.expert_freq);
            }
            layers.push(LayerFfn::Mixture(MixtureLayer {
                router: mat(
                    &router_tensor_name(config.architecture, l),
                    moe.num_experts,
                    h,
                )?,
                ffn_norm,
                experts,
                extents,
            }));
        }
        let model = if streams {
            Model::norms_only(config.clone(), take)?
        } else {
            Model::without_ffn(config.clone(), take, mat)?
        }
        .with_kv(o.kv);
        drop(tensors);
        drop(encoded);
        crate::platform::memory::release_freed_memory();
        let device = open_device(path, o.flash.clone())
            .with_context(|| format!("cannot open {} for streaming", path.display()))?;
        let io = Arc::new(IoQueue::new(device));
        // Where the budget streams dense weights, all of them come through the dense stream (the
        // resident ones read whole once, checked): the same encoded bytes and kernels as resident.
        let dense = if streams {
            let t = DenseTensors::open(&file)?;
            Some(DenseStream::open(
                &t,
                &config,
                split.dense_streamed,
                Arc::clone(&io),
            )?)
        } else {
            None
        };
        let mut stream = ExpertStream::new(
            layers,
            &config,
            path.to_path_buf(),
            io,
            split.slots,
            if o.lookahead { split.speculative } else { 0 },
            &prior,
            CHUNK,
        );
        // The hot set: the profile's most chosen experts first (ties to the lower id).
        let mut order: Vec<usize> = (0..prior.len()).filter(|&i| prior[i] > 0.0).collect();
        order.sort_by(|&a, &b| prior[b].total_cmp(&prior[a]).then(a.cmp(&b)));
        stream.warm(&order)?;
        if let Some(trace) = &o.oracle {
            let layers = config.num_layers;
            stream.set_oracle(oracle::Oracle::new(
                Arc::clone(trace),
                layers,
                moe.num_experts,
            ));
        }
        #[cfg(target_os = "linux")]
        if o.flash.is_none() {
            // Every later read is direct: what opening read through the page cache would be
            // memory outside the budget.
            crate::storage::page_cache::forget(path)
                .with_context(|| format!("cannot drop {} from the page cache", path.display()))?;
        }
        Ok(Self {
            model,
            stream,
            dense,
            dense_base: 0,
            split,
            budget: o.memory,
            started: Instant::now(),
            tokens: 0,
        })
    }

    /// The expert figures since the last [`reset_clock`](Self::reset_clock).
    pub fn summary(&self) -> ExpertSummary {
        let mut s = self
            .stream
            .counters
            .summary(self.tokens, self.started.elapsed().as_secs_f64());
        let dense = self.dense_read() - self.dense_base;
        s.dense_bytes_read_per_token = dense as f64 / self.tokens.max(1) as f64;
        s.bytes_read_per_token += s.dense_bytes_read_per_token;
        s
    }

    fn dense_read(&self) -> u64 {
        self.dense.as_ref().map_or(0, |d| d.counters().0)
    }

    /// Starts counting tokens, time and reads afresh.
    pub fn reset_clock(&mut self) {
        self.started = Instant::now();
        self.tokens = 0;
        self.stream.reset_counters();
        self.dense_base = self.dense_read();
    }

    /// The read queue.
    pub fn io(&self) -> &IoQueue {
        self.stream.io()
    }
}

impl LanguageModel for ExpertModel {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn new_cache(&self, ctx: usize) -> KvCache {
        self.model.new_cache(ctx)
    }

    fn prompt_chunk(&self) -> usize {
        CHUNK
    }

    fn scores_by_decoding(&self) -> bool {
        true
    }

    fn forward_into(
        &mut self,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        if tokens.len() > CHUNK {
            return super::forward_in_chunks(tokens, CHUNK, all_logits, logits, |chunk, logits| {
                self.forward_into(chunk, cache, all_logits, logits)
            });
        }
        self.tokens += tokens.len() as u64;
        self.stream.position = cache.len();
        self.model.forward_with(
            tokens,
            cache,
            all_logits,
            Some(&mut self.stream),
            self.dense.as_mut().map(|d| d as &mut dyn DenseWeights),
            logits,
        )
    }
}
