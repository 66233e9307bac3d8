//! A model opened the way the command line asks: a policy, a memory budget, a flash device and a
//! context length; the same for `run`, `perplexity` and `bench`.

use std::path::PathBuf;

use anyhow::{bail, Result};
use leanstream_format::meta::ChatTemplate;
use leanstream_format::LsbFile;
use serde_json::{json, Value};

use crate::model::kv_cache::KvType;
use crate::model::{LanguageModel, Model};
use crate::source;
use crate::storage::FlashProfile;
use crate::streaming::experts::{ExpertModel, ExpertOptions};
use crate::streaming::{Policy, Sparsity, StreamOptions, StreamingModel, Tuning};
use crate::tokenizer::Tokenizer;

/// Which engine computes the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyChoice {
    /// Every weight in DRAM, every neuron computed: the quality reference (on a converted file,
    /// its weights as stored, so that it differs from `resident` by sparsity alone).
    Dense,
    /// Every bundle in DRAM, the file's sparsity applied, no I/O.
    Resident,
    /// The file memory-mapped, the OS paging on demand (llama.cpp-like; real disk only).
    Mmap,
    /// PowerInfer-2's design: own predictor, per-cluster I/O-compute overlap, hot set + LRU.
    PowerInfer2,
    /// LLM in a Flash's design: own predictor, a window of recent tokens, load then compute.
    LlmInFlash,
    /// Speculate-and-refine streaming under the budget.
    Leanstream,
    /// The true active sets known in advance, Belady eviction: the limit.
    Oracle,
}

impl PolicyChoice {
    /// Every policy, references first, then the prior systems, leanstream and the limit.
    pub const ALL: [PolicyChoice; 7] = [
        PolicyChoice::Dense,
        PolicyChoice::Resident,
        PolicyChoice::Mmap,
        PolicyChoice::PowerInfer2,
        PolicyChoice::LlmInFlash,
        PolicyChoice::Leanstream,
        PolicyChoice::Oracle,
    ];

    /// The policy of a command-line name (see [`policy_name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|&p| policy_name(p) == name)
    }
}

/// The GPU's part in a session (docs/gpu.md; a build without the `gpu` feature says it has none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuChoice {
    /// Run the decode step on the GPU (`--gpu`, or `LEANSTREAM_GPU` set to anything but empty or
    /// `0`).
    pub on: bool,
    /// The most bytes of GPU memory the model takes (`--gpu-memory`); `None`: what
    /// `LEANSTREAM_GPU_MEMORY` says, or no limit.
    pub memory: Option<u64>,
    /// A streaming policy's FFN on the CPU, the GPU computing the attention only (`--gpu-ffn
    /// cpu`, or `LEANSTREAM_GPU_FFN=cpu`); otherwise on the GPU from its neuron pool.
    pub ffn_on_cpu: bool,
}

impl GpuChoice {
    /// What the environment asks for: `LEANSTREAM_GPU` (its budget, `LEANSTREAM_GPU_MEMORY`, is
    /// read when the GPU opens).
    pub fn from_env() -> Self {
        Self {
            on: std::env::var_os("LEANSTREAM_GPU").is_some_and(|v| !v.is_empty() && v != "0"),
            memory: None,
            ffn_on_cpu: match std::env::var("LEANSTREAM_GPU_FFN") {
                Ok(v) if v.trim().eq_ignore_ascii_case("cpu") => true,
                Ok(v) if !v.trim().is_empty() && !v.trim().eq_ignore_ascii_case("gpu") => {
                    eprintln!("gpu: LEANSTREAM_GPU_FFN={v} is neither gpu nor cpu; using gpu");
                    false
                }
                _ => false,
            },
        }
    }
}

#[derive(Debug, Clone)]
pub struct SessionOptions {
    pub model: PathBuf,
    /// `None`: `leanstream` for converted files, `dense` for anything else.
    pub policy: Option<PolicyChoice>,
    pub memory: Option<u64>,
    pub flash: Option<FlashProfile>,
    pub sparsity: Sparsity,
    pub ctx: Option<usize>,
    pub default_ctx: usize,
    pub kv: KvType,
    pub tuning: Tuning,
    pub gpu: GpuChoice,
}

