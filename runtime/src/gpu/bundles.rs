//! A converted file's decode step on the GPU: with its FFN from the file's neuron bundles there,
//! what `LEANSTREAM_GPU=1` gives `--policy resident` and `--policy dense` on a converted file;
//! with its FFN from the bundles the CPU streams from flash into the GPU's neuron pool, or with
//! its FFN on the CPU (the dense half on the GPU), what it gives the streaming policies
//! (docs/gpu.md). The streaming model holds it and hands it each forward call
//! ([`crate::streaming::StreamingModel`]).

use std::sync::Arc;

use anyhow::{Context, Result};

use super::layers::BundleParts;
use super::model::{forward_layers, Rows};
use super::{CpuFfn, Gpu, GpuLayers, HostFfn, PoolLayer, StreamedFfn};
use crate::kernels::Weight;
use crate::model::kv_cache::KvCache;
use crate::model::{Attention, FfnBackend, Model, TokenScratch};
use crate::streaming::skip_rule::Skip;

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

    /// Uploads the dense half of the step to `gpu` — `model`'s norms, the `attention`
    /// projections, the output `head` — and a neuron pool of `slots` clusters (fewer where the
    /// GPU's budget holds fewer beside a KV cache of `ctx` positions) for the `layers`' bundles,
    /// which the CPU streams into it ([`GpuLayers::upload_streamed`]): each
    /// [`forward`](Self::forward) then takes the engine that streams them.
    pub fn upload_streamed(
        gpu: Gpu,
        model: &Model,
        attention: &[Attention],
        head: &Weight,
        layers: Vec<(PoolLayer, Skip)>,
        slots: usize,
        ctx: usize,
    ) -> Result<Self> {
        let gpu = Arc::new(gpu);
        let layers =
            GpuLayers::upload_streamed(gpu.clone(), model, attention, head, layers, slots, ctx)
                .with_context(|| {
                    format!(
                        "uploading the step and its neuron pool to {}",
                        gpu.describe()
                    )
                })?;
        Ok(Self {
            gpu,
            layers,
            rows: Rows::default(),
            cpu_ffn: None,
        })
    }

    /// Where each layer's FFN runs, and so what [`forward`](Self::forward) takes.
    pub fn ffn_place(&self) -> FfnPlace {
        match (&self.cpu_ffn, self.layers.pool_slots()) {
            (Some(_), _) => FfnPlace::Cpu,
            (None, Some(_)) => FfnPlace::Streamed,
            (None, None) => FfnPlace::Gpu,
        }
    }

    /// What runs on the GPU, for `--json`'s `gpu` object: where the FFN runs (`gpu` from every
    /// bundle, `pool`, `cpu`), the step's bytes without the KV cache, and with a pool its slots,
    /// bytes and the clusters uploaded since `uploads_base` was the count.
    pub fn summary(&self, uploads_base: u64) -> serde_json::Value {
        let ffn = match self.ffn_place() {
            FfnPlace::Gpu => "gpu",
            FfnPlace::Streamed => "pool",
            FfnPlace::Cpu => "cpu",
        };
        let mut v = serde_json::json!({
            "adapter": self.gpu.describe(),
            "ffn": ffn,
            "bytes": self.layers.bytes(),
        });
        if let Some(slots) = self.layers.pool_slots() {
            v["pool_slots"] = slots.into();
            v["pool_bytes"] = self.layers.pool_bytes().into();
            v["pool_uploads"] = (self.layers.pool_uploads() - uploads_base).into();
        }
        v
    }

    /// Clusters uploaded into the neuron pool so far (0 without one).
    pub fn layers_uploads(&self) -> u64 {
        self.layers.pool_uploads()
    }

    /// Clusters uploaded into the neuron pool so far, and the slots it has (where the FFN
    /// streams into it).
    pub fn pool_uploads(&self) -> Option<(u64, usize)> {
        self.layers
            .pool_slots()
            .map(|slots| (self.layers.pool_uploads(), slots))
    }

    /// The line that says what runs on the GPU.
    pub fn describe(&self) -> String {
        if let Some(slots) = self.layers.pool_slots() {
            return format!(
                "the decode step ({:.1} MiB of weights and buffers, with a neuron pool of {slots} \
                 clusters in {:.1} MiB; the KV cache in f32 besides) runs on {}, each layer's FFN \
                 from the bundles the CPU streams into the pool",
                self.layers.bytes() as f64 / (1 << 20) as f64,
                self.layers.pool_bytes() as f64 / (1 << 20) as f64,
                self.gpu.describe()
            );
        }
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
    /// embedding row from `embed`; `host` is the FFN backend where the FFN runs on the CPU, the
    /// engine where it streams into the neuron pool ([`ffn_place`](Self::ffn_place)).
    /// `Ok(false)`: the GPU cannot hold the KV cache (said once on standard error), nothing was
    /// computed, and the caller computes on the CPU from now on (the streaming model drops this
    /// step then).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        model: &Model,
        embed: impl FnMut(u32, &mut [f32]) -> Result<()>,
        tokens: &[u32],
        cache: &mut KvCache,
        all_logits: bool,
        logits: &mut Vec<f32>,
        host: Host<'_>,
    ) -> Result<bool> {
        let host = match (host, self.cpu_ffn.as_mut()) {
            (Host::Backend(backend), Some(scratch)) => HostFfn::Cpu(CpuFfn { backend, scratch }),
            (Host::Backend(_), None) => anyhow::bail!("this step's FFN does not run on the CPU"),
            (Host::None, _) => HostFfn::None,
            (Host::Streamed(engine), _) => HostFfn::Streamed(engine),
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
            host,
        )?;
        Ok(done.is_ok())
    }
}

/// Where a converted model's FFN runs with its step on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnPlace {
    /// On the GPU from every bundle, uploaded once.
    Gpu,
    /// On the GPU from the bundles the CPU streams into the neuron pool.
    Streamed,
    /// On the CPU.
    Cpu,
}

/// What the host brings to [`GpuBundles::forward`].
pub enum Host<'a> {
    /// Nothing: the FFN runs on the GPU from every bundle.
    None,
    /// The CPU's FFN backend ([`FfnPlace::Cpu`]).
    Backend(&'a mut dyn FfnBackend),
    /// The engine that streams the bundles into the neuron pool ([`FfnPlace::Streamed`]).
    Streamed(&'a mut dyn StreamedFfn),
}
