//! The server's generation loop: `text::generate`'s prompt chunks and batch-1 decode, plus what
//! only the API asks for: log-probabilities of each token (log-softmax of the logits the sampler
//! receives, after any grammar mask and before the repetition penalty and temperature) and a
//! JSON grammar that masks the logits before each token is sampled.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Result};

use super::json_grammar::{mask, Grammar, Matcher, TokenTexts};
use crate::model::kv_cache::KvCache;
use crate::text::generate::StopReason;
use crate::text::sampler::{Sampler, SamplerConfig};
use crate::tokenizer::{TextStream, Tokenizer};

/// A generated token's log-probability and the most likely alternatives (most likely first).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

pub struct DecodeOptions<'a> {
    pub max_tokens: usize,
    pub ctx: usize,
    pub sampler: SamplerConfig,
    pub eos: &'a [u32],
    /// `Some(k)`: report each token's log-probability and the `k` most likely tokens.
    pub top_logprobs: Option<usize>,
    pub grammar: Option<(&'a Grammar, &'a TokenTexts)>,
}

pub struct Outcome {
    pub tokens: Vec<u32>,
    pub stop_reason: StopReason,
    pub tokens_per_s: f64,
    /// Prompt processing, and the time from then to the last token, in nanoseconds.
    pub prompt_ns: u64,
    pub decode_ns: u64,
}

/// What the generation loop needs of a model: a slot's view of the shared model
/// ([`super::batch::SlotModel`]).
pub trait Forward {
    /// The most prompt tokens one call should take.
    fn prompt_chunk(&self) -> usize;
    /// The last token's logits after `tokens` continue `cache`.
    fn forward_into(
        &mut self,
        tokens: &[u32],
        cache: &mut KvCache,
        logits: &mut Vec<f32>,
    ) -> Result<()>;
}

/// Buffers kept between requests, so the decode loop allocates nothing for them per token.
#[derive(Default)]
pub struct Scratch {
    logits: Vec<f32>,
    seen: Vec<f32>,
    /// The grammar's states while masking (one per byte of a token's text).
    matchers: Vec<Matcher>,
}

/// Continues `cache` (holding `history`) with `prompt`, then generates. `on_token` gets each
/// generated token's log-probabilities (when asked for) and the text it completes; a last call
/// without a token gives the text still held at the end.
#[allow(clippy::too_many_arguments)]
pub fn generate(
    model: &mut dyn Forward,
    tokenizer: &Tokenizer,
    cache: &mut KvCache,
    history: &[u32],
    prompt: &[u32],
    o: &DecodeOptions,
    interrupt: &AtomicBool,
    scratch: &mut Scratch,
    mut on_token: impl FnMut(Option<TokenLogprob>, Option<&str>),
) -> Result<Outcome> {
    if prompt.is_empty() {
        bail!("the prompt is empty: give at least one token of text");
    }
    if cache.len() + prompt.len() > o.ctx {
        bail!(
            "the prompt has {} tokens and the cache {}, over the context of {}",
            prompt.len(),
            cache.len(),
            o.ctx
        );
    }
    let Scratch {
        logits,
        seen,
        matchers: trial,
    } = scratch;
    let start = Instant::now();
    for chunk in prompt.chunks(model.prompt_chunk()) {
        model.forward_into(chunk, cache, logits)?;
    }
    let prompt_ns = start.elapsed().as_nanos() as u64;
    let decode_start = Instant::now();
    let mut sampler = Sampler::new(o.sampler.clone());
    let mut history = [history, prompt].concat();
    let mut matcher = o.grammar.map(|(g, _)| g.start());
    let mut stream = TextStream::default();
    let mut tokens = Vec::with_capacity(o.max_tokens.min(o.ctx));
    let mut first_at = None;
    let stop_reason = loop {
        if let (Some((g, texts)), Some(m)) = (o.grammar, matcher.as_ref()) {
            if m.is_complete() || mask(g, m, texts, o.eos, logits, trial) == 0 {
                break StopReason::Eos;
            }
        }
        let log_z = o.top_logprobs.map(|_| {
            seen.clear();
            seen.extend_from_slice(logits);
            log_sum_exp(logits)
        });
        let tok = sampler.sample(logits, &history);
        first_at.get_or_insert_with(Instant::now);
        if o.eos.contains(&tok) {
            break StopReason::Eos;
        }
        if let (Some((g, texts)), Some(m)) = (o.grammar, matcher.as_mut()) {
            // The mask leaves only continuations; a sampler that still picked a masked token
            // (float rounding on a zero weight) ends the reply rather than break the JSON.
            if !m.push_bytes(g, texts.get(tok)) {
                break StopReason::Eos;
            }
        }
        let logprob = match (o.top_logprobs, log_z) {
            (Some(k), Some(z)) => Some(TokenLogprob {
                token: tok,
                logprob: seen[tok as usize] - z,
                top: top_k(seen, k, z),
            }),
            _ => None,
        };
        history.push(tok);
        tokens.push(tok);
        let piece = stream.push(tokenizer, tok)?;
        on_token(logprob, piece.as_deref());
        if tokens.len() >= o.max_tokens {
            break StopReason::MaxTokens;
        }
        if cache.len() >= o.ctx {
            break StopReason::ContextFull;
        }
        if interrupt.load(Ordering::Relaxed) {
            break StopReason::Interrupted;
        }
        model.forward_into(&[tok], cache, logits)?;
    };
    if let Some(piece) = stream.finish(tokenizer)? {
        on_token(None, Some(&piece));
    }
    let tokens_per_s = match first_at {
        Some(t) if tokens.len() > 1 => (tokens.len() - 1) as f64 / t.elapsed().as_secs_f64(),
        _ => 0.0,
    };
    Ok(Outcome {
        tokens,
        stop_reason,
        tokens_per_s,
        prompt_ns,
        decode_ns: decode_start.elapsed().as_nanos() as u64,
    })
}

/// `ln Σ exp(x)` over the finite values, in f64.
pub fn log_sum_exp(x: &[f32]) -> f32 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = x.iter().map(|&v| ((v - max) as f64).exp()).sum();
    (max as f64 + sum.ln()) as f32
}

/// The `k` largest finite values as (index, value - `log_z`), largest first (lower index first
/// on ties).
pub fn top_k(x: &[f32], k: usize, log_z: f32) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return top;
    }
    for (i, &v) in x.iter().enumerate() {
        if !v.is_finite() || (top.len() == k && v <= top[k - 1].1) {
            continue;
        }
        let at = top.partition_point(|&(_, t)| t >= v);
        top.insert(at, (i as u32, v));
        top.truncate(k);
    }
    for (_, v) in &mut top {
        *v -= log_z;
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_and_top_k_match_a_direct_computation() {
        let x = [1.0f32, 3.0, 2.5, f32::NEG_INFINITY, 0.0, 3.0];
        let z = log_sum_exp(&x);
        let direct: f64 = x.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
        assert!((z as f64 - direct).abs() < 1e-6, "{z} vs {direct}");
        let top = top_k(&x, 3, z);
        assert_eq!(
            top.iter().map(|t| t.0).collect::<Vec<_>>(),
            [1, 5, 2],
            "{top:?}"
        );
        assert!((top[2].1 - (2.5 - z)).abs() < 1e-6);
        let p: f32 = top.iter().map(|t| t.1.exp()).sum();
        assert!(p <= 1.0 && p > 0.9, "{p}");
        // Minus infinity is never reported.
        assert_eq!(top_k(&x, 10, z).len(), 5);
    }
}
