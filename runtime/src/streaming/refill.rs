//! Refilling the neuron cache after the budget grows: instead of waiting for tokens to miss, the
//! clusters the profile ranks hottest are read into the new room in the background — at the
//! lowest priority, within a quarter of the read-ahead budget, a few per token — and land in the
//! cache when their layer next runs (or are computed from directly, if that layer needs them
//! first). Refinement never withdraws these reads as it does wrong guesses: they were not guesses
//! for the token. The output does not depend on what is cached, only the reads do.

use super::engine::Core;
use crate::neuron_cache::ClusterKey;

/// The priority of refill reads: behind everything a token needs or guesses.
const PRIORITY: u32 = 0;
/// Share of the read-ahead budget (`Core::io_budget`) refill reads may hold in flight.
const IO_SHARE: u64 = 4;

/// A refill under way.
pub(super) struct Refill {
    /// Every cluster, hottest in the profile first.
    order: Vec<ClusterKey>,
    /// The first of `order` not yet looked at.
    next: usize,
    /// Scratch: the reads queued by one step.
    batch: Vec<(ClusterKey, u32)>,
}

impl Refill {
    /// Starts refilling from the profile's order (`schedule::hot_order`).
    pub fn new(order: Vec<ClusterKey>) -> Self {
        Self {
            order,
            next: 0,
            batch: Vec::new(),
        }
    }

    /// Queues the next hottest clusters neither cached nor queued, while they fit the cache's
    /// room (what it holds and what is in flight counted) and the refill's share of the read
    /// budget. Returns false once the cache is full or every cluster has been looked at: the
    /// refill is over.
    pub fn step(&mut self, core: &mut Core) -> bool {
        self.batch.clear();
        let mut queued = 0;
        while let Some(&key) = self.order.get(self.next) {
            if core.cache.contains(key) || core.is_pending(key) {
                self.next += 1;
                continue;
            }
            let size = core.plans[key.0 as usize].clusters[key.1 as usize].size;
            if core.cache.used() + core.in_flight() + queued + size > core.cache.capacity() {
                break;
            }
            if core.in_flight() + queued + size > core.io_budget / IO_SHARE {
                core.request_refill(&self.batch);
                return true;
            }
            queued += size;
            self.batch.push((key, PRIORITY));
            self.next += 1;
        }
        core.request_refill(&self.batch);
        // Over when the cache has no room for the next cluster or none is left.
        false
    }
}
