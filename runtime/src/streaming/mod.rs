//! The streaming runtime: a converted file run under a memory budget, its FFN bundles read from
//! flash by the speculate-and-refine engine, everything else resident.

mod engine;
mod metrics;
mod plan;
pub mod planner;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use leanstream_format::quant::dequantize_row;
use leanstream_format::LsbFile;

use crate::config::ModelConfig;
use crate::kernels::{QMatrix, Weight};
use crate::kv_cache::KvCache;
use crate::model::Model;
use crate::neuron_cache::{NeuronCache, Retention};
use crate::storage::{open_device, Device, FlashProfile, IoQueue, IoStats};

pub use engine::{Bytes, Sparsity, StreamEngine};
pub use metrics::Summary;
pub use planner::MemorySplit;

/// Which engine runs the FFNs of a converted file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Speculate-and-refine streaming under the memory budget.
    Leanstream,
    /// Every bundle resident, the file's sparsity applied, no I/O during generation.
    Resident,
}

#[derive(Debug, Clone)]
pub struct StreamOptions {
    pub policy: Policy,
    pub sparsity: Sparsity,
    /// The hard cap on peak RSS; `None` = large enough for everything.
    pub memory: Option<u64>,
    /// `None` reads the real file with direct I/O.
    pub flash: Option<FlashProfile>,
    pub ctx: usize,
    pub lookahead: bool,
    pub retention: Retention,
}

/// A converted model ready to generate under a budget.
pub struct StreamingModel {
    model: Model,
    engine: StreamEngine,
    pub split: MemorySplit,
    pub budget: Option<u64>,
    started: Instant,
    tokens: u64,
    /// I/O counters at the start of the measured run (start-up reads excluded).
    io_base: (u64, u64, std::time::Duration),
}

impl StreamingModel {
    /// Opens `file` (read from `path`) to stream its bundles from the device `opts.flash` names.
    pub fn open(path: &Path, file: LsbFile, opts: &StreamOptions) -> Result<Self> {
        let device = open_device(path, opts.flash.clone())
            .with_context(|| format!("cannot open {} for streaming", path.display()))?;
        Self::open_on(file, device, opts)
    }

    /// Like [`StreamingModel::open`], streaming from `device`, which must hold `file`'s bytes
    /// (tests pass a [`crate::storage::FaultyDevice`]); `opts.flash` is not used.
    pub fn open_on(
        mut file: LsbFile,
        device: Arc<dyn Device>,
        opts: &StreamOptions,
    ) -> Result<Self> {
        let config = file.meta.model.clone();
        let plans = plan::LayerPlan::all(&mut file)?;
        let (input, io_budget) = plan_input(&file, &plans, opts.ctx, opts.memory, opts.policy);
        let split = planner::plan(input)?;
        let model = dense_model(&file, config.clone())?;
        let sparsity = if opts.policy == Policy::Resident {
            Sparsity::Exact
        } else {
            opts.sparsity
        };
        let cache = NeuronCache::new(split.neuron_cache, opts.retention);
        let hot = hot_order(&plans);
        let mut engine = StreamEngine::new(
            plans,
            config.activation,
            sparsity,
            IoQueue::new(device),
            cache,
            io_budget,
            opts.lookahead,
        );
        pin_hot_set(&mut engine, &file, &hot, opts.policy, split.neuron_cache)?;
        Ok(Self {
            model,
            engine,
            split,
            budget: opts.memory,
            started: Instant::now(),
            tokens: 0,
            io_base: (0, 0, std::time::Duration::ZERO),
        })
    }

    /// Figures of the run so far (call after generation).
    pub fn summary(&self) -> Summary {
        let (bytes, reads, busy) = self.io_counters();
        let wall = self.started.elapsed().as_secs_f64();
        self.engine.metrics.summary(
            self.tokens,
            bytes - self.io_base.0,
            reads - self.io_base.1,
            (busy - self.io_base.2).as_secs_f64() / wall.max(1e-9),
            wall,
        )
    }

    /// Starts counting tokens, time and I/O afresh (after the start-up reads).
    pub fn reset_clock(&mut self) {
        self.started = Instant::now();
        self.tokens = 0;
        self.io_base = self.io_counters();
        self.engine.metrics = Default::default();
    }

    /// The read queue's counters since start-up (retries and failures included).
    pub fn io_stats(&self) -> IoStats {
        self.engine.io().stats()
    }

    fn io_counters(&self) -> (u64, u64, std::time::Duration) {
        let s = self.engine.io().stats();
        (s.bytes_read, s.device_reads, s.busy)
    }
}

impl crate::model::LanguageModel for StreamingModel {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn forward(
        &mut self,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
    ) -> Result<Vec<f32>> {
        self.tokens += tokens.len() as u64;
        self.model
            .forward_with(tokens, cache, all_logits, Some(&mut self.engine))
    }
}

