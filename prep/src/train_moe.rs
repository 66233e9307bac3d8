//! `leanstream-prep train-moe`: trains a small Qwen3-MoE from scratch on a text with candle's
//! autograd and writes it as a Hugging Face directory (`config.json`, bf16 `model.safetensors`,
//! the tokenizer copied), the shape `models/qwen3-moe-austen/` ships.
//!
//! The model is Qwen3-MoE as Hugging Face defines it (and the runtime computes it): RMSNorm before
//! attention and before the mixture, per-head q/k RMSNorm, rotary positions (rotate-half), grouped
//! KV heads, tied embeddings, and in every layer a softmax router choosing the top k experts (SwiGLU
//! each), their weights renormalised over the k (`norm_topk_prob`). The loss is the next token's
//! cross-entropy plus two auxiliary terms:
//! - load balancing (Switch Transformer / Qwen's `router_aux_loss_coef`): `E · Σ_e f_e · P_e` per
//!   layer, `f_e` the share of the token slots routed to expert `e` and `P_e` its mean router
//!   probability, so that every expert is used;
//! - look-ahead consistency (optional, `--lookahead-weight`, 0 by default): for each layer `l ≥ 1`,
//!   the cross-entropy from layer `l`'s routing (held fixed: its distribution, or with
//!   `--lookahead-target chosen` its chosen experts, 1/k each) to layer `l`'s router applied to the
//!   residual after layer `l − 1`'s attention (before its FFN) — what the runtime's look-ahead
//!   computes — averaged over the
//!   layers (`--lookahead-layer-weights` weighs them), so that routing is predictable one layer early (as Pre-gated MoE trains its
//!   pre-gates).
//!
//! Training is single-device f32 on the CPU, deterministic for a seed and a thread count.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

#[derive(clap::Args, Debug, Clone)]
pub struct TrainMoeArgs {
    /// Output directory (created): config.json, model.safetensors (bf16), tokenizer.json.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Training text (UTF-8).
    #[arg(long, default_value = "data/calib.txt")]
    pub text: PathBuf,
    /// Held-out text for the validation figures (never trained on).
    #[arg(long, default_value = "data/heldout-head.txt")]
    pub heldout: PathBuf,
    /// The tokenizer (copied into the output).
    #[arg(long, default_value = "models/austen-relu/tokenizer.json")]
    pub tokenizer: PathBuf,
    /// Start from this model directory's weights (same shape) instead of a random init.
    #[arg(long)]
    pub init: Option<PathBuf>,
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    #[arg(long, default_value_t = 128)]
    pub hidden: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 32)]
    pub head_dim: usize,
    #[arg(long, default_value_t = 8)]
    pub experts: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 2)]
    pub top_k: usize,
    /// Each expert's intermediate size (`moe_intermediate_size`).
    #[arg(long, default_value_t = 192)]
    pub expert_intermediate: usize,
    /// Tokens per training sequence (and per validation window).
    #[arg(long, default_value_t = 256)]
    pub seq: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    #[arg(long, default_value_t = 3000)]
    pub steps: usize,
    /// Peak learning rate (linear warm-up, then cosine down to a tenth).
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 100)]
    pub warmup: usize,
    /// AdamW weight decay of the matrices (norm weights have none).
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    /// Weight of the load-balancing loss.
    #[arg(long, default_value_t = 0.01)]
    pub balance_weight: f64,
    /// Weight of the look-ahead consistency loss (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub lookahead_weight: f64,
    /// What the look-ahead is pulled towards: the layer's routing distribution (soft), or its
    /// chosen experts, each 1/k (chosen: aims at the top-k sets, what the runtime's recall counts).
    #[arg(long, value_enum, default_value_t = LookaheadTarget::Soft)]
    pub lookahead_target: LookaheadTarget,
    /// Relative weights of the look-ahead loss of layers 1, 2, … (the last repeats; default all
    /// equal): the first predicted layer, seen only through the token embedding, is the hardest.
    #[arg(long, value_delimiter = ',')]
    pub lookahead_layer_weights: Vec<f64>,
    /// Gradient norm clip.
    #[arg(long, default_value_t = 1.0)]
    pub clip: f64,
    /// Validate (perplexity, expert use, look-ahead recall on the held-out text) and write the
    /// model every N steps (and after the last).
    #[arg(long, default_value_t = 250)]
    pub eval_every: usize,
    /// Validation windows (of `--seq` tokens) taken from the start of the held-out text.
    #[arg(long, default_value_t = 16)]
    pub eval_windows: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LookaheadTarget {
    Soft,
    Chosen,
}

