//! `oracle`, the limit: it knows the true active clusters of every token and layer to come (an
//! [`ActiveTrace`] of the same token sequence, recorded beforehand by a `resident` run whose time
//! is not counted), reads exactly those that are not cached, issues them as early as the I/O
//! budget allows — across layers and tokens, earliest use first, cluster by cluster, topped up
//! whenever a quarter of the budget frees while a layer computes, as leanstream's certain reads
//! are — and evicts with Belady's rule over the trace (the cached cluster used farthest in the
//! future goes, and a cluster used later than everything cached is not kept).
//!
//! What it computes: by default (`oracle`) exactly the active neurons — their gate and up rows
//! only, which no exact policy can match (the rule needs a neuron's gate to know it is inactive,
//! so `resident` and every certified policy compute the gate of every neuron they hold). With
//! `Tuning::oracle_exact_compute` (`oracle-exact` in `bench`) it computes as the exact engine
//! does — every neuron's gate in each cluster it holds (cached, or read because it holds an
//! active neuron) — while still reading only the active clusters: the bound of what perfect
//! foresight of the reads alone gains. Either way its output is the `resident` policy's, bit for
//! bit (the inactive neurons add nothing there either).

use std::sync::Arc;

use anyhow::{bail, Result};

use crate::streaming::neuron_cache::ClusterKey;

use super::engine::{Core, Refine};
use super::schedule::Schedule;
use super::trace::ActiveTrace;

/// Priority of the read for step 0; later steps rank lower, all below urgent reads.
const PREFETCH_TOP: u32 = u32::MAX - 1;

pub(super) struct Oracle {
    trace: Arc<ActiveTrace>,
    /// Steps (token × layers + layer) at which each cluster is used, ascending, by layer and
    /// cluster (looked up per active cluster and layer: an index, not a hash).
    uses: Vec<Vec<Vec<u64>>>,
    /// The first step whose reads have not all been issued yet, and how many of its clusters
    /// have been (the prefetch cursor).
    scan: u64,
    cursor: usize,
    /// The step being computed.
    now: u64,
    /// Compute every neuron of the clusters held, as the exact engine does (`oracle-exact`).
    exact_compute: bool,
    /// Scratch of [`Oracle::prefetch`]: one batch of reads (so that neighbours merge).
    batch: Vec<(ClusterKey, u32)>,
}

impl Oracle {
    pub fn new(trace: Arc<ActiveTrace>, exact_compute: bool) -> Self {
        let mut uses: Vec<Vec<Vec<u64>>> = vec![Vec::new(); trace.layers()];
        for i in 0..trace.len() {
            for (l, layer) in uses.iter_mut().enumerate() {
                let step = (i * trace.layers() + l) as u64;
                for &c in trace.clusters(i, l) {
                    if layer.len() <= c as usize {
                        layer.resize(c as usize + 1, Vec::new());
                    }
                    layer[c as usize].push(step);
                }
            }
        }
        Self {
            trace,
            uses,
            scan: 0,
            cursor: 0,
            now: 0,
            exact_compute,
            batch: Vec::new(),
        }
    }

    fn step(&self, token: usize, l: usize) -> u64 {
        (token * self.trace.layers() + l) as u64
    }

    /// The first use of `key` after step `after` (`None` for "before the first token").
    fn next_use(&self, key: ClusterKey, after: Option<u64>) -> Option<u64> {
        let uses = self.uses.get(key.0 as usize)?.get(key.1 as usize)?;
        let i = after.map_or(0, |a| uses.partition_point(|&s| s <= a));
        uses.get(i).copied()
    }

    fn priority(step: u64) -> u32 {
        PREFETCH_TOP - step.min(PREFETCH_TOP as u64) as u32
    }

    /// Whether the prefetch cursor has passed cluster `key`'s use at step `at`.
    fn passed(&self, key: ClusterKey, at: u64) -> bool {
        if at != self.scan {
            return at < self.scan;
        }
        let layers = self.trace.layers();
        let (i, l) = ((at as usize) / layers, (at as usize) % layers);
        let clusters = self.trace.clusters(i, l);
        clusters.partition_point(|&c| c < key.1) < self.cursor
    }

