//! The converter's memory, stated before any work ([`estimate`]) and measured at the end (the
//! OS's peak resident size). `convert` holds the embedding and head in f32, one block's attention
//! and FFN in f32 (twice: the copy the calibration runs and the one the bundles are encoded from),
//! and the calibration state of one layer boundary: per calibration token a few vectors of the
//! hidden size and a few of the FFN width. None of it grows with depth.

use leanstream::source::config::ModelConfig;
use serde::Serialize;

use crate::calib::WINDOW;

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
    /// Embedding and head (f32) and the norms.
    pub model: u64,
    /// One block's attention and FFN in f32.
    pub block: u64,
    /// The calibration state of one layer boundary.
    pub calibration: u64,
    /// Logits of one held-out window, dense and one sparse stream, at the end.
    pub logits: u64,
    /// The source's largest tensor, mapped while it is read.
    pub source: u64,
    pub overhead: u64,
    pub total: u64,
}

/// The peak memory of converting a dense model of `c` with `tokens` calibration tokens from a
/// source of `source_bytes`.
pub fn estimate(c: &ModelConfig, tokens: usize, source_bytes: u64) -> Estimate {
    let (h, n, v) = (
        c.hidden_size as u64,
        c.intermediate_size as u64,
        c.vocab_size as u64,
    );
    let (q, kv) = (
        (c.num_heads * c.head_dim) as u64,
        (c.num_kv_heads * c.head_dim) as u64,
    );
    let heads = if c.tie_word_embeddings { 1 } else { 2 };
    let model = 4 * (heads * v * h + (2 * c.num_layers as u64 + 1) * h);
    let block = 4 * (2 * q * h + 2 * kv * h + 2 * 3 * h * n);
    let calibration = tokens as u64 * per_token_bytes(c);
    let logits = 4 * 2 * WINDOW as u64 * v + 4 * 4 * tokens as u64 * h;
    let source = source_bytes.min(4 * v * h);
    let total = OVERHEAD + source + model + (block + calibration).max(logits);
    Estimate {
        model,
        block,
        calibration,
        logits,
        source,
        overhead: OVERHEAD,
        total,
    }
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
        let (ea, eb) = (estimate(&a, 4096, 1 << 30), estimate(&b, 4096, 1 << 30));
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
