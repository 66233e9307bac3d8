//! `leanstream`: the device-side command-line tool.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use leanstream::generate::{generate, GenerateOptions, StopReason};
use leanstream::memory::peak_rss_bytes;
use leanstream::perplexity::perplexity;
use leanstream::sampler::SamplerConfig;
use leanstream::source::{self, LoadedModel};

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
}

#[derive(Args)]
struct CommonArgs {
    /// Model: a Hugging Face model directory or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// Context length in tokens (capped at the model's maximum).
    #[arg(long)]
    ctx: Option<usize>,
    /// Compute threads (default: all available cores).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,
    /// How weights are held: `dense` loads every weight into DRAM (the reference; the streaming
    /// policies arrive with the memory planner).
    #[arg(long, value_enum, default_value_t = Policy::Dense)]
    policy: Policy,
    /// Print one JSON object on stdout instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Policy {
    Dense,
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run(args),
        Command::Perplexity(args) => run_perplexity(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Loads the model and sets up threads; returns it with the effective context length.
fn setup(common: &CommonArgs, default_ctx: usize) -> Result<(LoadedModel, usize)> {
    if let Some(threads) = common.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads as usize)
            .build_global()
            .context("cannot start the thread pool")?;
    }
    let loaded = match common.policy {
        Policy::Dense => source::open(&common.model)?,
    };
    let max = loaded.model.config().max_position_embeddings;
    let ctx = common.ctx.unwrap_or(default_ctx);
    if ctx < 2 {
        anyhow::bail!("--ctx must be at least 2 tokens");
    }
    if ctx > max {
        if common.ctx.is_some() {
            eprintln!("note: --ctx {ctx} exceeds the model's maximum; using {max}");
        }
        return Ok((loaded, max));
    }
    Ok((loaded, ctx))
}

fn run(args: RunArgs) -> Result<()> {
    let (loaded, ctx) = setup(&args.common, 2048)?;
    let prompt = loaded.tokenizer.encode(&args.prompt, true)?;
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
        eos_token_ids: loaded.eos_token_ids.clone(),
    };
    let json = args.common.json;
    let mut stdout = std::io::stdout().lock();
    let generation = generate(&loaded.model, &loaded.tokenizer, &prompt, &opts, |piece| {
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
        let mut obj = serde_json::to_value(stats)?;
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
    let (loaded, window) = setup(&args.common, 512)?;
    let text = read_text(&args.file)?;
    let ids = loaded.tokenizer.encode(&text, false)?;
    let result = perplexity(&loaded.model, &ids, window, true)?;
    if args.common.json {
        let mut obj = serde_json::to_value(&result)?;
        obj["ctx"] = window.into();
        obj["peak_rss_bytes"] = peak_rss_bytes().into();
        println!("{}", serde_json::to_string_pretty(&obj)?);
    } else {
        println!(
            "perplexity {:.4} over {} tokens (windows of {window})",
            result.perplexity, result.tokens
        );
    }
    Ok(())
}

fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", path.display()))
}
