//! `leanstream demo`: the product in one command. Converts a model (by default the embedded
//! `models/austen-relu`) once with the `leanstream-prep` binary, caching the result by the model's
//! checksum and the converter's version; generates under a budget that leaves most of the FFN on
//! an emulated UFS 4.0 flash, streaming the text; then says what happened and runs the same
//! generation with every weight in DRAM (`dense`) for comparison.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;

use crate::generate::{generate, GenerateOptions, Generation};
use crate::memory::peak_rss_bytes;
use crate::memory_size::{format_size, parse_budget};
use crate::sampler::SamplerConfig;
use crate::session::{PolicyChoice, Session, SessionOptions};
use crate::source;
use crate::storage::FlashProfile;
use crate::streaming::{memory_split, Sparsity, Tuning};

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

pub fn run(args: DemoArgs) -> Result<()> {
    let model = match &args.model {
        Some(m) => m.clone(),
        None => embedded_model()?,
    };
    let (file, converted_now) = converted_file(&model)?;
    let split = memory_split(&file, CTX)?;
    let minimum = split.fixed();
    let budget = args.memory.unwrap_or(split.budget_for_ffn_share(0.25));
    let flash = FlashProfile::from_flash_arg(&args.flash)?;
    let opts = GenerateOptions {
        max_tokens: args.n_tokens as usize,
        ctx: CTX,
        // Greedy, so the two policies can be compared token for token.
        sampler: SamplerConfig {
            repeat_penalty: 1.1,
            ..Default::default()
        },
        eos_token_ids: Vec::new(),
    };
    let session = |policy, memory, flash| {
        Session::open(&SessionOptions {
            model: file.clone(),
            policy: Some(policy),
            memory,
            flash,
            sparsity: Sparsity::Certified,
            ctx: Some(CTX),
            default_ctx: CTX,
            kv: Default::default(),
            tuning: Tuning::default(),
        })
    };

    let mut streaming = session(PolicyChoice::Leanstream, Some(budget), flash)?;
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
    let mut dense = session(PolicyChoice::Dense, None, None)?;
    let reference = run_once(&mut dense, &args.prompt, &opts, |_| {})?;
    let identical = lean.tokens == reference.tokens;

    let f = |key: &str| report[key].as_f64().unwrap_or(f64::NAN);
    if args.json {
        let out = json!({
            "model": model,
            "converted_file": file,
            "converted_now": converted_now,
            "prompt": args.prompt,
            "flash": args.flash,
            "memory_budget_bytes": budget,
            "minimum_memory_bytes": minimum,
            "ffn_bytes": split["ffn_total"],
            "memory_split": split,
            "peak_rss_bytes": peak_rss,
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
                "text": reference.text,
                "tokens_per_s": reference.stats.tokens_per_s,
            },
            "identical_text": identical,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let ffn = split["ffn_total"].as_u64().unwrap_or(0);
    println!("\n");
    println!(
        "what happened ({} tokens, certified sparsity, --flash {}):",
        lean.stats.generated_tokens, args.flash
    );
    println!(
        "  memory: budget {} = minimum {} + {:.0} % of the {} of FFN bundles; peak RSS {}",
        format_size(budget),
        format_size(minimum),
        100.0 * budget.saturating_sub(minimum) as f64 / ffn.max(1) as f64,
        format_size(ffn),
        peak_rss.map_or("unknown".into(), format_size)
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
        lean.stats.tokens_per_s, reference.stats.tokens_per_s
    );
    println!("  identical text: {identical}");
    if !identical {
        println!("  dense text: {}{}", args.prompt, reference.text);
    }
    Ok(())
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

/// The converted file for `model`, and whether it was converted now (else it came from the
/// cache, keyed by the model's checksum, the flags and the converter's version, or `model` is
/// already converted).
fn converted_file(model: &Path) -> Result<(PathBuf, bool)> {
    if !model.exists() {
        bail!("model path {} does not exist", model.display());
    }
    if model.is_file() && source::is_converted(model)? {
        return Ok((model.to_path_buf(), false));
    }
    let prep = prep_binary()?;
    let version = converter_version(&prep)?;
    let name = model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let dir = cache_dir()?;
    let out = dir.join(format!(
        "{name}-{:016x}-{version}.lsb",
        conversion_key(model)?
    ));
    if out.is_file() {
        return Ok((out, false));
    }
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create the cache folder {}", dir.display()))?;
    eprintln!(
        "converting {} with {} (once; cached as {})",
        model.display(),
        prep.display(),
        out.display()
    );
    // prep writes under a temporary name and renames, so a cached file is always complete.
    let status = Command::new(&prep)
        .arg("convert")
        .arg(model)
        .arg("-o")
        .arg(&out)
        .args(CONVERT_FLAGS)
        .stdout(Stdio::null())
        .status()
        .with_context(|| format!("cannot run {}", prep.display()))?;
    if !status.success() {
        bail!(
            "{} convert {} failed ({status}); see its message above",
            prep.display(),
            model.display()
        );
    }
    Ok((out, true))
}

/// `leanstream-prep` beside this executable, else on `PATH`.
fn prep_binary() -> Result<PathBuf> {
    let name = format!("leanstream-prep{}", std::env::consts::EXE_SUFFIX);
    let exe = std::env::current_exe().context("cannot locate the leanstream executable")?;
    let beside = exe.parent().map(|d| d.join(&name));
    let on_path = || {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join(&name))
                .find(|p| p.is_file())
        })
    };
    beside
        .filter(|p| p.is_file())
        .or_else(on_path)
        .with_context(|| {
            format!(
            "the demo converts the model with leanstream-prep, which is neither beside {} nor on \
             PATH: `cargo build --release` builds both binaries",
            exe.display()
        )
        })
}

/// `leanstream-prep --version`, made safe for a file name.
fn converter_version(prep: &Path) -> Result<String> {
    let out = Command::new(prep)
        .arg("--version")
        .output()
        .with_context(|| format!("cannot run {}", prep.display()))?;
    if !out.status.success() {
        bail!("{} --version failed ({})", prep.display(), out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .trim()
        .trim_start_matches("leanstream-prep")
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect())
}

/// `$LEANSTREAM_CACHE`, else `~/.cache/leanstream`.
fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("LEANSTREAM_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME")
        .context("neither LEANSTREAM_CACHE nor HOME is set: set LEANSTREAM_CACHE to a folder")?;
    Ok(PathBuf::from(home).join(".cache/leanstream"))
}

/// xxh3 of the conversion flags and of a model file, or of a directory's files (names and
/// contents, in name order).
fn conversion_key(model: &Path) -> Result<u64> {
    let mut files = Vec::new();
    if model.is_dir() {
        for entry in
            std::fs::read_dir(model).with_context(|| format!("cannot list {}", model.display()))?
        {
            let path = entry?.path();
            if path.is_file() {
                files.push(path);
            }
        }
        files.sort();
    } else {
        files.push(model.to_path_buf());
    }
    let mut hash = xxhash_rust::xxh3::Xxh3Default::new();
    hash.update(CONVERT_FLAGS.join(" ").as_bytes());
    let mut buf = vec![0u8; 1 << 20];
    for path in files {
        hash.update(path.file_name().unwrap_or_default().as_encoded_bytes());
        let mut f = std::fs::File::open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        loop {
            let n = f
                .read(&mut buf)
                .with_context(|| format!("cannot read {}", path.display()))?;
            if n == 0 {
                break;
            }
            hash.update(&buf[..n]);
        }
    }
    Ok(hash.digest())
}
