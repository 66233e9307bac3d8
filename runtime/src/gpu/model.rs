//! A resident model on the GPU: what `LEANSTREAM_GPU=1` gives the dense policy (docs/gpu.md).
//! Its whole decode step runs there ([`GpuLayers`]) when the GPU supports the model's block and
//! holds its weights; otherwise its output head alone ([`GpuHead`]).

use std::sync::Arc;

use anyhow::{bail, Context, Result};

use super::{Gpu, GpuHead, GpuLayers, HostFfn};
use crate::model::kv_cache::KvCache;
use crate::model::{LanguageModel, Model};
use crate::source::config::ModelConfig;

/// What of a model runs on the GPU.
pub enum Placement {
    /// Every layer of the decode step, the final norm and the head.
    Layers(Box<GpuLayers>),
    /// The output head alone, with why the layers stay on the CPU.
    Head(Box<GpuHead>, String),
}

/// [`Model`] with its decode step, or its logits alone, computed on the GPU.
pub struct GpuModel {
    model: Model,
    placement: Placement,
    gpu: Arc<Gpu>,
    /// Set when the GPU could not hold a KV cache: the model then runs on the CPU.
    on_cpu: Option<String>,
    rows: Rows,
}

/// One token's logits and embedding row, kept between calls.
#[derive(Default)]
pub(super) struct Rows {
    logits: Vec<f32>,
    embedding: Vec<f32>,
}

impl GpuModel {
    /// Opens the first GPU and uploads `model`'s decode step, or when the step cannot run there
    /// (a feature it lacks, weights it cannot hold) its output head; an error saying why when the
    /// head cannot go either (the caller keeps `model` and runs it on the CPU).
    pub fn upload(model: &Model) -> Result<(Arc<Gpu>, Placement)> {
        Self::upload_on(Arc::new(Gpu::new()?), model)
    }

    /// [`upload`](Self::upload) to `gpu` (with its budget).
    pub fn upload_on(gpu: Arc<Gpu>, model: &Model) -> Result<(Arc<Gpu>, Placement)> {
        let why = match GpuLayers::upload(gpu.clone(), model) {
            Ok(layers) => return Ok((gpu, Placement::Layers(Box::new(layers)))),
            Err(e) => format!("{e:#}"),
        };
        let (gpu, head) = Self::head_on(gpu, model)?;
        Ok((gpu, Placement::Head(Box::new(head), why)))
    }

    /// Opens the first GPU and uploads `model`'s output head alone.
    pub fn head_for(model: &Model) -> Result<(Arc<Gpu>, GpuHead)> {
        Self::head_on(Arc::new(Gpu::new()?), model)
    }

    fn head_on(gpu: Arc<Gpu>, model: &Model) -> Result<(Arc<Gpu>, GpuHead)> {
        let projections = model
            .projections()
            .context("the model holds no projections to upload")?;
        let head = GpuHead::upload(gpu.clone(), projections)
            .with_context(|| format!("uploading the output head to {}", gpu.describe()))?;
        Ok((gpu, head))
    }

    /// `model` with `placement` (from [`upload`](Self::upload) or [`head_for`](Self::head_for) on
    /// the same model).
    pub fn new(model: Model, gpu: Arc<Gpu>, placement: Placement) -> Self {
        Self {
            model,
            placement,
            gpu,
            on_cpu: None,
            rows: Rows::default(),
        }
    }

    /// The line that says what runs on the GPU.
    pub fn describe(&self) -> String {
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        match &self.placement {
            Placement::Layers(l) => format!(
                "the decode step ({:.1} MiB of weights and buffers; the KV cache in f32 besides) \
                 runs on {}",
                mib(l.bytes()),
                self.gpu.describe()
            ),
            Placement::Head(head, why) => format!(
                "the output head ({:.1} MiB) runs on {}; the layers stay on the CPU: {why}",
                mib(head.bytes()),
                self.gpu.describe()
            ),
        }
    }

    /// Whether the whole decode step runs on the GPU (not the head alone, nor the CPU after a KV
    /// cache the GPU could not hold).
    pub fn runs_layers(&self) -> bool {
        matches!(self.placement, Placement::Layers(_)) && self.on_cpu.is_none()
    }
}

impl LanguageModel for GpuModel {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn new_cache(&self, ctx: usize) -> KvCache {
        self.model.new_cache(ctx)
    }

    fn forward_into(
        &mut self,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let layers = match &mut self.placement {
            Placement::Head(head, _) => {
                let projections = self
                    .model
                    .projections()
                    .expect("checked when the head was uploaded");
                let mut dense = head.dense(projections);
                return self.model.forward_with(
                    tokens,
                    cache,
                    all_logits,
                    None,
                    Some(&mut dense),
                    logits,
                );
            }
            Placement::Layers(_) if self.on_cpu.is_some() => {
                return self
                    .model
                    .forward_with(tokens, cache, all_logits, None, None, logits);
            }
            Placement::Layers(layers) => layers,
        };
        let embed = &self
            .model
            .projections()
            .expect("checked when the layers were uploaded")
            .embed;
        let on_gpu = forward_layers(
            layers,
            &self.model,
            |token, row| {
                embed.rows_f32(&[token], row);
                Ok(())
            },
            tokens,
            cache,
            all_logits,
            logits,
            &mut self.rows,
            HostFfn::None,
        )?;
        if let Err(why) = on_gpu {
            self.on_cpu = Some(why);
            return self
                .model
                .forward_with(tokens, cache, all_logits, None, None, logits);
        }
        Ok(())
    }
}

/// `tokens` through `layers`, one at a time, each embedding row from `embed`: the logits of
/// the last (or with `all_logits` of every one) into `logits`, the keys and values into
/// `cache`; `host` is what the host does per layer ([`GpuLayers::step`]).
/// `Ok(Err(why))`, with one `gpu:` line on standard error, when the GPU cannot hold the KV cache:
/// nothing was computed and `cache` is as it was, for the CPU to go on from.
#[allow(clippy::too_many_arguments)]
pub(super) fn forward_layers(
    layers: &mut GpuLayers,
    model: &Model,
    mut embed: impl FnMut(u32, &mut [f32]) -> Result<()>,
    tokens: &[u32],
    cache: &mut KvCache,
    all_logits: bool,
    logits: &mut Vec<f32>,
    rows: &mut Rows,
    mut host: HostFfn<'_>,
) -> Result<Result<(), String>> {
    let c = model.config();
    let (t, start) = (tokens.len(), cache.len());
    if t == 0 {
        bail!("forward needs at least one token");
    }
    if start + t > cache.capacity() {
        bail!(
            "context full: {} positions needed, the cache holds {}",
            start + t,
            cache.capacity()
        );
    }
    if let Some(tok) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
        bail!(
            "token id {tok} is outside the vocabulary ({} entries)",
            c.vocab_size
        );
    }
    if let Err(e) = layers.sync(model, cache) {
        // The caller's cache holds every position: the CPU goes on from it.
        let why = format!("{e:#}");
        eprintln!("gpu: {why}; running on the CPU");
        return Ok(Err(why));
    }
    rows.logits.resize(c.vocab_size, 0.0);
    rows.embedding.resize(c.hidden_size, 0.0);
    logits.clear();
    for (i, &token) in tokens.iter().enumerate() {
        embed(token, &mut rows.embedding)?;
        let host = host.reborrow();
        layers.step(model, &rows.embedding, cache, &mut rows.logits, host)?;
        cache.advance(1);
        if all_logits || i + 1 == t {
            logits.extend_from_slice(&rows.logits);
        }
    }
    Ok(Ok(()))
}
