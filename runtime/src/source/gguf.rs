//! Models in llama.cpp's GGUF files (v2/v3): metadata → [`ModelConfig`], GGUF tensor names →
//! Hugging Face names, and the tensors in Hugging Face's row order, so that the engine builds the
//! model through the same [`Model::from_hf_tensors`] as for a safetensors directory. A mixture of
//! experts (`qwen3moe`, or `llama` with `ffn_*_exps` tensors as llama.cpp writes Mixtral) stacks
//! each layer's experts in one 3-D tensor; expert `e` of Hugging Face's names is its slice `e`.
//!
//! Weight matrices stored as F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K stay in
//! that encoding (rows put in Hugging Face order by [`GgufFile::raw_tensor`]): the kernels compute
//! on it directly, and an embedding's rows are decoded on lookup. Other types are dequantized to
//! f32 at load.

use std::borrow::Cow;
use std::fs::File;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;
use leanstream_format::quant::QuantType;
use memmap2::Mmap;

use crate::kernels::{Matrix, QMatrix, Weight};
use crate::model::Model;
use crate::source::config::{Activation, Architecture, ModelConfig, MoeConfig};

mod block;
mod names;

use names::gguf_location;
pub use names::gguf_name;

/// A GGUF file, memory-mapped, with its parsed header.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    content: Content,
}

/// A tensor as stored in the file: its GGML type, shape (`[rows, cols]` or `[len]`) and blocks.
pub struct RawTensor<'a> {
    pub dtype: GgmlDType,
    pub shape: Vec<usize>,
    pub data: Cow<'a, [u8]>,
}

