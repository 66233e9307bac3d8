//! `leanstream-prep gguf` (and `synth --gguf`): a converted file's weights written as a GGUF file
//! that llama.cpp loads, so the usual way of running a model (llama.cpp, which maps the file) is
//! measured on the same weights as LeanStream — for a synthetic 7B, whose weights exist nowhere
//! else, this is the only way to have a peer at all.
//!
//! Dense tensors, gate rows and up rows are copied byte for byte: this format's `q8`/`q4` blocks
//! are GGML's `Q8_0`/`Q4_0`, and neurons go back to their original order. The down projection is
//! stored by columns in the bundles but by rows in GGUF, so it is decoded and encoded again along
//! its rows in the same type (a second rounding of the same values). Query/key rows of `llama`
//! files take llama.cpp's converter order. The tokenizer (byte-level BPE) is written as
//! `tokenizer.ggml.*`, padded to the model's vocabulary.
//!
//! A Qwen3 mixture of experts is written in llama.cpp's `qwen3moe` layout: each mixture layer's
//! router as `blk.{l}.ffn_gate_inp` (f32) and its experts stacked in three 3-D tensors
//! `ffn_gate_exps` / `ffn_up_exps` (`[E, m, h]`, rows first) and `ffn_down_exps` (`[E, h, m]`),
//! with `expert_count`, `expert_used_count` and `expert_feed_forward_length` in the metadata
//! (llama.cpp renormalises the chosen experts' weights, so a file whose `norm_topk_prob` is false
//! is refused).
//!
//! The file is written tensor by tensor (GGUF's header, metadata and tensor table first, then each
//! tensor's data as it is decoded), so memory holds one dense tensor or one layer's FFN (its three
//! expert stacks) at a time: a 30B-shaped mixture exports in a few hundred MiB.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Value;
use leanstream::source::gguf::{gguf_name, permute_rope_rows};
use leanstream::tokenizer::gguf::metadata_of;
use leanstream_format::container::read_at;
use leanstream_format::ffn::{self, FfnLayer};
use leanstream_format::file::check_extent;
use leanstream_format::model_config::{Activation, Architecture};
use leanstream_format::quant::{dequantize_row, quantize_row, row_bytes, QuantType};
use leanstream_format::LsbFile;

use crate::convert::bar;

#[derive(clap::Args)]
pub struct GgufArgs {
    /// A converted file (architecture llama, mistral or qwen3 with SiLU, or a Qwen3 mixture of
    /// experts).
    file: PathBuf,
    /// Output GGUF file.
    #[arg(short, long)]
    output: PathBuf,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
}

/// What [`export`] wrote.
#[derive(serde::Serialize)]
pub struct Exported {
    pub output: PathBuf,
    pub architecture: &'static str,
    pub tensors: usize,
    pub file_bytes: u64,
    /// Tokens added to the tokenizer's own so that there is one per embedding row.
    pub padding_tokens: usize,
}

pub fn run(args: GgufArgs) -> Result<()> {
    let done = export(&args.file, &args.output, !args.json)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&done)?);
    } else {
        print(&done);
    }
    Ok(())
}

pub fn print(done: &Exported) {
    println!(
        "wrote {} ({:.2} GiB, {} tensors, GGUF architecture {}{})",
        done.output.display(),
        done.file_bytes as f64 / (1u64 << 30) as f64,
        done.tensors,
        done.architecture,
        match done.padding_tokens {
            0 => String::new(),
            n => format!(", {n} padding tokens"),
        }
    );
}

