//! The neuron cache: clusters of neuron bundles held in DRAM, within a byte capacity. A pinned hot
//! set, chosen from the profile, never leaves; the rest is ranked by observed use — how often a
//! cluster turned out to hold active neurons, a moving average that starts from the profile's
//! frequency — so that what stays is what tokens actually needed, not what was once predicted.
//! (Recency and activation magnitude were tried as extra terms: both lowered the hit rate.)
//! The prior systems' rules (LRU, a window of recent tokens) and the oracle's (Belady: the cluster
//! used farthest in the future goes first) rank the same entries differently.
//!
//! Every cluster of the file has a fixed slot ([`ClusterSlots`]): the token loop asks about tens
//! of thousands of clusters per token at the 7B scale, so a lookup is an index, not a hash.

use std::ops::Deref;

use crate::streaming::slot_heap::SlotHeap;

/// A cluster: `(layer, cluster index)`.
pub type ClusterKey = (u32, u32);

/// A dense numbering of a file's clusters: layer `l`'s cluster `c` is slot `first[l] + c`.
#[derive(Debug, Clone, Default)]
pub struct ClusterSlots {
    first: Vec<u32>,
}

impl ClusterSlots {
    /// Slots for layers of `clusters[l]` clusters each.
    pub fn new(clusters: impl IntoIterator<Item = usize>) -> Self {
        let mut first = vec![0u32];
        for n in clusters {
            first.push(first.last().expect("starts with 0") + n as u32);
        }
        Self { first }
    }

    /// The cluster's slot (panics on a key outside the file: a caller's bug).
    #[inline]
    pub fn of(&self, key: ClusterKey) -> usize {
        let (l, c) = (key.0 as usize, key.1);
        assert!(
            c < self.first[l + 1] - self.first[l],
            "cluster {c} of layer {l}"
        );
        (self.first[l] + c) as usize
    }

    /// Slots in all.
    pub fn len(&self) -> usize {
        *self.first.last().expect("starts with 0") as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How the dynamic part ranks clusters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Observed activity: how often the cluster held an active neuron.
    Activity,
    /// Least recently used first out (an ablation and the prior systems' cold cache).
    Lru,
    /// LRU, and a cluster unused for more than this many tokens leaves (LLM in a Flash's window).
    Window(usize),
    /// The cluster whose next use is farthest goes first; a newcomer used later than everything
    /// resident is not kept. Next uses come from [`NeuronCache::set_next_use`] (the oracle).
    Belady,
}

struct Entry<B> {
    data: B,
    bytes: u64,
    pinned: bool,
    /// Moving average of "this cluster held an active neuron when its layer ran".
    freq: f32,
    last_used: u64,
    /// The entry's place in `order` (unpinned entries only).
    rank: u64,
}

/// Weight of the newest observation in the moving average: about the last 20 tokens count. On
/// the embedded model 0.02–0.3 gave hit rates within 0.01 of each other.
const EMA: f32 = 0.05;
/// `next_use` of a cluster never used again.
const NEVER: u64 = u64::MAX;

pub struct NeuronCache<B> {
    capacity: u64,
    used: u64,
    slots: ClusterSlots,
    /// The resident clusters, by slot.
    entries: Vec<Option<Entry<B>>>,
    /// The unpinned entries by `(rank, slot)`, lowest rank (first to go) first: eviction looks at
    /// the few it needs instead of ranking the whole cache, which holds tens of thousands of
    /// clusters at the 7B scale.
    order: SlotHeap,
    /// Activity remembered for clusters that are not resident (0 until observed), so a re-read
    /// cluster keeps its rank.
    history: Vec<f32>,
    retention: Retention,
    clock: u64,
    /// When each cluster is next used (Belady only; [`NEVER`] otherwise).
    next_use: Vec<u64>,
    /// The data of evicted clusters, until the owner takes it back ([`NeuronCache::drain_evicted`]).
    evicted: Vec<B>,
    /// Scratch of [`NeuronCache::offer`]: the entries it would evict, as `(rank, slot)`.
    victims: Vec<(u64, u32)>,
}

impl<B: Deref<Target = [u8]>> NeuronCache<B> {
    pub fn new(capacity: u64, retention: Retention, slots: ClusterSlots) -> Self {
        let n = slots.len();
        Self {
            capacity,
            used: 0,
            slots,
            entries: std::iter::repeat_with(|| None).take(n).collect(),
            order: SlotHeap::new(n),
            history: vec![0.0; n],
            retention,
            clock: 0,
            next_use: vec![NEVER; n],
            evicted: Vec::new(),
            victims: Vec::new(),
        }
    }

    /// The data of clusters evicted since the last call, for the owner to reuse.
    pub fn drain_evicted(&mut self) -> std::vec::Drain<'_, B> {
        self.evicted.drain(..)
    }

