//! The true active sets of a token sequence, recorded once with the `resident` policy through the
//! decode path: for every token and layer, the neurons whose exact activation passes the file's
//! sparsity rule, and the clusters that hold them. The oracle policy replays it (it knows every
//! future access); any policy given it measures its predictors and cache against the truth.

use std::fmt;
use std::path::Path;

use anyhow::{bail, Result};
use leanstream_format::LsbFile;

use crate::model::LanguageModel;

use super::{Policy, Sparsity, StreamOptions, StreamingModel, Tuning};

/// Serialisable so that `bench` can record it once and hand it to the oracle's process.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct ActiveTrace {
    tokens: Vec<u32>,
    /// Each token's position in the KV cache (the cache restarts when `ctx` positions are full).
    positions: Vec<u32>,
    layers: usize,
    /// Active stored positions per (token, layer), token-major, ascending.
    neurons: Vec<Vec<u32>>,
    /// Clusters holding an active neuron per (token, layer), ascending.
    clusters: Vec<Vec<u32>>,
}

impl fmt::Debug for ActiveTrace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ActiveTrace {{ {} tokens, {} layers }}",
            self.tokens.len(),
            self.layers
        )
    }
}

impl ActiveTrace {
    /// Runs the converted file at `path` with the `resident` policy over `tokens`, one token per
    /// forward call, with a KV cache of `ctx` positions that restarts empty when full (as
    /// perplexity windows of `ctx` do), and records every token's and layer's active set.
    pub fn record(path: &Path, tokens: &[u32], ctx: usize) -> Result<ActiveTrace> {
        if tokens.is_empty() {
            bail!("an active trace needs at least one token");
        }
        let file = LsbFile::open(path)?;
        let layers = file.meta.model.num_layers;
        let cluster_of: Vec<Vec<u32>> = file
            .ffn
            .layers
            .iter()
            .map(|f| {
                let mut of = vec![0u32; f.neurons()];
                for (ci, cl) in f.clusters.iter().enumerate() {
                    let first = cl.first as usize;
                    of[first..first + cl.count as usize].fill(ci as u32);
                }
                of
            })
            .collect();
        let max_ctx = file.meta.model.max_position_embeddings;
        if !(2..=max_ctx).contains(&ctx) {
            bail!("the trace's ctx must be 2..={max_ctx} tokens for this model, not {ctx}");
        }
        let opts = StreamOptions {
            policy: Policy::Resident,
            sparsity: Sparsity::Exact,
            memory: None,
            flash: None,
            ctx,
            ctx_floor: None,
            // The storage bench runs use, so the recorded sets are theirs.
            kv: Default::default(),
            tokenizer_bytes: None,
            tuning: Tuning::default(),
        };
        let mut model = StreamingModel::open(path, file, &opts)?;
        model.engine.start_recording();
        let mut cache = model.new_cache(ctx);
        let mut positions = Vec::with_capacity(tokens.len());
        for &t in tokens {
            if cache.len() == cache.capacity() {
                cache.clear();
            }
            positions.push(cache.len() as u32);
            model.forward(&[t], &mut cache, false)?;
        }
        let neurons = model.engine.take_recording();
        assert_eq!(neurons.len(), tokens.len() * layers, "one set per layer");
        let clusters = neurons
            .iter()
            .enumerate()
            .map(|(i, ns)| {
                let of = &cluster_of[i % layers];
                let mut cs: Vec<u32> = ns.iter().map(|&p| of[p as usize]).collect();
                cs.dedup();
                cs
            })
            .collect();
        Ok(ActiveTrace {
            tokens: tokens.to_vec(),
            positions,
            layers,
            neurons,
            clusters,
        })
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn layers(&self) -> usize {
        self.layers
    }

    /// The active stored positions of layer `l` for token `i` of the sequence.
    pub fn neurons(&self, i: usize, l: usize) -> &[u32] {
        &self.neurons[i * self.layers + l]
    }

    /// The clusters holding an active neuron of layer `l` for token `i`, ascending.
    pub fn clusters(&self, i: usize, l: usize) -> &[u32] {
        &self.clusters[i * self.layers + l]
    }

    /// Errors unless token `i` of the sequence is `token` at KV position `position`.
    pub(super) fn check(&self, i: usize, token: u32, position: usize) -> Result<()> {
        if i >= self.tokens.len() {
            bail!(
                "the active trace covers {} tokens and token {} was fed: record the trace over every token the model will see",
                self.tokens.len(),
                i + 1
            );
        }
        if self.tokens[i] != token || self.positions[i] as usize != position {
            bail!(
                "token {i} fed is id {token} at position {position}, but the active trace was recorded with id {} at position {}: the model must see exactly the traced sequence (same tokens, same order, same ctx)",
                self.tokens[i],
                self.positions[i]
            );
        }
        Ok(())
    }
}