const ROPE_THETA: f64 = 10_000.0;
const EPS: f64 = 1e-6;

struct LayerVars {
    input_norm: Var,
    q: Var,
    k: Var,
    v: Var,
    o: Var,
    q_norm: Var,
    k_norm: Var,
    post_norm: Var,
    router: Var,
    /// Per expert: gate `[n, h]`, up `[n, h]`, down `[h, n]`.
    experts: Vec<[Var; 3]>,
}

struct Params {
    embed: Var,
    layers: Vec<LayerVars>,
    norm: Var,
}

/// What one forward pass gives besides the logits.
struct Aux {
    balance: Tensor,
    lookahead: Tensor,
    /// Per layer: the router logits on the true input, and (layers ≥ 1) on the residual after the
    /// layer before's attention — `[N, E]` each.
    routers: Vec<(Tensor, Option<Tensor>)>,
}

fn normal(rng: &mut StdRng) -> f32 {
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

impl Params {
    fn random(a: &TrainMoeArgs, vocab: usize, rng: &mut StdRng, dev: &Device) -> Result<Self> {
        let mut mat = |rows: usize, cols: usize, std: f32| -> Result<Var> {
            let v: Vec<f32> = (0..rows * cols).map(|_| std * normal(rng)).collect();
            Ok(Var::from_tensor(&Tensor::from_vec(v, (rows, cols), dev)?)?)
        };
        let (h, hd, n) = (a.hidden, a.head_dim, a.expert_intermediate);
        // GPT-2 style: 0.02, the residual projections scaled down by depth.
        let std = 0.02;
        let out_std = std / (2.0 * a.layers as f32).sqrt();
        let embed = mat(vocab, h, std)?;
        let mut layers = Vec::with_capacity(a.layers);
        for _ in 0..a.layers {
            let q = mat(a.heads * hd, h, std)?;
            let k = mat(a.kv_heads * hd, h, std)?;
            let v = mat(a.kv_heads * hd, h, std)?;
            let o = mat(h, a.heads * hd, out_std)?;
            let router = mat(a.experts, h, std)?;
            let experts = (0..a.experts)
                .map(|_| Ok([mat(n, h, std)?, mat(n, h, std)?, mat(h, n, out_std)?]))
                .collect::<Result<Vec<_>>>()?;
            layers.push(LayerVars {
                input_norm: ones(h, dev)?,
                q,
                k,
                v,
                o,
                q_norm: ones(hd, dev)?,
                k_norm: ones(hd, dev)?,
                post_norm: ones(h, dev)?,
                router,
                experts,
            });
        }
        Ok(Self {
            embed,
            layers,
            norm: ones(h, dev)?,
        })
    }

    /// Every tensor with its Hugging Face name.
    fn named(&self) -> Vec<(String, &Var)> {
        let mut out = vec![("model.embed_tokens.weight".to_string(), &self.embed)];
        for (l, p) in self.layers.iter().enumerate() {
            let pre = format!("model.layers.{l}");
            let mut push = |name: &str, v| out.push((format!("{pre}.{name}.weight"), v));
            push("input_layernorm", &p.input_norm);
            push("self_attn.q_proj", &p.q);
            push("self_attn.k_proj", &p.k);
            push("self_attn.v_proj", &p.v);
            push("self_attn.o_proj", &p.o);
            push("self_attn.q_norm", &p.q_norm);
            push("self_attn.k_norm", &p.k_norm);
            push("post_attention_layernorm", &p.post_norm);
            push("mlp.gate", &p.router);
            for (e, [g, u, d]) in p.experts.iter().enumerate() {
                out.push((format!("{pre}.mlp.experts.{e}.gate_proj.weight"), g));
                out.push((format!("{pre}.mlp.experts.{e}.up_proj.weight"), u));
                out.push((format!("{pre}.mlp.experts.{e}.down_proj.weight"), d));
            }
        }
        out.push(("model.norm.weight".to_string(), &self.norm));
        out
    }

    /// Replaces every weight by the one of the same name in `dir`'s model.safetensors.
    fn load(&self, dir: &Path, dev: &Device) -> Result<()> {
        let file = dir.join("model.safetensors");
        let tensors = candle_core::safetensors::load(&file, dev)
            .with_context(|| format!("cannot read {}", file.display()))?;
        for (name, var) in self.named() {
            let t = tensors.get(&name).with_context(|| {
                format!(
                    "{} has no tensor {name} (a different shape?)",
                    file.display()
                )
            })?;
            ensure!(
                t.dims() == var.dims(),
                "{}: {name} is {:?}, this run's shape wants {:?}",
                file.display(),
                t.dims(),
                var.dims()
            );
            var.set(&t.to_dtype(DType::F32)?)?;
        }
        Ok(())
    }

    /// (matrices, norm weights): the two AdamW groups.
    fn groups(&self) -> (Vec<Var>, Vec<Var>) {
        let (mut mats, mut norms) = (Vec::new(), Vec::new());
        for (_, v) in self.named() {
            if v.rank() == 1 {
                norms.push(v.clone());
            } else {
                mats.push(v.clone());
            }
        }
        (mats, norms)
    }
}

fn ones(n: usize, dev: &Device) -> Result<Var> {
    Ok(Var::ones(n, DType::F32, dev)?)
}

/// RMSNorm over the last dimension.
fn rms(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let r = (x.sqr()?.mean_keepdim(D::Minus1)? + EPS)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&r)?.broadcast_mul(w)?)
}

