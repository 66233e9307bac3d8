//! The speculate-and-refine FFN: per token and layer,
//! 1. *speculate* — when the residual entering layer l exists, the look-ahead predictor of layer
//!    l+1 queues reads of the clusters it believes active, most likely first;
//! 2. *refine* — when layer l's FFN input exists, the candidate set is narrowed by the gate sketch
//!    (certified: only neurons proven inactive are dropped) or by the layer's own predictor
//!    (predicted); queued reads that are no longer wanted are cancelled, wanted ones are boosted,
//!    and missing ones are issued at top priority;
//! 3. *compute* — resident clusters first, then clusters as their reads land; the exact gate in
//!    each bundle decides, so a speculated-but-inactive neuron costs a read, never a wrong value;
//! 4. *retain* — the cache is told which clusters were actually used, and how strongly.

use std::collections::HashMap;
use std::ops::Deref;
use std::time::Instant;

use anyhow::{Context, Result};
use leanstream_format::file::check_extent;
use leanstream_format::predictor::{normalise_input, Predictor};
use leanstream_format::quant::QuantType;
use leanstream_format::FormatError;

use crate::config::Activation;
use crate::kernels::bundles::ffn_bundles;
use crate::kernels::Operand;
use crate::model::FfnBackend;
use crate::neuron_cache::{ClusterKey, NeuronCache};
use crate::storage::{AlignedBuf, IoQueue, Ticket};

use super::metrics::Metrics;
use super::plan::LayerPlan;

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
const URGENT: u32 = u32::MAX;
const SPECULATIVE_MAX: u32 = 1 << 30;

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

pub struct StreamEngine {
    plans: Vec<LayerPlan>,
    act: Activation,
    sparsity: Sparsity,
    io: IoQueue,
    cache: NeuronCache<Bytes>,
    pending: HashMap<ClusterKey, (Ticket, u64)>,
    /// Bytes of reads in flight; speculation stops at `io_budget`.
    in_flight: u64,
    io_budget: u64,
    lookahead_enabled: bool,
    /// Per layer: the stored positions the look-ahead predicted active for the current token.
    lookahead_sets: Vec<Option<Vec<bool>>>,
    pub metrics: Metrics,
}

impl StreamEngine {
    pub fn new(
        plans: Vec<LayerPlan>,
        act: Activation,
        sparsity: Sparsity,
        io: IoQueue,
        cache: NeuronCache<Bytes>,
        io_budget: u64,
        lookahead_enabled: bool,
    ) -> Self {
        let layers = plans.len();
        Self {
            plans,
            act,
            sparsity,
            io,
            cache,
            pending: HashMap::new(),
            in_flight: 0,
            io_budget,
            lookahead_enabled,
            lookahead_sets: vec![None; layers],
            metrics: Metrics::default(),
        }
    }

    pub fn io(&self) -> &IoQueue {
        &self.io
    }

    /// Pins a cluster read at start-up (the hot set).
    pub fn pin(&mut self, l: usize, c: usize, bytes: Bytes, prior_freq: f32) {
        self.cache.pin((l as u32, c as u32), bytes, prior_freq);
    }

