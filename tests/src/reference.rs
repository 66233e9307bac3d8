//! Plain f64 reference forward pass, written from the papers' equations.
//!
//! It shares no code with the engine on purpose: it parses config.json and the safetensors
//! files itself and recomputes the whole causal sequence from scratch (no KV cache), so a bug
//! in the engine's loader, kernels or cache cannot be mirrored here.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

/// Deliberate mistakes, used to prove that a comparison at 1e-4 would catch them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Breakage {
    None,
    /// Skip the rotary embedding on q and k.
    NoRope,
    /// Treat every RMSNorm weight (layer, final, q/k) as ones.
    NormsAllOnes,
    /// Skip Qwen3's per-head q/k RMSNorm.
    NoQkNorm,
    /// Use up_proj as the gate and gate_proj as the up projection.
    SwapGateUp,
    /// Map query head h to kv head `h % kv_heads` instead of `h / (heads / kv_heads)`.
    WrongGqaMapping,
    /// GPT-J style rope pairing (2i, 2i+1) instead of HF's rotate-half (i, i + d/2).
    InterleavedRope,
    /// Ignore Llama-3 `rope_scaling` (plain inv_freq).
    NoRopeScaling,
    /// Ignore `sliding_window` (full causal attention).
    NoSlidingWindow,
}

/// Llama-3 inv_freq rescaling parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

/// The subset of config.json the forward pass needs.
#[derive(Clone, Debug)]
pub struct RefConfig {
    pub architecture: String,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3Scaling>,
    pub relu: bool,
    pub tied: bool,
    pub qk_norm: bool,
    pub sliding_window: Option<usize>,
    pub moe: Option<RefMoe>,
}

/// A sparse mixture of experts, as Hugging Face's Qwen3-MoE and Mixtral blocks compute it:
/// softmax over the router logits, the `top_k` most probable experts, their outputs weighted by
/// those probabilities (divided by their sum when `norm_topk_prob`; Mixtral always does).
#[derive(Clone, Debug)]
pub struct RefMoe {
    pub experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    pub norm_topk_prob: bool,
    /// Whether each layer is sparse (the others have a dense `mlp`).
    pub sparse: Vec<bool>,
    /// `mlp` (Qwen3-MoE) or `block_sparse_moe` (Mixtral).
    pub block: &'static str,
    /// The expert's gate, up and down projection names.
    pub projections: [&'static str; 3],
}

impl RefMoe {
    fn parse(cfg: &Value, architecture: &str, layers: usize) -> Result<Option<Self>> {
        let top_k = || req_usize(cfg, "num_experts_per_tok");
        Ok(match architecture {
            "MixtralForCausalLM" => Some(RefMoe {
                experts: req_usize(cfg, "num_local_experts")?,
                top_k: top_k()?,
                intermediate: req_usize(cfg, "intermediate_size")?,
                norm_topk_prob: true,
                sparse: vec![true; layers],
                block: "block_sparse_moe",
                projections: ["w1", "w3", "w2"],
            }),
            "Qwen3MoeForCausalLM" => {
                let step = get(cfg, "decoder_sparse_step")
                    .and_then(Value::as_u64)
                    .unwrap_or(1) as usize;
                let mlp_only: Vec<u64> = get(cfg, "mlp_only_layers")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default();
                Some(RefMoe {
                    experts: req_usize(cfg, "num_experts")?,
                    top_k: top_k()?,
                    intermediate: req_usize(cfg, "moe_intermediate_size")?,
                    norm_topk_prob: get(cfg, "norm_topk_prob")
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                    sparse: (0..layers)
                        .map(|l| !mlp_only.contains(&(l as u64)) && (l + 1).is_multiple_of(step))
                        .collect(),
                    block: "mlp",
                    projections: ["gate_proj", "up_proj", "down_proj"],
                })
            }
            _ => None,
        })
    }
}

/// How many tokens chose each expert, per layer (empty for a dense layer).
pub type ExpertCounts = Vec<Vec<usize>>;

fn get<'a>(cfg: &'a Value, key: &str) -> Option<&'a Value> {
    cfg.get(key).filter(|v| !v.is_null())
}

