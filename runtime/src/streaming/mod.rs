//! The streaming runtime: a converted file run under a memory budget, its FFN bundles read from
//! flash by the speculate-and-refine engine, the dense weights resident or, under a budget too
//! small for them, streamed too ([`DenseStream`]).

pub mod certify;
pub mod neuron_cache;
pub mod skip_rule;
pub mod slot_heap;

mod dense_stream;
mod engine;
pub mod experts;
mod leanstream;
pub mod llm_in_flash;
mod metrics;
mod mmap;
mod oracle;
pub(crate) mod plan;
pub mod planner;
pub mod powerinfer2;
mod predict;
mod refill;
pub mod refine_sketch;
mod schedule;
mod speculation_gate;
mod trace;
mod tuning;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use leanstream_format::LsbFile;

use crate::model::kv_cache::{KvCache, KvLedger, KvType, RESERVE_STEP};
use crate::model::Model;
use crate::platform::elastic::BudgetWatch;
use crate::source::config::ModelConfig;
use crate::storage::{open_device, Device, FlashProfile, IoQueue};
use crate::streaming::neuron_cache::{ClusterSlots, NeuronCache, Retention};

pub use dense_stream::DenseStream;
use dense_stream::DenseTensors;
pub use engine::{Bytes, Sparsity, StreamEngine};
pub use metrics::{BudgetChange, Summary};
pub use planner::MemorySplit;
pub use predict::{default_predictor_rank, predictor_bytes, PREDICTOR_SHARE};
pub use trace::ActiveTrace;
pub use tuning::Tuning;

/// Which engine runs the FFNs of a converted file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Speculate-and-refine streaming under the memory budget.
    Leanstream,
    /// Every bundle resident, the file's sparsity applied, no I/O during generation.
    Resident,
    /// Every bundle resident and every neuron computed: the same bytes without sparsity.
    Dense,
    /// The file memory-mapped, the OS paging (llama.cpp-like).
    Mmap,
    /// PowerInfer-2's published design.
    PowerInfer2,
    /// LLM in a Flash's published design.
    LlmInFlash,
    /// The true active sets known in advance, Belady eviction: the limit.
    Oracle,
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
    /// Where the context was not asked for: it may shrink down to this to fit `memory`.
    pub ctx_floor: Option<usize>,
    /// How the KV cache stores keys and values (the planner reserves its bytes).
    pub kv: KvType,
    /// What the caller's loaded tokenizer holds ([`crate::tokenizer::Tokenizer::resident_bytes`]);
    /// `None` works it out from the file (reading its compact tables once more).
    pub tokenizer_bytes: Option<u64>,
    pub tuning: Tuning,
}

/// A converted model ready to generate under a budget.
pub struct StreamingModel {
    /// The norms; the projections come from `dense`.
    model: Model,
    dense: DenseStream,
    engine: StreamEngine,
    pub split: MemorySplit,
    pub budget: Option<u64>,
    replan_input: planner::PlanInput,
    /// Where new budgets come from while the model runs (`--memory-file`, `--memory auto`).
    watch: Option<BudgetWatch>,
    budget_changes: Vec<BudgetChange>,
    policy: Policy,
    /// The context planned: `StreamOptions::ctx`, or less where it did not fit the budget.
    pub ctx: usize,
    /// The most prompt tokens a forward call computes at once (its scratch is planned for it).
    prompt_chunk: usize,
    kv: KvType,
    /// The pages the caches this model made ([`crate::model::LanguageModel::new_cache`]) may have
    /// committed.
    kv_ledger: Arc<KvLedger>,
    /// The planned KV bytes no cache has reached, lent to the neuron cache beside its planned
    /// share ([`StreamingModel::lend_kv`]); 0 where nothing is lent.
    kv_lent: u64,
    /// Whether the KV cache's unreached bytes are lent: a streaming cache that cannot hold every
    /// cluster, and every cache this model has run with counted in `kv_ledger`.
    kv_lending: bool,
    started: Instant,
    tokens: u64,
    /// I/O counters at the start of the measured run (start-up reads excluded).
    io_base: IoCounters,
    /// The decode step on the GPU, where [`StreamingModel::use_gpu`] put it.
    #[cfg(feature = "gpu")]
    gpu: Option<Box<crate::gpu::GpuBundles>>,
    /// One token's logits from the GPU's step, where the FFN runs on the CPU.
    #[cfg(feature = "gpu")]
    gpu_row: Vec<f32>,
    /// The neuron pool's uploads when the clock was last reset.
    #[cfg(feature = "gpu")]
    gpu_uploads_base: u64,
    /// The dense weights' sizes as planned before the attention went to the GPU (whose memory
    /// the neuron cache then holds), to plan with again if the model goes back to the CPU.
    #[cfg(feature = "gpu")]
    dense_on_cpu: Option<planner::DenseSizes>,
}

/// What was read: all of it (FFN and dense), and the dense weights' part.
#[derive(Clone, Copy, Default)]
struct IoCounters {
    bytes: u64,
    reads: u64,
    busy: std::time::Duration,
    dense_bytes: u64,
    dense_reads: u64,
}

impl StreamingModel {
    /// Opens `file` (read from `path`) to stream its bundles from the device `opts.flash` names.
    pub fn open(path: &Path, file: LsbFile, opts: &StreamOptions) -> Result<Self> {
        let device = open_device(path, opts.flash.clone())
            .with_context(|| format!("cannot open {} for streaming", path.display()))?;
        Self::open_on(path, file, device, opts)
    }

