//! The mixture-of-experts FFN block (Qwen3-MoE, Mixtral): a router scores every expert from the
//! normalised input, each token runs its `k` best experts — each an ordinary SwiGLU/ReLU
//! [`DenseFfn`] — and adds their outputs weighted by the router's softmax probabilities. Tokens
//! are grouped by expert so that a chunk runs each expert's matrices once.

use anyhow::Result;

use super::dense_ffn::DenseFfn;
use crate::kernels::Weight;
use crate::source::config::{Activation, Architecture, ModelConfig, MoeConfig};

/// A resident mixture of experts: the router `[experts, hidden]` and every expert's FFN.
pub struct MoeFfn {
    pub router: Weight,
    pub experts: Vec<DenseFfn>,
}

/// One routing decision: an expert and the weight of its output.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    pub expert: u32,
    pub weight: f32,
}

/// The `chosen.len()` experts with the highest router logits (ties to the lower index), best
/// first, weighted by their softmax probability over all experts — renormalised over the chosen
/// ones when `norm_topk_prob`. Softmax preserves order, so choosing by logit is choosing by
/// probability.
pub fn route(logits: &[f32], norm_topk_prob: bool, chosen: &mut [Choice]) {
    let k = chosen.len();
    assert!(
        k <= logits.len(),
        "cannot choose {k} of {} experts",
        logits.len()
    );
    for i in 0..k {
        let mut best: Option<usize> = None;
        for (e, &v) in logits.iter().enumerate() {
            let taken = chosen[..i].iter().any(|c| c.expert as usize == e);
            if !taken && best.is_none_or(|b| v > logits[b]) {
                best = Some(e);
            }
        }
        let e = best.expect("k <= experts");
        chosen[i] = Choice {
            expert: e as u32,
            weight: logits[e],
        };
    }
    let max = chosen.first().map_or(0.0, |c| c.weight);
    let all: f32 = logits.iter().map(|v| (v - max).exp()).sum();
    for c in chosen.iter_mut() {
        c.weight = (c.weight - max).exp();
    }
    let denom = if norm_topk_prob {
        chosen.iter().map(|c| c.weight).sum()
    } else {
        all
    };
    chosen.iter_mut().for_each(|c| c.weight /= denom);
}

/// Scratch space for routing a chunk of `t` tokens and running their experts: [`MoeScratch::route`]
/// chooses, then [`MoeScratch::add_expert`] adds each chosen expert in expert order — the
/// resident mixture and the expert stream run these same steps, so their bits agree.
pub struct MoeScratch {
    logits: Vec<f32>,
    /// `t × k` choices, token-major.
    chosen: Vec<Choice>,
    /// Experts per token.
    k: usize,
    /// Tokens of the last [`MoeScratch::route`].
    routed: usize,
    /// The tokens routed to the expert being run, and their weights.
    rows: Vec<(usize, f32)>,
    /// Those tokens' inputs, gathered.
    xs: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    out: Vec<f32>,
}

impl MoeScratch {
    /// Empty when the model has no mixture of experts.
    pub fn new(c: &ModelConfig, t: usize) -> Self {
        let (e, k, n) = c.moe.as_ref().map_or((0, 0, 0), |m| {
            (
                m.num_experts,
                m.experts_per_token,
                m.expert_intermediate_size,
            )
        });
        let rows = if c.moe.is_some() { t } else { 0 };
        Self {
            logits: vec![0.0; rows * e],
            chosen: vec![
                Choice {
                    expert: 0,
                    weight: 0.0
                };
                rows * k
            ],
            k,
            routed: 0,
            rows: Vec::with_capacity(rows),
            xs: vec![0.0; rows * c.hidden_size],
            gate: vec![0.0; rows * n],
            up: vec![0.0; rows * n],
            out: vec![0.0; rows * c.hidden_size],
        }
    }

    /// Routes the `t` inputs `x` (`t × hidden`) through `router` (`[experts, hidden]`).
    pub fn route(&mut self, router: &Weight, m: &MoeConfig, x: &[f32], t: usize) {
        let (e_count, k) = (m.num_experts, m.experts_per_token);
        router.matmul_t(x, t, &mut self.logits[..t * e_count]);
        let logits = self.logits[..t * e_count].chunks_exact(e_count);
        for (l, chosen) in logits.zip(self.chosen.chunks_exact_mut(k)) {
            route(l, m.norm_topk_prob, chosen);
        }
        self.routed = t;
    }

    /// The choices of the tokens last routed, `k` per token, token-major.
    pub fn chosen(&self) -> &[Choice] {
        &self.chosen[..self.routed * self.k]
    }

    /// Adds expert `e`'s output for the tokens last routed that chose it, weighted, to `out`
    /// (`t × hidden`); nothing if none chose it.
    pub fn add_expert(
        &mut self,
        e: usize,
        expert: &DenseFfn,
        act: Activation,
        x: &[f32],
        t: usize,
        out: &mut [f32],
    ) {
        let (h, k) = (x.len() / t, self.k);
        let n = expert.gate.rows();
        self.rows.clear();
        for (row, chosen) in self.chosen[..t * k].chunks_exact(k).enumerate() {
            if let Some(c) = chosen.iter().find(|c| c.expert as usize == e) {
                self.rows.push((row, c.weight));
            }
        }
        let r = self.rows.len();
        if r == 0 {
            return;
        }
        for (&(row, _), dst) in self.rows.iter().zip(self.xs.chunks_exact_mut(h)) {
            dst.copy_from_slice(&x[row * h..(row + 1) * h]);
        }
        expert.apply(
            act,
            &self.xs[..r * h],
            r,
            &mut self.gate[..r * n],
            &mut self.up[..r * n],
            &mut self.out[..r * h],
        );
        for (&(row, w), y) in self.rows.iter().zip(self.out.chunks_exact(h)) {
            let dst = &mut out[row * h..(row + 1) * h];
            dst.iter_mut().zip(y).for_each(|(o, v)| *o += w * v);
        }
    }

