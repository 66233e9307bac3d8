//! The reads waiting for a device slot: ordered by priority (first come first served among equals)
//! and indexed by where they start and end, so that the read issued next can absorb the pending
//! reads that continue it on either side.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};

/// Where a read starts and how long it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Extent {
    pub offset: u64,
    pub len: usize,
}

impl Extent {
    fn end(self) -> u64 {
        self.offset + self.len as u64
    }
}

/// A device read covering one or more pending reads that lie end to end.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub offset: u64,
    pub len: usize,
    /// The reads it serves, in offset order, with their ids.
    pub parts: Vec<(u64, Extent)>,
}

#[derive(Default)]
pub(crate) struct PendingSet {
    by_priority: BTreeSet<(Reverse<u32>, u64)>,
    by_start: BTreeSet<(u64, u64)>,
    by_end: BTreeSet<(u64, u64)>,
    entries: HashMap<u64, (Extent, u32)>,
}

impl PendingSet {
    /// Adds read `id` (ids grow with submission order, which breaks priority ties).
    pub fn insert(&mut self, id: u64, extent: Extent, priority: u32) {
        self.by_priority.insert((Reverse(priority), id));
        self.by_start.insert((extent.offset, id));
        self.by_end.insert((extent.end(), id));
        self.entries.insert(id, (extent, priority));
    }

    /// Removes read `id`; false if it was not pending.
    pub fn remove(&mut self, id: u64) -> bool {
        let Some((extent, priority)) = self.entries.remove(&id) else {
            return false;
        };
        self.by_priority.remove(&(Reverse(priority), id));
        self.by_start.remove(&(extent.offset, id));
        self.by_end.remove(&(extent.end(), id));
        true
    }

    /// Gives read `id` a new priority; false if it was not pending.
    pub fn set_priority(&mut self, id: u64, priority: u32) -> bool {
        let Some((_, old)) = self.entries.get_mut(&id) else {
            return false;
        };
        let was = std::mem::replace(old, priority);
        self.by_priority.remove(&(Reverse(was), id));
        self.by_priority.insert((Reverse(priority), id));
        true
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The priority of the read that [`PendingSet::pop_run`] would take next.
    pub fn top_priority(&self) -> Option<u32> {
        self.by_priority.first().map(|&(Reverse(p), _)| p)
    }

    /// Takes the most urgent read and every pending read that extends it end to end, forwards
    /// then backwards, while the run stays within `max_len` bytes. The run's parts are listed in
    /// `parts` (cleared first: a caller that recycles it allocates nothing).
    pub fn pop_run(&mut self, max_len: usize, mut parts: Vec<(u64, Extent)>) -> Option<Run> {
        let &(_, first) = self.by_priority.first()?;
        let (extent, _) = self.entries[&first];
        self.remove(first);
        parts.clear();
        parts.push((first, extent));
        let mut run = Run {
            offset: extent.offset,
            len: extent.len,
            parts,
        };
        while let Some(&(_, id)) = first_at(&self.by_start, run.offset + run.len as u64) {
            let (next, _) = self.entries[&id];
            if run.len + next.len > max_len {
                break;
            }
            self.remove(id);
            run.len += next.len;
            run.parts.push((id, next));
        }
        while let Some(&(_, id)) = first_at(&self.by_end, run.offset) {
            let (prev, _) = self.entries[&id];
            if run.len + prev.len > max_len {
                break;
            }
            self.remove(id);
            run.offset = prev.offset;
            run.len += prev.len;
            run.parts.insert(0, (id, prev));
        }
        Some(run)
    }
}

/// The earliest-submitted entry of `index` keyed at `position`.
fn first_at(index: &BTreeSet<(u64, u64)>, position: u64) -> Option<&(u64, u64)> {
    index.range((position, 0)..=(position, u64::MAX)).next()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(offset: u64, len: usize) -> Extent {
        Extent { offset, len }
    }

    #[test]
    fn priority_then_submission_order() {
        let mut p = PendingSet::default();
        p.insert(1, ext(0, 4096), 5);
        p.insert(2, ext(65536, 4096), 9);
        p.insert(3, ext(131072, 4096), 9);
        let order: Vec<u64> = std::iter::from_fn(|| p.pop_run(1 << 20, Vec::new()))
            .map(|r| r.parts[0].0)
            .collect();
        assert_eq!(order, [2, 3, 1]);
    }

    #[test]
    fn merges_both_sides_within_the_bound() {
        let mut p = PendingSet::default();
        p.insert(1, ext(8192, 4096), 1);
        p.insert(2, ext(12288, 8192), 9);
        p.insert(3, ext(20480, 4096), 1);
        p.insert(4, ext(4096, 4096), 1);
        p.insert(5, ext(0, 4096), 1);
        let run = p.pop_run(5 * 4096, Vec::new()).unwrap();
        assert_eq!((run.offset, run.len), (4096, 5 * 4096));
        let ids: Vec<u64> = run.parts.iter().map(|x| x.0).collect();
        assert_eq!(ids, [4, 1, 2, 3]);
        let rest = p.pop_run(1 << 20, Vec::new()).unwrap();
        assert_eq!((rest.offset, rest.len, rest.parts.len()), (0, 4096, 1));
        assert!(p.is_empty());
    }

    #[test]
    fn remove_and_reprioritise() {
        let mut p = PendingSet::default();
        p.insert(1, ext(0, 4096), 1);
        p.insert(2, ext(65536, 4096), 2);
        assert!(p.set_priority(1, 3));
        assert!(p.remove(2));
        assert!(!p.remove(2));
        assert!(!p.set_priority(2, 7));
        assert_eq!(p.pop_run(4096, Vec::new()).unwrap().parts[0].0, 1);
        assert!(p.pop_run(4096, Vec::new()).is_none());
    }
}
