//! The FFN backend of a streamed mixture: each layer's exact top-k routing decides which experts
//! run; an expert not in the cache is read whole from flash through the read queue. Once layer
//! `l`'s attention has been added to a token's residual (before `l`'s FFN), layer `l+1`'s router
//! applied to that residual (normalised with `l+1`'s FFN norm) guesses `l+1`'s experts, and their
//! reads are queued at a low priority, most probable first, to overlap `l`'s FFN and `l+1`'s
//! attention; when `l+1` routes, the guesses it did not choose are cancelled (or, if already
//! issued, kept in the cache) and the reads it needs are raised to urgent. Experts are kept as
//! stored and decoded to f32 one at a time when they run, with the same decode and the same routed
//! steps as `--policy resident` ([`MoeScratch`]): the output is resident's, bit for bit.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use leanstream_format::ffn::FfnLayer;
use leanstream_format::file::check_extent;

use super::cache::ExpertCache;
use super::metrics::ExpertCounters;
use super::oracle::Oracle;
use crate::kernels::bundles::{gate_and_down, BundleLayout, ClusterRows};
use crate::kernels::{Matrix, Operand, RowKernels, Weight};
use crate::model::{rms_norm, route, Choice, DenseFfn, FfnBackend, MoeScratch};
use crate::source::config::{Activation, MoeConfig};
use crate::storage::{AlignedBuf, IoQueue, Ticket};
use crate::streaming::skip_rule::{Skip, SkipRule};

/// Reads a layer waits for (the engine's urgent priority: ahead of the dense stream's reads of the
/// next layer's attention).
const URGENT: u32 = crate::streaming::engine::URGENT;
/// Guesses for the next layer: behind urgent reads and the dense stream's reads ahead, within the
/// engine's speculative share.
const SPECULATIVE: u32 = 1;

/// A mixture layer as the stream holds it: the router resident, the experts on flash.
pub(super) struct MixtureLayer {
    pub router: Weight,
    /// The layer's FFN norm, which the look-ahead applies to the residual before routing.
    pub ffn_norm: Vec<f32>,
    /// Each expert's stored index (clusters, neuron order, quantization).
    pub experts: Vec<FfnLayer>,
    /// Each expert's file extent (offset, size): its clusters back to back.
    pub extents: Vec<(u64, u64)>,
}

/// A layer's FFN: resident (a dense layer of a mixture model) or experts on flash.
pub(super) enum LayerFfn {
    Dense(DenseFfn),
    Mixture(MixtureLayer),
}

/// Buffers a forward call reuses: nothing is allocated per token once they have grown.
struct Work {
    moe: MoeScratch,
    /// The expert being run, decoded to f32.
    decoded: DenseFfn,
    column: Vec<f32>,
    /// A dense layer's gate and up activations.
    gate: Vec<f32>,
    up: Vec<f32>,
    /// The look-ahead's normalised residual, logits and guesses.
    xn: Vec<f32>,
    logits: Vec<f32>,
    guess: Vec<Choice>,
    /// The running layer's chosen experts.
    chosen: Vec<bool>,
    /// Buffers of evicted experts, for the next reads.
    spare: Vec<AlignedBuf>,
    /// The bundle kernel's scores, active neurons and their coefficients (one gate batch).
    scores: Vec<f32>,
    active: Vec<u32>,
    coef: Vec<f32>,
}

pub(super) struct ExpertStream {
    layers: Vec<LayerFfn>,
    moe: MoeConfig,
    act: Activation,
    eps: f32,
    path: PathBuf,
    io: Arc<IoQueue>,
    cache: ExpertCache,
    /// Per expert id, its read in flight.
    tickets: Vec<Option<Ticket>>,
    /// Per expert id, whether the look-ahead guessed it for its layer's next run.
    predicted: Vec<bool>,
    /// Per layer, the ids guessed for its next run, most probable first.
    guessed: Vec<Vec<usize>>,
    /// Guesses per token (the speculative share of the slots).
    speculative: usize,
    work: Work,
    pub counters: ExpertCounters,
    /// The position of the forward call's first token (set by the model before each call).
    pub position: usize,
    /// Recording: per position, per layer, the experts chosen (one-token calls only).
    pub record: Option<Vec<Vec<Vec<u16>>>>,
    /// The expert oracle: the true experts guessed, Belady retention.
    oracle: Option<Oracle>,
}