/// Writes the weights of the converted file `src` as the GGUF file `out` (through a temporary
/// name, renamed when complete).
pub fn export(src: &Path, out: &Path, progress: bool) -> Result<Exported> {
    let file = LsbFile::open(src)?;
    let name = src.display();
    let c = &file.meta.model;
    if c.activation != Activation::Silu {
        bail!(
            "{name} gates its FFN with {:?}; llama.cpp's llama and qwen3 graphs use SiLU, so the \
             GGUF would be a different model",
            c.activation
        );
    }
    if c.qkv_bias {
        bail!("{name}: q/k/v biases (Qwen2) are not written to GGUF yet");
    }
    if c.rope_scaling.is_some()
        || c.rope_freq_factors.is_some()
        || !c.no_rope_layers.is_empty()
        || c.sliding_window.is_some()
    {
        bail!(
            "{name}: rope scaling and sliding-window attention are not written to GGUF (the \
             runtime's GGUF reader does not take them back either)"
        );
    }
    let arch = match (c.architecture, &c.moe) {
        (Architecture::Llama | Architecture::Mistral, None) => "llama",
        (Architecture::Qwen3, None) => "qwen3",
        (Architecture::Qwen2, None) => {
            bail!("{name}: Qwen2 files (q/k/v biases) are not written to GGUF yet")
        }
        (Architecture::Gemma2 | Architecture::Gemma3 | Architecture::Phi3, _) => {
            bail!("{name}: Gemma and Phi-3 files are not written to GGUF yet")
        }
        (Architecture::Qwen3, Some(m)) => {
            if !m.norm_topk_prob {
                bail!(
                    "{name}: its router weights are not renormalised over the chosen experts \
                     (norm_topk_prob false), but llama.cpp's qwen3moe graph renormalises them, so \
                     the GGUF would be a different model"
                );
            }
            if !m.dense_layers.is_empty() {
                bail!(
                    "{name}: layers {:?} have a dense FFN among mixture layers, which llama.cpp's \
                     qwen3moe graph does not have",
                    m.dense_layers
                );
            }
            "qwen3moe"
        }
        (_, Some(_)) => bail!(
            "{name} is a {:?} mixture of experts: only Qwen3 mixtures (llama.cpp's qwen3moe) can \
             be written as GGUF yet",
            c.architecture
        ),
    };
    let key = |k: &str| format!("{arch}.{k}");
    let u32_of = |v: usize| Value::U32(v as u32);
    let mut metadata = vec![
        (
            "general.architecture".to_string(),
            Value::String(arch.into()),
        ),
        (
            "general.name".to_string(),
            Value::String(format!("exported by leanstream-prep from {name}")),
        ),
        (key("context_length"), u32_of(c.max_position_embeddings)),
        (key("embedding_length"), u32_of(c.hidden_size)),
        (key("feed_forward_length"), u32_of(c.intermediate_size)),
        (key("block_count"), u32_of(c.num_layers)),
        (key("attention.head_count"), u32_of(c.num_heads)),
        (key("attention.head_count_kv"), u32_of(c.num_kv_heads)),
        (key("attention.key_length"), u32_of(c.head_dim)),
        (key("attention.value_length"), u32_of(c.head_dim)),
        (key("rope.dimension_count"), u32_of(c.head_dim)),
        (key("rope.freq_base"), Value::F32(c.rope_theta)),
        (
            key("attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_norm_eps),
        ),
    ];
    if let Some(m) = &c.moe {
        metadata.extend([
            (key("expert_count"), u32_of(m.num_experts)),
            (key("expert_used_count"), u32_of(m.experts_per_token)),
            (
                key("expert_feed_forward_length"),
                u32_of(m.expert_intermediate_size),
            ),
        ]);
    }
    let (tokenizer, padding_tokens) = metadata_of(&file.tokenizer_json, Some(c.vocab_size))
        .with_context(|| format!("{name}: its tokenizer cannot be written as GGUF metadata"))?;
    metadata.extend(tokenizer);
    if let Some(bos) = c.bos_token_id {
        metadata.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(bos)));
    }
    if let Some(&eos) = c.eos_token_ids.first() {
        metadata.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)));
    }

    // The tensor table: every tensor's name, type and shape, in the order its data is written.
    let mut table: Vec<Planned> = Vec::new();
    for (i, t) in file.dense.tensors.iter().enumerate() {
        let gguf = gguf_name(&t.name)
            .with_context(|| format!("{name}: tensor {} has no GGUF name", t.name))?;
        let dims = t.shape.iter().map(|&d| d as usize).collect();
        table.push(Planned::new(gguf, t.qtype, dims, Part::Dense(i))?);
    }
    for l in 0..c.num_layers {
        let (h, q) = (c.hidden_size, file.ffn.layers[l].qtypes);
        let mut parts = [q.gate, q.up, q.down];
        if c.is_moe_layer(l) {
            let experts = &file.experts.layers[l];
            let Some(first) = experts.first() else {
                bail!("{name}: mixture layer {l} has no experts");
            };
            let (e, m, q) = (experts.len(), first.neurons(), first.qtypes);
            if experts.iter().any(|x| x.qtypes != q || x.neurons() != m) {
                bail!(
                    "{name}: layer {l}'s experts differ in type or size, but a GGUF stack of \
                     experts has one type and shape"
                );
            }
            parts = [q.gate, q.up, q.down];
            for (part, stack, dims) in [
                (0, "ffn_gate_exps", vec![e, m, h]),
                (1, "ffn_up_exps", vec![e, m, h]),
                (2, "ffn_down_exps", vec![e, h, m]),
            ] {
                let gguf = format!("blk.{l}.{stack}.weight");
                table.push(Planned::new(gguf, parts[part], dims, Part::Ffn(l, part))?);
            }
        } else {
            let n = file.ffn.layers[l].neurons();
            for (part, hf, dims) in [
                (0, "gate_proj", vec![n, h]),
                (1, "up_proj", vec![n, h]),
                (2, "down_proj", vec![h, n]),
            ] {
                let gguf = gguf_name(&format!("model.layers.{l}.mlp.{hf}.weight"))
                    .expect("FFN names map to GGUF");
                table.push(Planned::new(gguf, parts[part], dims, Part::Ffn(l, part))?);
            }
        }
    }

    let tmp = out.with_extension("gguf.partial");
    let progress = bar(progress, table.len() as u64, "tensors");
    let write = || -> Result<()> {
        let mut reader = File::open(src).with_context(|| format!("cannot open {name}"))?;
        let mut w = BufWriter::with_capacity(
            1 << 20,
            File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?,
        );
        write_header(&mut w, &metadata, &table)?;
        // One layer's FFN (dense, or its three stacks of experts) at a time.
        let mut layer: Option<(usize, [Vec<u8>; 3])> = None;
        for t in &table {
            let data = match t.part {
                Part::Dense(i) => {
                    let d = &file.dense.tensors[i];
                    let mut data = file.read_dense(&mut reader, d)?;
                    if arch == "llama" {
                        let heads = if d.name.ends_with("self_attn.q_proj.weight") {
                            Some(c.num_heads)
                        } else if d.name.ends_with("self_attn.k_proj.weight") {
                            Some(c.num_kv_heads)
                        } else {
                            None
                        };
                        if let Some(heads) = heads {
                            data = permute_rope_rows(&data, heads, row_bytes(d.qtype, d.cols())?);
                        }
                    }
                    data
                }
                Part::Ffn(l, part) => {
                    if layer.as_ref().is_none_or(|(at, _)| *at != l) {
                        layer = Some((l, layer_ffn(&file, &mut reader, l)?));
                    }
                    let (_, parts) = layer.as_mut().expect("just set");
                    std::mem::take(&mut parts[part])
                }
            };
            if data.len() as u64 != t.bytes {
                bail!(
                    "{name}: tensor {} has {} bytes, its shape implies {}",
                    t.name,
                    data.len(),
                    t.bytes
                );
            }
            w.write_all(&data)?;
            w.write_all(&vec![0u8; padding(t.bytes) as usize])?;
            progress.inc(1);
        }
        w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        Ok(())
    };
    let written = write();
    progress.finish_and_clear();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.context(format!("cannot write {}", out.display())));
    }
    std::fs::rename(&tmp, out)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), out.display()))?;
    Ok(Exported {
        output: out.to_path_buf(),
        architecture: arch,
        tensors: table.len(),
        file_bytes: std::fs::metadata(out)?.len(),
        padding_tokens,
    })
}

