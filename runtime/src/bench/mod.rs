//! `leanstream bench`: every policy at every memory budget decodes the same tokens from the same
//! prompt after the same warm-up, each run in a fresh process; a table, headline ratios, JSON and a
//! plot come out of one invocation, so ratios are measured side by side.
//!
//! The token sequence is the greedy continuation of the prompt under `resident` (the file's
//! sparsity, every bundle in DRAM); every policy is fed that sequence, so their outputs can be
//! compared with the dense reference position by position.

mod elastic;
mod job;
mod moe;
mod plot;
mod prefill;
mod report;
mod trace;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

use crate::platform::cgroup::MemoryGroup;
use crate::platform::memory_size::{format_size, parse_size};
use crate::text::session::PolicyChoice;
use crate::tokenizer::Tokenizer;

pub use job::run_worker;
use job::{Job, Outcome, Task, Variant};
pub use report::Run;

/// The prompt used when no `--prompt-file` is given.
const DEFAULT_PROMPT: &str = "It was a fine morning in early spring, and the family had gathered";

#[derive(clap::Args)]
pub struct BenchArgs {
    /// A converted LeanStream file.
    #[arg(long)]
    model: PathBuf,
    /// Memory budgets, comma-separated: sizes (512MiB, 300MB, bytes) or ffn:P% (the policy
    /// minimum plus P% of the FFN bundles).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ffn:10%,ffn:25%,ffn:50%,ffn:100%"
    )]
    memory: Vec<String>,
    /// Policies, comma-separated, or `all`. Besides the policies of `run --policy`, the ablations
    /// leanstream-no-lookahead, -always-lookahead, -no-refine, -no-cancel, -lru and -predicted,
    /// and oracle-exact (the oracle's reads, the exact engine's compute: every gate it holds).
    /// A mixture of experts runs leanstream, leanstream-no-lookahead and expert-oracle, at budgets
    /// given as sizes, `min` or ffn:P% (every dense weight resident, 2k slots, P% of the experts).
    #[arg(long, value_delimiter = ',', default_value = "all")]
    policy: Vec<String>,
    /// Flash device: ufs4, ufs31, nvme, a profile FILE.toml, or none (the real disk, direct I/O).
    #[arg(long, default_value = "ufs4")]
    flash: String,
    /// Tokens decoded and measured per run (after the warm-up).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    tokens: u64,
    /// Decode steps run before measuring (they warm the caches).
    #[arg(long, default_value_t = 4)]
    warmup: usize,
    /// A text file whose content is the prompt.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Compute threads of each run.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,
    /// Runs of each policy at each budget, interleaved (every policy at every budget once, then
    /// again): each row is the run with the median tokens/s, `tokens_per_s_runs` has them all.
    /// One run's timing moves with whatever else the machine does; bytes and hits do not.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=50))]
    repeat: u16,
    /// Context length of each run (its KV cache counts against the budget).
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Print one JSON object `{"runs": [...], "summary": {...}}` instead of the table.
    #[arg(long)]
    json: bool,
    /// Write an SVG plot of tokens/s versus memory, one line per policy.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Write a timeline of every run's reads and decode steps (Chrome trace format; Perfetto).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Budgets one leanstream run steps through while it decodes, in order, comma-separated
    /// (sizes or ffn:P%, as --memory): instead of the table of policies and budgets, a trace of
    /// the resident set and tokens/s over time (--plot draws it); --memory and --policy are not
    /// used.
    #[arg(long, value_delimiter = ',')]
    elastic: Vec<String>,
    /// Prompt processing: every policy prefills a prompt of this many tokens (the prompt text
    /// repeated to length) in chunks as `run` does, then decodes --tokens tokens; the table gives
    /// prefill tokens/s and the time to the first token beside decode tokens/s. `--policy all`
    /// is resident and dense here; --ctx grows to hold the prompt and the tokens.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    prompt: Option<u64>,
    /// Tokens decoded at each --elastic budget.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..))]
    step_tokens: u64,
}