fn f32_data(w: &mut Weight) -> &mut [f32] {
    match w {
        Weight::F32(m) => &mut m.data,
        Weight::Encoded(_) => unreachable!("the decoded expert is f32"),
    }
}

impl ExpertStream {
    /// `chunk` = the most tokens of one forward call; `prior` = every expert's profile frequency.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        layers: Vec<LayerFfn>,
        config: &crate::source::config::ModelConfig,
        path: PathBuf,
        io: Arc<IoQueue>,
        slots: usize,
        speculative: usize,
        prior: &[f32],
        chunk: usize,
    ) -> Self {
        let moe = config.moe.clone().expect("a mixture's config");
        let (h, n, e) = (
            config.hidden_size,
            moe.expert_intermediate_size,
            moe.num_experts,
        );
        let f32_matrix = |rows, cols| Weight::F32(Matrix::new(rows, cols, vec![0.0; rows * cols]));
        // A dense layer's activations, and the f32 copy of an expert that is not run where it
        // lies: only where some layer needs them (the planner counts them only then).
        let dense_n = if layers.iter().any(|l| matches!(l, LayerFfn::Dense(_))) {
            config.intermediate_size
        } else {
            0
        };
        let decodes = layers.iter().any(|l| match l {
            LayerFfn::Mixture(m) => m.experts.iter().any(|x| !x.qtypes.all_block()),
            LayerFfn::Dense(_) => false,
        });
        let (dn, dh) = if decodes { (n, h) } else { (0, 0) };
        let experts = layers.len() * e;
        let counters = ExpertCounters::new(layers.len());
        // Speculative reads hold one device slot at most: an urgent read never waits behind two.
        io.limit_background(crate::streaming::engine::SPECULATIVE_MAX + 1, 1);
        Self {
            work: Work {
                moe: MoeScratch::new(config, chunk),
                decoded: DenseFfn {
                    gate: f32_matrix(dn, dh),
                    up: f32_matrix(dn, dh),
                    down: f32_matrix(dh, dn),
                },
                column: vec![0.0; dh],
                gate: vec![0.0; chunk * dense_n],
                up: vec![0.0; chunk * dense_n],
                xn: vec![0.0; h],
                logits: vec![0.0; e],
                guess: vec![
                    Choice {
                        expert: 0,
                        weight: 0.0
                    };
                    speculative.min(e)
                ],
                chosen: vec![false; e],
                spare: Vec::with_capacity(slots),
                scores: vec![0.0; GATE_BATCH],
                active: vec![0; GATE_BATCH],
                coef: vec![0.0; GATE_BATCH],
            },
            guessed: (0..layers.len())
                .map(|_| Vec::with_capacity(speculative))
                .collect(),
            layers,
            act: config.activation,
            eps: config.rms_norm_eps,
            moe,
            path,
            io,
            cache: ExpertCache::new(slots, e, prior),
            tickets: vec![None; experts],
            predicted: vec![false; experts],
            speculative: speculative.min(e),
            counters,
            position: 0,
            record: None,
            oracle: None,
        }
    }

    /// Guesses the true experts from `oracle` and keeps experts by their next use in it.
    pub(super) fn set_oracle(&mut self, mut oracle: Oracle) {
        let (layers, e_count) = (self.layers.len(), self.moe.num_experts);
        for l in 0..layers {
            for e in 0..e_count {
                let id = self.cache.id(l, e);
                self.cache
                    .set_score(id, oracle.score_after(id, l, layers, None));
            }
        }
        self.oracle = Some(oracle);
    }

    pub(super) fn reset_counters(&mut self) {
        self.counters = ExpertCounters::new(self.layers.len());
    }

    pub(super) fn io(&self) -> &IoQueue {
        &self.io
    }

    /// Fills the cache with the profile's most chosen experts, leaving room for one layer's reads
    /// and the speculative ones (start-up: not counted).
    pub(super) fn warm(&mut self, order: &[usize]) -> Result<()> {
        let room = self
            .cache
            .slots()
            .saturating_sub(self.moe.experts_per_token + self.speculative);
        let e_count = self.moe.num_experts;
        for &id in order.iter().take(room) {
            self.submit(id / e_count, id % e_count, URGENT, false)?;
        }
        for &id in order.iter().take(room) {
            self.land(id / e_count, id % e_count)?;
        }
        self.reset_counters();
        Ok(())
    }

    fn mixture(&self, l: usize) -> &MixtureLayer {
        match &self.layers[l] {
            LayerFfn::Mixture(m) => m,
            LayerFfn::Dense(_) => unreachable!("layer {l} is a mixture"),
        }
    }

    /// Queues the read of expert `e` of layer `l` if a slot can be had — for a speculative read
    /// only by evicting a less used expert; false if not queued where `optional`, an error if not.
    fn submit(&mut self, l: usize, e: usize, priority: u32, optional: bool) -> Result<bool> {
        let id = self.cache.id(l, e);
        let claimed = if priority == SPECULATIVE {
            self.cache.claim_for(id)
        } else {
            self.cache.claim()
        };
        let Some(evicted) = claimed else {
            if optional {
                return Ok(false);
            }
            bail!("no expert slot is free for layer {l}'s expert {e} (a planning error)");
        };
        if let Some(buf) = evicted {
            self.work.spare.push(buf);
        }
        let (offset, size) = self.mixture(l).extents[e];
        let buf = match self.work.spare.pop() {
            Some(b) if b.len() == size as usize => b,
            _ => AlignedBuf::new(size as usize),
        };
        self.tickets[id] = Some(self.io.submit_into(buf, offset, priority));
        Ok(true)
    }

    /// Waits for the read of expert `e` of layer `l`, checks its clusters and makes it resident.
    fn land(&mut self, l: usize, e: usize) -> Result<()> {
        let id = self.cache.id(l, e);
        let ticket = self.tickets[id].take().expect("a read in flight");
        let buf = match self.io.wait(ticket) {
            Ok(buf) => buf,
            Err(err) => {
                self.cache.release();
                return Err(err).with_context(|| {
                    format!(
                        "cannot read layer {l}'s expert {e} from {}",
                        self.path.display()
                    )
                });
            }
        };
        let expert = &self.mixture(l).experts[e];
        let first = expert.clusters.first().map_or(0, |c| c.offset);
        for (ci, c) in expert.clusters.iter().enumerate() {
            let at = (c.offset - first) as usize;
            check_extent(&buf[at..at + c.extent_size as usize], c.checksum, || {
                format!(
                    "{}: layer {l} expert {e} cluster {ci} (run `leanstream-prep verify` on the file)",
                    self.path.display()
                )
            })?;
        }
        self.counters.reads += 1;
        self.counters.bytes += buf.len() as u64;
        self.cache.insert(id, buf);
        Ok(())
    }

    /// The look-ahead: layer `n`'s router on the residual `x` after the previous layer's
    /// attention.
    fn speculate(&mut self, n: usize, x: &[f32]) -> Result<()> {
        let s = self.speculative;
        let known = match &self.oracle {
            Some(o) => match o.chosen(self.position, n) {
                Some(c) => {
                    for (g, &e) in self.work.guess[..s].iter_mut().zip(c) {
                        g.expert = e as u32;
                    }
                    true
                }
                None => false,
            },
            None => false,
        };
        if !known {
            let LayerFfn::Mixture(m) = &self.layers[n] else {
                unreachable!("layer {n} is a mixture")
            };
            let w = &mut self.work;
            rms_norm(x, &m.ffn_norm, self.eps, &mut w.xn);
            m.router.matmul_t(&w.xn, 1, &mut w.logits);
            route(&w.logits, false, &mut w.guess[..s]);
        }
        for i in 0..s {
            let e = self.work.guess[i].expert as usize;
            let id = self.cache.id(n, e);
            self.predicted[id] = true;
            self.guessed[n].push(id);
            if self.cache.get(id).is_some() || self.tickets[id].is_some() {
                continue;
            }
            if self.submit(n, e, SPECULATIVE, true)? {
                self.counters.speculative_reads += 1;
            }
        }
        Ok(())
    }

    /// Layer `l`'s experts for the `t` inputs `x`, added to `out`.
    fn run_mixture(&mut self, l: usize, x: &[f32], t: usize, out: &mut [f32]) -> Result<()> {
        let e_count = self.moe.num_experts;
        self.cache.begin_run();
        {
            let LayerFfn::Mixture(m) = &self.layers[l] else {
                unreachable!("layer {l} is a mixture")
            };
            self.work.moe.route(&m.router, &self.moe, x, t);
        }
        let chosen = &mut self.work.chosen;
        chosen.fill(false);
        for c in self.work.moe.chosen() {
            chosen[c.expert as usize] = true;
        }
        if let (Some(rec), 1) = (&mut self.record, t) {
            let layers = self.layers.len();
            if rec.len() <= self.position {
                rec.resize(self.position + 1, vec![Vec::new(); layers]);
            }
            rec[self.position][l] = self
                .work
                .moe
                .chosen()
                .iter()
                .map(|c| c.expert as u16)
                .collect();
        }
        if self.oracle.is_none() {
            self.cache.observe(l, &self.work.chosen);
        }
        let judged = t == 1 && !self.guessed[l].is_empty();
        let c = &mut self.counters;
        for e in (0..e_count).filter(|&e| self.work.chosen[e]) {
            let id = self.cache.id(l, e);
            c.needed += 1;
            if self.cache.get(id).is_some() {
                c.hits += 1;
            }
            if judged {
                c.chosen_by_layer[l] += 1;
                if self.predicted[id] {
                    c.found_by_layer[l] += 1;
                }
            }
            self.cache.needed(id);
        }
        if judged {
            c.predicted_by_layer[l] += self.guessed[l].len() as u64;
        }
        // Refinement: guesses not chosen are withdrawn, or kept if their read already started.
        for i in 0..self.guessed[l].len() {
            let id = self.guessed[l][i];
            self.predicted[id] = false;
            let e = id % e_count;
            if self.work.chosen[e] {
                continue;
            }
            if let Some(ticket) = self.tickets[id] {
                if self.io.cancel(ticket) {
                    self.tickets[id] = None;
                    self.cache.release();
                    self.counters.cancelled += 1;
                } else {
                    self.land(l, e)?;
                }
            }
        }
        self.guessed[l].clear();
        // The chosen experts not resident: guesses raised to urgent, the others read as slots
        // allow (a prompt chunk may choose more experts than there are slots: each expert frees
        // its slot once it has run).
        for e in 0..e_count {
            let id = self.cache.id(l, e);
            if self.work.chosen[e] && self.cache.get(id).is_none() {
                if let Some(ticket) = self.tickets[id] {
                    self.io.boost(ticket, URGENT);
                }
            }
        }
        let mut next = self.read_ahead(l, 0)?;
        out.fill(0.0);
        for e in 0..e_count {
            if !self.work.chosen[e] {
                continue;
            }
            let id = self.cache.id(l, e);
            if self.cache.get(id).is_none() {
                if self.tickets[id].is_none() {
                    self.submit(l, e, URGENT, false)?;
                    next = e + 1;
                }
                self.land(l, e)?;
            }
            let LayerFfn::Mixture(m) = &self.layers[l] else {
                unreachable!("layer {l} is a mixture")
            };
            let bytes = self.cache.get(id).expect("landed");
            let w = &mut self.work;
            let expert = &m.experts[e];
            if expert.qtypes.all_block() {
                // Where it lies, in its stored encoding (q4/q8 bundles): every neuron computed.
                let layout = BundleLayout::of(expert)?;
                let (kernels, skip) = (RowKernels::best(), expert_skip(self.act));
                let (scores, active, coef) = (&mut w.scores, &mut w.active, &mut w.coef);
                let c = &mut self.counters;
                w.moe.add_expert_with(e, x, t, out, |xr, y| {
                    let computed = run_bundles(
                        kernels, &layout, expert, bytes, skip, xr, y, scores, active, coef,
                    )?;
                    c.neurons += expert.neurons() as u64;
                    c.neurons_computed += computed as u64;
                    Ok(())
                })?;
            } else {
                decode_expert(expert, bytes, &mut w.decoded, &mut w.column)?;
                w.moe.add_expert(e, &w.decoded, self.act, x, t, out);
            }
            self.cache.done(id);
            next = self.read_ahead(l, next)?;
        }
        if let Some(o) = &mut self.oracle {
            let (layers, last) = (self.layers.len(), self.position + t - 1);
            for e in 0..e_count {
                let id = self.cache.id(l, e);
                self.cache
                    .set_score(id, o.score_after(id, l, layers, Some(last)));
            }
        }
        Ok(())
    }

    /// Queues the reads of layer `l`'s chosen experts from `from` on that are neither resident nor
    /// in flight, in expert order, while slots can be had; returns the first not queued.
    fn read_ahead(&mut self, l: usize, from: usize) -> Result<usize> {
        let e_count = self.moe.num_experts;
        for e in from..e_count {
            let id = self.cache.id(l, e);
            if !self.work.chosen[e] || self.cache.get(id).is_some() || self.tickets[id].is_some() {
                continue;
            }
            if !self.submit(l, e, URGENT, true)? {
                return Ok(e);
            }
        }
        Ok(e_count)
    }
}

