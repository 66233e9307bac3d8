//! The streaming FFN, shared by every policy: per token and layer,
//! 1. *select* — when layer l's FFN input exists, the sparsity mode names the candidate neurons
//!    (certified: all but those the gate sketch proves inactive; predicted: the layer's own
//!    predictor's set; exact: all), and so the clusters needed — unless the policy knows the
//!    active neurons in advance (the oracle);
//! 2. *refine* — queued reads of the layer that are no longer wanted are cancelled, wanted ones
//!    boosted, missing ones issued at top priority (each policy says which of these it does);
//! 3. *compute* — resident clusters first, then clusters as their reads land (or, for a policy
//!    that loads then computes, once all have landed); the exact gate in each bundle decides, so
//!    a speculated-but-inactive neuron costs a read, never a wrong value;
//! 4. *retain* — the cache is told which clusters were actually used, and how strongly.
//!
//! What is read ahead, what is pinned and what the cache keeps are the policy's decisions
//! ([`Schedule`]); this file only carries them out and measures.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use leanstream_format::file::check_extent;
use leanstream_format::quant::QuantType;
use leanstream_format::FormatError;

use crate::config::Activation;
use crate::kernels::bundles::ffn_bundles;
use crate::kernels::Operand;
use crate::model::FfnBackend;
use crate::neuron_cache::{ClusterKey, NeuronCache};
use crate::storage::{AlignedBuf, IoQueue, SpareBuffers, Ticket};

use super::metrics::Metrics;
use super::mmap::Mapping;
use super::plan::LayerPlan;
use super::predict::{above, active_from_flash};
use super::schedule::Schedule;
use super::trace::ActiveTrace;

/// How neurons are chosen for computation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sparsity {
    /// Skip only neurons the gate sketch proves inactive: output equals `resident`.
    Certified,
    /// Skip what the layer's own predictor calls inactive (approximate, like prior systems).
    Predicted,
    /// Compute every neuron's exact gate (the `resident` policy: all bundles in DRAM).
    Exact,
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

/// What a policy may do to the layer's queued reads once its needed clusters are known.
#[derive(Debug, Clone, Copy)]
pub(super) struct Refine {
    /// Raise reads of needed clusters to top priority.
    pub boost: bool,
    /// Withdraw not-yet-issued reads of clusters not needed.
    pub cancel: bool,
    /// Hand completed reads of clusters not needed to the cache (they belong to this token).
    pub reap: bool,
}

/// The state every policy works on: the layers' plans, the read queue, the cache, the reads in
/// flight and the counters.
pub(super) struct Core {
    pub plans: Vec<LayerPlan>,
    /// Shared with the dense weights' stream ([`super::dense_stream`]): one queue per device.
    pub io: Arc<IoQueue>,
    pub cache: NeuronCache<Bytes>,
    /// The file mapped into memory (`mmap` policy): every cluster is addressable, the OS pages.
    pub mapping: Option<Mapping>,
    pending: HashMap<ClusterKey, (Ticket, u64)>,
    /// Bytes of reads in flight; reads ahead stop at `io_budget`.
    in_flight: u64,
    pub io_budget: u64,
    /// Read buffers done with (up to `io_budget` bytes), for the next reads of their size.
    spare: SpareBuffers,
    pub metrics: Metrics,
}

impl Core {
    pub fn is_pending(&self, key: ClusterKey) -> bool {
        self.pending.contains_key(&key)
    }

    /// Whether a read ahead of `size` bytes fits the I/O budget now.
    pub fn has_room(&self, size: u64) -> bool {
        self.in_flight + size <= self.io_budget
    }

    /// Queues a read of cluster `key` unless it is cached or already queued; true if queued.
    pub fn request(&mut self, key: ClusterKey, priority: u32) -> bool {
        self.request_all(&[(key, priority)]) == 1
    }