    /// Like [`StreamingModel::open`], streaming from `device`, which must hold the bytes of
    /// `file` at `path` (tests pass a [`crate::storage::FaultyDevice`]); `opts.flash` is not used.
    pub fn open_on(
        path: &Path,
        mut file: LsbFile,
        device: Arc<dyn Device>,
        opts: &StreamOptions,
    ) -> Result<Self> {
        let config = file.meta.model.clone();
        let policy = opts.policy;
        let tuning = &opts.tuning;
        check_options(path, opts, config.num_layers)?;
        let sparsity = match policy {
            Policy::Resident | Policy::Oracle => match opts.sparsity {
                Sparsity::Refine { .. } => opts.sparsity,
                _ => Sparsity::Exact,
            },
            Policy::Dense => Sparsity::Dense,
            Policy::PowerInfer2 | Policy::LlmInFlash => Sparsity::Predicted,
            Policy::Leanstream | Policy::Mmap => opts.sparsity,
        };
        let uses = plan::PredictorUse {
            own: sparsity == Sparsity::Predicted,
            lookahead: policy == Policy::Leanstream && tuning.lookahead,
        };
        let mut plans = plan::LayerPlan::all(&mut file, uses)?;
        if let Sparsity::Refine { .. } = sparsity {
            // One layer per thread: each reads its own bundles (positional reads) and rotates
            // its rows.
            use rayon::prelude::*;
            let basis = LsbFile::read_input_basis(path)?.unwrap_or_default();
            ensure!(
                basis.layers.is_empty() || basis.layers.len() == plans.len(),
                "{}: INPUT_BASIS has {} layers, the model {}; convert the model again",
                path.display(),
                basis.layers.len(),
                plans.len()
            );
            // Each layer's directions move into its sketch (at the 7B width 1 MiB a layer: not
            // copied).
            let mut directions: Vec<Option<_>> = basis.layers.into_iter().map(Some).collect();
            directions.resize(plans.len(), None);
            plans
                .par_iter_mut()
                .zip(directions)
                .try_for_each(|(p, directions)| {
                    p.refine_sketch =
                        Some(refine_sketch::RefineSketch::build(path, p, directions)?);
                    anyhow::Ok(())
                })?;
        }
        // Decoding the file's indexes and plans freed more than the plans keep: give it back
        // to the OS, or the allocator keeps it resident beside the budgeted parts.
        crate::platform::memory::release_freed_memory();
        let tensors = DenseTensors::open(&file)?;
        let sizes = tensors.sizes(&config)?;
        let tokenizer = match opts.tokenizer_bytes {
            Some(bytes) => bytes,
            None => crate::tokenizer::resident_bytes(&file)?,
        };
        // `freed`: resident bytes the plans would give up (what dropping the certificates frees).
        let fit = |plans: &[plan::LayerPlan], freed: u64| {
            let input = |shape: Shape| {
                let sizes = sizes.clone();
                let (mut input, io) =
                    plan_input(&file, tokenizer, plans, sizes, shape, opts.memory, policy);
                input.resident_state -= freed;
                (input, io)
            };
            let asked = Shape {
                ctx: opts.ctx,
                kv: opts.kv,
                chunk: crate::text::generate::PROMPT_CHUNK,
            };
            let io_budget = input(asked).1;
            let shortest = Shape {
                chunk: planner::MIN_PROMPT_CHUNK,
                ..asked
            };
            // The context asked for with the longest prompt chunk that fits; where the context
            // may shrink, the shortest chunk with the longest context that fits.
            let (shape, split) = planner::fit_chunk(|chunk| input(Shape { chunk, ..asked }).0)
                .map(|(chunk, split)| (Shape { chunk, ..asked }, split))
                .or_else(|refused| match opts.ctx_floor {
                    Some(floor) => planner::fit_context(opts.ctx, floor, |ctx| {
                        input(Shape { ctx, ..shortest }).0
                    })
                    .map(|(ctx, split)| (Shape { ctx, ..shortest }, split)),
                    None => Err(refused),
                })
                .map_err(|refused| {
                    let fits = |ctx, kv| {
                        input(Shape {
                            ctx,
                            kv,
                            ..shortest
                        })
                        .0
                    };
                    match planner::what_fits(opts.ctx, opts.kv, fits) {
                        Some(flags) => anyhow::anyhow!("{refused}, or run with {flags}"),
                        None => refused,
                    }
                })?;
            // What a new budget is planned with while the model runs
            // ([`StreamingModel::set_budget`]).
            let replan_input = input(shape).0;
            anyhow::Ok((shape, split, io_budget, replan_input))
        };
        // Certificates are read only where they earn their bytes: with nothing cached first, and
        // once the plan keeps every dense weight resident, at its cache share (the bytes of those
        // that do not earn them go to the cache). Predicted sparsity uses none.
        // They are optional: where the budget cannot hold them beside every dense weight and the
        // context asked for, the plan without any is taken when it fits where they do not, holds
        // a longer context, or reads fewer bytes per token (the dense weights they would push to
        // flash are read on every token).
        choose_certificates(&file, &mut plans, 0.0, sparsity);
        let mut fitted = fit(&plans, 0);
        let freed = certificates_bytes(&plans);
        if freed > 0
            && fitted.as_ref().map_or(true, |f| {
                f.0.ctx < opts.ctx || f.1.dense_streamed != Default::default()
            })
        {
            let terms = certificate_terms(&file, &plans);
            let certified: Vec<bool> = plans.iter().map(|p| p.certify).collect();
            let reads = |split: &planner::MemorySplit, certified: &[bool]| {
                let share = split.neuron_cache as f64 / split.ffn_total.max(1) as f64;
                planner::reads_per_token(sizes.total - split.dense, share, &terms, certified)
            };
            let without = fit(&plans, freed);
            let take_without = match (&fitted, &without) {
                // A certificate never costs context; else the fewer bytes read per token win.
                (Ok(w), Ok(wo)) => {
                    wo.0.ctx > w.0.ctx
                        || (wo.0.ctx == w.0.ctx
                            && reads(&wo.1, &vec![false; plans.len()]) < reads(&w.1, &certified))
                }
                (Err(_), _) => true,
                (Ok(_), Err(_)) => false,
            };
            if take_without {
                // `without` is the plan of these plans once dropped: `freed` is what they free.
                drop_certificates(&mut plans);
                fitted = without;
            }
        }
        let (mut shape, mut split, mut io_budget, mut replan_input) = fitted?;
        let share = split.neuron_cache as f64 / split.ffn_total.max(1) as f64;
        if split.dense_streamed == planner::DenseStreamed::default()
            && choose_certificates(&file, &mut plans, share, sparsity)
        {
            (shape, split, io_budget, replan_input) = fit(&plans, 0)?;
        }
        plan::LayerPlan::load_certificates(&file, &mut plans)?;
        split.certified_layers = (0..plans.len())
            .filter(|&l| plans[l].certificate.is_some())
            .collect();
        let model = Model::norms_only(config.clone(), |name, shape| tensors.vector(name, shape))?;
        let io = Arc::new(IoQueue::new(device));
        let dense = DenseStream::open(&tensors, &config, split.dense_streamed, Arc::clone(&io))?;
        let window = tuning.window.unwrap_or(llm_in_flash::DEFAULT_WINDOW);
        let retention = match policy {
            Policy::Leanstream => tuning.retention,
            Policy::PowerInfer2 => Retention::Lru,
            Policy::LlmInFlash => Retention::Window(window),
            Policy::Oracle => Retention::Belady,
            Policy::Resident | Policy::Dense | Policy::Mmap => Retention::Activity,
        };
        let mapping = if policy == Policy::Mmap {
            // The page cache is the mapping's cache; the budget is enforced around the process.
            split.neuron_cache = 0;
            Some(mmap::Mapping::open(path)?)
        } else {
            None
        };
        let schedule: Box<dyn schedule::Schedule + Send> = match policy {
            Policy::Leanstream => Box::new(leanstream::Leanstream::new(tuning, config.num_layers)),
            Policy::Resident | Policy::Dense => Box::new(schedule::Resident),
            Policy::Mmap => Box::new(schedule::Mapped),
            Policy::PowerInfer2 => Box::new(powerinfer2::PowerInfer2::new(
                tuning
                    .hot_fraction
                    .unwrap_or(powerinfer2::DEFAULT_HOT_FRACTION),
            )),
            Policy::LlmInFlash => Box::new(llm_in_flash::LlmInFlash),
            Policy::Oracle => Box::new(oracle::Oracle::new(
                tuning.oracle.clone().expect("checked above"),
                tuning.oracle_exact_compute,
            )),
        };
        let slots = ClusterSlots::new(plans.iter().map(|p| p.clusters.len()));
        // Until a cache reaches them, the KV cache's planned pages hold clusters: all but the
        // first step of positions, which the first call reserves.
        let kv_lending = policy != Policy::Mmap && split.neuron_cache < split.ffn_total;
        let kv_lent = if kv_lending {
            lendable(
                &split,
                KvCache::reserved_for(&config, shape.ctx, opts.kv, RESERVE_STEP),
            )
        } else {
            0
        };
        let mut engine = StreamEngine::new(
            plans,
            sparsity,
            io,
            NeuronCache::new(split.neuron_cache + kv_lent, retention, slots),
            mapping,
            io_budget,
            schedule,
            tuning.oracle.clone(),
        );
        engine.warm()?;
        #[cfg(target_os = "linux")]
        if opts.flash.is_none() && policy != Policy::Mmap {
            // Everything resident is decoded and every later read is direct: what the buffered
            // reads of opening left in the page cache would be memory outside the budget.
            crate::storage::page_cache::forget(path)
                .with_context(|| format!("cannot drop {} from the page cache", path.display()))?;
        }
        Ok(Self {
            model,
            dense,
            engine,
            split,
            budget: opts.memory,
            replan_input,
            watch: None,
            budget_changes: Vec::new(),
            policy,
            ctx: shape.ctx,
            prompt_chunk: shape.chunk,
            kv: opts.kv,
            kv_ledger: Arc::new(KvLedger::default()),
            kv_lent,
            kv_lending,
            started: Instant::now(),
            tokens: 0,
            io_base: IoCounters::default(),
            #[cfg(feature = "gpu")]
            gpu: None,
            #[cfg(feature = "gpu")]
            gpu_row: Vec::new(),
            #[cfg(feature = "gpu")]
            gpu_uploads_base: 0,
            #[cfg(feature = "gpu")]
            dense_on_cpu: None,
        })
    }

