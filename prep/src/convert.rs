//! `leanstream-prep convert`: profile, sparsify, place, train predictors, quantize and write one
//! checksummed file, one layer at a time.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use leanstream::kernels::{Matrix, Weight};
use leanstream::model::Attention;
use leanstream::source::config::ModelConfig;
use leanstream::streaming::skip_rule::SkipRule;
use leanstream_format::container::{ContainerWriter, SectionKind};
use leanstream_format::dense::{DenseIndex, DenseTensor};
use leanstream_format::ffn::{ClusterLayout, FfnIndex};
use leanstream_format::meta::{LayerMeta, Meta};
use leanstream_format::predictor::{Predictor, PredictorInput, Predictors};
use leanstream_format::quant::{row_bytes, QuantType};
use leanstream_format::refine::{Refine, RefineLayer};
use leanstream_format::sketch::Sketch;
use serde::Serialize;

use crate::calibrate::{calibrate, CalibrateOptions};
use crate::certificate_study;
use crate::layout::write_layout;
use crate::memory_plan;
use crate::profile::Profiler;
use crate::source::Source;
use crate::sparsity::{down_norms, pow2_norms, rescale, AutoChoice, SparsityMode};
use crate::tensors::{dense_specs, ffn_names, quantize_rows};
use crate::train::{AtThreshold, Trained};

/// Partners per cluster kept in the refine statistics.
const NEIGHBOURS: usize = 8;
/// The layout of the cluster extents the converter writes (FORMAT.md §6.3): split, format 1.6.
pub(crate) const LAYOUT: ClusterLayout = ClusterLayout::Split;
/// The own predictor's output bias for a neuron it always names (its output weights zeroed):
/// `sigmoid(30)` is 1 in f32.
pub(crate) const ALWAYS_LOGIT: f32 = 30.0;

pub struct ConvertOptions {
    pub model_dir: PathBuf,
    pub source_name: String,
    pub output: PathBuf,
    pub quant: QuantType,
    /// Each tensor keeps the source's encoding where the file format has it (a GGUF file under
    /// `--quant auto`; [`crate::quant_choice`]); `quant` encodes the rest. The layout pass keeps
    /// them, and the calibration moves its bundles without encoding them again.
    pub keep: bool,
    pub cluster_kib: u32,
    /// Write the layout pass's file only (FORMAT.md §4.1 `layout_only`): no calibration.
    pub layout_only: bool,
    /// The memory the conversion may use (`--memory`); none: no limit but the machine's.
    pub memory: Option<u64>,
    /// How the layout pass's file is calibrated (its `sparsity` also names the layout's rule).
    pub calibration: CalibrateOptions,
}

impl ConvertOptions {
    /// `--sparsity`.
    pub fn sparsity(&self) -> &str {
        self.calibration.sparsity.as_deref().unwrap_or("auto")
    }
}

#[derive(Debug, Serialize)]
pub struct Summary {
    pub output: PathBuf,
    pub file_bytes: u64,
    pub dense_bytes: u64,
    pub ffn_bytes: u64,
    /// Bytes of a mixture's experts' bundles (0 for a dense model).
    pub expert_bytes: u64,
    pub quant: String,
    pub sparsity_mode: String,
    pub sparsity_rule: String,
    pub calib_tokens: usize,
    pub heldout_tokens: usize,
    pub cluster_neurons: Vec<usize>,
    pub layers: Vec<LayerMeta>,
    /// The sparse model (`perplexity`) against the dense one (`reference_perplexity`) on the
    /// held-out calibration windows; none for a mixture of experts (nothing is made sparse).
    pub quality: Option<leanstream::text::perplexity::Comparison>,
    /// The same in predicted mode (only the neurons the own predictors name, of those active).
    pub predicted_quality: Option<leanstream::text::perplexity::Comparison>,
    /// Each layer's own predictor at the file's threshold, on the held-out rows (none for a
    /// mixture).
    pub predicted: Vec<PredictedLayer>,
    /// What `--sparsity auto` chose and measured.
    pub sparsity_auto: Option<AutoChoice>,
    /// Each layer's certificate encoding (`none` where it has none).
    pub certificates: Vec<String>,
    /// `--certificate-study`: every candidate design's bytes and reads.
    pub certificate_study: Option<certificate_study::Study>,
    pub seconds: Phases,
    /// The peak memory stated before any work (none for a mixture of experts).
    pub memory_estimate: Option<memory_plan::Estimate>,
    /// The peak resident size the OS measured.
    pub peak_rss_bytes: Option<u64>,
}