    /// Queues reads of the clusters not cached or queued yet, in one submission (one lock and
    /// one wake-up of the read queue for all); returns how many were queued.
    pub fn request_all(&mut self, wanted: &[(ClusterKey, u32)]) -> usize {
        let mut reads = Vec::with_capacity(wanted.len());
        let mut keys = Vec::with_capacity(wanted.len());
        for &(key, priority) in wanted {
            if self.cache.contains(key) || self.pending.contains_key(&key) || keys.contains(&key) {
                continue;
            }
            let cl = self.plans[key.0 as usize].clusters[key.1 as usize];
            let buf = self.spare.take(cl.size as usize);
            reads.push((buf, cl.offset, priority));
            keys.push(key);
        }
        let tickets = self.io.submit_batch_into(reads);
        for (key, ticket) in keys.iter().zip(tickets) {
            let size = self.plans[key.0 as usize].clusters[key.1 as usize].size;
            self.pending.insert(*key, (ticket, size));
            self.in_flight += size;
        }
        keys.len()
    }

    /// Offers a cluster just read to the cache; what the cache declines or evicts is recycled.
    pub fn offer(&mut self, key: ClusterKey, bytes: Bytes) -> bool {
        let declined = self.cache.offer(key, bytes);
        let kept = declined.is_none();
        for b in declined.into_iter().chain(self.cache.take_evicted()) {
            if let Bytes::Read(buf) = b {
                self.spare.give(buf);
            }
        }
        kept
    }

    /// Reads a cluster now (warming the cache at start-up), checking its checksum.
    pub fn read_now(&self, key: ClusterKey) -> Result<Bytes> {
        let (l, c) = (key.0 as usize, key.1 as usize);
        let cl = self.plans[l].clusters[c];
        let buf = self
            .io
            .wait(self.io.submit(cl.offset, cl.size as usize, URGENT))?;
        self.check_cluster(l, c, &buf)?;
        Ok(Bytes::Read(buf))
    }

    /// Checks a cluster read against its checksum; the error names the file, layer and cluster.
    fn check_cluster(&self, l: usize, c: usize, bytes: &[u8]) -> Result<(), FormatError> {
        let cl = self.plans[l].clusters[c];
        check_extent(bytes, cl.checksum, || {
            format!(
                "{}: layer {l} cluster {c} (offset {})",
                self.io.device().name(),
                cl.offset
            )
        })
    }

    /// Takes a queued read's buffer, waiting for it, and checks it; the time counts as stalled.
    fn take(&mut self, key: ClusterKey) -> Result<AlignedBuf> {
        let start = Instant::now();
        let (ticket, size) = self.pending.remove(&key).expect("queued");
        self.in_flight -= size;
        let (l, c) = (key.0 as usize, key.1 as usize);
        let buf = self
            .io
            .wait(ticket)
            .with_context(|| format!("reading layer {l} cluster {c}"))?;
        self.check_cluster(l, c, &buf)?;
        self.metrics.stall_s += start.elapsed().as_secs_f64();
        Ok(buf)
    }

    /// The bytes of a cluster that need no read: cached, or in the mapping.
    fn resident(&self, key: ClusterKey) -> Option<&[u8]> {
        self.cache.get(key).or_else(|| {
            let cl = &self.plans[key.0 as usize].clusters[key.1 as usize];
            self.mapping.as_ref().map(|m| m.cluster(cl))
        })
    }

    /// Whether a cluster is in memory now: cached, or (mapping) its pages are in the page cache.
    fn in_memory(&self, key: ClusterKey) -> bool {
        self.cache.contains(key)
            || self.mapping.as_ref().is_some_and(|m| {
                m.is_resident(&self.plans[key.0 as usize].clusters[key.1 as usize])
            })
    }

