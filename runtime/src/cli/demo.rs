//! `leanstream demo`: the product in one command. Converts a model (by default the embedded
//! `models/austen-relu`) once with the `leanstream-prep` binary, cached (see `conversion_cache`);
//! generates under a budget that leaves most of the FFN on an emulated UFS 4.0 flash, streaming the
//! text; then says what happened and measures, each in a process of its own, the same generation
//! with every weight in DRAM (`dense`: its text, speed and peak RSS, the memory the model needs)
//! and, where a memory cgroup can be made, the usual way of running a model larger than memory
//! (`mmap`, the OS paging the file) held to the same budget by the kernel.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

use crate::platform::memory::peak_rss_bytes;
use crate::platform::memory_size::{format_size, parse_budget};
use crate::source::conversion_cache::converted_file;
use crate::source::model_arg::{classify, ModelArg};
use crate::storage::FlashProfile;
use crate::streaming::{memory_split, Sparsity, Tuning};
use crate::text::generate::{generate, GenerateOptions, Generation};
use crate::text::sampler::SamplerConfig;
use crate::text::session::{GpuChoice, PolicyChoice, Session, SessionOptions};

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// A model directory or GGUF file (converted once, cached), or a converted file. Default: the
    /// embedded models/austen-relu of the checkout this binary was built from.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The prompt.
    #[arg(short = 'p', long, default_value = "It was a fine morning, and Emma")]
    pub prompt: String,
    /// Number of tokens to generate.
    #[arg(short = 'n', long = "n-tokens", default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    pub n_tokens: u64,
    /// Memory budget (peak RSS). Default: the planner's minimum plus a quarter of the FFN bundles.
    #[arg(long, value_parser = parse_budget)]
    pub memory: Option<u64>,
    /// Flash device: ufs4, ufs31, nvme, none (this machine's disk) or a profile FILE.toml.
    #[arg(long, default_value = "ufs4")]
    pub flash: String,
    /// Print one JSON object instead of the text and the summary.
    #[arg(long)]
    pub json: bool,
}

/// Context length of the demo: enough for the prompt and the generation.
const CTX: usize = 512;

/// How the demo converts a model: f32 weights, so that the streaming engine and the dense policy
/// do the same arithmetic (with q8 weights the engine quantizes activations to q8 for its dot
/// products while `dense` dequantizes to f32, and greedy texts drift apart for that reason alone);
/// small clusters, which suit the embedded model's small bundles; a calibration of seconds.
const CONVERT_FLAGS: [&str; 6] = [
    "--quant",
    "f32",
    "--calib-tokens",
    "2048",
    "--cluster-kib",
    "8",
];

/// Greedy with a mild repetition penalty (the tiny model loops without one), so that the policies
/// can be compared token for token; `run_cli` passes the same as flags.
const REPEAT_PENALTY: f32 = 1.1;