pub fn run(args: BenchArgs) -> Result<()> {
    let file = leanstream_format::LsbFile::open(&args.model)?;
    let tokenizer = Tokenizer::from_lsb(&args.model)?;
    // Random weights carry no quality worth measuring, and their dense form (f32) may not even
    // fit in memory at the 7B scale: synthetic files get no dense reference.
    let synthetic = file.meta.synthetic.is_some();
    let mixture = file.meta.model.moe.is_some();
    drop(file);
    let prompt_text = match &args.prompt_file {
        Some(p) => crate::tokenizer::read_text(p)?,
        None => DEFAULT_PROMPT.to_string(),
    };
    if let Some(n) = args.prompt {
        if mixture || !args.elastic.is_empty() {
            bail!("--prompt measures a dense model's prompt processing: leave out --elastic (a mixture of experts is not supported)");
        }
        return prefill::run(&args, &prompt_text, n as usize);
    }
    let prompt = tokenizer.encode(&prompt_text, true)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens: give some text");
    }
    if mixture {
        if !args.elastic.is_empty() {
            bail!("--elastic is not implemented for a mixture of experts");
        }
        return moe::run(&args, prompt);
    }
    if !args.elastic.is_empty() {
        return run_elastic(&args, prompt);
    }
    let budgets = resolve_budgets(&args.model, args.ctx, &args.memory)?;
    let variants = expand_policies(&args.policy, &args.flash)?;
    let per_budget: Vec<&Variant> = variants.iter().filter(|v| !budget_free(v)).collect();
    let repeat = args.repeat as usize;
    let total = variants.len() - per_budget.len() + per_budget.len() * budgets.len() * repeat + 2;
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("bench {bar:40} {pos}/{len} runs  {elapsed}  {msg}")
            .expect("valid template"),
    );
    let work = tempdir(&args.model)?;
    let runner = Runner {
        args: &args,
        prompt,
        work: work.path.clone(),
        bar: &bar,
        moe: false,
    };
    // The shared sequence, then the dense reference distributions of each measured step.
    let warmup = args.warmup;
    bar.set_message("resident: the token sequence");
    let sequence = runner.resident_sequence(warmup + args.tokens as usize)?;
    // The true active sets of the sequence: the oracle's knowledge, and the truth against which
    // every streaming run's predictors and hits are measured (predicted runs compute only what
    // they predict, so what they computed cannot serve as the truth).
    if !per_budget.is_empty() {
        bar.set_message("resident: the true active sets");
        runner.record_active_trace(&sequence)?;
    }
    let reference = (!synthetic).then(|| work.path.join("dense.logprobs"));
    let decode = |record: Option<PathBuf>, reference: Option<PathBuf>| Task::Decode {
        sequence: sequence.clone(),
        warmup,
        record,
        reference,
    };
    let dense = Variant::new(PolicyChoice::Dense);
    let mut runs = Vec::new();
    match &reference {
        Some(path) => {
            bar.set_message("dense: the reference");
            let outcome = runner.execute(&dense, None, decode(Some(path.clone()), None))?;
            runs.push(Run::new(dense.clone(), None, outcome));
        }
        None => bar.println("note: synthetic weights: no dense run, no quality figures"),
    }
    for v in variants.iter().filter(|v| budget_free(v) && **v != dense) {
        bar.set_message(v.label.clone());
        let outcome = runner.execute(v, None, decode(None, reference.clone()))?;
        runs.push(Run::new(v.clone(), None, outcome));
    }
    let mut timelines = Vec::new();
    let mut outcomes: Vec<Vec<Outcome>> = vec![Vec::new(); budgets.len() * per_budget.len()];
    for r in 0..repeat {
        for (b, &(budget, ref label)) in budgets.iter().enumerate() {
            for (i, v) in per_budget.iter().enumerate() {
                let round = if repeat > 1 {
                    format!(" (run {} of {repeat})", r + 1)
                } else {
                    String::new()
                };
                bar.set_message(format!("{} at {label}{round}", v.label));
                let outcome = runner.execute(v, Some(budget), decode(None, reference.clone()))?;
                if let Some(events) = runner.take_timeline()? {
                    timelines.push((format!("{} at {label}{round}", v.label), events));
                }
                outcomes[b * per_budget.len() + i].push(outcome);
            }
        }
    }
    for (b, &(budget, _)) in budgets.iter().enumerate() {
        for (i, v) in per_budget.iter().enumerate() {
            let all = std::mem::take(&mut outcomes[b * per_budget.len() + i]);
            runs.push(median_run(v, budget, all));
        }
    }
    bar.finish_and_clear();
    if let Some(path) = &args.trace {
        trace::write(path, timelines)?;
    }
    let summary = report::summarise(&runs);
    if let Some(path) = &args.plot {
        plot::write(path, &runs, &args.model)?;
    }
    if args.json {
        let obj = serde_json::json!({ "runs": runs, "summary": summary });
        println!("{}", serde_json::to_string_pretty(&obj)?);
    } else {
        report::print_table(&runs, &budgets);
        report::print_summary(&summary);
    }
    if !summary.faster_than_oracle.is_empty() {
        eprintln!(
            "note: faster than the oracle at no fewer bytes (one timing per run: load from other processes, or the oracle's bookkeeping): {}",
            summary.faster_than_oracle.join("; ")
        );
    }
    if !summary.oracle_violations.is_empty() {
        bail!(
            "a policy read fewer bytes than the oracle, which is impossible if both are right: {}",
            summary.oracle_violations.join("; ")
        );
    }
    Ok(())
}