/// Neurons whose gates [`run_bundles`] computes before adding their down columns.
const GATE_BATCH: usize = 64;

/// How an expert's neurons are skipped: none, except, for a ReLU-family activation (ReLU,
/// FATReLU, dReLU: TurboSparse-Mixtral's experts), the neurons it zeroes: their up rows and down
/// columns are skipped (threshold 0 on `|act(gate)|`, and under dReLU a non-positive
/// `relu(g)·relu(u)` too, [`keep_positive`](crate::kernels::bundles::keep_positive)), which
/// leaves out exactly nothing.
fn expert_skip(act: Activation) -> Skip {
    Skip {
        act,
        rule: SkipRule::Gate,
        // Below any score (every neuron), or ReLU's exact rule.
        threshold: if act.is_relu_like() { 0.0 } else { -1.0 },
    }
}

/// An expert's output for one input `x` added to `y`: the bundle kernel over its clusters where
/// they lie in `bytes` (its whole extent), in stored order, skipping as `skip` says
/// ([`expert_skip`]). Returns how many neurons' down columns were added.
#[allow(clippy::too_many_arguments)]
fn run_bundles(
    kernels: &RowKernels,
    layout: &BundleLayout,
    expert: &FfnLayer,
    bytes: &[u8],
    skip: Skip,
    x: &[f32],
    y: &mut [f32],
    scores: &mut [f32],
    active: &mut [u32],
    coef: &mut [f32],
) -> Result<usize> {
    let first = expert.clusters.first().map_or(0, |c| c.offset);
    let op = Operand::new(x, layout.operand_type());
    let mut computed = 0;
    for (ci, c) in expert.clusters.iter().enumerate() {
        let at = (c.offset - first) as usize;
        let extent = bytes.get(at..).unwrap_or_default();
        let rows = ClusterRows::new(layout, extent, c.count as usize)
            .with_context(|| format!("expert cluster {ci}"))?;
        for start in (0..rows.len()).step_by(GATE_BATCH) {
            let len = GATE_BATCH.min(rows.len() - start);
            let (scores, rows) = (&mut scores[..len], rows.from(start));
            computed += gate_and_down(kernels, layout, &op, &rows, skip, scores, active, coef, y);
        }
    }
    Ok(computed)
}