/// `x · wᵀ` for `x` `[N, in]`.
fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.matmul(&w.t()?)?)
}

/// Rotate-half rotary positions on `[B, heads, T, hd]`.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let hd = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, hd / 2)?;
    let x2 = x.narrow(D::Minus1, hd / 2, hd / 2)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?)
}

/// Indices of the `k` largest of `row`, the largest first (ties: the lower index).
fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

struct Model<'a> {
    a: &'a TrainMoeArgs,
    p: &'a Params,
    cos: Tensor,
    sin: Tensor,
    mask: Tensor,
    dev: Device,
}

impl<'a> Model<'a> {
    fn new(a: &'a TrainMoeArgs, p: &'a Params, dev: &Device) -> Result<Self> {
        let (t, hd) = (a.seq, a.head_dim);
        let half = hd / 2;
        let mut cos = Vec::with_capacity(t * hd);
        let mut sin = Vec::with_capacity(t * hd);
        for pos in 0..t {
            for i in 0..hd {
                let f = 1.0 / ROPE_THETA.powf((2 * (i % half)) as f64 / hd as f64);
                let angle = pos as f64 * f;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let mask: Vec<f32> = (0..t * t)
            .map(|i| if i % t > i / t { -1e9 } else { 0.0 })
            .collect();
        Ok(Self {
            a,
            p,
            cos: Tensor::from_vec(cos, (t, hd), dev)?,
            sin: Tensor::from_vec(sin, (t, hd), dev)?,
            mask: Tensor::from_vec(mask, (t, t), dev)?,
            dev: dev.clone(),
        })
    }

    /// Layer `l`'s share of the look-ahead loss (the layer weights normalised to sum to 1).
    fn lookahead_share(&self, l: usize) -> f64 {
        let w = |l: usize| {
            let w = &self.a.lookahead_layer_weights;
            w.get(l - 1).or(w.last()).copied().unwrap_or(1.0)
        };
        w(l) / (1..self.a.layers).map(w).sum::<f64>()
    }

    /// Logits `[B·T, V]` of `ids` (`b` sequences of `seq` tokens) and the auxiliary terms.
    fn forward(&self, ids: &[u32], b: usize) -> Result<(Tensor, Aux)> {
        let a = self.a;
        let (t, h, hd, e_count) = (a.seq, a.hidden, a.head_dim, a.experts);
        let n = b * t;
        let ids = Tensor::from_vec(ids.to_vec(), n, &self.dev)?;
        let mut x = self.p.embed.index_select(&ids, 0)?;
        let mut balance = Tensor::zeros((), DType::F32, &self.dev)?;
        let mut lookahead = Tensor::zeros((), DType::F32, &self.dev)?;
        let mut routers = Vec::with_capacity(a.layers);
        let mut previous_input: Option<Tensor> = None;
        let groups = a.heads / a.kv_heads;
        for (l, p) in self.p.layers.iter().enumerate() {
            // Attention.
            let xn = rms(&x, &p.input_norm)?;
            let heads = |w: &Var, count: usize, norm: &Var| -> Result<Tensor> {
                let y = linear(&xn, w)?.reshape((b, t, count, hd))?;
                let y = rms(&y, norm)?.transpose(1, 2)?.contiguous()?;
                rope(&y, &self.cos, &self.sin)
            };
            let q = heads(&p.q, a.heads, &p.q_norm)?;
            let k = heads(&p.k, a.kv_heads, &p.k_norm)?;
            let v = linear(&xn, &p.v)?
                .reshape((b, t, a.kv_heads, hd))?
                .transpose(1, 2)?;
            let repeat = |y: Tensor| -> Result<Tensor> {
                Ok(y.unsqueeze(2)?
                    .expand((b, a.kv_heads, groups, t, hd))?
                    .reshape((b, a.heads, t, hd))?)
            };
            let (k, v) = (repeat(k)?, repeat(v.contiguous()?)?);
            let scores = (q.matmul(&k.t()?.contiguous()?)? / (hd as f64).sqrt())?
                .broadcast_add(&self.mask)?;
            let att = candle_nn::ops::softmax(&scores, D::Minus1)?.matmul(&v)?;
            let att = att.transpose(1, 2)?.reshape((n, a.heads * hd))?;
            x = (x + linear(&att, &p.o)?)?;
            let after_attention = x.clone();
            // The mixture.
            let xn = rms(&x, &p.post_norm)?;
            let logits = linear(&xn, &p.router)?;
            let probs = candle_nn::ops::softmax(&logits, D::Minus1)?;
            let rows = logits.to_vec2::<f32>()?;
            let mut mask = vec![0f32; n * e_count];
            let mut chosen: Vec<Vec<u32>> = vec![Vec::new(); e_count];
            for (i, row) in rows.iter().enumerate() {
                for e in top_k(row, a.top_k) {
                    mask[i * e_count + e] = 1.0;
                    chosen[e].push(i as u32);
                }
            }
            let mask = Tensor::from_vec(mask, (n, e_count), &self.dev)?;
            let w = (&probs * &mask)?;
            let w = w.broadcast_div(&w.sum_keepdim(1)?)?;
            let mut out = Tensor::zeros((n, h), DType::F32, &self.dev)?;
            for (e, [g, u, d]) in p.experts.iter().enumerate() {
                if chosen[e].is_empty() {
                    continue;
                }
                let idx = Tensor::from_vec(chosen[e].clone(), chosen[e].len(), &self.dev)?;
                let xe = xn.index_select(&idx, 0)?;
                let act = (candle_nn::ops::silu(&linear(&xe, g)?)? * linear(&xe, u)?)?;
                let we = w.index_select(&idx, 0)?.narrow(1, e, 1)?;
                let y = linear(&act, d)?.broadcast_mul(&we)?;
                out = out.index_add(&idx, &y, 0)?;
            }
            let share: Vec<f32> = chosen
                .iter()
                .map(|c| c.len() as f32 / (n * a.top_k) as f32)
                .collect();
            let share = Tensor::from_vec(share, e_count, &self.dev)?;
            let layer_balance = ((probs.mean(0)? * share)?.sum_all()? * e_count as f64)?;
            balance = (balance + layer_balance)?;
            // The look-ahead: this layer's router on the residual after the layer before's
            // attention.
            let early = match &previous_input {
                Some(prev) => {
                    let early = linear(&rms(prev, &p.post_norm)?, &p.router)?;
                    let target = match a.lookahead_target {
                        LookaheadTarget::Soft => probs.detach(),
                        LookaheadTarget::Chosen => (&mask / a.top_k as f64)?,
                    };
                    let ce = (target * candle_nn::ops::log_softmax(&early, D::Minus1)?)?
                        .sum(1)?
                        .mean(0)?
                        .neg()?;
                    lookahead = (lookahead + (ce * self.lookahead_share(l))?)?;
                    Some(early)
                }
                None => None,
            };
            routers.push((logits, early));
            let _ = l;
            previous_input = Some(after_attention);
            x = (x + out)?;
        }
        let x = rms(&x, &self.p.norm)?;
        let logits = linear(&x, &self.p.embed)?;
        let layers = a.layers as f64;
        Ok((
            logits,
            Aux {
                balance: (balance / layers)?,
                lookahead,
                routers,
            },
        ))
    }
}

/// Validation figures on held-out windows.
#[derive(Debug, Default, serde::Serialize)]
struct Eval {
    perplexity: f64,
    /// Per layer: the share of the chosen experts the look-ahead's top k held (null: layer 0).
    lookahead_recall: Vec<Option<f64>>,
    /// Per layer: the largest share of token slots one expert took (1/E is perfectly even).
    busiest_expert_share: Vec<f64>,
    /// Per layer: the recall of a guess that ignores the token, the k experts most chosen on these
    /// windows (what the look-ahead has to beat).
    static_recall: Vec<f64>,
}

fn evaluate(m: &Model, windows: &[&[u32]]) -> Result<Eval> {
    let a = m.a;
    let (mut nll, mut count) = (0.0f64, 0usize);
    let mut found = vec![0usize; a.layers];
    let mut chosen = vec![0usize; a.layers];
    let mut uses = vec![vec![0usize; a.experts]; a.layers];
    for w in windows {
        let (logits, aux) = m.forward(&w[..a.seq], 1)?;
        let targets = Tensor::from_vec(w[1..=a.seq].to_vec(), a.seq, &m.dev)?;
        let ce = candle_nn::loss::cross_entropy(&logits, &targets)?.to_scalar::<f32>()?;
        nll += ce as f64 * a.seq as f64;
        count += a.seq;
        for (l, (true_logits, early)) in aux.routers.iter().enumerate() {
            let rows = true_logits.to_vec2::<f32>()?;
            let early = early.as_ref().map(|e| e.to_vec2::<f32>()).transpose()?;
            for (i, row) in rows.iter().enumerate() {
                let truth = top_k(row, a.top_k);
                for &e in &truth {
                    uses[l][e] += 1;
                }
                if let Some(early) = &early {
                    let guess = top_k(&early[i], a.top_k);
                    chosen[l] += truth.len();
                    found[l] += truth.iter().filter(|e| guess.contains(e)).count();
                }
            }
        }
    }
    Ok(Eval {
        perplexity: (nll / count as f64).exp(),
        lookahead_recall: (0..a.layers)
            .map(|l| (l > 0).then(|| found[l] as f64 / chosen[l].max(1) as f64))
            .collect(),
        busiest_expert_share: uses
            .iter()
            .map(|u| *u.iter().max().unwrap_or(&0) as f64 / u.iter().sum::<usize>().max(1) as f64)
            .collect(),
        static_recall: uses
            .iter()
            .map(|u| {
                let busiest: usize =
                    top_k(&u.iter().map(|&c| c as f32).collect::<Vec<_>>(), a.top_k)
                        .iter()
                        .map(|&e| u[e])
                        .sum();
                busiest as f64 / u.iter().sum::<usize>().max(1) as f64
            })
            .collect(),
    })
}

fn check(a: &TrainMoeArgs) -> Result<()> {
    ensure!(
        a.layers >= 1 && a.hidden >= 1,
        "--layers and --hidden must be at least 1"
    );
    ensure!(
        a.kv_heads >= 1 && a.heads.is_multiple_of(a.kv_heads),
        "--heads ({}) must be a multiple of --kv-heads ({})",
        a.heads,
        a.kv_heads
    );
    ensure!(
        a.head_dim.is_multiple_of(2),
        "--head-dim must be even (rotary positions)"
    );
    ensure!(
        a.top_k >= 1 && a.top_k <= a.experts,
        "--top-k ({}) must be between 1 and --experts ({})",
        a.top_k,
        a.experts
    );
    ensure!(
        a.lookahead_layer_weights.is_empty()
            || a.lookahead_layer_weights
                .iter()
                .all(|w| w.is_finite() && *w >= 0.0)
                && a.lookahead_layer_weights.iter().any(|w| *w > 0.0),
        "--lookahead-layer-weights must be non-negative numbers, one at least positive"
    );
    ensure!(
        a.seq >= 2 && a.batch >= 1 && a.steps >= 1,
        "--seq ≥ 2, --batch ≥ 1, --steps ≥ 1"
    );
    Ok(())
}

fn read_text(path: &Path) -> Result<String> {
    leanstream::tokenizer::read_text(path)
}

pub fn run(a: TrainMoeArgs) -> Result<()> {
    check(&a)?;
    let started = Instant::now();
    let tok_bytes = std::fs::read(&a.tokenizer)
        .with_context(|| format!("cannot read the tokenizer {}", a.tokenizer.display()))?;
    let tokenizer = leanstream::tokenizer::Tokenizer::from_bytes(&tok_bytes)
        .with_context(|| format!("{} is not a tokenizer.json", a.tokenizer.display()))?;
    let train = tokenizer.encode(&read_text(&a.text)?, false)?;
    let held = tokenizer.encode(&read_text(&a.heldout)?, false)?;
    let vocab = 1 + *train.iter().chain(&held).max().context("empty texts")? as usize;
    let vocab = vocab_size(&tok_bytes)?.max(vocab);
    if train.len() < a.seq + 2 {
        bail!(
            "{} gives {} tokens; a training sequence needs {}",
            a.text.display(),
            train.len(),
            a.seq + 1
        );
    }
    let windows: Vec<&[u32]> = held
        .chunks(a.seq + 1)
        .filter(|w| w.len() == a.seq + 1)
        .take(a.eval_windows)
        .collect();
    if windows.is_empty() {
        bail!(
            "{} gives {} tokens; a validation window needs {}",
            a.heldout.display(),
            held.len(),
            a.seq + 1
        );
    }
    eprintln!(
        "train-moe: {} training tokens ({}), {} validation windows of {} ({}), vocab {vocab}",
        train.len(),
        a.text.display(),
        windows.len(),
        a.seq,
        a.heldout.display()
    );
    let dev = Device::Cpu;
    let mut rng = StdRng::seed_from_u64(a.seed);
    let params = Params::random(&a, vocab, &mut rng, &dev)?;
    if let Some(dir) = &a.init {
        params.load(dir, &dev)?;
    }
    let count: usize = params.named().iter().map(|(_, v)| v.elem_count()).sum();
    eprintln!("train-moe: {count} parameters");
    let model = Model::new(&a, &params, &dev)?;
    let (mats, norms) = params.groups();
    let adam = |vars, wd| {
        AdamW::new(
            vars,
            ParamsAdamW {
                lr: a.lr,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: wd,
            },
        )
    };
    let mut opt_mats = adam(mats.clone(), a.weight_decay)?;
    let mut opt_norms = adam(norms.clone(), 0.0)?;
    let all: Vec<Var> = mats.iter().chain(&norms).cloned().collect();
    let mut log = Vec::new();
    let mut last_loss = f64::NAN;
    for step in 0..a.steps {
        let lr = schedule(&a, step);
        opt_mats.set_learning_rate(lr);
        opt_norms.set_learning_rate(lr);
        let mut ids = Vec::with_capacity(a.batch * a.seq);
        let mut targets = Vec::with_capacity(a.batch * a.seq);
        for _ in 0..a.batch {
            let s = rng.random_range(0..train.len() - a.seq - 1);
            ids.extend_from_slice(&train[s..s + a.seq]);
            targets.extend_from_slice(&train[s + 1..s + a.seq + 1]);
        }
        let (logits, aux) = model.forward(&ids, a.batch)?;
        let targets = Tensor::from_vec(targets, a.batch * a.seq, &dev)?;
        let ce = candle_nn::loss::cross_entropy(&logits, &targets)?;
        let mut loss = (&ce + (&aux.balance * a.balance_weight)?)?;
        if a.lookahead_weight > 0.0 {
            loss = (loss + (&aux.lookahead * a.lookahead_weight)?)?;
        }
        let mut grads = loss.backward()?;
        let mut norm2 = 0.0f64;
        for v in &all {
            if let Some(g) = grads.get(v) {
                norm2 += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            }
        }
        let norm = norm2.sqrt();
        if norm > a.clip {
            for v in &all {
                if let Some(g) = grads.remove(v) {
                    grads.insert(v, (g * (a.clip / norm))?);
                }
            }
        }
        opt_mats.step(&grads)?;
        opt_norms.step(&grads)?;
        last_loss = ce.to_scalar::<f32>()? as f64;
        if step % 50 == 0 || step + 1 == a.steps {
            eprintln!(
                "step {step:5}  lr {lr:.2e}  loss {last_loss:.4}  balance {:.4}  look-ahead {:.4}  \
                 grad {norm:.3}  {:.0} s ({:.0} s CPU)",
                aux.balance.to_scalar::<f32>()?,
                aux.lookahead.to_scalar::<f32>()?,
                started.elapsed().as_secs_f64(),
                cpu_seconds().unwrap_or(f64::NAN)
            );
        }
        if (step + 1) % a.eval_every == 0 || step + 1 == a.steps {
            let e = evaluate(&model, &windows)?;
            eprintln!("eval at step {}: {}", step + 1, serde_json::to_string(&e)?);
            log.push(json!({ "step": step + 1, "train_loss": last_loss, "eval": e }));
            // A checkpoint at every validation: a run stopped early leaves its last one.
            write_model(&a, &params, vocab, &tok_bytes)?;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let summary = json!({
        "args": format!("{a:?}"),
        "parameters": count,
        "training_tokens": train.len(),
        "final_train_loss": last_loss,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds(),
        "evals": log,
    });
    let path = a.output.join("training.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!(
        "train-moe: wrote {} ({count} parameters, {:.0} s)",
        a.output.display(),
        seconds
    );
    Ok(())
}

/// This process's user + system CPU time (Linux: /proc/self/stat), if it can be read.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// Linear warm-up, then cosine from `lr` down to `lr / 10`.
fn schedule(a: &TrainMoeArgs, step: usize) -> f64 {
    if step < a.warmup {
        return a.lr * (step + 1) as f64 / a.warmup as f64;
    }
    let span = (a.steps - a.warmup).max(1) as f64;
    let progress = (step - a.warmup) as f64 / span;
    let min = a.lr / 10.0;
    min + 0.5 * (a.lr - min) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// The tokenizer's vocabulary size (its model's vocab plus added tokens).
fn vocab_size(tokenizer_json: &[u8]) -> Result<usize> {
    let v: serde_json::Value = serde_json::from_slice(tokenizer_json)?;
    let model = v["model"]["vocab"].as_object().map_or(0, |m| m.len());
    let added = v["added_tokens"].as_array().map_or(0, |a| {
        a.iter()
            .filter_map(|t| t["id"].as_u64())
            .map(|id| id as usize + 1)
            .max()
            .unwrap_or(0)
    });
    Ok(model.max(added))
}

fn write_model(a: &TrainMoeArgs, p: &Params, vocab: usize, tokenizer: &[u8]) -> Result<()> {
    let dir = &a.output;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let config = json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": a.hidden,
        "intermediate_size": a.expert_intermediate * a.top_k,
        "moe_intermediate_size": a.expert_intermediate,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": EPS,
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": true,
        "vocab_size": vocab,
        "max_position_embeddings": a.seq,
        "num_experts": a.experts,
        "num_experts_per_tok": a.top_k,
        "norm_topk_prob": true,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": a.balance_weight,
        "output_router_logits": false,
        "use_sliding_window": false,
        "sliding_window": null,
        "max_window_layers": a.layers,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": null,
        "eos_token_id": 0,
        "torch_dtype": "bfloat16",
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)? + "\n",
    )?;
    std::fs::write(dir.join("tokenizer.json"), tokenizer)?;
    let mut encoded: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, v) in p.named() {
        let values = v.flatten_all()?.to_vec1::<f32>()?;
        let bytes = values
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect();
        encoded.push((name, v.dims().to_vec(), bytes));
    }
    let views = encoded
        .iter()
        .map(|(n, s, b)| {
            Ok((
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), b)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, Some(meta), &path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}