impl GgufFile {
    /// Maps `path` and parses its header (metadata and tensor directory).
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: read-only mapping of a model file that is not expected to change while loaded;
        // every tensor is copied out of it at load.
        let mmap = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot map {}", path.display()))?;
        if !mmap.starts_with(b"GGUF") {
            bail!(
                "{} is not a GGUF file (it does not start with the GGUF magic): --model takes a \
                 .gguf file or a Hugging Face model directory",
                path.display()
            );
        }
        if has_zero_alignment(&mmap) {
            bail!(
                "{} is not a readable GGUF file: its general.alignment is 0",
                path.display()
            );
        }
        let content = Content::read(&mut Cursor::new(&mmap[..]))
            .map_err(|e| anyhow::anyhow!("{} is not a readable GGUF file: {e}", path.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            content,
        })
    }

    /// The engine's architecture for `general.architecture`.
    fn architecture(&self) -> Result<Architecture> {
        match self.required_str("general.architecture")? {
            // llama.cpp's converter also writes Mistral checkpoints as `llama`.
            "llama" => Ok(Architecture::Llama),
            "qwen3" | "qwen3moe" => Ok(Architecture::Qwen3),
            "qwen2" => Ok(Architecture::Qwen2),
            "smollm3" => Ok(Architecture::Llama),
            // PowerInfer's name for Bamboo / TurboSparse-Mistral: Mistral's block with dReLU (in
            // llama.cpp's layout, as `llama`; no sliding window key).
            "bamboo" => Ok(Architecture::Mistral),
            "gemma2" => Ok(Architecture::Gemma2),
            "gemma3" => Ok(Architecture::Gemma3),
            "phi3" => Ok(Architecture::Phi3),
            other => bail!(
                "{}: architecture {other:?} is not supported (GGUF files of architecture llama \
                 (Llama 2 and 3.x, SmolLM2, Mixtral), smollm3, qwen2 (Qwen2, Qwen2.5), qwen3, \
                 qwen3moe, gemma2, gemma3, phi3 (Phi-3, Phi-3.5) and bamboo (dReLU) are)",
                self.path.display()
            ),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model: configuration from the metadata, weight matrices as [`weight`](Self::weight)
    /// keeps them, norms as f32. Each tensor's file pages are dropped once it is copied, so the
    /// load peaks at the model plus one tensor, not the model plus the mapped file.
    pub fn load_model(&self) -> Result<Model> {
        Model::from_hf_weights(
            self.config()?,
            |name, shape| {
                let t = self.tensor_f32(name, shape);
                self.release_pages();
                t
            },
            |name, rows, cols| {
                let w = self.weight(name, rows, cols);
                self.release_pages();
                w
            },
        )
    }

    /// Hugging Face weight matrix `name` (`rows × cols`): as stored when the kernels read its
    /// encoding, else dequantized to f32.
    pub fn weight(&self, name: &str, rows: usize, cols: usize) -> Result<Weight> {
        let raw = self.raw_tensor(name, &[rows, cols])?;
        let qtype = match quant_type(raw.dtype) {
            Some(q) if q != QuantType::F32 => q,
            _ => {
                let values = self.tensor_f32(name, &[rows, cols])?;
                return Ok(Weight::F32(Matrix::new(rows, cols, values)));
            }
        };
        let q = QMatrix::new(rows, cols, qtype, raw.data.into_owned())
            .with_context(|| format!("{}: tensor {name}", self.path.display()))?;
        Ok(Weight::Encoded(q.in_groups()))
    }

    /// The model configuration from the `{architecture}.*` and `tokenizer.ggml.*` metadata.
    pub fn config(&self) -> Result<ModelConfig> {
        let architecture = self.architecture()?;
        let arch = self.required_str("general.architecture")?;
        let key = |k: &str| format!("{arch}.{k}");
        let num_heads = self.required_usize(&key("attention.head_count"))?;
        let hidden_size = self.required_usize(&key("embedding_length"))?;
        let head_dim = match self.usize(&key("attention.key_length"))? {
            Some(d) => d,
            None => hidden_size.checked_div(num_heads).unwrap_or(0),
        };
        for (k, what) in [
            ("attention.value_length", "value head size"),
            (
                "rope.dimension_count",
                "rotary dimension (partial rotary is not supported)",
            ),
        ] {
            if let Some(d) = self.usize(&key(k))? {
                if d != head_dim {
                    bail!(
                        "{}: {arch}.{k} = {d}: the {what} must equal the head size {head_dim}",
                        self.path.display()
                    );
                }
            }
        }
        let mut linear = None;
        if let Some(kind) = self.str(&key("rope.scaling.type"))? {
            match kind {
                "none" => {}
                // Gemma 3's global layers: every frequency divided by the factor.
                "linear" => linear = self.f32(&key("rope.scaling.factor"))?,
                _ => bail!(
                    "{}: rope scaling {kind:?} is not supported (none and linear are)",
                    self.path.display()
                ),
            }
        }
        // Llama 3.1 and later: llama.cpp's converter writes the llama3 rope scaling as one divisor
        // per frequency.
        let rope_freq_factors = match self.content.tensor_infos.contains_key("rope_freqs.weight") {
            true => Some(self.tensor_f32("rope_freqs.weight", &[head_dim / 2])?),
            false => linear.map(|f| vec![f; head_dim / 2]),
        };
        let num_layers = self.required_usize(&key("block_count"))?;
        if self
            .content
            .tensor_infos
            .contains_key("blk.0.ffn_down_t.weight")
        {
            bail!(
                "{}: blk.0.ffn_down_t.weight is PowerInfer's transposed FFN down projection, which \
                 is not supported: convert the model's Hugging Face folder instead",
                self.path.display()
            );
        }
        let embd = self.info("token_embd.weight")?;
        let vocab_size = embd.shape.dims().first().copied().unwrap_or(0);
        let (sliding_window, block) =
            self.block_options(arch, architecture, hidden_size, num_heads)?;
        let config = ModelConfig {
            architecture,
            // llama.cpp's graphs gate the FFN with SiLU, Gemma's with tanh GELU, PowerInfer's
            // bamboo graph with ReLU on gate and up; GGUF has no key for it.
            activation: match (arch, architecture.is_gemma()) {
                ("bamboo", _) => Activation::DRelu,
                (_, true) => Activation::GeluTanh,
                (_, false) => Activation::Silu,
            },
            hidden_size,
            intermediate_size: match self.usize(&key("feed_forward_length"))? {
                Some(n) => n,
                None => self
                    .usize(&key("expert_feed_forward_length"))?
                    .with_context(|| self.missing(&key("feed_forward_length")))?,
            },
            num_layers,
            num_heads,
            num_kv_heads: self
                .usize(&key("attention.head_count_kv"))?
                .unwrap_or(num_heads),
            head_dim,
            vocab_size,
            max_position_embeddings: self.usize(&key("context_length"))?.unwrap_or(2048),
            rms_norm_eps: self
                .f32(&key("attention.layer_norm_rms_epsilon"))?
                .with_context(|| self.missing(&key("attention.layer_norm_rms_epsilon")))?,
            rope_theta: self.f32(&key("rope.freq_base"))?.unwrap_or(10000.0),
            rope_scaling: None,
            rope_freq_factors,
            // llama.cpp's smollm3 graph leaves every fourth layer without rope; GGUF has no key.
            no_rope_layers: match arch {
                "smollm3" => (3..num_layers).step_by(4).collect(),
                _ => Vec::new(),
            },
            sliding_window,
            tie_word_embeddings: !self.content.tensor_infos.contains_key("output.weight"),
            qk_norm: matches!(architecture, Architecture::Qwen3 | Architecture::Gemma3),
            qkv_bias: architecture == Architecture::Qwen2,
            bos_token_id: self.u32("tokenizer.ggml.bos_token_id")?,
            eos_token_ids: self
                .u32("tokenizer.ggml.eos_token_id")?
                .into_iter()
                .collect(),
            moe: self.moe_config(arch)?,
            block,
        };
        config
            .validate()
            .with_context(|| format!("{}: invalid model metadata", self.path.display()))?;
        Ok(config)
    }

    /// The mixture of experts, if the file has one. llama.cpp renormalises the chosen experts'
    /// weights for both `qwen3moe` and `llama` (Mixtral), so `norm_topk_prob` is set; layers
    /// without a router (`ffn_gate_inp`) are dense.
    fn moe_config(&self, arch: &str) -> Result<Option<MoeConfig>> {
        let key = |k: &str| format!("{arch}.{k}");
        let num_experts = self.usize(&key("expert_count"))?.unwrap_or(0);
        if num_experts == 0 {
            if arch == "qwen3moe" {
                bail!("{}", self.missing(&key("expert_count")));
            }
            return Ok(None);
        }
        let layers = self.required_usize(&key("block_count"))?;
        let expert_intermediate_size = match self.usize(&key("expert_feed_forward_length"))? {
            Some(n) => n,
            None => self.required_usize(&key("feed_forward_length"))?,
        };
        let has_router = |l: usize| {
            let name = format!("blk.{l}.ffn_gate_inp.weight");
            self.content.tensor_infos.contains_key(&name)
        };
        Ok(Some(MoeConfig {
            num_experts,
            experts_per_token: self.required_usize(&key("expert_used_count"))?,
            expert_intermediate_size,
            norm_topk_prob: true,
            dense_layers: (0..layers).filter(|&l| !has_router(l)).collect(),
        }))
    }

    /// Hugging Face tensor `name` as f32, after checking it has `shape`.
    /// Drops the file's pages from this process's memory (a private read-only map: a later read
    /// faults them in again from the file). `leanstream-prep` calls it after each tensor it
    /// reads, so its resident size holds no more than one tensor of the source.
    pub fn release_pages(&self) {
        // SAFETY: the map is read-only and file-backed; DONTNEED only discards clean pages, which
        // later reads fault in again with the same contents.
        let _ = unsafe {
            self.mmap
                .unchecked_advise(memmap2::UncheckedAdvice::DontNeed)
        };
    }

    pub fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let raw = self.raw_tensor(name, shape)?;
        let gguf_name = gguf_name(name).unwrap_or_default();
        let dequantized = QStorage::from_data(raw.data, &Device::Cpu, raw.dtype)
            .and_then(|storage| QTensor::new(storage, raw.shape))
            .and_then(|q| q.dequantize(&Device::Cpu))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>());
        dequantized.map_err(|e| {
            anyhow::anyhow!(
                "{}: cannot dequantize tensor {gguf_name} ({:?}): {e}",
                self.path.display(),
                raw.dtype
            )
        })
    }

    /// Hugging Face tensor `name` in its stored encoding, after checking it has `shape`. Query and
    /// key rows of `llama` files are put back into Hugging Face's order (see [`unpermute_rope_rows`]).
    pub fn raw_tensor(&self, name: &str, shape: &[usize]) -> Result<RawTensor<'_>> {
        // Gemma's sandwich norms and Phi-3's fused projections (rows `fused.0..` of `fused.1`).
        let (located, fused) = match self.block_location(name, shape)? {
            Some((gguf_name, fused)) => (Some((gguf_name, None)), fused),
            None => (gguf_location(name), None),
        };
        let (gguf_name, expert) = located.with_context(|| {
            format!(
                "{}: no GGUF tensor corresponds to {name}",
                self.path.display()
            )
        })?;
        // Older llama.cpp files (Mixtral converted before the stacks) hold each expert's matrix as
        // its own tensor, `blk.{l}.ffn_gate.{e}.weight` for the stack `blk.{l}.ffn_gate_exps`.
        let (gguf_name, expert) = match expert {
            Some(e) if !self.content.tensor_infos.contains_key(&gguf_name) => {
                let own = gguf_name.replace("_exps.weight", &format!(".{e}.weight"));
                if self.content.tensor_infos.contains_key(&own) {
                    (own, None)
                } else {
                    (gguf_name, expert)
                }
            }
            _ => (gguf_name, expert),
        };
        let info = self.info(&gguf_name)?;
        // An expert's matrix is one slice of its layer's stack of `expert_count` matrices.
        let (stacked, first) = match expert {
            None if fused.is_some() => {
                let (_, rows) = fused.expect("checked");
                ([&[rows][..], &shape[1..]].concat(), 0)
            }
            Some(e) => {
                let arch = self.required_str("general.architecture")?;
                let experts = self.usize(&format!("{arch}.expert_count"))?.unwrap_or(0);
                if e >= experts {
                    bail!(
                        "{}: {name} is expert {e}, but {arch}.expert_count is {experts}",
                        self.path.display()
                    );
                }
                ([&[experts][..], shape].concat(), e)
            }
            None => (shape.to_vec(), 0),
        };
        if info.shape.dims() != stacked {
            bail!(
                "{}: tensor {gguf_name} has shape {:?} but the metadata implies {stacked:?}",
                self.path.display(),
                info.shape.dims()
            );
        }
        let dtype = info.ggml_dtype;
        let cols = shape.last().copied().unwrap_or(1);
        if !cols.is_multiple_of(dtype.block_size()) {
            bail!(
                "{}: tensor {gguf_name}: rows of {cols} values do not fill whole {dtype:?} blocks",
                self.path.display()
            );
        }
        let row_bytes = cols / dtype.block_size() * dtype.type_size();
        let len = shape.iter().product::<usize>() / cols * row_bytes;
        let start = (self.content.tensor_data_offset)
            .checked_add(info.offset)
            .and_then(|s| usize::try_from(s).ok())
            .and_then(|s| s.checked_add(first.checked_mul(len)?))
            .and_then(|s| s.checked_add(fused.map_or(0, |(at, _)| at) * row_bytes));
        let data = start
            .and_then(|s| self.mmap.get(s..s.checked_add(len)?))
            .with_context(|| {
                format!(
                    "{}: tensor {gguf_name} lies past the end of the file (truncated download?)",
                    self.path.display()
                )
            })?;
        // GGUF aligns tensor data (to 32 bytes by default); the block decoders need 4.
        if !(data.as_ptr() as usize).is_multiple_of(4) {
            bail!(
                "{}: tensor {gguf_name} is not aligned in the file as GGUF requires",
                self.path.display()
            );
        }
        let data = match (self.architecture()?, name.rsplit('.').nth(1)) {
            (Architecture::Llama | Architecture::Mistral, Some(proj @ ("q_proj" | "k_proj"))) => {
                let (q_heads, kv_heads) = self.head_counts()?;
                let heads = if proj == "q_proj" { q_heads } else { kv_heads };
                Cow::Owned(unpermute_rope_rows(data, heads, row_bytes))
            }
            _ => Cow::Borrowed(data),
        };
        Ok(RawTensor {
            dtype,
            shape: shape.to_vec(),
            data,
        })
    }

    /// Query and key/value head counts, which the row order of `attn_q` and `attn_k` depends on.
    fn head_counts(&self) -> Result<(usize, usize)> {
        let arch = self.required_str("general.architecture")?;
        let q = self.required_usize(&format!("{arch}.attention.head_count"))?;
        let kv = self
            .usize(&format!("{arch}.attention.head_count_kv"))?
            .unwrap_or(q);
        Ok((q, kv))
    }

    /// The GGML type of the first stored FFN gate (`blk.L.ffn_gate.weight`, or a mixture's
    /// `blk.L.ffn_gate_exps.weight` / `blk.L.ffn_gate.E.weight`) at the lowest layer `L`, if any:
    /// the width the file's author chose for the FFN, which `leanstream-prep convert --quant auto`
    /// keeps.
    pub fn ffn_gate_type(&self) -> Option<GgmlDType> {
        // The layer of an FFN tensor whose name starts with `prefix`.
        let layer_of = |name: &str, prefix: &str| -> Option<usize> {
            let (layer, tensor) = name.strip_prefix("blk.")?.split_once('.')?;
            tensor.starts_with(prefix).then(|| layer.parse().ok())?
        };
        let first = |prefix: &str, not: &str| {
            self.content
                .tensor_infos
                .iter()
                .filter(|(name, _)| !name.contains(not))
                .filter_map(|(name, info)| Some((layer_of(name, prefix)?, name, info.ggml_dtype)))
                .min_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)))
                .map(|(_, _, dtype)| dtype)
        };
        // Not a router (`ffn_gate_inp`); Phi-3's gate rows lie in `ffn_up` with the up rows.
        first("ffn_gate", "ffn_gate_inp").or_else(|| first("ffn_up", "ffn_up_shexp"))
    }

    fn info(&self, gguf_name: &str) -> Result<&candle_core::quantized::gguf_file::TensorInfo> {
        self.content
            .tensor_infos
            .get(gguf_name)
            .with_context(|| format!("{}: missing tensor {gguf_name}", self.path.display()))
    }

    fn value(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn missing(&self, key: &str) -> String {
        format!("{}: missing metadata {key}", self.path.display())
    }

    fn wrong_type(&self, key: &str, v: &Value, expected: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "{}: metadata {key} is {:?}, expected {expected}",
            self.path.display(),
            v.value_type()
        )
    }

    /// An unsigned integer of any GGUF integer type.
    pub fn usize(&self, key: &str) -> Result<Option<usize>> {
        let Some(v) = self.value(key) else {
            return Ok(None);
        };
        let n = match *v {
            Value::U8(n) => Some(n as u64),
            Value::U16(n) => Some(n as u64),
            Value::U32(n) => Some(n as u64),
            Value::U64(n) => Some(n),
            Value::I8(n) => u64::try_from(n).ok(),
            Value::I16(n) => u64::try_from(n).ok(),
            Value::I32(n) => u64::try_from(n).ok(),
            Value::I64(n) => u64::try_from(n).ok(),
            _ => None,
        };
        n.and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| self.wrong_type(key, v, "a non-negative integer"))
    }

    pub fn u32(&self, key: &str) -> Result<Option<u32>> {
        match self.usize(key)? {
            None => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| anyhow::anyhow!("{}: {key} = {n} is too large", self.path.display())),
        }
    }

    fn required_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?.with_context(|| self.missing(key))
    }

    pub fn f32(&self, key: &str) -> Result<Option<f32>> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x)),
            Some(Value::F64(x)) => Ok(Some(*x as f32)),
            Some(v) => Err(self.wrong_type(key, v, "a float")),
        }
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong_type(key, v, "a bool")),
        }
    }

    pub fn str(&self, key: &str) -> Result<Option<&str>> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong_type(key, v, "a string")),
        }
    }

    fn required_str(&self, key: &str) -> Result<&str> {
        self.str(key)?.with_context(|| self.missing(key))
    }

    /// An array value; `None` when the key is absent.
    pub fn array(&self, key: &str) -> Result<Option<&[Value]>> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(self.wrong_type(key, v, "an array")),
        }
    }
}

