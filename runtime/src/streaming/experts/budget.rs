//! How a memory budget splits for a streamed mixture of experts: the fixed part (start-up, the
//! dense weights as stored, norms and routers as f32 — what `--policy resident` computes with — the KV
//! cache, activations and one decoded expert), then whole expert slots. The least a run needs is
//! `2k` slots: the `k` experts a layer runs, read at once, and `k` for the next layer's speculative
//! reads; every slot beyond holds an expert for reuse.

use anyhow::{bail, Result};
use serde::Serialize;

use crate::memory_size::format_size;

/// The split of one budget.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExpertSplit {
    /// Bytes that do not depend on the budget.
    pub fixed: u64,
    /// Bytes of one expert slot (the largest expert's extent on flash).
    pub expert_bytes: u64,
    /// Expert slots: resident experts and reads in flight.
    pub slots: usize,
    /// Of those, the most that speculative reads may hold.
    pub speculative: usize,
    /// Every expert of the file.
    pub experts: usize,
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
        format!(
            "memory: {} fixed (dense weights as stored, norms and routers f32, KV cache, activations), {} expert \
             slots of {} ({} of {} experts resident at most, {} for speculative reads)",
            format_size(self.fixed),
            self.slots,
            format_size(self.expert_bytes),
            self.slots.saturating_sub(self.speculative).min(self.experts),
            self.experts,
            self.speculative
        )
    }
}

/// Splits `budget` (`None` = room for every expert) for `experts` experts of `expert_bytes`, `k`
/// per token; refused below the minimum, which the message names.
pub fn split(
    fixed: u64,
    expert_bytes: u64,
    experts: usize,
    k: usize,
    budget: Option<u64>,
    what: &str,
) -> Result<ExpertSplit> {
    let least = ExpertSplit::min_slots(k);
    // More slots than every expert plus the reads of one layer hold nothing.
    let most = experts + least;
    let minimum = fixed + least as u64 * expert_bytes;
    let slots = match budget {
        None => most,
        Some(b) if b < minimum => bail!(
            "--memory {} is below the minimum of {} for streaming the mixture of experts {what}: \
             {} fixed (dense weights as stored, norms and routers f32, KV cache, activations) and {least} expert \
             slots of {} (the {k} experts a layer runs and {k} speculative reads): use --memory {} \
             or more",
            format_size(b),
            format_size(minimum),
            format_size(fixed),
            format_size(expert_bytes),
            format_size(minimum),
        ),
        Some(b) => (((b - fixed) / expert_bytes.max(1)) as usize).min(most),
    };
    Ok(ExpertSplit {
        fixed,
        expert_bytes,
        slots,
        speculative: k,
        experts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_minimum_is_two_layers_of_reads_and_the_refusal_names_it() {
        let s = split(500, 100, 24, 2, Some(900), "m.lsb").unwrap();
        assert_eq!((s.slots, s.total()), (4, 900));
        let e = split(500, 100, 24, 2, Some(899), "m.lsb").unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("m.lsb") && msg.contains("use --memory 900 B or more"),
            "{msg}"
        );
    }

    #[test]
    fn slots_grow_with_the_budget_up_to_every_expert() {
        assert_eq!(split(500, 100, 24, 2, Some(1550), "m").unwrap().slots, 10);
        assert_eq!(
            split(500, 100, 24, 2, Some(1 << 30), "m").unwrap().slots,
            28
        );
        assert_eq!(split(500, 100, 24, 2, None, "m").unwrap().slots, 28);
    }
}