    /// Moves the decode step to the GPU (docs/gpu.md). For `resident` (exact sparsity) and
    /// `dense`, the whole step, its FFN from the resident bundles in their stored encodings under
    /// the file's skip rule ([`crate::gpu::GpuBundles::upload`]). For the streaming policies and
    /// the other sparsity modes, the dense half — norms, attention, the output head — and the
    /// FFN from a neuron pool on the GPU into which this model streams the bundles it chooses,
    /// reads and caches as it would without the GPU
    /// ([`crate::gpu::GpuBundles::upload_streamed`]); with `ffn_on_cpu`, or where the GPU cannot
    /// hold the pool, each layer's FFN on the CPU instead
    /// ([`crate::gpu::GpuBundles::upload_attention`]). Each needs the dense weights in memory.
    /// Returns the line that says what runs where, or an error saying why the model stays on the
    /// CPU.
    #[cfg(feature = "gpu")]
    pub fn use_gpu(&mut self, gpu_memory: Option<u64>, ffn_on_cpu: bool) -> Result<String> {
        let whole = matches!(self.policy, Policy::Resident | Policy::Dense)
            && matches!(self.engine.sparsity(), Sparsity::Exact | Sparsity::Dense);
        let (attention, head) = self.dense.resident().context(
            "the dense weights stream from flash under this budget; the GPU needs them in memory",
        )?;
        let gpu = crate::gpu::Gpu::open(gpu_memory)?;
        let engine = &self.engine;
        let mut why_cpu = None;
        let step = if whole {
            crate::gpu::GpuBundles::upload(gpu, &self.model, attention, head, |l| {
                engine.bundle_parts(l)
            })?
        } else if ffn_on_cpu {
            crate::gpu::GpuBundles::upload_attention(gpu, &self.model, attention, head)?
        } else {
            // The cache as it will be planned once the attention's bytes are its.
            let slots = engine.pool_slots(self.replan_input.dense.attention);
            let layers = engine.pool_layers();
            match crate::gpu::GpuBundles::upload_streamed(
                gpu,
                &self.model,
                attention,
                head,
                layers,
                slots,
                self.ctx,
            ) {
                Ok(step) => step,
                Err(e) => {
                    why_cpu = Some(format!("{e:#}"));
                    let gpu = crate::gpu::Gpu::open(gpu_memory)?;
                    crate::gpu::GpuBundles::upload_attention(gpu, &self.model, attention, head)?
                }
            }
        };
        let mut line = step.describe();
        if let Some(why) = why_cpu {
            line.push_str(&format!(" (no neuron pool on the GPU: {why})"));
        }
        self.gpu = Some(Box::new(step));
        if !whole {
            // The GPU computes the attention: the CPU's copy goes, and its bytes to the cache.
            let sizes = self.replan_input.dense.clone();
            self.dense.attention_away();
            self.replan_input.dense = sizes.without_attention();
            self.dense_on_cpu = Some(sizes.clone());
            if let Some(budget) = self.budget {
                self.apply_plan(budget)?;
            }
            crate::platform::memory::release_freed_memory();
            line.push_str(&format!(
                "; the CPU's {} of attention weights freed for the neuron cache",
                crate::platform::memory_size::format_size(sizes.attention)
            ));
        }
        Ok(line)
    }

