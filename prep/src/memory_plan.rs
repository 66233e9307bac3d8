//! The converter's memory, stated before any work ([`estimate`]) and measured at the end (the
//! OS's peak resident size). `convert` runs two passes, one after the other. The layout pass
//! ([`crate::layout`]) holds one source tensor in f32 at a time (the largest is the embedding) and
//! its encoding. The calibration ([`crate::calibrate`]) holds the embedding and head as stored
//! (encoded), one block's attention as stored and FFN in f32 with its bundles, and the calibration
//! state of one layer boundary: per calibration token a few vectors of the hidden size and a few
//! of the FFN width. None of it grows with depth.

use leanstream::source::config::ModelConfig;
use leanstream_format::quant::{row_bytes, QuantType};
use serde::Serialize;

use crate::calib::WINDOW;
use crate::profile::COMPARE_ROWS;

/// Vectors of the FFN width (`n` f32) held per calibration token while a layer is profiled and
/// its predictors trained: the neuron coefficients, scores, targets, energies, both predictors'
/// scores and their threshold's copy, and the mask (measured on models/austen-relu and SmolLM2).
const PER_TOKEN_N: u64 = 8;
/// Vectors of the hidden size per calibration token: the dense stream, the residual entering this
/// layer and the one before, the FFN input, both predictors' normalised inputs, the held-out
/// sparse streams.
const PER_TOKEN_H: u64 = 6;
/// The process before any model: code, allocator, tokenizer, calibration text.
/// (Measured: 25 to 35 MiB above the parts below on models/austen-relu, SmolLM2 and the tiny
/// models of the memory test.)
const OVERHEAD: u64 = 80 << 20;

/// Rows of a dense matrix the layout pass decodes at a time.
pub const LAYOUT_RUN_ROWS: u64 = 1024;

/// Memory the calibration state takes by default ([`default_calib_tokens`]).
pub const DEFAULT_CALIB_BYTES: u64 = 192 << 20;
/// Calibration tokens the default never goes below (predictor and threshold quality) or above.
pub const MIN_CALIB_TOKENS: usize = 2048;
pub const MAX_CALIB_TOKENS: usize = 16384;

/// Bytes each calibration token costs while a layer is profiled.
pub fn per_token_bytes(c: &ModelConfig) -> u64 {
    4 * (PER_TOKEN_N * c.intermediate_size as u64 + PER_TOKEN_H * c.hidden_size as u64)
}

/// The default number of calibration tokens: as many whole windows as [`DEFAULT_CALIB_BYTES`]
/// holds, within [`MIN_CALIB_TOKENS`]..=[`MAX_CALIB_TOKENS`] (SmolLM2-135M: 3072; a 7B shape:
/// 2048; models/austen-relu: 16384).
pub fn default_calib_tokens(c: &ModelConfig) -> usize {
    let t = (DEFAULT_CALIB_BYTES / per_token_bytes(c)) as usize;
    (t / WINDOW * WINDOW).clamp(MIN_CALIB_TOKENS, MAX_CALIB_TOKENS)
}

/// Predictor training epochs by default: as many sample-epochs as 8 epochs of 16384 tokens (the
/// old defaults), at most 24. With fewer tokens and 8 epochs the embedded ReLU model's predicted
/// mode lost most of its quality (held-out perplexity +289 % against +64 %; 24 epochs of 5120
/// tokens: +75 %).
pub fn default_epochs(tokens: usize) -> usize {
    (8 * MAX_CALIB_TOKENS).div_ceil(tokens.max(1)).clamp(8, 24)
}

/// The converter's peak memory, by part.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Estimate {
    /// Embedding and head as stored, and the norms.
    pub model: u64,
    /// The layout pass: the largest source tensor mapped, its encoding (twice: written and its
    /// padded extent) and a run of its rows in f32, one FFN in f32 (twice: read and rescaled).
    pub layout: u64,
    /// One block's attention and FFN in f32.
    pub block: u64,
    /// The calibration state of one layer boundary.
    pub calibration: u64,
    /// Logits of a run of held-out positions, dense and one sparse stream, per core, at the end.
    pub logits: u64,
    /// The source's largest tensor, mapped while it is read.
    pub source: u64,
    pub overhead: u64,
    pub total: u64,
}

