//! The streaming FFN, shared by every policy: per token and layer,
//! 1. *select* — when layer l's FFN input exists, the sparsity mode names the candidate neurons
//!    (certified: all but those the layer's certificate, where it has one, proves inactive;
//!    predicted: the layer's own
//!    predictor's set; exact: all), and so the clusters needed — unless the policy knows the
//!    active neurons in advance (the oracle);
//! 2. *refine* — queued reads of the layer that are no longer wanted are cancelled, wanted ones
//!    boosted, missing ones issued at top priority (each policy says which of these it does);
//! 3. *compute* — resident clusters first, then clusters as their reads land (or, for a policy
//!    that loads then computes, once all have landed); the exact score in each bundle decides, so
//!    a speculated-but-inactive neuron costs a read, never a wrong value;
//! 4. *retain* — the cache is told which clusters were actually used, and how strongly.
//!
//! What is read ahead, what is pinned and what the cache keeps are the policy's decisions
//! ([`Schedule`]); this file only carries them out and measures.

mod chunk;
mod groups;
mod runs;
mod state;

use groups::*;
use runs::LayerRuns;
use state::Resident;
pub(super) use state::{Core, Refine};

use std::ops::Deref;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};
use leanstream_format::file::check_extent;
use leanstream_format::quant::QuantType;
use leanstream_format::FormatError;

use crate::kernels::bundles::{
    down_pass, gate_pass, gate_pass_groups, gate_pass_runs, keep_positive, ClusterRows,
    GroupedRuns, PARALLEL_MIN_BYTES, RUN_PASS,
};
use crate::kernels::grouped_cluster::{
    gate_pass_grouped_cluster, group_cluster, groupable_cluster, ungroup_cluster_into,
};
use crate::kernels::parallel;
use crate::kernels::{Operand, RowKernels};
use crate::model::FfnBackend;
use crate::storage::{AlignedBuf, IoQueue, SpareBuffers, Ticket};
use crate::streaming::neuron_cache::{ClusterKey, ClusterSlots, NeuronCache};
use crate::streaming::skip_rule::Skip;

use super::metrics::Metrics;
use super::mmap::Mapping;
use super::plan::LayerPlan;
use super::predict::{above_into, active_from_read, read_predictor};
use super::refill::Refill;
use super::refine_sketch::RefineScratch;
use super::schedule::{Schedule, TOP_UP_SHARE};
use super::trace::ActiveTrace;

/// How neurons are chosen for computation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sparsity {
    /// Compute only the `keep_permille`/1000 share of each layer's neurons that its one-bit gate
    /// sketch scores highest, skip the others unread ([`crate::streaming::refine_sketch`]):
    /// approximate, the same neurons under every policy.
    Refine { keep_permille: u16 },
    /// Skip only neurons the gate sketch proves inactive: output equals `resident`.
    Certified,
    /// Skip what the layer's own predictor calls inactive (approximate, like prior systems).
    Predicted,
    /// Compute every neuron's exact gate (the `resident` policy: all bundles in DRAM).
    Exact,
    /// Compute every neuron, up and down included: the same bytes without sparsity (`dense` on a
    /// converted file, the baseline sparsity is measured against).
    Dense,
}

/// Read priorities: refinement's demands outrank speculation's guesses.
pub(super) const URGENT: u32 = u32::MAX;
pub(super) const SPECULATIVE_MAX: u32 = 1 << 30;
/// Where the layer's own predictor decides nothing it is not resident: in certified mode it is read
/// from flash (its f16 record, a small read) on one decoded token in this many, for its recall
/// and precision figures only — never within a prompt chunk, whose point is to read each needed
/// cluster once; exact mode (the resident policy reads nothing after start-up) has no such
/// figures.
const OWN_SAMPLE: usize = 16;
/// Reduction groups per layer. A layer's FFN output is the sum, in group order, of [`GROUPS`]
/// partial sums, each over a fixed run of consecutive clusters, adding its clusters' active neurons
/// in order from zero. The shape depends only on the layer: which clusters happened to be
/// resident, the order reads landed in and the number of threads change when a group's work is
/// done, never the arithmetic, so certified output is bitwise the resident policy's. A read that
/// lands before an earlier cluster of its group has its gates computed at once and its down
/// columns added when the group gets to it.
const GROUPS: usize = 16;