impl SessionOptions {
    /// The context length when neither [`SessionOptions::ctx`] nor the caller's default says
    /// otherwise (what `leanstream run` uses).
    pub const DEFAULT_CTX: usize = 2048;

    /// Options for `model` with `policy` (`None`: chosen by the file, see [`SessionOptions::policy`]):
    /// no memory budget, no emulated flash, certified sparsity, the default KV cache and tuning,
    /// context [`SessionOptions::DEFAULT_CTX`], the GPU as the environment asks
    /// ([`GpuChoice::from_env`]). Change the rest with the setters below or with
    /// `..SessionOptions::new(model, policy)`.
    pub fn new(model: impl Into<PathBuf>, policy: Option<PolicyChoice>) -> Self {
        Self {
            model: model.into(),
            policy,
            memory: None,
            flash: None,
            sparsity: Sparsity::Certified,
            ctx: None,
            default_ctx: Self::DEFAULT_CTX,
            kv: KvType::default(),
            tuning: Tuning::default(),
            gpu: GpuChoice::from_env(),
        }
    }

    /// A memory budget in bytes (`None`: unbounded).
    pub fn memory(mut self, memory: Option<u64>) -> Self {
        self.memory = memory;
        self
    }

    /// An emulated flash device (`None`: the file's own disk).
    pub fn flash(mut self, flash: Option<FlashProfile>) -> Self {
        self.flash = flash;
        self
    }

    pub fn sparsity(mut self, sparsity: Sparsity) -> Self {
        self.sparsity = sparsity;
        self
    }

    /// Exactly `ctx` positions: the requested context and the default both.
    pub fn ctx(mut self, ctx: usize) -> Self {
        self.ctx = Some(ctx);
        self.default_ctx = ctx;
        self
    }

    pub fn kv(mut self, kv: KvType) -> Self {
        self.kv = kv;
        self
    }

    pub fn tuning(mut self, tuning: Tuning) -> Self {
        self.tuning = tuning;
        self
    }

    pub fn gpu(mut self, gpu: GpuChoice) -> Self {
        self.gpu = gpu;
        self
    }
}

/// The dense policy's model: on the CPU, or with its decode step (or its output head alone) on the
/// GPU when `gpu` asks for it (docs/gpu.md); one line on standard error then says what runs where,
/// or why it stays on the CPU.
fn dense_engine(model: Model, gpu: GpuChoice) -> Box<dyn LanguageModel + Send> {
    if !gpu.on {
        return Box::new(model);
    }
    #[cfg(feature = "gpu")]
    match crate::gpu::Gpu::open(gpu.memory)
        .and_then(|g| crate::gpu::GpuModel::upload_on(std::sync::Arc::new(g), &model))
    {
        Ok((gpu, placement)) => {
            let model = crate::gpu::GpuModel::new(model, gpu, placement);
            eprintln!("gpu: {}", model.describe());
            Box::new(model)
        }
        Err(e) => {
            eprintln!("gpu: {e:#}; running on the CPU");
            Box::new(model)
        }
    }
    #[cfg(not(feature = "gpu"))]
    {
        say_no_gpu_support();
        Box::new(model)
    }
}

/// The line a build without the `gpu` feature prints when the GPU is asked for.
#[cfg(not(feature = "gpu"))]
fn say_no_gpu_support() {
    eprintln!("gpu: this build has no GPU support (the `gpu` feature); running on the CPU");
}

enum Engine {
    /// A resident model ([`Model`], or with the `gpu` feature its GPU form: [`dense_engine`]).
    Dense(Box<dyn LanguageModel + Send>),
    Streaming(Box<StreamingModel>),
    /// A mixture of experts whose experts stream.
    Experts(Box<ExpertModel>),
}

pub struct Session {
    engine: Engine,
    pub model_path: PathBuf,
    pub tokenizer: Tokenizer,
    pub eos_token_ids: Vec<u32>,
    pub chat_template: Option<ChatTemplate>,
    pub ctx: usize,
    /// Why the context is shorter than the default, when the budget shrank it.
    pub context_note: Option<String>,
    pub policy: PolicyChoice,
}

