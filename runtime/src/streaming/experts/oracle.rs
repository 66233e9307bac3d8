//! The expert oracle: the experts each token chose in each layer, recorded from a resident run of
//! the same tokens, known in advance. A stream given it (`bench`'s `expert-oracle`) reads the next
//! layer's true experts where leanstream reads the next router's guesses, and evicts the resident
//! expert whose next use lies furthest ahead (Belady) — the limit of speculation and retention
//! with the same slots.

use std::path::Path;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// Per position (one token per forward call, from an empty cache), per layer, the experts chosen
/// (most probable first; empty for a dense layer).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ExpertTrace {
    pub layers: usize,
    pub experts: usize,
    pub chosen: Vec<Vec<Vec<u16>>>,
}

impl ExpertTrace {
    /// Records `tokens` through the mixture at `path` with every expert resident, one token per
    /// call from an empty cache of `ctx` positions stored as `kv` (the runs' own: its rounding
    /// decides close routings).
    pub fn record(
        path: &Path,
        tokens: &[u32],
        ctx: usize,
        kv: crate::model::kv_cache::KvType,
    ) -> Result<Self> {
        if tokens.len() > ctx {
            bail!(
                "{} tokens do not fit in --ctx {ctx} for the expert trace",
                tokens.len()
            );
        }
        let file = leanstream_format::LsbFile::open(path)?;
        let o = super::ExpertOptions {
            memory: None,
            flash: None,
            ctx,
            kv,
            tokenizer_bytes: 0,
            lookahead: false,
            oracle: None,
        };
        let mut model = super::ExpertModel::open(path, file, &o)?;
        model.stream.record = Some(Vec::with_capacity(tokens.len()));
        let mut cache = crate::model::LanguageModel::new_cache(&model, ctx);
        let mut logits = Vec::new();
        for &t in tokens {
            crate::model::LanguageModel::forward_into(
                &mut model,
                &[t],
                &mut cache,
                false,
                &mut logits,
            )?;
        }
        let c = crate::model::LanguageModel::config(&model);
        Ok(Self {
            layers: c.num_layers,
            experts: c.moe.as_ref().map_or(0, |m| m.num_experts),
            chosen: model.stream.record.take().unwrap_or_default(),
        })
    }
}

/// A stream's use of the trace: each expert's positions of use, and how far each has been passed.
pub(super) struct Oracle {
    pub trace: std::sync::Arc<ExpertTrace>,
    /// Per expert id (`layer × experts + expert`), the positions that choose it, ascending.
    uses: Vec<Vec<u32>>,
    /// Per expert id, the first entry of `uses` not yet passed.
    next: Vec<usize>,
}

impl Oracle {
    pub fn new(trace: std::sync::Arc<ExpertTrace>, layers: usize, experts: usize) -> Self {
        let mut uses = vec![Vec::new(); layers * experts];
        for (p, by_layer) in trace.chosen.iter().enumerate() {
            for (l, chosen) in by_layer.iter().enumerate().take(layers) {
                for &e in chosen {
                    uses[l * experts + e as usize].push(p as u32);
                }
            }
        }
        Self {
            trace,
            next: vec![0; uses.len()],
            uses,
        }
    }

    /// The experts layer `l` chooses at position `pos`, if recorded.
    pub fn chosen(&self, pos: usize, l: usize) -> Option<&[u16]> {
        self.trace
            .chosen
            .get(pos)
            .and_then(|by_layer| by_layer.get(l))
            .map(Vec::as_slice)
    }

    /// The retention score of expert `id` of layer `l` once position `after` has run there:
    /// minus its next use's step (`position × layers + layer`), so that the furthest next use is
    /// the lowest score and goes first; never used again is the lowest of all.
    pub fn score_after(&mut self, id: usize, l: usize, layers: usize, after: Option<usize>) -> f32 {
        let u = &self.uses[id];
        let n = &mut self.next[id];
        if let Some(after) = after {
            while *n < u.len() && u[*n] as usize <= after {
                *n += 1;
            }
        }
        match u.get(*n) {
            Some(&p) => -((p as usize * layers + l) as f32),
            None => f32::MIN,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_put_the_furthest_next_use_lowest() {
        // 2 layers of 3 experts; positions 0..3.
        let trace = ExpertTrace {
            layers: 2,
            experts: 3,
            chosen: vec![
                vec![vec![0], vec![1]],
                vec![vec![1], vec![1]],
                vec![vec![0], vec![2]],
            ],
        };
        let mut o = Oracle::new(std::sync::Arc::new(trace), 2, 3);
        assert_eq!(o.chosen(1, 0), Some(&[1u16][..]));
        assert_eq!(o.chosen(3, 0), None);
        // Before anything ran: expert 0 of layer 0 is next used at position 0 (step 0).
        assert_eq!(o.score_after(0, 0, 2, None), 0.0);
        // After position 0: at position 2 (step 4); expert 1 of layer 0 at position 1 (step 2).
        assert_eq!(o.score_after(0, 0, 2, Some(0)), -4.0);
        assert_eq!(o.score_after(1, 0, 2, Some(0)), -2.0);
        // Layer 1's expert 1 (id 4) after position 1: never again.
        assert_eq!(o.score_after(4, 1, 2, Some(1)), f32::MIN);
    }
}