/// What the planner needs to know about a file; also returns the speculation I/O budget.
fn plan_input(
    file: &LsbFile,
    plans: &[plan::LayerPlan],
    ctx: usize,
    budget: Option<u64>,
    policy: Policy,
) -> (planner::PlanInput, u64) {
    let sizes = || plans.iter().flat_map(|p| p.clusters.iter().map(|c| c.size));
    let max_cluster = sizes().max().unwrap_or(0);
    // Speculation may keep about one layer's FFN in flight (more only waits in the queue).
    let layer_max = plans
        .iter()
        .map(|p| p.clusters.iter().map(|c| c.size).sum::<u64>())
        .max()
        .unwrap_or(0);
    let io_budget = layer_max.clamp(4 * max_cluster, 64 << 20);
    let config = &file.meta.model;
    let input = planner::PlanInput {
        budget,
        overhead: planner::baseline_overhead(file.tokenizer_json.len() as u64),
        dense: file.dense.data_bytes(),
        kv_cache: KvCache::bytes_for(config, ctx) as u64,
        resident_state: plans.iter().map(|p| p.resident_bytes()).sum(),
        // Speculative reads for the next layer while this layer's own reads are in flight.
        io_buffers: 2 * io_budget,
        scratch: planner::scratch_bytes(config),
        ffn: sizes().sum(),
        needs_all_ffn: policy == Policy::Resident,
        ctx,
    };
    (input, io_budget)
}

/// The smallest `--memory` the `leanstream` policy accepts for `file` at `ctx` (the neuron cache
/// empty: every bundle streams).
pub fn minimum_memory(path: &Path, ctx: usize) -> Result<u64> {
    let mut file = LsbFile::open(path)?;
    let plans = plan::LayerPlan::all(&mut file)?;
    let (input, _) = plan_input(&file, &plans, ctx, None, Policy::Leanstream);
    Ok(planner::plan(input)?.fixed())
}

/// The non-FFN weights as stored (encoded rows stay encoded; norms are f32).
fn dense_model(file: &LsbFile, config: ModelConfig) -> Result<Model> {
    let mut f = std::fs::File::open(&file.path)
        .with_context(|| format!("cannot open {}", file.path.display()))?;
    let mut tensors = std::collections::HashMap::new();
    for t in &file.dense.tensors {
        tensors.insert(t.name.clone(), (t, file.read_dense(&mut f, t)?));
    }
    let tensors = std::cell::RefCell::new(tensors);
    let take = |name: &str| {
        tensors
            .borrow_mut()
            .remove(name)
            .with_context(|| format!("{}: tensor {name} is missing", file.path.display()))
    };
    Model::without_ffn(
        config,
        |name, shape| {
            let (t, bytes) = take(name)?;
            if t.shape
                .iter()
                .map(|&d| d as usize)
                .ne(shape.iter().copied())
            {
                bail!(
                    "{}: tensor {name} has shape {:?}, the config implies {shape:?}",
                    file.path.display(),
                    t.shape
                );
            }
            let mut v = vec![0.0f32; shape.iter().product()];
            dequantize_row(t.qtype, &bytes, &mut v)?;
            Ok(v)
        },
        |name, rows, cols| {
            let (t, bytes) = take(name)?;
            if t.rows() != rows || t.cols() != cols {
                bail!(
                    "{}: tensor {name} is {:?}, the config implies [{rows}, {cols}]",
                    file.path.display(),
                    t.shape
                );
            }
            Ok(Weight::Encoded(QMatrix::new(rows, cols, t.qtype, bytes)?))
        },
    )
}

/// Every cluster as `(profile frequency, layer, cluster)`, most frequently active first.
fn hot_order(plans: &[plan::LayerPlan]) -> Vec<(f32, usize, usize)> {
    let mut order: Vec<(f32, usize, usize)> = Vec::new();
    for (l, p) in plans.iter().enumerate() {
        for (c, &f) in p.refine.cluster_freq.iter().enumerate() {
            order.push((f, l, c));
        }
    }
    order.sort_by(|a, b| b.0.total_cmp(&a.0));
    order
}

/// Pins clusters before the first token: for `resident`, every cluster; for `leanstream`, the
/// profile's hottest clusters (by activation frequency) up to half the cache, so the dynamic part
/// keeps room for what tokens turn out to use.
fn pin_hot_set(
    engine: &mut StreamEngine,
    file: &LsbFile,
    order: &[(f32, usize, usize)],
    policy: Policy,
    capacity: u64,
) -> Result<()> {
    let limit = match policy {
        Policy::Resident => capacity,
        Policy::Leanstream => capacity / 2,
    };
    let mut used = 0u64;
    for &(freq, l, c) in order {
        let (_, size) = file.cluster_extent(l, c);
        if used + size > limit {
            if policy == Policy::Resident {
                bail!("the resident policy needs every bundle in DRAM; raise --memory");
            }
            continue;
        }
        let buf = engine.read_now(l, c)?;
        used += size;
        engine.pin(l, c, Bytes::Read(buf), freq);
    }
    Ok(())
}