    /// Back to the CPU (the GPU could not hold the KV cache): the step dropped and, where it held
    /// the attention, the plan made again with the attention on the CPU and the projections
    /// read again (the cache shrinks first).
    #[cfg(feature = "gpu")]
    fn leave_gpu(&mut self) -> Result<()> {
        self.gpu = None;
        if let Some(sizes) = self.dense_on_cpu.take() {
            self.replan_input.dense = sizes;
            if let Some(budget) = self.budget {
                self.apply_plan(budget)?;
            }
            self.dense
                .attention_back()
                .context("reading the attention weights again for the CPU")?;
        }
        Ok(())
    }

    /// [`forward_into`](crate::model::LanguageModel::forward_into) with the dense half on the
    /// GPU and the FFN streamed into its neuron pool or on the CPU, a token at a time (each a
    /// call of the engine, as a decoded token is without the GPU). `Ok(false)`: the GPU could not
    /// hold the KV cache, nothing was computed and the step is dropped.
    #[cfg(feature = "gpu")]
    fn forward_split(
        &mut self,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
        logits: &mut Vec<f32>,
    ) -> Result<bool> {
        self.take_watched_budget();
        let mut row = std::mem::take(&mut self.gpu_row);
        logits.clear();
        for (i, &token) in tokens.iter().enumerate() {
            let positions = cache.len() + 1;
            self.lend_kv([(&mut *cache, positions)])?;
            self.engine.begin_call(&[token], cache.len())?;
            let gpu = self.gpu.as_deref_mut().expect("the caller checked");
            let dense = &mut self.dense;
            let embed =
                |token, row: &mut [f32]| crate::model::DenseWeights::embed(dense, &[token], row);
            let host = match gpu.ffn_place() {
                crate::gpu::FfnPlace::Streamed => crate::gpu::Host::Streamed(&mut self.engine),
                _ => crate::gpu::Host::Backend(&mut self.engine),
            };
            let done = gpu.forward(&self.model, embed, &[token], cache, false, &mut row, host);
            self.engine.end_call(1);
            if !done? {
                // Only the first token syncs a new cache.
                ensure!(i == 0, "the GPU dropped its KV cache within a call");
                self.gpu_row = row;
                return Ok(false);
            }
            self.tokens += 1;
            if all_logits || i + 1 == tokens.len() {
                logits.extend_from_slice(&row);
            }
        }
        self.gpu_row = row;
        Ok(true)
    }

