//! `powerinfer2`, PowerInfer-2's published design in this engine: nothing is read before a
//! layer's FFN input exists; then the layer's own predictor names the clusters (predicted
//! sparsity), the missing ones are read at once and each is computed as its read lands (I/O and
//! compute overlapped per cluster within the layer; a bundle holds a neuron's gate, up and down
//! rows, so "gate first, then up/down of the active neurons" is one read per cluster here). A
//! static hot set from the profile is pinned; the rest of the cache is an LRU cold cache. No
//! cross-layer look-ahead, no refinement.

use anyhow::Result;

use super::engine::{Core, Refine};
use super::schedule::{hot_order, pin_hottest, Schedule};

/// The best fixed share of the cache pinned as the hot set. Swept over 0, ¼, ½, ¾ and 1 on the
/// embedded model at the minimum + 10, 25 and 50 % of the FFN with ufs4, pinning more read less
/// at every budget (1452 / 1015 / 482 KiB per token at 1 against 1539 / 1300 / 741 at 0): on
/// this model the LRU cold cache never earns its room back.
pub const DEFAULT_HOT_FRACTION: f32 = 1.0;

pub(super) struct PowerInfer2 {
    hot_fraction: f32,
}

impl PowerInfer2 {
    pub fn new(hot_fraction: f32) -> Self {
        Self { hot_fraction }
    }
}

impl Schedule for PowerInfer2 {
    fn warm(&mut self, core: &mut Core) -> Result<()> {
        let limit = (core.cache.capacity() as f64 * self.hot_fraction as f64) as u64;
        pin_hottest(core, &hot_order(core), limit)?;
        Ok(())
    }

    fn refine(&self) -> Refine {
        Refine {
            boost: false,
            cancel: false,
            reap: false,
        }
    }
}