/// Whether the metadata sets `general.alignment` to 0, which candle's reader divides by unchecked
/// (a panic). The key-value pairs are walked as the header stores them (lengths and counts of 8
/// bytes in GGUF v2/v3, 4 in v1), so only the metadata is read, never the tensor data: scanning the
/// whole map read every page of a model file. A header this walk cannot follow is left to candle's
/// reader, which refuses it.
fn has_zero_alignment(bytes: &[u8]) -> bool {
    zero_alignment(bytes).unwrap_or(false)
}

fn zero_alignment(bytes: &[u8]) -> Option<bool> {
    let version = u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?);
    let wide = version >= 2;
    let mut r = Header { bytes, at: 8, wide };
    let (_tensors, pairs) = (r.len()?, r.len()?);
    for _ in 0..pairs {
        let key = r.take_string()?;
        let kind = r.u32()?;
        if key == b"general.alignment" {
            // GGUF value types 0-5: u8, i8, u16, i16, u32, i32; 10, 11: u64, i64.
            let width = match kind {
                0 | 1 => 1,
                2 | 3 => 2,
                4 | 5 => 4,
                10 | 11 => 8,
                _ => return Some(false),
            };
            return Some(r.take(width)?.iter().all(|&b| b == 0));
        }
        r.skip_value(kind, 0)?;
    }
    Some(false)
}