/// Decodes an expert's stored clusters (`bytes`, its whole extent) into `into`'s f32 matrices.
fn decode_expert(
    expert: &FfnLayer,
    bytes: &[u8],
    into: &mut DenseFfn,
    column: &mut [f32],
) -> Result<()> {
    let first = expert.clusters.first().map_or(0, |c| c.offset);
    let DenseFfn { gate, up, down } = into;
    let mats = [f32_data(gate), f32_data(up), f32_data(down)];
    let [g, u, d] = mats;
    for (ci, c) in expert.clusters.iter().enumerate() {
        let at = (c.offset - first) as usize;
        crate::source::lsb_dense::decode_cluster(
            expert,
            ci,
            &bytes[at..at + c.extent_size as usize],
            [&mut *g, &mut *u, &mut *d],
            column,
        )?;
    }
    Ok(())
}

impl FfnBackend for ExpertStream {
    /// Nothing: the look-ahead waits for `l`'s attention, which carries the context (from the
    /// residual entering `l` it finds fewer of `l+1`'s experts, and a first guess here refined
    /// after the attention reads more at the same recall: docs/cli.md, "Mixtures of experts under
    /// a budget").
    fn begin_layer(&mut self, _: usize, _: &[f32]) -> Result<()> {
        Ok(())
    }