impl Session {
    pub fn open(o: &SessionOptions) -> Result<Self> {
        let converted = o.model.is_file() && source::is_converted(&o.model)?;
        // A converted mixture of experts (format 1.5) runs with every expert in memory, or with
        // its experts streaming under a budget or from a flash device.
        let mixture = converted && LsbFile::has_experts(&o.model)?;
        let policy = o.policy.unwrap_or(if mixture {
            if o.memory.is_some() || o.flash.is_some() {
                PolicyChoice::Leanstream
            } else {
                PolicyChoice::Resident
            }
        } else if converted {
            PolicyChoice::Leanstream
        } else {
            PolicyChoice::Dense
        });
        if mixture {
            return Self::open_mixture(o, policy);
        }
        if policy != PolicyChoice::Dense && !converted {
            bail!(
                "--policy {} needs a converted file; convert {} with `leanstream-prep convert` or use --policy dense",
                policy_name(policy),
                o.model.display()
            );
        }
        if policy == PolicyChoice::Dense && (o.memory.is_some() || o.flash.is_some()) {
            bail!(
                "--memory and --flash apply to the streaming policies, not --policy dense: drop \
                 --policy dense to stream {} (a model that is not converted is converted once)",
                o.model.display()
            );
        }
        if policy == PolicyChoice::Dense && !converted {
            let loaded = source::open(&o.model)?;
            let ctx = cap_ctx(o, loaded.model.config().max_position_embeddings)?;
            check_kv(o, loaded.model.config().head_dim)?;
            return Ok(Self {
                engine: Engine::Dense(dense_engine(loaded.model.with_kv(o.kv), o.gpu)),
                model_path: o.model.clone(),
                tokenizer: loaded.tokenizer,
                eos_token_ids: loaded.eos_token_ids,
                chat_template: loaded.chat_template,
                ctx,
                context_note: None,
                policy,
            });
        }
        // The tokenizer first, and its parse's garbage (without compact tables, `tokenizer.json`
        // is parsed) returned to the OS before the file's indexes are decoded: the two peaks
        // would otherwise stack above the budget.
        let tokenizer = Tokenizer::from_lsb(&o.model)?;
        crate::platform::memory::release_freed_memory();
        let file = LsbFile::open(&o.model)?;
        let ctx = cap_ctx(o, file.meta.model.max_position_embeddings)?;
        check_kv(o, file.meta.model.head_dim)?;
        let stream = StreamOptions {
            policy: match policy {
                // A converted file's weights as stored, every neuron computed.
                PolicyChoice::Dense => Policy::Dense,
                PolicyChoice::Resident => Policy::Resident,
                PolicyChoice::Mmap => Policy::Mmap,
                PolicyChoice::PowerInfer2 => Policy::PowerInfer2,
                PolicyChoice::LlmInFlash => Policy::LlmInFlash,
                PolicyChoice::Leanstream => Policy::Leanstream,
                PolicyChoice::Oracle => Policy::Oracle,
            },
            sparsity: o.sparsity,
            memory: o.memory,
            flash: o.flash.clone(),
            ctx,
            // Without --ctx, a budget too small for the default context gets a shorter one.
            ctx_floor: (o.ctx.is_none() && o.memory.is_some()).then_some(MIN_SHRUNK_CTX.min(ctx)),
            kv: o.kv,
            tokenizer_bytes: Some(tokenizer.resident_bytes(&file)),
            tuning: o.tuning.clone(),
        };
        let eos_token_ids = file.meta.model.eos_token_ids.clone();
        let chat_template = file.meta.chat_template.clone();
        let mut model = StreamingModel::open(&o.model, file, &stream)?;
        // A converted file's decode step on the GPU (docs/gpu.md): one line says where it runs.
        #[cfg(feature = "gpu")]
        if o.gpu.on {
            match model.use_gpu(o.gpu.memory, o.gpu.ffn_on_cpu) {
                Ok(line) => eprintln!("gpu: {line}"),
                Err(e) => eprintln!(
                    "gpu: --policy {} on a converted file: {e:#}; running on the CPU",
                    policy_name(policy)
                ),
            }
        }
        #[cfg(not(feature = "gpu"))]
        if o.gpu.on {
            say_no_gpu_support();
        }
        model.reset_clock();
        let context_note = (model.ctx < ctx).then(|| {
            format!(
                "note: --memory {} holds a context of {} tokens, not the default {ctx}: using --ctx {} (pass --ctx to choose another)",
                crate::platform::memory_size::format_size(o.memory.unwrap_or_default()),
                model.ctx,
                model.ctx
            )
        });
        let ctx = model.ctx;
        Ok(Self {
            engine: Engine::Streaming(Box::new(model)),
            model_path: o.model.clone(),
            tokenizer,
            eos_token_ids,
            chat_template,
            ctx,
            context_note,
            policy,
        })
    }

