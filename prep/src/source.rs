//! What `convert` reads: a Hugging Face model directory or a GGUF file — the config, the tensors
//! by Hugging Face name as f32, and the tokenizer (embedded in the output as `tokenizer.json`).

use std::path::Path;

use anyhow::{bail, Context, Result};
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