/// A cluster's bytes: read from flash or held in the cache.
pub enum Bytes {
    Read(AlignedBuf),
    Vec(Vec<u8>),
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Read(b) => b,
            Bytes::Vec(v) => v,
        }
    }
}

impl std::ops::DerefMut for Bytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Bytes::Read(b) => b,
            Bytes::Vec(v) => v,
        }
    }
}

/// What one token's layer needs, decided once its FFN input exists. The engine keeps one per row
/// of a forward call and refills it for every layer, so the token loop does not allocate it.
#[derive(Default)]
struct Selection {
    /// The layer's own predictor's set, where it ran (see [`OWN_SAMPLE`]): valid when `has_own`.
    own: Vec<bool>,
    has_own: bool,
    /// The read of the own predictor kept on flash, and its extent, while it is sampled and not
    /// scored yet.
    own_read: Option<(Ticket, (u64, u64))>,
    /// Scratch of the own predictor: its normalised input and scores.
    own_input: Vec<f32>,
    own_scores: Vec<f32>,
    /// Neurons to compute.
    candidate: Vec<bool>,
    /// Scratch of the refine sketch.
    refine: RefineScratch,
    /// Clusters holding a candidate, ascending.
    needed: Vec<usize>,
    /// The true active neurons, when a trace is known.
    truth: Option<Vec<u32>>,
    /// Per cluster: listed (needed or truly active) and in memory when the input was ready.
    in_memory: Vec<bool>,
}

/// Per-layer flags that [`StreamEngine::retain_and_measure`] and refinement fill, kept between
/// layers so that they are not allocated per token.
#[derive(Default)]
struct Marks {
    /// Per cluster: needed by the token.
    is_needed: Vec<bool>,
    /// Per neuron: computed and active.
    computed: Vec<bool>,
    /// Per neuron: truly active (the trace's, else `computed`).
    active: Vec<bool>,
    /// Per cluster: holds a truly active neuron.
    active_clusters: Vec<bool>,
    /// Computed clusters that held an active neuron.
    used: Vec<usize>,
}

pub struct StreamEngine {
    core: Core,
    schedule: Box<dyn Schedule + Send>,
    /// Index of the first token of the current forward call, counted since the engine started.
    call_token: usize,
    /// The true active sets of the tokens to come, when known (the bench records them): the
    /// truth the metrics use, and the oracle's knowledge.
    truth: Option<Arc<ActiveTrace>>,
    /// Per (token, layer) in order: the active stored positions, while recording a trace.
    recording: Option<Vec<Vec<u32>>>,
    work: Work,
    /// One selection per row of the current forward call.
    rows: Vec<Selection>,
    marks: Marks,
    /// Refilling the cache after the budget grew, while under way.
    refill: Option<Refill>,
}