/// `--elastic`: the resident sequence, then one leanstream run stepping through the budgets.
fn run_elastic(args: &BenchArgs, prompt: Vec<u32>) -> Result<()> {
    let plan = crate::streaming::memory_split(&args.model, args.ctx)?;
    let steps = args
        .elastic
        .iter()
        .map(|spec| resolve_budget(&plan, spec))
        .collect::<Result<Vec<_>>>()?;
    let step_tokens = args.step_tokens as usize;
    let bar = ProgressBar::new(3);
    let work = tempdir(&args.model)?;
    let runner = Runner {
        args,
        prompt,
        work: work.path.clone(),
        bar: &bar,
        moe: false,
    };
    bar.set_message("resident: the token sequence");
    let tokens = args.warmup + steps.len() * step_tokens + 1;
    let sequence = runner.resident_sequence(tokens)?;
    bar.set_message("resident: the true active sets");
    runner.record_active_trace(&sequence)?;
    bar.set_message("leanstream: stepping the budget");
    let outcome = runner.execute(
        &Variant::new(PolicyChoice::Leanstream),
        Some(steps[0].0),
        Task::Elastic {
            sequence,
            warmup: args.warmup,
            budgets: steps.iter().map(|s| s.0).collect(),
            step_tokens,
        },
    )?;
    bar.finish_and_clear();
    if let Some(e) = outcome.error {
        bail!("leanstream cannot start at {}: {e}", steps[0].1);
    }
    let exact = outcome.exact == Some(true);
    if args.json {
        let obj = serde_json::json!({
            "points": outcome.elastic,
            "identical_to_resident": exact,
            "budget_changes": outcome.report["budget_changes"],
            "reread_bytes": outcome.report["reread_bytes"],
            "refill_reads": outcome.report["refill_reads"],
            "tokens_per_s": outcome.tokens_per_s,
        });
        println!("{}", serde_json::to_string_pretty(&obj)?);
    } else {
        elastic::print_table(&outcome.elastic, step_tokens);
        elastic::print_changes(&outcome.report["budget_changes"]);
        println!(
            "identical to resident: {exact}; re-read after growing: {}; refill reads: {}",
            format_size(outcome.report["reread_bytes"].as_u64().unwrap_or(0)),
            outcome.report["refill_reads"]
        );
    }
    if let Some(path) = &args.plot {
        let name = args.model.file_name().unwrap_or(args.model.as_os_str());
        let title = format!(
            "{}: resident set and tokens/s as the budget steps ({} flash)",
            name.to_string_lossy(),
            args.flash
        );
        elastic::write_plot(path, &outcome.elastic, &title)?;
    }
    if !exact {
        bail!("the tokens of the run whose budget changed differ from resident's");
    }
    Ok(())
}

