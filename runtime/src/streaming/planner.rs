//! The memory planner: splits one `--memory` budget (a cap on the process's peak RSS) into the
//! runtime's fixed needs — process overhead, dense weights, KV cache, the resident per-layer state
//! (sketch, predictors, statistics), I/O buffers, scratch — and the neuron cache, which gets the
//! rest. A budget below the fixed needs is refused with the minimum.

use anyhow::{bail, Result};
use serde::Serialize;

use crate::config::ModelConfig;
use crate::memory_size::format_size;

pub struct PlanInput {
    pub budget: Option<u64>,
    pub overhead: u64,
    pub dense: u64,
    pub kv_cache: u64,
    pub resident_state: u64,
    pub io_buffers: u64,
    pub scratch: u64,
    /// Bytes of every FFN cluster extent.
    pub ffn: u64,
    /// The policy keeps every cluster resident.
    pub needs_all_ffn: bool,
    pub ctx: usize,
}

/// Where the budget goes, in bytes.
#[derive(Debug, Clone, Serialize)]
pub struct MemorySplit {
    pub overhead: u64,
    pub dense: u64,
    pub kv_cache: u64,
    pub resident_state: u64,
    pub io_buffers: u64,
    pub scratch: u64,
    pub neuron_cache: u64,
    /// Bytes of all FFN bundles (for "how much of the FFN fits").
    pub ffn_total: u64,
}

impl MemorySplit {
    /// The budget that leaves `share` (0–1) of the FFN bundles to the neuron cache.
    pub fn budget_for_ffn_share(&self, share: f64) -> u64 {
        self.fixed() + (self.ffn_total as f64 * share) as u64
    }

    pub fn fixed(&self) -> u64 {
        self.overhead
            + self.dense
            + self.kv_cache
            + self.resident_state
            + self.io_buffers
            + self.scratch
    }

    /// One line for people.
    pub fn describe(&self) -> String {
        format!(
            "memory: overhead {}, dense {}, KV cache {}, sketch+predictors {}, I/O buffers {}, scratch {}, neuron cache {} ({:.0} % of the FFN)",
            format_size(self.overhead),
            format_size(self.dense),
            format_size(self.kv_cache),
            format_size(self.resident_state),
            format_size(self.io_buffers),
            format_size(self.scratch),
            format_size(self.neuron_cache),
            100.0 * self.neuron_cache as f64 / self.ffn_total.max(1) as f64
        )
    }
}

pub fn plan(p: PlanInput) -> Result<MemorySplit> {
    let mut split = MemorySplit {
        overhead: p.overhead,
        dense: p.dense,
        kv_cache: p.kv_cache,
        resident_state: p.resident_state,
        io_buffers: p.io_buffers,
        scratch: p.scratch,
        neuron_cache: 0,
        ffn_total: p.ffn,
    };
    let fixed = split.fixed();
    let minimum = if p.needs_all_ffn {
        fixed + p.ffn
    } else {
        fixed
    };
    let budget = p.budget.unwrap_or(fixed + p.ffn);
    if budget < minimum {
        bail!(
            "--memory {} is below the minimum of {} for this model at ctx {} ({}); raise --memory{}",
            format_size(budget),
            format_size(minimum),
            p.ctx,
            split.describe_fixed(),
            if p.ctx > 512 { " or lower --ctx" } else { "" }
        );
    }
    split.neuron_cache = (budget - fixed).min(p.ffn);
    Ok(split)
}

impl MemorySplit {
    fn describe_fixed(&self) -> String {
        format!(
            "overhead {}, dense {}, KV cache {}, sketch+predictors {}, I/O buffers {}, scratch {}",
            format_size(self.overhead),
            format_size(self.dense),
            format_size(self.kv_cache),
            format_size(self.resident_state),
            format_size(self.io_buffers),
            format_size(self.scratch)
        )
    }
}

/// The process before any model is loaded (code, libraries, allocator, thread stacks: measured at
/// start-up), plus the tokenizer (its parsed form takes a few times its JSON size), plus slack for
/// the allocator and the file's indexes while they are decoded.
pub fn baseline_overhead(tokenizer_json_bytes: u64) -> u64 {
    // The measured start-up RSS (about 5 MiB on x86-64 Linux) varies by ~100 KiB from run to run;
    // a floor above it, and rounding up to whole MiB, keep the stated minimum — and so the cache
    // two policies get from one budget — from moving with that noise.
    const MIB: u64 = 1 << 20;
    const STARTUP_FLOOR: u64 = 6 * MIB;
    let startup = crate::memory::startup_rss_bytes().max(STARTUP_FLOOR);
    (startup + 4 * tokenizer_json_bytes + 4 * MIB).div_ceil(MIB) * MIB
}

/// Activations of one prompt chunk and the logits.
pub fn scratch_bytes(c: &ModelConfig) -> u64 {
    let t = crate::generate::PROMPT_CHUNK as u64;
    let per_token = (c.hidden_size * 4
        + c.num_heads * c.head_dim * 2
        + c.num_kv_heads * c.head_dim * 2
        + c.intermediate_size * 2) as u64;
    4 * (t * per_token + 2 * c.vocab_size as u64)
        + 4 * t * c.max_position_embeddings.min(2048) as u64
}
