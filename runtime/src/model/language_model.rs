//! The interface every runnable model offers the text loop: tokens in, logits out, over a KV
//! cache; the resident [`Model`] implements it here, the streaming models where they live.

use anyhow::Result;

use super::kv_cache::KvCache;
use super::Model;
use crate::source::config::ModelConfig;

/// Anything that turns tokens into logits with a KV cache: the resident model, or a streaming one.
pub trait LanguageModel {
    fn config(&self) -> &ModelConfig;
    /// An empty KV cache of `ctx` positions in the storage this model runs with.
    fn new_cache(&self, ctx: usize) -> KvCache;
    /// See [`Model::forward`].
    fn forward(
        &mut self,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
    ) -> Result<Vec<f32>> {
        let mut logits = Vec::new();
        self.forward_into(tokens, cache, all_logits, &mut logits)?;
        Ok(logits)
    }

    /// [`forward`](Self::forward) into `logits` (resized): a decoding loop that keeps its logits
    /// buffer allocates nothing per token.
    fn forward_into(
        &mut self,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
        logits: &mut Vec<f32>,
    ) -> Result<()>;

    /// One token for each of several sequences (`tokens[i]` continues `caches[i]`), `logits`
    /// getting one row per token: what a server decoding several requests at once calls. Each
    /// row's logits are bitwise those of [`forward_into`](Self::forward_into) on that token alone;
    /// a streaming model computes the rows' FFNs together, reading each cluster once for all of
    /// them. This default decodes them one after another.
    fn forward_batch(
        &mut self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        decode_each(self, tokens, caches, logits)
    }

    /// Whether scoring a text should feed it one token at a time, as generation does, so that what
    /// the model measures (bytes read, hit rates) is generation's rather than a prompt chunk's.
    fn scores_by_decoding(&self) -> bool {
        false
    }

    /// The most prompt tokens one forward call should take (a streaming model plans its scratch
    /// for this many; a longer slice is split).
    fn prompt_chunk(&self) -> usize {
        crate::text::generate::PROMPT_CHUNK
    }
}

/// [`LanguageModel::forward_batch`] one token after another: each `tokens[i]` decoded alone after
/// `caches[i]`, its logits appended to `logits` (the default, and a batching model's fallback).
pub fn decode_each<M: LanguageModel + ?Sized>(
    model: &mut M,
    tokens: &[u32],
    caches: &mut [&mut KvCache],
    logits: &mut Vec<f32>,
) -> Result<()> {
    if tokens.len() != caches.len() {
        anyhow::bail!(
            "a batch needs one KV cache per token ({} tokens, {} caches)",
            tokens.len(),
            caches.len()
        );
    }
    // The row buffer is kept on this thread, so that a step allocates nothing once warm (taken,
    // not borrowed: a model whose own step decoded rows this way would find it empty, not busy).
    let mut row = ROW.take();
    logits.clear();
    let result = tokens
        .iter()
        .zip(caches.iter_mut())
        .try_for_each(|(&tok, cache)| {
            model.forward_into(&[tok], cache, false, &mut row)?;
            logits.extend_from_slice(&row);
            Ok(())
        });
    ROW.set(row);
    result
}

thread_local! {
    /// [`decode_each`]'s row of logits, kept between steps.
    static ROW: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A model whose computing calls ([`forward_into`](LanguageModel::forward_into) and
/// [`forward_batch`](LanguageModel::forward_batch)) each run inside `pool.install`, so their
/// parallel loops use that pool's threads, while the caller's code between the calls (a token
/// callback of [`generate_after`](crate::text::generate::generate_after)) stays on the calling
/// thread: how the C API gives each model its own thread count. With no pool the calls run on the
/// calling thread (their parallel loops on the shared pool).
pub struct OnPool<'a, M: ?Sized> {
    pub model: &'a mut M,
    pub pool: Option<&'a rayon::ThreadPool>,
}

/// Runs `f` inside `pool.install` (its parallel loops on the pool's threads, the calling thread
/// waiting), or with no pool on the calling thread (its parallel loops on the shared pool).
pub fn install<R: Send>(pool: Option<&rayon::ThreadPool>, f: impl FnOnce() -> R + Send) -> R {
    match pool {
        Some(pool) => pool.install(f),
        None => f(),
    }
}

impl<M: LanguageModel + Send + ?Sized> LanguageModel for OnPool<'_, M> {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn new_cache(&self, ctx: usize) -> KvCache {
        self.model.new_cache(ctx)
    }

    fn scores_by_decoding(&self) -> bool {
        self.model.scores_by_decoding()
    }

    fn prompt_chunk(&self) -> usize {
        self.model.prompt_chunk()
    }

    fn forward_into(
        &mut self,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let model = &mut *self.model;
        install(self.pool, || {
            model.forward_into(tokens, cache, all_logits, logits)
        })
    }

    fn forward_batch(
        &mut self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let model = &mut *self.model;
        install(self.pool, || model.forward_batch(tokens, caches, logits))
    }
}

impl<T: LanguageModel + ?Sized> LanguageModel for &mut T {
    fn config(&self) -> &ModelConfig {
        (**self).config()
    }

    fn new_cache(&self, ctx: usize) -> KvCache {
        (**self).new_cache(ctx)
    }

    fn scores_by_decoding(&self) -> bool {
        (**self).scores_by_decoding()
    }

    fn prompt_chunk(&self) -> usize {
        (**self).prompt_chunk()
    }

    fn forward_into(
        &mut self,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        (**self).forward_into(tokens, cache, all_logits, logits)
    }

    fn forward_batch(
        &mut self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        (**self).forward_batch(tokens, caches, logits)
    }
}

impl LanguageModel for Model {
    fn config(&self) -> &ModelConfig {
        Model::config(self)
    }

    fn new_cache(&self, ctx: usize) -> KvCache {
        Model::new_cache(self, ctx)
    }

    fn forward_into(
        &mut self,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        Model::forward_with(self, tokens, cache, all_logits, None, None, logits)
    }

    /// As `&Model` does.
    fn forward_batch(
        &mut self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let mut model: &Model = self;
        model.forward_batch(tokens, caches, logits)
    }
}

impl LanguageModel for &Model {
    fn config(&self) -> &ModelConfig {
        Model::config(self)
    }

    fn new_cache(&self, ctx: usize) -> KvCache {
        Model::new_cache(self, ctx)
    }

    fn forward_into(
        &mut self,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        Model::forward_with(self, tokens, cache, all_logits, None, None, logits)
    }

    /// Block-encoded weights take the batch's rows together (each row's bits its own, as
    /// decoding it alone); float weights and experts decode the rows one after another.
    fn forward_batch(
        &mut self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        if tokens.len() < 2 || !self.batches_bitwise() {
            return decode_each(self, tokens, caches, logits);
        }
        self.forward_batch_with(tokens, caches, None, None, logits)
    }
}
