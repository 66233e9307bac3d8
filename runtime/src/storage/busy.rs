//! How long a device had at least one read in flight: the union of the reads' intervals. Intervals
//! arrive when reads complete, out of start order (a long read started before a short one ends
//! after it), so the recent ones are kept merged and only those older than [`HORIZON`] are folded
//! into the total.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// No read is expected to last longer than this: intervals ending before `now - HORIZON` are
/// final.
const HORIZON: Duration = Duration::from_secs(1);

#[derive(Default)]
pub(crate) struct BusyClock {
    folded: Duration,
    /// Disjoint intervals in start order.
    recent: VecDeque<(Instant, Instant)>,
}

impl BusyClock {
    /// Records that the device was busy from `start` to `end`.
    pub fn add(&mut self, start: Instant, end: Instant) {
        if end <= start {
            return;
        }
        let (mut start, mut end) = (start, end);
        // Intervals overlapping or touching [start, end] are merged into it.
        let first = self.recent.partition_point(|&(_, e)| e < start);
        let mut last = first;
        while last < self.recent.len() && self.recent[last].0 <= end {
            start = start.min(self.recent[last].0);
            end = end.max(self.recent[last].1);
            last += 1;
        }
        self.recent.drain(first..last);
        self.recent.insert(first, (start, end));
        let now = Instant::now();
        while let Some(&(s, e)) = self.recent.front() {
            if e + HORIZON >= now {
                break;
            }
            self.folded += e - s;
            self.recent.pop_front();
        }
    }

    /// The total busy time so far.
    pub fn total(&self) -> Duration {
        self.folded + self.recent.iter().map(|&(s, e)| e - s).sum::<Duration>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn union_of_out_of_order_intervals() {
        let t = Instant::now();
        let at = |us: u64| t + Duration::from_micros(us);
        let mut b = BusyClock::default();
        b.add(at(20), at(30));
        b.add(at(0), at(25)); // started earlier, ended later
        b.add(at(50), at(60));
        b.add(at(40), at(45));
        b.add(at(44), at(52)); // bridges two
        assert_eq!(b.total(), Duration::from_micros(30 + 20));
        assert_eq!(b.recent.len(), 2);
    }
}