    /// Carries out the policy's refinement of layer `l`'s queued reads; issues the needed reads
    /// that nobody requested (late reads).
    fn refine(&mut self, l: usize, is_needed: &[bool], how: Refine) {
        let keys: Vec<ClusterKey> = self
            .pending
            .keys()
            .copied()
            .filter(|k| k.0 == l as u32)
            .collect();
        for key in keys {
            let (ticket, size) = self.pending[&key];
            if is_needed[key.1 as usize] {
                if how.boost {
                    self.io.boost(ticket, URGENT);
                }
            } else if how.cancel && self.io.cancel(ticket) {
                self.pending.remove(&key);
                self.in_flight -= size;
                self.metrics.cancelled_reads += 1;
            } else if how.reap {
                if let Some(done) = self.io.poll(ticket) {
                    // Read already, though not needed now: the cache may keep it; either way its
                    // buffer is released here rather than held by the queue.
                    self.pending.remove(&key);
                    self.in_flight -= size;
                    self.metrics.wasted_reads += 1;
                    if let Ok(buf) = done {
                        if self.check_cluster(l, key.1 as usize, &buf).is_ok() {
                            self.offer(key, Bytes::Read(buf));
                        }
                    }
                }
            }
        }
        if self.mapping.is_none() {
            let late: Vec<(ClusterKey, u32)> = (0..is_needed.len())
                .filter(|&ci| is_needed[ci])
                .map(|ci| ((l as u32, ci as u32), URGENT))
                .collect();
            self.metrics.late_reads += self.request_all(&late) as u64;
        }
    }
}

/// What one token's layer needs, decided once its FFN input exists.
struct Selection<'x> {
    operand: Operand<'x>,
    /// The layer's own predictor's set, where it ran (see [`OWN_SAMPLE`]).
    own: Option<Vec<bool>>,
    /// Neurons to compute.
    candidate: Vec<bool>,
    /// Clusters holding a candidate, ascending.
    needed: Vec<usize>,
    /// The true active neurons, when a trace is known.
    truth: Option<Vec<u32>>,
    /// Per cluster: listed (needed or truly active) and in memory when the input was ready.
    in_memory: Vec<bool>,
}

pub struct StreamEngine {
    core: Core,
    schedule: Box<dyn Schedule>,
    act: Activation,
    sparsity: Sparsity,
    /// Index of the first token of the current forward call, counted since the engine started.
    call_token: usize,
    /// Tokens in the current forward call (1 while decoding).
    call_len: usize,
    /// The true active sets of the tokens to come, when known (the bench records them): the
    /// truth the metrics use, and the oracle's knowledge.
    truth: Option<Arc<ActiveTrace>>,
    /// Per (token, layer) in order: the active stored positions, while recording a trace.
    recording: Option<Vec<Vec<u32>>>,
}

