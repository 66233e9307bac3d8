//! What a model argument names: a path on this machine, or a Hugging Face hub id (`owner/name`).
//! Both tools (`leanstream --model`, `leanstream-prep convert MODEL`) decide it here, so that a
//! mistyped path is reported as a missing file at once instead of being sent to the hub.
//!
//! An argument is a path when it names an existing file or folder, starts with `/`, `./`, `../`
//! or `~` (`~` and `~/…` are expanded with `HOME`, as a shell would), ends with a model file's
//! extension, or has a first component that is an existing folder (`models/typo`). Anything else of
//! the form `owner/name` is a hub id.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

/// A model argument, classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelArg {
    /// An existing file or folder.
    Path(PathBuf),
    /// A Hugging Face hub id, `owner/name`.
    HubId(String),
}

/// File extensions that only ever name local files.
const FILE_EXTENSIONS: [&str; 4] = ["gguf", "lsb", "safetensors", "zst"];

/// Classifies `arg`; a path that does not exist is the error "no such file or directory: ARG".
pub fn classify(arg: &Path) -> Result<ModelArg> {
    let path = expand_home(arg);
    if path.exists() {
        return Ok(ModelArg::Path(path));
    }
    let missing = || anyhow::anyhow!("no such file or directory: {}", arg.display());
    let Some(text) = arg.to_str() else {
        return Err(missing());
    };
    if looks_like_a_path(text) {
        return Err(missing());
    }
    if !is_hub_id(text) {
        bail!("no such file or directory: {text} (nor a Hugging Face hub id, which is owner/name)");
    }
    Ok(ModelArg::HubId(text.to_string()))
}

/// `~` and `~/…` with `HOME` in place of the tilde; anything else unchanged.
fn expand_home(arg: &Path) -> PathBuf {
    let home = || std::env::var_os("HOME").map(PathBuf::from);
    match arg.to_str() {
        Some("~") => home().unwrap_or_else(|| arg.to_path_buf()),
        Some(s) if s.starts_with("~/") => home()
            .map(|h| h.join(&s[2..]))
            .unwrap_or_else(|| arg.to_path_buf()),
        _ => arg.to_path_buf(),
    }
}

/// Whether a missing `arg` can only have meant a local path.
fn looks_like_a_path(arg: &str) -> bool {
    let explicit = ["/", "./", "../", "~"].iter().any(|p| arg.starts_with(p))
        || arg == "."
        || arg == ".."
        || arg.contains('\\');
    let extension = Path::new(arg)
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| FILE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()));
    let under_a_local_folder = arg
        .split_once('/')
        .is_some_and(|(first, _)| Path::new(first).is_dir());
    explicit || extension || under_a_local_folder
}

/// `owner/name` with the characters the hub allows (letters, digits, `-`, `_`, `.`).
fn is_hub_id(arg: &str) -> bool {
    let part = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    matches!(arg.split_once('/'), Some((owner, name)) if part(owner) && part(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(arg: &str) -> String {
        format!("{:#}", classify(Path::new(arg)).unwrap_err())
    }

    #[test]
    fn missing_paths_are_never_hub_ids() {
        for arg in [
            "/nonexistent",
            "./nonexistent-dir",
            "../nope/model",
            "~/nope",
            "nope.gguf",
            "owner/model.gguf",
            "src/missing", // `src` is a folder of this crate, where tests run
        ] {
            assert_eq!(err(arg), format!("no such file or directory: {arg}"));
        }
        assert_eq!(
            err("smollm2"),
            "no such file or directory: smollm2 (nor a Hugging Face hub id, which is owner/name)"
        );
        assert!(err("a/b/c").starts_with("no such file or directory: a/b/c"));
    }

    #[test]
    fn hub_ids_and_existing_paths() {
        let id = |s: &str| Some(ModelArg::HubId(s.into()));
        assert_eq!(
            classify(Path::new("Qwen/Qwen3-0.6B")).ok(),
            id("Qwen/Qwen3-0.6B")
        );
        assert_eq!(
            classify(Path::new("HuggingFaceTB/SmolLM2-135M-Instruct")).ok(),
            id("HuggingFaceTB/SmolLM2-135M-Instruct")
        );
        assert_eq!(
            classify(Path::new("src")).ok(),
            Some(ModelArg::Path("src".into()))
        );
        if let Some(home) = std::env::var_os("HOME").filter(|h| Path::new(h).is_dir()) {
            assert_eq!(
                classify(Path::new("~")).ok(),
                Some(ModelArg::Path(home.into()))
            );
        }
    }
}
