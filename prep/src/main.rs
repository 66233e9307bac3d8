//! `leanstream-prep`: the workstation tool that converts a Hugging Face model into one checksummed
//! LeanStream file.

mod activity;
mod calib;
mod calibrate;
mod certificate;
mod certificate_study;
mod convert;
mod convert_moe;
mod gguf_export;
mod hub;
mod input_basis;
mod inspect;
mod layout;
mod memory_plan;
mod pack;
mod placement;
mod profile;
mod progress;
mod push;
mod quant_choice;
mod source;
mod sparsity;
mod sparsity_search;
mod spill;
mod stored;
mod synth;
mod tensors;
mod train;
mod train_moe;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

use crate::certificate::CertificateChoice;

#[derive(Parser)]
#[command(
    name = "leanstream-prep",
    version,
    about = "Convert Hugging Face models into LeanStream files",
    after_help = EXAMPLES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

const EXAMPLES: &str = "\
Examples:
  # Convert a GGUF file (its tokenizer is rebuilt from the metadata and embedded)
  leanstream-prep convert SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2.lsb

  # Convert a Hugging Face model by hub id (downloaded into the cache under HF_HOME), 4-bit bundles
  leanstream-prep convert HuggingFaceTB/SmolLM2-135M-Instruct -o smollm2.lsb --quant q4

  # Copy the file to a phone with adb, check it there, then run it on the phone
  leanstream-prep push smollm2.lsb --adb && adb shell leanstream run --model /data/local/tmp/smollm2.lsb --memory 200MB --ctx 512 -p Hi";

