//! A min-heap of `(rank, slot)` pairs that knows where each slot sits in it, so that an entry can
//! be removed or re-ranked by its slot in O(log n). The neuron cache orders its evictable clusters
//! with it: sized once for every cluster of the file, it never allocates afterwards, where a
//! `BTreeSet` allocates and frees nodes as entries move — thousands of times per token at the 7B
//! scale. Ranks are unique per slot, so the order is total: the minimum is the one a sorted set
//! would give first.

/// Where a slot not in the heap "sits".
const ABSENT: u32 = u32::MAX;

pub struct SlotHeap {
    heap: Vec<(u64, u32)>,
    /// Each slot's index in `heap`, or [`ABSENT`].
    at: Vec<u32>,
}

impl SlotHeap {
    /// An empty heap for slots `0..slots`, its storage reserved for all of them.
    pub fn new(slots: usize) -> Self {
        Self {
            heap: Vec::with_capacity(slots),
            at: vec![ABSENT; slots],
        }
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// The lowest `(rank, slot)`.
    pub fn first(&self) -> Option<(u64, u32)> {
        self.heap.first().copied()
    }

    /// Adds `slot` at `rank` (it must not be in the heap).
    pub fn insert(&mut self, rank: u64, slot: u32) {
        assert_eq!(self.at[slot as usize], ABSENT, "slot {slot} is in the heap");
        self.heap.push((rank, slot));
        self.at[slot as usize] = (self.heap.len() - 1) as u32;
        self.up(self.heap.len() - 1);
    }

    /// Removes and returns the lowest `(rank, slot)`.
    pub fn pop(&mut self) -> Option<(u64, u32)> {
        let first = self.first()?;
        self.remove(first.1);
        Some(first)
    }

    /// Removes `slot`; false if it was not in the heap.
    pub fn remove(&mut self, slot: u32) -> bool {
        let i = self.at[slot as usize];
        if i == ABSENT {
            return false;
        }
        let i = i as usize;
        let last = self.heap.len() - 1;
        self.swap(i, last);
        self.heap.pop();
        self.at[slot as usize] = ABSENT;
        if i < self.heap.len() {
            self.down(i);
            self.up(i);
        }
        true
    }

    fn swap(&mut self, i: usize, j: usize) {
        self.heap.swap(i, j);
        self.at[self.heap[i].1 as usize] = i as u32;
        self.at[self.heap[j].1 as usize] = j as u32;
    }

    fn up(&mut self, mut i: usize) {
        while i > 0 {
            let parent = (i - 1) / 2;
            if self.heap[parent] <= self.heap[i] {
                break;
            }
            self.swap(i, parent);
            i = parent;
        }
    }

    fn down(&mut self, mut i: usize) {
        loop {
            let (l, r) = (2 * i + 1, 2 * i + 2);
            let mut least = i;
            if l < self.heap.len() && self.heap[l] < self.heap[least] {
                least = l;
            }
            if r < self.heap.len() && self.heap[r] < self.heap[least] {
                least = r;
            }
            if least == i {
                return;
            }
            self.swap(i, least);
            i = least;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Random inserts, removals, re-ranks and pops against a sorted set: the same minimum after
    /// every step, and the same order when drained.
    #[test]
    fn pops_in_the_order_of_a_sorted_set() {
        let seed = rand::random();
        let mut rng = StdRng::seed_from_u64(seed);
        let slots = 200;
        let (mut heap, mut set) = (SlotHeap::new(slots), BTreeSet::new());
        let mut rank_of = vec![None; slots];
        for _ in 0..20_000 {
            let s = rng.random_range(0..slots as u32);
            let rank = rng.random_range(0..50u64);
            match (rng.random_range(0..4), rank_of[s as usize]) {
                (0, None) | (1, None) => {
                    heap.insert(rank, s);
                    set.insert((rank, s));
                    rank_of[s as usize] = Some(rank);
                }
                (1, Some(old)) => {
                    // A re-rank: out, then in again.
                    assert!(heap.remove(s));
                    set.remove(&(old, s));
                    heap.insert(rank, s);
                    set.insert((rank, s));
                    rank_of[s as usize] = Some(rank);
                }
                (2, Some(old)) => {
                    assert!(heap.remove(s), "seed {seed}");
                    set.remove(&(old, s));
                    rank_of[s as usize] = None;
                }
                (3, _) => {
                    let popped = heap.pop();
                    assert_eq!(popped, set.pop_first(), "seed {seed}");
                    if let Some((_, p)) = popped {
                        rank_of[p as usize] = None;
                    }
                }
                (2, None) => assert!(!heap.remove(s), "seed {seed}"),
                _ => {}
            }
            assert_eq!(heap.first(), set.first().copied(), "seed {seed}");
            assert_eq!(heap.len(), set.len());
        }
        while let Some(p) = heap.pop() {
            assert_eq!(Some(p), set.pop_first(), "seed {seed}");
        }
        assert!(set.is_empty() && heap.is_empty());
    }
}