    /// Reads a cluster now (for pinning the hot set at start-up), checking its checksum.
    pub fn read_now(&self, l: usize, c: usize) -> Result<AlignedBuf> {
        let io = &self.io;
        let cl = self.plans[l].clusters[c];
        let buf = io.wait(io.submit(cl.offset, cl.size as usize, URGENT))?;
        self.check_cluster(l, c, &buf)?;
        Ok(buf)
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

    /// Queues reads of the clusters layer `target`'s look-ahead predictor expects, from the
    /// residual `residual` (one token).
    fn speculate(&mut self, target: usize, residual: &[f32]) {
        let plan = &self.plans[target];
        let scores = predictor_scores(&plan.lookahead, residual);
        let predicted = above(&scores, plan.lookahead.threshold);
        let io = &self.io;
        let mut wanted: Vec<(f32, usize)> = Vec::new();
        for (ci, cl) in plan.clusters.iter().enumerate() {
            let best = scores[cl.first..cl.first + cl.count]
                .iter()
                .copied()
                .fold(0.0f32, f32::max);
            if best >= plan.lookahead.threshold {
                wanted.push((best, ci));
            }
        }
        wanted.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (score, ci) in wanted {
            let key = (target as u32, ci as u32);
            if self.cache.contains(key) || self.pending.contains_key(&key) {
                continue;
            }
            let cl = plan.clusters[ci];
            if self.in_flight + cl.size > self.io_budget {
                break;
            }
            let priority = (score.clamp(0.0, 1.0) * SPECULATIVE_MAX as f32) as u32;
            self.pending.insert(
                key,
                (io.submit(cl.offset, cl.size as usize, priority), cl.size),
            );
            self.in_flight += cl.size;
            self.metrics.speculative_reads += 1;
        }
        self.lookahead_sets[target] = Some(predicted);
    }

    /// One token's FFN of layer `l`.
    fn ffn_row(&mut self, l: usize, x: &[f32], out: &mut [f32]) -> Result<()> {
        let plan = &self.plans[l];
        let n = plan.cluster_of.len();
        // The FFN input as the kernels see it: its q8 form feeds both the sketch and block bundles.
        let operand = Operand::new(x, QuantType::Q8_0);
        // The own predictor's set: the candidates in predicted mode, a measured signal otherwise.
        let own = above(&predictor_scores(&plan.own, x), plan.own.threshold);
        let candidate: Vec<bool> = match self.sparsity {
            Sparsity::Exact => vec![true; n],
            Sparsity::Certified => certified_candidates(plan, &operand),
            Sparsity::Predicted => own.clone(),
        };
        let mut needed: Vec<usize> = Vec::new();
        for (ci, cl) in plan.clusters.iter().enumerate() {
            if candidate[cl.first..cl.first + cl.count].iter().any(|&c| c) {
                needed.push(ci);
            }
        }
        // Refine the reads of this layer: cancel what is no longer wanted, boost the rest, issue
        // what speculation missed.
        let mut is_needed = vec![false; plan.clusters.len()];
        needed.iter().for_each(|&c| is_needed[c] = true);
        {
            let io = &self.io;
            let keys: Vec<ClusterKey> = self
                .pending
                .keys()
                .copied()
                .filter(|k| k.0 == l as u32)
                .collect();
            for key in keys {
                let (ticket, size) = self.pending[&key];
                if is_needed[key.1 as usize] {
                    io.boost(ticket, URGENT);
                } else if io.cancel(ticket) {
                    self.pending.remove(&key);
                    self.in_flight -= size;
                    self.metrics.cancelled_reads += 1;
                } else if let Some(done) = io.poll(ticket) {
                    // Read already, though not needed now: the cache may keep it; either way its
                    // buffer is released here rather than held by the queue.
                    self.pending.remove(&key);
                    self.in_flight -= size;
                    self.metrics.wasted_reads += 1;
                    if let Ok(buf) = done {
                        if self.check_cluster(l, key.1 as usize, &buf).is_ok() {
                            let _ = self.cache.offer(key, Bytes::Read(buf));
                        }
                    }
                }
            }
            for &ci in &needed {
                let key = (l as u32, ci as u32);
                if !self.cache.contains(key) && !self.pending.contains_key(&key) {
                    let cl = plan.clusters[ci];
                    self.pending.insert(
                        key,
                        (io.submit(cl.offset, cl.size as usize, URGENT), cl.size),
                    );
                    self.in_flight += cl.size;
                    self.metrics.late_reads += 1;
                }
            }
        }
        // Compute: resident clusters first, then reads in the order they were wanted. Each
        // cluster sums into its own buffer and the buffers are added in cluster order, so the
        // result does not depend on what happened to be resident: certified output is bitwise the
        // resident policy's.
        let mut gates = vec![f32::NAN; n];
        let h = x.len();
        let mut partial = vec![0.0f32; needed.len() * h];
        let slot: HashMap<usize, usize> = needed.iter().enumerate().map(|(i, &c)| (c, i)).collect();
        let (resident, missing): (Vec<usize>, Vec<usize>) = needed
            .iter()
            .partition(|&&c| self.cache.contains((l as u32, c as u32)));
        self.metrics.cluster_hits += resident.len() as u64;
        self.metrics.cluster_misses += missing.len() as u64;
        let compute_start = Instant::now();
        for &ci in &resident {
            let bytes = self.cache.get((l as u32, ci as u32)).expect("resident");
            let part = &mut partial[slot[&ci] * h..(slot[&ci] + 1) * h];
            compute_cluster(
                plan, self.act, ci, bytes, &candidate, &operand, part, &mut gates,
            )?;
        }
        let mut compute_s = compute_start.elapsed().as_secs_f64();
        for &ci in &missing {
            let key = (l as u32, ci as u32);
            let (ticket, size) = self.pending.remove(&key).expect("issued above");
            self.in_flight -= size;
            let buf = self
                .io
                .wait(ticket)
                .with_context(|| format!("reading layer {l} cluster {ci}"))?;
            self.check_cluster(l, ci, &buf)?;
            let t = Instant::now();
            let part = &mut partial[slot[&ci] * h..(slot[&ci] + 1) * h];
            compute_cluster(
                plan, self.act, ci, &buf, &candidate, &operand, part, &mut gates,
            )?;
            compute_s += t.elapsed().as_secs_f64();
            // A cluster the cache declines is simply dropped after use.
            let _ = self.cache.offer(key, Bytes::Read(buf));
        }
        for part in partial.chunks_exact(h) {
            out.iter_mut().zip(part).for_each(|(o, p)| *o += p);
        }
        // Retain by what was used; measure the predictors against the truth.
        let threshold = plan.threshold;
        let act = self.act;
        let active: Vec<bool> = gates
            .iter()
            .map(|&g| !g.is_nan() && act.apply(g).abs() > threshold)
            .collect();
        for &ci in &needed {
            let cl = plan.clusters[ci];
            let (mut any, mut mag, mut count) = (false, 0.0f32, 0);
            for p in cl.first..cl.first + cl.count {
                if active[p] {
                    any = true;
                    mag += act.apply(gates[p]).abs();
                    count += 1;
                }
            }
            self.cache.observe(
                (l as u32, ci as u32),
                any,
                if count > 0 { mag / count as f32 } else { 0.0 },
            );
        }
        self.metrics.record_layer(
            &active,
            &own,
            self.lookahead_sets[l].take().as_deref(),
            needed.len(),
            plan.clusters.len(),
        );
        self.metrics.compute_s += compute_s;
        Ok(())
    }
}

impl FfnBackend for StreamEngine {
    fn begin_layer(&mut self, l: usize, residual: &[f32]) -> Result<()> {
        if !self.lookahead_enabled {
            return Ok(());
        }
        let h = residual.len().min(self.plans[0].layout.hidden);
        let last = &residual[residual.len() - h..];
        if l == 0 {
            self.cache.tick();
            self.speculate(0, last);
        }
        if l + 1 < self.plans.len() {
            self.speculate(l + 1, last);
        }
        Ok(())
    }

    fn ffn(&mut self, l: usize, x: &[f32], out: &mut [f32]) -> Result<()> {
        let h = self.plans[l].layout.hidden;
        for (xr, or) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
            self.ffn_row(l, xr, or)?;
        }
        Ok(())
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
    (0..n)
        .map(|p| {
            let (e, s) = (plan.sketch_err[p], plan.sketch_norm[p]);
            let w = s + e;
            let mut beta = e * xq + slack * w * xq.max(x_norm(x.x));
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

/// Which scores reach the threshold (a predictor's "active" set).
fn above(scores: &[f32], threshold: f32) -> Vec<bool> {
    scores.iter().map(|&s| s >= threshold).collect()
}

/// A predictor's sigmoid scores for one input, RMS-normalised as in training.
fn predictor_scores(p: &Predictor, x: &[f32]) -> Vec<f32> {
    p.scores(&normalise_input(x))
}
