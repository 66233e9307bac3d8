//! What `convert` reads: a Hugging Face model directory or a GGUF file — the config, the tensors
//! by Hugging Face name as f32, and the tokenizer (embedded in the output as `tokenizer.json`).

use std::borrow::Cow;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::quantized::{QStorage, QTensor};
use candle_core::Device;
use leanstream::source::config::ModelConfig;
use leanstream::source::gguf::{quant_type, GgufFile};
use leanstream::source::safetensors_dir::SafetensorsDir;
use leanstream::tokenizer::Tokenizer;
use leanstream_format::meta::ChatTemplate;
use leanstream_format::quant::QuantType;

enum Tensors {
    Dir(SafetensorsDir),
    Gguf(GgufFile),
}

pub struct Source {
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    /// The tokenizer serialised as `tokenizer.json`.
    pub tokenizer_json: Vec<u8>,
    /// Carried into the converted file for `leanstream chat` and `run --chat`.
    pub chat_template: Option<ChatTemplate>,
    tensors: Tensors,
}

impl Source {
    pub fn open(path: &Path) -> Result<Self> {
        if path.is_dir() {
            let tokenizer_path = path.join("tokenizer.json");
            let tokenizer_json = std::fs::read(&tokenizer_path).map_err(|e| {
                anyhow::anyhow!(
                    "cannot read {}: {e}; the model directory needs tokenizer.json",
                    tokenizer_path.display()
                )
            })?;
            let mut config = leanstream::source::config::from_hf_dir(path)?;
            // Generation stops where a run of the same folder stops.
            config.eos_token_ids =
                leanstream::source::hf_eos_token_ids(path, &config.eos_token_ids)?;
            return Ok(Self {
                config,
                tokenizer: Tokenizer::from_bytes(&tokenizer_json)
                    .with_context(|| format!("invalid tokenizer {}", tokenizer_path.display()))?,
                tokenizer_json,
                chat_template: leanstream::tokenizer::chat_template::from_hf_dir(path)?,
                tensors: Tensors::Dir(SafetensorsDir::open(path)?),
            });
        }
        if !path.is_file() {
            bail!(
                "{} is neither a model directory nor a GGUF file",
                path.display()
            );
        }
        if leanstream::source::is_converted(path)? {
            bail!(
                "{} is already a converted LeanStream file: run it with `leanstream run --model {}`, or convert its source model",
                path.display(),
                path.display()
            );
        }
        let gguf = GgufFile::open(path)?;
        let mut config = gguf.config()?;
        let tok = leanstream::tokenizer::gguf::from_gguf(&gguf)?;
        // Generation stops where llama.cpp stops for this file.
        config.eos_token_ids = tok.eos_token_ids;
        Ok(Self {
            config,
            tokenizer_json: tok.tokenizer.to_json()?,
            tokenizer: tok.tokenizer,
            chat_template: tok.chat_template,
            tensors: Tensors::Gguf(gguf),
        })
    }

    /// Tensor `name` (Hugging Face naming) as f32, checked against `shape`. The source's pages
    /// are dropped from memory after each read: the converter reads each tensor once or a few
    /// times, and a mapped file's pages would otherwise stay resident (the whole source at the end).
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        match &self.tensors {
            Tensors::Dir(d) => {
                let t = leanstream::source::hf_tensors::tensor(d, &self.config, name, shape);
                d.release_pages();
                t
            }
            Tensors::Gguf(g) => {
                let t = g.tensor_f32(name, shape);
                g.release_pages();
                t
            }
        }
    }

    /// Matrix `name` (`rows × cols`) as f32 in runs of at most `chunk` rows, handed to `each` in
    /// order. A GGUF file's blocks are decoded one run at a time, so a large table (the
    /// embedding: SmolLM2's is 113 MB in f32) is never whole in f32; other sources give it whole.
    pub fn tensor_rows(
        &self,
        name: &str,
        [rows, cols]: [usize; 2],
        chunk: usize,
        mut each: impl FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        let Tensors::Gguf(g) = &self.tensors else {
            return each(&self.tensor(name, &[rows, cols])?);
        };
        let raw = g.raw_tensor(name, &[rows, cols])?;
        let row_bytes = raw.data.len() / rows.max(1);
        for start in (0..rows).step_by(chunk.max(1)) {
            let end = (start + chunk.max(1)).min(rows);
            let data = &raw.data[start * row_bytes..end * row_bytes];
            let decoded = QStorage::from_data(Cow::Borrowed(data), &Device::Cpu, raw.dtype)
                .and_then(|storage| QTensor::new(storage, (end - start, cols)))
                .and_then(|q| q.dequantize(&Device::Cpu))
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(|e| {
                    anyhow::anyhow!(
                        "{}: cannot decode rows {start}..{end} of {name} ({:?}): {e}",
                        g.path().display(),
                        raw.dtype
                    )
                })?;
            each(&decoded)?;
        }
        drop(raw);
        g.release_pages();
        Ok(())
    }

    /// Tensor `name` as the source stores it, checked against `shape`: its encoding and rows (in
    /// Hugging Face row order), when the source is a GGUF file and the file format has its
    /// encoding; `None` otherwise (a folder's tensors, or a GGUF type such as Q3_K).
    pub fn stored(&self, name: &str, shape: &[usize]) -> Result<Option<(QuantType, Vec<u8>)>> {
        let Tensors::Gguf(g) = &self.tensors else {
            return Ok(None);
        };
        let raw = g.raw_tensor(name, shape)?;
        let kept = quant_type(raw.dtype).map(|q| (q, raw.data.into_owned()));
        g.release_pages();
        Ok(kept)
    }

    /// Bytes of the source's tensor files.
    pub fn file_bytes(&self, path: &Path) -> u64 {
        let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
        if path.is_dir() {
            std::fs::read_dir(path)
                .map(|d| {
                    d.flatten()
                        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
                        .map(|e| size(&e.path()))
                        .sum()
                })
                .unwrap_or(0)
        } else {
            size(path)
        }
    }
}