    /// Starts recording the active neurons (stored positions) of each token and layer the CPU
    /// computes: a test's reference for the GPU's.
    #[cfg(all(test, feature = "gpu"))]
    pub(crate) fn record_active(&mut self) {
        self.engine.start_recording();
    }

    /// What was recorded since [`StreamingModel::record_active`], per (token, layer) in order.
    #[cfg(all(test, feature = "gpu"))]
    pub(crate) fn recorded_active(&mut self) -> Vec<Vec<u32>> {
        self.engine.take_recording()
    }

    /// The decode step on the GPU, where [`StreamingModel::use_gpu`] put it and it still runs (a
    /// KV cache the GPU cannot hold drops it).
    #[cfg(feature = "gpu")]
    pub fn gpu(&mut self) -> Option<&mut crate::gpu::GpuBundles> {
        self.gpu.as_deref_mut()
    }

    /// A new budget, taken between tokens and planned as at start-up ([`planner::replan`]).
    /// Shrinking first evicts the neuron cache's lowest-ranked clusters, then moves dense weights
    /// to streaming if the cache alone does not make room; growing first reads streamed dense
    /// weights back into memory, then gives the cache its room (later reads fill it). What is
    /// freed is returned to the OS before this returns. Refused — the old budget staying — below
    /// the minimum at the run's context.
    pub fn set_budget(&mut self, budget: u64) -> Result<()> {
        let started = Instant::now();
        if self.budget == Some(budget) {
            return Ok(());
        }
        if self.policy == Policy::Mmap {
            bail!("--policy mmap's memory is held by the kernel (a cgroup), not by a budget the runtime can change");
        }
        let from = self.budget;
        self.apply_plan(budget)?;
        self.budget_changes.push(BudgetChange {
            at_token: self.tokens,
            from,
            to: budget,
            micros: started.elapsed().as_micros() as u64,
            rss_after: crate::platform::memory::current_rss_bytes(),
            dense_streamed: self.split.dense_streamed,
        });
        Ok(())
    }

    /// Plans `budget` ([`planner::replan`]) and makes the model hold what the plan says.
    fn apply_plan(&mut self, budget: u64) -> Result<()> {
        let input = planner::PlanInput {
            budget: Some(budget),
            ..self.replan_input.clone()
        };
        let split = planner::replan(input, &self.split)?;
        let lent = self.kv_lendable(&split);
        // Room is made before anything is read: the cache shrinks first, and a part of the dense
        // weights is dropped before it is read again in its new form.
        self.engine.set_cache_capacity(
            (split.neuron_cache + lent).min(self.split.neuron_cache + self.kv_lent),
        )?;
        if split.dense_streamed != self.split.dense_streamed {
            self.dense
                .set_streamed(split.dense_streamed)
                .context("cannot move the dense weights for the new budget")?;
        }
        self.engine.set_cache_capacity(split.neuron_cache + lent)?;
        self.kv_lent = lent;
        crate::platform::memory::release_freed_memory();
        self.split = split;
        self.budget = Some(budget);
        Ok(())
    }

    /// The least budget [`StreamingModel::set_budget`] accepts: every dense weight the planner
    /// may stream streaming, at the run's context and prompt chunk.
    pub fn budget_floor(&self) -> u64 {
        planner::minimum(&self.replan_input)
    }

    /// Follows `watch` from now on: each new budget it publishes is taken before the next token.
    pub fn follow(&mut self, watch: BudgetWatch) {
        self.watch = Some(watch);
    }

    /// Whether a watch sets the budget.
    pub fn follows(&self) -> bool {
        self.watch.is_some()
    }

    /// Takes a budget the watch published since the last token (or now, between requests). One
    /// that cannot be taken keeps the old budget and says why on stderr; one below the floor from
    /// a source that lowers it as far as it goes (`--memory auto` under pressure) is the floor.
    /// Whether there was one to take.
    pub fn take_watched_budget(&mut self) -> bool {
        let Some(watch) = self.watch.as_mut() else {
            return false;
        };
        let to_floor = watch.to_floor();
        let Some(mut budget) = watch.changed() else {
            return false;
        };
        if to_floor {
            budget = budget.max(self.budget_floor());
        }
        if let Err(e) = self.set_budget(budget) {
            eprintln!("leanstream: budget unchanged: {e:#}");
        }
        true
    }

