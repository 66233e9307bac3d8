//! The FFN half of a transformer block: RMSNorm, then the dense gate/up/down (SwiGLU or ReLU)
//! from resident weights, a resident mixture of experts ([`super::moe`]), or an [`FfnBackend`]
//! that streams them, added to the residual. Prep watches the dense FFN through an [`FfnProbe`].

use anyhow::{bail, Result};

use super::attention::add_output;
use super::norm::rms_norm;
use super::{FfnWeights, Layer, Model, Scratch};
use crate::kernels::Weight;
use crate::source::config::Activation;

/// A resident FFN: gate `[n, h]`, up `[n, h]`, down `[h, n]`. A mixture's experts are these too.
pub struct DenseFfn {
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
}

impl DenseFfn {
    /// Gate and up pre-activations of the `t` rows of `x` (`t × n` each); `whole`: in one product
    /// ([`Model::set_whole_products`]).
    fn project(&self, x: &[f32], t: usize, gate: &mut [f32], up: &mut [f32], whole: bool) {
        self.gate.matmul_t_with(x, t, gate, whole);
        self.up.matmul_t_with(x, t, up, whole);
    }

    /// `out = down · (act(gate) ⊙ up)` (dReLU: `relu(gate) ⊙ relu(up)`, [`Activation::coef`]),
    /// overwriting `gate` with the coefficients.
    fn finish(
        &self,
        act: Activation,
        t: usize,
        gate: &mut [f32],
        up: &[f32],
        out: &mut [f32],
        whole: bool,
    ) {
        gate.iter_mut()
            .zip(up)
            .for_each(|(g, u)| *g = act.coef(act.apply(*g), *u));
        self.down.matmul_t_with(gate, t, out, whole);
    }

    /// The FFN of the `t` rows of `x` into `out` (`t × hidden`), with `gate` and `up` as scratch.
    pub fn apply(
        &self,
        act: Activation,
        x: &[f32],
        t: usize,
        gate: &mut [f32],
        up: &mut [f32],
        out: &mut [f32],
    ) {
        self.project(x, t, gate, up, false);
        self.finish(act, t, gate, up, out, false);
    }

    pub(super) fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }
}

/// Computes the FFNs in place of the resident weights: the streaming runtime plugs its scheduler in
/// here, while attention, norms and the KV cache stay the model's.
pub trait FfnBackend {
    /// The residual stream entering layer `l` (`t × hidden`) is ready: the moment to speculate
    /// about the FFNs ahead.
    fn begin_layer(&mut self, l: usize, residual: &[f32]) -> Result<()>;
    /// Layer `l`'s attention has been added to the residual stream (`t × hidden`, before the FFN
    /// norm): a later moment to speculate, one that has seen the context. Does nothing unless a
    /// backend uses it.
    fn after_attention(&mut self, _l: usize, _residual: &[f32]) -> Result<()> {
        Ok(())
    }
    /// Adds layer `l`'s FFN output for the normalised inputs `x` (`t × hidden`) to `out`.
    fn ffn(&mut self, l: usize, x: &[f32], out: &mut [f32]) -> Result<()>;
}

/// What a profiling probe sees of one FFN: `t` rows each. Of a mixture of experts it sees the input
/// only (`gate` and `up` are empty).
pub struct FfnProbe<'a> {
    pub layer: usize,
    /// The residual stream after the layer's attention, before the FFN norm (`t × hidden`): what
    /// the next layer's look-ahead routes from.
    pub residual: &'a [f32],
    /// The normalised FFN input (`t × hidden`).
    pub ffn_input: &'a [f32],
    /// Gate pre-activations `gate · x` (`t × intermediate`). A probe may zero entries to drop
    /// those neurons (act(0) = 0 for every supported activation): prep measures sparsity's
    /// quality cost that way.
    pub gate: &'a mut [f32],
    /// Up projections `up · x` (`t × intermediate`).
    pub up: &'a [f32],
}

/// Who computes a block's FFN.
pub(super) enum Ffn<'a, 'b> {
    /// The resident weights, optionally watched by a profiling probe.
    Resident(Option<&'a mut dyn FnMut(FfnProbe)>),
    Backend(&'a mut (dyn FfnBackend + 'b)),
}

impl Model {
    pub(super) fn ffn_block(
        &self,
        l: usize,
        layer: &Layer,
        t: usize,
        x: &mut [f32],
        s: &mut Scratch,
        mut ffn: Ffn,
    ) -> Result<()> {
        let c = &self.config;
        let h = c.hidden_size;
        if let Ffn::Backend(b) = &mut ffn {
            b.after_attention(l, x)?;
        }
        for (src, dst) in x.chunks_exact(h).zip(s.xn.chunks_exact_mut(h)) {
            rms_norm(src, &layer.ffn_norm, c.rms_norm_eps, dst);
        }
        let probe = match ffn {
            Ffn::Backend(b) => {
                // Only the call's rows: a batched step's scratch may hold more.
                let n = t * h;
                s.proj[..n].fill(0.0);
                b.ffn(l, &s.xn[..n], &mut s.proj[..n])?;
                add_output(
                    layer.ffn_post_norm.as_deref(),
                    c.rms_norm_eps,
                    x,
                    &mut s.proj,
                );
                return Ok(());
            }
            Ffn::Resident(probe) => probe,
        };
        let weights = match &layer.ffn {
            None => bail!(
                "layer {l} has no resident FFN weights: this model streams them (use a streaming \
                 policy)"
            ),
            Some(FfnWeights::Experts(moe)) => {
                if let Some(probe) = probe {
                    probe(FfnProbe {
                        layer: l,
                        residual: x,
                        ffn_input: &s.xn,
                        gate: &mut [],
                        up: &[],
                    });
                }
                let m = c
                    .moe
                    .as_ref()
                    .expect("a model with experts has an MoE config");
                moe.forward(m, c.activation, &s.xn, t, &mut s.moe, &mut s.proj)?;
                add_output(
                    layer.ffn_post_norm.as_deref(),
                    c.rms_norm_eps,
                    x,
                    &mut s.proj,
                );
                return Ok(());
            }
            Some(FfnWeights::Dense(weights)) => weights,
        };
        let n = weights.gate.rows();
        let (gate, up) = (&mut s.gate[..t * n], &mut s.up[..t * n]);
        // Only the call's rows: a batched step's scratch may hold more.
        let xn = &s.xn[..t * h];
        weights.project(xn, t, gate, up, self.whole_products);
        if let Some(probe) = probe {
            probe(FfnProbe {
                layer: l,
                residual: x,
                ffn_input: xn,
                gate,
                up,
            });
        }
        weights.finish(
            c.activation,
            t,
            gate,
            up,
            &mut s.proj[..t * h],
            self.whole_products,
        );
        add_output(
            layer.ffn_post_norm.as_deref(),
            c.rms_norm_eps,
            x,
            &mut s.proj,
        );
        Ok(())
    }
}