impl StreamEngine {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        plans: Vec<LayerPlan>,
        act: Activation,
        sparsity: Sparsity,
        io: Arc<IoQueue>,
        cache: NeuronCache<Bytes>,
        mapping: Option<Mapping>,
        io_budget: u64,
        schedule: Box<dyn Schedule>,
        truth: Option<Arc<ActiveTrace>>,
    ) -> Self {
        Self {
            core: Core {
                plans,
                io,
                cache,
                mapping,
                pending: HashMap::new(),
                in_flight: 0,
                io_budget,
                spare: SpareBuffers::new(io_budget as usize),
                metrics: Metrics::default(),
            },
            schedule,
            act,
            sparsity,
            call_token: 0,
            call_len: 0,
            truth,
            recording: None,
        }
    }

    pub fn io(&self) -> &IoQueue {
        &self.core.io
    }

    pub fn metrics(&self) -> &Metrics {
        &self.core.metrics
    }

    pub fn reset_metrics(&mut self) {
        self.core.metrics = Metrics::default();
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
        self.call_len = tokens.len();
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

    /// What layer `l` of `token` needs, from its FFN input `x`.
    fn select<'x>(&mut self, l: usize, token: usize, x: &'x [f32]) -> Result<Selection<'x>> {
        let start = Instant::now();
        let plan = &self.core.plans[l];
        let n = plan.cluster_of.len();
        // The FFN input as the kernels see it: its q8 form feeds both the sketch and block bundles.
        let operand = Operand::new(x, QuantType::Q8_0);
        // The own predictor's set: the candidates in predicted mode, a measured signal otherwise.
        let own = match (&plan.own, plan.own_on_flash) {
            (Some(p), _) => Some(above(&p.scores(x), p.threshold)),
            (None, Some(extent))
                if self.sparsity == Sparsity::Certified
                    && self.call_len == 1
                    && token.is_multiple_of(OWN_SAMPLE) =>
            {
                Some(active_from_flash(&self.core.io, extent, URGENT, x)?)
            }
            (None, _) => None,
        };
        let known = self.schedule.needs(&mut self.core, l, token)?;
        let plan = &self.core.plans[l];
        let candidate: Vec<bool> = match (known, self.sparsity) {
            (Some(neurons), _) => {
                let mut c = vec![false; n];
                neurons.iter().for_each(|&p| c[p as usize] = true);
                c
            }
            (None, Sparsity::Exact) => vec![true; n],
            (None, Sparsity::Certified) => certified_candidates(plan, &operand),
            (None, Sparsity::Predicted) => own.clone().expect("computed in predicted mode"),
        };
        let needed: Vec<usize> = (0..plan.clusters.len())
            .filter(|&ci| {
                let cl = plan.clusters[ci];
                candidate[cl.first..cl.first + cl.count].contains(&true)
            })
            .collect();
        // What was in memory when the layer's input was ready, for the hit figures.
        let truth = self.truth.as_ref().map(|t| t.neurons(token, l).to_vec());
        let mut listed = vec![false; plan.clusters.len()];
        needed.iter().for_each(|&c| listed[c] = true);
        for &p in truth.iter().flatten() {
            listed[plan.cluster_of[p as usize] as usize] = true;
        }
        let in_memory: Vec<bool> = (0..listed.len())
            .map(|ci| listed[ci] && self.core.in_memory((l as u32, ci as u32)))
            .collect();
        self.core.metrics.select_s += start.elapsed().as_secs_f64();
        Ok(Selection {
            operand,
            own,
            candidate,
            needed,
            truth,
            in_memory,
        })
    }

    /// One token's FFN of layer `l`.
    fn ffn_row(&mut self, l: usize, token: usize, x: &[f32], out: &mut [f32]) -> Result<()> {
        let sel = self.select(l, token, x)?;
        let mut is_needed = vec![false; self.core.plans[l].clusters.len()];
        sel.needed.iter().for_each(|&c| is_needed[c] = true);
        self.core.refine(l, &is_needed, self.schedule.refine());
        let (partial, gates) = self.compute(l, &sel.needed, &sel.candidate, &sel.operand)?;
        let h = x.len();
        for part in partial.chunks_exact(h) {
            out.iter_mut().zip(part).for_each(|(o, p)| *o += p);
        }
        self.retain_and_measure(l, token, &sel, &gates)
    }

    /// A prompt chunk's FFN of layer `l` (`x` holds one row per token): every cluster any row
    /// needs is read once for the chunk — all requested at once, so that neighbours merge into
    /// long sequential reads — and each is computed for the rows that need it. Each row still
    /// adds its clusters in cluster order, so every row's output is bitwise what decoding that
    /// token alone gives.
    fn ffn_chunk(&mut self, l: usize, x: &[f32], out: &mut [f32]) -> Result<()> {
        let h = self.core.plans[l].layout.hidden;
        let first = self.call_token;
        let mut selections = Vec::with_capacity(x.len() / h);
        for (r, xr) in x.chunks_exact(h).enumerate() {
            selections.push(self.select(l, first + r, xr)?);
        }
        let clusters = self.core.plans[l].clusters.len();
        let mut is_needed = vec![false; clusters];
        for sel in &selections {
            sel.needed.iter().for_each(|&c| is_needed[c] = true);
        }
        self.core.refine(l, &is_needed, self.schedule.refine());
        let n = self.core.plans[l].cluster_of.len();
        let mut gates = vec![vec![f32::NAN; n]; selections.len()];
        let mut part = vec![0.0f32; h];
        let act = self.act;
        for ci in (0..clusters).filter(|&ci| is_needed[ci]) {
            let key = (l as u32, ci as u32);
            let read = match self.core.resident(key) {
                Some(_) => None,
                None => Some(self.core.take(key)?),
            };
            let core = &self.core;
            let bytes = match &read {
                Some(buf) => &buf[..],
                None => core.resident(key).expect("resident"),
            };
            let t = Instant::now();
            for (r, sel) in selections.iter().enumerate() {
                if sel.needed.binary_search(&ci).is_err() {
                    continue;
                }
                part.fill(0.0);
                let plan = &core.plans[l];
                compute_cluster(
                    plan,
                    act,
                    ci,
                    bytes,
                    &sel.candidate,
                    &sel.operand,
                    &mut part,
                    &mut gates[r],
                )?;
                let row = &mut out[r * h..(r + 1) * h];
                row.iter_mut().zip(&part).for_each(|(o, p)| *o += p);
            }
            self.core.metrics.compute_s += t.elapsed().as_secs_f64();
            if let Some(buf) = read {
                self.core.offer(key, Bytes::Read(buf));
            }
        }
        for (r, (sel, g)) in selections.iter().zip(&gates).enumerate() {
            self.retain_and_measure(l, first + r, sel, g)?;
        }
        Ok(())
    }

    /// Computes the needed clusters: resident ones first, then reads as they land (or all reads
    /// first, if the policy loads then computes). Each cluster sums into its own buffer, added in
    /// cluster order by the caller, so the result does not depend on what happened to be resident:
    /// certified output is bitwise the resident policy's. Returns the buffers and the exact gates.
    fn compute(
        &mut self,
        l: usize,
        needed: &[usize],
        candidate: &[bool],
        operand: &Operand,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let core = &mut self.core;
        let plan_n = core.plans[l].cluster_of.len();
        let h = operand.x.len();
        let mut gates = vec![f32::NAN; plan_n];
        let mut partial = vec![0.0f32; needed.len() * h];
        let (resident, missing): (Vec<usize>, Vec<usize>) =
            (0..needed.len()).partition(|&i| core.resident((l as u32, needed[i] as u32)).is_some());
        let act = self.act;
        let compute_start = Instant::now();
        for &i in &resident {
            let ci = needed[i];
            let bytes = core.resident((l as u32, ci as u32)).expect("resident");
            let part = &mut partial[i * h..(i + 1) * h];
            compute_cluster(
                &core.plans[l],
                act,
                ci,
                bytes,
                candidate,
                operand,
                part,
                &mut gates,
            )?;
        }
        let mut compute_s = compute_start.elapsed().as_secs_f64();
        let mut landed: Vec<(usize, AlignedBuf)> = Vec::new();
        let load_first = self.schedule.load_then_compute();
        for &i in &missing {
            let key = (l as u32, needed[i] as u32);
            landed.push((i, core.take(key)?));
            if load_first && landed.len() < missing.len() {
                continue;
            }
            for (i, buf) in landed.drain(..) {
                let ci = needed[i];
                let t = Instant::now();
                let part = &mut partial[i * h..(i + 1) * h];
                compute_cluster(
                    &core.plans[l],
                    act,
                    ci,
                    &buf,
                    candidate,
                    operand,
                    part,
                    &mut gates,
                )?;
                compute_s += t.elapsed().as_secs_f64();
                // A cluster the cache declines goes back to the spare buffers.
                core.offer((l as u32, ci as u32), Bytes::Read(buf));
            }
        }
        core.metrics.compute_s += compute_s;
        Ok((partial, gates))
    }

    /// Tells the cache what was used, the policy what happened, and the metrics how it went.
    fn retain_and_measure(
        &mut self,
        l: usize,
        token: usize,
        sel: &Selection,
        gates: &[f32],
    ) -> Result<()> {
        let (needed, own, in_memory) = (&sel.needed, &sel.own, &sel.in_memory);
        let plan = &self.core.plans[l];
        let threshold = plan.threshold;
        let act = self.act;
        let computed: Vec<bool> = gates
            .iter()
            .map(|&g| !g.is_nan() && act.apply(g).abs() > threshold)
            .collect();
        let mut used = Vec::new();
        for &ci in needed {
            let cl = plan.clusters[ci];
            let active = computed[cl.first..cl.first + cl.count].contains(&true);
            if active {
                used.push(ci);
            }
            self.core.cache.observe((l as u32, ci as u32), active);
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
                let mut a = vec![false; computed.len()];
                t.iter().for_each(|&p| a[p as usize] = true);
                a
            }
            None => computed,
        };
        let plan = &self.core.plans[l];
        let mut active_clusters = vec![false; plan.clusters.len()];
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
        let m = &mut self.core.metrics;
        m.record_layer(
            &active,
            own.as_deref(),
            lookahead.as_deref(),
            needed.len(),
            plan.clusters.len(),
        );
        self.schedule.end_layer(&mut self.core, l, token, &used)
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