/// A cursor over a GGUF header.
struct Header<'a> {
    bytes: &'a [u8],
    at: usize,
    /// Lengths and counts are u64 (v2 and later), else u32.
    wide: bool,
}

impl<'a> Header<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let b = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(b)
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn len(&mut self) -> Option<usize> {
        match self.wide {
            true => usize::try_from(u64::from_le_bytes(self.take(8)?.try_into().ok()?)).ok(),
            false => Some(self.u32()? as usize),
        }
    }

    fn take_string(&mut self) -> Option<&'a [u8]> {
        let n = self.len()?;
        self.take(n)
    }

    /// Skips a value of GGUF type `kind` (arrays nest at most a few levels).
    fn skip_value(&mut self, kind: u32, depth: usize) -> Option<()> {
        match kind {
            8 => self.take_string().map(drop),
            9 if depth < 4 => {
                let (inner, count) = (self.u32()?, self.len()?);
                match inner {
                    8 | 9 => (0..count).try_for_each(|_| self.skip_value(inner, depth + 1)),
                    _ => self.take(count.checked_mul(fixed_width(inner)?)?).map(drop),
                }
            }
            _ => self.take(fixed_width(kind)?).map(drop),
        }
    }
}

/// Bytes of a value of GGUF type `kind` where every value of it has the same size (not strings,
/// arrays or unknown types).
fn fixed_width(kind: u32) -> Option<usize> {
    Some(match kind {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        _ => return None,
    })
}

