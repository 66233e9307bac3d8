//! The GPU's neuron pool: where a streaming model's FFN bundles live on the GPU
//! ([`GpuLayers::upload_streamed`](super::GpuLayers::upload_streamed)). Three buffers (gate rows,
//! up rows, down columns) cut into slots of one cluster each, as stored; the engine uploads a
//! cluster when a token first needs it on the GPU (from its neuron cache or from the read that
//! brought it), and the pool keeps it until its slot is wanted by another, the least recently
//! used first (a clock). Each layer's map says, per neuron, its row in the pool or that the
//! CPU's choice skips it (`mapped.wgsl`, `select.wgsl`).

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use leanstream_format::ffn::PartTypes;

use super::{Gpu, GpuWeights, Slots};
use crate::kernels::bundles::{ClusterRows, NeuronRows};

/// A neuron the CPU's choice skips, in a layer's map.
pub(super) const SKIPPED: u32 = u32::MAX;

/// A streamed layer's shape, for [`NeuronPool::new`].
pub struct PoolLayer {
    pub qtypes: PartTypes,
    /// Each cluster's first neuron (stored position) and its neurons.
    pub clusters: Vec<(u32, u32)>,
}

/// A layer in the pool: its encodings and their row bytes, its clusters (first neuron, neurons)
/// and its map (one word a neuron).
struct Layer {
    qtypes: PartTypes,
    row_bytes: [usize; 3],
    clusters: Vec<(u32, u32)>,
    map: wgpu::Buffer,
}

/// The GPU's slots of clusters and the maps of the layers' neurons to them.
pub(super) struct NeuronPool {
    /// Gate rows, up rows, down columns: `slots` slots of `strides[p]` bytes each.
    parts: [wgpu::Buffer; 3],
    strides: [u64; 3],
    /// Neurons a slot holds (the largest cluster's).
    slot_neurons: u32,
    layers: Vec<Layer>,
    hidden: usize,
    /// Per slot: the cluster it holds, and whether it was used since the clock last passed.
    owner: Vec<Option<(u32, u32)>>,
    used: Vec<bool>,
    /// Per slot: the layer call that last needed it (such a slot is never given up in it).
    stamp: Vec<u64>,
    now: u64,
    hand: usize,
    index: HashMap<(u32, u32), u32>,
    /// A cluster's part rows end to end, for one write, and a layer's map on the host.
    staging: Vec<u8>,
    map: Vec<u32>,
    /// Bytes on the GPU (the slots and the maps).
    pub(super) bytes: u64,
    /// Clusters uploaded since the pool was made.
    pub(super) uploads: u64,
}