    fn after_attention(&mut self, l: usize, residual: &[f32]) -> Result<()> {
        let next = l + 1;
        let decoding = residual.len() == self.work.xn.len();
        let mixture_next = matches!(self.layers.get(next), Some(LayerFfn::Mixture(_)));
        if decoding && mixture_next && self.speculative > 0 {
            self.speculate(next, residual)?;
        }
        Ok(())
    }

    fn ffn(&mut self, l: usize, x: &[f32], out: &mut [f32]) -> Result<()> {
        let t = x.len() / self.work.xn.len();
        if let LayerFfn::Dense(f) = &self.layers[l] {
            let n = f.gate.rows();
            let w = &mut self.work;
            f.apply(
                self.act,
                x,
                t,
                &mut w.gate[..t * n],
                &mut w.up[..t * n],
                out,
            );
            return Ok(());
        }
        self.run_mixture(l, x, t, out)
    }
}

#[cfg(test)]
mod tests {
    use leanstream_format::ffn::{Cluster, ClusterLayout, FfnLayer, PartTypes};
    use leanstream_format::quant::QuantType;

    use super::*;
    use crate::kernels::bundles::{down_pass, gate_pass};

    /// A Q8_0 expert of `n` neurons over `hidden` values in one cluster: every block's scale
    /// 2^-7 and its codes drawn from a fixed sequence.
    fn q8_expert(n: usize, hidden: usize) -> (FfnLayer, Vec<u8>) {
        let layer = FfnLayer {
            qtypes: PartTypes::uniform(QuantType::Q8_0),
            hidden: hidden as u32,
            perm: (0..n as u32).collect(),
            clusters: vec![Cluster {
                first: 0,
                count: n as u32,
                offset: 0,
                extent_size: 0,
                checksum: 0,
            }],
            layout: ClusterLayout::Split,
        };
        let blocks = 3 * n * hidden / 32;
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut bytes = Vec::with_capacity(blocks * 34);
        for _ in 0..blocks {
            bytes.extend(half::f16::from_f32(1.0 / 128.0).to_le_bytes());
            for _ in 0..32 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                bytes.push((state >> 56) as u8);
            }
        }
        (layer, bytes)
    }

    /// Under ReLU, FATReLU and dReLU the expert skips the neurons the activation zeroes and adds
    /// exactly what computing every neuron adds, bit for bit; under SiLU it computes them all.
    #[test]
    fn relu_family_experts_skip_exactly_the_zeroed_neurons() {
        let (n, hidden) = (256, 64);
        let (expert, bytes) = q8_expert(n, hidden);
        let layout = BundleLayout::of(&expert).unwrap();
        let k = RowKernels::best();
        let x: Vec<f32> = (0..hidden)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 4.0)
            .collect();
        let mut scores = vec![0.0; GATE_BATCH];
        let (mut active, mut coef) = (vec![0; GATE_BATCH], vec![0.0; GATE_BATCH]);
        for act in [
            Activation::Relu,
            Activation::FatRelu { threshold: 0.5 },
            Activation::DRelu,
            Activation::Silu,
        ] {
            // Every neuron computed (no dReLU filter either), as an expert ran before it skipped
            // any.
            let every = Skip {
                threshold: -1.0,
                ..expert_skip(act)
            };
            let mut want = vec![0.0f32; hidden];
            let rows = ClusterRows::new(&layout, &bytes, n).unwrap();
            let op = Operand::new(&x, layout.operand_type());
            for start in (0..n).step_by(GATE_BATCH) {
                let s = &mut scores[..GATE_BATCH.min(n - start)];
                let (a, c) = (&mut active, &mut coef);
                let rows = rows.from(start);
                let m = gate_pass(k, &layout, &op, &rows, None, |_| true, every, s, a, c);
                assert_eq!(m, s.len());
                down_pass(k, &layout, &rows, &a[..m], &c[..m], &mut want);
            }
            let mut got = vec![0.0f32; hidden];
            let (s, a, c) = (&mut scores, &mut active, &mut coef);
            let skip = expert_skip(act);
            let computed = run_bundles(k, &layout, &expert, &bytes, skip, &x, &mut got, s, a, c);
            let computed = computed.unwrap();
            assert!(want.iter().any(|&v| v != 0.0), "{act:?}");
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{act:?}"
            );
            if act == Activation::Silu {
                assert_eq!(computed, n);
            } else {
                // About half the gates are positive; dReLU also needs a positive up.
                let most = if act == Activation::DRelu {
                    n / 3
                } else {
                    2 * n / 3
                };
                assert!(computed > n / 10 && computed < most, "{act:?}: {computed}");
            }
        }
    }
}
