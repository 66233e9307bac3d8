//! A converted file's decode step on the GPU: with its FFN from the file's neuron bundles there,
//! what `LEANSTREAM_GPU=1` gives `--policy resident` and `--policy dense` on a converted file;
//! with its FFN on the CPU (the dense half on the GPU, the bundles streamed from flash), what
//! it gives the streaming policies (docs/gpu.md). The streaming model holds it and hands it each
//! forward call ([`crate::streaming::StreamingModel`]).

use std::sync::Arc;

use anyhow::{Context, Result};

use super::layers::BundleParts;
use super::model::{forward_layers, Rows};
use super::{CpuFfn, Gpu, GpuLayers};
use crate::kernels::Weight;
use crate::model::kv_cache::KvCache;
use crate::model::{Attention, FfnBackend, Model, TokenScratch};

/// A converted model's decode step on the GPU, with the FFN of every layer from its bundles
/// there, or on the CPU.
pub struct GpuBundles {
    gpu: Arc<Gpu>,
    layers: GpuLayers,
    rows: Rows,
    /// Where the FFN runs on the CPU: its scratch.
    cpu_ffn: Option<TokenScratch>,
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
            cpu_ffn: None,
        })
    }

    /// Uploads the dense half of the step to `gpu` — `model`'s norms, the `attention`
    /// projections, the output `head` — and leaves the FFN to the CPU
    /// ([`GpuLayers::upload_attention`]): each [`forward`](Self::forward) then takes the CPU's
    /// FFN backend.
    pub fn upload_attention(
        gpu: Gpu,
        model: &Model,
        attention: &[Attention],
        head: &Weight,
    ) -> Result<Self> {
        let gpu = Arc::new(gpu);
        let layers = GpuLayers::upload_attention(gpu.clone(), model, attention, head)
            .with_context(|| format!("uploading the attention to {}", gpu.describe()))?;
        Ok(Self {
            gpu,
            layers,
            rows: Rows::default(),
            cpu_ffn: Some(model.token_scratch()),
        })
    }

    /// Whether the FFN runs on the CPU ([`upload_attention`](Self::upload_attention)).
    pub fn ffn_on_cpu(&self) -> bool {
        self.cpu_ffn.is_some()
    }

    /// The line that says what runs on the GPU.
    pub fn describe(&self) -> String {
        if self.cpu_ffn.is_some() {
            return format!(
                "the attention and the output head ({:.1} MiB of weights and buffers; the KV \
                 cache in f32 besides) run on {}, each layer's FFN on the CPU from the bundles \
                 it streams",
                self.layers.bytes() as f64 / (1 << 20) as f64,
                self.gpu.describe()
            );
        }
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
    /// embedding row from `embed`, the FFN by `backend` where it runs on the CPU (`None`
    /// otherwise). `Ok(false)`: the GPU cannot hold the KV cache (said once on standard error),
    /// nothing was computed, and the caller computes on the CPU from now on (the streaming model
    /// drops this step then).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        model: &Model,
        embed: impl FnMut(u32, &mut [f32]) -> Result<()>,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
        logits: &mut Vec<f32>,
        backend: Option<&mut dyn FfnBackend>,
    ) -> Result<bool> {
        let cpu = match (backend, self.cpu_ffn.as_mut()) {
            (Some(backend), Some(scratch)) => Some(CpuFfn { backend, scratch }),
            (None, None) => None,
            (Some(_), None) => anyhow::bail!("this step's FFN runs on the GPU"),
            (None, Some(_)) => anyhow::bail!("this step's FFN runs on the CPU: pass its backend"),
        };
        let done = forward_layers(
            &mut self.layers,
            model,
            embed,
            tokens,
            cache,
            all_logits,
            logits,
            &mut self.rows,
            cpu,
        )?;
        Ok(done.is_ok())
    }
}