    /// Figures of the run so far (call after generation).
    pub fn summary(&self) -> Summary {
        let now = self.io_counters();
        let base = self.io_base;
        let wall = self.started.elapsed().as_secs_f64();
        let dense_bytes = now.dense_bytes - base.dense_bytes;
        let dense_reads = now.dense_reads - base.dense_reads;
        // The device counts a read when it lands, the dense stream when it queues it: a read
        // queued before the start and landing after could make the difference dip below zero.
        let mut summary = self.engine.metrics().summary(
            self.tokens,
            (now.bytes - base.bytes).saturating_sub(dense_bytes),
            (now.reads - base.reads).saturating_sub(dense_reads),
            (now.busy - base.busy).as_secs_f64() / wall.max(1e-9),
            wall,
        );
        summary.dense_bytes_read_per_token = dense_bytes as f64 / self.tokens.max(1) as f64;
        summary.budget_changes = self.budget_changes.clone();
        summary.whole_layers = self.engine.whole_layers();
        summary.kv_lent_bytes = self.kv_lent;
        summary
    }

    /// What the neuron cache may borrow of `split`'s KV bytes now ([`lendable`]; 0 where nothing
    /// is lent).
    fn kv_lendable(&self, split: &planner::MemorySplit) -> u64 {
        if self.kv_lending {
            lendable(split, self.kv_ledger.committed())
        } else {
            0
        }
    }

    /// Reserves in `caches` the positions `0..positions` the next call writes, then gives the
    /// neuron cache the KV cache's planned bytes that no cache has reached: shrinking evicts
    /// clusters and returns their memory to the OS before the pages are written. A cache this
    /// model did not make ends the lending for good (its pages are not counted).
    fn lend_kv<'a>(
        &mut self,
        caches: impl IntoIterator<Item = (&'a mut KvCache, usize)>,
    ) -> Result<()> {
        if !self.kv_lending {
            return Ok(());
        }
        for (cache, positions) in caches {
            if !cache.counts_in(&self.kv_ledger) {
                self.kv_lending = false;
            }
            cache.reserve(positions);
        }
        let lent = self.kv_lendable(&self.split);
        if lent != self.kv_lent {
            self.engine
                .set_cache_capacity(self.split.neuron_cache + lent)?;
            if lent < self.kv_lent {
                crate::platform::memory::release_freed_memory();
            }
            self.kv_lent = lent;
        }
        Ok(())
    }

    /// Starts counting tokens, time and I/O afresh (after the start-up reads).
    pub fn reset_clock(&mut self) {
        self.started = Instant::now();
        self.tokens = 0;
        self.io_base = self.io_counters();
        self.engine.reset_metrics();
        #[cfg(feature = "gpu")]
        {
            self.gpu_uploads_base = self.gpu.as_deref().map_or(0, |g| g.layers_uploads());
        }
    }

    /// What runs on the GPU since the clock was reset, for `--json` (`None` on the CPU).
    #[cfg(feature = "gpu")]
    pub fn gpu_summary(&self) -> Option<serde_json::Value> {
        let g = self.gpu.as_deref()?;
        Some(g.summary(self.gpu_uploads_base))
    }

    /// The read queue (its counters, retries and failures included, and its timeline).
    pub fn io(&self) -> &IoQueue {
        self.engine.io()
    }

    /// Bytes read, reads and device busy time so far: the read queue's, or for a mapping what
    /// the kernel read for the process (major faults as reads; busy time unknown); and the dense
    /// stream's part.
    fn io_counters(&self) -> IoCounters {
        let (dense_bytes, dense_reads) = self.dense.counters();
        let (bytes, reads, busy) = if self.engine.mapping().is_some() {
            let (bytes, faults) = mmap::process_io();
            (
                bytes + dense_bytes,
                faults + dense_reads,
                std::time::Duration::ZERO,
            )
        } else {
            let s = self.engine.io().stats();
            (s.bytes_read, s.device_reads, s.busy)
        };
        IoCounters {
            bytes,
            reads,
            busy,
            dense_bytes,
            dense_reads,
        }
    }
}

impl crate::model::LanguageModel for StreamingModel {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn new_cache(&self, ctx: usize) -> KvCache {
        KvCache::new(self.config(), ctx, self.kv).with_ledger(Arc::clone(&self.kv_ledger))
    }

    fn prompt_chunk(&self) -> usize {
        self.prompt_chunk
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
        #[cfg(feature = "gpu")]
        if let Some(place) = self.gpu.as_deref().map(|g| g.ffn_place()) {
            let on_gpu = if place != crate::gpu::FfnPlace::Gpu {
                self.forward_split(tokens, cache, all_logits, logits)?
            } else {
                self.take_watched_budget();
                let gpu = self.gpu.as_deref_mut().expect("checked above");
                let dense = &mut self.dense;
                let embed = |token, row: &mut [f32]| {
                    crate::model::DenseWeights::embed(dense, &[token], row)
                };
                let host = crate::gpu::Host::None;
                let done =
                    gpu.forward(&self.model, embed, tokens, cache, all_logits, logits, host)?;
                if done {
                    self.tokens += tokens.len() as u64;
                }
                done
            };
            if on_gpu {
                return Ok(());
            }
            // The GPU could not hold the KV cache: the CPU from now on.
            self.leave_gpu()?;
        }
        // A trace was recorded one token at a time (a chunk would round differently); otherwise
        // no more tokens at once than the scratch was planned for.
        let most = if self.engine.decode_only() {
            1
        } else {
            self.prompt_chunk
        };
        if tokens.len() > most {
            return forward_in_chunks(tokens, most, all_logits, logits, |chunk, logits| {
                self.forward_into(chunk, cache, all_logits, logits)
            });
        }
        self.take_watched_budget();
        let positions = cache.len() + tokens.len();
        self.lend_kv([(&mut *cache, positions)])?;
        self.engine.begin_call(tokens, cache.len())?;
        self.tokens += tokens.len() as u64;
        let done = self.model.forward_with(
            tokens,
            cache,
            all_logits,
            Some(&mut self.engine),
            Some(&mut self.dense),
            logits,
        );
        self.engine.end_call(tokens.len());
        done
    }

