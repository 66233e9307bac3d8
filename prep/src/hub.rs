//! What `convert MODEL` reads: a local path as it is (never sent to the hub; see
//! `leanstream::source::model_arg`), or a Hugging Face hub id resolved to a snapshot directory of the
//! standard cache (`HF_HOME`), downloading what is missing unless `HF_HUB_OFFLINE=1`. A hub id that
//! cannot be had is one line saying why and how to fill the cache on a connected machine.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::Cache;
use leanstream::source::model_arg::{classify, ModelArg};

/// Files a model needs besides its weights.
const REQUIRED: [&str; 2] = ["config.json", "tokenizer.json"];
const INDEX: &str = "model.safetensors.index.json";

/// Looks a file of the repository up: its local path, or `None` when the repository lacks it.
type Fetch<'a> = Box<dyn Fn(&str) -> Result<Option<PathBuf>> + 'a>;

/// The model directory or file `model` names, downloading a hub id's files if needed.
pub fn resolve_model(model: &str) -> Result<PathBuf> {
    match classify(Path::new(model))? {
        ModelArg::Path(path) => Ok(path),
        ModelArg::HubId(id) => resolve(&id),
    }
}

/// Returns the snapshot directory holding `model_id`'s config, tokenizer and weights.
fn resolve(model_id: &str) -> Result<PathBuf> {
    let offline =
        std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    let cache = Cache::from_env();
    let fill = format!(
        "on a connected machine, `leanstream-prep convert {model_id} -o model.lsb` converts it \
         (copy model.lsb here), or `huggingface-cli download {model_id}` fills that machine's \
         cache (copy it here and point HF_HOME at it)"
    );
    let fetch: Fetch = if offline {
        let repo = cache.model(model_id.to_string());
        Box::new(move |f| Ok(repo.get(f)))
    } else {
        let api = ApiBuilder::from_env()
            .build()
            .context("cannot set up the Hugging Face hub client")?;
        let endpoint =
            std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into());
        let repo = api.model(model_id.to_string());
        let cache_dir = cache.path().clone();
        let fill = fill.clone();
        Box::new(move |f| {
            match repo.get(f) {
            Ok(p) => Ok(Some(p)),
            Err(ApiError::RequestError(e)) if is_not_found(&e) => Ok(None),
            // One line: the innermost cause, not the chain of wrappers that each repeat it.
            Err(e) => Err(anyhow!(
                "cannot fetch {f} of {model_id} from the Hugging Face hub at {endpoint} ({}), and \
                 it is not in the local cache {}: check the network or the proxy settings; or {fill}",
                root_cause(&e),
                cache_dir.display()
            )),
        }
        })
    };
    let need = |f: &str| -> Result<PathBuf> {
        fetch(f)?.ok_or_else(|| {
            if offline {
                anyhow!(
                    "{model_id} is not in the local Hugging Face cache {} ({f} is missing; the \
                     folder is HF_HOME/hub) and HF_HUB_OFFLINE=1 forbids downloading: {fill}",
                    cache.path().display()
                )
            } else {
                anyhow!("{model_id} has no {f} on the Hugging Face hub: is it a model repository?")
            }
        })
    };
    let config = need(REQUIRED[0])?;
    need(REQUIRED[1])?;
    // Optional files: generation settings and the chat template.
    for optional in [
        "generation_config.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        let _ = fetch(optional);
    }
    if let Some(index) = fetch(INDEX)? {
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index)?)
            .with_context(|| format!("{} is not valid JSON", index.display()))?;
        let shards: std::collections::BTreeSet<&str> = json["weight_map"]
            .as_object()
            .with_context(|| format!("{} has no weight_map", index.display()))?
            .values()
            .filter_map(|v| v.as_str())
            .collect();
        for shard in shards {
            need(shard)?;
        }
    } else {
        need("model.safetensors")?;
    }
    Ok(config
        .parent()
        .expect("a file in a snapshot directory")
        .to_path_buf())
}

/// Whether the hub answered 404: the repository lacks the file.
fn is_not_found(e: &dyn std::error::Error) -> bool {
    e.to_string().contains("404")
}

/// The innermost error of `e`'s source chain, as text.
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut inner = e;
    while let Some(source) = inner.source() {
        inner = source;
    }
    inner.to_string()
}