/// The file format's encoding of GGML type `dtype`, where the format has it (the kernels then
/// read its blocks as stored).
pub fn quant_type(dtype: GgmlDType) -> Option<QuantType> {
    Some(match dtype {
        GgmlDType::F32 => QuantType::F32,
        GgmlDType::F16 => QuantType::F16,
        GgmlDType::BF16 => QuantType::BF16,
        GgmlDType::Q8_0 => QuantType::Q8_0,
        GgmlDType::Q4_0 => QuantType::Q4_0,
        GgmlDType::Q4_1 => QuantType::Q4_1,
        GgmlDType::Q5_0 => QuantType::Q5_0,
        GgmlDType::Q5_1 => QuantType::Q5_1,
        GgmlDType::Q4K => QuantType::Q4_K,
        GgmlDType::Q5K => QuantType::Q5_K,
        GgmlDType::Q6K => QuantType::Q6_K,
        _ => return None,
    })
}

/// llama.cpp's converter reorders each head's query/key rows from Hugging Face's rope layout
/// (rotate-half: first half of the head, then second half) to interleaved pairs (row `2i + j` holds
/// Hugging Face row `j * head_dim/2 + i`). This puts `data` (rows of `row_bytes`, in any block
/// encoding, since blocks never span rows) back into Hugging Face order.
pub fn unpermute_rope_rows(data: &[u8], heads: usize, row_bytes: usize) -> Vec<u8> {
    move_rope_rows(data, heads, row_bytes, |gguf, hf| (gguf, hf))
}

