//! One bench run, executed in a process of its own (`leanstream bench-worker JOB.json`) so that its
//! peak RSS is its own and a cgroup can hold it: open the model under one policy and budget, warm
//! up, then decode the shared token sequence one token at a time, timing each step.

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::platform::memory::peak_rss_bytes;
use crate::storage::FlashProfile;
use crate::streaming::neuron_cache::Retention;
use crate::streaming::{ActiveTrace, Sparsity, Tuning};
use crate::text::perplexity::log_softmax;
use crate::text::sampler::argmax;
use crate::text::session::{GpuChoice, PolicyChoice, Session, SessionOptions};

/// Everything a worker needs; written by the orchestrator as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    pub model: PathBuf,
    pub variant: Variant,
    pub memory: Option<u64>,
    pub flash: String,
    pub ctx: usize,
    pub threads: Option<usize>,
    /// The prompt, prefilled before anything is measured.
    pub prompt: Vec<u32>,
    pub task: Task,
    /// Where to write the measured steps' timeline events (`--trace`).
    pub trace: Option<PathBuf>,
    /// The recorded active sets of the prompt and sequence: the truth of every streaming run's
    /// metrics, and the oracle's knowledge.
    pub active_trace: Option<PathBuf>,
    /// A mixture's recorded experts of the prompt and sequence (the expert oracle's knowledge).
    #[serde(default)]
    pub expert_trace: Option<PathBuf>,
}

/// A policy with its settings; `label` names it in tables and plots.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Variant {
    pub label: String,
    pub policy: String,
    pub predicted: bool,
    pub lookahead: bool,
    pub always_lookahead: bool,
    pub retain_lru: bool,
    pub refine: bool,
    pub cancel: bool,
    pub hot_fraction: Option<f32>,
    pub window: Option<usize>,
    /// A mixture's expert oracle: the true experts guessed, Belady retention.
    #[serde(default)]
    pub expert_oracle: bool,
    /// The oracle computing as the exact engine does (`oracle-exact`).
    #[serde(default)]
    pub oracle_exact: bool,
}

impl Variant {
    pub fn new(policy: PolicyChoice) -> Self {
        Self {
            label: crate::text::session::policy_name(policy).to_string(),
            policy: crate::text::session::policy_name(policy).to_string(),
            predicted: matches!(policy, PolicyChoice::PowerInfer2 | PolicyChoice::LlmInFlash),
            lookahead: true,
            always_lookahead: false,
            retain_lru: false,
            refine: true,
            cancel: true,
            hot_fraction: None,
            window: None,
            expert_oracle: false,
            oracle_exact: false,
        }
    }

    /// Whether the policy computes every active neuron (its output is resident's).
    pub fn exact(&self) -> bool {
        !self.predicted && self.policy != "dense"
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Task {
    /// Greedy-decode `tokens` tokens after the prompt (the shared sequence, from `resident`).
    Generate { tokens: usize },
    /// Decode `sequence` token by token: the first `warmup` steps unmeasured, then the rest timed.
    /// Log-softmax rows of every measured step go to `record` (the dense reference) or are compared
    /// with the rows in `reference`.
    Decode {
        sequence: Vec<u32>,
        warmup: usize,
        record: Option<PathBuf>,
        reference: Option<PathBuf>,
    },
    /// Decode `sequence` as `Decode` does, taking `budgets[i]` before the `i`-th `step_tokens`
    /// tokens after the warm-up (`bench --elastic`).
    Elastic {
        sequence: Vec<u32>,
        warmup: usize,
        budgets: Vec<u64>,
        step_tokens: usize,
    },
    /// Prefill the prompt in chunks as `run` does (timed: prompt tokens/s, and the time to the
    /// first token, the greedy pick after it), then greedy-decode `tokens` tokens, timed
    /// (`bench --prompt`).
    Prefill { tokens: usize },
}

/// What a worker prints.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Outcome {
    /// The greedy continuation (a `Generate` task).
    pub generated: Vec<u32>,
    pub tokens: usize,
    pub tokens_per_s: f64,
    pub ms_per_token_p50: f64,
    pub ms_per_token_p99: f64,
    pub peak_rss_bytes: Option<u64>,
    /// Mean KL divergence (nats) of the policy's next-token distribution from dense's.
    pub kl_vs_dense: Option<f64>,
    /// Fraction of steps whose most likely token is dense's.
    pub top1_vs_dense: Option<f64>,
    /// The streaming engine's report (`memory_split`, bytes and reads per token, hit rate...).
    pub report: serde_json::Value,
    /// Why the policy could not start under this budget (e.g. below its minimum).
    pub error: Option<String>,
    /// `mmap` runs: the peak charge of the memory cgroup that enforced the budget (the process's
    /// memory and the page cache it filled).
    pub memory_group_peak_bytes: Option<u64>,
    /// `Elastic` runs: every measured token, and whether each step's most likely token was the
    /// sequence's.
    #[serde(default)]
    pub elastic: Vec<super::elastic::Point>,
    pub exact: Option<bool>,
    /// `Prefill` runs: the prompt's tokens, their rate, and the time to the first token.
    #[serde(default)]
    pub prompt_tokens: usize,
    #[serde(default)]
    pub prompt_tokens_per_s: f64,
    #[serde(default)]
    pub ttft_ms: f64,
    /// The process's CPU time (user and system, every thread) over the prefill: on a loaded
    /// machine, waiting for a CPU is not charged to it.
    #[serde(default)]
    pub prompt_cpu_s: f64,
}

/// The `bench-worker` entry point: runs `job_path` and prints the outcome as JSON on stdout.
pub fn run_worker(job_path: &Path) -> Result<()> {
    let text = std::fs::read_to_string(job_path)
        .with_context(|| format!("cannot read bench job {}", job_path.display()))?;
    let job: Job = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a bench job", job_path.display()))?;
    if let Some(t) = job.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .context("cannot start the thread pool")?;
    }
    let outcome = execute(&job)?;
    println!("{}", serde_json::to_string(&outcome)?);
    Ok(())
}