    /// A converted mixture of experts: with `leanstream`, its experts stream from flash under the
    /// budget ([`ExpertModel`]); with `resident` or `dense`, the same engine with room for every
    /// expert (the two compute the same: no sparsity is calibrated inside experts yet): the dense
    /// weights as stored, every expert read once and kept, exactly the model the file holds.
    fn open_mixture(o: &SessionOptions, policy: PolicyChoice) -> Result<Self> {
        #[cfg(feature = "gpu")]
        if o.gpu.on {
            eprintln!("gpu: a mixture of experts is not on the GPU yet; running on the CPU");
        }
        #[cfg(not(feature = "gpu"))]
        if o.gpu.on {
            say_no_gpu_support();
        }
        if policy == PolicyChoice::Leanstream {
            return Self::open_streamed_mixture(o, policy);
        }
        if !matches!(policy, PolicyChoice::Resident | PolicyChoice::Dense)
            || o.memory.is_some()
            || o.flash.is_some()
        {
            bail!(
                "{} is a mixture of experts: its experts stream with --policy leanstream (the \
                 default under --memory or --flash) or stay in memory with --policy resident or \
                 dense, without --memory and --flash; --policy {} is not implemented for experts",
                o.model.display(),
                policy_name(policy)
            );
        }
        Self::open_streamed_mixture(o, policy)
    }

    /// A converted mixture whose experts stream under `o.memory` from `o.flash`.
    fn open_streamed_mixture(o: &SessionOptions, policy: PolicyChoice) -> Result<Self> {
        let tokenizer = Tokenizer::from_lsb(&o.model)?;
        let file = LsbFile::open(&o.model)?;
        let ctx = cap_ctx(o, file.meta.model.max_position_embeddings)?;
        check_kv(o, file.meta.model.head_dim)?;
        let opts = ExpertOptions {
            memory: o.memory,
            flash: o.flash.clone(),
            ctx,
            kv: o.kv,
            tokenizer_bytes: tokenizer.resident_bytes(&file),
            lookahead: o.tuning.lookahead,
            oracle: o.tuning.expert_oracle.clone(),
        };
        let eos_token_ids = file.meta.model.eos_token_ids.clone();
        let chat_template = file.meta.chat_template.clone();
        let mut model = ExpertModel::open(&o.model, file, &opts)?;
        model.reset_clock();
        Ok(Self {
            engine: Engine::Experts(Box::new(model)),
            model_path: o.model.clone(),
            tokenizer,
            eos_token_ids,
            chat_template,
            ctx,
            context_note: None,
            policy,
        })
    }

    pub fn model(&mut self) -> &mut (dyn LanguageModel + Send) {
        match &mut self.engine {
            Engine::Dense(m) => m.as_mut(),
            Engine::Streaming(s) => s.as_mut(),
            Engine::Experts(m) => m.as_mut(),
        }
    }

