//! `leanstream`: the device-side command-line tool.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use leanstream::model::kv_cache::KvType;
use leanstream::platform::elastic::{BudgetSource, BudgetWatch};
use leanstream::platform::memory::peak_rss_bytes;
use leanstream::platform::memory_size::parse_budget;
use leanstream::source::conversion_cache::model_to_open;
use leanstream::storage::FlashProfile;
use leanstream::streaming::neuron_cache::Retention;
use leanstream::streaming::{Sparsity, Tuning};
use leanstream::text::generate::{generate, GenerateOptions, StopReason};
use leanstream::text::perplexity::{compare_from, perplexity_from};
use leanstream::text::session::{policy_name, GpuChoice, PolicyChoice, Session, SessionOptions};

#[derive(Parser)]
#[command(
    name = "leanstream",
    version,
    about = "Run LLMs whose FFN weights stream from flash",
    after_help = EXAMPLES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

const EXAMPLES: &str = "\
Examples:
  # Convert the embedded model once, stream it under a tight budget and compare with dense
  leanstream demo

  # Stream a GGUF model in 200 MB: converted once with leanstream-prep, cached in ~/.cache/leanstream
  leanstream run --model SmolLM2-135M-Instruct.Q4_1.gguf --memory 200MB --ctx 512 -p \"The capital of France is\"

  # Chat with a converted file in 200 MB, reading from an emulated UFS 4.0 phone flash
  leanstream chat --model smollm2.lsb --memory 200MB --ctx 512 --flash ufs4";

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming it to stdout.
    Run(RunArgs),
    /// Perplexity of a text file under the model.
    Perplexity(PerplexityArgs),
    /// Measure a flash device with direct I/O and write a profile for --flash.
    ProbeFlash(leanstream::storage::probe::ProbeArgs),
    /// Compare policies across memory budgets on one token sequence: table, ratios, JSON, plot.
    Bench(leanstream::bench::BenchArgs),
    /// One bench run in its own process (used by `bench`).
    #[command(hide = true)]
    BenchWorker { job: PathBuf },
    /// Restore a file packed by `leanstream-prep pack`, checking every checksum.
    Unpack(leanstream::transfer::unpack::UnpackArgs),
    /// Check every checksum of a converted file.
    Verify(leanstream::transfer::verify::VerifyArgs),
    /// Chat with an instruction-tuned model (one message per line on stdin), streaming replies.
    Chat(ChatArgs),
    /// Convert the embedded model (once), stream it under a tight budget and compare with dense.
    Demo(leanstream::cli::demo::DemoArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (chat and completions, streamed or not).
    #[cfg(feature = "serve")]
    Serve(ServeArgs),
}