fn session_options(job: &Job) -> Result<SessionOptions> {
    let v = &job.variant;
    let policy = PolicyChoice::from_name(&v.policy)
        .with_context(|| format!("unknown policy {:?}", v.policy))?;
    Ok(SessionOptions {
        model: job.model.clone(),
        policy: Some(policy),
        memory: job.memory,
        flash: FlashProfile::from_flash_arg(&job.flash)?,
        sparsity: if v.predicted {
            Sparsity::Predicted
        } else {
            Sparsity::Certified
        },
        ctx: Some(job.ctx),
        default_ctx: job.ctx,
        kv: Default::default(),
        tuning: Tuning {
            lookahead: v.lookahead,
            always_lookahead: v.always_lookahead,
            retention: if v.retain_lru {
                Retention::Lru
            } else {
                Retention::Activity
            },
            refine: v.refine,
            cancel: v.cancel,
            hot_fraction: v.hot_fraction,
            window: v.window,
            oracle: match &job.active_trace {
                Some(p) => Some(Arc::new(read_trace(p)?)),
                None => None,
            },
            oracle_exact_compute: v.oracle_exact,
            expert_oracle: match (&job.expert_trace, v.expert_oracle) {
                (Some(p), true) => {
                    let bytes =
                        std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?;
                    Some(Arc::new(serde_json::from_slice(&bytes).with_context(
                        || format!("{} is not an expert trace", p.display()),
                    )?))
                }
                _ => None,
            },
        },
        gpu: GpuChoice::from_env(),
    })
}

fn read_trace(path: &Path) -> Result<ActiveTrace> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not an active trace", path.display()))
}

fn execute(job: &Job) -> Result<Outcome> {
    // A policy that cannot run under the budget is a result (it needs more memory), not a failure.
    let mut session = match Session::open(&session_options(job)?) {
        Ok(s) => s,
        Err(e) => {
            return Ok(Outcome {
                error: Some(format!("{e:#}")),
                ..Default::default()
            })
        }
    };
    if let Task::Prefill { tokens } = job.task {
        return super::prefill::measure(job, &mut session, tokens);
    }
    let model = session.model();
    let mut cache = model.new_cache(job.ctx);
    let vocab = model.config().vocab_size;
    let mut logits = Vec::new();
    // One token per call, as decoding does: the oracle's trace is recorded that way.
    for &t in &job.prompt {
        model.forward_into(&[t], &mut cache, false, &mut logits)?;
    }
    if let Task::Decode {
        sequence, warmup, ..
    }
    | Task::Elastic {
        sequence, warmup, ..
    } = &job.task
    {
        warm_up(
            job,
            &mut session,
            &mut cache,
            &mut logits,
            sequence,
            *warmup,
        )?;
    }
    match &job.task {
        Task::Generate { tokens } => {
            let model = session.model();
            let mut generated = Vec::with_capacity(*tokens);
            for _ in 0..*tokens {
                if cache.len() >= job.ctx {
                    bail!("the bench sequence does not fit in --ctx {}", job.ctx);
                }
                let next = argmax(&logits);
                generated.push(next);
                model.forward_into(&[next], &mut cache, false, &mut logits)?;
            }
            Ok(Outcome {
                generated,
                ..Default::default()
            })
        }
        Task::Decode {
            sequence,
            warmup,
            record,
            reference,
        } => {
            if let (Some(io), Some(_)) = (session.io(), &job.trace) {
                io.record_spans();
            }
            #[cfg(feature = "gpu")]
            if let (Some(gpu), Some(_)) = (session.gpu_layers(), &job.trace) {
                gpu.record_spans();
            }
            let model = session.model();
            let mut rows = RowsIo::open(record.as_deref(), reference.as_deref(), vocab)?;
            let t0 = Instant::now();
            let mut steps = Vec::with_capacity(sequence.len() - warmup);
            for &t in &sequence[*warmup..] {
                rows.step(&logits)?;
                let start = Instant::now();
                model.forward_into(&[t], &mut cache, false, &mut logits)?;
                steps.push((start, Instant::now()));
            }
            // Measured before the timeline is serialised: that is bookkeeping, not the run.
            let peak_rss = peak_rss_bytes();
            if let Some(path) = &job.trace {
                let reads = session.io().map(|io| io.take_spans()).unwrap_or_default();
                #[allow(unused_mut)]
                let mut events = super::trace::run_events(t0, &steps, &reads);
                #[cfg(feature = "gpu")]
                if let Some(gpu) = session.gpu_layers() {
                    events.extend(super::trace::gpu_events(t0, &gpu.take_spans()));
                }
                std::fs::write(path, serde_json::to_vec(&events)?)
                    .with_context(|| format!("cannot write {}", path.display()))?;
            }
            let times: Vec<f64> = steps.iter().map(|(a, b)| (*b - *a).as_secs_f64()).collect();
            let mut outcome = timing(&times);
            (outcome.kl_vs_dense, outcome.top1_vs_dense) = rows.finish()?;
            outcome.report = session.report();
            outcome.peak_rss_bytes = peak_rss;
            Ok(outcome)
        }
        Task::Elastic {
            sequence,
            warmup,
            budgets,
            step_tokens,
        } => {
            let (points, exact) = super::elastic::decode(
                &mut session,
                &mut cache,
                &mut logits,
                sequence,
                *warmup,
                budgets,
                *step_tokens,
            )?;
            let times: Vec<f64> = points.iter().map(|p| p.step_ms / 1e3).collect();
            let mut outcome = timing(&times);
            outcome.peak_rss_bytes = peak_rss_bytes();
            outcome.report = session.report();
            outcome.elastic = points;
            outcome.exact = Some(exact);
            Ok(outcome)
        }
        Task::Prefill { .. } => unreachable!("measured above"),
    }
}