    /// Issues the reads of the steps ahead, in order, cluster by cluster while they fit the I/O
    /// budget; the reads of steps up to `now` are issued whatever the budget. One batch per call.
    /// While step `now` computes (`computing`), its clusters are cached, queued or held by the
    /// computation (read, not yet offered to the cache): none is read again for a later use now
    /// (`end_layer` reads those the cache does not keep).
    fn prefetch(&mut self, core: &mut Core, now: u64, computing: bool) {
        let layers = self.trace.layers();
        let total = (self.trace.len() * layers) as u64;
        let (now_token, now_layer) = ((now as usize) / layers, (now as usize) % layers);
        let held = match computing {
            true => self.trace.clusters(now_token, now_layer),
            false => &[],
        };
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear();
        let mut bytes = 0u64;
        'steps: while self.scan < total {
            let (i, l) = ((self.scan as usize) / layers, (self.scan as usize) % layers);
            let clusters = self.trace.clusters(i, l);
            while let Some(&c) = clusters.get(self.cursor) {
                let key = (l as u32, c);
                let is_held = l == now_layer && held.binary_search(&c).is_ok();
                if !is_held && !core.cache.contains(key) && !core.is_pending(key) {
                    let size = core.plans[l].clusters[c as usize].size;
                    if self.scan > now && !core.has_room(bytes + size) {
                        break 'steps;
                    }
                    bytes += size;
                    batch.push((key, Self::priority(self.scan)));
                }
                self.cursor += 1;
            }
            self.scan += 1;
            self.cursor = 0;
        }
        core.request_all(&batch);
        self.batch = batch;
    }
}

impl Schedule for Oracle {
    /// The optimal start: the clusters used first, as many as the cache holds.
    fn warm(&mut self, core: &mut Core) -> Result<()> {
        let mut order: Vec<(u64, ClusterKey)> = self
            .uses
            .iter()
            .enumerate()
            .flat_map(|(l, layer)| {
                layer
                    .iter()
                    .enumerate()
                    .filter_map(move |(c, uses)| Some((*uses.first()?, (l as u32, c as u32))))
            })
            .collect();
        order.sort_unstable();
        let capacity = core.cache.capacity();
        let mut used = 0u64;
        for (first, key) in order {
            let size = core.plans[key.0 as usize].clusters[key.1 as usize].size;
            if used + size > capacity {
                continue;
            }
            core.cache.set_next_use(key, Some(first));
            let bytes = core.read_now(key)?;
            if core.offer(key, bytes) {
                used += size;
            }
        }
        Ok(())
    }

    fn begin_layer(&mut self, core: &mut Core, l: usize, token: usize, _: &[f32]) -> Result<()> {
        self.now = self.step(token, l);
        self.prefetch(core, self.now, false);
        Ok(())
    }

    fn needs(
        &mut self,
        core: &mut Core,
        l: usize,
        token: usize,
        candidate: &mut Vec<bool>,
    ) -> Result<bool> {
        let now = self.step(token, l);
        let plan = &core.plans[l];
        candidate.resize(plan.cluster_of.len(), false);
        if self.exact_compute {
            // Every neuron of every cluster held, and of every active one (read if not held).
            for (ci, cl) in plan.clusters.iter().enumerate() {
                if core.cache.contains((l as u32, ci as u32)) {
                    candidate[cl.first..cl.first + cl.count].fill(true);
                }
            }
            for &c in self.trace.clusters(token, l) {
                let cl = plan.clusters[c as usize];
                candidate[cl.first..cl.first + cl.count].fill(true);
            }
        } else {
            for &p in self.trace.neurons(token, l) {
                candidate[p as usize] = true;
            }
        }
        for &c in self.trace.clusters(token, l) {
            let key = (l as u32, c);
            core.cache.set_next_use(key, self.next_use(key, Some(now)));
        }
        Ok(true)
    }

    fn refine(&self) -> Refine {
        // The other queued reads of this layer belong to later tokens: leave them be.
        Refine {
            boost: true,
            cancel: false,
            reap: false,
        }
    }

    /// The reads ahead are topped up while the layer computes.
    fn taken(&mut self, core: &mut Core) {
        self.prefetch(core, self.now, true);
    }

    fn end_layer(&mut self, core: &mut Core, l: usize, token: usize, used: &[usize]) -> Result<()> {
        let recorded = self.trace.clusters(token, l);
        if used.len() != recorded.len() || used.iter().zip(recorded).any(|(&a, &b)| a != b as usize)
        {
            bail!(
                "the oracle's active trace does not match the computation at token {token}, layer {l} ({} clusters active, {} recorded): record the trace with the same file, tokens and ctx",
                used.len(),
                recorded.len()
            );
        }
        // A cluster read for this step and not kept is read again for its next use, if the
        // look-ahead has already gone past that use.
        let now = self.step(token, l);
        for &c in recorded {
            let key = (l as u32, c);
            if let Some(next) = self.next_use(key, Some(now)) {
                if self.passed(key, next) {
                    core.request(key, Self::priority(next));
                }
            }
        }
        self.prefetch(core, now + 1, false);
        Ok(())
    }
}