    fn forward_batch(
        &mut self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        // A recorded trace is replayed one token at a time; a batch beyond the planned scratch
        // is decoded row by row, as is every batch on the GPU.
        #[cfg(feature = "gpu")]
        if self.gpu.is_some() {
            return crate::model::decode_each(self, tokens, caches, logits);
        }
        if tokens.len() < 2 || tokens.len() > self.prompt_chunk || self.engine.decode_only() {
            return crate::model::decode_each(self, tokens, caches, logits);
        }
        self.take_watched_budget();
        self.lend_kv(caches.iter_mut().map(|c| {
            let positions = c.len() + 1;
            (&mut **c, positions)
        }))?;
        self.engine.begin_call(tokens, 0)?;
        self.tokens += tokens.len() as u64;
        let done = self.model.forward_batch_with(
            tokens,
            caches,
            Some(&mut self.engine),
            Some(&mut self.dense),
            logits,
        );
        self.engine.end_call(tokens.len());
        done
    }
}

/// What the neuron cache may borrow of `split`'s KV bytes when `committed` of them are counted: the
/// rest, up to what the cache lacks of the FFN.
fn lendable(split: &planner::MemorySplit, committed: u64) -> u64 {
    split
        .kv_cache
        .saturating_sub(committed)
        .min(split.ffn_total.saturating_sub(split.neuron_cache))
}

/// Runs `tokens` through `step` in pieces of at most `most`, keeping every piece's logits when
/// `all_logits`, else the last piece's (what one call on all of `tokens` would return).
fn forward_in_chunks(
    tokens: &[u32],
    most: usize,
    all_logits: bool,
    logits: &mut Vec<f32>,
    mut step: impl FnMut(&[u32], &mut Vec<f32>) -> Result<()>,
) -> Result<()> {
    let mut out = Vec::new();
    let last = (tokens.len() - 1) / most;
    for (i, chunk) in tokens.chunks(most).enumerate() {
        step(chunk, logits)?;
        if all_logits || i == last {
            out.extend_from_slice(logits);
        }
    }
    *logits = out;
    Ok(())
}

/// Refuses option combinations a policy cannot run with, saying what to change.
fn check_options(path: &Path, opts: &StreamOptions, layers: usize) -> Result<()> {
    let t = &opts.tuning;
    if opts.policy == Policy::Mmap && opts.flash.is_some() {
        bail!(
            "--policy mmap maps {} through the page cache of the real disk; an emulated --flash device cannot sit under a mapping: use --flash none",
            path.display()
        );
    }
    if opts.policy == Policy::Oracle && t.oracle.is_none() {
        bail!("--policy oracle needs the true active sets of the tokens it will see, recorded in advance (ActiveTrace::record; `leanstream bench` does this)");
    }
    if let Some(trace) = &t.oracle {
        if trace.layers() != layers {
            bail!(
                "the active trace has {} layers and {} has {layers}: record it from this file",
                trace.layers(),
                path.display()
            );
        }
    }
    if let Some(f) = t.hot_fraction {
        if !(0.0..=1.0).contains(&f) {
            bail!("--hot-fraction must lie between 0 and 1, not {f}");
        }
    }
    if t.window == Some(0) {
        bail!("--window must be at least 1 token");
    }
    Ok(())
}

/// Keeps the certificates that earn their bytes ([`planner::keep_certificates`] with a neuron
/// cache holding `cache_share` of the FFN), none where nothing is certified, and never one dropped
/// before; true if any was dropped. A certified layer without one reads every uncached cluster on
/// every token, so its look-ahead predictor, which guesses which to read, goes too.
fn choose_certificates(
    file: &LsbFile,
    plans: &mut [plan::LayerPlan],
    cache_share: f64,
    sparsity: Sparsity,
) -> bool {
    let keep = planner::keep_certificates(&certificate_terms(file, plans), cache_share);
    let mut dropped = false;
    for (p, keep) in plans.iter_mut().zip(keep) {
        if sparsity != Sparsity::Certified {
            dropped |= std::mem::take(&mut p.certify);
        } else if !keep || !p.certify {
            dropped |= p.uncertify();
        }
    }
    dropped
}

/// Each layer's certificate as the planner weighs it.
fn certificate_terms(file: &LsbFile, plans: &[plan::LayerPlan]) -> Vec<planner::CertificateTerm> {
    plans
        .iter()
        .zip(&file.meta.layers)
        .map(|(p, m)| planner::CertificateTerm {
            bytes: p.certificate_bytes.filter(|_| p.certify).unwrap_or(0),
            ffn: p.clusters.iter().map(|c| c.size).sum(),
            saves: m.certificate_saves.map(f64::from),
        })
        .collect()
}

/// The resident bytes [`drop_certificates`] frees: the certificates kept and the look-ahead
/// predictors of their layers.
fn certificates_bytes(plans: &[plan::LayerPlan]) -> u64 {
    plans
        .iter()
        .filter(|p| p.certify)
        .map(|p| p.certificate_bytes.unwrap_or(0) + p.lookahead.as_ref().map_or(0, |q| q.bytes()))
        .sum()
}

