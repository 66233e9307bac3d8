//! `leanstream`: the device-side command-line tool.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use leanstream::generate::{generate, GenerateOptions, StopReason};
use leanstream::memory::peak_rss_bytes;
use leanstream::neuron_cache::Retention;
use leanstream::perplexity::{compare, perplexity};
use leanstream::sampler::SamplerConfig;
use leanstream::session::{policy_name, PolicyChoice, Session, SessionOptions};
use leanstream::storage::FlashProfile;
use leanstream::streaming::Sparsity;

#[derive(Parser)]
#[command(
    name = "leanstream",
    version,
    about = "Run LLMs whose FFN weights stream from flash"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming it to stdout.
    Run(RunArgs),
    /// Perplexity of a text file under the model.
    Perplexity(PerplexityArgs),
    /// Measure a flash device with direct I/O and write a profile for --flash.
    ProbeFlash(leanstream::probe::ProbeArgs),
}

#[derive(Args)]
struct CommonArgs {
    /// Model: a converted LeanStream file, a GGUF file, or a Hugging Face model directory.
    #[arg(long)]
    model: PathBuf,
    /// Context length in tokens (capped at the model's maximum).
    #[arg(long)]
    ctx: Option<usize>,
    /// Compute threads (default: all available cores).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,
    /// leanstream (stream FFN bundles under --memory; default for converted files), resident
    /// (all bundles in DRAM, the file's sparsity), dense (every weight and neuron; default otherwise).
    #[arg(long, value_enum)]
    policy: Option<PolicyArg>,
    /// Hard cap on peak memory (RSS): 512MiB, 1.5GiB, 300MB or bytes. Default: everything fits.
    #[arg(long, value_parser = parse_memory)]
    memory: Option<u64>,
    /// Flash device: none (the real disk, direct I/O), ufs4, ufs31, nvme, or a profile FILE.toml.
    #[arg(long, default_value = "none")]
    flash: String,
    /// certified (skip only neurons proven inactive: output equals resident) or predicted (trust
    /// the predictors, like prior systems).
    #[arg(long, value_enum, default_value_t = SparsityArg::Certified)]
    sparsity: SparsityArg,
    /// Disable look-ahead speculation (an ablation).
    #[arg(long)]
    no_lookahead: bool,
    /// Cache retention: activity (observed use) or lru (an ablation).
    #[arg(long, value_enum, default_value_t = RetainArg::Activity)]
    retain: RetainArg,
    /// Print one JSON object on stdout instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum PolicyArg {
    Leanstream,
    Resident,
    Dense,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum SparsityArg {
    Certified,
    Predicted,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum RetainArg {
    Activity,
    Lru,
}

fn parse_memory(s: &str) -> Result<u64, String> {
    match leanstream::memory_size::parse_size(s) {
        Ok(0) => Err("the budget must be positive".into()),
        Ok(v) => Ok(v),
        Err(e) => Err(e.to_string()),
    }
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
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    temp: f32,
    /// Sample only among the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Sample only among the most likely tokens whose probability reaches P (1 = off).
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Penalty on recently generated tokens (1 = off).
    #[arg(long, default_value_t = 1.1)]
    repeat_penalty: f32,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
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
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ReferenceArg {
    Dense,
    Resident,
}

fn main() -> ExitCode {
    leanstream::memory::startup_rss_bytes();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run(args),
        Command::Perplexity(args) => run_perplexity(args),
        Command::ProbeFlash(args) => leanstream::probe::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Sets up threads and opens the model as the flags ask.
fn setup(common: &CommonArgs, default_ctx: usize) -> Result<Session> {
    if let Some(threads) = common.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads as usize)
            .build_global()
            .context("cannot start the thread pool")?;
    }
    let session = Session::open(&session_options(common, default_ctx)?)?;
    if let Some(line) = session.describe_memory() {
        if !common.json {
            eprintln!("{line}");
        }
    }
    Ok(session)
}

fn session_options(common: &CommonArgs, default_ctx: usize) -> Result<SessionOptions> {
    Ok(SessionOptions {
        model: common.model.clone(),
        policy: common.policy.map(policy_choice),
        memory: common.memory,
        flash: FlashProfile::from_flash_arg(&common.flash)?,
        sparsity: match common.sparsity {
            SparsityArg::Certified => Sparsity::Certified,
            SparsityArg::Predicted => Sparsity::Predicted,
        },
        ctx: common.ctx,
        default_ctx,
        lookahead: !common.no_lookahead,
        retention: match common.retain {
            RetainArg::Activity => Retention::Activity,
            RetainArg::Lru => Retention::Lru,
        },
    })
}

fn policy_choice(p: PolicyArg) -> PolicyChoice {
    match p {
        PolicyArg::Leanstream => PolicyChoice::Leanstream,
        PolicyArg::Resident => PolicyChoice::Resident,
        PolicyArg::Dense => PolicyChoice::Dense,
    }
}

fn run(args: RunArgs) -> Result<()> {
    let mut session = setup(&args.common, 2048)?;
    let ctx = session.ctx;
    let prompt = session.tokenizer.encode(&args.prompt, true)?;
    let opts = GenerateOptions {
        max_tokens: args.n_tokens as usize,
        ctx,
        sampler: SamplerConfig {
            temperature: args.temp,
            top_k: args.top_k,
            top_p: args.top_p,
            repeat_penalty: args.repeat_penalty,
            seed: args.seed,
            ..Default::default()
        },
        eos_token_ids: session.eos_token_ids.clone(),
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
    }
    Ok(())
}

fn run_perplexity(args: PerplexityArgs) -> Result<()> {
    let mut session = setup(&args.common, 512)?;
    let window = session.ctx;
    let text = read_text(&args.file)?;
    let ids = session.tokenizer.encode(&text, false)?;
    let Some(reference) = args.reference else {
        let result = perplexity(session.model(), &ids, window, true)?;
        if args.common.json {
            let mut obj = session.report();
            merge(&mut obj, serde_json::to_value(&result)?);
            obj["ctx"] = window.into();
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
        ..session_options(&args.common, 512)?
    })?;
    let c = compare(
        session.model(),
        reference_session.model(),
        &ids,
        window,
        true,
    )?;
    let reference_name = policy_name(reference_session.policy);
    if args.common.json {
        let mut obj = session.report();
        merge(&mut obj, serde_json::to_value(&c)?);
        obj["reference"] = reference_name.into();
        obj["ctx"] = window.into();
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

fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", path.display()))
}
