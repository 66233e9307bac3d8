//! `leanstream bench --prompt N`: prompt processing beside decode. Each policy prefills the same
//! N-token prompt in chunks as `run` does (after one unmeasured prefill that warms the caches),
//! picks its first token, then decodes `--tokens` tokens greedily, in a process of its own; the
//! table gives prefill tokens/s, the time to the first token and decode tokens/s side by side.

use std::time::Instant;

use anyhow::{bail, Result};
use serde::Serialize;

use super::job::{timing, Job, Outcome, Task, Variant};
use super::{budget_free, expand_policies, resolve_budgets, tempdir, BenchArgs, Runner};
use crate::platform::memory_size::format_size;
use crate::text::sampler::argmax;
use crate::text::session::{PolicyChoice, Session};
use crate::tokenizer::Tokenizer;

/// One policy's prompt processing and decode.
#[derive(Debug, Clone, Serialize)]
pub struct PrefillRun {
    pub policy: String,
    pub memory_budget_bytes: Option<u64>,
    pub prompt_tokens: usize,
    pub prompt_tokens_per_s: f64,
    /// Prefill of the whole prompt plus the pick of the first token.
    pub ttft_ms: f64,
    /// Prompt tokens per second of the process's CPU time (every thread's): the figure a loaded
    /// machine disturbs least.
    pub prompt_tokens_per_cpu_s: f64,
    pub tokens: usize,
    pub tokens_per_s: f64,
    pub ms_per_token_p50: f64,
    pub peak_rss_bytes: Option<u64>,
    pub threads: Option<usize>,
    /// Everything the engine reported.
    pub details: serde_json::Value,
    /// Set when the policy could not run under the budget.
    pub error: Option<String>,
}

/// `prompt_tokens` token ids: `text` (encoded with its start token), then `text` again and again
/// without it, cut at `prompt_tokens`.
pub fn prompt_of(tokenizer: &Tokenizer, text: &str, prompt_tokens: usize) -> Result<Vec<u32>> {
    let mut ids = tokenizer.encode(text, true)?;
    let again = tokenizer.encode(&format!(" {text}"), false)?;
    if again.is_empty() {
        bail!("the prompt encodes to no tokens: give some text");
    }
    while ids.len() < prompt_tokens {
        ids.extend_from_slice(&again);
    }
    ids.truncate(prompt_tokens);
    Ok(ids)
}

/// The policies `--policy` names for a prompt bench: `all` is `resident` and `dense` (`resident`
/// only for synthetic weights, whose dense form may not fit in memory).
fn policies(args: &BenchArgs, synthetic: bool) -> Result<Vec<Variant>> {
    if args.policy.iter().any(|p| p == "all") {
        let mut v = vec![Variant::new(PolicyChoice::Resident)];
        if !synthetic {
            v.push(Variant::new(PolicyChoice::Dense));
        }
        return Ok(v);
    }
    expand_policies(&args.policy, &args.flash)
}

pub(super) fn run(args: &BenchArgs, text: &str, prompt_tokens: usize) -> Result<()> {
    let file = leanstream_format::LsbFile::open(&args.model)?;
    let synthetic = file.meta.synthetic.is_some();
    drop(file);
    let tokenizer = Tokenizer::from_lsb(&args.model)?;
    let prompt = prompt_of(&tokenizer, text, prompt_tokens)?;
    let tokens = args.tokens as usize;
    let ctx = args.ctx.max(prompt.len() + tokens + 1);
    let variants = policies(args, synthetic)?;
    let budgets = if variants.iter().all(budget_free) {
        Vec::new()
    } else {
        resolve_budgets(&args.model, ctx, &args.memory)?
    };
    let bar = indicatif::ProgressBar::hidden();
    let work = tempdir(&args.model)?;
    let runner = Runner {
        args,
        prompt,
        work: work.path.clone(),
        bar: &bar,
        moe: false,
    };
    let mut runs = Vec::new();
    for v in &variants {
        let at: Vec<Option<u64>> = if budget_free(v) {
            vec![None]
        } else {
            budgets.iter().map(|b| Some(b.0)).collect()
        };
        for memory in at {
            for r in 0..args.repeat {
                eprintln!(
                    "bench: {} at {}, prompt of {} tokens{}",
                    v.label,
                    memory.map_or("no budget".into(), format_size),
                    runner.prompt.len(),
                    if args.repeat > 1 {
                        format!(" (run {} of {})", r + 1, args.repeat)
                    } else {
                        String::new()
                    }
                );
                let o = runner.execute_at(v, memory, ctx, Task::Prefill { tokens })?;
                runs.push(PrefillRun {
                    policy: v.label.clone(),
                    memory_budget_bytes: memory,
                    prompt_tokens: o.prompt_tokens,
                    prompt_tokens_per_s: o.prompt_tokens_per_s,
                    ttft_ms: o.ttft_ms,
                    prompt_tokens_per_cpu_s: o.prompt_tokens as f64 / o.prompt_cpu_s.max(1e-9),
                    tokens: o.tokens,
                    tokens_per_s: o.tokens_per_s,
                    ms_per_token_p50: o.ms_per_token_p50,
                    peak_rss_bytes: o.peak_rss_bytes,
                    threads: args.threads.map(usize::from),
                    details: o.report,
                    error: o.error,
                });
            }
        }
    }
    if args.json {
        let obj =
            serde_json::json!({ "runs": runs, "kernels": crate::kernels::RowKernels::best().isa });
        println!("{}", serde_json::to_string_pretty(&obj)?);
    } else {
        print_table(&runs);
    }
    Ok(())
}