impl StreamEngine {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        plans: Vec<LayerPlan>,
        sparsity: Sparsity,
        io: Arc<IoQueue>,
        cache: NeuronCache<Bytes>,
        mapping: Option<Mapping>,
        io_budget: u64,
        schedule: Box<dyn Schedule + Send>,
        truth: Option<Arc<ActiveTrace>>,
    ) -> Self {
        let slots = cache.slots().clone();
        Self {
            core: Core {
                plans,
                sparsity,
                call_len: 0,
                io,
                cache,
                mapping,
                runs: Vec::new(),
                slots: slots.clone(),
                pending: vec![None; slots.len()],
                in_batch: vec![false; slots.len()],
                shrunk: vec![false; slots.len()],
                refilling: vec![false; slots.len()],
                late: Vec::new(),
                tickets: Vec::new(),
                reads: Vec::new(),
                in_flight: 0,
                io_budget,
                spare: SpareBuffers::new(io_budget as usize),
                group_buf: Vec::new(),
                metrics: Metrics::default(),
            },
            schedule,
            call_token: 0,
            truth,
            recording: None,
            work: Work::default(),
            rows: Vec::new(),
            marks: Marks::default(),
            refill: None,
        }
    }

    pub fn io(&self) -> &IoQueue {
        &self.core.io
    }

    pub fn metrics(&self) -> &Metrics {
        &self.core.metrics
    }

    /// Layers whose bundles the cache holds whole, as runs ([`Core::pin_layer_in_runs`]).
    pub fn whole_layers(&self) -> usize {
        self.core.runs.iter().filter(|r| r.is_some()).count()
    }

    pub fn reset_metrics(&mut self) {
        self.core.metrics = Metrics::default();
    }

    /// Gives the neuron cache a new capacity (the budget changed between tokens); what a
    /// smaller one evicts is freed, not kept as spare read buffers, and remembered so that
    /// reading it again counts as re-read. A larger one is refilled from the profile's hottest
    /// clusters in the background ([`super::refill`]).
    ///
    /// A layer held whole in runs that loses a cluster gives the runs up, its clusters still
    /// cached read again into entries of their own ([`Core::unpack_runs`]).
    pub(super) fn set_cache_capacity(&mut self, bytes: u64) -> Result<()> {
        let grows = bytes > self.core.cache.capacity();
        for s in self.core.cache.set_capacity(bytes) {
            self.core.shrunk[s] = true;
        }
        self.core.cache.drain_evicted().for_each(drop);
        for l in 0..self.core.runs.len() {
            let cache = &self.core.cache;
            let clusters = self.core.plans[l].clusters.len() as u32;
            if self.core.runs[l].is_some() && (0..clusters).any(|c| !cache.contains((l as u32, c)))
            {
                self.core
                    .unpack_runs(l)
                    .with_context(|| format!("reading layer {l}'s bundles for the new budget"))?;
            }
        }
        if grows && self.core.mapping.is_none() {
            let order = super::schedule::hot_order(&self.core);
            self.refill = Some(Refill::new(order.into_iter().map(|(_, k)| k).collect()));
        }
        Ok(())
    }

    pub(super) fn mapping(&self) -> Option<&Mapping> {
        self.core.mapping.as_ref()
    }

    /// Loads the policy's start-up cache contents.
    pub(super) fn warm(&mut self) -> Result<()> {
        self.schedule.warm(&mut self.core)
    }

    /// Whether forward calls must go one token at a time: a trace was recorded that way, and only
    /// the same computation reproduces it bit for bit.
    pub(super) fn decode_only(&self) -> bool {
        self.truth.is_some()
    }

    /// Starts recording the true active sets (see [`ActiveTrace::record`]).
    pub(super) fn start_recording(&mut self) {
        self.recording = Some(Vec::new());
    }

    pub(super) fn take_recording(&mut self) -> Vec<Vec<u32>> {
        self.recording.take().unwrap_or_default()
    }

    /// A forward call of `tokens` at positions `start..`: checked against the trace, if any.
    pub(super) fn begin_call(&mut self, tokens: &[u32], start: usize) -> Result<()> {
        self.core.call_len = tokens.len();
        if let Some(refill) = &mut self.refill {
            if !refill.step(&mut self.core) {
                self.refill = None;
            }
        }
        if let Some(trace) = &self.truth {
            for (r, &tok) in tokens.iter().enumerate() {
                trace.check(self.call_token + r, tok, start + r)?;
            }
        }
        Ok(())
    }

    pub(super) fn end_call(&mut self, tokens: usize) {
        self.call_token += tokens;
    }

    /// What layer `l` of `token` needs, from its FFN input `x` (its q8 form, `operand`), into
    /// `sel`'s buffers.
    fn select(
        &mut self,
        l: usize,
        token: usize,
        x: &[f32],
        operand: &Operand,
        sel: &mut Selection,
    ) -> Result<()> {
        let start = Instant::now();
        let plan = &self.core.plans[l];
        let n = plan.cluster_of.len();
        // The own predictor's set: the candidates in predicted mode, a measured signal otherwise.
        sel.has_own = match (&plan.own, plan.own_on_flash) {
            (Some(p), _) => {
                p.scores_into(x, &mut sel.own_input, &mut sel.own_scores);
                above_into(&sel.own_scores, p.threshold, &mut sel.own);
                true
            }
            (None, Some(extent))
                if self.core.sparsity == Sparsity::Certified
                    && self.core.call_len == 1
                    && token.is_multiple_of(OWN_SAMPLE) =>
            {
                // Read now, scored once the layer is computed: the metric does not hold it up.
                sel.own_read = Some((read_predictor(&self.core.io, extent, URGENT), extent));
                false
            }
            (None, _) => false,
        };
        let candidate = &mut sel.candidate;
        candidate.clear();
        let known = self.schedule.needs(&mut self.core, l, token, candidate)?;
        let plan = &self.core.plans[l];
        match (known, self.core.sparsity) {
            (true, _) => debug_assert_eq!(candidate.len(), n),
            (false, Sparsity::Exact | Sparsity::Dense) => candidate.resize(n, true),
            (false, Sparsity::Certified) => match &plan.certificate {
                Some(c) => {
                    let cache = &self.core.cache;
                    let cached = |ci: usize| cache.contains((l as u32, ci as u32));
                    c.candidates(
                        &plan.clusters,
                        operand,
                        !plan.block_bundles(),
                        cached,
                        candidate,
                    )
                }
                // Every uncached cluster is read; the exact scores in its bundles decide.
                None => candidate.resize(n, true),
            },
            (false, Sparsity::Predicted) => {
                assert!(sel.has_own, "computed in predicted mode");
                candidate.extend_from_slice(&sel.own);
            }
            (false, Sparsity::Refine { keep_permille }) => {
                let sketch = plan
                    .refine_sketch
                    .as_ref()
                    .expect("built when the model opened in refine mode");
                sketch.candidates(x, keep_permille as f32 / 1000.0, &mut sel.refine, candidate);
                let m = &mut self.core.metrics;
                m.refine_scored += n as u64;
                m.refine_skipped += candidate.iter().filter(|&&c| !c).count() as u64;
            }
        }
        let clusters = plan.clusters.len();
        sel.needed.clear();
        sel.needed.extend((0..clusters).filter(|&ci| {
            let cl = plan.clusters[ci];
            sel.candidate[cl.first..cl.first + cl.count].contains(&true)
        }));
        if let (false, Sparsity::Refine { .. }) = (known, self.core.sparsity) {
            let m = &mut self.core.metrics;
            m.refine_skipped_bytes += plan.clusters.iter().map(|c| c.size).sum::<u64>();
            for &ci in &sel.needed {
                m.refine_skipped_bytes -= plan.clusters[ci].size;
            }
        }
        // What was in memory when the layer's input was ready, for the hit figures: of the
        // clusters needed or (with a trace) truly active.
        let in_memory = &mut sel.in_memory;
        in_memory.clear();
        in_memory.resize(clusters, false);
        sel.needed.iter().for_each(|&c| in_memory[c] = true);
        match &self.truth {
            Some(t) => {
                let truth = sel.truth.get_or_insert_with(Vec::new);
                truth.clear();
                truth.extend_from_slice(t.neurons(token, l));
                for &p in truth.iter() {
                    in_memory[plan.cluster_of[p as usize] as usize] = true;
                }
            }
            None => sel.truth = None,
        }
        for (ci, m) in in_memory.iter_mut().enumerate() {
            *m = *m && self.core.in_memory((l as u32, ci as u32));
        }
        self.core.metrics.select_s += start.elapsed().as_secs_f64();
        Ok(())
    }

    /// One token's FFN of layer `l`.
    fn ffn_row(&mut self, l: usize, token: usize, x: &[f32], out: &mut [f32]) -> Result<()> {
        // The FFN input as the kernels see it: its q8 form feeds both the sketch and block bundles.
        let operand = Operand::new(x, QuantType::Q8_0);
        let mut rows = self.select_row(l, token, x, &operand)?;
        let sel = &mut rows[0];
        self.compute(l, &sel.needed, &sel.candidate, &operand, out)?;
        let scores = std::mem::take(&mut self.work.scores);
        let done = self.finish_row(l, token, x, sel, &scores);
        self.work.scores = scores;
        self.rows = rows;
        done
    }

    /// What one token's layer `l` needs ([`StreamEngine::select`]), its reads refined: the
    /// selections taken out of `self.rows` (the first is this row's), for the caller to put back.
    fn select_row(
        &mut self,
        l: usize,
        token: usize,
        x: &[f32],
        operand: &Operand,
    ) -> Result<Vec<Selection>> {
        let mut rows = std::mem::take(&mut self.rows);
        if rows.is_empty() {
            rows.push(Selection::default());
        }
        let sel = &mut rows[0];
        self.select(l, token, x, operand, sel)?;
        let mut is_needed = std::mem::take(&mut self.marks.is_needed);
        is_needed.clear();
        is_needed.resize(self.core.plans[l].clusters.len(), false);
        sel.needed.iter().for_each(|&c| is_needed[c] = true);
        self.core.refine(l, &is_needed, self.schedule.refine());
        self.marks.is_needed = is_needed;
        Ok(rows)
    }

    /// After one token's layer `l` was computed with these exact `scores`: its own predictor
    /// scored where it was read, then [`StreamEngine::retain_and_measure`].
    fn finish_row(
        &mut self,
        l: usize,
        token: usize,
        x: &[f32],
        sel: &mut Selection,
        scores: &[f32],
    ) -> Result<()> {
        if let Some((read, extent)) = sel.own_read.take() {
            let t = Instant::now();
            sel.own = active_from_read(&self.core.io, read, extent, x)?;
            sel.has_own = true;
            self.core.metrics.select_s += t.elapsed().as_secs_f64();
        }
        self.retain_and_measure(l, token, sel, scores)
    }

    /// Computes the needed clusters into `out`: resident ones first, then reads as they land (or
    /// all reads first, if the policy loads then computes), each group's down columns added in
    /// cluster order ([`GROUPS`]). Leaves the exact scores in `self.work.scores`.
    fn compute(
        &mut self,
        l: usize,
        needed: &[usize],
        candidate: &[bool],
        operand: &Operand,
        out: &mut [f32],
    ) -> Result<()> {
        let start = Instant::now();
        let stalled = self.core.metrics.stall_s;
        let skip = self.skip(l);
        let core = &mut self.core;
        let work = &mut self.work;
        let (n, clusters) = (core.plans[l].cluster_of.len(), core.plans[l].clusters.len());
        let h = operand.x.len();
        work.reset(n, clusters, h);
        needed
            .iter()
            .for_each(|&ci| work.lists.stage[ci] = Stage::Waiting);
        let bounds = group_bounds(clusters);
        let mut next: [usize; GROUPS] = std::array::from_fn(|g| bounds[g]);
        let k = RowKernels::best();
        let [found, grouped] = resident_groups(
            core, work, l, k, skip, needed, candidate, operand, &bounds, &mut next,
        )?;
        core.metrics.resident_gates += found;
        core.metrics.grouped_gates += grouped;
        let waiting = |w: &Work, ci: usize| w.lists.stage[ci] == Stage::Waiting;
        if self.schedule.load_then_compute() {
            for &ci in needed {
                if waiting(work, ci) {
                    work.held[ci] = Some(core.take((l as u32, ci as u32))?);
                }
            }
        }
        // A cluster whose bytes came: its gates now, its down columns when its group gets to it.
        let landed =
            |core: &Core, work: &mut Work, next: &mut [usize; GROUPS], ci, buf: AlignedBuf| {
                let ops = ClusterOps::new(&core.plans[l], k, skip, ci, &buf)?;
                ops.gates(candidate, operand, &mut work.scores, &mut work.lists)?;
                work.held[ci] = Some(buf);
                let g = group_of(&bounds, ci);
                advance(core, work, l, k, skip, g, &bounds, &mut next[g]);
                anyhow::Ok(())
            };
        // Reads held (loaded first) in cluster order, then the others in the order they complete:
        // the groups make the sum independent of it.
        let mut missing = std::mem::take(&mut work.missing);
        missing.clear();
        for &ci in needed {
            if !waiting(work, ci) {
                continue;
            }
            match work.held[ci].take() {
                Some(buf) => landed(core, work, &mut next, ci, buf)?,
                None => missing.push(ci),
            }
        }
        if !missing.is_empty() {
            core.watch(l, &missing);
            for _ in 0..missing.len() {
                let (ci, buf) = core.take_watched(l)?;
                if core.has_room(core.io_budget / TOP_UP_SHARE) {
                    self.schedule.taken(core);
                }
                landed(core, work, &mut next, ci, buf)?;
            }
        }
        work.missing = missing;
        debug_assert!((0..GROUPS).all(|g| next[g] == bounds[g + 1]));
        for a in work.acc.chunks_exact(h) {
            out.iter_mut().zip(a).for_each(|(o, a)| *o += a);
        }
        // Every down column is added: the reads may go to the cache (which may evict clusters
        // of this layer now).
        for &ci in needed {
            if let Some(buf) = work.held[ci].take() {
                core.offer((l as u32, ci as u32), Bytes::Read(buf));
            }
        }
        let stall = core.metrics.stall_s - stalled;
        core.metrics.compute_s += start.elapsed().as_secs_f64() - stall;
        Ok(())
    }

    /// How neurons are chosen.
    #[cfg(feature = "gpu")]
    pub(crate) fn sparsity(&self) -> Sparsity {
        self.core.sparsity
    }

    /// Layer `l`'s bundles for the GPU ([`crate::gpu::GpuBundles`]): each part's rows of every
    /// neuron end to end in stored order, copied from the resident clusters as stored, and the
    /// layer's skip rule as this engine applies it. An error when a cluster is not in memory.
    #[cfg(feature = "gpu")]
    pub(crate) fn bundle_parts(&self, l: usize) -> Result<crate::gpu::BundleParts> {
        let plan = &self.core.plans[l];
        let layout = plan.layout;
        let neurons = plan.cluster_of.len();
        let rb = layout.row_bytes();
        let mut parts = rb.map(|b| Vec::with_capacity(neurons * b));
        let mut scratch = Vec::new();
        for (ci, cl) in plan.clusters.iter().enumerate() {
            let rows = self
                .core
                .resident_into((l as u32, ci as u32), &mut scratch)
                .with_context(|| format!("layer {l}'s cluster {ci} is not in memory"))??;
            for k in 0..cl.count {
                use crate::kernels::bundles::NeuronRows;
                parts[0].extend_from_slice(rows.gate(k));
                parts[1].extend_from_slice(rows.up(k));
                parts[2].extend_from_slice(rows.down(k));
            }
        }
        Ok(crate::gpu::BundleParts {
            qtypes: layout.qtypes,
            neurons,
            hidden: layout.hidden,
            parts,
            skip: self.skip(l),
        })
    }

    /// Each layer's encodings, clusters and skip rule, for the GPU's neuron pool
    /// ([`crate::gpu::GpuBundles::upload_streamed`]).
    #[cfg(feature = "gpu")]
    pub(crate) fn pool_layers(&self) -> Vec<(crate::gpu::PoolLayer, Skip)> {
        (0..self.core.plans.len())
            .map(|l| {
                let plan = &self.core.plans[l];
                let clusters = plan
                    .clusters
                    .iter()
                    .map(|c| (c.first as u32, c.count as u32))
                    .collect();
                let layer = crate::gpu::PoolLayer {
                    qtypes: plan.layout.qtypes,
                    clusters,
                };
                (layer, self.skip(l))
            })
            .collect()
    }

    /// Clusters the GPU's neuron pool holds: a layer's clusters (any of them may be needed at
    /// once) and as many more as the neuron cache holds with `more` bytes, so that the pool keeps
    /// about what the cache keeps (in clusters of the largest layer's mean size); never more than
    /// the model has.
    #[cfg(feature = "gpu")]
    pub(crate) fn pool_slots(&self, more: u64) -> usize {
        let plans = &self.core.plans;
        let most = plans.iter().map(|p| p.clusters.len()).max().unwrap_or(0);
        let layer_bytes = plans
            .iter()
            .map(|p| p.clusters.iter().map(|c| c.size).sum::<u64>())
            .max()
            .unwrap_or(0);
        let total = plans.iter().map(|p| p.clusters.len()).sum::<usize>();
        let per_cluster = (layer_bytes / most.max(1) as u64).max(1);
        let cache = self.core.cache.capacity() + more;
        (most + (cache / per_cluster) as usize).min(total)
    }

    /// The skip rule of layer `l`'s neurons: none skipped in dense mode.
    fn skip(&self, l: usize) -> Skip {
        let skip = self.core.plans[l].skip;
        match self.core.sparsity {
            Sparsity::Dense => Skip {
                threshold: f32::NEG_INFINITY,
                ..skip
            },
            _ => skip,
        }
    }

    /// Tells the cache what was used, the policy what happened, and the metrics how it went.
    fn retain_and_measure(
        &mut self,
        l: usize,
        token: usize,
        sel: &Selection,
        scores: &[f32],
    ) -> Result<()> {
        let (needed, in_memory) = (&sel.needed, &sel.in_memory);
        let own = sel.has_own.then_some(&sel.own[..]);
        let plan = &self.core.plans[l];
        let marks = &mut self.marks;
        marks.computed.clear();
        marks
            .computed
            .extend(scores.iter().map(|&s| !s.is_nan() && plan.skip.active(s)));
        let computed = &marks.computed;
        marks.used.clear();
        // What an uncached cluster costs is a read whenever it is needed: a layer that needs every
        // cluster values them all alike (so the cache keeps what it has rather than trading
        // clusters it would read back on the next token); elsewhere activity ranks them.
        let every = self.core.needs_every_cluster(l);
        for &ci in needed {
            let cl = plan.clusters[ci];
            let active = computed[cl.first..cl.first + cl.count].contains(&true);
            if active {
                marks.used.push(ci);
            }
            self.core
                .cache
                .observe((l as u32, ci as u32), active || every);
        }
        if let Some(rec) = &mut self.recording {
            rec.push(
                (0..computed.len())
                    .filter(|&p| computed[p])
                    .map(|p| p as u32)
                    .collect(),
            );
        }
        // The truth: the trace's when known, else what was computed (complete unless predicted).
        let active = match &sel.truth {
            Some(t) => {
                marks.active.clear();
                marks.active.resize(computed.len(), false);
                t.iter().for_each(|&p| marks.active[p as usize] = true);
                &marks.active
            }
            None => computed,
        };
        let active_clusters = &mut marks.active_clusters;
        active_clusters.clear();
        active_clusters.resize(plan.clusters.len(), false);
        for (p, _) in active.iter().enumerate().filter(|(_, &a)| a) {
            active_clusters[plan.cluster_of[p] as usize] = true;
        }
        let m = &mut self.core.metrics;
        for (ci, _) in active_clusters.iter().enumerate().filter(|(_, &a)| a) {
            m.active_clusters += 1;
            if in_memory[ci] {
                m.active_cluster_hits += 1;
            } else {
                m.active_uncached_bytes += plan.clusters[ci].size;
            }
        }
        let hits = needed.iter().filter(|&&ci| in_memory[ci]).count();
        m.cluster_hits += hits as u64;
        m.cluster_misses += (needed.len() - hits) as u64;
        let lookahead = self.schedule.lookahead_set(l);
        m.record_layer(active, own, lookahead, needed.len(), plan.clusters.len());
        self.schedule
            .end_layer(&mut self.core, l, token, &self.marks.used)
    }
}

