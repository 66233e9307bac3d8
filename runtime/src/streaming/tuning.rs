//! The knobs of the streaming policies: leanstream's ablations, the prior systems' settings and
//! the oracle's trace. Defaults are each policy's best fixed choice.

use std::sync::Arc;

use crate::streaming::neuron_cache::Retention;

use super::trace::ActiveTrace;

#[derive(Debug, Clone)]
pub struct Tuning {
    /// leanstream: speculate with the look-ahead predictors (`--no-lookahead` turns it off).
    pub lookahead: bool,
    /// leanstream: speculate on every token rather than where it measurably pays
    /// (`--always-lookahead`, an ablation of the speculation gate).
    pub always_lookahead: bool,
    /// leanstream: how the dynamic part of the cache ranks clusters (`--retain`).
    pub retention: Retention,
    /// leanstream: refine queued reads from the layer's needs (`--no-refine` turns it off).
    pub refine: bool,
    /// leanstream: refinement may cancel reads (`--no-cancel` keeps boosting and adding only).
    pub cancel: bool,
    /// powerinfer2 and leanstream: the pinned hot set as a fraction of the neuron cache
    /// (`--hot-fraction`).
    pub hot_fraction: Option<f32>,
    /// llm-in-flash: the window k in tokens (`--window`).
    pub window: Option<usize>,
    /// The true active sets of the tokens to come: the oracle's knowledge, and the truth the
    /// metrics of any policy use when given.
    pub oracle: Option<Arc<ActiveTrace>>,
    /// oracle: compute every neuron of the clusters it holds, as the exact engine does, rather
    /// than only the active ones (`bench`'s `oracle-exact`; see the oracle's module).
    pub oracle_exact_compute: bool,
    /// A mixture's expert oracle (`bench`'s `expert-oracle`): each token's true experts.
    pub expert_oracle: Option<Arc<super::experts::ExpertTrace>>,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            lookahead: true,
            always_lookahead: false,
            retention: Retention::Activity,
            refine: true,
            cancel: true,
            hot_fraction: None,
            window: None,
            oracle: None,
            oracle_exact_compute: false,
            expert_oracle: None,
        }
    }
}