fn req_usize(cfg: &Value, key: &str) -> Result<usize> {
    get(cfg, key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| anyhow!("config.json: missing or non-integer `{key}`"))
}

fn req_f64(v: &Value, key: &str) -> Result<f64> {
    get(v, key)
        .and_then(Value::as_f64)
        .ok_or_else(|| anyhow!("config.json: missing or non-numeric `{key}`"))
}

fn rope_type(v: &Value) -> Option<&str> {
    get(v, "rope_type")
        .or_else(|| get(v, "type"))
        .and_then(Value::as_str)
}

impl RefConfig {
    pub fn parse(cfg: &Value) -> Result<Self> {
        let architecture = cfg
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .ok_or_else(|| anyhow!("config.json: no architectures"))?
            .to_string();
        let qk_norm = match architecture.as_str() {
            "LlamaForCausalLM" | "MistralForCausalLM" | "MixtralForCausalLM" => false,
            "Qwen3ForCausalLM" | "Qwen3MoeForCausalLM" => true,
            other => bail!("reference: unsupported architecture {other}"),
        };
        let hidden = req_usize(cfg, "hidden_size")?;
        let heads = req_usize(cfg, "num_attention_heads")?;
        let kv_heads = get(cfg, "num_key_value_heads")
            .and_then(Value::as_u64)
            .map_or(heads, |v| v as usize);
        let head_dim = get(cfg, "head_dim")
            .and_then(Value::as_u64)
            .map_or(hidden / heads, |v| v as usize);
        let relu = match get(cfg, "hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu")
        {
            "silu" | "swish" => false,
            "relu" => true,
            other => bail!("reference: unsupported hidden_act {other}"),
        };

        // v5 layout: rope_parameters carries theta (and scaling); v4: top-level fields.
        let rp = get(cfg, "rope_parameters");
        let rope_theta = rp
            .and_then(|p| get(p, "rope_theta"))
            .or_else(|| get(cfg, "rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0);
        let scaling_src = match rp {
            Some(p) if rope_type(p).is_some_and(|t| t != "default") => Some(p),
            _ => get(cfg, "rope_scaling"),
        };
        let rope_scaling = match scaling_src {
            None => None,
            Some(s) => match rope_type(s) {
                None | Some("default") => None,
                Some("llama3") => Some(Llama3Scaling {
                    factor: req_f64(s, "factor")?,
                    low_freq_factor: req_f64(s, "low_freq_factor")?,
                    high_freq_factor: req_f64(s, "high_freq_factor")?,
                    original_max_position_embeddings: req_f64(
                        s,
                        "original_max_position_embeddings",
                    )?,
                }),
                Some(other) => bail!("reference: unsupported rope_type {other}"),
            },
        };

        let use_sw = get(cfg, "use_sliding_window")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let sliding_window = if use_sw {
            get(cfg, "sliding_window")
                .and_then(Value::as_u64)
                .map(|v| v as usize)
        } else {
            None
        };

        if kv_heads == 0 || heads % kv_heads != 0 {
            bail!("heads {heads} not a multiple of kv_heads {kv_heads}");
        }
        let layers = req_usize(cfg, "num_hidden_layers")?;
        let moe = RefMoe::parse(cfg, &architecture, layers)?;
        Ok(RefConfig {
            architecture,
            hidden,
            intermediate: req_usize(cfg, "intermediate_size")?,
            layers,
            heads,
            kv_heads,
            head_dim,
            vocab: req_usize(cfg, "vocab_size")?,
            eps: req_f64(cfg, "rms_norm_eps")?,
            rope_theta,
            rope_scaling,
            relu,
            tied: get(cfg, "tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            qk_norm,
            sliding_window,
            moe,
        })
    }
}

/// A dense row-major tensor in f64.
struct Tensor {
    shape: Vec<usize>,
    data: Vec<f64>,
}

fn to_f64(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f64>> {
    Ok(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect(),
        other => bail!("reference: unsupported dtype {other:?}"),
    })
}

fn load_tensors(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<String> = if index.exists() {
        let v: Value = serde_json::from_slice(&std::fs::read(&index)?)
            .with_context(|| format!("parsing {}", index.display()))?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| anyhow!("index has no weight_map"))?;
        let mut files: Vec<String> = map
            .values()
            .map(|f| f.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| anyhow!("weight_map value not a string"))?;
        files.sort();
        files.dedup();
        files
    } else {
        vec!["model.safetensors".to_string()]
    };
    let mut out = HashMap::new();
    for f in files {
        let path = dir.join(&f);
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let st = SafeTensors::deserialize(&bytes)
            .with_context(|| format!("parsing {}", path.display()))?;
        for (name, view) in st.tensors() {
            let t = Tensor {
                shape: view.shape().to_vec(),
                data: to_f64(view.dtype(), view.data())?,
            };
            if out.insert(name.clone(), t).is_some() {
                bail!("tensor {name} appears in two files");
            }
        }
    }
    Ok(out)
}

/// The reference model: config plus every tensor in f64.
pub struct ReferenceModel {
    cfg: RefConfig,
    tensors: HashMap<String, Tensor>,
}

fn rms_norm(x: &[f64], w: Option<&[f64]>, eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    match w {
        Some(w) => x.iter().zip(w).map(|(v, w)| v * r * w).collect(),
        None => x.iter().map(|v| v * r).collect(),
    }
}

fn log_sum_exp(x: &[f64]) -> f64 {
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln()
}

/// Dot product with four partial sums, only so the real-model tests stay fast.
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0.0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for ((s, x), y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    acc[0] + acc[1] + acc[2] + acc[3] + tail
}

impl ReferenceModel {
    pub fn load(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let cfg: Value = serde_json::from_slice(
            &std::fs::read(&cfg_path).with_context(|| format!("reading {}", cfg_path.display()))?,
        )?;
        let cfg = RefConfig::parse(&cfg)?;
        let tensors = load_tensors(dir)?;
        let m = ReferenceModel { cfg, tensors };
        m.check_shapes()?;
        Ok(m)
    }

    pub fn config(&self) -> &RefConfig {
        &self.cfg
    }

    fn check_shapes(&self) -> Result<()> {
        let c = &self.cfg;
        let (h, i, hd) = (c.hidden, c.intermediate, c.head_dim);
        let mut want: Vec<(String, Vec<usize>)> = vec![
            ("model.embed_tokens.weight".into(), vec![c.vocab, h]),
            ("model.norm.weight".into(), vec![h]),
        ];
        if !c.tied {
            want.push(("lm_head.weight".into(), vec![c.vocab, h]));
        }
        for l in 0..c.layers {
            let p = format!("model.layers.{l}");
            want.push((format!("{p}.input_layernorm.weight"), vec![h]));
            want.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            want.push((
                format!("{p}.self_attn.q_proj.weight"),
                vec![c.heads * hd, h],
            ));
            want.push((
                format!("{p}.self_attn.k_proj.weight"),
                vec![c.kv_heads * hd, h],
            ));
            want.push((
                format!("{p}.self_attn.v_proj.weight"),
                vec![c.kv_heads * hd, h],
            ));
            want.push((
                format!("{p}.self_attn.o_proj.weight"),
                vec![h, c.heads * hd],
            ));
            match c.moe.as_ref().filter(|m| m.sparse[l]) {
                Some(m) => {
                    let b = format!("{p}.{}", m.block);
                    want.push((format!("{b}.gate.weight"), vec![m.experts, h]));
                    let [g, u, d] = m.projections;
                    let n = m.intermediate;
                    for e in 0..m.experts {
                        let x = format!("{b}.experts.{e}");
                        want.push((format!("{x}.{g}.weight"), vec![n, h]));
                        want.push((format!("{x}.{u}.weight"), vec![n, h]));
                        want.push((format!("{x}.{d}.weight"), vec![h, n]));
                    }
                }
                None => {
                    want.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
                    want.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
                    want.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
                }
            }
            if c.qk_norm {
                want.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
                want.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
            }
        }
        for (name, shape) in want {
            let t = self
                .tensors
                .get(&name)
                .ok_or_else(|| anyhow!("missing tensor {name}"))?;
            if t.shape != shape {
                bail!("tensor {name}: shape {:?}, expected {shape:?}", t.shape);
            }
        }
        Ok(())
    }

    fn t(&self, name: &str) -> &[f64] {
        &self.tensors[name].data
    }

    /// `W x` for a row-major `[out, in]` weight.
    fn matvec(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let w = &self.tensors[name];
        let inp = w.shape[1];
        debug_assert_eq!(inp, x.len());
        w.data.chunks_exact(inp).map(|row| dot(row, x)).collect()
    }

    fn norm(&self, x: &[f64], name: &str, brk: Breakage) -> Vec<f64> {
        let w = (brk != Breakage::NormsAllOnes).then(|| self.t(name));
        rms_norm(x, w, self.cfg.eps)
    }

    /// inv_freq_i = theta^(-2i/d), optionally rescaled as in Llama 3.
    fn inv_freq(&self, brk: Breakage) -> Vec<f64> {
        let d = self.cfg.head_dim;
        let base: Vec<f64> = (0..d / 2)
            .map(|i| self.cfg.rope_theta.powf(-((2 * i) as f64) / d as f64))
            .collect();
        let Some(s) = self
            .cfg
            .rope_scaling
            .filter(|_| brk != Breakage::NoRopeScaling)
        else {
            return base;
        };
        let low_wl = s.original_max_position_embeddings / s.low_freq_factor;
        let high_wl = s.original_max_position_embeddings / s.high_freq_factor;
        base.into_iter()
            .map(|f| {
                let wl = 2.0 * std::f64::consts::PI / f;
                if wl > low_wl {
                    f / s.factor
                } else if wl < high_wl {
                    f
                } else {
                    let smooth = (s.original_max_position_embeddings / wl - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * f / s.factor + smooth * f
                }
            })
            .collect()
    }

    /// Rotate-half rope in place: dim i pairs with i + d/2 (or 2i with 2i+1 when broken).
    fn rope(x: &mut [f64], pos: usize, inv_freq: &[f64], brk: Breakage) {
        let half = inv_freq.len();
        for (i, f) in inv_freq.iter().enumerate() {
            let (s, c) = (pos as f64 * f).sin_cos();
            let (ia, ib) = if brk == Breakage::InterleavedRope {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (a, b) = (x[ia], x[ib]);
            x[ia] = a * c - b * s;
            x[ib] = b * c + a * s;
        }
    }

    /// `down · (act(gate · x) ⊙ up · x)` with the projections `{prefix}.{gate|up|down}.weight`.
    fn mlp(&self, prefix: &str, [gate, up, down]: [&str; 3], x: &[f64], brk: Breakage) -> Vec<f64> {
        let (gate, up) = if brk == Breakage::SwapGateUp {
            (up, gate)
        } else {
            (gate, up)
        };
        let g = self.matvec(&format!("{prefix}.{gate}.weight"), x);
        let u = self.matvec(&format!("{prefix}.{up}.weight"), x);
        let a: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| {
                let act = if self.cfg.relu {
                    g.max(0.0)
                } else {
                    g / (1.0 + (-g).exp())
                };
                act * u
            })
            .collect();
        self.matvec(&format!("{prefix}.{down}.weight"), &a)
    }

    /// The mixture of experts of layer prefix `p` on the normalised input `x`.
    /// Counts each chosen expert in `chosen`.
    fn experts(
        &self,
        p: &str,
        m: &RefMoe,
        x: &[f64],
        brk: Breakage,
        chosen_count: &mut [usize],
    ) -> Vec<f64> {
        let b = format!("{p}.{}", m.block);
        let logits = self.matvec(&format!("{b}.gate.weight"), x);
        let lse = log_sum_exp(&logits);
        let probs: Vec<f64> = logits.iter().map(|v| (v - lse).exp()).collect();
        let mut order: Vec<usize> = (0..m.experts).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let chosen = &order[..m.top_k];
        let total: f64 = if m.norm_topk_prob {
            chosen.iter().map(|&e| probs[e]).sum()
        } else {
            1.0
        };
        let mut out = vec![0.0; x.len()];
        for &e in chosen {
            chosen_count[e] += 1;
            let y = self.mlp(&format!("{b}.experts.{e}"), m.projections, x, brk);
            let w = probs[e] / total;
            out.iter_mut().zip(&y).for_each(|(o, v)| *o += w * v);
        }
        out
    }

    /// Logits `[T][vocab]` for every position of `ids` (positions 0..T).
    pub fn logits(&self, ids: &[u32], brk: Breakage) -> Result<Vec<Vec<f64>>> {
        Ok(self.logits_and_routing(ids, brk)?.0)
    }

    /// [`logits`](Self::logits), and how many tokens chose each expert of each layer (empty for
    /// dense layers).
    pub fn logits_and_routing(
        &self,
        ids: &[u32],
        brk: Breakage,
    ) -> Result<(Vec<Vec<f64>>, ExpertCounts)> {
        let c = &self.cfg;
        let (h, hd, nh, nkv) = (c.hidden, c.head_dim, c.heads, c.kv_heads);
        let group = nh / nkv;
        let emb = self.t("model.embed_tokens.weight");
        let mut x: Vec<Vec<f64>> = ids
            .iter()
            .map(|&id| {
                let id = id as usize;
                if id >= c.vocab {
                    bail!("token id {id} >= vocab {}", c.vocab);
                }
                Ok(emb[id * h..(id + 1) * h].to_vec())
            })
            .collect::<Result<_>>()?;
        let inv_freq = self.inv_freq(brk);
        let window = c
            .sliding_window
            .filter(|_| brk != Breakage::NoSlidingWindow);
        let t_len = ids.len();
        let mut routing: Vec<Vec<usize>> = (0..c.layers)
            .map(|l| match c.moe.as_ref().filter(|m| m.sparse[l]) {
                Some(m) => vec![0; m.experts],
                None => Vec::new(),
            })
            .collect();

        for (l, counts) in routing.iter_mut().enumerate() {
            let p = format!("model.layers.{l}");
            let mut qs = Vec::with_capacity(t_len);
            let mut ks = Vec::with_capacity(t_len);
            let mut vs = Vec::with_capacity(t_len);
            for (pos, xt) in x.iter().enumerate() {
                let hn = self.norm(xt, &format!("{p}.input_layernorm.weight"), brk);
                let mut q = self.matvec(&format!("{p}.self_attn.q_proj.weight"), &hn);
                let mut k = self.matvec(&format!("{p}.self_attn.k_proj.weight"), &hn);
                let v = self.matvec(&format!("{p}.self_attn.v_proj.weight"), &hn);
                if c.qk_norm && brk != Breakage::NoQkNorm {
                    let qn = format!("{p}.self_attn.q_norm.weight");
                    let kn = format!("{p}.self_attn.k_norm.weight");
                    for head in q.chunks_exact_mut(hd) {
                        let n = self.norm(head, &qn, brk);
                        head.copy_from_slice(&n);
                    }
                    for head in k.chunks_exact_mut(hd) {
                        let n = self.norm(head, &kn, brk);
                        head.copy_from_slice(&n);
                    }
                }
                if brk != Breakage::NoRope {
                    for head in q.chunks_exact_mut(hd) {
                        Self::rope(head, pos, &inv_freq, brk);
                    }
                    for head in k.chunks_exact_mut(hd) {
                        Self::rope(head, pos, &inv_freq, brk);
                    }
                }
                qs.push(q);
                ks.push(k);
                vs.push(v);
            }

            let scale = 1.0 / (hd as f64).sqrt();
            for t in 0..t_len {
                let start = window.map_or(0, |w| (t + 1).saturating_sub(w));
                let mut attn = vec![0.0; nh * hd];
                for head in 0..nh {
                    let kvh = if brk == Breakage::WrongGqaMapping {
                        head % nkv
                    } else {
                        head / group
                    };
                    let q = &qs[t][head * hd..(head + 1) * hd];
                    let scores: Vec<f64> = (start..=t)
                        .map(|j| dot(q, &ks[j][kvh * hd..(kvh + 1) * hd]) * scale)
                        .collect();
                    let lse = log_sum_exp(&scores);
                    let out = &mut attn[head * hd..(head + 1) * hd];
                    for (j, s) in (start..=t).zip(&scores) {
                        let pr = (s - lse).exp();
                        let v = &vs[j][kvh * hd..(kvh + 1) * hd];
                        for (o, vv) in out.iter_mut().zip(v) {
                            *o += pr * vv;
                        }
                    }
                }
                let o = self.matvec(&format!("{p}.self_attn.o_proj.weight"), &attn);
                for (xv, ov) in x[t].iter_mut().zip(&o) {
                    *xv += ov;
                }
            }

            for xt in x.iter_mut() {
                let hn = self.norm(xt, &format!("{p}.post_attention_layernorm.weight"), brk);
                let d = match c.moe.as_ref().filter(|m| m.sparse[l]) {
                    Some(m) => self.experts(&p, m, &hn, brk, counts),
                    None => self.mlp(
                        &format!("{p}.mlp"),
                        ["gate_proj", "up_proj", "down_proj"],
                        &hn,
                        brk,
                    ),
                };
                for (xv, dv) in xt.iter_mut().zip(&d) {
                    *xv += dv;
                }
            }
        }

        let head_name = if c.tied {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        let logits = x
            .iter()
            .map(|xt| {
                let hn = self.norm(xt, "model.norm.weight", brk);
                self.matvec(head_name, &hn)
            })
            .collect();
        Ok((logits, routing))
    }

    /// Windowed perplexity: consecutive windows of `window` tokens, each run from scratch,
    /// every token after the first of its window scored; a last window shorter than 2 is
    /// dropped. Returns (exp(mean NLL), scored tokens).
    pub fn perplexity(&self, ids: &[u32], window: usize) -> Result<(f64, usize)> {
        if window < 2 {
            bail!("window must be >= 2");
        }
        let mut nll = 0.0;
        let mut n = 0usize;
        for chunk in ids.chunks(window).filter(|c| c.len() >= 2) {
            let logits = self.logits(chunk, Breakage::None)?;
            for t in 0..chunk.len() - 1 {
                let row = &logits[t];
                nll += log_sum_exp(row) - row[chunk[t + 1] as usize];
                n += 1;
            }
        }
        if n == 0 {
            bail!("no tokens to score");
        }
        Ok(((nll / n as f64).exp(), n))
    }
}

/// Reference logits `[T][vocab]` for the model in `dir`.
pub fn reference_logits(dir: &Path, ids: &[u32], brk: Breakage) -> Result<Vec<Vec<f64>>> {
    ReferenceModel::load(dir)?.logits(ids, brk)
}

/// Reference windowed perplexity; see [`ReferenceModel::perplexity`].
pub fn reference_perplexity(dir: &Path, ids: &[u32], window: usize) -> Result<(f64, usize)> {
    ReferenceModel::load(dir)?.perplexity(ids, window)
}