impl NeuronPool {
    /// A pool of `slots` clusters for `layers` of `hidden` values, fewer where the GPU's budget
    /// holds fewer besides the `reserve` bytes the rest of the step and its KV cache will take:
    /// an error when that is less than the largest layer (every cluster of a layer may be needed
    /// at once) or more than one buffer holds. `charge` takes each buffer's bytes first.
    pub(super) fn new(
        gpu: &Gpu,
        layers: Vec<PoolLayer>,
        hidden: usize,
        slots: usize,
        reserve: u64,
        charge: &super::Charge,
    ) -> Result<Self> {
        let slot_neurons = layers
            .iter()
            .flat_map(|l| l.clusters.iter().map(|c| c.1))
            .max()
            .context("a streamed model without clusters")?;
        let most = layers.iter().map(|l| l.clusters.len()).max().unwrap_or(0);
        if slots as u64 * slot_neurons as u64 >= SKIPPED as u64 {
            bail!("a pool of {slots} clusters of {slot_neurons} neurons has too many rows");
        }
        let mut widest = [0usize; 3];
        let mut shaped = Vec::with_capacity(layers.len());
        for (l, layer) in layers.into_iter().enumerate() {
            let q = layer.qtypes;
            let rb = q
                .row_bytes(hidden)
                .with_context(|| format!("layer {l}'s rows of {hidden} values"))?;
            for p in 0..3 {
                widest[p] = widest[p].max(rb[p]);
            }
            let neurons = layer.clusters.iter().map(|c| c.1 as usize).sum::<usize>();
            charge.take(4 * neurons.max(1) as u64)?;
            let map = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("neuron map"),
                size: 4 * neurons.max(1) as u64,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            shaped.push(Layer {
                qtypes: q,
                row_bytes: rb,
                clusters: layer.clusters,
                map,
            });
        }
        let strides = widest.map(|w| slot_neurons as u64 * w as u64);
        let slot_bytes = strides.iter().sum::<u64>();
        let slots = match gpu.budget {
            Some(budget) => {
                let free = budget.saturating_sub(charge.held() + reserve);
                slots.min((free / slot_bytes) as usize)
            }
            None => slots,
        };
        if slots < most {
            bail!(
                "a neuron pool of {slots} clusters ({}) holds less than a layer ({most} clusters) \
                 beside the step and its KV cache",
                crate::platform::memory_size::format_size(slots as u64 * slot_bytes)
            );
        }
        let max = gpu.max_matrix_bytes().min(u32::MAX as u64);
        let mut bytes = shaped.iter().map(|l| l.map.size()).sum::<u64>();
        let parts = strides.map(|stride| {
            let size = stride * slots as u64;
            if size > max {
                bail!(
                    "a pool of {slots} clusters ({size} bytes a part) is larger than the GPU's \
                     largest storage buffer ({max} bytes)"
                );
            }
            charge.take(size)?;
            bytes += size;
            Ok(gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("neuron pool"),
                size,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }))
        });
        let [g, u, d] = parts;
        Ok(Self {
            parts: [g?, u?, d?],
            strides,
            slot_neurons,
            layers: shaped,
            hidden,
            owner: vec![None; slots],
            used: vec![false; slots],
            stamp: vec![0; slots],
            now: 0,
            hand: 0,
            index: HashMap::new(),
            staging: Vec::new(),
            map: Vec::new(),
            bytes,
            uploads: 0,
        })
    }

    /// Layer `l`'s parts as matrices of `neurons` rows in the pool's slots, for the step's
    /// dispatches, and its map.
    pub(super) fn layer(&self, gpu: &Gpu, l: usize) -> Result<([GpuWeights; 3], &wgpu::Buffer)> {
        let Layer {
            qtypes: q,
            row_bytes: rb,
            clusters,
            map,
        } = &self.layers[l];
        let rows = clusters.iter().map(|c| c.1 as usize).sum::<usize>();
        let part = |p: usize, qtype| -> Result<GpuWeights> {
            Ok(GpuWeights {
                rows,
                cols: self.hidden,
                qtype,
                bytes: 0,
                row_bytes: rb[p],
                slots: Slots {
                    neurons: self.slot_neurons,
                    stride: self.strides[p] as u32,
                },
                buffer: self.parts[p].clone(),
                pipeline: gpu.pipeline(qtype)?,
            })
        };
        Ok(([part(0, q.gate)?, part(1, q.up)?, part(2, q.down)?], map))
    }

    /// Slots the pool holds.
    pub(super) fn slots(&self) -> usize {
        self.owner.len()
    }

    /// A new layer call: the clusters it needs are marked by [`holds`](Self::holds) and
    /// [`upload`](Self::upload) and kept until the next.
    pub(super) fn begin(&mut self) {
        self.now += 1;
    }

    /// Whether the pool holds `key`, marking it needed by this layer call.
    pub(super) fn holds(&mut self, key: (u32, u32)) -> bool {
        match self.index.get(&key) {
            Some(&s) => {
                self.used[s as usize] = true;
                self.stamp[s as usize] = self.now;
                true
            }
            None => false,
        }
    }

    /// Writes cluster `key` (its `rows`) into a slot: a free one, else the first the clock finds
    /// unused since it last passed and not needed by this layer call.
    pub(super) fn upload(&mut self, gpu: &Gpu, key: (u32, u32), rows: &ClusterRows) -> Result<()> {
        if self.holds(key) {
            return Ok(());
        }
        let (l, ci) = (key.0 as usize, key.1 as usize);
        let layer = &self.layers[l];
        let (rb, count) = (layer.row_bytes, layer.clusters[ci].1 as usize);
        let slots = self.owner.len();
        let mut looked = 0;
        let slot = loop {
            let s = self.hand;
            self.hand = (self.hand + 1) % slots;
            if self.owner[s].is_none() {
                break s;
            }
            if self.stamp[s] != self.now {
                if !self.used[s] {
                    break s;
                }
                self.used[s] = false;
            }
            looked += 1;
            if looked > 2 * slots {
                bail!("every slot of the GPU's neuron pool is needed by layer {l}");
            }
        };
        if let Some(old) = self.owner[slot].take() {
            self.index.remove(&old);
        }
        for (p, part) in self.parts.iter().enumerate() {
            let staging = &mut self.staging;
            staging.clear();
            for k in 0..count {
                staging.extend_from_slice(match p {
                    0 => rows.gate(k),
                    1 => rows.up(k),
                    _ => rows.down(k),
                });
            }
            debug_assert_eq!(staging.len(), count * rb[p]);
            gpu.queue
                .write_buffer(part, slot as u64 * self.strides[p], staging);
        }
        self.owner[slot] = Some(key);
        self.used[slot] = true;
        self.stamp[slot] = self.now;
        self.index.insert(key, slot as u32);
        self.uploads += 1;
        Ok(())
    }

    /// Writes layer `l`'s map: neuron `i` of a `needed` cluster (ascending) that is a
    /// `candidate` at its row in the pool, every other [`SKIPPED`]. An error when a needed
    /// cluster is not in the pool.
    pub(super) fn write_map(
        &mut self,
        gpu: &Gpu,
        l: usize,
        needed: &[usize],
        candidate: &[bool],
    ) -> Result<()> {
        let Layer {
            clusters,
            map: buffer,
            ..
        } = &self.layers[l];
        let map = &mut self.map;
        map.clear();
        map.resize(candidate.len(), SKIPPED);
        for &ci in needed {
            let (first, count) = clusters[ci];
            let slot = *self
                .index
                .get(&(l as u32, ci as u32))
                .with_context(|| format!("layer {l}'s cluster {ci} is not on the GPU"))?;
            let base = slot * self.slot_neurons;
            for k in 0..count {
                let i = (first + k) as usize;
                if candidate[i] {
                    map[i] = base + k;
                }
            }
        }
        gpu.queue.write_buffer(buffer, 0, super::f32_bytes_u32(map));
        Ok(())
    }

    /// Layer `l`'s map as written last ([`write_map`](Self::write_map)): which neurons were
    /// computed.
    pub(super) fn computed(&self, i: usize) -> bool {
        self.map[i] != SKIPPED
    }
}