/// Checks that the prompt and `sequence` fit the context, decodes the first `warmup` tokens of
/// `sequence` unmeasured, and starts the measurement.
fn warm_up(
    job: &Job,
    session: &mut Session,
    cache: &mut crate::model::kv_cache::KvCache,
    logits: &mut Vec<f32>,
    sequence: &[u32],
    warmup: usize,
) -> Result<()> {
    if job.prompt.len() + sequence.len() > job.ctx {
        bail!(
            "prompt and sequence ({} tokens) do not fit in --ctx {}",
            job.prompt.len() + sequence.len(),
            job.ctx
        );
    }
    for &t in &sequence[..warmup] {
        session.model().forward_into(&[t], cache, false, logits)?;
    }
    session.reset_metrics();
    Ok(())
}

/// Throughput and per-token latency percentiles from per-step times (seconds).
pub(super) fn timing(times: &[f64]) -> Outcome {
    let total: f64 = times.iter().sum();
    let mut ms: Vec<f64> = times.iter().map(|t| t * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let pct = |q: f64| {
        ms.get(((ms.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    Outcome {
        tokens: times.len(),
        tokens_per_s: if total > 0.0 {
            times.len() as f64 / total
        } else {
            0.0
        },
        ms_per_token_p50: pct(0.5),
        ms_per_token_p99: pct(0.99),
        ..Default::default()
    }
}

/// Writes the reference's log-softmax rows, or compares each step with them (KL and top-1).
struct RowsIo {
    record: Option<BufWriter<std::fs::File>>,
    reference: Option<(BufReader<std::fs::File>, PathBuf)>,
    vocab: usize,
    kl: f64,
    agree: usize,
    steps: usize,
}

impl RowsIo {
    fn open(record: Option<&Path>, reference: Option<&Path>, vocab: usize) -> Result<Self> {
        let create = |p: &Path| {
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))
        };
        let open = |p: &Path| {
            std::fs::File::open(p).with_context(|| format!("cannot open {}", p.display()))
        };
        Ok(Self {
            record: record.map(create).transpose()?.map(BufWriter::new),
            reference: match reference {
                Some(p) => Some((BufReader::new(open(p)?), p.to_path_buf())),
                None => None,
            },
            vocab,
            kl: 0.0,
            agree: 0,
            steps: 0,
        })
    }

    fn step(&mut self, logits: &[f32]) -> Result<()> {
        if self.record.is_none() && self.reference.is_none() {
            return Ok(());
        }
        let lp = log_softmax(logits);
        if let Some(w) = &mut self.record {
            for &v in &lp {
                w.write_all(&(v as f32).to_le_bytes())?;
            }
        }
        if let Some((r, path)) = &mut self.reference {
            let mut bytes = vec![0u8; self.vocab * 4];
            r.read_exact(&mut bytes)
                .with_context(|| format!("{} ends early", path.display()))?;
            let reference: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            self.kl += reference
                .iter()
                .zip(&lp)
                .map(|(&p, &q)| (p as f64).exp() * (p as f64 - q))
                .sum::<f64>();
            self.agree += usize::from(argmax(&reference) == argmax(logits));
        }
        self.steps += 1;
        Ok(())
    }

    fn finish(self) -> Result<(Option<f64>, Option<f64>)> {
        if let Some(mut w) = self.record {
            w.flush()?;
        }
        if self.reference.is_none() || self.steps == 0 {
            return Ok((None, None));
        }
        let n = self.steps as f64;
        Ok((Some(self.kl / n), Some(self.agree as f64 / n)))
    }
}
