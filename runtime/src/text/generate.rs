//! Text generation: chunked prompt processing, then batch-1 decode until EOS, the token limit or a
//! full context; timings for the run summary.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Result};
use serde::Serialize;

use crate::model::kv_cache::KvCache;
use crate::model::LanguageModel;
use crate::text::sampler::{Sampler, SamplerConfig};
use crate::tokenizer::{TextStream, Tokenizer};

/// Prompt tokens per forward call: large enough for mat-mat speed (256 scored perplexity 1.2-1.3x
/// faster than 64 on the embedded model), small enough to bound the scratch buffers.
pub const PROMPT_CHUNK: usize = 256;

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub ctx: usize,
    pub sampler: SamplerConfig,
    pub eos_token_ids: Vec<u32>,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    Eos,
    MaxTokens,
    ContextFull,
    /// Stopped from outside (Ctrl-C in `chat`).
    Interrupted,
}

#[derive(Debug, Clone, Serialize)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Decode rate: tokens after the first, over the time from first to last token.
    pub tokens_per_s: f64,
    pub prompt_tokens_per_s: f64,
    /// Prompt processing plus the first sampled token.
    pub ttft_ms: f64,
    /// Time between consecutive generated tokens: median and 99th percentile.
    pub ms_per_token_p50: f64,
    pub ms_per_token_p99: f64,
    pub stop_reason: StopReason,
}

pub struct Generation {
    pub text: String,
    pub tokens: Vec<u32>,
    /// Per sampled token (an EOS included), the largest logit minus the second largest, as the
    /// sampler received them: where it is tiny, rounding can flip a greedy choice (ports compare
    /// greedy texts only where it is not).
    pub margins: Vec<f32>,
    pub stats: GenerationStats,
}

/// Generates from `prompt` (token ids), calling `on_text` with each completed piece of text.
pub fn generate(
    mut model: impl LanguageModel,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_text: impl FnMut(&str),
) -> Result<Generation> {
    let mut cache = model.new_cache(opts.ctx);
    let never = AtomicBool::new(false);
    generate_after(
        &mut model,
        tokenizer,
        &mut cache,
        &[],
        prompt,
        opts,
        &never,
        on_text,
    )
}

/// Continues the sequence held in `cache` (its tokens are `history`, for the repetition penalty)
/// with `prompt`, then generates; only `prompt` is computed, not the history. Generation also
/// stops, with [`StopReason::Interrupted`], after the token during which `interrupt` was set.
/// Afterwards `cache` holds the first `cache.len()` of history, prompt and generated tokens (a
/// generated token is fed back only when another one follows it).
#[allow(clippy::too_many_arguments)]
pub fn generate_after(
    mut model: impl LanguageModel,
    tokenizer: &Tokenizer,
    cache: &mut KvCache,
    history: &[u32],
    prompt: &[u32],
    opts: &GenerateOptions,
    interrupt: &AtomicBool,
    mut on_text: impl FnMut(&str),
) -> Result<Generation> {
    if prompt.is_empty() {
        bail!("the prompt is empty: give at least one token of text");
    }
    if cache.len() + prompt.len() > opts.ctx {
        bail!(
            "the prompt has {} tokens but the context holds {}{}: shorten it or raise --ctx",
            prompt.len(),
            opts.ctx,
            if cache.is_empty() {
                String::new()
            } else {
                format!(" and already has {}", cache.len())
            }
        );
    }
    let mut sampler = Sampler::new(opts.sampler.clone());
    let start = Instant::now();
    let mut logits = Vec::new();
    for chunk in prompt.chunks(model.prompt_chunk()) {
        logits = model.forward(chunk, cache, false)?;
    }
    let prompt_s = start.elapsed().as_secs_f64();
    let mut history = [history, prompt].concat();
    let mut stream = TextStream::default();
    let mut text = String::new();
    let mut tokens = Vec::new();
    let mut first_token_at = None;
    let mut token_times: Vec<Instant> = Vec::new();
    let mut margins = Vec::with_capacity(opts.max_tokens.min(opts.ctx) + 1);
    let stop_reason = loop {
        margins.push(top2_margin(&logits));
        let tok = sampler.sample(&mut logits, &history);
        let now = Instant::now();
        first_token_at.get_or_insert(now);
        token_times.push(now);
        if opts.eos_token_ids.contains(&tok) {
            break StopReason::Eos;
        }
        history.push(tok);
        tokens.push(tok);
        if let Some(piece) = stream.push(tokenizer, tok)? {
            on_text(&piece);
            text.push_str(&piece);
        }
        if tokens.len() >= opts.max_tokens {
            break StopReason::MaxTokens;
        }
        if cache.len() >= opts.ctx {
            break StopReason::ContextFull;
        }
        if interrupt.load(Ordering::Relaxed) {
            break StopReason::Interrupted;
        }
        model.forward_into(&[tok], cache, false, &mut logits)?;
    };
    let end = Instant::now();
    if let Some(piece) = stream.finish(tokenizer)? {
        on_text(&piece);
        text.push_str(&piece);
    }
    let first = first_token_at.expect("at least one token is sampled");
    let decode_s = (end - first).as_secs_f64();
    let mut gaps: Vec<f64> = token_times
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
        .collect();
    gaps.sort_by(f64::total_cmp);
    let pct = |q: f64| {
        gaps.get(((gaps.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    let stats = GenerationStats {
        ms_per_token_p50: pct(0.5),
        ms_per_token_p99: pct(0.99),
        prompt_tokens: prompt.len(),
        generated_tokens: tokens.len(),
        tokens_per_s: if tokens.len() > 1 {
            (tokens.len() - 1) as f64 / decode_s
        } else {
            0.0
        },
        prompt_tokens_per_s: prompt.len() as f64 / prompt_s,
        ttft_ms: (first - start).as_secs_f64() * 1e3,
        stop_reason,
    };
    Ok(Generation {
        text,
        tokens,
        margins,
        stats,
    })
}

/// The largest value minus the second largest (infinite for fewer than two values).
fn top2_margin(logits: &[f32]) -> f32 {
    let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in logits {
        if v > first {
            second = first;
            first = v;
        } else if v > second {
            second = v;
        }
    }
    first - second
}

#[cfg(test)]
mod tests {
    use super::top2_margin;

    #[test]
    fn top2_margin_is_the_gap_between_the_two_largest() {
        assert_eq!(top2_margin(&[1.0, 5.0, 3.0, 4.5]), 0.5);
        assert_eq!(top2_margin(&[4.5, 1.0, 5.0, 3.0]), 0.5);
        assert_eq!(top2_margin(&[5.0, 1.0, 5.0]), 0.0);
        assert_eq!(top2_margin(&[2.0]), f32::INFINITY);
    }
}
