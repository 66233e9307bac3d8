//! How a memory budget splits for a streamed mixture of experts: the fixed part (start-up, the
//! norms and routers as f32, the KV cache, activations, the dense weights — embedding, attention,
//! output head — resident as stored or streamed from flash through a few buffers), then whole
//! expert slots. The least a run needs is `2k` slots: the `k` experts a layer runs, read at once,
//! and `k` for the next layer's speculative reads; every slot beyond holds an expert for reuse.
//!
//! Dense weights stream only when the budget cannot hold them beside `2k` slots, cheapest first:
//! the embedding (one row read per token), then the output head, then the attention projections
//! (each read whole on every token: as many bytes read per token as they free).

use anyhow::{bail, Result};
use serde::Serialize;

use crate::platform::memory_size::format_size;
use crate::streaming::planner::{DenseSizes, DenseStreamed};

/// What the split is made from (bytes).
#[derive(Clone, Debug)]
pub struct PlanInput {
    /// Everything fixed except the dense weights that may stream: start-up and tokenizer, norms
    /// and routers (f32), any dense FFN layer, the KV cache, activations.
    pub base: u64,
    /// The embedding, attention and head as held when resident (encoded, or f32).
    pub dense: u64,
    /// Their stored sizes and streaming buffers.
    pub sizes: DenseSizes,
    /// Bytes of one expert slot (the largest expert's extent on flash).
    pub expert_bytes: u64,
    pub experts: usize,
    /// Experts per token.
    pub k: usize,
}

impl PlanInput {
    /// The dense choices, fewest streaming first.
    fn choices(&self) -> Vec<DenseStreamed> {
        let embedding = DenseStreamed {
            embedding: true,
            // A tied head is the embedding: they stream together.
            head: self.sizes.tied,
            attention: false,
        };
        let head = DenseStreamed {
            head: true,
            ..embedding
        };
        let all = DenseStreamed {
            attention: true,
            ..head
        };
        let mut v = vec![DenseStreamed::default(), embedding, head, all];
        v.dedup();
        v
    }

    /// The fixed bytes under `s`: (total fixed, dense resident, dense buffers).
    fn fixed(&self, s: DenseStreamed) -> (u64, u64, u64) {
        let z = &self.sizes;
        let mut dense = self.dense;
        let mut buffers = 0;
        let head_streams = s.head || (z.tied && s.embedding);
        for (on, bytes, bufs) in [
            (s.attention, z.attention, z.attention_buffers),
            (head_streams, z.head, z.head_buffers),
            (s.embedding, z.embedding, z.embedding_buffers),
        ] {
            if on {
                dense -= bytes.min(dense);
                buffers += bufs;
            }
        }
        (self.base + dense + buffers, dense, buffers)
    }

    /// The least budget a run accepts: every dense weight streamed, `2k` slots.
    pub fn minimum(&self) -> u64 {
        let least = ExpertSplit::min_slots(self.k) as u64 * self.expert_bytes;
        self.choices()
            .into_iter()
            .map(|s| self.fixed(s).0 + least)
            .min()
            .expect("a choice")
    }
}

/// The split of one budget.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExpertSplit {
    /// Bytes that do not depend on the budget (with the dense weights below).
    pub fixed: u64,
    /// Dense weights resident (embedding, attention, head, as held).
    pub dense: u64,
    /// Which dense weights stream from flash.
    pub dense_streamed: DenseStreamed,
    /// Their read buffers and page hashes.
    pub dense_buffers: u64,
    /// Bytes of one expert slot (the largest expert's extent on flash).
    pub expert_bytes: u64,
    /// Expert slots: resident experts and reads in flight.
    pub slots: usize,
    /// Of those, the most that speculative reads may hold.
    pub speculative: usize,
    /// Every expert of the file.
    pub experts: usize,
    /// The least budget the file runs in (every dense weight streamed, `2k` slots).
    pub minimum: u64,
}

impl ExpertSplit {
    /// The least slots a run needs with `k` experts per token.
    pub fn min_slots(k: usize) -> usize {
        2 * k
    }

    pub fn total(&self) -> u64 {
        self.fixed + self.slots as u64 * self.expert_bytes
    }

    /// One line for stderr.
    pub fn describe(&self) -> String {
        let streaming = if self.dense_streamed == DenseStreamed::default() {
            String::new()
        } else {
            format!(
                "; streaming {} through {} of buffers",
                self.dense_streamed.describe(),
                format_size(self.dense_buffers)
            )
        };
        format!(
            "memory: {} fixed (dense weights {} as stored{streaming}; norms and routers f32, KV \
             cache, activations), {} expert slots of {} ({} of {} experts resident at most, {} \
             for speculative reads); minimum {}",
            format_size(self.fixed),
            format_size(self.dense),
            self.slots,
            format_size(self.expert_bytes),
            self.slots
                .saturating_sub(self.speculative)
                .min(self.experts),
            self.experts,
            self.speculative,
            format_size(self.minimum),
        )
    }
}

