//! A converted mixture of experts run under `--memory` (and, with room for every expert, as
//! `--policy resident`): the embeddings and attention resident as stored (their encoded bytes, run
//! by the quantized kernels; f32 files as f32), the norms, routers and any dense FFN layer as f32,
//! the experts on flash, read whole through the read queue into an expert cache ([`cache`]) as the exact
//! routing needs them and speculatively from the next layer's router ([`stream`]); the budget
//! sets the cache's slots ([`budget`]).

mod budget;
mod cache;
mod metrics;
mod stream;

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use leanstream_format::quant::QuantType;
use leanstream_format::LsbFile;

use crate::config::ModelConfig;
use crate::kernels::{Matrix, QMatrix, Weight};
use crate::kv_cache::{KvCache, KvType};
use crate::lsb_dense;
use crate::model::{router_tensor_name, DenseFfn, LanguageModel, Model};
use crate::storage::{open_device, FlashProfile, IoQueue};
pub use budget::ExpertSplit;
pub use metrics::ExpertSummary;
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
}

/// A mixture of experts whose experts stream from flash.
pub struct ExpertModel {
    model: Model,
    stream: ExpertStream,
    pub split: ExpertSplit,
    pub budget: Option<u64>,
    started: Instant,
    tokens: u64,
}

/// The most prompt tokens one forward call computes (the scratch is sized for it).
const CHUNK: usize = crate::generate::PROMPT_CHUNK;

/// The budget split for `file` at `o`'s context (refused below the minimum, naming it).
fn plan(file: &LsbFile, o: &ExpertOptions) -> Result<ExpertSplit> {
    let c = &file.meta.model;
    let moe = c.moe.as_ref().context("not a mixture of experts")?;
    let f32_bytes = |n: usize| 4 * n as u64;
    let dense: u64 = file
        .dense
        .tensors
        .iter()
        .map(|t| {
            if kept_encoded(t) {
                t.size
            } else {
                f32_bytes(t.rows() * t.cols())
            }
        })
        .sum();
    let dense_ffn: u64 = (0..c.num_layers)
        .filter(|&l| !c.is_moe_layer(l))
        .map(|_| f32_bytes(3 * c.intermediate_size * c.hidden_size))
        .sum();
    let (h, n, e, k) = (
        c.hidden_size,
        moe.expert_intermediate_size,
        moe.num_experts,
        moe.experts_per_token,
    );
    // Routing and running a chunk's experts, and the one expert decoded at a time.
    let moe_scratch = f32_bytes(CHUNK * (e + 2 * k + 3 * h + 2 * n) + 3 * n * h + h);
    let fixed = crate::streaming::planner::baseline_overhead(o.tokenizer_bytes)
        + dense
        + dense_ffn
        + KvCache::bytes_for(c, o.ctx, o.kv) as u64
        + crate::streaming::planner::scratch_bytes(c, CHUNK)
        + moe_scratch;
    let experts = file.experts.layers.iter().map(Vec::len).sum();
    let expert_bytes = (0..file.experts.layers.len())
        .flat_map(|l| (0..file.experts.layers[l].len()).map(move |e| (l, e)))
        .map(|(l, e)| file.expert_extent(l, e).1)
        .max()
        .unwrap_or(0);
    budget::split(
        fixed,
        expert_bytes,
        experts,
        k,
        o.memory,
        &file.path.display().to_string(),
    )
}

/// The least `--memory` a streamed run of the mixture at `path` accepts at `ctx` with KV storage
/// `kv`: the fixed part and [`ExpertSplit::min_slots`] expert slots.
pub fn minimum_memory(path: &Path, ctx: usize, kv: KvType) -> Result<u64> {
    let file = LsbFile::open(path)?;
    let o = ExpertOptions {
        memory: None,
        flash: None,
        ctx,
        kv,
        tokenizer_bytes: crate::tokenizer::resident_bytes(&file)?,
        lookahead: true,
    };
    let split = plan(&file, &o)?;
    let k = split.speculative;
    Ok(split.fixed + ExpertSplit::min_slots(k) as u64 * split.expert_bytes)
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
/// FFN layer) decoded to f32 as [`lsb_dense::tensors`] gives them.
fn resident_tensors(file: &LsbFile) -> Result<(lsb_dense::Tensors, EncodedTensors)> {
    let path = &file.path;
    let mut f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut encoded = EncodedTensors::new();
    for t in file.dense.tensors.iter().filter(|t| kept_encoded(t)) {
        let bytes = file.read_dense(&mut f, t)?;
        let shape = t.shape.iter().map(|&d| d as usize).collect();
        encoded.insert(t.name.clone(), (shape, t.qtype, bytes));
    }
    let decoded = lsb_dense::tensors_except(file, &|name| encoded.contains_key(name))?;
    Ok((decoded, encoded))
}

impl ExpertModel {
    /// Opens `file` (read from `path`): refuses a budget below the minimum, loads the resident
    /// part, and fills the expert cache with the profile's most chosen experts.
    pub fn open(path: &Path, file: LsbFile, o: &ExpertOptions) -> Result<Self> {
        let split = plan(&file, o)?;
        let config: ModelConfig = file.meta.model.clone();
        let moe = config.moe.clone().context("not a mixture of experts")?;
        let (decoded, encoded) = resident_tensors(&file)?;
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
                return Ok(Weight::Encoded(QMatrix::new(rows, cols, qtype, bytes)?));
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
        let model = Model::without_ffn(config.clone(), take, mat)?.with_kv(o.kv);
        drop(tensors);
        drop(encoded);
        crate::memory::release_freed_memory();
        let device = open_device(path, o.flash.clone())
            .with_context(|| format!("cannot open {} for streaming", path.display()))?;
        let mut stream = ExpertStream::new(
            layers,
            &config,
            path.to_path_buf(),
            IoQueue::new(device),
            split.slots,
            if o.lookahead { split.speculative } else { 0 },
            &prior,
            CHUNK,
        );
        // The hot set: the profile's most chosen experts first (ties to the lower id).
        let mut order: Vec<usize> = (0..prior.len()).filter(|&i| prior[i] > 0.0).collect();
        order.sort_by(|&a, &b| prior[b].total_cmp(&prior[a]).then(a.cmp(&b)));
        stream.warm(&order)?;
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
            split,
            budget: o.memory,
            started: Instant::now(),
            tokens: 0,
        })
    }

    /// The expert figures since the last [`reset_clock`](Self::reset_clock).
    pub fn summary(&self) -> ExpertSummary {
        self.stream
            .counters
            .summary(self.tokens, self.started.elapsed().as_secs_f64())
    }

    /// Starts counting tokens, time and reads afresh.
    pub fn reset_clock(&mut self) {
        self.started = Instant::now();
        self.tokens = 0;
        self.stream.reset_counters();
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
        self.model.forward_with(
            tokens,
            cache,
            all_logits,
            Some(&mut self.stream),
            None,
            logits,
        )
    }
}