/// GGUF's default alignment of tensor data.
const ALIGNMENT: u64 = 32;

fn padding(bytes: u64) -> u64 {
    bytes.next_multiple_of(ALIGNMENT) - bytes
}

/// Where a tensor's data comes from.
#[derive(Clone, Copy)]
enum Part {
    /// A DENSE_INDEX tensor.
    Dense(usize),
    /// Layer `l`'s gate (0), up (1) or down (2): the dense FFN's matrix, or a mixture layer's
    /// stack of its experts' matrices.
    Ffn(usize, usize),
}

/// One entry of the tensor table.
struct Planned {
    name: String,
    /// GGML type id.
    ggml_type: u32,
    /// Rows first (as Hugging Face writes shapes); GGUF stores them innermost first.
    dims: Vec<usize>,
    bytes: u64,
    part: Part,
}

impl Planned {
    fn new(name: String, qtype: QuantType, dims: Vec<usize>, part: Part) -> Result<Self> {
        let cols = *dims.last().context("a tensor has a shape")?;
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let ggml_type = qtype.ggml_type();
        Ok(Self {
            bytes: (rows * row_bytes(qtype, cols)?) as u64,
            name,
            ggml_type,
            dims,
            part,
        })
    }
}

/// GGUF (version 3) up to the tensor data: header, metadata, tensor table, alignment padding.
fn write_header(w: &mut impl Write, metadata: &[(String, Value)], table: &[Planned]) -> Result<()> {
    w.write_all(b"GGUF")?;
    w.write_all(&3u32.to_le_bytes())?;
    w.write_all(&(table.len() as u64).to_le_bytes())?;
    w.write_all(&(metadata.len() as u64).to_le_bytes())?;
    let mut at = 24u64;
    for (k, v) in metadata {
        at += write_string(w, k)?;
        w.write_all(&value_type(v)?.to_le_bytes())?;
        at += 4 + write_value(w, v)?;
    }
    let mut offset = 0u64;
    for t in table {
        at += write_string(w, &t.name)?;
        w.write_all(&(t.dims.len() as u32).to_le_bytes())?;
        for &d in t.dims.iter().rev() {
            w.write_all(&(d as u64).to_le_bytes())?;
        }
        w.write_all(&t.ggml_type.to_le_bytes())?;
        w.write_all(&offset.to_le_bytes())?;
        at += 4 + 8 * t.dims.len() as u64 + 4 + 8;
        offset += t.bytes + padding(t.bytes);
    }
    w.write_all(&vec![0u8; padding(at) as usize])?;
    Ok(())
}

