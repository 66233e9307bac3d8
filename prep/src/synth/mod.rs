//! `leanstream-prep synth`: a full-size converted file of a published shape (random weights),
//! with the activation statistics of a converted source file planted: per-layer sparsity, hot-set
//! skew, token-to-token overlap, co-activation and predictor accuracy. It is written layer by
//! layer (dense tensors, then each FFN layer's bundles), so memory holds one layer's work plus the
//! index sections; the statistics it reaches are measured on held-out calibration text run
//! through the synthetic model itself and stored in META next to the source's.

mod dense;
mod layer;
mod moe;
mod plant;
pub(crate) mod shape;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use leanstream::kernels::{Matrix, QMatrix, Weight};
use leanstream::model::{rms_norm, DenseFfn, Model};
use leanstream::source::config::ModelConfig;
use leanstream::streaming::default_predictor_rank;
use leanstream::streaming::skip_rule::{Skip, SkipRule};
use leanstream::tokenizer::Tokenizer;
use leanstream_format::container::{ContainerWriter, SectionKind};
use leanstream_format::dense::DenseIndex;
use leanstream_format::ffn::{Cluster, FfnIndex, FfnLayer, PartTypes};
use leanstream_format::meta::{LayerMeta, Meta, Synthetic};
use leanstream_format::predictor::{normalise_input, PredictorInput, Predictors};
use leanstream_format::quant::{row_bytes, QuantType};
use leanstream_format::refine::Refine;
use leanstream_format::sketch::{Sketch, SketchLayer};
use leanstream_format::LsbFile;

use crate::calib::{Calibration, DEFAULT_CALIB, WINDOW};
use crate::certificate;
use crate::certificate_study;
use crate::convert::{
    bar, check_block_shapes, refine_stats, to_predictor, write_index_sections, write_tensor,
    LAYOUT, MIN_PREDICTOR_RANK,
};
use crate::sparsity::scores;
use crate::tensors::dense_specs;
use dense::{dense_row, Layout};
use layer::{Inputs, Params, Target};
use shape::Shape;

/// A neuron is active when `|silu(gate·x)| > 1`, i.e. `gate·x > 1.2785`: only the positive side
/// of SiLU counts (its minimum is −0.278).
const THRESHOLD: f32 = 1.0;

