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
//! `tokenizer.ggml.*`, padded to the model's vocabulary. The whole model is held in memory while
//! the file is written (candle's GGUF writer takes every tensor at once): a workstation's job.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
use candle_core::Device;
use leanstream::gguf::{gguf_name, permute_rope_rows};
use leanstream::gguf_tokenizer::metadata_of;
use leanstream_format::model_config::{Activation, Architecture};
use leanstream_format::quant::{dequantize_row, quantize_row, row_bytes, QuantType};
use leanstream_format::LsbFile;

use crate::convert::bar;

#[derive(clap::Args)]
pub struct GgufArgs {
    /// A converted file (dense models of architecture llama, mistral or qwen3 with SiLU).
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
    if c.moe.is_some() {
        bail!("{name} is a mixture of experts: only dense models can be written as GGUF yet");
    }
    if c.activation != Activation::Silu {
        bail!(
            "{name} gates its FFN with {:?}; llama.cpp's llama and qwen3 graphs use SiLU, so the \
             GGUF would be a different model",
            c.activation
        );
    }
    if c.rope_scaling.is_some() || c.sliding_window.is_some() {
        bail!(
            "{name}: rope scaling and sliding-window attention are not written to GGUF (the \
             runtime's GGUF reader does not take them back either)"
        );
    }
    let arch = match c.architecture {
        Architecture::Llama | Architecture::Mistral => "llama",
        Architecture::Qwen3 => "qwen3",
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
    let (tokenizer, padding_tokens) = metadata_of(&file.tokenizer_json, Some(c.vocab_size))
        .with_context(|| format!("{name}: its tokenizer cannot be written as GGUF metadata"))?;
    metadata.extend(tokenizer);
    if let Some(bos) = c.bos_token_id {
        metadata.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(bos)));
    }
    if let Some(&eos) = c.eos_token_ids.first() {
        metadata.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)));
    }

    let mut reader = File::open(src).with_context(|| format!("cannot open {name}"))?;
    let progress = bar(progress, c.num_layers as u64 + 1, "layers");
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for t in &file.dense.tensors {
        let gguf = gguf_name(&t.name)
            .with_context(|| format!("{name}: tensor {} has no GGUF name", t.name))?;
        let mut data = file.read_dense(&mut reader, t)?;
        if arch == "llama" {
            let heads = if t.name.ends_with("self_attn.q_proj.weight") {
                Some(c.num_heads)
            } else if t.name.ends_with("self_attn.k_proj.weight") {
                Some(c.num_kv_heads)
            } else {
                None
            };
            if let Some(heads) = heads {
                data = permute_rope_rows(&data, heads, row_bytes(t.qtype, t.cols())?);
            }
        }
        let dims = t.shape.iter().map(|&d| d as usize).collect();
        tensors.push((gguf, tensor(t.qtype, &data, dims)?));
    }
    progress.inc(1);
    for l in 0..c.num_layers {
        for (part, data, dims) in ffn_tensors(&file, &mut reader, l)? {
            let hf = format!("model.layers.{l}.mlp.{part}.weight");
            let gguf = gguf_name(&hf).expect("FFN names map to GGUF");
            tensors.push((gguf, tensor(file.ffn.layers[l].qtype, &data, dims)?));
        }
        progress.inc(1);
    }
    progress.finish_and_clear();

    let tmp = out.with_extension("gguf.partial");
    let write = || -> Result<()> {
        let mut w = BufWriter::new(
            File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?,
        );
        let meta: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
        gguf_file::write(&mut w, &meta, &refs)?;
        w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        Ok(())
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.context(format!("cannot write {}", out.display())));
    }
    std::fs::rename(&tmp, out)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), out.display()))?;
    Ok(Exported {
        output: out.to_path_buf(),
        architecture: arch,
        tensors: tensors.len(),
        file_bytes: std::fs::metadata(out)?.len(),
        padding_tokens,
    })
}

/// A GGML tensor of `dims` (rows first) from encoded bytes.
fn tensor(qtype: QuantType, data: &[u8], dims: Vec<usize>) -> Result<QTensor> {
    let dtype = match qtype {
        QuantType::F32 => GgmlDType::F32,
        QuantType::F16 => GgmlDType::F16,
        QuantType::BF16 => GgmlDType::BF16,
        QuantType::Q8_0 => GgmlDType::Q8_0,
        QuantType::Q4_0 => GgmlDType::Q4_0,
        QuantType::Q4_1 => GgmlDType::Q4_1,
    };
    Ok(qtensor_from_ggml(dtype, data, dims, &Device::Cpu)?)
}

/// A Hugging Face FFN matrix's name part, its encoded rows and its shape (rows first).
type FfnTensor = (&'static str, Vec<u8>, Vec<usize>);

/// Layer `l`'s gate, up (`[n, h]`, rows copied from the bundles in original neuron order) and
/// down (`[h, n]`, decoded from the bundles' columns and encoded along its rows).
fn ffn_tensors(file: &LsbFile, reader: &mut File, l: usize) -> Result<[FfnTensor; 3]> {
    let layer = &file.ffn.layers[l];
    let (h, n, qtype) = (layer.hidden as usize, layer.neurons(), layer.qtype);
    let (rb, bb) = (layer.row_bytes(), layer.bundle_bytes());
    let down_row_bytes = row_bytes(qtype, n).with_context(|| {
        format!(
            "{}: layer {l}'s {n} neurons are not a whole number of {} blocks, so its down \
             projection has no GGUF rows in that type",
            file.path.display(),
            qtype.name()
        )
    })?;
    let (mut gate, mut up) = (vec![0u8; n * rb], vec![0u8; n * rb]);
    let mut down = vec![0f32; h * n];
    let mut column = vec![0f32; h];
    for (ci, cluster) in layer.clusters.iter().enumerate() {
        let bytes = file.read_cluster(reader, l, ci)?;
        for k in 0..cluster.count as usize {
            let i = layer.perm[cluster.first as usize + k] as usize;
            let bundle = &bytes[k * bb..(k + 1) * bb];
            gate[i * rb..(i + 1) * rb].copy_from_slice(&bundle[..rb]);
            up[i * rb..(i + 1) * rb].copy_from_slice(&bundle[rb..2 * rb]);
            dequantize_row(qtype, &bundle[2 * rb..], &mut column)?;
            for (j, v) in column.iter().enumerate() {
                down[j * n + i] = *v;
            }
        }
    }
    let mut down_rows = Vec::with_capacity(h * down_row_bytes);
    for row in down.chunks_exact(n) {
        down_rows.extend(quantize_row(qtype, row)?);
    }
    Ok([
        ("gate_proj", gate, vec![n, h]),
        ("up_proj", up, vec![n, h]),
        ("down_proj", down_rows, vec![h, n]),
    ])
}