/// Budgets as bytes with their labels, smallest first.
fn resolve_budgets(model: &Path, ctx: usize, specs: &[String]) -> Result<Vec<(u64, String)>> {
    let plan = crate::streaming::memory_split(model, ctx)?;
    let mut out = specs
        .iter()
        .map(|spec| resolve_budget(&plan, spec))
        .collect::<Result<Vec<_>>>()?;
    out.sort_by_key(|b| b.0);
    out.dedup_by_key(|b| b.0);
    Ok(out)
}

/// A budget as bytes with its label: a size, or ffn:P% (the minimum with every dense weight
/// resident plus P% of the FFN bundles).
fn resolve_budget(plan: &crate::streaming::MemorySplit, spec: &str) -> Result<(u64, String)> {
    let spec = spec.trim();
    Ok(match spec.strip_prefix("ffn:") {
        Some(pct) => {
            let b = plan.budget_for_ffn_share(ffn_percent(spec, pct)? / 100.0);
            (b, format!("{spec} ({})", format_size(b)))
        }
        None => {
            let b = parse_size(spec).with_context(|| format!("--memory {spec}"))?;
            (b, format_size(b))
        }
    })
}

/// P of `--memory ffn:P%` (`spec`), between 0 and 100.
fn ffn_percent(spec: &str, pct: &str) -> Result<f64> {
    pct.trim_end_matches('%')
        .parse()
        .ok()
        .filter(|p: &f64| (0.0..=100.0).contains(p))
        .with_context(|| format!("--memory {spec}: write ffn:P% with P between 0 and 100"))
}

/// Policies as runnable variants; `all` is every policy and ablation.
fn expand_policies(names: &[String], flash: &str) -> Result<Vec<Variant>> {
    let all: Vec<String> = PolicyChoice::ALL
        .iter()
        .map(|&p| crate::text::session::policy_name(p).to_string())
        .chain(ABLATIONS.iter().map(|s| s.to_string()))
        .collect();
    let names: Vec<String> = if names.iter().any(|n| n == "all") {
        all.clone()
    } else {
        names.to_vec()
    };
    let mut out = Vec::new();
    for name in &names {
        let expanded = variants(name)
            .with_context(|| format!("unknown policy {name:?}: choose from {}", all.join(", ")))?;
        if name == "mmap" && flash != "none" {
            eprintln!("note: mmap reads through the page cache of the real disk; skipped under --flash {flash}");
            continue;
        }
        for v in expanded {
            if !out.contains(&v) {
                out.push(v);
            }
        }
    }
    Ok(out)
}

/// Ablations of leanstream, each turning one of its parts off, and the oracle computing as the
/// exact engine does.
const ABLATIONS: [&str; 7] = [
    "oracle-exact",
    "leanstream-no-lookahead",
    "leanstream-always-lookahead",
    "leanstream-no-refine",
    "leanstream-no-cancel",
    "leanstream-lru",
    "leanstream-predicted",
];

/// The prior systems' settings swept at every budget (the best is what the summary compares):
/// PowerInfer-2's pinned hot set as a fraction of the cache, LLM in a Flash's window in tokens.
const HOT_FRACTIONS: [f32; 3] = [0.5, 0.75, 1.0];
const WINDOWS: [usize; 3] = [2, 5, 10];

