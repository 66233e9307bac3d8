//! Refilling the neuron cache after the budget grows: instead of waiting for tokens to miss, the
//! clusters the profile ranks hottest are read into the new room in the background — at the
//! lowest priority, within a quarter of the read-ahead budget, a few per token — and land in the
//! cache when their layer next runs (or are computed from directly, if that layer needs them
//! first). Refinement never withdraws these reads as it does wrong guesses: they were not guesses
//! for the token. The output does not depend on what is cached, only the reads do.

use super::engine::Core;
use crate::streaming::neuron_cache::ClusterKey;

/// The priority of refill reads: behind everything a token needs or guesses.
const PRIORITY: u32 = 0;
/// Share of the read-ahead budget (`Core::io_budget`) refill reads may hold in flight.
const IO_SHARE: u64 = 4;

/// What a refill step reads of the engine and asks of it: [`Core`] in a run.
pub(super) trait Target {
    /// Whether `key` is cached or its read queued.
    fn has(&self, key: ClusterKey) -> bool;
    fn size(&self, key: ClusterKey) -> u64;
    /// The cache's bytes held and its capacity.
    fn cache_used(&self) -> u64;
    fn cache_capacity(&self) -> u64;
    /// Bytes of reads in flight, and the read-ahead budget they are held to.
    fn in_flight(&self) -> u64;
    fn io_budget(&self) -> u64;
    /// Queues the refill reads `batch` in one submission.
    fn request_refill(&mut self, batch: &[(ClusterKey, u32)]);
}

impl Target for Core {
    fn has(&self, key: ClusterKey) -> bool {
        self.cache.contains(key) || self.is_pending(key)
    }
    fn size(&self, key: ClusterKey) -> u64 {
        self.plans[key.0 as usize].clusters[key.1 as usize].size
    }
    fn cache_used(&self) -> u64 {
        self.cache.used()
    }
    fn cache_capacity(&self) -> u64 {
        self.cache.capacity()
    }
    fn in_flight(&self) -> u64 {
        Core::in_flight(self)
    }
    fn io_budget(&self) -> u64 {
        self.io_budget
    }
    fn request_refill(&mut self, batch: &[(ClusterKey, u32)]) {
        Core::request_refill(self, batch)
    }
}

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
    /// budget — or, when no read at all is in flight, the next one whatever its size (one larger
    /// than the share would never be refilled otherwise). Returns false once the cache is full or
    /// every cluster has been looked at: the refill is over.
    pub fn step(&mut self, core: &mut impl Target) -> bool {
        self.batch.clear();
        let mut queued = 0;
        let share = core.io_budget() / IO_SHARE;
        while let Some(&key) = self.order.get(self.next) {
            if core.has(key) {
                self.next += 1;
                continue;
            }
            let size = core.size(key);
            let in_flight = core.in_flight() + queued;
            if core.cache_used() + in_flight + size > core.cache_capacity() {
                break;
            }
            if in_flight > 0 && in_flight + size > share {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// One layer of clusters of the given sizes, a cache and a read queue that only count.
    struct Fake {
        sizes: Vec<u64>,
        cached: Vec<bool>,
        /// Reads in flight: the refill's and the token's (`other`).
        pending: Vec<bool>,
        other: u64,
        capacity: u64,
        io_budget: u64,
    }

    impl Fake {
        fn new(sizes: &[u64], capacity: u64, io_budget: u64) -> Self {
            Self {
                sizes: sizes.to_vec(),
                cached: vec![false; sizes.len()],
                pending: vec![false; sizes.len()],
                other: 0,
                capacity,
                io_budget,
            }
        }
        /// The refill reads in flight land in the cache.
        fn land(&mut self) {
            for (c, p) in self.cached.iter_mut().zip(&mut self.pending) {
                *c |= std::mem::take(p);
            }
        }
        fn queued(&self) -> Vec<usize> {
            (0..self.sizes.len()).filter(|&c| self.pending[c]).collect()
        }
    }

    impl Target for Fake {
        fn has(&self, key: ClusterKey) -> bool {
            self.cached[key.1 as usize] || self.pending[key.1 as usize]
        }
        fn size(&self, key: ClusterKey) -> u64 {
            self.sizes[key.1 as usize]
        }
        fn cache_used(&self) -> u64 {
            (0..self.sizes.len())
                .filter(|&c| self.cached[c])
                .map(|c| self.sizes[c])
                .sum()
        }
        fn cache_capacity(&self) -> u64 {
            self.capacity
        }
        fn in_flight(&self) -> u64 {
            self.other
                + (0..self.sizes.len())
                    .filter(|&c| self.pending[c])
                    .map(|c| self.sizes[c])
                    .sum::<u64>()
        }
        fn io_budget(&self) -> u64 {
            self.io_budget
        }
        fn request_refill(&mut self, batch: &[(ClusterKey, u32)]) {
            for &(key, priority) in batch {
                assert_eq!(priority, PRIORITY);
                assert!(!self.has(key), "{key:?} queued twice");
                self.pending[key.1 as usize] = true;
            }
        }
    }

    fn order(n: u32) -> Vec<ClusterKey> {
        (0..n).map(|c| (0, c)).collect()
    }

    #[test]
    fn a_cluster_larger_than_the_refills_share_is_refilled_alone() {
        // The read budget is 400: the refill's share 100. Cluster 0, the hottest, is 150.
        let mut fake = Fake::new(&[150, 40, 40, 40], 1000, 400);
        let mut refill = Refill::new(order(4));
        // Something else in flight: the large one waits (and the smaller behind it too).
        fake.other = 10;
        assert!(refill.step(&mut fake));
        assert_eq!(fake.queued(), Vec::<usize>::new());
        // Nothing in flight: it is read, alone.
        fake.other = 0;
        assert!(refill.step(&mut fake));
        assert_eq!(fake.queued(), vec![0]);
        // While it is in flight nothing more goes.
        assert!(refill.step(&mut fake));
        assert_eq!(fake.queued(), vec![0]);
        // Once it landed, the others within the share: two of 40, then the last.
        fake.land();
        assert!(refill.step(&mut fake));
        assert_eq!(fake.queued(), vec![1, 2]);
        fake.land();
        assert!(!refill.step(&mut fake));
        assert_eq!(fake.queued(), vec![3]);
        fake.land();
        assert!(fake.cached.iter().all(|&c| c));
    }

    #[test]
    fn a_refill_stops_at_the_caches_room_whatever_the_read_budget() {
        // Room for 150 + 40 of the 270: the large one goes alone, the next fits, the third not.
        let mut fake = Fake::new(&[150, 40, 40, 40], 200, 400);
        let mut refill = Refill::new(order(4));
        assert!(refill.step(&mut fake));
        assert_eq!(fake.queued(), vec![0]);
        fake.land();
        assert!(!refill.step(&mut fake));
        assert_eq!(fake.queued(), vec![1]);
        // A cluster larger than all the room is not read even with nothing in flight.
        let mut fake = Fake::new(&[300, 40], 200, 400);
        let mut refill = Refill::new(order(2));
        assert!(!refill.step(&mut fake));
        assert_eq!(fake.queued(), Vec::<usize>::new());
    }
}