/// The peak memory of converting a dense model of `c` to encoding `q` with `tokens` calibration
/// tokens from a source of `source_bytes`: the larger of the two passes'.
pub fn estimate(c: &ModelConfig, q: QuantType, tokens: usize, source_bytes: u64) -> Estimate {
    let (h, n, v) = (
        c.hidden_size as u64,
        c.intermediate_size as u64,
        c.vocab_size as u64,
    );
    let (qd, kv) = (
        (c.num_heads * c.head_dim) as u64,
        (c.num_kv_heads * c.head_dim) as u64,
    );
    let heads = if c.tie_word_embeddings { 1 } else { 2 };
    let encoded = |rows: u64, cols: u64| {
        rows * row_bytes(q, cols as usize).unwrap_or(4 * cols as usize) as u64
    };
    let model = heads * encoded(v, h) + 4 * (2 * c.num_layers as u64 + 1) * h;
    let ffn = 4 * 3 * h * n;
    let source = source_bytes.min(4 * v * h);
    let layout = OVERHEAD + source + 2 * encoded(v, h) + 4 * LAYOUT_RUN_ROWS * h + 2 * ffn;
    // The windows run on every core (at most one task a window): per task one window's
    // activations and keys and values; the held-out comparison, one run of positions' logits.
    let threads = rayon::current_num_threads() as u64;
    let tasks = threads.min(tokens.div_ceil(WINDOW) as u64);
    let runs = threads.min(WINDOW.div_ceil(COMPARE_ROWS) as u64);
    let window = 4 * WINDOW as u64 * (4 * h + 2 * qd + 2 * kv + 3 * n);
    let block = 4 * (2 * qd * h + 2 * kv * h) + 2 * ffn + tasks * window;
    let calibration = tokens as u64 * per_token_bytes(c);
    let logits = runs * 4 * 2 * COMPARE_ROWS as u64 * v + 4 * 4 * tokens as u64 * h;
    let total = layout.max(OVERHEAD + model + (block + calibration).max(logits));
    Estimate {
        model,
        layout,
        block,
        calibration,
        logits,
        source,
        overhead: OVERHEAD,
        total,
    }
}

/// The calibration tokens and the estimate of a conversion of `c` to `q` (`layout_only`: the
/// layout pass alone) that may use `budget` bytes: without `requested` tokens, the default, fewer
/// (down to [`MIN_CALIB_TOKENS`]) where the budget asks. It may use the larger of the budget and
/// its floor (the same conversion at [`MIN_CALIB_TOKENS`]), and refuses up front what needs more,
/// or a floor above the memory the machine has free, naming what it needs and the command that
/// converts `model` on a larger machine.
pub fn plan(
    c: &ModelConfig,
    q: QuantType,
    requested: Option<usize>,
    source_bytes: u64,
    budget: Option<u64>,
    layout_only: bool,
    model: &str,
) -> anyhow::Result<(usize, Estimate)> {
    let needs = |e: &Estimate| if layout_only { e.layout } else { e.total };
    let mut tokens = requested.unwrap_or_else(|| default_calib_tokens(c));
    if let (Some(b), None) = (budget, requested) {
        while tokens > MIN_CALIB_TOKENS && needs(&estimate(c, q, tokens, source_bytes)) > b {
            tokens = (tokens - WINDOW).max(MIN_CALIB_TOKENS);
        }
    }
    let e = estimate(c, q, tokens, source_bytes);
    let floor = needs(&estimate(c, q, MIN_CALIB_TOKENS.min(tokens), source_bytes));
    let mib = |b: u64| b.div_ceil(1 << 20);
    let elsewhere = format!(
        "convert it on a larger machine with `leanstream-prep convert {model} -o model.lsb` and \
         copy model.lsb here"
    );
    if let Some(b) = budget {
        if needs(&e) > b.max(floor) {
            anyhow::bail!(
                "converting needs about {} MiB with --calib-tokens {tokens}, more than --memory \
                 ({} MiB) and the {} MiB its layers need one at a time: leave out \
                 --calib-tokens (or lower it), or {elsewhere}",
                mib(needs(&e)),
                mib(b),
                mib(floor)
            );
        }
    }
    if let Some(free) = available_bytes() {
        if floor > free {
            anyhow::bail!(
                "converting needs about {} MiB and this machine has {} MiB free: {elsewhere}",
                mib(floor),
                mib(free)
            );
        }
    }
    Ok((tokens, e))
}

/// The memory the machine has free (`MemAvailable` of `/proc/meminfo`), where the OS says.
fn available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(h: usize, n: usize, layers: usize) -> ModelConfig {
        ModelConfig {
            hidden_size: h,
            intermediate_size: n,
            num_layers: layers,
            ..crate::synth::shape::Shape::Tiny.config(None, Vec::new())
        }
    }

    #[test]
    fn the_estimate_does_not_grow_with_depth_and_the_default_tokens_fit_their_budget() {
        let (a, b) = (config(576, 1536, 1), config(576, 1536, 30));
        let q = QuantType::Q8_0;
        let (ea, eb) = (
            estimate(&a, q, 4096, 1 << 30),
            estimate(&b, q, 4096, 1 << 30),
        );
        // Only the norms (4 bytes × hidden per layer) grow.
        assert_eq!(eb.total - ea.total, 4 * 2 * 29 * 576);
        assert_eq!(ea.calibration, 4096 * 4 * (8 * 1536 + 6 * 576));
        let t = default_calib_tokens(&a);
        assert_eq!(t % WINDOW, 0);
        assert!(t as u64 * per_token_bytes(&a) <= DEFAULT_CALIB_BYTES);
        assert!((t + WINDOW) as u64 * per_token_bytes(&a) > DEFAULT_CALIB_BYTES);
        assert_eq!(
            default_calib_tokens(&config(4096, 11008, 32)),
            MIN_CALIB_TOKENS
        );
        assert_eq!(default_calib_tokens(&config(64, 128, 2)), MAX_CALIB_TOKENS);
        assert_eq!(default_epochs(16384), 8);
        assert_eq!(default_epochs(8192), 16);
        assert_eq!(default_epochs(2048), 24);
    }
}