/// A layer's own predictor as predicted mode uses it.
#[derive(Debug, Serialize)]
pub struct PredictedLayer {
    #[serde(flatten)]
    pub quality: AtThreshold,
    /// Neurons it always names ([`crate::train::massive`]).
    pub always: usize,
}

#[derive(Debug, Default, Serialize)]
pub struct Phases {
    pub load: f64,
    /// The layout pass: every tensor read once, encoded and written in the original order.
    pub layout: f64,
    pub dense: f64,
    pub allocate: f64,
    pub profile: f64,
    pub place: f64,
    pub train: f64,
    pub bundles: f64,
    pub finish: f64,
}

/// The smallest default predictor rank (a model so small that its share buys less).
pub(crate) const MIN_PREDICTOR_RANK: usize = 4;

pub fn convert(opts: &ConvertOptions) -> Result<Summary> {
    let mut phases = Phases::default();
    let t = Instant::now();
    let source = Source::open(&opts.model_dir)?;
    let config = source.config.clone();
    if config.moe.is_some() {
        phases.load = t.elapsed().as_secs_f64();
        if opts.layout_only {
            eprintln!(
                "note: a mixture of experts has no layout-only form yet; converting it whole"
            );
        }
        return crate::convert_moe::convert(opts, source, phases);
    }
    SparsityMode::parse(opts.sparsity(), config.activation)?;
    check_block_shapes(&config, opts.quant)?;
    let (tokens, estimate) = memory_plan::plan(
        &config,
        opts.quant,
        opts.calibration.calib_tokens,
        source.file_bytes(&opts.model_dir),
        opts.memory,
        opts.layout_only,
        &opts.source_name,
    )?;
    if opts.calibration.progress {
        let mib = |b: u64| b >> 20;
        eprintln!(
            "peak memory about {} MiB (layout pass {} MiB; calibration of {tokens} tokens: \
             embedding and head {} MiB, one block {} MiB, calibration state {} MiB)",
            mib(if opts.layout_only {
                estimate.layout
            } else {
                estimate.total
            }),
            mib(estimate.layout),
            mib(estimate.model),
            mib(estimate.block),
            mib(estimate.calibration)
        );
    }
    phases.load = t.elapsed().as_secs_f64();
    let t = Instant::now();
    if opts.layout_only {
        write_layout(opts, &source, &opts.output)?;
        drop(source);
        phases.layout = t.elapsed().as_secs_f64();
        return layout_summary(opts, phases, estimate);
    }
    // The layout pass writes a temporary file beside the output, which the calibration reads and
    // the guard removes.
    remove_stale(&opts.output, "layout");
    let layout = TempFile(sibling(&opts.output, "layout"));
    write_layout(opts, &source, &layout.0)?;
    drop(source);
    phases.layout = t.elapsed().as_secs_f64();
    let calibrate_opts = CalibrateOptions {
        calib_tokens: Some(tokens),
        ..opts.calibration.clone()
    };
    let mut summary = calibrate(&layout.0, &opts.output, &calibrate_opts, phases)?;
    summary.memory_estimate = Some(estimate);
    Ok(summary)
}

/// A file removed when this is dropped (whether the conversion succeeded or not).
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `.NAME.WHAT-PID` in `path`'s folder.
pub(crate) fn sibling(path: &Path, what: &str) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.{what}-{}", std::process::id()))
}