#[derive(Args)]
struct CommonArgs {
    /// Model: a converted LeanStream file, a GGUF file, a Hugging Face model directory or hub id
    /// (owner/name). With --memory, --flash or --policy (and always for a hub id) a model that is
    /// not converted is converted once with leanstream-prep's defaults and cached.
    #[arg(long)]
    model: PathBuf,
    /// Refuse a model that is not converted instead of converting it.
    #[arg(long)]
    no_convert: bool,
    /// Context length in tokens, at most the model's maximum (default: 2048 for run, 512 for
    /// perplexity, or the model's maximum if smaller).
    #[arg(long)]
    ctx: Option<usize>,
    /// KV cache storage: f16 (half of f32's memory; perplexity within 0.1 %), f32 (exact), or
    /// q8_0 (about a quarter of f32's).
    #[arg(long, value_enum, default_value_t = KvArg::F16)]
    kv: KvArg,
    /// Compute threads (default: the fast cores — on a big.LITTLE CPU the big ones; all cores where
    /// they are alike).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,
    /// leanstream (stream FFN bundles under --memory; default for converted files), resident
    /// (all bundles in DRAM, the file's sparsity), dense (every weight and neuron; default
    /// otherwise); prior systems: mmap (llama.cpp-like, --flash none only), powerinfer2,
    /// llm-in-flash; oracle (needs a recorded trace: `bench`).
    #[arg(long, value_enum)]
    policy: Option<PolicyArg>,
    /// Hard cap on peak memory (RSS): 512MiB, 1.5GiB, 300MB or bytes; `ffn:P%`: the minimum with
    /// every dense weight resident plus P% of the FFN bundles (a converted file's; as `bench`);
    /// or `auto`: the memory cgroup's limit, followed while the model runs. Default: everything
    /// fits.
    #[arg(long, value_parser = parse_memory)]
    memory: Option<MemoryArg>,
    /// A file holding the budget (one size such as 300MiB): re-read when it changes and on
    /// SIGUSR1, the budget follows it while the model runs.
    #[arg(long, conflicts_with = "memory")]
    memory_file: Option<PathBuf>,
    /// Flash device: none (the real disk, direct I/O), ufs4, ufs31, nvme, or a profile FILE.toml.
    #[arg(long, default_value = "none")]
    flash: String,
    /// Run the decode step on the GPU (a build with the `gpu` feature; docs/gpu.md), as
    /// LEANSTREAM_GPU=1 does; what does not fit stays on the CPU, one line says why.
    #[arg(long)]
    gpu: bool,
    /// The most GPU memory the model takes (weights, buffers, KV cache), as --memory's sizes;
    /// implies --gpu. Default: LEANSTREAM_GPU_MEMORY, else as much as the GPU gives.
    #[arg(long, value_parser = parse_budget)]
    gpu_memory: Option<u64>,
    /// Where a streaming policy's FFN runs with --gpu: gpu (from the bundles streamed into a
    /// neuron pool on the GPU) or cpu (the GPU computes the attention only); implies --gpu.
    /// Default: LEANSTREAM_GPU_FFN, else gpu.
    #[arg(long, value_enum)]
    gpu_ffn: Option<GpuFfnArg>,
    /// certified (skip only neurons proven inactive: output equals resident), predicted (trust
    /// the predictors, like prior systems), or refine (compute only the --refine-keep share of
    /// each layer's neurons that a resident one-bit gate sketch scores highest, skip the rest
    /// unread: trades quality for reads, measure it with `perplexity`; also with --policy
    /// resident, whose output it then equals bit for bit).
    #[arg(long, value_enum, default_value_t = SparsityArg::Certified)]
    sparsity: SparsityArg,
    /// --sparsity refine: the share (0-1) of each layer's neurons computed; 0.5 skips half.
    #[arg(long, default_value_t = 0.5, value_parser = parse_keep)]
    refine_keep: f64,
    /// Disable look-ahead speculation (an ablation).
    #[arg(long)]
    no_lookahead: bool,
    /// Speculate on every token, not only where it measurably pays (an ablation of the gate).
    #[arg(long, conflicts_with = "no_lookahead")]
    always_lookahead: bool,
    /// Cache retention: activity (observed use) or lru (an ablation).
    #[arg(long, value_enum, default_value_t = RetainArg::Activity)]
    retain: RetainArg,
    /// leanstream ablation: no refinement (no cancel, boost or reordering of queued reads).
    #[arg(long)]
    no_refine: bool,
    /// leanstream ablation: refinement boosts and adds reads but never cancels them.
    #[arg(long)]
    no_cancel: bool,
    /// powerinfer2 and leanstream: the pinned hot set as a fraction (0-1) of the neuron cache
    /// (defaults 1.0 and 0; leanstream fills the rest from the profile too, unpinned).
    #[arg(long)]
    hot_fraction: Option<f32>,
    /// llm-in-flash: the window k in tokens.
    #[arg(long)]
    window: Option<usize>,
    /// Print one JSON object on stdout instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum PolicyArg {
    Leanstream,
    Resident,
    Dense,
    Mmap,
    Powerinfer2,
    LlmInFlash,
    Oracle,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum KvArg {
    F32,
    F16,
    #[value(name = "q8_0")]
    Q8_0,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum SparsityArg {
    Certified,
    Predicted,
    Refine,
}

fn parse_keep(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!(
            "--refine-keep {s:?}: give the share of neurons computed, above 0 and at most 1 (e.g. 0.5)"
        )),
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum RetainArg {
    Activity,
    Lru,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// The prompt.
    #[arg(short = 'p', long)]
    prompt: String,
    /// Maximum number of tokens to generate.
    #[arg(short = 'n', long = "n-tokens", default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    n_tokens: u64,
    /// Send the prompt as one user message through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Generate all `-n` tokens, past any end-of-sequence token (as llama.cpp's `--ignore-eos`):
    /// timings then cover a fixed number of decode steps whatever the kernels' last bits choose.
    #[arg(long)]
    ignore_eos: bool,
    #[command(flatten)]
    sampling: leanstream::cli::sampling_args::SamplingArgs,
}

#[derive(Args)]
struct ChatArgs {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    chat: leanstream::cli::chat::ChatArgs,
}

#[derive(Args)]
#[cfg(feature = "serve")]
struct ServeArgs {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    serve: leanstream::serve::ServeArgs,
}

#[derive(Args)]
struct PerplexityArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Text file to score.
    #[arg(long)]
    file: PathBuf,
    /// Also score the text with this policy in the same pass (same file, everything resident) and
    /// report KL(reference ‖ policy) per token and top-1 agreement.
    #[arg(long, value_enum)]
    reference: Option<ReferenceArg>,
    /// Score each window's predictions from this position on (0: all of them). With N above 0
    /// only whole windows count, as `llama-perplexity -c CTX` does from CTX/2: pass
    /// `--score-from 256` at `--ctx 512` to score the positions it scores.
    #[arg(long, default_value_t = 0)]
    score_from: usize,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ReferenceArg {
    Dense,
    Resident,
}

fn main() -> ExitCode {
    leanstream::platform::closed_pipe::end_quietly_when_stdout_closes();
    leanstream::platform::memory::startup_rss_bytes();
    let cli = Cli::parse();
    let result = leanstream::kernels::RowKernels::check_forced().and_then(|_| match cli.command {
        Command::Run(args) => run(args),
        Command::Perplexity(args) => run_perplexity(args),
        Command::ProbeFlash(args) => leanstream::storage::probe::run(args),
        Command::Bench(args) => leanstream::bench::run(args),
        Command::BenchWorker { job } => leanstream::bench::run_worker(&job),
        Command::Unpack(args) => leanstream::transfer::unpack::run(args),
        Command::Verify(args) => leanstream::transfer::verify::run(args),
        Command::Chat(args) => setup(&args.common, 2048)
            .and_then(|session| leanstream::cli::chat::run(session, &args.chat, args.common.json)),
        Command::Demo(args) => leanstream::cli::demo::run(args),
        #[cfg(feature = "serve")]
        Command::Serve(args) => setup(&args.common, 2048)
            .and_then(|session| leanstream::serve::run(session, &args.serve)),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

#[derive(Clone, Copy)]
enum MemoryArg {
    Size(u64),
    /// `ffn:P%`, as a share (0–1): resolved once the converted file is known.
    FfnShare(f64),
    Auto,
}

fn parse_memory(s: &str) -> std::result::Result<MemoryArg, String> {
    if s == "auto" {
        return Ok(MemoryArg::Auto);
    }
    if let Some(pct) = s.strip_prefix("ffn:") {
        return pct
            .strip_suffix('%')
            .and_then(|p| p.parse::<f64>().ok())
            .filter(|p| (0.0..=100.0).contains(p))
            .map(|p| MemoryArg::FfnShare(p / 100.0))
            .ok_or_else(|| format!("write ffn:P% with P between 0 and 100, not {s}"));
    }
    leanstream::platform::memory_size::parse_budget(s).map(MemoryArg::Size)
}

/// Where a changing budget comes from, if the flags ask for one.
fn budget_source(common: &CommonArgs) -> Result<Option<BudgetSource>> {
    Ok(match (common.memory, &common.memory_file) {
        (_, Some(path)) => Some(BudgetSource::File(path.clone())),
        (Some(MemoryArg::Auto), None) => Some(BudgetSource::Cgroup(
            leanstream::platform::elastic::Groups::of_this_process()
                .context("--memory auto follows the memory cgroup")?,
        )),
        _ => None,
    })
}

/// Sets up threads and opens the model as the flags ask.
fn setup(common: &CommonArgs, default_ctx: usize) -> Result<Session> {
    let threads = common
        .threads
        .map_or_else(leanstream::platform::cores::default_threads, usize::from);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .context("cannot start the thread pool")?;
    let streaming = match common.policy {
        Some(PolicyArg::Dense) => false,
        Some(_) => true,
        None => common.memory.is_some() || common.memory_file.is_some() || common.flash != "none",
    };
    let convert_within = match common.memory {
        Some(MemoryArg::Size(b)) => Some(b),
        _ => None,
    };
    let model = model_to_open(&common.model, streaming, common.no_convert, convert_within)?;
    let watch = budget_source(common)?.map(BudgetWatch::start).transpose()?;
    let options = session_options(common, default_ctx)?;
    let memory = match common.memory {
        // Planned in this process, whose start-up is the run's: the cache gets P% of the FFN.
        Some(MemoryArg::FfnShare(share)) => Some(
            leanstream::streaming::memory_split_with(
                &model,
                options.ctx.unwrap_or(default_ctx),
                options.kv,
            )
            .with_context(|| {
                format!(
                    "--memory ffn:{}%: {} has no FFN bundles to share out; give a size",
                    share * 100.0,
                    model.display()
                )
            })?
            .budget_for_ffn_share(share),
        ),
        _ => options.memory,
    };
    let mut session = Session::open(&SessionOptions {
        model,
        memory: watch.as_ref().map(|(_, first)| *first).or(memory),
        ..options
    })?;
    if let Some((watch, _)) = watch {
        session.follow_budget(watch)?;
    }
    if let Some(note) = &session.context_note {
        eprintln!("{note}");
    }
    if let Some(line) = session.describe_memory() {
        if !common.json {
            eprintln!("{line}");
        }
    }
    Ok(session)
}

fn session_options(common: &CommonArgs, default_ctx: usize) -> Result<SessionOptions> {
    let env = GpuChoice::from_env();
    Ok(SessionOptions {
        model: common.model.clone(),
        policy: common.policy.map(policy_choice),
        memory: match common.memory {
            Some(MemoryArg::Size(bytes)) => Some(bytes),
            // Followed: set from the watch's first reading; a share is resolved in `setup`.
            Some(MemoryArg::Auto | MemoryArg::FfnShare(_)) | None => None,
        },
        flash: FlashProfile::from_flash_arg(&common.flash)?,
        sparsity: match common.sparsity {
            SparsityArg::Certified => Sparsity::Certified,
            SparsityArg::Predicted => Sparsity::Predicted,
            SparsityArg::Refine => Sparsity::Refine {
                keep_permille: (common.refine_keep * 1000.0).round().clamp(1.0, 1000.0) as u16,
            },
        },
        ctx: common.ctx,
        default_ctx,
        kv: match common.kv {
            KvArg::F32 => KvType::F32,
            KvArg::F16 => KvType::F16,
            KvArg::Q8_0 => KvType::Q8_0,
        },
        tuning: Tuning {
            lookahead: !common.no_lookahead,
            always_lookahead: common.always_lookahead,
            retention: match common.retain {
                RetainArg::Activity => Retention::Activity,
                RetainArg::Lru => Retention::Lru,
            },
            refine: !common.no_refine,
            cancel: !common.no_cancel,
            hot_fraction: common.hot_fraction,
            window: common.window,
            oracle: None,
            oracle_exact_compute: false,
            expert_oracle: None,
        },
        gpu: GpuChoice {
            on: common.gpu || common.gpu_memory.is_some() || common.gpu_ffn.is_some() || env.on,
            memory: common.gpu_memory,
            ffn_on_cpu: match common.gpu_ffn {
                Some(place) => place == GpuFfnArg::Cpu,
                None => env.ffn_on_cpu,
            },
        },
    })
}

/// Where a streaming policy's FFN runs with the GPU (`--gpu-ffn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum GpuFfnArg {
    Gpu,
    Cpu,
}

fn policy_choice(p: PolicyArg) -> PolicyChoice {
    match p {
        PolicyArg::Leanstream => PolicyChoice::Leanstream,
        PolicyArg::Resident => PolicyChoice::Resident,
        PolicyArg::Dense => PolicyChoice::Dense,
        PolicyArg::Mmap => PolicyChoice::Mmap,
        PolicyArg::Powerinfer2 => PolicyChoice::PowerInfer2,
        PolicyArg::LlmInFlash => PolicyChoice::LlmInFlash,
        PolicyArg::Oracle => PolicyChoice::Oracle,
    }
}

fn run(args: RunArgs) -> Result<()> {
    let mut session = setup(&args.common, 2048)?;
    let ctx = session.ctx;
    let (prompt, mut eos_token_ids) = if args.chat {
        leanstream::cli::chat::single_turn(&session, &args.prompt)?
    } else {
        let prompt = session.tokenizer.encode(&args.prompt, true)?;
        (prompt, session.eos_token_ids.clone())
    };
    if args.ignore_eos {
        eos_token_ids.clear();
    }
    let opts = GenerateOptions {
        max_tokens: args.n_tokens as usize,
        ctx,
        sampler: args.sampling.config(),
        eos_token_ids,
    };
    let json = args.common.json;
    let mut stdout = std::io::stdout().lock();
    let tokenizer = session.tokenizer.clone();
    let generation = generate(session.model(), &tokenizer, &prompt, &opts, |piece| {
        if !json {
            // A closed stdout (e.g. `| head`) should not abort generation with a panic.
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
    })?;
    let stats = &generation.stats;
    if stats.stop_reason == StopReason::ContextFull {
        eprintln!(
            "\nnote: the context is full ({ctx} tokens): generation stopped; raise --ctx for more"
        );
    }
    if json {
        let mut obj = session.report();
        merge(&mut obj, serde_json::to_value(stats)?);
        obj["text"] = generation.text.into();
        obj["tokens"] = generation.tokens.into();
        obj["top2_margins"] = generation.margins.into();
        obj["peak_rss_bytes"] = peak_rss_bytes().into();
        obj["ctx"] = ctx.into();
        obj["threads"] = rayon::current_num_threads().into();
        println!("{}", serde_json::to_string_pretty(&obj)?);
    } else {
        println!();
        eprintln!(
            "{} prompt tokens at {:.1} tok/s, {} generated at {:.1} tok/s, first token after {:.0} ms",
            stats.prompt_tokens, stats.prompt_tokens_per_s, stats.generated_tokens, stats.tokens_per_s, stats.ttft_ms
        );
        if let Some(line) = session.describe_experts() {
            eprintln!("{line}");
        }
    }
    Ok(())
}

fn run_perplexity(args: PerplexityArgs) -> Result<()> {
    let mut session = setup(&args.common, 512)?;
    let window = session.ctx;
    let text = leanstream::tokenizer::read_text(&args.file)?;
    let ids = session.tokenizer.encode(&text, false)?;
    let Some(reference) = args.reference else {
        let result = perplexity_from(session.model(), &ids, window, args.score_from, true)
            .with_context(|| format!("cannot score {}", args.file.display()))?;
        if args.common.json {
            let mut obj = session.report();
            merge(&mut obj, serde_json::to_value(&result)?);
            obj["ctx"] = window.into();
            obj["score_from"] = args.score_from.into();
            obj["peak_rss_bytes"] = peak_rss_bytes().into();
            println!("{}", serde_json::to_string_pretty(&obj)?);
        } else {
            println!(
                "perplexity {:.4} over {} tokens (windows of {window})",
                result.perplexity, result.tokens
            );
        }
        return Ok(());
    };
    let mut reference_session = Session::open(&SessionOptions {
        policy: Some(match reference {
            ReferenceArg::Dense => PolicyChoice::Dense,
            ReferenceArg::Resident => PolicyChoice::Resident,
        }),
        memory: None,
        flash: None,
        ctx: Some(window),
        model: session.model_path.clone(),
        ..session_options(&args.common, 512)?
    })?;
    let c = compare_from(
        session.model(),
        reference_session.model(),
        &ids,
        window,
        args.score_from,
        true,
    )?;
    let reference_name = policy_name(reference_session.policy);
    if args.common.json {
        let mut obj = session.report();
        merge(&mut obj, serde_json::to_value(&c)?);
        obj["reference"] = reference_name.into();
        obj["ctx"] = window.into();
        obj["score_from"] = args.score_from.into();
        obj["peak_rss_bytes"] = peak_rss_bytes().into();
        println!("{}", serde_json::to_string_pretty(&obj)?);
    } else {
        println!(
            "perplexity {:.4} ({reference_name} {:.4}, {:+.2} %) over {} tokens (windows of {window}); \
             KL({reference_name} ‖ {}) {:.5} nats/token; top-1 agreement {:.4}",
            c.perplexity,
            c.reference_perplexity,
            100.0 * (c.perplexity / c.reference_perplexity - 1.0),
            c.tokens,
            policy_name(session.policy),
            c.kl,
            c.top1_agreement
        );
    }
    Ok(())
}

/// Adds the fields of `more` (an object) to `obj`.
fn merge(obj: &mut serde_json::Value, more: serde_json::Value) {
    if let (Some(o), serde_json::Value::Object(m)) = (obj.as_object_mut(), more) {
        o.extend(m);
    }
}