pub fn run(args: DemoArgs) -> Result<()> {
    let model = match &args.model {
        Some(m) => classify(m)?,
        None => ModelArg::Path(embedded_model()?),
    };
    let (file, converted_now) = converted_file(&model, &CONVERT_FLAGS, &[])?;
    let split = memory_split(&file, CTX)?;
    let minimum = split.fixed();
    let budget = args.memory.unwrap_or(split.budget_for_ffn_share(0.25));
    let flash = FlashProfile::from_flash_arg(&args.flash)?;
    let mut streaming = Session::open(&SessionOptions {
        model: file.clone(),
        policy: Some(PolicyChoice::Leanstream),
        memory: Some(budget),
        flash,
        sparsity: Sparsity::Certified,
        ctx: Some(CTX),
        default_ctx: CTX,
        kv: Default::default(),
        tuning: Tuning::default(),
        gpu: GpuChoice::from_env(),
    })?;
    let opts = GenerateOptions {
        max_tokens: args.n_tokens as usize,
        ctx: CTX,
        sampler: SamplerConfig {
            repeat_penalty: REPEAT_PENALTY,
            ..Default::default()
        },
        eos_token_ids: streaming.eos_token_ids.clone(),
    };
    let split = streaming.report()["memory_split"].clone();
    if !args.json {
        println!("{}", streaming.describe_memory().unwrap_or_default());
        print!("\n{}", args.prompt);
    }
    let mut stdout = std::io::stdout();
    let lean = run_once(&mut streaming, &args.prompt, &opts, |piece| {
        if !args.json {
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
    })?;
    let report = streaming.report();
    let peak_rss = peak_rss_bytes();
    drop(streaming);
    let dense = run_cli(&file, &args, "dense")?;
    let dense_peak = dense["peak_rss_bytes"].as_u64();
    let identical = dense["text"].as_str() == Some(lean.text.as_str());
    let mmap = mmap_in_budget(&file, &args, budget);
    let file_bytes = std::fs::metadata(&file)
        .with_context(|| format!("cannot read the size of {}", file.display()))?
        .len();
    // How many times less memory streaming needed than dense, both measured as peak RSS.
    let dram_ratio = match (peak_rss, dense_peak) {
        (Some(lean), Some(dense)) if lean > 0 => Some(dense as f64 / lean as f64),
        _ => None,
    };

    let f = |key: &str| report[key].as_f64().unwrap_or(f64::NAN);
    if args.json {
        let out = json!({
            "model": args.model.as_deref().map(Path::to_path_buf).unwrap_or_else(|| file.clone()),
            "converted_file": file,
            "converted_now": converted_now,
            "prompt": args.prompt,
            "flash": args.flash,
            "memory_budget_bytes": budget,
            "minimum_memory_bytes": minimum,
            "file_bytes": file_bytes,
            "ffn_bytes": split["ffn_total"],
            "memory_split": split,
            "peak_rss_bytes": peak_rss,
            "dram_ratio": dram_ratio,
            "leanstream": {
                "text": lean.text,
                "generated_tokens": lean.stats.generated_tokens,
                "tokens_per_s": lean.stats.tokens_per_s,
                "bytes_read_per_token": report["bytes_read_per_token"],
                "reads_per_token": report["reads_per_token"],
                "cache_hit_rate": report["cache_hit_rate"],
                "predictor_recall": report["predictor_recall"],
                "predictor_precision": report["predictor_precision"],
                "lookahead_recall": report["lookahead_recall"],
                "active_fraction": report["active_fraction"],
            },
            "dense": {
                "text": dense["text"],
                "tokens_per_s": dense["tokens_per_s"],
                "peak_rss_bytes": dense_peak,
            },
            "mmap": match &mmap {
                Ok(v) => json!({
                    "tokens_per_s": v["tokens_per_s"],
                    "peak_rss_bytes": v["peak_rss_bytes"],
                    "memory_group_peak_bytes": v["memory_group_peak_bytes"],
                }),
                Err(why) => json!({ "skipped": why }),
            },
            "identical_text": identical,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let ffn = split["ffn_total"].as_u64().unwrap_or(0);
    let size = |b: Option<u64>| b.map_or("unknown".into(), format_size);
    println!("\n");
    println!(
        "what happened ({} tokens, certified sparsity, --flash {}):",
        lean.stats.generated_tokens, args.flash
    );
    println!(
        "  ran in {} (peak RSS), {} less than the model needs in DRAM (dense, every weight resident: {} peak RSS)",
        size(peak_rss),
        dram_ratio.map_or("unknown times".into(), |r| format!("{r:.1}×")),
        size(dense_peak)
    );
    println!(
        "  memory: budget {} = minimum {} + {:.0} % of the {} of FFN bundles",
        format_size(budget),
        format_size(minimum),
        100.0 * budget.saturating_sub(minimum) as f64 / ffn.max(1) as f64,
        format_size(ffn),
    );
    println!(
        "  flash: {} read per token in {:.0} reads; neuron cache hit rate {:.2}",
        format_size(f("bytes_read_per_token") as u64),
        f("reads_per_token"),
        f("cache_hit_rate")
    );
    println!(
        "  sparsity: {:.1} % of the neurons active; predictor recall {:.2} (precision {:.2}), look-ahead recall {:.2}",
        100.0 * f("active_fraction"),
        f("predictor_recall"),
        f("predictor_precision"),
        f("lookahead_recall")
    );
    println!(
        "  speed: {:.1} tok/s streaming; dense, every weight in DRAM: {:.1} tok/s",
        lean.stats.tokens_per_s,
        dense["tokens_per_s"].as_f64().unwrap_or(f64::NAN)
    );
    match &mmap {
        Ok(v) => println!(
            "  mmap (the OS pages the file, as llama.cpp does) in a memory cgroup of the same {}, on this machine's disk: {}",
            format_size(budget),
            v["tokens_per_s"].as_f64().map_or_else(
                || v["failed"].as_str().unwrap_or("no result").to_string(),
                |t| format!("{t:.1} tok/s")
            )
        ),
        Err(why) => println!("  mmap in the same budget: skipped ({why})"),
    }
    if file_bytes <= budget {
        println!(
            "  note: the whole {} file fits in this {} budget, so mmap pages it in once and then runs from memory; \
             streaming pays where the model is larger than the memory it gets (try `leanstream demo --model` on a bigger model)",
            format_size(file_bytes),
            format_size(budget)
        );
    }
    println!("  identical text: {identical}");
    if !identical {
        println!(
            "  dense text: {}{}",
            args.prompt,
            dense["text"].as_str().unwrap_or("")
        );
    }
    Ok(())
}

/// `leanstream run --json` of the converted file under `policy`, with no budget, in a process of
/// its own (so its peak RSS is its own): its JSON report.
fn run_cli(file: &Path, args: &DemoArgs, policy: &str) -> Result<Value> {
    let out = spawn_run(file, args, policy, None, None)?;
    if !out.status.success() {
        bail!(
            "the {policy} run failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("the {policy} run printed no JSON report"))
}

#[cfg(target_os = "linux")]
type Group = crate::platform::cgroup::MemoryGroup;
#[cfg(not(target_os = "linux"))]
type Group = ();

/// `leanstream run --json` of the converted file with the demo's prompt, length and greedy
/// sampling under `policy` and `memory`, inside `group` if given.
fn spawn_run(
    file: &Path,
    args: &DemoArgs,
    policy: &str,
    memory: Option<u64>,
    group: Option<&Group>,
) -> Result<Output> {
    let exe = std::env::current_exe().context("cannot locate the leanstream executable")?;
    let mut cmd = Command::new(exe);
    cmd.arg("run")
        .arg("--model")
        .arg(file)
        .args(["--policy", policy, "-p", &args.prompt])
        .args(["-n", &args.n_tokens.to_string(), "--ctx", &CTX.to_string()])
        .args([
            "--temp",
            "0",
            "--repeat-penalty",
            &REPEAT_PENALTY.to_string(),
        ])
        .arg("--json")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(m) = memory {
        cmd.arg("--memory").arg(m.to_string());
    }
    let out = match group {
        #[cfg(target_os = "linux")]
        Some(g) => g.spawn(&mut cmd).and_then(|c| c.wait_with_output()),
        _ => cmd.output(),
    };
    out.with_context(|| format!("cannot start the {policy} run"))
}

/// The `mmap` policy run in a memory cgroup limited to `budget`, the page cache of the file
/// dropped first so that it starts as cold as streaming: its JSON report (with the group's peak
/// charge, or `failed` saying how it died), or why it could not be run.
#[cfg(target_os = "linux")]
fn mmap_in_budget(file: &Path, args: &DemoArgs, budget: u64) -> Result<Value, String> {
    let group = crate::platform::cgroup::MemoryGroup::create(budget).map_err(|e| {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            format!("making a memory cgroup needs root: {e}")
        } else {
            e.to_string()
        }
    })?;
    crate::storage::page_cache::evict(file)
        .map_err(|e| format!("cannot drop {} from the page cache: {e}", file.display()))?;
    let out =
        spawn_run(file, args, "mmap", Some(budget), Some(&group)).map_err(|e| format!("{e:#}"))?;
    let peak = group.peak_bytes().ok();
    if !out.status.success() {
        let why = match std::os::unix::process::ExitStatusExt::signal(&out.status) {
            Some(9) => "killed by the kernel's out-of-memory killer".to_string(),
            Some(s) => format!("killed by signal {s}"),
            None => String::from_utf8_lossy(&out.stderr).trim().to_string(),
        };
        return Ok(json!({ "failed": why, "memory_group_peak_bytes": peak }));
    }
    let mut v: Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("the mmap run printed no JSON report: {e}"))?;
    v["memory_group_peak_bytes"] = peak.into();
    Ok(v)
}

#[cfg(not(target_os = "linux"))]
fn mmap_in_budget(_: &Path, _: &DemoArgs, _: u64) -> Result<Value, String> {
    Err("memory cgroups are Linux-only".into())
}

fn run_once(
    session: &mut Session,
    prompt: &str,
    opts: &GenerateOptions,
    on_text: impl FnMut(&str),
) -> Result<Generation> {
    let ids = session.tokenizer.encode(prompt, true)?;
    let tokenizer = session.tokenizer.clone();
    generate(session.model(), &tokenizer, &ids, opts, on_text)
}

/// `models/austen-relu` of the checkout this binary was built from.
fn embedded_model() -> Result<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/austen-relu");
    if !path.join("config.json").is_file() {
        bail!(
            "the embedded model is not at {} (this binary was built from a checkout that has moved): \
             pass --model",
            path.display()
        );
    }
    Ok(path)
}
