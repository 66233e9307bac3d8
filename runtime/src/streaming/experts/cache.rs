//! The expert cache: whole experts held as read from flash (their stored quantization, not f32),
//! a fixed number of slots shared with the reads in flight. What stays is decided by observed
//! use — each expert's score decays every token its layer runs and grows when it is chosen —
//! starting from the converter's routing profile, so the experts the calibration text chose most
//! (the hot set) are the last to go before the run has shown otherwise. The experts the running
//! layer needs are never evicted while it runs.

use crate::storage::AlignedBuf;

/// Per token of its layer, every expert's score is multiplied by this: a use counts half after
/// about 34 tokens.
const DECAY: f32 = 0.98;
/// A profile frequency of 1 (chosen by every token) is worth this many observed uses.
const PRIOR_USES: f32 = 16.0;

/// Experts numbered densely: `layer × experts + expert`.
pub struct ExpertCache {
    /// Experts per layer.
    experts: usize,
    /// Slots for resident experts and reads in flight together.
    slots: usize,
    buffers: Vec<Option<AlignedBuf>>,
    score: Vec<f32>,
    /// The stamp of the layer run that needs the expert (protected while it equals `now`).
    needed_at: Vec<u64>,
    now: u64,
    /// The resident experts' ids, unordered.
    resident: Vec<u32>,
    in_flight: usize,
}

impl ExpertCache {
    /// `slots` experts (resident or in flight) of `layers × experts`, scored first by `prior`
    /// (each expert's profile frequency, `layers × experts`).
    pub fn new(slots: usize, experts: usize, prior: &[f32]) -> Self {
        Self {
            experts,
            slots,
            buffers: (0..prior.len()).map(|_| None).collect(),
            score: prior.iter().map(|f| f * PRIOR_USES).collect(),
            needed_at: vec![u64::MAX; prior.len()],
            now: 0,
            resident: Vec::with_capacity(slots),
            in_flight: 0,
        }
    }

