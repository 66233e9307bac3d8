//! `leanstream`: speculate and refine. When the residual entering layer l exists, the look-ahead
//! predictor of layer l+1 queues reads of the clusters it believes active, most likely first,
//! within the I/O budget, on the tokens where speculating measurably pays (see
//! [`SpeculationGate`]); when a layer's needs are known, reads no longer wanted are cancelled and
//! wanted ones boosted; speculative reads use at most a quarter of the device's slots, so the
//! ones still waiting are there to cancel. A layer that needs every cluster whatever its input
//! (certified, without a certificate) has nothing to guess: its uncached clusters are read ahead
//! for certain, layer after layer up to a token ahead, as far as the I/O budget allows, and need
//! no look-ahead predictor. The cache starts with the profile's hottest clusters and keeps what
//! tokens used. Ablations switch off the look-ahead, the refinement, or only its
//! cancelling.

use anyhow::Result;

use super::engine::{Core, Refine, SPECULATIVE_MAX, URGENT};
use super::predict::above_into;
use super::schedule::{hot_order, pin_all_in_runs, pin_hottest, pin_layers_in_runs, Schedule};
use super::speculation_gate::SpeculationGate;
use super::tuning::Tuning;

/// Share of the neuron cache pinned with the profile's hottest clusters (`--hot-fraction`); the
/// rest also starts with the profile's hottest, but observed use may replace them. On the embedded
/// model at the minimum + 25 % of the FFN, pinning nothing kept the most of what tokens used (hit
/// rate 0.327 against 0.318 with half pinned and 0.313 with all pinned, as powerinfer2 does).
const HOT_FRACTION: f32 = 0.0;

/// Which tokens speculate.
enum Speculation {
    /// None (`--no-lookahead`).
    Never,
    /// Every one, the gate bypassed (`--always-lookahead`).
    Always,
    /// Those where it measurably pays.
    Gated(SpeculationGate),
}

pub(super) struct Leanstream {
    hot_fraction: f32,
    speculation: Speculation,
    /// The current token speculates.
    speculating: bool,
    refine: bool,
    cancel: bool,
    /// Per layer: the stored positions the look-ahead predicted active for the current token,
    /// valid while the flag is set (kept between tokens: the token loop does not allocate them).
    lookahead_sets: Vec<(bool, Vec<bool>)>,
    /// Scratch of [`Leanstream::speculate`], kept between layers.
    scratch: Scratch,
    /// The first step (token × layers + layer) whose certain reads are not all queued yet, and
    /// in it the first cluster not looked at ([`Leanstream::read_ahead`]).
    ahead: u64,
    ahead_cluster: usize,
    /// The layer and token being computed.
    current: (usize, usize),
}

/// What speculating on a layer works in.
#[derive(Default)]
struct Scratch {
    normalised: Vec<f32>,
    scores: Vec<f32>,
    /// The clusters worth reading, as (best score, cluster).
    wanted: Vec<(f32, usize)>,
    reads: Vec<((u32, u32), u32)>,
}

impl Leanstream {
    pub fn new(tuning: &Tuning, layers: usize) -> Self {
        Self {
            hot_fraction: tuning.hot_fraction.unwrap_or(HOT_FRACTION),
            speculation: match (tuning.lookahead, tuning.always_lookahead) {
                (false, _) => Speculation::Never,
                (true, true) => Speculation::Always,
                (true, false) => Speculation::Gated(SpeculationGate::default()),
            },
            speculating: false,
            refine: tuning.refine,
            cancel: tuning.cancel,
            lookahead_sets: vec![(false, Vec::new()); layers],
            scratch: Scratch::default(),
            ahead: 0,
            ahead_cluster: 0,
            current: (0, 0),
        }
    }

