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

use std::ops::Deref;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};
use leanstream_format::file::check_extent;
use leanstream_format::quant::QuantType;
use leanstream_format::FormatError;

use crate::kernels::bundles::{down_pass, gate_pass, ClusterRows, PARALLEL_MIN_BYTES};
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
use super::schedule::{Schedule, TOP_UP_SHARE};
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

/// Where a cluster of the layer being computed stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Not needed by this token.
    Skipped,
    /// Needed; its bytes are not here yet.
    Waiting,
    /// Gates computed, active neurons known; down columns not added yet.
    Gated,
    /// Added to its group's sum.
    Added,
}

/// One layer's working state, grown to the largest layer once and reused by every token and
/// layer, so that the token loop does not allocate it.
#[derive(Default)]
struct Work {
    /// Exact skip scores of the layer's neurons (NaN: not computed).
    scores: Vec<f32>,
    lists: Lists,
    /// Reads that landed, held until their down columns are added, then offered to the cache.
    held: Vec<Option<AlignedBuf>>,
    /// The groups' partial sums, `GROUPS × hidden`.
    acc: Vec<f32>,
    /// Scratch of `compute`: the needed clusters whose bytes have not come yet.
    missing: Vec<usize>,
    /// Scratch of a prompt chunk: each row's scores (`rows × neurons`) and group sum
    /// (`rows × hidden`).
    chunk_scores: Vec<f32>,
    chunk_acc: Vec<f32>,
}

/// What the gates of a layer's clusters decided.
#[derive(Default)]
struct Lists {
    /// The active neurons of cluster `c` (offsets within it) and their coefficients
    /// `act(g)·(up·x)`, in the slots of its own neurons: `first .. first + n_active[c]`.
    active: Vec<u32>,
    coef: Vec<f32>,
    n_active: Vec<u32>,
    stage: Vec<Stage>,
}

impl Work {
    /// Sized for a layer of `neurons` in `clusters` and `hidden` outputs; scores NaN, sums zero,
    /// every cluster skipped.
    fn reset(&mut self, neurons: usize, clusters: usize, hidden: usize) {
        let lists = &mut self.lists;
        if lists.active.len() < neurons {
            lists.active.resize(neurons, 0);
            lists.coef.resize(neurons, 0.0);
        }
        if lists.stage.len() < clusters {
            lists.n_active.resize(clusters, 0);
            lists.stage.resize(clusters, Stage::Skipped);
            self.held.resize_with(clusters, || None);
        }
        self.scores.clear();
        self.scores.resize(neurons, f32::NAN);
        self.acc.clear();
        self.acc.resize(GROUPS * hidden, 0.0);
        lists.stage[..clusters].fill(Stage::Skipped);
        self.held[..clusters].iter_mut().for_each(|h| *h = None);
    }
}

/// The first cluster of each group of a layer of `clusters`, and the end.
fn group_bounds(clusters: usize) -> [usize; GROUPS + 1] {
    std::array::from_fn(|g| g * clusters / GROUPS)
}

fn group_of(bounds: &[usize; GROUPS + 1], ci: usize) -> usize {
    bounds.partition_point(|&b| b <= ci) - 1
}

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
    /// How the run chooses neurons.
    pub sparsity: Sparsity,
    /// Tokens in the current forward call (1 while decoding, more in a prompt chunk).
    pub call_len: usize,
    /// Shared with the dense weights' stream ([`super::dense_stream`]): one queue per device.
    pub io: Arc<IoQueue>,
    pub cache: NeuronCache<Bytes>,
    /// The file mapped into memory (`mmap` policy): every cluster is addressable, the OS pages.
    pub mapping: Option<Mapping>,
    /// The file's clusters numbered densely, shared with the cache: lookups are indexes.
    slots: ClusterSlots,
    /// The queued read of each cluster (by slot) and its size.
    pending: Vec<Option<(Ticket, u64)>>,
    /// Scratch of [`Core::request_all`]: the slots of its batch (all false between calls).
    in_batch: Vec<bool>,
    /// Per slot: evicted when the budget shrank and not read since ([`Metrics::reread_bytes`]).
    shrunk: Vec<bool>,
    /// Per slot: the queued read refills the cache ([`super::refill`]): refinement leaves it.
    refilling: Vec<bool>,
    /// Scratch of [`Core::refine`]: the late reads.
    late: Vec<(ClusterKey, u32)>,
    /// Scratch of [`Core::request_all`]: the tickets of its batch.
    tickets: Vec<Ticket>,
    /// Scratch of [`Core::request_all`]: the reads of its batch.
    reads: Vec<(AlignedBuf, u64, u32)>,
    /// Bytes of reads in flight; reads ahead stop at `io_budget`.
    in_flight: u64,
    pub io_budget: u64,
    /// Read buffers done with (up to `io_budget` bytes), for the next reads of their size.
    spare: SpareBuffers,
    pub metrics: Metrics,
}