/// Removes what killed conversions to `output` left of their temporary `what` files (the layout
/// pass, the spilled profiles): `.NAME.WHAT-PID` and its own temporary `..NAME.WHAT-PID.tmp-PID`,
/// where process PID is gone (Linux: no `/proc/PID`). A live conversion's stay.
pub(crate) fn remove_stale(output: &Path, what: &str) {
    let dir = match output.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let (Some(name), Ok(entries)) = (output.file_name(), std::fs::read_dir(dir)) else {
        return;
    };
    if !Path::new("/proc/self").exists() {
        return;
    }
    let prefix = format!(".{}.{what}-", name.to_string_lossy());
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = file
            .strip_prefix(&prefix)
            .or_else(|| file.strip_prefix('.').and_then(|f| f.strip_prefix(&prefix)))
        else {
            continue;
        };
        let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if !pid.is_empty() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// What `convert --layout-only` reports: the file's sizes, nothing measured.
fn layout_summary(
    opts: &ConvertOptions,
    phases: Phases,
    estimate: memory_plan::Estimate,
) -> Result<Summary> {
    let f = leanstream_format::LsbFile::open(&opts.output)?;
    let mode = SparsityMode::parse(opts.sparsity(), f.meta.model.activation)?;
    Ok(Summary {
        file_bytes: std::fs::metadata(&opts.output)?.len(),
        output: opts.output.clone(),
        dense_bytes: f.dense.data_bytes(),
        ffn_bytes: f.ffn.bundle_bytes(),
        expert_bytes: 0,
        quant: f.meta.ffn_quant.clone(),
        sparsity_mode: "layout-only".into(),
        sparsity_rule: mode.rule().name().into(),
        calib_tokens: 0,
        heldout_tokens: 0,
        cluster_neurons: f
            .ffn
            .layers
            .iter()
            .map(|l| l.clusters[0].count as usize)
            .collect(),
        layers: f.meta.layers.clone(),
        quality: None,
        predicted_quality: None,
        predicted: Vec::new(),
        sparsity_auto: None,
        certificates: vec!["none".into(); f.meta.layers.len()],
        certificate_study: None,
        seconds: phases,
        memory_estimate: Some(estimate),
        peak_rss_bytes: leanstream::platform::memory::peak_rss_bytes(),
    })
}

/// An empty matrix: a block's attention projections while the calibration is elsewhere.
pub(crate) fn placeholder() -> Weight {
    Weight::F32(Matrix::new(0, 0, Vec::new()))
}

/// Drops block `l`'s attention and FFN weights from the profiler's model (see
/// [`crate::calibrate::install`]).
pub(crate) fn uninstall(profiler: &mut Profiler, l: usize) {
    let model = &mut profiler.model;
    model.set_ffn(l, None);
    let empty = Attention {
        wq: placeholder(),
        wk: placeholder(),
        wv: placeholder(),
        wo: placeholder(),
    };
    profiler.attention_spare = Some(model.set_attention(l, empty));
    release_free_memory();
}

/// Gives the allocator's free pages back to the OS. The calibration's worker threads allocate
/// each window's buffers in their own malloc arenas, which glibc does not shrink by itself: at a 7B
/// shape, block after block, they came to hold more than a GiB of free pages.
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory to the OS; it touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Layer `l`'s gate, up and down weights as f32 (`n × h`, `n × h`, `h × n`), and the power of two
/// each up row was scaled by. Under the `gate_up` rule every up row is scaled by its down
/// column's norm and the column divided by it, so the rule's score is the norm of the neuron's
/// contribution (see [`down_norms`], [`rescale`]); if `pow2`, by the norm's power of two
/// ([`pow2_norms`]), so that stored up rows keep their encoding and only their scale fields
/// change. The exponents are empty unless `pow2` under `gate_up`.
pub(crate) type FfnWeights = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<i32>);

/// See [`FfnWeights`].
pub(crate) fn ffn_weights(
    get: &impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
    l: usize,
    h: usize,
    n: usize,
    rule: SkipRule,
    pow2: bool,
) -> Result<FfnWeights> {
    let [gate_name, up_name, down_name] = ffn_names(l);
    let gate = get(&gate_name, &[n, h])?;
    let mut up = get(&up_name, &[n, h])?;
    let mut down = get(&down_name, &[h, n])?;
    let mut exponents = Vec::new();
    if rule == SkipRule::GateUp {
        let mut norms = down_norms(&down, h, n);
        if pow2 {
            exponents = pow2_norms(&mut norms);
        }
        rescale(&mut up, &mut down, &norms, h);
    }
    Ok((gate, up, down, exponents))
}

/// Writes the sections that follow a file's data — META, tokenizer, the dense and FFN indexes
/// and the per-neuron side data — raising the file's minor version to what they use. The one
/// writer of these sections for `convert`, its mixture-of-experts path and `synth`.
pub(crate) fn write_index_sections(
    writer: &mut ContainerWriter,
    meta: &Meta,
    tokenizer_json: &[u8],
    dense: &DenseIndex,
    ffn: &FfnIndex,
    (predictors, sketch, refine): &(Predictors, Sketch, Refine),
) -> Result<()> {
    writer.require_minor(meta.minor_version().max(sketch.minor_version()));
    writer.require_minor(dense.minor_version().max(ffn.minor_version()));
    writer.add_section(SectionKind::Meta, &serde_json::to_vec_pretty(meta)?, false)?;
    add_tokenizer(writer, tokenizer_json)?;
    writer.add_section(SectionKind::DenseIndex, &dense.encode(), false)?;
    writer.add_section(SectionKind::FfnIndex, &ffn.encode(), false)?;
    writer.add_section(SectionKind::Predictors, &predictors.encode(), false)?;
    writer.add_section(SectionKind::Sketch, &sketch.encode(), false)?;
    writer.add_section(SectionKind::Refine, &refine.encode(), false)?;
    Ok(())
}

