//! Hugging Face hub ids: resolved to a snapshot directory of the standard cache (`HF_HOME`),
//! downloading what is missing unless `HF_HUB_OFFLINE=1`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::Cache;

/// Files a model needs besides its weights.
const REQUIRED: [&str; 2] = ["config.json", "tokenizer.json"];
const INDEX: &str = "model.safetensors.index.json";

/// Looks a file of the repository up: its local path, or `None` when the repository lacks it.
type Fetch<'a> = Box<dyn Fn(&str) -> Result<Option<PathBuf>> + 'a>;

/// Returns the snapshot directory holding `model_id`'s config, tokenizer and weights.
pub fn resolve(model_id: &str) -> Result<PathBuf> {
    if !model_id.contains('/') {
        bail!("{model_id} is neither a model directory nor a hub id (owner/name)");
    }
    let offline =
        std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    let fetch: Fetch = if offline {
        let repo = Cache::from_env().model(model_id.to_string());
        Box::new(move |f| Ok(repo.get(f)))
    } else {
        let api = ApiBuilder::from_env()
            .build()
            .context("cannot set up the Hugging Face hub client")?;
        let repo = api.model(model_id.to_string());
        Box::new(move |f| match repo.get(f) {
            Ok(p) => Ok(Some(p)),
            Err(hf_hub::api::sync::ApiError::RequestError(e)) if e.to_string().contains("404") => {
                Ok(None)
            }
            Err(e) => Err(e).with_context(|| format!("cannot download {f} of {model_id}")),
        })
    };
    let need = |f: &str| -> Result<PathBuf> {
        fetch(f)?.with_context(|| {
            if offline {
                format!("{model_id}: {f} is not in the Hugging Face cache and HF_HUB_OFFLINE=1")
            } else {
                format!("{model_id} has no {f}")
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