/// Splits `budget` (`None` = room for every expert, every dense weight resident): the fewest dense
/// weights streaming that leave `2k` slots, the rest to slots; refused below the minimum, which
/// the message names.
pub fn split(p: &PlanInput, budget: Option<u64>, what: &str) -> Result<ExpertSplit> {
    let (k, experts) = (p.k, p.experts);
    let least = ExpertSplit::min_slots(k);
    // More slots than every expert plus the reads of one layer hold nothing.
    let most = experts + least;
    let minimum = p.minimum();
    let choices = p.choices();
    let fits = |s: &DenseStreamed| match budget {
        None => true,
        Some(b) => p.fixed(*s).0 + least as u64 * p.expert_bytes <= b,
    };
    let Some(&s) = choices.iter().find(|s| fits(s)) else {
        let b = budget.expect("no budget always fits");
        let (fixed, _, _) = p.fixed(*choices.last().expect("a choice"));
        bail!(
            "--memory {} is below the minimum of {} for streaming the mixture of experts {what}: \
             {} fixed (norms and routers f32, KV cache, activations, the dense weights streamed \
             from flash) and {least} expert slots of {} (the {k} experts a layer runs and {k} \
             speculative reads): use --memory {} or more",
            format_size(b),
            format_size(minimum),
            format_size(fixed),
            format_size(p.expert_bytes),
            format_size(minimum),
        );
    };
    let (fixed, dense, dense_buffers) = p.fixed(s);
    let slots = match budget {
        None => most,
        Some(b) => (((b - fixed) / p.expert_bytes.max(1)) as usize).min(most),
    };
    Ok(ExpertSplit {
        fixed,
        dense,
        dense_streamed: s,
        dense_buffers,
        expert_bytes: p.expert_bytes,
        slots,
        speculative: k,
        experts,
        minimum,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 300 base; dense 200 = embedding 60 + head 40 + attention 100 (buffers 5 each); slots of
    /// 100, 24 experts, 2 per token.
    fn input(tied: bool) -> PlanInput {
        PlanInput {
            base: 300,
            dense: if tied { 160 } else { 200 },
            sizes: DenseSizes {
                total: 0,
                attention: 100,
                attention_buffers: 5,
                head: if tied { 0 } else { 40 },
                head_buffers: 5,
                embedding: 60,
                embedding_buffers: 5,
                tied,
            },
            expert_bytes: 100,
            experts: 24,
            k: 2,
        }
    }

    #[test]
    fn the_minimum_streams_every_dense_weight_and_the_refusal_names_it() {
        let p = input(false);
        // 300 + 15 buffers + 4 slots.
        assert_eq!(p.minimum(), 715);
        let s = split(&p, Some(715), "m.lsb").unwrap();
        assert_eq!((s.slots, s.total(), s.dense), (4, 715, 0));
        assert!(s.dense_streamed.attention && s.dense_streamed.head);
        let e = split(&p, Some(714), "m.lsb").unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("m.lsb") && msg.contains("use --memory 715 B or more"),
            "{msg}"
        );
    }

    #[test]
    fn dense_weights_stream_cheapest_first_only_below_them() {
        let p = input(false);
        // Everything resident: 500 + 4 slots.
        let s = split(&p, Some(900), "m").unwrap();
        assert_eq!((s.dense_streamed, s.slots), (DenseStreamed::default(), 4));
        // The embedding goes first (one row per token): 300 + 140 + 5 + 400.
        let s = split(&p, Some(845), "m").unwrap();
        assert_eq!(
            (s.dense_streamed.embedding, s.dense_streamed.head, s.dense),
            (true, false, 140)
        );
        // Then the head: 300 + 100 + 10 + 400.
        let s = split(&p, Some(810), "m").unwrap();
        assert_eq!(
            (s.dense_streamed.head, s.dense_streamed.attention, s.dense),
            (true, false, 100)
        );
        // A tied head streams with the embedding: its choices are three.
        let t = input(true);
        assert_eq!(t.choices().len(), 3);
        let s = split(&t, Some(300 + 100 + 10 + 400), "m").unwrap();
        assert!(s.dense_streamed.embedding && s.dense_streamed.head);
        assert_eq!(s.dense, 100);
    }

    #[test]
    fn slots_grow_with_the_budget_up_to_every_expert() {
        let p = input(false);
        assert_eq!(split(&p, Some(500 + 1050), "m").unwrap().slots, 10);
        assert_eq!(split(&p, Some(1 << 30), "m").unwrap().slots, 28);
        assert_eq!(split(&p, None, "m").unwrap().slots, 28);
    }
}