impl Core {
    /// Whether layer `l` needs every cluster whatever its input, so that its uncached clusters are
    /// read on every token: exact modes, and certified layers without a certificate (nothing
    /// proves a neuron inactive before its bundle is read).
    pub fn needs_every_cluster(&self, l: usize) -> bool {
        match self.sparsity {
            Sparsity::Exact | Sparsity::Dense => true,
            Sparsity::Certified => self.plans[l].certificate.is_none(),
            Sparsity::Predicted => false,
        }
    }

    pub fn is_pending(&self, key: ClusterKey) -> bool {
        self.pending[self.slots.of(key)].is_some()
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
        // A key listed twice is queued once: its slot is marked while the batch is formed.
        let mut reads = std::mem::take(&mut self.reads);
        for &(key, priority) in wanted {
            let s = self.slots.of(key);
            if self.cache.contains(key) || self.pending[s].is_some() || self.in_batch[s] {
                continue;
            }
            self.in_batch[s] = true;
            let cl = self.plans[key.0 as usize].clusters[key.1 as usize];
            let buf = self.spare.take(cl.size as usize);
            reads.push((buf, cl.offset, priority));
        }
        if reads.is_empty() {
            self.reads = reads;
            return 0;
        }
        let mut tickets = std::mem::take(&mut self.tickets);
        // Hashed by the thread that moves the bytes (see `check_read`).
        self.io
            .submit_batch_into(reads.drain(..), &mut tickets, true);
        self.reads = reads;
        let n = tickets.len();
        let mut tickets_in_order = tickets.iter();
        for &(key, _) in wanted {
            let s = self.slots.of(key);
            if !self.in_batch[s] {
                continue;
            }
            // Unmarked once queued: a later duplicate in `wanted` is not queued again.
            self.in_batch[s] = false;
            let ticket = *tickets_in_order.next().expect("one ticket per marked key");
            let size = self.plans[key.0 as usize].clusters[key.1 as usize].size;
            self.refilling[s] = false;
            if std::mem::take(&mut self.shrunk[s]) {
                self.metrics.reread_bytes += size;
            }
            self.pending[s] = Some((ticket, size));
            self.in_flight += size;
        }
        self.tickets = tickets;
        n
    }

    /// Queues refill reads ([`super::refill`]): like [`Core::request_all`], but refinement
    /// neither withdraws them nor counts them as wasted.
    pub fn request_refill(&mut self, wanted: &[(ClusterKey, u32)]) {
        self.metrics.refill_reads += self.request_all(wanted) as u64;
        for &(key, _) in wanted {
            let s = self.slots.of(key);
            self.refilling[s] = self.pending[s].is_some();
        }
    }

