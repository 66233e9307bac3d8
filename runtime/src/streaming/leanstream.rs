//! `leanstream`: speculate and refine. When the residual entering layer l exists, the look-ahead
//! predictor of layer l+1 queues reads of the clusters it believes active, most likely first,
//! within the I/O budget; when a layer's needs are known, reads no longer wanted are cancelled and
//! wanted ones boosted. Half the cache is pinned with the profile's hottest clusters; the rest
//! keeps what tokens used. Ablations switch off the look-ahead, the refinement, or only its
//! cancelling.

use anyhow::Result;

use super::engine::{above, predictor_scores, Core, Refine, SPECULATIVE_MAX};
use super::schedule::{hot_order, pin_hottest, Schedule};
use super::tuning::Tuning;

/// Share of the neuron cache pinned with the profile's hottest clusters (`--hot-fraction`).
const HOT_FRACTION: f32 = 0.5;

pub(super) struct Leanstream {
    hot_fraction: f32,
    lookahead: bool,
    refine: bool,
    cancel: bool,
    /// Per layer: the stored positions the look-ahead predicted active for the current token.
    lookahead_sets: Vec<Option<Vec<bool>>>,
}

impl Leanstream {
    pub fn new(tuning: &Tuning, layers: usize) -> Self {
        Self {
            hot_fraction: tuning.hot_fraction.unwrap_or(HOT_FRACTION),
            lookahead: tuning.lookahead,
            refine: tuning.refine,
            cancel: tuning.cancel,
            lookahead_sets: vec![None; layers],
        }
    }

    /// Queues reads of the clusters layer `target`'s look-ahead predictor expects from `residual`.
    fn speculate(&mut self, core: &mut Core, target: usize, residual: &[f32]) {
        let plan = &core.plans[target];
        let scores = predictor_scores(&plan.lookahead, residual);
        let threshold = plan.lookahead.threshold;
        let mut wanted: Vec<(f32, usize)> = plan
            .clusters
            .iter()
            .enumerate()
            .map(|(ci, cl)| {
                let best = scores[cl.first..cl.first + cl.count]
                    .iter()
                    .copied()
                    .fold(0.0f32, f32::max);
                (best, ci)
            })
            .filter(|&(best, _)| best >= threshold)
            .collect();
        wanted.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (score, ci) in wanted {
            let key = (target as u32, ci as u32);
            if core.cache.contains(key) || core.is_pending(key) {
                continue;
            }
            if !core.has_room(core.plans[target].clusters[ci].size) {
                break;
            }
            let priority = (score.clamp(0.0, 1.0) * SPECULATIVE_MAX as f32) as u32;
            core.request(key, priority);
            core.metrics.speculative_reads += 1;
        }
        self.lookahead_sets[target] = Some(above(&scores, threshold));
    }
}

impl Schedule for Leanstream {
    fn warm(&mut self, core: &mut Core) -> Result<()> {
        let limit = (core.cache.capacity() as f64 * self.hot_fraction as f64) as u64;
        pin_hottest(core, &hot_order(core), limit)?;
        Ok(())
    }

    fn begin_layer(&mut self, core: &mut Core, l: usize, _: usize, residual: &[f32]) -> Result<()> {
        if !self.lookahead {
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

    fn lookahead_set(&mut self, l: usize) -> Option<Vec<bool>> {
        self.lookahead_sets[l].take()
    }
}
