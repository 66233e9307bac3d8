//! `llm-in-flash`, LLM in a Flash's published design in this engine: the layer's predictor on its
//! FFN input names the clusters (predicted sparsity); the missing ones are read as bundles (a
//! neuron's rows lie together) and the layer computes once all have landed (load, then
//! compute); the cache is a window: what the last k tokens used stays, what fell out of the
//! window leaves (the cache's `Retention::Window`). No hot set, no look-ahead, no refinement.

use super::engine::Refine;
use super::schedule::Schedule;

/// The best fixed window k in tokens. Swept over 1, 3, 5, 10 and 20 on the embedded model at the
/// minimum + 10, 25 and 50 % of the FFN with ufs4: k = 1 read most (821 KiB per token at 50 %),
/// k ≥ 3 within 2 % of each other, 10 lowest or tied at every budget.
pub const DEFAULT_WINDOW: usize = 10;

pub(super) struct LlmInFlash;

impl Schedule for LlmInFlash {
    fn refine(&self) -> Refine {
        Refine {
            boost: false,
            cancel: false,
            reap: false,
        }
    }

    fn load_then_compute(&self) -> bool {
        true
    }
}