    /// Bytes of reads in flight.
    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// Offers a cluster just read to the cache; what the cache declines or evicts is recycled.
    pub fn offer(&mut self, key: ClusterKey, bytes: Bytes) -> bool {
        let declined = self.cache.offer(key, bytes);
        let kept = declined.is_none();
        let spare = &mut self.spare;
        for b in declined.into_iter().chain(self.cache.drain_evicted()) {
            if let Bytes::Read(buf) = b {
                spare.give(buf);
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

    /// [`Core::check_cluster`] for a read whose bytes the read queue hashed as it moved them
    /// (`hash`, their XXH3 in the buffer handed over, which nothing writes afterwards): the same
    /// check, every read, without hashing on the computing thread. Without a hash, or when it
    /// differs, the bytes are checked here (and a mismatch named).
    fn check_read(&self, l: usize, c: usize, bytes: &[u8], hash: Option<u64>) -> Result<()> {
        if hash == Some(self.plans[l].clusters[c].checksum) {
            return Ok(());
        }
        Ok(self.check_cluster(l, c, bytes)?)
    }

    /// Takes a queued read's buffer, waiting for it, and checks it; the time counts as stalled.
    fn take(&mut self, key: ClusterKey) -> Result<AlignedBuf> {
        let start = Instant::now();
        let (ticket, size) = self.pending[self.slots.of(key)].take().expect("queued");
        self.in_flight -= size;
        let (l, c) = (key.0 as usize, key.1 as usize);
        let (buf, hash) = self.io.wait_hashed(ticket);
        let buf = buf.with_context(|| format!("reading layer {l} cluster {c}"))?;
        self.check_read(l, c, &buf, hash)?;
        self.metrics.stall_s += start.elapsed().as_secs_f64();
        Ok(buf)
    }

    /// Watches the queued reads of layer `l`'s clusters `cis`, for [`Core::take_watched`].
    fn watch(&mut self, l: usize, cis: &[usize]) {
        let (pending, slots) = (&self.pending, &self.slots);
        self.io.watch_all(cis.iter().map(|&ci| {
            let (ticket, _) = pending[slots.of((l as u32, ci as u32))].expect("queued");
            (ticket, ci as u32)
        }));
    }

    /// Takes the first of the watched reads of layer `l` ([`Core::watch`]) to complete, waiting
    /// for it, and checks it; returns its cluster. O(log n) per read, however many are watched.
    /// The time counts as stalled.
    fn take_watched(&mut self, l: usize) -> Result<(usize, AlignedBuf)> {
        let start = Instant::now();
        let (ci, result, hash) = self.io.wait_watched().expect("a watched read is left");
        let ci = ci as usize;
        let (_, size) = self.pending[self.slots.of((l as u32, ci as u32))]
            .take()
            .expect("queued");
        self.in_flight -= size;
        let buf = result.with_context(|| format!("reading layer {l} cluster {ci}"))?;
        self.check_read(l, ci, &buf, hash)?;
        self.metrics.stall_s += start.elapsed().as_secs_f64();
        Ok((ci, buf))
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
        for (ci, &needed) in is_needed.iter().enumerate() {
            let key = (l as u32, ci as u32);
            let s = self.slots.of(key);
            let Some((ticket, size)) = self.pending[s] else {
                continue;
            };
            if needed {
                if how.boost {
                    self.io.boost(ticket, URGENT);
                }
            } else if how.cancel && !self.refilling[s] && self.io.cancel(ticket) {
                self.pending[s] = None;
                self.in_flight -= size;
                self.metrics.cancelled_reads += 1;
            } else if how.reap {
                if let Some(done) = self.io.poll(ticket) {
                    // Read already, though not needed now: the cache may keep it; either way its
                    // buffer is released here rather than held by the queue.
                    self.pending[s] = None;
                    self.in_flight -= size;
                    if !std::mem::take(&mut self.refilling[s]) {
                        self.metrics.wasted_reads += 1;
                    }
                    if let Ok(buf) = done {
                        if self.check_cluster(l, ci, &buf).is_ok() {
                            self.offer(key, Bytes::Read(buf));
                        }
                    }
                }
            }
        }
        if self.mapping.is_none() {
            let mut late = std::mem::take(&mut self.late);
            late.clear();
            late.extend(
                (0..is_needed.len())
                    .filter(|&ci| is_needed[ci] && !self.cache.contains((l as u32, ci as u32)))
                    .map(|ci| ((l as u32, ci as u32), URGENT)),
            );
            self.metrics.late_reads += self.request_all(&late) as u64;
            self.late = late;
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

    pub fn reset_metrics(&mut self) {
        self.core.metrics = Metrics::default();
    }

    /// Gives the neuron cache a new capacity (the budget changed between tokens); what a
    /// smaller one evicts is freed, not kept as spare read buffers, and remembered so that
    /// reading it again counts as re-read. A larger one is refilled from the profile's hottest
    /// clusters in the background ([`super::refill`]).
    pub(super) fn set_cache_capacity(&mut self, bytes: u64) {
        let grows = bytes > self.core.cache.capacity();
        for s in self.core.cache.set_capacity(bytes) {
            self.core.shrunk[s] = true;
        }
        self.core.cache.drain_evicted().for_each(drop);
        if grows && self.core.mapping.is_none() {
            let order = super::schedule::hot_order(&self.core);
            self.refill = Some(Refill::new(order.into_iter().map(|(_, k)| k).collect()));
        }
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
        }
        let clusters = plan.clusters.len();
        sel.needed.clear();
        sel.needed.extend((0..clusters).filter(|&ci| {
            let cl = plan.clusters[ci];
            sel.candidate[cl.first..cl.first + cl.count].contains(&true)
        }));
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
        let mut rows = std::mem::take(&mut self.rows);
        if rows.is_empty() {
            rows.push(Selection::default());
        }
        let sel = &mut rows[0];
        self.select(l, token, x, &operand, sel)?;
        let mut is_needed = std::mem::take(&mut self.marks.is_needed);
        is_needed.clear();
        is_needed.resize(self.core.plans[l].clusters.len(), false);
        sel.needed.iter().for_each(|&c| is_needed[c] = true);
        self.core.refine(l, &is_needed, self.schedule.refine());
        self.marks.is_needed = is_needed;
        self.compute(l, &sel.needed, &sel.candidate, &operand, out)?;
        if let Some((read, extent)) = sel.own_read.take() {
            let t = Instant::now();
            sel.own = active_from_read(&self.core.io, read, extent, x)?;
            sel.has_own = true;
            self.core.metrics.select_s += t.elapsed().as_secs_f64();
        }
        let scores = std::mem::take(&mut self.work.scores);
        let done = self.retain_and_measure(l, token, sel, &scores);
        self.work.scores = scores;
        self.rows = rows;
        done
    }

    /// A prompt chunk's FFN of layer `l` (`x` holds one row per token): every cluster any row
    /// needs is read once for the chunk — all requested at once, so that neighbours merge into
    /// long sequential reads — and each is computed for the rows that need it. Each row sums its
    /// clusters in the groups decoding uses ([`GROUPS`]), so every row's output is bitwise what
    /// decoding that token alone gives.
    fn ffn_chunk(&mut self, l: usize, x: &[f32], out: &mut [f32]) -> Result<()> {
        let h = self.core.plans[l].layout.hidden;
        let first = self.call_token;
        let n_rows = x.len() / h;
        let operands: Vec<Operand> = x
            .chunks_exact(h)
            .map(|xr| Operand::new(xr, QuantType::Q8_0))
            .collect();
        let mut rows = std::mem::take(&mut self.rows);
        if rows.len() < n_rows {
            rows.resize_with(n_rows, Selection::default);
        }
        for (r, xr) in x.chunks_exact(h).enumerate() {
            self.select(l, first + r, xr, &operands[r], &mut rows[r])?;
        }
        let selections = &rows[..n_rows];
        let clusters = self.core.plans[l].clusters.len();
        let mut is_needed = std::mem::take(&mut self.marks.is_needed);
        is_needed.clear();
        is_needed.resize(clusters, false);
        for sel in selections {
            sel.needed.iter().for_each(|&c| is_needed[c] = true);
        }
        self.core.refine(l, &is_needed, self.schedule.refine());
        let n = self.core.plans[l].cluster_of.len();
        self.work.reset(n, clusters, h);
        let mut scores = std::mem::take(&mut self.work.chunk_scores);
        scores.clear();
        scores.resize(n_rows * n, f32::NAN);
        let mut acc = std::mem::take(&mut self.work.chunk_acc);
        acc.clear();
        acc.resize(n_rows * h, 0.0);
        let (k, skip) = (RowKernels::best(), self.skip(l));
        let bounds = group_bounds(clusters);
        for g in 0..GROUPS {
            acc.fill(0.0);
            for ci in (bounds[g]..bounds[g + 1]).filter(|&ci| is_needed[ci]) {
                let key = (l as u32, ci as u32);
                let read = match self.core.resident(key) {
                    Some(_) => None,
                    None => {
                        if !self.core.is_pending(key) {
                            // Resident when the chunk was refined, then evicted by a read offered
                            // to the cache since (this chunk's, or a speculative one): read again.
                            self.core.request(key, URGENT);
                            self.core.metrics.late_reads += 1;
                        }
                        Some(self.core.take(key)?)
                    }
                };
                let core = &self.core;
                let bytes = match &read {
                    Some(buf) => &buf[..],
                    None => core.resident(key).expect("resident"),
                };
                let t = Instant::now();
                let plan = &core.plans[l];
                let work = &mut self.work;
                for (r, sel) in selections.iter().enumerate() {
                    if sel.needed.binary_search(&ci).is_err() {
                        continue;
                    }
                    let ops = ClusterOps {
                        plan,
                        k,
                        skip,
                        ci,
                        bytes,
                    };
                    ops.gates(
                        &sel.candidate,
                        &operands[r],
                        &mut scores[r * n..(r + 1) * n],
                        &mut work.lists,
                    )?;
                    ops.add(&work.lists, &mut acc[r * h..(r + 1) * h]);
                }
                self.core.metrics.compute_s += t.elapsed().as_secs_f64();
                if let Some(buf) = read {
                    self.core.offer(key, Bytes::Read(buf));
                }
            }
            for (o, a) in out.chunks_exact_mut(h).zip(acc.chunks_exact(h)) {
                o.iter_mut().zip(a).for_each(|(o, a)| *o += a);
            }
        }
        for (r, (sel, g)) in selections.iter().zip(scores.chunks_exact(n)).enumerate() {
            self.retain_and_measure(l, first + r, sel, g)?;
        }
        self.rows = rows;
        self.marks.is_needed = is_needed;
        self.work.chunk_scores = scores;
        self.work.chunk_acc = acc;
        Ok(())
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
        resident_groups(
            core, work, l, k, skip, needed, candidate, operand, &bounds, &mut next,
        )?;
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
                let ops = ClusterOps {
                    plan: &core.plans[l],
                    k,
                    skip,
                    ci,
                    bytes: &buf,
                };
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

/// Adds, in cluster order, the down columns of group `g`'s clusters whose gates are computed, from
/// `next` up to the first whose bytes have not come yet.
#[allow(clippy::too_many_arguments)]
fn advance(
    core: &Core,
    work: &mut Work,
    l: usize,
    k: &RowKernels,
    skip: Skip,
    g: usize,
    bounds: &[usize; GROUPS + 1],
    next: &mut usize,
) {
    let plan = &core.plans[l];
    let [mut group] = work.groups(plan, bounds, g..g + 1);
    group.advance(core, l, k, skip, next);
}

/// The resident clusters of layer `l` among the `needed`: their gates, then each group's down
/// columns in cluster order as far as the first cluster still waiting for its bytes (`next`).
/// The groups are independent (each its own clusters, neurons and partial sum), so with more than
/// one thread (`--threads`, the size of rayon's pool) and [`PARALLEL_MIN_BYTES`] of bundles or
/// more they are shared out among this thread and parked helpers ([`parallel::for_each`], which
/// allocates nothing): the same operations on the same values in the same order as on one
/// thread, so the same bits.
#[allow(clippy::too_many_arguments)]
fn resident_groups(
    core: &Core,
    work: &mut Work,
    l: usize,
    k: &RowKernels,
    skip: Skip,
    needed: &[usize],
    candidate: &[bool],
    operand: &Operand,
    bounds: &[usize; GROUPS + 1],
    next: &mut [usize; GROUPS],
) -> Result<()> {
    let plan = &core.plans[l];
    let start = *next;
    let one = |g: usize, group: &mut GroupWork, next: &mut usize| -> Result<()> {
        let lo = needed.partition_point(|&c| c < bounds[g]);
        let hi = needed.partition_point(|&c| c < bounds[g + 1]);
        let resident = |ci: usize| {
            let bytes = core.resident((l as u32, ci as u32))?;
            Some(ClusterOps {
                plan,
                k,
                skip,
                ci,
                bytes,
            })
        };
        let mut ahead = needed[lo..hi].iter().map(|&ci| resident(ci)).peekable();
        while let Some(ops) = ahead.next() {
            if let Some(ops) = ops {
                // The gate pass asks for the next cluster's first rows as it nears its end.
                let then = match ahead.peek() {
                    Some(Some(next)) => next.rows().ok(),
                    _ => None,
                };
                group.gates(&ops, then.as_ref(), candidate, operand)?;
            }
        }
        group.advance(core, l, k, skip, next);
        Ok(())
    };
    let groups: [GroupWork; GROUPS] = work.groups(plan, bounds, 0..GROUPS);
    let bytes = needed.len() * plan.cluster_of.len() / plan.clusters.len().max(1)
        * plan.layout.bundle_bytes();
    let threads = if bytes >= PARALLEL_MIN_BYTES {
        rayon::current_num_threads()
    } else {
        1
    };
    // Each group behind its own (uncontended) lock: whichever thread takes it has it alone.
    let cells = groups.map(|group| Mutex::new((group, 0, anyhow::Ok(()))));
    parallel::for_each(threads, GROUPS, &|g| {
        let mut cell = cells[g].lock().unwrap_or_else(|e| e.into_inner());
        let (group, next, result) = &mut *cell;
        *next = start[g];
        *result = one(g, group, next);
    });
    for (cell, next) in cells.into_iter().zip(next) {
        let (_, n, result) = cell.into_inner().unwrap_or_else(|e| e.into_inner());
        *next = n;
        result?;
    }
    Ok(())
}

/// One reduction group's share of a layer's working state ([`Work::groups`]): its clusters'
/// lists, stages and held reads, its neurons' scores and active lists, and its partial sum.
struct GroupWork<'w> {
    /// The group's first cluster and first neuron (indexes of the slices below start there).
    c0: usize,
    n0: usize,
    end: usize,
    scores: &'w mut [f32],
    active: &'w mut [u32],
    coef: &'w mut [f32],
    n_active: &'w mut [u32],
    stage: &'w mut [Stage],
    held: &'w mut [Option<AlignedBuf>],
    acc: &'w mut [f32],
}

impl Work {
    /// The shares of groups `gs` (`N` of them, consecutive) of layer `plan`, cut from this
    /// state without copying it.
    fn groups<const N: usize>(
        &mut self,
        plan: &LayerPlan,
        bounds: &[usize; GROUPS + 1],
        gs: std::ops::Range<usize>,
    ) -> [GroupWork<'_>; N] {
        assert_eq!(gs.len(), N);
        let h = plan.layout.hidden;
        let neuron = |c: usize| {
            plan.clusters
                .get(c)
                .map_or(plan.cluster_of.len(), |cl| cl.first)
        };
        let (c_start, n_start) = (bounds[gs.start], neuron(bounds[gs.start]));
        let lists = &mut self.lists;
        let mut scores = &mut self.scores[n_start..];
        let mut active = &mut lists.active[n_start..];
        let mut coef = &mut lists.coef[n_start..];
        let mut n_active = &mut lists.n_active[c_start..];
        let mut stage = &mut lists.stage[c_start..];
        let mut held = &mut self.held[c_start..];
        let mut acc = &mut self.acc[gs.start * h..];
        fn cut<'a, T>(rest: &mut &'a mut [T], n: usize) -> &'a mut [T] {
            let (head, tail) = std::mem::take(rest).split_at_mut(n);
            *rest = tail;
            head
        }
        std::array::from_fn(|i| {
            let g = gs.start + i;
            let (c0, c1) = (bounds[g], bounds[g + 1]);
            let (n0, n1) = (neuron(c0), neuron(c1));
            GroupWork {
                c0,
                n0,
                end: c1,
                scores: cut(&mut scores, n1 - n0),
                active: cut(&mut active, n1 - n0),
                coef: cut(&mut coef, n1 - n0),
                n_active: cut(&mut n_active, c1 - c0),
                stage: cut(&mut stage, c1 - c0),
                held: cut(&mut held, c1 - c0),
                acc: cut(&mut acc, h),
            }
        })
    }
}

impl GroupWork<'_> {
    /// Computes the gates of cluster `ops.ci` (one of this group's) and records its active
    /// neurons.
    fn gates(
        &mut self,
        ops: &ClusterOps,
        then: Option<&ClusterRows>,
        candidate: &[bool],
        x: &Operand,
    ) -> Result<()> {
        let cl = ops.plan.clusters[ops.ci];
        let r = cl.first - self.n0..cl.first - self.n0 + cl.count;
        let m = ops.gate_into(
            then,
            candidate,
            x,
            &mut self.scores[r.clone()],
            &mut self.active[r.clone()],
            &mut self.coef[r],
        )?;
        self.n_active[ops.ci - self.c0] = m as u32;
        self.stage[ops.ci - self.c0] = Stage::Gated;
        Ok(())
    }

    /// Adds, in cluster order, the down columns of the group's clusters whose gates are computed,
    /// from `next` up to the first whose bytes have not come yet.
    fn advance(&mut self, core: &Core, l: usize, k: &RowKernels, skip: Skip, next: &mut usize) {
        while *next < self.end {
            let (ci, i) = (*next, *next - self.c0);
            match self.stage[i] {
                Stage::Waiting => return,
                Stage::Skipped | Stage::Added => {}
                Stage::Gated => {
                    let bytes = match &self.held[i] {
                        Some(buf) => &buf[..],
                        None => core
                            .resident((l as u32, ci as u32))
                            .expect("a gated cluster stays resident until its layer is done"),
                    };
                    let ops = ClusterOps {
                        plan: &core.plans[l],
                        k,
                        skip,
                        ci,
                        bytes,
                    };
                    let first = ops.plan.clusters[ci].first - self.n0;
                    let r = first..first + self.n_active[i] as usize;
                    ops.add_from(&self.active[r.clone()], &self.coef[r], self.acc);
                    self.stage[i] = Stage::Added;
                }
            }
            *next += 1;
        }
    }
}

/// One cluster's bytes and what computing it takes.
struct ClusterOps<'a> {
    plan: &'a LayerPlan,
    k: &'a RowKernels,
    /// A neuron is computed when its score under this rule exceeds the threshold.
    skip: Skip,
    ci: usize,
    bytes: &'a [u8],
}

impl<'a> ClusterOps<'a> {
    /// The cluster's neurons' rows where its bytes lie; an error if they are too few.
    fn rows(&self) -> Result<ClusterRows<'a>> {
        let count = self.plan.clusters[self.ci].count;
        ClusterRows::new(&self.plan.layout, self.bytes, count)
            .with_context(|| format!("cluster {}", self.ci))
    }

