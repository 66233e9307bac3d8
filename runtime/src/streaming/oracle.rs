//! `oracle`, the limit: it knows the true active clusters of every token and layer to come (an
//! [`ActiveTrace`] of the same token sequence), reads exactly those that are not cached, issues
//! them as early as the I/O budget allows — across layers and tokens, earliest use first — and
//! evicts with Belady's rule over the trace (the cached cluster used farthest in the future goes,
//! and a cluster used later than everything cached is not kept). It computes exactly the active
//! neurons, so its output is the `resident` policy's, bit for bit (the inactive ones add nothing
//! there either).

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Result};

use crate::neuron_cache::ClusterKey;

use super::engine::{Core, Refine};
use super::schedule::Schedule;
use super::trace::ActiveTrace;

/// Priority of the read for step 0; later steps rank lower, all below urgent reads.
const PREFETCH_TOP: u32 = u32::MAX - 1;

pub(super) struct Oracle {
    trace: Arc<ActiveTrace>,
    /// Steps (token × layers + layer) at which each cluster is used, ascending.
    uses: HashMap<ClusterKey, Vec<u64>>,
    /// The first step whose reads have not been issued yet.
    scan: u64,
}

impl Oracle {
    pub fn new(trace: Arc<ActiveTrace>) -> Self {
        let mut uses: HashMap<ClusterKey, Vec<u64>> = HashMap::new();
        for i in 0..trace.len() {
            for l in 0..trace.layers() {
                let step = (i * trace.layers() + l) as u64;
                for &c in trace.clusters(i, l) {
                    uses.entry((l as u32, c)).or_default().push(step);
                }
            }
        }
        Self {
            trace,
            uses,
            scan: 0,
        }
    }

    fn step(&self, token: usize, l: usize) -> u64 {
        (token * self.trace.layers() + l) as u64
    }

    /// The first use of `key` after step `after` (`None` for "before the first token").
    fn next_use(&self, key: ClusterKey, after: Option<u64>) -> Option<u64> {
        let uses = self.uses.get(&key)?;
        let i = after.map_or(0, |a| uses.partition_point(|&s| s <= a));
        uses.get(i).copied()
    }

    fn priority(step: u64) -> u32 {
        PREFETCH_TOP - step.min(PREFETCH_TOP as u64) as u32
    }

    /// Issues the reads of the steps ahead, in order, while they fit the I/O budget; the reads of
    /// steps up to `now` are issued whatever the budget.
    fn prefetch(&mut self, core: &mut Core, now: u64) {
        let layers = self.trace.layers();
        let total = (self.trace.len() * layers) as u64;
        while self.scan < total {
            let (i, l) = ((self.scan as usize) / layers, (self.scan as usize) % layers);
            let wanted: Vec<ClusterKey> = self
                .trace
                .clusters(i, l)
                .iter()
                .map(|&c| (l as u32, c))
                .filter(|&k| !core.cache.contains(k) && !core.is_pending(k))
                .collect();
            let bytes: u64 = wanted
                .iter()
                .map(|k| core.plans[k.0 as usize].clusters[k.1 as usize].size)
                .sum();
            if self.scan > now && !core.has_room(bytes) {
                return;
            }
            for key in wanted {
                core.request(key, Self::priority(self.scan));
            }
            self.scan += 1;
        }
    }
}

impl Schedule for Oracle {
    /// The optimal start: the clusters used first, as many as the cache holds.
    fn warm(&mut self, core: &mut Core) -> Result<()> {
        let mut order: Vec<(u64, ClusterKey)> = self
            .uses
            .iter()
            .map(|(&key, uses)| (uses[0], key))
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
        let now = self.step(token, l);
        self.prefetch(core, now);
        Ok(())
    }

    fn needs(&mut self, core: &mut Core, l: usize, token: usize) -> Result<Option<Vec<u32>>> {
        let now = self.step(token, l);
        for &c in self.trace.clusters(token, l) {
            let key = (l as u32, c);
            core.cache.set_next_use(key, self.next_use(key, Some(now)));
        }
        Ok(Some(self.trace.neurons(token, l).to_vec()))
    }

    fn refine(&self) -> Refine {
        // The other queued reads of this layer belong to later tokens: leave them be.
        Refine {
            boost: true,
            cancel: false,
            reap: false,
        }
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
                if next < self.scan {
                    core.request(key, Self::priority(next));
                }
            }
        }
        self.prefetch(core, now + 1);
        Ok(())
    }
}