#[derive(clap::Args)]
pub struct SynthArgs {
    /// The published shape to copy.
    #[arg(long, value_enum)]
    shape: Shape,
    /// Weight encoding: q4 (the 7B-scale use), q8, f16, bf16 or f32.
    #[arg(long, default_value = "q4")]
    quant: QuantType,
    /// A converted file whose activation statistics (and tokenizer) the synthetic file takes.
    #[arg(long)]
    profile_from: PathBuf,
    /// Output file.
    #[arg(short, long)]
    output: PathBuf,
    /// Keep only the first N layers of the shape (tests, quick looks).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    layers: Option<u64>,
    /// Seed of every random weight.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Calibration tokens run through the synthetic model to plant and measure.
    #[arg(long, default_value_t = 1280, value_parser = clap::value_parser!(u64).range(512..))]
    calib_tokens: u64,
    /// Rank of the predictors (default: the largest at which both predictors of a layer, held
    /// as int8, take at most 3 % of its FFN bundle bytes; at least 4).
    #[arg(long, value_parser = clap::value_parser!(u64).range(3..))]
    predictor_rank: Option<u64>,
    /// Target size of a neuron cluster (one read), in KiB.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(4..=4096))]
    cluster_kib: u32,
    /// Also write the same weights as a GGUF file for llama.cpp (see `leanstream-prep gguf`).
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// Where the source's vocabulary is larger than the shape's (SmolLM2's 49,152 tokens against
    /// llama2-7b's 32,000), give the embedding and the head the source's size instead of stopping
    /// (dense shapes; the summary says so).
    #[arg(long)]
    source_vocab: bool,
    /// Also measure every candidate certificate design (bytes, reads per token) on the held-out
    /// rows, as `convert --certificate-study` does (`certificate_study` in --json).
    #[arg(long)]
    certificate_study: bool,
    /// Mixtures of experts: the share of a token's experts that the previous token also chose
    /// (default: the profile's measurement of its layer when `--profile-from` is a mixture,
    /// else 0.3).
    #[arg(long)]
    token_reuse: Option<f32>,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(args: SynthArgs) -> Result<()> {
    let started = Instant::now();
    let src = LsbFile::open(&args.profile_from)?;
    let src_path = args.profile_from.display().to_string();
    if args.shape.config(None, Vec::new()).moe.is_some() {
        return moe::run(&args, &src, started);
    }
    if src.meta.layers.iter().any(|l| l.activity.is_none()) {
        bail!(
            "{src_path} has no activity statistics (converted before format 1.1): convert the \
             source model again"
        );
    }
    let m = &src.meta.model;
    let mut config = args.shape.config(m.bos_token_id, m.eos_token_ids.clone());
    if let Some(l) = args.layers {
        config.num_layers = config.num_layers.min(l as usize);
    }
    let shape_vocab = config.vocab_size;
    config.vocab_size = vocab_size(&args, shape_vocab, m.vocab_size, &src_path)?;
    check_block_shapes(&config, args.quant)?;
    let lay = Layout::new(&config)?;
    let tokenizer = Tokenizer::from_bytes(&src.tokenizer_json)
        .with_context(|| format!("{src_path}: its tokenizer cannot be loaded"))?;
    let calib = Calibration::new(&tokenizer, None, DEFAULT_CALIB, args.calib_tokens as usize)?;
    let (h, n, layers) = (
        config.hidden_size,
        config.intermediate_size,
        config.num_layers,
    );
    let bundle_bytes = 3 * row_bytes(args.quant, h)?;
    let rank = args.predictor_rank.map_or_else(
        || {
            default_predictor_rank(
                h,
                config.intermediate_size,
                bundle_bytes,
                MIN_PREDICTOR_RANK,
            )
        },
        |r| r as usize,
    );

    let mut writer = ContainerWriter::create(&args.output)
        .with_context(|| format!("cannot write {}", args.output.display()))?;
    let bar = bar(!args.json, layers as u64 + 1, "layers");
    bar.set_message("dense weights");
    let (dense, inputs) = write_dense(&mut writer, &config, &lay, &args, &calib)?;
    bar.inc(1);

    let bundle_bytes = 3 * row_bytes(args.quant, h)?;
    let cluster_size = leanstream::kernels::grouped_cluster::cluster_neurons(
        args.cluster_kib,
        bundle_bytes,
        n,
        PartTypes::uniform(args.quant),
    );
    let sketch_q = match args.quant {
        QuantType::Q4_0 | QuantType::Q4_1 => QuantType::Q4_0,
        _ => QuantType::Q8_0,
    };
    let z_on = silu_inverse(THRESHOLD);
    let (mut ffn, mut predictors, mut sketch, mut refine) = (
        FfnIndex::default(),
        Predictors::default(),
        Sketch::default(),
        Refine::default(),
    );
    let (mut layer_meta, mut knobs, mut source_layer) = (Vec::new(), Vec::new(), Vec::new());
    let mut studies = Vec::new();
    writer.begin_section(LAYOUT.ffn_data());
    for l in 0..layers {
        bar.set_message(format!("layer {l}"));
        let sl = l * src.meta.layers.len() / layers;
        let src_freq = &src.refine.layers[sl].neuron_freq;
        let target = Target {
            meta: &src.meta.layers[sl],
            activity: src.meta.layers[sl].activity.expect("checked above"),
            freq: (0..n).map(|p| src_freq[p * src_freq.len() / n]).collect(),
        };
        let params = Params {
            h,
            n,
            rank,
            quant: args.quant,
            act: config.activation,
            threshold: THRESHOLD,
            z_on,
            cluster_size,
            seed: args.seed,
            layer: l,
        };
        let built = layer::build(&params, &lay, &inputs, &target)?;
        let mut sketch_layer = SketchLayer {
            qtype: sketch_q,
            hidden: h as u32,
            rows: Vec::new(),
            err_norm: Vec::new(),
        };
        let mut clusters = Vec::new();
        for (ci, chunk) in built.bundles.chunks(cluster_size).enumerate() {
            for b in chunk {
                certificate::add_sketch_row(
                    &mut sketch_layer,
                    sketch_q,
                    args.quant,
                    &b[..bundle_bytes / 3],
                    h,
                )?;
            }
            let extent = LAYOUT.arrange(&chunk.concat(), [bundle_bytes / 3; 3]);
            let (offset, extent_size, checksum) = writer.write_extent(&extent)?;
            clusters.push(Cluster {
                first: (ci * cluster_size) as u32,
                count: chunk.len() as u32,
                offset,
                extent_size,
                checksum,
            });
        }
        let identity: Vec<u32> = (0..n as u32).collect();
        refine.layers.push(refine_stats(
            &built.masks,
            &scores(SkipRule::Gate, config.activation, &built.gates, &[]),
            n,
            &inputs.train,
            &identity,
            cluster_size,
        ));
        predictors.own.push(to_predictor(
            built.own,
            &identity,
            l,
            PredictorInput::FfnInput,
            built.own_threshold,
        ));
        predictors.lookahead.push(to_predictor(
            built.lookahead,
            &identity,
            l.saturating_sub(1),
            PredictorInput::Residual,
            built.lookahead_threshold,
        ));
        // What the certificate saves on the held-out rows, so that the runtime keeps it only
        // where it earns its bytes (as `convert` measures it).
        let skip = Skip {
            act: config.activation,
            rule: SkipRule::Gate,
            threshold: THRESHOLD,
        };
        let saves = certificate::saves(&sketch_layer, skip, &inputs.x, &inputs.eval, cluster_size)?;
        if args.certificate_study {
            let gates: Vec<Vec<u8>> = built
                .bundles
                .iter()
                .map(|b| b[..bundle_bytes / 3].to_vec())
                .collect();
            let identity: Vec<u32> = (0..n as u32).collect();
            studies.push(certificate_study::layer(&certificate_study::LayerInput {
                gates: &gates,
                bundle: args.quant,
                hidden: h,
                skip,
                x: &inputs.x,
                rows: &inputs.eval,
                mask: &built.masks,
                perm: &identity,
                cluster_size,
                bundle_bytes,
                written: Some(sketch_q),
            })?);
        }
        sketch.layers.push(sketch_layer);
        ffn.layers.push(FfnLayer {
            qtypes: PartTypes::uniform(args.quant),
            hidden: h as u32,
            perm: layer::shuffled_order(n, args.seed ^ l as u64),
            clusters,
            layout: LAYOUT,
        });
        layer_meta.push(LayerMeta {
            certificate_saves: Some(saves),
            ..built.meta
        });
        knobs.push(built.knobs);
        source_layer.push(sl);
        bar.inc(1);
    }
    writer.end_section();
    bar.finish_and_clear();

    let mean_sparsity = layer_meta.iter().map(|l| l.sparsity).sum::<f32>() / layers as f32;
    let meta = Meta {
        model: config.clone(),
        dense_quant: args.quant.name().into(),
        ffn_quant: args.quant.name().into(),
        sparsity_mode: "threshold".into(),
        sparsity_target: Some(mean_sparsity),
        sparsity_rule: None,
        cluster_kib: args.cluster_kib,
        layers: layer_meta.clone(),
        provenance: serde_json::json!({
            "source": src_path,
            "converter": concat!("leanstream-prep ", env!("CARGO_PKG_VERSION"), " synth"),
            "calib_tokens": calib.tokens(),
            "heldout_tokens": inputs.eval.len(),
            "predictor_rank": 2 * ((rank - 1) / 2) + 1,
            "planted": knobs,
        }),
        // Synthetic text is noise: no chat template is carried over.
        chat_template: None,
        layout_only: false,
        synthetic: Some(Synthetic {
            shape: args.shape.name().into(),
            source: src_path.clone(),
            seed: args.seed,
            source_layer: source_layer.clone(),
            source_layers: src.meta.layers.clone(),
        }),
    };
    let side = (predictors, sketch, refine);
    write_index_sections(&mut writer, &meta, &src.tokenizer_json, &dense, &ffn, &side)?;
    writer.finish()?;

    let gguf = match &args.gguf {
        Some(path) => Some(crate::gguf_export::export(&args.output, path, !args.json)?),
        None => None,
    };
    let study = args
        .certificate_study
        .then(|| certificate_study::summarise(&studies, args.quant));
    let summary = serde_json::json!({
        "output": args.output,
        "gguf": gguf,
        "shape": args.shape.name(),
        "vocab_size": config.vocab_size,
        "shape_vocab_size": shape_vocab,
        "file_bytes": std::fs::metadata(&args.output)?.len(),
        "dense_bytes": dense.data_bytes(),
        "ffn_bytes": ffn.bundle_bytes(),
        "seconds": started.elapsed().as_secs_f64(),
        "peak_rss_bytes": leanstream::platform::memory::peak_rss_bytes(),
        "comparison": crate::inspect::comparison(&meta),
        "certificate_study": study,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!(
            "wrote {} ({:.2} GiB, {} layers of {}) in {:.0} s, peak RSS {:.0} MiB",
            args.output.display(),
            summary["file_bytes"].as_f64().unwrap_or(0.0) / (1u64 << 30) as f64,
            layers,
            args.shape.name(),
            summary["seconds"].as_f64().unwrap_or(0.0),
            summary["peak_rss_bytes"].as_f64().unwrap_or(0.0) / (1u64 << 20) as f64
        );
        if config.vocab_size != shape_vocab {
            println!(
                "vocabulary: {} tokens, the source's (the shape's is {shape_vocab})",
                config.vocab_size
            );
        }
        crate::inspect::print_comparison(&summary["comparison"]);
        if let Some(study) = &study {
            certificate_study::print(study);
        }
        if let Some(done) = &gguf {
            crate::gguf_export::print(done);
        }
    }
    Ok(())
}

/// The synthetic file's vocabulary: the shape's, or with `--source-vocab` the source's where it
/// is larger (the file carries the source's tokenizer, so it cannot be smaller).
fn vocab_size(args: &SynthArgs, shape: usize, source: usize, src_path: &str) -> Result<usize> {
    if source <= shape {
        return Ok(shape);
    }
    if !args.source_vocab {
        bail!(
            "{src_path}: its vocabulary ({source}) is larger than {}'s ({shape}); the synthetic \
             file uses the source's tokenizer, so pick a source with at most {shape} tokens, a \
             larger shape, or --source-vocab (the embedding and head take the source's size)",
            args.shape.name()
        );
    }
    Ok(source)
}

/// `z` with `silu(z) = y` on the increasing branch (y > 0).
fn silu_inverse(y: f32) -> f32 {
    let silu = |z: f64| z / (1.0 + (-z).exp());
    plant::solve_increasing(silu, y as f64, 0.0, 20.0, 60) as f32
}

/// Writes DENSE_DATA tensor by tensor and runs the calibration windows through embedding and
/// layer 0 (the only attention that writes anything) to get every layer's FFN input.
fn write_dense(
    writer: &mut ContainerWriter,
    config: &ModelConfig,
    lay: &Layout,
    args: &SynthArgs,
    calib: &Calibration,
) -> Result<(DenseIndex, Inputs)> {
    writer.begin_section(SectionKind::DenseData);
    let mut index = DenseIndex::default();
    let mut kept: HashMap<String, (Vec<usize>, Vec<u8>)> = HashMap::new();
    for (ti, spec) in dense_specs(config).into_iter().enumerate() {
        let (qtype, bytes) = tensor_bytes(lay, config, args, ti, &spec)?;
        index
            .tensors
            .push(write_tensor(writer, &spec, qtype, &bytes)?);
        if kept_for_inputs(&spec.name) {
            kept.insert(spec.name, (spec.shape, bytes));
        }
    }
    writer.end_section();
    Ok((index, layer0_inputs(config, args.quant, kept, calib)?))
}

/// Dense tensor `ti` (`spec`) encoded: its type (f32 for vectors and routers, else the file's)
/// and bytes.
fn tensor_bytes(
    lay: &Layout,
    config: &ModelConfig,
    args: &SynthArgs,
    ti: usize,
    spec: &crate::tensors::DenseSpec,
) -> Result<(QuantType, Vec<u8>)> {
    let qtype = if spec.stays_f32() {
        QuantType::F32
    } else {
        args.quant
    };
    let cols = *spec.shape.last().expect("shape");
    let rows = if spec.is_vector() { 1 } else { spec.shape[0] };
    let rb = row_bytes(qtype, cols)?;
    let mut bytes = vec![0u8; rows * rb];
    use rayon::prelude::*;
    bytes
        .par_chunks_mut(rb)
        .enumerate()
        .try_for_each(|(r, out)| -> Result<()> {
            let mut row = vec![0.0f32; cols];
            dense_row(lay, config, args.seed, ti as u64, &spec.name, r, &mut row);
            out.copy_from_slice(&leanstream_format::quant::quantize_row(qtype, &row)?);
            Ok(())
        })?;
    Ok((qtype, bytes))
}

/// Whether [`layer0_inputs`] needs the dense tensor `name`.
fn kept_for_inputs(name: &str) -> bool {
    let layer0 = name.starts_with("model.layers.0.") && !name.contains(".mlp.");
    layer0 || name == "model.embed_tokens.weight" || name == "model.norm.weight"
}

/// The calibration windows through the stored embedding and layer 0 (as the runtime computes
/// them, from the encoded weights), with layer 0's FFN left out: it writes back ~1e-5.
fn layer0_inputs(
    config: &ModelConfig,
    quant: QuantType,
    kept: HashMap<String, (Vec<usize>, Vec<u8>)>,
    calib: &Calibration,
) -> Result<Inputs> {
    let h = config.hidden_size;
    let one = ModelConfig {
        num_layers: 1,
        intermediate_size: 32,
        tie_word_embeddings: true,
        moe: None,
        ..config.clone()
    };
    let kept = std::cell::RefCell::new(kept);
    let take = |name: &str| {
        kept.borrow_mut()
            .remove(name)
            .with_context(|| format!("synthetic tensor {name} was not kept"))
    };
    let mut model = Model::without_ffn(
        one,
        |name, _| {
            let (_, b) = take(name)?;
            Ok(b.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect())
        },
        |name, rows, cols| {
            let (_, b) = take(name)?;
            Ok(Weight::Encoded(QMatrix::new(rows, cols, quant, b)?))
        },
    )?;
    let zero = |r, c| Weight::F32(Matrix::new(r, c, vec![0.0; r * c]));
    model.set_ffn(
        0,
        Some(DenseFfn {
            gate: zero(32, h),
            up: zero(32, h),
            down: zero(h, 32),
        }),
    );
    let (mut embed, mut resid) = (Vec::new(), Vec::new());
    for w in &calib.windows {
        let e = model.embed(w)?;
        let mut x = e.clone();
        let mut cache = model.new_cache(WINDOW);
        model.block(0, 0, &mut x, &mut cache, None);
        embed.extend(e);
        resid.extend(x);
    }
    let ones = vec![1.0f32; h];
    let mut x = vec![0.0f32; resid.len()];
    for (src, dst) in resid.chunks_exact(h).zip(x.chunks_exact_mut(h)) {
        rms_norm(src, &ones, config.rms_norm_eps, dst);
    }
    let hat = |v: &[f32]| -> Vec<f32> { v.chunks_exact(h).flat_map(normalise_input).collect() };
    let (train, eval) = calib.split_rows();
    let lay = Layout::new(config)?;
    let train_prev = calib.previous(&train);
    let part = |r: std::ops::Range<usize>| part_stats(&x, h, r, &train, &train_prev);
    let ((sf, rf), (ss, rs)) = (part(lay.fast.clone()), part(lay.slow.clone()));
    Ok(Inputs {
        embed_hat: hat(&embed),
        resid_hat: hat(&resid),
        eval_prev: calib.previous(&eval),
        x,
        train,
        eval,
        sigma: (sf, ss),
        rho: (rf, rs),
    })
}

/// RMS of the dimensions `dims` of `x` over `rows`, and their lag-1 correlation over consecutive
/// rows (`Σ x_t·x_{t−1} / Σ x_t²`).
fn part_stats(
    x: &[f32],
    h: usize,
    dims: std::ops::Range<usize>,
    rows: &[usize],
    prev: &[Option<usize>],
) -> (f32, f64) {
    let (mut sq, mut cross, mut sq_pairs) = (0.0f64, 0.0f64, 0.0f64);
    for (&r, &p) in rows.iter().zip(prev) {
        let a = &x[r * h..(r + 1) * h][dims.clone()];
        sq += a.iter().map(|v| (*v as f64).powi(2)).sum::<f64>();
        if let Some(p) = p {
            let b = &x[p * h..(p + 1) * h][dims.clone()];
            cross += a
                .iter()
                .zip(b)
                .map(|(u, v)| *u as f64 * *v as f64)
                .sum::<f64>();
            sq_pairs += a.iter().map(|v| (*v as f64).powi(2)).sum::<f64>();
        }
    }
    let count = (rows.len() * dims.len()).max(1) as f64;
    (
        (sq / count).sqrt() as f32,
        if sq_pairs > 0.0 {
            cross / sq_pairs
        } else {
            0.0
        },
    )
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        synth: SynthArgs,
    }

    fn args(extra: &[&str]) -> SynthArgs {
        let base = [
            "synth",
            "--shape",
            "llama2-7b",
            "--profile-from",
            "s.lsb",
            "-o",
            "o.lsb",
        ];
        Cli::parse_from(base.iter().chain(extra)).synth
    }

    #[test]
    fn a_larger_source_vocabulary_needs_the_flag() {
        // A source within the shape's vocabulary keeps the shape's size.
        assert_eq!(vocab_size(&args(&[]), 32000, 4096, "s.lsb").unwrap(), 32000);
        assert_eq!(
            vocab_size(&args(&["--source-vocab"]), 32000, 32000, "s.lsb").unwrap(),
            32000
        );
        // SmolLM2's 49,152 tokens against llama2-7b's 32,000: an error that names the way out,
        // or the source's size with `--source-vocab`.
        let err = vocab_size(&args(&[]), 32000, 49152, "s.lsb")
            .unwrap_err()
            .to_string();
        assert!(err.contains("s.lsb") && err.contains("49152") && err.contains("--source-vocab"));
        assert_eq!(
            vocab_size(&args(&["--source-vocab"]), 32000, 49152, "s.lsb").unwrap(),
            49152
        );
    }
}
