//! The dense path's output head on the GPU: a [`DenseWeights`] source that reads the embedding and
//! the attention projections from a model's own [`Projections`] (the CPU kernels) and computes the
//! logits with [`Gpu::matvec`].

use std::sync::Arc;

use anyhow::Result;

use super::{Gpu, GpuMatrix};
use crate::model::{Attention, DenseWeights, Projections};

/// A model's output head (its `lm_head`, or the embedding when tied), uploaded.
pub struct GpuHead {
    gpu: Arc<Gpu>,
    head: GpuMatrix,
}

impl GpuHead {
    /// Uploads the head of `projections`; an error when the GPU cannot hold it.
    pub fn upload(gpu: Arc<Gpu>, projections: &Projections) -> Result<Self> {
        let head = gpu.upload(projections.lm_head.as_ref().unwrap_or(&projections.embed))?;
        Ok(Self { gpu, head })
    }

    /// The bytes of the head on the GPU.
    pub fn bytes(&self) -> usize {
        self.head.bytes
    }

    /// The [`DenseWeights`] of one forward pass over `projections` (those the head came from).
    pub fn dense<'a>(&'a self, projections: &'a Projections) -> GpuDense<'a> {
        GpuDense {
            head: self,
            projections,
        }
    }
}

/// [`DenseWeights`] with the head on the GPU, everything else from the CPU's projections.
pub struct GpuDense<'a> {
    head: &'a GpuHead,
    projections: &'a Projections,
}

impl DenseWeights for GpuDense<'_> {
    fn embed(&mut self, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        self.projections.embed.rows_f32(tokens, out);
        Ok(())
    }

    fn attention(&mut self, l: usize) -> Result<&Attention> {
        Ok(&self.projections.attention[l])
    }

    fn head(&mut self, xn: &[f32], rows: usize, logits: &mut [f32]) -> Result<()> {
        let h = &self.head.head;
        for (x, out) in xn
            .chunks_exact(h.cols)
            .zip(logits.chunks_exact_mut(h.rows))
            .take(rows)
        {
            self.head.gpu.matvec(h, x, out)?;
        }
        Ok(())
    }
}