    /// Computes the exact scores of the cluster's candidate neurons into `scores` (the layer's)
    /// and records its active neurons.
    fn gates(
        &self,
        candidate: &[bool],
        x: &Operand,
        scores: &mut [f32],
        lists: &mut Lists,
    ) -> Result<()> {
        let cl = self.plan.clusters[self.ci];
        let r = cl.first..cl.first + cl.count;
        let m = self.gate_into(
            None,
            candidate,
            x,
            &mut scores[r.clone()],
            &mut lists.active[r.clone()],
            &mut lists.coef[r],
        )?;
        lists.n_active[self.ci] = m as u32;
        lists.stage[self.ci] = Stage::Gated;
        Ok(())
    }

    /// The cluster's gates: its neurons' exact scores into `scores`, and its active neurons
    /// (offsets within it) and their coefficients into the first slots of `active` and `coef`
    /// (each as long as the cluster); returns how many are active.
    fn gate_into(
        &self,
        then: Option<&ClusterRows>,
        candidate: &[bool],
        x: &Operand,
        scores: &mut [f32],
        active: &mut [u32],
        coef: &mut [f32],
    ) -> Result<usize> {
        let cl = self.plan.clusters[self.ci];
        Ok(gate_pass(
            self.k,
            &self.plan.layout,
            x,
            &self.rows()?,
            then,
            |i| candidate[cl.first + i],
            self.skip,
            scores,
            active,
            coef,
        ))
    }

    /// Adds the cluster's active neurons' down columns to `acc`, in order.
    fn add(&self, lists: &Lists, acc: &mut [f32]) {
        let cl = self.plan.clusters[self.ci];
        let r = cl.first..cl.first + lists.n_active[self.ci] as usize;
        self.add_from(&lists.active[r.clone()], &lists.coef[r], acc);
    }

    /// Adds `coef[j] · down(active[j])` for the cluster's neurons `active`, in order, to `acc`.
    /// The cluster's gates were computed ([`Self::gate_into`] checked its size).
    fn add_from(&self, active: &[u32], coef: &[f32], acc: &mut [f32]) {
        let rows = self.rows().expect("gate_into checked the cluster's size");
        down_pass(self.k, &self.plan.layout, &rows, active, coef, acc);
    }
}