/// The converter's reordering itself (Hugging Face order in, llama.cpp's out): what a GGUF writer
/// applies to `llama` query/key rows; [`unpermute_rope_rows`] undoes it.
pub fn permute_rope_rows(data: &[u8], heads: usize, row_bytes: usize) -> Vec<u8> {
    move_rope_rows(data, heads, row_bytes, |gguf, hf| (hf, gguf))
}

/// Copies each row of `data` to its place: `src_dst(gguf_row, hf_row)` gives (source, destination).
fn move_rope_rows(
    data: &[u8],
    heads: usize,
    row_bytes: usize,
    src_dst: impl Fn(usize, usize) -> (usize, usize),
) -> Vec<u8> {
    let head_dim = data.len() / row_bytes / heads;
    let half = head_dim / 2;
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let (src, dst) = src_dst(h * head_dim + 2 * i + j, h * head_dim + j * half + i);
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The format's decoder of the 5-bit types and K-quants gives candle's (ggml's) bits for
    /// random blocks (random codes and scales, finite f16 scales of both signs), so a GGUF tensor
    /// kept encoded decodes exactly as the f32 expansion at load did.
    #[test]
    fn k_quants_decode_as_candle_does() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for (qtype, dtype, scales) in [
            (QuantType::Q5_0, GgmlDType::Q5_0, &[0][..]),
            (QuantType::Q5_1, GgmlDType::Q5_1, &[0, 2][..]),
            (QuantType::Q4_K, GgmlDType::Q4K, &[0, 2][..]),
            (QuantType::Q5_K, GgmlDType::Q5K, &[0, 2][..]),
            (QuantType::Q6_K, GgmlDType::Q6K, &[208][..]),
        ] {
            let blocks = 12;
            let n = blocks * qtype.block_len();
            let mut bytes: Vec<u8> = (0..blocks * qtype.block_bytes())
                .map(|_| rng.random())
                .collect();
            for block in bytes.chunks_exact_mut(qtype.block_bytes()) {
                for &at in scales {
                    let v = half::f16::from_f32(rng.random_range(-2.0f32..2.0));
                    block[at..at + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
            let want = QStorage::from_data(Cow::Borrowed(&bytes[..]), &Device::Cpu, dtype)
                .and_then(|s| QTensor::new(s, vec![n]))
                .and_then(|q| q.dequantize(&Device::Cpu))
                .and_then(|t| t.to_vec1::<f32>())
                .unwrap();
            let mut got = vec![0.0f32; n];
            leanstream_format::quant::dequantize_row(qtype, &bytes, &mut got).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "seed {seed}: {qtype}");
            // The kernels' decoding (axpy into zeros) is the same.
            let mut fast = vec![f32::NAN; n];
            for k in crate::kernels::RowKernels::available() {
                k.dequantize(qtype, &bytes, &mut fast);
                assert_eq!(fast, want, "seed {seed}: {} {qtype}", k.isa);
            }
        }
    }

    #[test]
    fn a_zero_alignment_is_found() {
        // A v3 header (or v1: counts and lengths of 4 bytes): a string pair, an array of strings
        // and one of u32, then `general.alignment` of type `kind`.
        let file = |wide: bool, kind: u32, value: &[u8]| {
            let len = |b: &mut Vec<u8>, n: usize| match wide {
                true => b.extend((n as u64).to_le_bytes()),
                false => b.extend((n as u32).to_le_bytes()),
            };
            let string = |b: &mut Vec<u8>, s: &[u8]| {
                len(b, s.len());
                b.extend(s);
            };
            let mut b = b"GGUF".to_vec();
            b.extend(if wide { 3u32 } else { 1u32 }.to_le_bytes());
            len(&mut b, 0);
            len(&mut b, 4);
            string(&mut b, b"general.name");
            b.extend(8u32.to_le_bytes());
            string(&mut b, b"general.alignment");
            string(&mut b, b"tokenizer.ggml.tokens");
            b.extend(9u32.to_le_bytes());
            b.extend(8u32.to_le_bytes());
            len(&mut b, 2);
            string(&mut b, b"a");
            string(&mut b, b"general.alignment");
            string(&mut b, b"tokenizer.ggml.token_type");
            b.extend(9u32.to_le_bytes());
            b.extend(5u32.to_le_bytes());
            len(&mut b, 3);
            b.extend([0u8; 12]);
            string(&mut b, b"general.alignment");
            b.extend(kind.to_le_bytes());
            b.extend(value);
            // Tensor data after the header is never read.
            b.extend(b"general.alignment");
            b
        };
        for wide in [true, false] {
            assert!(has_zero_alignment(&file(wide, 4, &[0; 4])));
            assert!(has_zero_alignment(&file(wide, 0, &[0])));
            assert!(has_zero_alignment(&file(wide, 10, &[0; 8])));
            assert!(!has_zero_alignment(&file(wide, 4, &32u32.to_le_bytes())));
        }
        // Cut short: left to candle's reader.
        let cut = file(true, 4, &[0; 4]);
        assert!(!has_zero_alignment(&cut[..cut.len() - 24]));
        let fixture = include_bytes!("../../tests/fixtures/quant-types.gguf");
        assert!(!has_zero_alignment(fixture));
    }

    #[test]
    fn unpermute_inverts_the_converters_permutation() {
        // Two heads of head_dim 4, one byte per row: Hugging Face rows 0..8. The converter views
        // rows as (head, half, i) and swaps the last two axes.
        let heads = 2;
        let hf: Vec<u8> = (0..8).collect();
        let gguf = permute_rope_rows(&hf, heads, 1);
        assert_eq!(gguf, [0, 2, 1, 3, 4, 6, 5, 7]);
        assert_eq!(unpermute_rope_rows(&gguf, heads, 1), hf);
        // Rows of several bytes move whole.
        let wide: Vec<u8> = (0..16).collect();
        let moved = permute_rope_rows(&wide, 1, 4);
        assert_eq!(
            moved,
            [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
        );
        assert_eq!(unpermute_rope_rows(&moved, 1, 4), wide);
    }
}