    /// The kernel set, memory plan and streaming figures for `--json` (policy and kernels only for
    /// dense).
    pub fn report(&self) -> Value {
        let mut v = match &self.engine {
            Engine::Dense(_) => json!({ "policy": policy_name(self.policy) }),
            Engine::Streaming(s) => {
                let mut v = serde_json::to_value(s.summary()).expect("serialisable");
                v["policy"] = policy_name(self.policy).into();
                v["memory_budget_bytes"] = s.budget.into();
                v["memory_split"] = serde_json::to_value(&s.split).expect("serialisable");
                #[cfg(feature = "gpu")]
                if let Some(gpu) = s.gpu_summary() {
                    v["gpu"] = gpu;
                }
                v
            }
            Engine::Experts(m) => {
                let mut v = serde_json::to_value(m.summary()).expect("serialisable");
                v["policy"] = policy_name(self.policy).into();
                v["memory_budget_bytes"] = m.budget.into();
                v["expert_split"] = serde_json::to_value(&m.split).expect("serialisable");
                v
            }
        };
        v["kernels"] = crate::kernels::RowKernels::best().isa.into();
        v
    }

    /// Starts the streaming counters and clock afresh, e.g. after a warm-up.
    pub fn reset_metrics(&mut self) {
        match &mut self.engine {
            Engine::Streaming(s) => s.reset_clock(),
            Engine::Experts(m) => m.reset_clock(),
            Engine::Dense(_) => {}
        }
    }

    /// The decode step on the GPU of a converted file's model, where it runs there.
    #[cfg(feature = "gpu")]
    pub fn gpu_layers(&mut self) -> Option<&mut crate::gpu::GpuLayers> {
        match &mut self.engine {
            Engine::Streaming(s) => s.gpu().map(|g| g.layers()),
            _ => None,
        }
    }

    /// The streaming policies' read queue; `None` for dense.
    pub fn io(&self) -> Option<&crate::storage::IoQueue> {
        match &self.engine {
            Engine::Dense(_) => None,
            Engine::Streaming(s) => Some(s.io()),
            Engine::Experts(m) => Some(m.io()),
        }
    }

    /// A new memory budget, taken before the next token: the neuron cache shrinks (the memory
    /// returned to the OS before this returns) or grows. Refused, the old budget staying, below
    /// what the run needs with its dense weights as opened, and for `dense`, which has no budget.
    pub fn set_memory_budget(&mut self, bytes: u64) -> Result<()> {
        match &mut self.engine {
            Engine::Dense(_) => bail!("--policy dense has no memory budget to change"),
            Engine::Streaming(s) => s.set_budget(bytes),
            Engine::Experts(_) => bail!(EXPERT_BUDGET_FIXED),
        }
    }

    /// Follows the budget `watch` publishes (`--memory-file`, `--memory auto`) from the next token.
    pub fn follow_budget(&mut self, watch: crate::platform::elastic::BudgetWatch) -> Result<()> {
        match &mut self.engine {
            Engine::Dense(_) => bail!("--policy dense has no memory budget to follow"),
            Engine::Experts(_) => bail!(EXPERT_BUDGET_FIXED),
            Engine::Streaming(s) => {
                s.follow(watch);
                Ok(())
            }
        }
    }

    /// Whether the budget follows a watch ([`Session::follow_budget`]).
    pub fn follows_budget(&self) -> bool {
        matches!(&self.engine, Engine::Streaming(s) if s.follows())
    }

    /// Takes a budget the followed watch published, now (between requests: a server's idle
    /// worker gives memory back without waiting for the next token).
    /// Whether there was one to take.
    pub fn take_followed_budget(&mut self) -> bool {
        match &mut self.engine {
            Engine::Streaming(s) => s.take_watched_budget(),
            Engine::Dense(_) | Engine::Experts(_) => false,
        }
    }