/// Drops every certificate; a certified layer without one reads every uncached cluster, so its
/// look-ahead predictor goes too (as in [`choose_certificates`]).
fn drop_certificates(plans: &mut [plan::LayerPlan]) {
    for p in plans.iter_mut().filter(|p| p.certify) {
        p.uncertify();
    }
}

/// What a plan is made for: the context, the KV cache's storage and the prompt chunk.
#[derive(Clone, Copy)]
struct Shape {
    ctx: usize,
    kv: KvType,
    chunk: usize,
}

/// What the planner needs to know about a file; also returns the speculation I/O budget.
fn plan_input(
    file: &LsbFile,
    tokenizer_bytes: u64,
    plans: &[plan::LayerPlan],
    dense: planner::DenseSizes,
    shape: Shape,
    budget: Option<u64>,
    policy: Policy,
) -> (planner::PlanInput, u64) {
    let Shape { ctx, kv, chunk } = shape;
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
        overhead: planner::baseline_overhead(tokenizer_bytes),
        dense,
        kv_cache: KvCache::bytes_for(config, ctx, kv) as u64,
        resident_state: plans.iter().map(|p| p.resident_bytes()).sum(),
        // Speculative reads for the next layer while this layer's own reads are in flight (up to
        // the whole layer: more than the speculation budget where that is capped).
        io_buffers: layer_max.max(io_budget) + io_budget,
        scratch: planner::scratch_bytes(config, chunk),
        ffn: sizes().sum(),
        needs_all_ffn: matches!(policy, Policy::Resident | Policy::Dense),
        ctx,
        prompt_chunk: chunk,
    };
    (input, io_budget)
}

/// The dense-resident minimum (`min_memory_dense_resident_bytes` in `inspect --json`): the
/// smallest `--memory` at which the `leanstream` policy keeps every dense weight resident (the
/// neuron cache empty: every bundle streams), with the default KV cache storage. Below it dense
/// weights stream too, down to [`streaming_minimum_memory`]. Not the least budget a run accepts.
pub fn minimum_memory(path: &Path, ctx: usize) -> Result<u64> {
    Ok(memory_split(path, ctx)?.fixed())
}

/// The minimum (`min_memory_bytes` in `inspect --json`, the figure a refused `--memory` states):
/// the smallest `--memory` the `leanstream` policy accepts for `file` at `ctx`: every bundle and
/// the dense weights the planner may stream stream, and no certificate is kept (they are optional).
pub fn streaming_minimum_memory(path: &Path, ctx: usize) -> Result<u64> {
    Ok(planner::minimum(&open_plan_input(
        path,
        Shape {
            ctx,
            kv: KvType::default(),
            chunk: planner::MIN_PROMPT_CHUNK,
        },
        false,
    )?))
}

/// The least budget a running `leanstream` run of `file` at `ctx`, opened with the longest prompt
/// chunk, takes when it changes ([`StreamingModel::budget_floor`]): every dense weight the planner
/// may stream streaming, the certificates kept as [`memory_split`] keeps them (a run keeps those
/// it opened with).
pub fn running_minimum_memory(path: &Path, ctx: usize) -> Result<u64> {
    Ok(planner::minimum(&open_plan_input(
        path,
        Shape {
            ctx,
            kv: KvType::default(),
            chunk: crate::text::generate::PROMPT_CHUNK,
        },
        true,
    )?))
}

/// The planner's split for `file` at `ctx` without a budget: the fixed part with every dense
/// weight resident and the size of the FFN bundles, from which budgets are chosen.
pub fn memory_split(path: &Path, ctx: usize) -> Result<MemorySplit> {
    memory_split_with(path, ctx, KvType::default())
}

/// [`memory_split`] with the KV cache stored as `kv`. Its `overhead` is this process's start-up
/// RSS (measured once, [`crate::platform::memory::startup_rss_bytes`]): a budget meant for another process
/// (a test's for a `leanstream` it starts) is only as exact as their start-ups agree, so such
/// callers pass `--memory ffn:P%` and let that process plan it.
pub fn memory_split_with(path: &Path, ctx: usize, kv: KvType) -> Result<MemorySplit> {
    planner::plan(open_plan_input(
        path,
        Shape {
            ctx,
            kv,
            chunk: crate::text::generate::PROMPT_CHUNK,
        },
        true,
    )?)
}

/// `certificates`: keep those that earn their bytes with nothing cached (else none).
fn open_plan_input(path: &Path, shape: Shape, certificates: bool) -> Result<planner::PlanInput> {
    let mut file = LsbFile::open(path)?;
    // The default run: certified sparsity, speculating with the look-ahead predictors.
    let uses = plan::PredictorUse {
        own: false,
        lookahead: true,
    };
    let mut plans = plan::LayerPlan::all(&mut file, uses)?;
    choose_certificates(&file, &mut plans, 0.0, Sparsity::Certified);
    if !certificates {
        drop_certificates(&mut plans);
    }
    let sizes = DenseTensors::open(&file)?.sizes(&file.meta.model)?;
    Ok(plan_input(
        &file,
        crate::tokenizer::resident_bytes(&file)?,
        &plans,
        sizes,
        shape,
        None,
        Policy::Leanstream,
    )
    .0)
}
