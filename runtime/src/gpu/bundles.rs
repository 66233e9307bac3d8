//! A converted file's decode step on the GPU, its FFN from the file's neuron bundles: what
//! `LEANSTREAM_GPU=1` gives `--policy resident` and `--policy dense` on a converted file
//! (docs/gpu.md). The streaming model holds it and hands it each forward call
//! ([`crate::streaming::StreamingModel`]).

use std::sync::Arc;

use anyhow::{Context, Result};

use super::layers::BundleParts;
use super::model::{forward_layers, Rows};
use super::{Gpu, GpuLayers};
use crate::kernels::Weight;
use crate::model::kv_cache::KvCache;
use crate::model::{Attention, Model};

/// A converted model's decode step on the GPU, with the FFN of every layer from its bundles.
pub struct GpuBundles {
    gpu: Arc<Gpu>,
    layers: GpuLayers,
    rows: Rows,
}

impl GpuBundles {
    /// Uploads the step to `gpu`: `model`'s norms (a model of norms only), the `attention`
    /// projections, the output `head`, and each layer's bundles as `bundles(l)` gives them; an
    /// error that says why when the GPU lacks something the step needs.
    pub fn upload(
        gpu: Gpu,
        model: &Model,
        attention: &[Attention],
        head: &Weight,
        bundles: impl FnMut(usize) -> Result<BundleParts>,
    ) -> Result<Self> {
        let gpu = Arc::new(gpu);
        let layers = GpuLayers::upload_bundles(gpu.clone(), model, attention, head, bundles)
            .with_context(|| format!("uploading the decode step to {}", gpu.describe()))?;
        Ok(Self {
            gpu,
            layers,
            rows: Rows::default(),
        })
    }

    /// The line that says what runs on the GPU.
    pub fn describe(&self) -> String {
        format!(
            "the decode step, its FFN from the file's bundles ({:.1} MiB of weights and buffers; \
             the KV cache in f32 besides), runs on {}",
            self.layers.bytes() as f64 / (1 << 20) as f64,
            self.gpu.describe()
        )
    }

    /// The step on the GPU: its last token's active neurons per layer, and the scores a test
    /// records.
    pub fn layers(&mut self) -> &mut GpuLayers {
        &mut self.layers
    }

    /// `tokens` through the GPU's step (as [`crate::model::LanguageModel::forward_into`]), each
    /// embedding row from `embed`. `Ok(false)`: the GPU cannot hold the KV cache (said once on
    /// standard error), nothing was computed, and the caller computes on the CPU from now on (the
    /// streaming model drops this step then).
    pub fn forward(
        &mut self,
        model: &Model,
        embed: impl FnMut(u32, &mut [f32]) -> Result<()>,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
        logits: &mut Vec<f32>,
    ) -> Result<bool> {
        let done = forward_layers(
            &mut self.layers,
            model,
            embed,
            tokens,
            cache,
            all_logits,
            logits,
            &mut self.rows,
        )?;
        Ok(done.is_ok())
    }
}