/// The variants a policy name stands for (several for a swept prior policy).
fn variants(name: &str) -> Option<Vec<Variant>> {
    if let Some(p) = PolicyChoice::from_name(name) {
        let base = Variant::new(p);
        return Some(match p {
            PolicyChoice::PowerInfer2 => HOT_FRACTIONS
                .iter()
                .map(|&h| Variant {
                    label: format!("{name}(hot={h})"),
                    hot_fraction: Some(h),
                    ..base.clone()
                })
                .collect(),
            PolicyChoice::LlmInFlash => WINDOWS
                .iter()
                .map(|&k| Variant {
                    label: format!("{name}(k={k})"),
                    window: Some(k),
                    ..base.clone()
                })
                .collect(),
            _ => vec![base],
        });
    }
    if name == "oracle-exact" {
        let mut v = Variant::new(PolicyChoice::Oracle);
        v.label = name.to_string();
        v.oracle_exact = true;
        return Some(vec![v]);
    }
    let mut v = Variant::new(PolicyChoice::Leanstream);
    v.label = name.to_string();
    match name {
        "leanstream-no-lookahead" => v.lookahead = false,
        "leanstream-always-lookahead" => v.always_lookahead = true,
        "leanstream-no-refine" => v.refine = false,
        "leanstream-no-cancel" => v.cancel = false,
        "leanstream-lru" => v.retain_lru = true,
        "leanstream-predicted" => v.predicted = true,
        _ => return None,
    }
    Some(vec![v])
}

/// The run with the median tokens/s of `all` (one policy's repeats at one budget), every repeat's
/// rate kept.
fn median_run(v: &Variant, budget: u64, mut all: Vec<Outcome>) -> Run {
    all.sort_by(|x, y| x.tokens_per_s.total_cmp(&y.tokens_per_s));
    let rates = all.iter().map(|o| o.tokens_per_s).collect();
    let median = all.swap_remove(all.len() / 2);
    Run::new(v.clone(), Some(budget), median).with_runs(rates)
}

/// References run once, without a budget.
fn budget_free(v: &Variant) -> bool {
    v.policy == "dense" || v.policy == "resident"
}

/// Spawns workers (this executable's hidden `bench-worker` command) and reads their outcome.
struct Runner<'a> {
    args: &'a BenchArgs,
    prompt: Vec<u32>,
    work: PathBuf,
    bar: &'a ProgressBar,
    /// A mixture of experts: its runs get the expert trace, not the neurons' active sets.
    moe: bool,
}