    /// [`add_expert`](Self::add_expert) with the expert run by `run(x_row, y)`, which writes the
    /// expert's output for one token's input into `y` (`hidden` values, zeroed first): for an
    /// expert computed where it lies, in its stored encoding, one token at a time.
    pub fn add_expert_with(
        &mut self,
        e: usize,
        x: &[f32],
        t: usize,
        out: &mut [f32],
        mut run: impl FnMut(&[f32], &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let (h, k) = (x.len() / t, self.k);
        self.rows.clear();
        for (row, chosen) in self.chosen[..t * k].chunks_exact(k).enumerate() {
            if let Some(c) = chosen.iter().find(|c| c.expert as usize == e) {
                self.rows.push((row, c.weight));
            }
        }
        let y = &mut self.out[..h];
        for &(row, w) in &self.rows {
            y.fill(0.0);
            run(&x[row * h..(row + 1) * h], y)?;
            let dst = &mut out[row * h..(row + 1) * h];
            dst.iter_mut().zip(y.iter()).for_each(|(o, v)| *o += w * v);
        }
        Ok(())
    }
}

/// The Hugging Face block of an architecture's mixture and its experts' gate, up and down names:
/// Qwen3-MoE's (`mlp`, `gate_proj`…) or, for the Mistral/Llama family, Mixtral's
/// (`block_sparse_moe`, `w1` = gate, `w3` = up, `w2` = down).
fn hf_block(arch: Architecture) -> (&'static str, [&'static str; 3]) {
    match arch {
        // No Gemma or Phi-3 mixture is read; their names would be Qwen's.
        Architecture::Qwen3
        | Architecture::Qwen2
        | Architecture::Gemma2
        | Architecture::Gemma3
        | Architecture::Phi3 => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        Architecture::Llama | Architecture::Mistral => ("block_sparse_moe", ["w1", "w3", "w2"]),
    }
}

/// Hugging Face names of expert `e` of layer `l`: its gate, up and down matrices.
pub fn expert_tensor_names(arch: Architecture, l: usize, e: usize) -> [String; 3] {
    let (block, parts) = hf_block(arch);
    parts.map(|w| format!("model.layers.{l}.{block}.experts.{e}.{w}.weight"))
}

/// Hugging Face name of layer `l`'s router (`[experts, hidden]`).
pub fn router_tensor_name(arch: Architecture, l: usize) -> String {
    format!("model.layers.{l}.{}.gate.weight", hf_block(arch).0)
}

impl MoeFfn {
    /// Loads the router and experts of layer `l` through `mat`, under the Hugging Face names of
    /// the architecture ([`expert_tensor_names`], [`router_tensor_name`]).
    pub(super) fn load(
        c: &ModelConfig,
        l: usize,
        mat: impl Fn(&str, usize, usize) -> Result<Weight>,
    ) -> Result<Self> {
        let m = c.moe.as_ref().expect("an MoE layer has an MoE config");
        let (h, n) = (c.hidden_size, m.expert_intermediate_size);
        let experts = (0..m.num_experts)
            .map(|e| {
                let [gate, up, down] = expert_tensor_names(c.architecture, l, e);
                Ok(DenseFfn {
                    gate: mat(&gate, n, h)?,
                    up: mat(&up, n, h)?,
                    down: mat(&down, h, n)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            router: mat(&router_tensor_name(c.architecture, l), m.num_experts, h)?,
            experts,
        })
    }

    /// Writes the mixture's output for the `t` normalised inputs `x` (`t × hidden`) to `out`.
    pub(super) fn forward(
        &self,
        m: &MoeConfig,
        act: Activation,
        x: &[f32],
        t: usize,
        s: &mut MoeScratch,
        out: &mut [f32],
    ) -> Result<()> {
        s.route(&self.router, m, x, t);
        out.fill(0.0);
        for (e, expert) in self.experts.iter().enumerate() {
            s.add_expert(e, expert, act, x, t, out);
        }
        Ok(())
    }

    pub(super) fn bytes(&self) -> usize {
        self.router.bytes() + self.experts.iter().map(DenseFfn::bytes).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choices(k: usize) -> Vec<Choice> {
        vec![
            Choice {
                expert: 0,
                weight: 0.0
            };
            k
        ]
    }

    #[test]
    fn routes_to_the_best_experts_with_softmax_weights() {
        let logits = [0.5f32, 2.0, -1.0, 1.0];
        let z: f32 = logits.iter().map(|v| v.exp()).sum();
        let mut c = choices(2);
        route(&logits, false, &mut c);
        assert_eq!((c[0].expert, c[1].expert), (1, 3));
        assert!((c[0].weight - 2f32.exp() / z).abs() < 1e-6);
        assert!((c[1].weight - 1f32.exp() / z).abs() < 1e-6);
        route(&logits, true, &mut c);
        let pair = 2f32.exp() + 1f32.exp();
        assert!((c[0].weight - 2f32.exp() / pair).abs() < 1e-6);
        assert!((c[0].weight + c[1].weight - 1.0).abs() < 1e-6);
    }

    #[test]
    fn ties_go_to_the_lower_expert() {
        let mut c = choices(2);
        route(&[1.0, 3.0, 3.0, 3.0], true, &mut c);
        assert_eq!((c[0].expert, c[1].expert), (1, 2));
        assert_eq!(c[0].weight, 0.5);
    }
}