/// Computes the candidate neurons of one cluster from its bundles; writes their exact gates.
#[allow(clippy::too_many_arguments)]
fn compute_cluster(
    plan: &LayerPlan,
    act: Activation,
    ci: usize,
    bytes: &[u8],
    candidate: &[bool],
    x: &Operand,
    out: &mut [f32],
    gates: &mut [f32],
) -> Result<()> {
    let cl = plan.clusters[ci];
    let bb = plan.layout.bundle_bytes();
    if bytes.len() < cl.count * bb {
        bail!(
            "cluster {ci} holds {} bytes, its {} bundles need {}",
            bytes.len(),
            cl.count,
            cl.count * bb
        );
    }
    let mut slices = Vec::with_capacity(cl.count);
    let mut positions = Vec::with_capacity(cl.count);
    for k in 0..cl.count {
        if candidate[cl.first + k] {
            slices.push(&bytes[k * bb..(k + 1) * bb]);
            positions.push(cl.first + k);
        }
    }
    let mut g = vec![0.0f32; slices.len()];
    ffn_bundles(&plan.layout, x, &slices, act, plan.threshold, out, &mut g)?;
    for (p, v) in positions.into_iter().zip(g) {
        gates[p] = v;
    }
    Ok(())
}

/// Neurons the sketch cannot prove inactive. The exact gate is `w·x̃` (x̃ the q8 input for block
/// bundles, x for float ones); the sketch gives `ŝ·x̃` and `|w − ŝ| ≤ e`, so
/// `|w·x̃ − ŝ·x̃| ≤ e‖x̃‖`, plus `(‖ŝ‖ + e)‖x − x̃‖` for float bundles, plus a float-rounding slack.
fn certified_candidates(plan: &LayerPlan, x: &Operand) -> Vec<bool> {
    let n = plan.cluster_of.len();
    let mut g = vec![0.0f32; n];
    plan.sketch.matvec(x, &mut g);
    let q8 = x.q8();
    let h = x.x.len();
    let (mut xq2, mut d2) = (0.0f64, 0.0f64);
    for i in 0..h {
        let v = q8.value(i) as f64;
        xq2 += v * v;
        d2 += (v - x.x[i] as f64).powi(2);
    }
    let (xq, dx) = (xq2.sqrt() as f32, d2.sqrt() as f32);
    let float_bundles = !plan.block_bundles();
    let slack = 4.0 * h as f32 * f32::EPSILON;
    let norm = xq.max(x_norm(x.x));
    (0..n)
        .map(|p| {
            let (e, s) = (plan.sketch_err[p], plan.sketch_norm[p]);
            let w = s + e;
            let mut beta = e * xq + slack * w * norm;
            if float_bundles {
                beta += w * dx;
            }
            !plan.skip.contains(g[p] - beta, g[p] + beta)
        })
        .collect()
}

fn x_norm(x: &[f32]) -> f32 {
    x.iter().map(|v| v * v).sum::<f32>().sqrt()
}