/// Writes TOKENIZER, and BPE_VOCAB when the compact tokenizer reproduces `tokenizer.json` (else
/// says why on stderr: the runtime then parses `tokenizer.json`, about ten times its size).
fn add_tokenizer(writer: &mut ContainerWriter, json: &[u8]) -> Result<()> {
    writer.add_section(SectionKind::Tokenizer, json, true)?;
    match leanstream::tokenizer::bpe_vocab(json) {
        Ok(vocab) => writer.add_section(SectionKind::BpeVocab, &vocab.encode(), false)?,
        Err(e) => eprintln!(
            "note: the file gets no compact tokenizer ({e:#}); the runtime will parse tokenizer.json"
        ),
    }
    Ok(())
}

/// Block types need rows of whole blocks; say so before any work is done.
pub(crate) fn check_block_shapes(c: &ModelConfig, q: QuantType) -> Result<()> {
    for (what, n) in [
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("head_dim × heads", c.num_heads * c.head_dim),
    ] {
        row_bytes(q, n).with_context(|| {
            format!(
                "--quant {q} cannot encode this model ({what} = {n} is no multiple of {}, the \
                 values of one {q} block); use q8, q4_1 or f16",
                q.block_len()
            )
        })?;
    }
    Ok(())
}

/// Rows of f32 in runs: `rows(name, shape, each)` hands tensor `name` of `shape` to `each` a run
/// of whole rows at a time, in order ([`Source::tensor_rows`]), or whole ([`whole`]).
pub(crate) type RowRuns<'a> = dyn Fn(&str, &[usize], EachRun) -> Result<()> + 'a;

/// What takes each run of rows.
pub(crate) type EachRun<'b> = &'b mut dyn FnMut(&[f32]) -> Result<()>;

/// [`RowRuns`] of a source that gives each tensor whole.
pub(crate) fn whole<'a>(
    get: &'a impl Fn(&str, &[usize]) -> Result<Vec<f32>>,
) -> impl Fn(&str, &[usize], EachRun) -> Result<()> + 'a {
    move |name, shape, each| each(&get(name, shape)?)
}

/// Writes every dense tensor: as the source stores it where `stored` gives its encoded rows
/// ([`crate::source::Source::stored`]; not vectors or routers, which stay f32), else encoded as
/// `quant`.
pub(crate) fn write_dense(
    writer: &mut ContainerWriter,
    config: &ModelConfig,
    quant: QuantType,
    rows: &RowRuns,
    stored: &impl Fn(&str, &[usize]) -> Result<Option<(QuantType, Vec<u8>)>>,
) -> Result<DenseIndex> {
    writer.begin_section(SectionKind::DenseData);
    let mut index = DenseIndex::default();
    for spec in dense_specs(config) {
        if !spec.stays_f32() {
            if let Some((qtype, bytes)) = stored(&spec.source, &spec.shape)? {
                index
                    .tensors
                    .push(write_tensor(writer, &spec, qtype, &bytes)?);
                continue;
            }
        }
        let qtype = if spec.stays_f32() {
            QuantType::F32
        } else {
            quant
        };
        let cols = *spec.shape.last().expect("shape");
        let mut bytes = Vec::new();
        rows(&spec.source, &spec.shape, &mut |run| {
            bytes.extend(quantize_rows(qtype, run, cols, &spec.name)?);
            Ok(())
        })?;
        index
            .tensors
            .push(write_tensor(writer, &spec, qtype, &bytes)?);
    }
    writer.end_section();
    Ok(index)
}

/// Writes an encoded dense tensor as one extent of the open DENSE_DATA; returns its index entry.
pub(crate) fn write_tensor(
    writer: &mut ContainerWriter,
    spec: &crate::tensors::DenseSpec,
    qtype: QuantType,
    bytes: &[u8],
) -> Result<DenseTensor> {
    let (offset, extent_size, checksum) = writer.write_extent(bytes)?;
    Ok(DenseTensor {
        name: spec.name.clone(),
        qtype,
        shape: spec.shape.iter().map(|&d| d as u64).collect(),
        offset,
        size: bytes.len() as u64,
        extent_size,
        checksum,
    })
}

