//! Tensors of a Hugging Face model directory: `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`. Files are memory-mapped and each tensor is converted to f32 once,
//! at load.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

/// One memory-mapped safetensors file.
struct Shard {
    path: PathBuf,
    mmap: Mmap,
}

/// The tensors of a model directory, looked up by name across shards.
pub struct SafetensorsDir {
    shards: Vec<Shard>,
    /// Tensor name → index into `shards`.
    index: HashMap<String, usize>,
}

impl SafetensorsDir {
    /// Opens `model.safetensors` or the shards named by `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("cannot read {}", index_path.display()))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", index_path.display()))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .with_context(|| format!("{} has no weight_map object", index_path.display()))?;
            let names: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            bail!(
                "no weights in {}: expected model.safetensors or model.safetensors.index.json",
                dir.display()
            );
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for path in files {
            let file = File::open(&path).with_context(|| {
                format!(
                    "cannot open weight shard {} (named by the index)",
                    path.display()
                )
            })?;
            // SAFETY: the file is opened read-only; the model files are not expected to change
            // while loading, and every tensor is copied out before the map is dropped.
            let mmap = unsafe { Mmap::map(&file) }
                .with_context(|| format!("cannot map {}", path.display()))?;
            let names: Vec<String> = SafeTensors::deserialize(&mmap)
                .map_err(|e| {
                    anyhow::anyhow!("{} is not a valid safetensors file: {e}", path.display())
                })?
                .names()
                .into_iter()
                .map(str::to_string)
                .collect();
            for name in names {
                index.insert(name, shards.len());
            }
            shards.push(Shard { path, mmap });
        }
        Ok(Self { shards, index })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Loads tensor `name`, checks it has `shape`, and converts it to f32.
    /// Drops every shard's pages from this process's memory (private read-only maps: a later
    /// read faults them in again from the files). `leanstream-prep` calls it after each tensor it
    /// reads, so its resident size holds no more than one tensor of the source.
    pub fn release_pages(&self) {
        for shard in &self.shards {
            // SAFETY: the map is read-only and file-backed; DONTNEED only discards clean pages,
            // which later reads fault in again with the same contents.
            let _ = unsafe {
                shard
                    .mmap
                    .unchecked_advise(memmap2::UncheckedAdvice::DontNeed)
            };
        }
    }

    pub fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let &shard_idx = self.index.get(name).with_context(|| {
            let files: Vec<String> = self
                .shards
                .iter()
                .map(|s| s.path.display().to_string())
                .collect();
            format!("missing tensor {name} in {}", files.join(", "))
        })?;
        let shard = &self.shards[shard_idx];
        let st = SafeTensors::deserialize(&shard.mmap)
            .map_err(|e| anyhow::anyhow!("{}: {e}", shard.path.display()))?;
        let view = st
            .tensor(name)
            .map_err(|e| anyhow::anyhow!("{}: tensor {name}: {e}", shard.path.display()))?;
        if view.shape() != shape {
            bail!(
                "{}: tensor {name} has shape {:?} but config.json implies {:?}",
                shard.path.display(),
                view.shape(),
                shape
            );
        }
        let bytes = view.data();
        let out = match view.dtype() {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => bail!(
                "{}: tensor {name} has dtype {other:?}; supported are F32, F16 and BF16",
                shard.path.display()
            ),
        };
        Ok(out)
    }
}