    /// Sets what is believed of a cluster before it is ever observed (the profile's activity
    /// frequency), so the first tokens rank clusters by the profile rather than all alike.
    pub fn set_prior(&mut self, key: ClusterKey, freq: f32) {
        let s = self.slots.of(key);
        match &mut self.entries[s] {
            Some(e) => {
                e.freq = freq;
                self.rerank(s);
            }
            None => self.history[s] = freq,
        }
    }

    /// The numbering of the file's clusters this cache was made for.
    pub fn slots(&self) -> &ClusterSlots {
        &self.slots
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// A new capacity (the budget changed). Shrinking evicts until what is held fits: the
    /// lowest-ranked unpinned clusters first, then pinned ones, the profile's coldest first (a
    /// hot set chosen for a larger budget cannot stay whole in a smaller one). Growing keeps
    /// everything; later reads fill the room. The evicted data is for the owner to take and free;
    /// returns the evicted clusters' slots.
    pub fn set_capacity(&mut self, capacity: u64) -> Vec<usize> {
        self.capacity = capacity;
        let mut evicted = Vec::new();
        while self.used > capacity {
            let Some((_, s)) = self.order.first() else {
                break;
            };
            self.evict(s as usize);
            evicted.push(s as usize);
        }
        if self.used > capacity {
            let mut pinned: Vec<(f32, usize)> = (self.entries.iter().enumerate())
                .filter_map(|(s, e)| e.as_ref().map(|e| (e.freq, s)))
                .collect();
            pinned.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            for (_, s) in pinned {
                if self.used <= capacity {
                    break;
                }
                self.evict(s);
                evicted.push(s);
            }
        }
        evicted
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn contains(&self, key: ClusterKey) -> bool {
        self.entries[self.slots.of(key)].is_some()
    }

    /// The cluster's bytes, if resident.
    pub fn get(&self, key: ClusterKey) -> Option<&[u8]> {
        self.entries[self.slots.of(key)].as_ref().map(|e| &*e.data)
    }

    /// The cluster's data, if resident, to change in place (the same bytes laid out otherwise:
    /// its size as counted stays).
    pub fn get_mut(&mut self, key: ClusterKey) -> Option<&mut B> {
        let s = self.slots.of(key);
        self.entries[s].as_mut().map(|e| &mut e.data)
    }

    /// Gives a resident cluster new data, counted as before; returns the old (`None`, `data`
    /// dropped, where the cluster is not resident).
    pub fn replace(&mut self, key: ClusterKey, data: B) -> Option<B> {
        let e = self.entries[self.slots.of(key)].as_mut()?;
        Some(std::mem::replace(&mut e.data, data))
    }

    /// Advances the clock: call once per token. A window drops what fell out of it.
    pub fn tick(&mut self) {
        self.clock += 1;
        if let Retention::Window(k) = self.retention {
            // Ranked by last use: the ones that fell out of the window come first.
            let clock = self.clock;
            while let Some((last_used, s)) = self.order.first() {
                if clock - last_used.min(clock) <= k as u64 {
                    break;
                }
                self.evict(s as usize);
            }
        }
    }

    /// Tells a Belady cache when `key` is next used (`None`: never again).
    pub fn set_next_use(&mut self, key: ClusterKey, at: Option<u64>) {
        let s = self.slots.of(key);
        self.next_use[s] = at.unwrap_or(NEVER);
        self.rerank(s);
    }

    /// Pins a cluster of the profile's hot set. Fails (returns false) when it does not fit.
    pub fn pin(&mut self, key: ClusterKey, data: B, prior_freq: f32) -> bool {
        let bytes = data.len() as u64;
        self.pin_sized(key, data, bytes, prior_freq)
    }

    /// [`NeuronCache::pin`] of a cluster counted as `bytes` whatever `data` holds: its bytes are
    /// held elsewhere (a layer kept whole in runs), `data` standing in for them.
    pub fn pin_sized(&mut self, key: ClusterKey, data: B, bytes: u64, prior_freq: f32) -> bool {
        if self.used + bytes > self.capacity {
            return false;
        }
        self.used += bytes;
        let e = Entry {
            data,
            bytes,
            pinned: true,
            freq: prior_freq,
            last_used: self.clock,
            rank: 0,
        };
        self.entries[self.slots.of(key)] = Some(e);
        true
    }

    /// Records whether any of the cluster's neurons was active when its layer ran.
    pub fn observe(&mut self, key: ClusterKey, active: bool) {
        let s = self.slots.of(key);
        let clock = self.clock;
        let update = |freq: &mut f32| *freq += EMA * ((active as u8 as f32) - *freq);
        match &mut self.entries[s] {
            Some(e) => {
                update(&mut e.freq);
                if active {
                    e.last_used = clock;
                }
                if !e.pinned {
                    self.rerank(s);
                }
            }
            None => update(&mut self.history[s]),
        }
    }

    /// Offers a freshly read cluster. It is kept if there is room, or if evicting lower-ranked
    /// unpinned clusters makes room; otherwise it is dropped (returned as `Some`).
    pub fn offer(&mut self, key: ClusterKey, data: B) -> Option<B> {
        let s = self.slots.of(key);
        let bytes = data.len() as u64;
        if bytes > self.capacity || self.entries[s].is_some() {
            return Some(data);
        }
        let mut candidate = Entry {
            data,
            bytes,
            pinned: false,
            freq: self.history[s],
            last_used: self.clock,
            rank: 0,
        };
        candidate.rank = self.rank(s, &candidate);
        // The lowest-ranked entries come out in order until the newcomer fits; they go back if it
        // does not outrank them all.
        self.victims.clear();
        let mut freed = 0;
        let mut fits = true;
        while self.used - freed + bytes > self.capacity {
            match self.order.pop() {
                Some((rank, v)) if rank < candidate.rank => {
                    freed += self.entries[v as usize].as_ref().expect("ranked").bytes;
                    self.victims.push((rank, v));
                }
                lowest => {
                    if let Some((rank, v)) = lowest {
                        self.order.insert(rank, v);
                    }
                    fits = false;
                    break;
                }
            }
        }
        if !fits {
            for &(rank, v) in &self.victims {
                self.order.insert(rank, v);
            }
            return Some(candidate.data);
        }
        for i in 0..self.victims.len() {
            self.evict(self.victims[i].1 as usize);
        }
        self.used += bytes;
        self.order.insert(candidate.rank, s as u32);
        self.entries[s] = Some(candidate);
        None
    }

    fn evict(&mut self, s: usize) {
        let e = self.entries[s].take().expect("evicting a resident cluster");
        self.order.remove(s as u32);
        self.used -= e.bytes;
        self.history[s] = e.freq;
        self.evicted.push(e.data);
    }

    /// Moves an unpinned resident entry to where its current state ranks it.
    fn rerank(&mut self, s: usize) {
        let Some(e) = &self.entries[s] else {
            return;
        };
        if e.pinned {
            return;
        }
        let rank = self.rank(s, e);
        if rank == e.rank {
            return;
        }
        self.entries[s].as_mut().expect("resident").rank = rank;
        self.order.remove(s as u32);
        self.order.insert(rank, s as u32);
    }

    /// Higher is kept longer. Each rule's order is fixed between the updates that `rerank`
    /// (LRU: last use, the same order as age at any clock; activity: the frequency, whose
    /// non-negative `f32` bits order as the values; Belady: the next use, never = lowest).
    fn rank(&self, s: usize, e: &Entry<B>) -> u64 {
        match self.retention {
            Retention::Lru | Retention::Window(_) => e.last_used,
            Retention::Activity => e.freq.max(0.0).to_bits() as u64,
            Retention::Belady => u64::MAX - self.next_use[s],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(n: usize) -> Vec<u8> {
        vec![0; n]
    }

    fn slots() -> ClusterSlots {
        ClusterSlots::new([8, 8])
    }

    #[test]
    fn slots_number_the_clusters_layer_after_layer() {
        let slots = ClusterSlots::new([3, 0, 2]);
        assert_eq!(slots.len(), 5);
        assert_eq!(slots.of((0, 0)), 0);
        assert_eq!(slots.of((0, 2)), 2);
        assert_eq!(slots.of((2, 0)), 3);
        assert_eq!(slots.of((2, 1)), 4);
        // A cluster past its layer's end is a caller's bug, never another layer's slot.
        assert!(std::panic::catch_unwind(|| slots.of((0, 3))).is_err());
        assert!(std::panic::catch_unwind(|| slots.of((1, 0))).is_err());
    }

    #[test]
    fn keeps_what_is_used_and_never_evicts_pins() {
        let mut c = NeuronCache::new(3 * 4096, Retention::Activity, slots());
        assert!(c.pin((0, 0), buf(4096), 0.9));
        assert!(c.offer((0, 1), buf(4096)).is_none());
        assert!(c.offer((0, 2), buf(4096)).is_none());
        for _ in 0..10 {
            c.tick();
            c.observe((0, 1), true);
            c.observe((0, 2), false);
            c.observe((0, 3), true);
        }
        // (0, 3) has been active; it displaces the idle (0, 2), not the busy (0, 1) or the pin.
        assert!(c.offer((0, 3), buf(4096)).is_none());
        assert!(c.contains((0, 0)) && c.contains((0, 1)) && c.contains((0, 3)));
        assert!(!c.contains((0, 2)));
        assert_eq!(c.used(), 3 * 4096);
        // An idle newcomer does not displace active clusters.
        assert!(c.offer((0, 4), buf(4096)).is_some());
    }

    #[test]
    fn the_profile_ranks_clusters_until_use_says_otherwise() {
        let mut c = NeuronCache::new(2 * 4096, Retention::Activity, slots());
        c.set_prior((0, 0), 0.9);
        c.set_prior((0, 1), 0.2);
        c.set_prior((0, 2), 0.5);
        assert!(c.offer((0, 0), buf(4096)).is_none());
        assert!(c.offer((0, 1), buf(4096)).is_none());
        // Hotter in the profile than (0, 1): it takes that place, whose buffer is handed back.
        assert!(c.offer((0, 2), buf(4096)).is_none());
        assert!(!c.contains((0, 1)));
        assert_eq!(c.drain_evicted().count(), 1);
        assert_eq!(c.drain_evicted().count(), 0);
        // Tokens never use (0, 0): its rank decays below (0, 1)'s, which they use.
        for _ in 0..60 {
            c.tick();
            c.observe((0, 0), false);
            c.observe((0, 1), true);
        }
        assert!(c.offer((0, 1), buf(4096)).is_none());
        assert!(c.contains((0, 1)) && !c.contains((0, 0)));
    }

    #[test]
    fn shrinking_evicts_the_lowest_ranked_then_the_coldest_pins() {
        let mut c = NeuronCache::new(4 * 4096, Retention::Activity, slots());
        assert!(c.pin((0, 0), buf(4096), 0.9));
        assert!(c.pin((0, 1), buf(4096), 0.4));
        c.set_prior((1, 0), 0.7);
        c.set_prior((1, 1), 0.1);
        assert!(c.offer((1, 0), buf(4096)).is_none());
        assert!(c.offer((1, 1), buf(4096)).is_none());
        let slot = |key| slots().of(key);
        assert_eq!(c.set_capacity(3 * 4096), [slot((1, 1))]);
        assert!(!c.contains((1, 1)) && c.contains((1, 0)));
        // Every unpinned one, then the colder pin.
        assert_eq!(c.set_capacity(4096 + 100), [slot((1, 0)), slot((0, 1))]);
        assert!(c.contains((0, 0)) && !c.contains((0, 1)) && !c.contains((1, 0)));
        assert_eq!((c.used(), c.drain_evicted().len()), (4096, 3));
        assert_eq!(c.set_capacity(0), [slot((0, 0))]);
        assert_eq!((c.used(), c.drain_evicted().len()), (0, 1));
        // Grown again: room for newcomers, and their history kept their rank.
        c.set_capacity(2 * 4096);
        assert!(c.offer((1, 0), buf(4096)).is_none());
        assert!(c.offer((1, 1), buf(4096)).is_none());
        assert_eq!(c.capacity(), 2 * 4096);
    }

    #[test]
    fn lru_evicts_the_oldest() {
        let mut c = NeuronCache::new(2 * 4096, Retention::Lru, slots());
        c.offer((1, 0), buf(4096));
        c.tick();
        c.offer((1, 1), buf(4096));
        c.tick();
        c.observe((1, 0), true);
        c.tick();
        assert!(c.offer((1, 2), buf(4096)).is_none());
        assert!(c.contains((1, 0)) && c.contains((1, 2)) && !c.contains((1, 1)));
    }

    #[test]
    fn a_window_drops_what_fell_out_of_it() {
        let mut c = NeuronCache::new(4 * 4096, Retention::Window(2), slots());
        c.offer((0, 0), buf(4096));
        c.offer((0, 1), buf(4096));
        for _ in 0..2 {
            c.tick();
            c.observe((0, 1), true);
        }
        assert!(c.contains((0, 0)) && c.contains((0, 1)));
        c.tick();
        // (0, 0) was last used 3 tokens ago: out of the window of 2.
        assert!(!c.contains((0, 0)) && c.contains((0, 1)));
        assert_eq!(c.used(), 4096);
    }

    #[test]
    fn belady_evicts_the_farthest_next_use_and_bypasses_later_ones() {
        let mut c = NeuronCache::new(2 * 4096, Retention::Belady, slots());
        c.set_next_use((0, 0), Some(5));
        c.set_next_use((0, 1), Some(9));
        c.offer((0, 0), buf(4096));
        c.offer((0, 1), buf(4096));
        // Used at 7: (0, 1), used at 9, goes.
        c.set_next_use((0, 2), Some(7));
        assert!(c.offer((0, 2), buf(4096)).is_none());
        assert!(c.contains((0, 0)) && c.contains((0, 2)) && !c.contains((0, 1)));
        // Never used again: not kept.
        c.set_next_use((0, 3), None);
        assert!(c.offer((0, 3), buf(4096)).is_some());
    }
}
