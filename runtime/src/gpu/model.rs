//! A resident model whose output head runs on the GPU: what `LEANSTREAM_GPU=1` gives the dense
//! policy (docs/gpu.md).

use std::sync::Arc;

use anyhow::{Context, Result};

use super::{Gpu, GpuHead};
use crate::model::kv_cache::KvCache;
use crate::model::{LanguageModel, Model};
use crate::source::config::ModelConfig;

/// [`Model`] with its logits computed by [`GpuHead`]; everything else on the CPU, unchanged.
pub struct GpuModel {
    model: Model,
    head: GpuHead,
    gpu: Arc<Gpu>,
}

impl GpuModel {
    /// Opens the first GPU and uploads `model`'s head; an error saying why when either fails (the
    /// caller keeps `model` and runs it on the CPU).
    pub fn head_for(model: &Model) -> Result<(Arc<Gpu>, GpuHead)> {
        let gpu = Arc::new(Gpu::new()?);
        let projections = model
            .projections()
            .context("the model holds no projections to upload")?;
        let head = GpuHead::upload(gpu.clone(), projections)
            .with_context(|| format!("uploading the output head to {}", gpu.describe()))?;
        Ok((gpu, head))
    }

    /// `model` with `head` (from [`head_for`](Self::head_for) on the same model).
    pub fn new(model: Model, gpu: Arc<Gpu>, head: GpuHead) -> Self {
        Self { model, head, gpu }
    }

    /// The line that says where the head runs.
    pub fn describe(&self) -> String {
        format!(
            "the output head ({:.1} MiB) runs on {}",
            self.head.bytes() as f64 / (1 << 20) as f64,
            self.gpu.describe()
        )
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
        let projections = self
            .model
            .projections()
            .expect("checked when the head was uploaded");
        let mut dense = self.head.dense(projections);
        self.model
            .forward_with(tokens, cache, all_logits, None, Some(&mut dense), logits)
    }
}
