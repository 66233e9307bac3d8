//! Opens what `--model PATH` names: a Hugging Face model directory or a GGUF file.

pub mod config;
pub mod conversion_cache;
pub mod gguf;
pub mod hf_tensors;
pub mod lsb_dense;
pub mod model_arg;
pub mod safetensors_dir;

use std::path::Path;

use anyhow::{bail, Context, Result};
use leanstream_format::meta::ChatTemplate;

use crate::model::Model;
use crate::source::gguf::GgufFile;
use crate::tokenizer::chat_template;
use crate::tokenizer::gguf as gguf_tokenizer;
use crate::tokenizer::Tokenizer;

/// A model ready to generate: weights, tokenizer, the tokens that end a generation and the chat
/// template, if the model has one.
pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub eos_token_ids: Vec<u32>,
    pub chat_template: Option<ChatTemplate>,
}

/// Loads a GGUF file, or a model directory (`config.json`, safetensors, `tokenizer.json`).
pub fn open(path: &Path) -> Result<LoadedModel> {
    if !path.exists() {
        bail!("model path {} does not exist", path.display());
    }
    if path.is_file() {
        return if is_converted(path)? {
            open_converted(path)
        } else {
            open_gguf(path)
        };
    }
    if !path.is_dir() {
        bail!(
            "{} is not a model directory: give a folder with config.json, *.safetensors and tokenizer.json, or a .gguf file",
            path.display()
        );
    }
    let model = Model::load(path)?;
    let tokenizer = Tokenizer::from_dir(path)?;
    let eos_token_ids = hf_eos_token_ids(path, &model.config().eos_token_ids)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        eos_token_ids,
        chat_template: chat_template::from_hf_dir(path)?,
    })
}

/// A converted LeanStream file starts with its magic; anything else is tried as GGUF.
pub fn is_converted(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut magic = [0u8; 8];
    let mut f =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let n = f
        .read(&mut magic)
        .with_context(|| format!("cannot read {}", path.display()))?;
    Ok(n == 8 && magic == leanstream_format::container::MAGIC)
}

/// Loads a converted file whole, as the dense model.
fn open_converted(path: &Path) -> Result<LoadedModel> {
    let file = leanstream_format::LsbFile::open(path)?;
    let tokenizer = Tokenizer::from_lsb(path)?;
    Ok(LoadedModel {
        eos_token_ids: file.meta.model.eos_token_ids.clone(),
        chat_template: file.meta.chat_template.clone(),
        model: crate::source::lsb_dense::load(&file)?,
        tokenizer,
    })
}

/// Loads a GGUF file: weights, and the tokenizer from its metadata.
fn open_gguf(path: &Path) -> Result<LoadedModel> {
    let file = GgufFile::open(path)?;
    let tokenizer = gguf_tokenizer::from_gguf(&file)?;
    Ok(LoadedModel {
        model: file.load_model()?,
        tokenizer: tokenizer.tokenizer,
        eos_token_ids: tokenizer.eos_token_ids,
        chat_template: tokenizer.chat_template,
    })
}

/// The tokens that end a generation of the Hugging Face model in `dir`: `config_ids` (its
/// `config.json`'s `eos_token_id`) and the `eos_token_id` of its `generation_config.json`, sorted,
/// without repeats. The one rule for a model folder, whether it runs as it is or is converted
/// first, so that both stop at the same tokens.
pub fn hf_eos_token_ids(dir: &Path, config_ids: &[u32]) -> Result<Vec<u32>> {
    let mut ids = config_ids.to_vec();
    ids.extend(generation_config_eos(dir)?);
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

/// `eos_token_id` of `generation_config.json` (chat models list their end-of-turn token there).
fn generation_config_eos(dir: &Path) -> Result<Vec<u32>> {
    let path = dir.join("generation_config.json");
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    Ok(match json.get("eos_token_id") {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|n| n as u32).into_iter().collect(),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|v| v.as_u64())
            .map(|n| n as u32)
            .collect(),
        _ => Vec::new(),
    })
}