impl FfnBackend for StreamEngine {
    fn begin_layer(&mut self, l: usize, residual: &[f32]) -> Result<()> {
        if l == 0 {
            self.core.cache.tick();
        }
        let h = self.core.plans[0].layout.hidden;
        let last = &residual[residual.len() - h..];
        let token = self.call_token + residual.len() / h - 1;
        self.schedule.begin_layer(&mut self.core, l, token, last)
    }

    fn ffn(&mut self, l: usize, x: &[f32], out: &mut [f32]) -> Result<()> {
        if x.len() == self.core.plans[l].layout.hidden {
            self.ffn_row(l, self.call_token, x, out)
        } else {
            self.ffn_chunk(l, x, out)
        }
    }
}

/// The FFN on the GPU from its neuron pool: the layer's neurons chosen here as for the CPU's
/// kernels ([`StreamEngine::select`], the same reads refined), each needed cluster the pool
/// lacks uploaded from memory or from its read as it lands, the layer computed there, and the
/// cache told what was used from the GPU's scores.
#[cfg(feature = "gpu")]
impl crate::gpu::StreamedFfn for StreamEngine {
    fn begin_layer(&mut self, l: usize, residual: &[f32]) -> Result<()> {
        FfnBackend::begin_layer(self, l, residual)
    }