/// What a streaming model's engine does for a step whose FFN runs from the neuron pool
/// ([`GpuLayers::upload_streamed`](super::GpuLayers::upload_streamed)).
pub trait StreamedFfn {
    /// The residual stream entering layer `l` is known (its attention not computed yet): the
    /// moment to queue the reads it expects.
    fn begin_layer(&mut self, l: usize, residual: &[f32]) -> Result<()>;
    /// Layer `l`'s FFN for the FFN input `x` (normalised): the engine chooses the neurons and
    /// their clusters, hands `gpu` those it does not hold (from memory or as their reads land),
    /// has it compute the layer, and learns from its scores what to keep.
    fn ffn_on_gpu(&mut self, l: usize, x: &[f32], gpu: &mut dyn PoolTarget) -> Result<()>;
}

/// A layer's FFN on the GPU from the neuron pool, as [`StreamedFfn::ffn_on_gpu`] drives it.
pub trait PoolTarget {
    /// Whether the pool holds cluster `key` (layer, cluster), kept now for this layer.
    fn holds(&mut self, key: (u32, u32)) -> bool;
    /// Uploads cluster `key`'s rows.
    fn upload(&mut self, key: (u32, u32), rows: &ClusterRows) -> Result<()>;
    /// Computes the layer's FFN into the residual stream from the `needed` clusters (ascending,
    /// each held) and their `candidate` neurons (a flag per neuron), and returns each neuron's
    /// exact skip score, NaN for those not computed.
    fn compute(&mut self, needed: &[usize], candidate: &[bool]) -> Result<&[f32]>;
}