    pub fn id(&self, layer: usize, expert: usize) -> usize {
        layer * self.experts + expert
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn get(&self, id: usize) -> Option<&AlignedBuf> {
        self.buffers[id].as_ref()
    }

    /// A new layer run begins: what it marks [`needed`](Self::needed) is protected until the next.
    pub fn begin_run(&mut self) {
        self.now += 1;
    }

    /// Expert `id` runs in the current layer run: protected from eviction until the next.
    pub fn needed(&mut self, id: usize) {
        self.needed_at[id] = self.now;
    }

    /// Expert `id` has run in the current layer run: evictable again.
    pub fn done(&mut self, id: usize) {
        self.needed_at[id] = u64::MAX;
    }

    /// One token of `layer` ran, choosing the experts `chosen` marks (`experts` long).
    pub fn observe(&mut self, layer: usize, chosen: &[bool]) {
        let first = layer * self.experts;
        for (s, &c) in self.score[first..first + self.experts]
            .iter_mut()
            .zip(chosen)
        {
            *s = *s * DECAY + if c { 1.0 } else { 0.0 };
        }
    }

    /// Sets expert `id`'s retention score (the oracle's: minus its next use).
    pub fn set_score(&mut self, id: usize, score: f32) {
        self.score[id] = score;
    }

    /// Claims a slot for a read about to be submitted, evicting the lowest-scored unprotected
    /// resident expert if every slot is taken; the evicted buffer is returned for reuse. `None`
    /// (nothing claimed) when every slot is in flight or protected.
    pub fn claim(&mut self) -> Option<Option<AlignedBuf>> {
        let spare = if self.resident.len() + self.in_flight >= self.slots {
            Some(self.evict_one()?)
        } else {
            None
        };
        self.in_flight += 1;
        Some(spare)
    }

    /// Claims a slot only if expert `id` would outrank the expert it evicts (speculation must not
    /// push out what is used more than the guess); as [`claim`](Self::claim) otherwise.
    pub fn claim_for(&mut self, id: usize) -> Option<Option<AlignedBuf>> {
        if self.resident.len() + self.in_flight >= self.slots {
            let (_, victim) = self.victim()?;
            if self.score[self.resident[victim] as usize] > self.score[id] {
                return None;
            }
        }
        self.claim()
    }

    /// A claimed read ended without a buffer to keep (cancelled, failed or dropped).
    pub fn release(&mut self) {
        self.in_flight -= 1;
    }

    /// A claimed read of expert `id` landed: it becomes resident in its slot.
    pub fn insert(&mut self, id: usize, buf: AlignedBuf) {
        debug_assert!(self.buffers[id].is_none(), "expert {id} read twice");
        self.in_flight -= 1;
        self.buffers[id] = Some(buf);
        self.resident.push(id as u32);
    }

    /// The resident, unprotected expert with the lowest score: (its score, its place in
    /// `resident`).
    fn victim(&self) -> Option<(f32, usize)> {
        let mut best: Option<(f32, usize)> = None;
        for (i, &id) in self.resident.iter().enumerate() {
            let id = id as usize;
            if self.needed_at[id] == self.now {
                continue;
            }
            if best.is_none_or(|(s, _)| self.score[id] < s) {
                best = Some((self.score[id], i));
            }
        }
        best
    }

    fn evict_one(&mut self) -> Option<AlignedBuf> {
        let (_, i) = self.victim()?;
        let id = self.resident.swap_remove(i) as usize;
        self.buffers[id].take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf() -> AlignedBuf {
        AlignedBuf::new(AlignedBuf::ALIGN)
    }

    /// Fills `ids` through claim + insert.
    fn fill(c: &mut ExpertCache, ids: &[usize]) {
        for &id in ids {
            c.claim().expect("a free slot");
            c.insert(id, buf());
        }
    }

    #[test]
    fn evicts_the_least_used_and_keeps_the_profile_hot_set_until_use_says_otherwise() {
        // One layer of 4 experts; the profile says expert 2 is hot.
        let mut c = ExpertCache::new(2, 4, &[0.1, 0.1, 0.9, 0.1]);
        fill(&mut c, &[2, 0]);
        c.begin_run();
        // A third expert evicts 0 (prior 0.1), not the hot 2.
        assert!(c.claim().unwrap().is_some());
        c.insert(1, buf());
        assert!(c.get(0).is_none() && c.get(2).is_some() && c.get(1).is_some());
        // Tokens that choose 1 and never 2 outrank the profile.
        for _ in 0..60 {
            c.observe(0, &[false, true, false, false]);
        }
        assert!(c.claim().unwrap().is_some());
        c.insert(3, buf());
        assert!(c.get(2).is_none(), "the unused hot expert went");
        assert!(c.get(1).is_some() && c.get(3).is_some());
    }

    #[test]
    fn protects_the_running_layers_experts_and_counts_reads_in_flight() {
        let mut c = ExpertCache::new(2, 4, &[0.0; 4]);
        fill(&mut c, &[0, 1]);
        c.begin_run();
        c.needed(0);
        c.needed(1);
        assert!(c.claim().is_none(), "both residents are needed now");
        c.begin_run();
        c.needed(1);
        let spare = c.claim().unwrap();
        assert!(
            spare.is_some() && c.get(0).is_none(),
            "0 evicted for the read"
        );
        // The read in flight holds the second slot: nothing more to claim.
        assert!(c.claim().is_none());
        c.release();
        assert!(c.claim().unwrap().is_none(), "a free slot: nothing evicted");
        c.insert(3, buf());
        assert_eq!(c.resident.len(), 2);
    }

    #[test]
    fn speculation_does_not_evict_what_is_used_more_than_its_guess() {
        let mut c = ExpertCache::new(1, 4, &[0.5, 0.0, 0.9, 0.0]);
        fill(&mut c, &[0]);
        c.begin_run();
        assert!(c.claim_for(1).is_none(), "1 scores below the resident 0");
        assert!(c.claim_for(2).unwrap().is_some(), "2 outranks it");
    }
}