    fn ffn_on_gpu(
        &mut self,
        l: usize,
        x: &[f32],
        gpu: &mut dyn crate::gpu::PoolTarget,
    ) -> Result<()> {
        let token = self.call_token;
        let operand = Operand::new(x, QuantType::Q8_0);
        let mut rows = self.select_row(l, token, x, &operand)?;
        let sel = &mut rows[0];

        let start = Instant::now();
        let stalled = self.core.metrics.stall_s;
        let core = &mut self.core;
        let mut missing = std::mem::take(&mut self.work.missing);
        let mut scratch = std::mem::take(&mut self.work.chunk_rows);
        missing.clear();
        // What is in memory first (uploaded where the pool lacks it), then the reads as they
        // land, each offered to the cache once uploaded.
        for &ci in &sel.needed {
            let key = (l as u32, ci as u32);
            if !core.has_resident(key) {
                missing.push(ci);
            } else if !gpu.holds(key) {
                let rows = core
                    .resident_into(key, &mut scratch)
                    .expect("checked by has_resident")?;
                gpu.upload(key, &rows)?;
            }
        }
        if !missing.is_empty() {
            core.watch(l, &missing);
            for _ in 0..missing.len() {
                let (ci, buf) = core.take_watched(l)?;
                if core.has_room(core.io_budget / TOP_UP_SHARE) {
                    self.schedule.taken(core);
                }
                let key = (l as u32, ci as u32);
                if !gpu.holds(key) {
                    let plan = &core.plans[l];
                    let rows = ClusterRows::new(&plan.layout, &buf, plan.clusters[ci].count)
                        .with_context(|| format!("layer {l}'s cluster {ci}"))?;
                    gpu.upload(key, &rows)?;
                }
                core.offer(key, Bytes::Read(buf));
            }
        }
        self.work.missing = missing;
        self.work.chunk_rows = scratch;
        let scores = gpu.compute(&sel.needed, &sel.candidate)?;
        let stall = self.core.metrics.stall_s - stalled;
        self.core.metrics.compute_s += start.elapsed().as_secs_f64() - stall;
        let done = self.finish_row(l, token, x, sel, scores);
        self.rows = rows;
        done
    }
}