#[derive(Subcommand)]
enum Command {
    /// Profile, sparsify, cluster, train predictors and write one file.
    Convert {
        /// A model directory, a GGUF file, or a Hugging Face hub id (owner/name).
        model: String,
        /// Output file.
        #[arg(short, long)]
        output: PathBuf,
        /// Weight encoding: auto, f32, f16, bf16, q8, q4, q4_1, q5_0, q5_1, q4_k, q5_k or q6_k
        /// (the k-quants need widths that are multiples of 256). auto: a GGUF file keeps each
        /// tensor's encoding (FFN down columns become q6_k from 4- and 5-bit types, else q8;
        /// types the format lacks become q4_1 or q8), float weights become q8.
        #[arg(long, default_value = "auto")]
        quant: quant_choice::QuantArg,
        /// auto, relu, target:F (SwiGLU: skip by |silu(gate)·up|, a mean fraction F allocated
        /// across layers), target-uniform:F (the same fraction in every layer), or threshold:F
        /// (skip by |act(gate)|, fraction F per layer). auto: relu for ReLU models, else target:F at
        /// the largest F (a multiple of 0.05) whose perplexity on the held-out calibration windows
        /// is within 2 % of the dense model's (it says which).
        #[arg(long, default_value = "auto")]
        sparsity: String,
        /// The certificate exact mode skips unread neurons with: auto (per layer, the gate sketch
        /// encoding — the bundles' own, q8 or q4 — that saves most reads for its bytes, or none
        /// where none earns them; none for target:F, whose rule a gate sketch cannot prove), q8,
        /// q4, or none.
        #[arg(long, default_value = "auto")]
        certificate: String,
        /// Also measure every candidate certificate design (bytes, reads per token) on the
        /// held-out calibration rows and report it (`certificate_study` in --json).
        #[arg(long)]
        certificate_study: bool,
        #[command(flatten)]
        calibration: CalibrationArgs,
        /// Target size of a neuron cluster (one read), in KiB.
        #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(4..=4096))]
        cluster_kib: u32,
        /// Write the weights only, at once, without calibration: bundles in their original order,
        /// no sparsity, no predictors (exact streaming computes every neuron). `leanstream-prep
        /// calibrate FILE` upgrades the file in place later.
        #[arg(long)]
        layout_only: bool,
        /// The memory the conversion may use (e.g. 300MB): fewer calibration tokens where the
        /// default needs more; refused up front when even its layers one at a time need more.
        #[arg(long, value_parser = leanstream::platform::memory_size::parse_budget)]
        memory: Option<u64>,
        /// Print the summary as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Calibrate a converted file (one `convert --layout-only` wrote, or any dense one) in place:
    /// learned neuron order, sparsity thresholds, certificates and predictors, the weights
    /// unchanged.
    Calibrate {
        /// A converted file.
        file: PathBuf,
        /// Output file (default: FILE itself, replaced atomically).
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// As for convert (default: the mode the file was converted with, else auto).
        #[arg(long)]
        sparsity: Option<String>,
        /// As for convert.
        #[arg(long, default_value = "auto")]
        certificate: String,
        #[command(flatten)]
        calibration: CalibrationArgs,
        /// Print the summary as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Describe a converted file: sizes, sparsity, predictor quality.
    Inspect {
        file: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Rewrite a format 1.5 file's clusters in format 1.6's split layout (the same weights, no
    /// conversion): `[gate rows | up rows | down columns]` per cluster, the layout the runtime's
    /// gate pass reads fastest.
    Upgrade {
        /// A converted file of format 1.5 or before.
        file: PathBuf,
        /// Output file (may be FILE itself).
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Check every checksum of a converted file.
    Verify(leanstream::transfer::verify::VerifyArgs),
    /// Compress a converted file into one checksummed archive for transfer.
    Pack(pack::PackArgs),
    /// Copy a converted file to a device with adb or scp, then check it there.
    Push(push::PushArgs),
    /// Write a full-size file of a published shape with a source file's activity planted.
    Synth(synth::SynthArgs),
    /// Write a converted file's weights as a GGUF file for llama.cpp (the same weights, to compare).
    Gguf(gguf_export::GgufArgs),
    /// Train a small Qwen3-MoE from scratch on a text (how models/qwen3-moe-austen was made).
    TrainMoe(train_moe::TrainMoeArgs),
}

/// How `convert` and `calibrate` calibrate.
#[derive(clap::Args)]
struct CalibrationArgs {
    /// Calibration text (default: for SwiGLU models prose, Python source and technical English
    /// in turns, for ReLU models the prose alone; the texts shipped in data/).
    #[arg(long)]
    calib: Option<PathBuf>,
    /// Calibration tokens to profile (default: as many as about 192 MiB of calibration state
    /// holds, 2048 to 16384: SmolLM2-135M 3072, a 7B shape 2048; 16384 for a mixture).
    #[arg(long, value_parser = clap::value_parser!(u64).range(128..))]
    calib_tokens: Option<u64>,
    /// Rank of the predictors (default: the largest at which both predictors of a layer, held
    /// as int8, take at most 3 % of its FFN bundle bytes; at least 4).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    predictor_rank: Option<u64>,
    /// Training epochs of the predictors (default: 8 × 16384 / calibration tokens, 8 to 24).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    epochs: Option<u64>,
}

impl CalibrationArgs {
    fn options(
        self,
        sparsity: Option<String>,
        certificate: &str,
        certificate_study: bool,
        progress: bool,
    ) -> Result<calibrate::CalibrateOptions> {
        Ok(calibrate::CalibrateOptions {
            sparsity,
            certificate: CertificateChoice::parse(certificate)?,
            certificate_study,
            calib: self.calib,
            calib_tokens: self.calib_tokens.map(|t| t as usize),
            predictor_rank: self.predictor_rank.map(|r| r as usize),
            epochs: self.epochs.map(|e| e as usize),
            progress,
        })
    }
}

fn main() -> ExitCode {
    leanstream::platform::closed_pipe::end_quietly_when_stdout_closes();
    // `inspect` states the runtime's minimum budget, whose overhead term is the process's size at
    // start-up: take it now, before any model is loaded (as the runtime does).
    leanstream::platform::memory::startup_rss_bytes();
    fixed_mmap_threshold();
    match run(Cli::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(command: Command) -> Result<()> {
    match command {
        Command::Convert {
            model,
            output,
            quant,
            sparsity,
            certificate,
            certificate_study,
            calibration,
            cluster_kib,
            layout_only,
            memory,
            json,
        } => {
            let model_dir = hub::resolve_model(&model)?;
            let choice = quant_choice::resolve(quant, &model_dir)?;
            let quant = choice.quant;
            if !json {
                match choice.keep {
                    true => eprintln!("encoding {}", choice.why),
                    false => eprintln!("encoding {} ({})", quant.name(), choice.why),
                }
            }
            let opts = convert::ConvertOptions {
                model_dir,
                source_name: model,
                output,
                quant,
                keep: choice.keep,
                cluster_kib,
                layout_only,
                memory,
                calibration: calibration.options(
                    Some(sparsity),
                    &certificate,
                    certificate_study,
                    !json,
                )?,
            };
            let summary = convert::convert(&opts)?;
            report(&summary, json)?;
        }
        Command::Calibrate {
            file,
            output,
            sparsity,
            certificate,
            calibration,
            json,
        } => {
            let opts = calibration.options(sparsity, &certificate, false, !json)?;
            let output = output.unwrap_or_else(|| file.clone());
            let summary = calibrate::calibrate(&file, &output, &opts, Default::default())?;
            report(&summary, json)?;
        }
        Command::Inspect { file, json } => {
            let f = leanstream_format::LsbFile::open(&file)?;
            let v = inspect::describe(&f);
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                inspect::print(&v);
            }
        }
        Command::Upgrade { file, output } => upgrade(&file, &output)?,
        Command::Verify(args) => leanstream::transfer::verify::run(args)?,
        Command::Pack(args) => pack::run(args)?,
        Command::Push(args) => push::run(args)?,
        Command::Synth(args) => synth::run(args)?,
        Command::Gguf(args) => gguf_export::run(args)?,
        Command::TrainMoe(args) => train_moe::run(args)?,
    }
    Ok(())
}

/// glibc serves an allocation of 1 MiB or more from its own mapping, given back to the OS when
/// freed. Left to itself it raises that threshold after each such free, and the converter's
/// per-layer arrays (freed and made again every layer) then come from the heap, which keeps its
/// high-water mark and fragments: its peak RSS grew with depth (measured +23 MiB on a 4-layer
/// 512-wide model).
fn fixed_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter; called before any other thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

fn report(summary: &convert::Summary, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(summary)?);
    } else {
        print_summary(summary);
    }
    Ok(())
}

fn print_summary(s: &convert::Summary) {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "wrote {} ({:.1} MiB: dense {:.1} MiB, FFN bundles {:.1} MiB, experts {:.1} MiB, {})",
        s.output.display(),
        mib(s.file_bytes),
        mib(s.dense_bytes),
        mib(s.ffn_bytes),
        mib(s.expert_bytes),
        s.quant
    );
    println!(
        "calibration: {} tokens ({} held out); sparsity {} (rule {})",
        s.calib_tokens, s.heldout_tokens, s.sparsity_mode, s.sparsity_rule
    );
    println!("layer  sparsity  own recall/prec  look-ahead recall/prec  static recall  cluster fill (unordered)");
    for (i, l) in s.layers.iter().enumerate() {
        println!(
            "{i:>5}  {:>8.3}  {:>6.3}/{:<6.3}    {:>6.3}/{:<6.3}           {:>6.3}         {:.3} ({:.3})",
            l.sparsity,
            l.predictor_recall,
            l.predictor_precision,
            l.lookahead_recall,
            l.lookahead_precision,
            l.static_recall,
            l.cluster_fill,
            l.cluster_fill_unordered
        );
    }
    for (mode, q) in [("exact", &s.quality), ("predicted", &s.predicted_quality)] {
        let Some(q) = q else { continue };
        println!(
            "held-out perplexity, {mode}: dense {:.3}, sparse {:.3} ({:+.2} %); KL {:.4} nats; top-1 agreement {:.3}",
            q.reference_perplexity,
            q.perplexity,
            100.0 * (q.perplexity / q.reference_perplexity - 1.0),
            q.kl,
            q.top1_agreement
        );
    }
    let (n, p) = (s.predicted.len().max(1) as f32, &s.predicted);
    if !p.is_empty() {
        println!(
        "own predictors at their thresholds: recall {:.3}, precision {:.3}, predicted fraction {:.3} (means over layers), {} neurons always named",
        p.iter().map(|a| a.quality.recall).sum::<f32>() / n,
        p.iter().map(|a| a.quality.precision).sum::<f32>() / n,
        p.iter().map(|a| a.quality.predicted).sum::<f32>() / n,
        p.iter().map(|a| a.always).sum::<usize>()
    );
    }
    inspect::print_routing(&serde_json::to_value(&s.layers).unwrap_or_default());
    if !s.certificates.is_empty() {
        println!("certificate per layer: {}", s.certificates.join(" "));
    }
    if let Some(study) = &s.certificate_study {
        certificate_study::print(study);
    }
    let p = &s.seconds;
    println!(
        "time: load {:.1}s, layout {:.1}s, dense {:.1}s, allocate {:.1}s, profile {:.1}s, place {:.1}s, train {:.1}s, bundles {:.1}s, finish {:.1}s; peak RSS {:.0} MiB (estimated {:.0} MiB)",
        p.load,
        p.layout,
        p.dense,
        p.allocate,
        p.profile,
        p.place,
        p.train,
        p.bundles,
        p.finish,
        mib(s.peak_rss_bytes.unwrap_or(0)),
        mib(s.memory_estimate.map_or(0, |e| e.total))
    );
}

/// `upgrade`: `file`'s clusters rewritten split, as format 1.6 (FORMAT.md §6.3, §12).
fn upgrade(file: &std::path::Path, output: &std::path::Path) -> Result<()> {
    use leanstream_format::ffn::ClusterLayout;
    leanstream_format::relayout::relayout(file, output, ClusterLayout::Split)?;
    eprintln!("wrote {} (format 1.6, split clusters)", output.display());
    Ok(())
}