impl Runner<'_> {
    /// The resident policy's greedy continuation of the prompt, `tokens` long: the sequence every
    /// run decodes.
    fn resident_sequence(&self, tokens: usize) -> Result<Vec<u32>> {
        let generated = self.execute(
            &Variant::new(PolicyChoice::Resident),
            None,
            Task::Generate { tokens },
        )?;
        if let Some(e) = generated.error {
            bail!("the resident policy cannot run this model: {e}");
        }
        Ok(generated.generated)
    }

    fn execute(&self, variant: &Variant, memory: Option<u64>, task: Task) -> Result<Outcome> {
        self.execute_at(variant, memory, self.args.ctx, task)
    }

    /// [`execute`](Self::execute) with a context of `ctx` tokens.
    fn execute_at(
        &self,
        variant: &Variant,
        memory: Option<u64>,
        ctx: usize,
        task: Task,
    ) -> Result<Outcome> {
        let traced = memory.filter(|_| !matches!(task, Task::Prefill { .. }));
        let job = Job {
            model: self.args.model.clone(),
            variant: variant.clone(),
            memory,
            flash: if budget_free(variant) {
                "none".into()
            } else {
                self.args.flash.clone()
            },
            ctx,
            threads: self.args.threads.map(usize::from),
            prompt: self.prompt.clone(),
            trace: (self.args.trace.is_some() && traced.is_some()).then(|| self.timeline_path()),
            active_trace: traced
                .filter(|_| !self.moe)
                .map(|_| self.active_trace_path()),
            expert_trace: traced
                .filter(|_| self.moe)
                .map(|_| self.expert_trace_path()),
            task,
        };
        let path = self.work.join("job.json");
        std::fs::write(&path, serde_json::to_vec(&job)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
        let exe = std::env::current_exe().context("cannot locate the leanstream executable")?;
        let mut cmd = Command::new(exe);
        cmd.arg("bench-worker").arg(&path);
        let group = match memory {
            Some(limit) if variant.policy == "mmap" => Some(self.memory_group(limit)?),
            _ => None,
        };
        let out = match &group {
            Some(g) => g
                .spawn(cmd.stdout(Stdio::piped()).stderr(Stdio::piped()))
                .and_then(|child| child.wait_with_output()),
            None => cmd.output(),
        }
        .context("cannot start a bench worker")?;
        self.bar.inc(1);
        let at = memory
            .map(format_size)
            .unwrap_or_else(|| "no budget".into());
        if !out.status.success() {
            let why = match out.status.code() {
                Some(_) => String::from_utf8_lossy(&out.stderr).trim().to_string(),
                None => format!(
                    "killed by {} (signal 9 is often the kernel's out-of-memory killer)",
                    std::os::unix::process::ExitStatusExt::signal(&out.status)
                        .map_or("a signal".into(), |s| format!("signal {s}"))
                ),
            };
            bail!("the {} run at {at} failed: {why}", variant.label);
        }
        let mut outcome: Outcome = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("the {} run at {at} printed no outcome", variant.label))?;
        if let Some(g) = &group {
            outcome.memory_group_peak_bytes = Some(g.peak_bytes()?);
        }
        Ok(outcome)
    }

    /// The memory cgroup an `mmap` run gets as its budget, as llama.cpp would run on a phone: the
    /// kernel charges the mapped file's page cache to it and reclaims at the limit. The file's
    /// pages are dropped from the page cache first, so the run starts as cold as the streaming
    /// policies, whose direct reads never find them there.
    fn memory_group(&self, limit: u64) -> Result<MemoryGroup> {
        crate::storage::page_cache::evict(&self.args.model).with_context(|| {
            format!(
                "cannot drop {} from the page cache",
                self.args.model.display()
            )
        })?;
        MemoryGroup::create(limit).context(
            "--policy mmap needs a memory cgroup to hold it to its budget (cgroup v1 memory controller, writable by this user); leave mmap out of --policy",
        )
    }
}

impl Runner<'_> {
    fn active_trace_path(&self) -> PathBuf {
        self.work.join("active-trace.json")
    }

    fn expert_trace_path(&self) -> PathBuf {
        self.work.join("expert-trace.json")
    }

    /// Records the true active sets of the prompt and `sequence` where the budgeted runs read them.
    fn record_active_trace(&self, sequence: &[u32]) -> Result<()> {
        let all: Vec<u32> = self.prompt.iter().chain(sequence).copied().collect();
        let trace = crate::streaming::ActiveTrace::record(&self.args.model, &all, self.args.ctx)?;
        let path = self.active_trace_path();
        std::fs::write(&path, serde_json::to_vec(&trace)?)
            .with_context(|| format!("cannot write {}", path.display()))
    }

    fn timeline_path(&self) -> PathBuf {
        self.work.join("timeline.json")
    }

    /// The events the last run wrote, if it wrote any.
    fn take_timeline(&self) -> Result<Option<Vec<serde_json::Value>>> {
        let path = self.timeline_path();
        match std::fs::read(&path) {
            Ok(bytes) => {
                std::fs::remove_file(&path)?;
                Ok(Some(serde_json::from_slice(&bytes)?))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
        }
    }
}

/// A scratch folder beside nothing the user owns, removed when the bench ends.
struct TempDir {
    path: PathBuf,
}

fn tempdir(model: &Path) -> Result<TempDir> {
    let name = format!(
        "leanstream-bench-{}-{}",
        std::process::id(),
        model
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("model")
    );
    let path = std::env::temp_dir().join(name);
    std::fs::create_dir_all(&path)
        .with_context(|| format!("cannot create the scratch folder {}", path.display()))?;
    Ok(TempDir { path })
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