    /// Queues the certain reads of the steps from layer `l` of `token` on: the uncached clusters
    /// of every layer that needs them all ([`Core::needs_every_cluster`]), the nearest step first
    /// and at the higher priority, while they fit the I/O budget — up to a token ahead while
    /// decoding, within the call in a prompt chunk (no token may follow it). Called at each layer's
    /// start and end and whenever a read is taken, it resumes where it stopped (clusters already
    /// looked at are not looked at again, so each call costs what it queues); a cluster evicted
    /// after it was passed is read when its layer comes (a late read).
    fn read_ahead(&mut self, core: &mut Core, l: usize, token: usize) {
        let layers = core.plans.len() as u64;
        let now = token as u64 * layers + l as u64;
        let horizon = match core.call_len {
            1 => now + layers,
            _ => (token as u64 + 1) * layers,
        };
        if self.ahead < now {
            self.ahead = now;
            self.ahead_cluster = 0;
        }
        let reads = &mut self.scratch.reads;
        reads.clear();
        let mut room = 0;
        'steps: while self.ahead < horizon {
            let target = (self.ahead % layers) as usize;
            if core.needs_every_cluster(target) {
                // Below the late reads, above every guess.
                let priority = URGENT - 1 - (self.ahead - now) as u32;
                let clusters = &core.plans[target].clusters;
                while let Some(cl) = clusters.get(self.ahead_cluster) {
                    let key = (target as u32, self.ahead_cluster as u32);
                    if !core.cache.contains(key) && !core.is_pending(key) {
                        if !core.has_room(room + cl.size) {
                            break 'steps;
                        }
                        room += cl.size;
                        reads.push((key, priority));
                    }
                    self.ahead_cluster += 1;
                }
            }
            self.ahead += 1;
            self.ahead_cluster = 0;
        }
        core.request_all(reads);
    }

    /// Queues reads of the clusters layer `target`'s look-ahead predictor expects from `residual`.
    fn speculate(&mut self, core: &mut Core, target: usize, residual: &[f32]) {
        let start = std::time::Instant::now();
        let plan = &core.plans[target];
        // Nothing to read ahead (and no predictor to run) when the whole layer is in memory or on
        // its way — at budgets that hold the FFN, speculation then costs nothing — or when the
        // layer's reads are certain ([`Leanstream::read_ahead`]).
        let all_there = core.needs_every_cluster(target)
            || (0..plan.clusters.len()).all(|ci| {
                let key = (target as u32, ci as u32);
                core.cache.contains(key) || core.is_pending(key)
            });
        if all_there {
            self.lookahead_sets[target].0 = false;
            return;
        }
        let lookahead = plan
            .lookahead
            .as_ref()
            .expect("resident where the policy speculates");
        let s = &mut self.scratch;
        lookahead.scores_into(residual, &mut s.normalised, &mut s.scores);
        let (scores, threshold) = (&s.scores, lookahead.threshold);
        s.wanted.clear();
        s.wanted.extend(
            plan.clusters
                .iter()
                .enumerate()
                .map(|(ci, cl)| {
                    let best = scores[cl.first..cl.first + cl.count]
                        .iter()
                        .copied()
                        .fold(0.0f32, f32::max);
                    (best, ci)
                })
                .filter(|&(best, _)| best >= threshold),
        );
        // Most likely first, ties in cluster order: what a stable sort by score gives, without
        // its buffer.
        s.wanted
            .sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        s.reads.clear();
        let mut room = 0;
        for &(score, ci) in &s.wanted {
            let key = (target as u32, ci as u32);
            if core.cache.contains(key) || core.is_pending(key) {
                continue;
            }
            room += core.plans[target].clusters[ci].size;
            if !core.has_room(room) {
                break;
            }
            s.reads
                .push((key, (score.clamp(0.0, 1.0) * SPECULATIVE_MAX as f32) as u32));
        }
        core.metrics.speculative_reads += core.request_all(&s.reads) as u64;
        let (valid, set) = &mut self.lookahead_sets[target];
        above_into(&s.scores, threshold, set);
        *valid = true;
        core.metrics.select_s += start.elapsed().as_secs_f64();
    }
}

impl Schedule for Leanstream {
    fn warm(&mut self, core: &mut Core) -> Result<()> {
        // Guesses take at most a quarter of the device's slots (on `ufs4`, 8 slots of 32 KiB
        // reads still move more than its bandwidth): demanded reads never queue behind them, and
        // the guesses still waiting can be withdrawn when refinement proves them wrong.
        let slots = (core.io.device().queue_depth() / 4).max(1);
        core.io.limit_background(SPECULATIVE_MAX + 1, slots);
        let order = hot_order(core);
        for &(freq, key) in &order {
            core.cache.set_prior(key, freq);
        }
        // A cache that holds the whole file keeps every layer whole, as `resident` does (a
        // smaller budget later gives the runs up, `StreamEngine::set_cache_capacity`).
        if pin_all_in_runs(core)? {
            return Ok(());
        }
        pin_layers_in_runs(core)?;
        let limit = (core.cache.capacity() as f64 * self.hot_fraction as f64) as u64;
        pin_hottest(core, &order, limit)?;
        // The rest of the cache starts with the next hottest, unpinned: use may replace them.
        for &(_, key) in &order {
            let size = core.plans[key.0 as usize].clusters[key.1 as usize].size;
            if core.cache.used() + size <= core.cache.capacity() && !core.cache.contains(key) {
                let bytes = core.read_now(key)?;
                core.offer(key, bytes);
            }
        }
        Ok(())
    }

    fn begin_layer(
        &mut self,
        core: &mut Core,
        l: usize,
        token: usize,
        residual: &[f32],
    ) -> Result<()> {
        self.current = (l, token);
        self.read_ahead(core, l, token);
        if l == 0 {
            self.speculating = match &mut self.speculation {
                Speculation::Never => false,
                Speculation::Always => true,
                Speculation::Gated(gate) => gate.begin_token(token),
            };
            core.metrics.speculating_tokens += u64::from(self.speculating);
        }
        if !self.speculating {
            return Ok(());
        }
        if l == 0 {
            self.speculate(core, 0, residual);
        }
        if l + 1 < core.plans.len() {
            self.speculate(core, l + 1, residual);
        }
        Ok(())
    }

    fn refine(&self) -> Refine {
        Refine {
            boost: self.refine,
            cancel: self.refine && self.cancel,
            reap: true,
        }
    }

    /// The certain reads after the layer's are queued.
    fn taken(&mut self, core: &mut Core) {
        let (l, token) = self.current;
        self.read_ahead(core, l, token);
    }

    fn lookahead_set(&mut self, l: usize) -> Option<&[bool]> {
        let (valid, set) = &mut self.lookahead_sets[l];
        std::mem::take(valid).then_some(&set[..])
    }

    /// The layer's reads are taken, so the I/O budget has room again: the certain reads of the
    /// steps after it are queued now rather than when the next layer begins, so that the device
    /// does not idle through the layer's compute.
    fn end_layer(&mut self, core: &mut Core, l: usize, token: usize, _: &[usize]) -> Result<()> {
        if l + 1 < core.plans.len() {
            self.read_ahead(core, l + 1, token);
        } else if core.call_len == 1 {
            self.read_ahead(core, 0, token + 1);
        }
        Ok(())
    }
}