    /// Makes room under the budget for the KV caches of `slots` sequences served at once (a
    /// server's `--parallel`): the plan holds one; the neuron cache gives up the bytes of the
    /// others. Returns how many fit (fewer than asked when the budget cannot hold them all, at
    /// least one) and the bytes set aside. Without a budget every slot fits.
    pub fn reserve_kv_slots(&mut self, slots: usize) -> Result<(usize, u64)> {
        let slots = slots.max(1);
        match &mut self.engine {
            Engine::Dense(_) => Ok((slots, 0)),
            Engine::Experts(m) => match m.budget {
                Some(_) if slots > 1 => bail!(
                    "--parallel {slots}: a mixture of experts streams under the budget it was \
                     opened with; serving several requests at once under --memory is not \
                     implemented for experts (use --parallel 1, or drop --memory)"
                ),
                _ => Ok((slots, 0)),
            },
            Engine::Streaming(s) => {
                let Some(budget) = s.budget else {
                    return Ok((slots, 0));
                };
                if slots > 1 && s.follows() {
                    bail!(
                        "--parallel {slots} sets aside KV caches under a fixed budget: give \
                         --memory a size, not auto or --memory-file, or use --parallel 1"
                    );
                }
                let per = s.split.kv_cache.max(1);
                let room = budget.saturating_sub(s.budget_floor());
                let fit = slots.min(1 + (room / per) as usize);
                let reserved = per * (fit - 1) as u64;
                if reserved > 0 {
                    s.set_budget(budget - reserved)?;
                }
                Ok((fit, reserved))
            }
        }
    }

    /// The least budget [`Session::set_memory_budget`] accepts; `None` for dense.
    pub fn budget_floor(&self) -> Option<u64> {
        match &self.engine {
            Engine::Dense(_) | Engine::Experts(_) => None,
            Engine::Streaming(s) => Some(s.budget_floor()),
        }
    }

    /// A streamed mixture's expert figures, one line, for stderr.
    pub fn describe_experts(&self) -> Option<String> {
        let Engine::Experts(m) = &self.engine else {
            return None;
        };
        let s = m.summary();
        Some(format!(
            "experts: hit rate {:.3}, look-ahead recall {:.3} precision {:.3}, {:.2} experts ({}) read per token, {:.3} of their neurons computed",
            s.expert_hit_rate,
            s.expert_lookahead_recall,
            s.expert_lookahead_precision,
            s.experts_read_per_token,
            crate::platform::memory_size::format_size(s.bytes_read_per_token as u64),
            s.expert_neuron_fraction
        ))
    }

    /// The memory split, one line, for stderr.
    pub fn describe_memory(&self) -> Option<String> {
        match &self.engine {
            Engine::Dense(_) => None,
            Engine::Streaming(s) => Some(s.split.describe()),
            Engine::Experts(m) => Some(m.split.describe()),
        }
    }
}

/// Why a streamed mixture's budget cannot change while it runs.
const EXPERT_BUDGET_FIXED: &str =
    "a mixture of experts streams under the budget it was opened with (a new budget while it runs is not implemented for experts)";

pub fn policy_name(p: PolicyChoice) -> &'static str {
    match p {
        PolicyChoice::Dense => "dense",
        PolicyChoice::Resident => "resident",
        PolicyChoice::Mmap => "mmap",
        PolicyChoice::PowerInfer2 => "powerinfer2",
        PolicyChoice::LlmInFlash => "llm-in-flash",
        PolicyChoice::Leanstream => "leanstream",
        PolicyChoice::Oracle => "oracle",
    }
}

/// The shortest context a budget may shrink the default to.
pub const MIN_SHRUNK_CTX: usize = 256;

/// The KV cache storage can hold rows of the model's head dimension.
fn check_kv(o: &SessionOptions, head_dim: usize) -> Result<()> {
    o.kv.row_bytes(head_dim)
        .map(|_| ())
        .map_err(|e| anyhow::anyhow!("{}: {e}", o.model.display()))
}

fn cap_ctx(o: &SessionOptions, max: usize) -> Result<usize> {
    let ctx = o.ctx.unwrap_or(o.default_ctx);
    if ctx < 2 {
        bail!("--ctx must be at least 2 tokens");
    }
    if ctx > max {
        if o.ctx.is_some() {
            bail!(
                "--ctx {ctx} exceeds the maximum context of {} ({max} tokens): use --ctx {max} or less",
                o.model.display()
            );
        }
        return Ok(max);
    }
    Ok(ctx)
}