fn print_table(runs: &[PrefillRun]) {
    println!(
        "{:<14} {:>12} {:>8} {:>12} {:>12} {:>14} {:>8} {:>12} {:>10}",
        "policy",
        "budget",
        "prompt",
        "prefill t/s",
        "t/CPU s",
        "first token ms",
        "decoded",
        "decode t/s",
        "peak RSS"
    );
    for r in runs {
        let budget = r.memory_budget_bytes.map_or("-".into(), format_size);
        if let Some(e) = &r.error {
            println!("{:<14} {:>12}  cannot run: {e}", r.policy, budget);
            continue;
        }
        println!(
            "{:<14} {:>12} {:>8} {:>12.1} {:>12.1} {:>14.0} {:>8} {:>12.1} {:>10}",
            r.policy,
            budget,
            r.prompt_tokens,
            r.prompt_tokens_per_s,
            r.prompt_tokens_per_cpu_s,
            r.ttft_ms,
            r.tokens,
            r.tokens_per_s,
            r.peak_rss_bytes.map_or("-".into(), format_size)
        );
    }
    println!(
        "kernels: {}; threads: {}",
        crate::kernels::RowKernels::best().isa,
        runs.first()
            .and_then(|r| r.threads)
            .map_or("default".into(), |t| t.to_string())
    );
}

/// The worker's side: one unmeasured prefill, then the measured prefill, first token and decode.
pub(super) fn measure(job: &Job, session: &mut Session, tokens: usize) -> Result<Outcome> {
    let model = session.model();
    let chunk = model.prompt_chunk();
    let mut logits = Vec::new();
    let mut warm = model.new_cache(job.ctx);
    for c in job.prompt.chunks(chunk) {
        model.forward_into(c, &mut warm, false, &mut logits)?;
    }
    drop(warm);
    let mut cache = model.new_cache(job.ctx);
    let (start, cpu) = (Instant::now(), process_cpu_s());
    for c in job.prompt.chunks(chunk) {
        model.forward_into(c, &mut cache, false, &mut logits)?;
    }
    let prefilled = start.elapsed().as_secs_f64();
    let prompt_cpu_s = process_cpu_s() - cpu;
    let mut next = argmax(&logits);
    let ttft = start.elapsed().as_secs_f64();
    let mut times = Vec::with_capacity(tokens);
    for _ in 0..tokens {
        let t = Instant::now();
        model.forward_into(&[next], &mut cache, false, &mut logits)?;
        next = argmax(&logits);
        times.push(t.elapsed().as_secs_f64());
    }
    let mut outcome = timing(&times);
    outcome.prompt_tokens = job.prompt.len();
    outcome.prompt_tokens_per_s = job.prompt.len() as f64 / prefilled;
    outcome.ttft_ms = ttft * 1e3;
    outcome.prompt_cpu_s = prompt_cpu_s;
    outcome.peak_rss_bytes = crate::platform::memory::peak_rss_bytes();
    outcome.report = session.report();
    Ok(outcome)
}

/// CPU time of this process so far (every thread, user and system), in seconds.
fn process_cpu_s() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    if rc != 0 {
        return f64::NAN;
    }
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}