/// Cluster and neuron statistics in stored order.
pub(crate) fn refine_stats(
    mask: &[bool],
    score: &[f32],
    n: usize,
    rows: &[usize],
    perm: &[u32],
    cluster_size: usize,
) -> RefineLayer {
    let clusters = n.div_ceil(cluster_size);
    let mut active = ndarray::Array2::<f32>::zeros((rows.len(), clusters));
    let (mut freq, mut mag) = (vec![0.0f32; n], vec![0.0f32; n]);
    for (ri, &r) in rows.iter().enumerate() {
        for (p, &i) in perm.iter().enumerate() {
            let i = i as usize;
            if mask[r * n + i] {
                active[[ri, p / cluster_size]] = 1.0;
                freq[p] += 1.0;
                mag[p] += score[r * n + i];
            }
        }
    }
    for p in 0..n {
        if freq[p] > 0.0 {
            mag[p] /= freq[p];
        }
        freq[p] /= rows.len().max(1) as f32;
    }
    let co = active.t().dot(&active);
    let cluster_count: Vec<f32> = (0..clusters).map(|c| co[[c, c]]).collect();
    let k = NEIGHBOURS.min(clusters.saturating_sub(1));
    // Strongest first, ties to the lower cluster. One scratch list for every cluster, and each
    // keeps exactly its `k` (a list truncated from all the others would keep their capacity: at
    // a 7B shape, 2,752 clusters × 22 KB, 60 MB a layer held to the end of the conversion).
    let stronger = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let mut others: Vec<(u32, f32)> = Vec::with_capacity(clusters);
    let neighbours = (0..clusters)
        .map(|c| {
            others.clear();
            others.extend((0..clusters).filter(|&o| o != c).map(|o| {
                (
                    o as u32,
                    if cluster_count[c] > 0.0 {
                        co[[c, o]] / cluster_count[c]
                    } else {
                        0.0
                    },
                )
            }));
            if k < others.len() {
                others.select_nth_unstable_by(k, stronger);
            }
            let mut top = others[..k].to_vec();
            top.sort_by(stronger);
            top
        })
        .collect();
    let denom = rows.len().max(1) as f32;
    RefineLayer {
        cluster_freq: cluster_count.iter().map(|c| c / denom).collect(),
        neighbours,
        neuron_freq: freq,
        neuron_mag: mag,
    }
}

/// Reorders a predictor's outputs into stored order and packs it for the file.
pub(crate) fn to_predictor(
    t: Trained,
    perm: &[u32],
    source_layer: usize,
    input: PredictorInput,
    threshold: f32,
) -> Predictor {
    let (rank, d) = t.w1.dim();
    let mut w2 = Vec::with_capacity(perm.len() * rank);
    let mut b2 = Vec::with_capacity(perm.len());
    for &i in perm {
        w2.extend(t.w2.row(i as usize).iter());
        b2.push(t.b2[i as usize]);
    }
    Predictor {
        source_layer: source_layer as u32,
        input,
        input_dim: d as u32,
        rank: rank as u32,
        outputs: perm.len() as u32,
        threshold,
        w1: t.w1.iter().copied().collect(),
        b1: t.b1.to_vec(),
        w2,
        b2,
    }
}

pub(crate) fn bar(show: bool, len: u64, what: &str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template(&format!(
            "{{bar:40}} {{pos}}/{{len}} {what}  {{elapsed}} (eta {{eta}})  {{msg}}"
        ))
        .expect("valid template"),
    );
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refine_neighbours_are_the_strongest_k_and_hold_nothing_more() {
        let (n, rows, cluster_size) = (96, 40, 3);
        // A reproducible mask with ties (whole clusters on together) and singles.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut bit = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state.is_multiple_of(5)
        };
        let mask: Vec<bool> = (0..rows * n).map(|_| bit()).collect();
        let score = vec![1.0f32; rows * n];
        let perm: Vec<u32> = (0..n as u32).rev().collect();
        let all_rows: Vec<usize> = (0..rows).collect();
        let stats = refine_stats(&mask, &score, n, &all_rows, &perm, cluster_size);

        // Reference: every other cluster's P(other | this), sorted in full, the first k kept.
        let clusters = n / cluster_size;
        let on = |r: usize, c: usize| {
            (c * cluster_size..(c + 1) * cluster_size).any(|p| mask[r * n + perm[p] as usize])
        };
        for (c, got) in stats.neighbours.iter().enumerate() {
            let count = (0..rows).filter(|&r| on(r, c)).count() as f32;
            let mut want: Vec<(u32, f32)> = (0..clusters)
                .filter(|&o| o != c)
                .map(|o| {
                    let both = (0..rows).filter(|&r| on(r, c) && on(r, o)).count() as f32;
                    (o as u32, if count > 0.0 { both / count } else { 0.0 })
                })
                .collect();
            want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            want.truncate(NEIGHBOURS);
            assert_eq!(got, &want, "cluster {c}");
            assert_eq!(
                got.capacity(),
                NEIGHBOURS,
                "cluster {c} keeps spare capacity"
            );
        }
        assert_eq!(stats.neighbours.len(), clusters);
    }
}