/// Writes a GGUF string; returns the bytes written.
fn write_string(w: &mut impl Write, s: &str) -> Result<u64> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())?;
    Ok(8 + s.len() as u64)
}

/// GGUF's id of a value's type.
fn value_type(v: &Value) -> Result<u32> {
    Ok(match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    })
}

/// Writes a metadata value (without its type); returns the bytes written.
fn write_value(w: &mut impl Write, v: &Value) -> Result<u64> {
    let mut put = |b: &[u8]| -> Result<u64> {
        w.write_all(b)?;
        Ok(b.len() as u64)
    };
    Ok(match v {
        Value::U8(x) => put(&x.to_le_bytes())?,
        Value::I8(x) => put(&x.to_le_bytes())?,
        Value::U16(x) => put(&x.to_le_bytes())?,
        Value::I16(x) => put(&x.to_le_bytes())?,
        Value::U32(x) => put(&x.to_le_bytes())?,
        Value::I32(x) => put(&x.to_le_bytes())?,
        Value::F32(x) => put(&x.to_le_bytes())?,
        Value::Bool(x) => put(&[u8::from(*x)])?,
        Value::U64(x) => put(&x.to_le_bytes())?,
        Value::I64(x) => put(&x.to_le_bytes())?,
        Value::F64(x) => put(&x.to_le_bytes())?,
        Value::String(s) => write_string(w, s)?,
        Value::Array(items) => {
            let t = items.first().map_or(Ok(4), value_type)?;
            if items.iter().any(|i| value_type(i).ok() != Some(t)) {
                bail!("a GGUF array holds values of one type");
            }
            w.write_all(&t.to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            let mut n = 12;
            for i in items {
                n += write_value(w, i)?;
            }
            n
        }
    })
}

/// Layer `l`'s FFN as GGUF data: gate and up rows in original neuron order, down along its rows
/// (decoded from the bundles' columns and encoded again); a mixture layer's three stacks hold its
/// experts' matrices one after the other.
fn layer_ffn(file: &LsbFile, reader: &mut File, l: usize) -> Result<[Vec<u8>; 3]> {
    let path = &file.path;
    if !file.meta.model.is_moe_layer(l) {
        let layer = &file.ffn.layers[l];
        return ffn_matrices(file, layer, l, |ci| Ok(file.read_cluster(reader, l, ci)?));
    }
    let mut stacks: [Vec<u8>; 3] = Default::default();
    for (e, expert) in file.experts.layers[l].iter().enumerate() {
        let (start, size) = file.expert_extent(l, e);
        let bytes = read_at(reader, path, start, size)?;
        let parts = ffn_matrices(file, expert, l, |ci| {
            let (offset, size) = file.expert_cluster_extent(l, e, ci);
            let at = (offset - start) as usize;
            let extent = &bytes[at..at + size as usize];
            check_extent(extent, expert.clusters[ci].checksum, || {
                format!("{}: layer {l} expert {e} cluster {ci}", path.display())
            })?;
            Ok(extent.to_vec())
        })?;
        for (stack, part) in stacks.iter_mut().zip(parts) {
            stack.extend(part);
        }
    }
    Ok(stacks)
}

/// An FFN's gate, up (`[n, h]`, rows copied from the bundles in original neuron order) and down
/// (`[h, n]`, decoded from the bundles' columns and encoded along its rows); `cluster(ci)` reads
/// cluster `ci`'s extent.
fn ffn_matrices(
    file: &LsbFile,
    layer: &FfnLayer,
    l: usize,
    mut cluster: impl FnMut(usize) -> Result<Vec<u8>>,
) -> Result<[Vec<u8>; 3]> {
    let (h, n, q) = (layer.hidden as usize, layer.neurons(), layer.qtypes);
    let qtype = q.down;
    let [rb, ub, _] = layer.row_bytes();
    let down_row_bytes = row_bytes(qtype, n).with_context(|| {
        format!(
            "{}: layer {l}'s {n} neurons are not a whole number of {} blocks, so its down \
             projection has no GGUF rows in that type",
            file.path.display(),
            qtype.name()
        )
    })?;
    let (mut gate, mut up) = (vec![0u8; n * rb], vec![0u8; n * ub]);
    let mut down = vec![0f32; h * n];
    let mut column = vec![0f32; h];
    for (ci, c) in layer.clusters.iter().enumerate() {
        let bytes = cluster(ci)?;
        for k in 0..c.count as usize {
            let i = layer.perm[c.first as usize + k] as usize;
            let row = |part: ffn::Part| layer.row(&bytes, ci, k, part);
            gate[i * rb..(i + 1) * rb].copy_from_slice(row(ffn::Part::Gate));
            up[i * ub..(i + 1) * ub].copy_from_slice(row(ffn::Part::Up));
            dequantize_row(qtype, row(ffn::Part::Down), &mut column)?;
            for (j, v) in column.iter().enumerate() {
                down[j * n + i] = *v;
            }
        }
    }
    let mut down_rows = Vec::with_capacity(h * down_row_bytes);
    for row in down.chunks_exact(n) {
        down_rows.extend(quantize_row(qtype, row)?);
    }
    Ok([gate, up, down_rows])
}
