//! Mat-vecs on a GPU through wgpu (Vulkan on Linux and Android, Metal on Apple), behind the `gpu`
//! feature: docs/gpu.md. [`GpuLayers`] builds a resident model's whole decode step from them and
//! a few more kernels; [`GpuModel`] is what the dense policy runs.
//!
//! A [`GpuMatrix`] is a [`Weight`]'s rows uploaded as they are stored (f32, f16, bf16, q8_0, q4_0,
//! q4_1, q5_0, q5_1, q4_k, q5_k, q6_k: FORMAT.md §10), byte for byte, into one storage buffer; a
//! WGSL compute shader per encoding decodes them in registers. [`Gpu::matvec`] takes the input in
//! the same form as the CPU kernels do (f32 for the float encodings, the q8 form of
//! [`Q8Vec`] for the block encodings), so that each block's integer sum is the CPU's exactly and
//! a result differs from the CPU kernels' only by the order in which f32 terms are added (and
//! where the GPU fuses a multiply and an add): [`tolerance`] bounds that.
//!
//! The shaders use no subgroup operations: one workgroup of 64 invocations per row, a fixed tree
//! to add their partial sums, so they run on any adapter, Mesa's lavapipe (a CPU Vulkan) included.

mod bundles;
mod head;
mod layers;
mod model;
mod pool;

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use leanstream_format::quant::{row_bytes, QuantType, BLOCK_LEN, K_BLOCK_LEN};
use wgpu::util::DeviceExt;

use crate::kernels::{Q8Vec, Weight};
use crate::platform::memory_size::{format_size, parse_budget};

pub use bundles::{FfnPlace, GpuBundles, Host};
pub use head::{GpuDense, GpuHead};
pub use layers::{
    unsupported, unsupported_config, BundleParts, CpuFfn, GpuLayers, GpuSpan, HostFfn, SpanKind,
};
pub use model::{GpuModel, Placement};
pub use pool::{PoolLayer, PoolTarget, StreamedFfn};

const BYTES: &str = include_str!("shaders/bytes.wgsl");
const COMMON: &str = include_str!("shaders/common.wgsl");
const MATVEC: &str = include_str!("shaders/matvec.wgsl");
const GATHER: &str = include_str!("shaders/gather.wgsl");
const MAPPED: &str = include_str!("shaders/mapped.wgsl");
const UNITS: &str = include_str!("shaders/units.wgsl");
const DOWN: &str = include_str!("shaders/down.wgsl");
const ELEMS: &str = include_str!("shaders/elems.wgsl");

/// The text after the marker `//@name` in `text`, up to the next marker.
fn section<'a>(text: &'a str, file: &str, name: &str) -> &'a str {
    let marker = format!("//@{name}\n");
    let start = text
        .find(&marker)
        .unwrap_or_else(|| panic!("{file} has no {name}"))
        + marker.len();
    let end = text[start..].find("//@").map_or(text.len(), |e| start + e);
    &text[start..end]
}

/// The `unit_dot` of `qtype` from `units.wgsl`, with the K-quants' shared function.
fn unit_source(qtype: QuantType) -> String {
    let mut s = section(UNITS, "units.wgsl", qtype.name()).to_string();
    if matches!(qtype, QuantType::Q4_K | QuantType::Q5_K) {
        s.push_str(section(UNITS, "units.wgsl", "k45"));
    }
    s
}

/// The whole mat-vec shader of `qtype`.
fn shader_source(qtype: QuantType) -> String {
    format!("{BYTES}\n{COMMON}\n{MATVEC}\n{}", unit_source(qtype))
}

/// The mat-vec over listed rows (`gather.wgsl`) of `qtype`.
fn gather_source(qtype: QuantType) -> String {
    format!("{BYTES}\n{COMMON}\n{GATHER}\n{}", unit_source(qtype))
}

/// The mat-vec over a streamed layer's neurons in the neuron pool (`mapped.wgsl`) of `qtype`.
fn mapped_source(qtype: QuantType) -> String {
    format!("{BYTES}\n{COMMON}\n{MAPPED}\n{}", unit_source(qtype))
}

/// The down update (`down.wgsl`) over columns of `qtype`, with its `elem` (`elems.wgsl`).
fn down_source(qtype: QuantType) -> String {
    let mut s = format!(
        "{BYTES}\n{DOWN}\n{}",
        section(ELEMS, "elems.wgsl", qtype.name())
    );
    if matches!(qtype, QuantType::Q4_K | QuantType::Q5_K) {
        s.push_str(section(ELEMS, "elems.wgsl", "k45"));
    }
    if matches!(
        qtype,
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1
    ) {
        s.push_str(section(ELEMS, "elems.wgsl", "nibble"));
    }
    s
}

/// A GPU device and one compute pipeline per encoding (built when first used).
pub struct Gpu {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    pipelines: Mutex<Vec<Option<wgpu::ComputePipeline>>>,
    /// The decode step's other kernels (`layers.rs`), by name.
    kernels: Mutex<HashMap<String, wgpu::ComputePipeline>>,
    /// The most bytes a model's weights, buffers and KV cache may take on this GPU
    /// ([`GPU_MEMORY`]); `None`: as much as the adapter allocates.
    budget: Option<u64>,
    /// Where the budget came from, for the errors: `--gpu-memory` or [`GPU_MEMORY`].
    budget_from: &'static str,
}

/// The environment variable that caps the GPU memory a model takes (docs/gpu.md): a size as
/// `--memory` takes it (`512MiB`, `1.5GiB`, `300MB`, bytes).
pub const GPU_MEMORY: &str = "LEANSTREAM_GPU_MEMORY";

/// The budget [`GPU_MEMORY`]'s value asks for: `None` when it is unset or empty; an error that
/// names the variable when it is not a positive size.
pub fn budget_from(value: Option<&str>) -> Result<Option<u64>> {
    match value.map(str::trim) {
        None | Some("") => Ok(None),
        Some(v) => parse_budget(v)
            .map(Some)
            .map_err(|e| anyhow!("{GPU_MEMORY}={v}: {e}")),
    }
}

/// What one upload has taken from [`Gpu`]'s budget so far: each buffer is charged before it is
/// made, so that an upload the budget cannot hold stops before it allocates past it.
pub(crate) struct Charge<'g> {
    gpu: &'g Gpu,
    what: &'static str,
    held: Cell<u64>,
}

impl Charge<'_> {
    /// Charges a buffer of `bytes`; an error that names the budget when it does not fit.
    pub(crate) fn take(&self, bytes: u64) -> Result<()> {
        let held = self.held.get() + bytes;
        if let Some(budget) = self.gpu.budget {
            if held > budget {
                bail!(
                    "{} need more than the {} that {} allows on the GPU ({} taken when \
                     {} more was asked for)",
                    self.what,
                    format_size(budget),
                    self.gpu.budget_from,
                    format_size(self.held.get()),
                    format_size(bytes)
                );
            }
        }
        self.held.set(held);
        Ok(())
    }

    /// Bytes charged so far.
    pub(crate) fn held(&self) -> u64 {
        self.held.get()
    }
}

impl Gpu {
    /// The first Vulkan or Metal adapter wgpu finds (a discrete GPU before an integrated one, and
    /// either before a CPU implementation such as lavapipe); an error that says why when there is
    /// none or its device cannot be opened. `WGPU_BACKEND` and `WGPU_ADAPTER_NAME` narrow the
    /// choice as wgpu documents; [`GPU_MEMORY`] sets its budget.
    pub fn new() -> Result<Self> {
        Self::open(None)
    }

    /// [`new`](Self::new) with `budget` (`--gpu-memory`) in place of [`GPU_MEMORY`]'s when it
    /// is set.
    pub fn open(budget: Option<u64>) -> Result<Self> {
        let (budget, from) = match budget {
            Some(b) => (Some(b), "--gpu-memory"),
            None => (
                budget_from(std::env::var(GPU_MEMORY).ok().as_deref())?,
                GPU_MEMORY,
            ),
        };
        let mut gpu =
            Self::with_backends((wgpu::Backends::VULKAN | wgpu::Backends::METAL).with_env())?;
        (gpu.budget, gpu.budget_from) = (budget, from);
        Ok(gpu)
    }

    /// This GPU with at most `budget` bytes for a model's weights, buffers and KV cache (`None`:
    /// no limit but the adapter's), as `--gpu-memory` sets it.
    pub fn with_budget(mut self, budget: Option<u64>) -> Self {
        self.budget = budget;
        self.budget_from = "--gpu-memory";
        self
    }

    /// A new [`Charge`] against the budget for an upload of `what` (for its error message).
    pub(crate) fn charge(&self, what: &'static str) -> Charge<'_> {
        Charge {
            gpu: self,
            what,
            held: Cell::new(0),
        }
    }

    /// [`new`](Self::new) among the adapters of `backends` only (those built in: Vulkan, Metal).
    pub fn with_backends(backends: wgpu::Backends) -> Result<Self> {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = backends;
        let instance = wgpu::Instance::new(desc);
        let adapter =
            match pollster::block_on(wgpu::util::initialize_adapter_from_env(&instance, None)) {
                Ok(named) => named,
                Err(_) => pollster::block_on(
                    instance.request_adapter(&wgpu::RequestAdapterOptions {
                        power_preference: wgpu::PowerPreference::from_env()
                            .unwrap_or(wgpu::PowerPreference::HighPerformance),
                        ..Default::default()
                    }),
                )
                .map_err(|e| anyhow!("no GPU adapter (Vulkan or Metal) found: {e}"))?,
            };
        let info = adapter.get_info();
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("leanstream"),
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .with_context(|| format!("opening the GPU {} failed", info.name))?;
        Ok(Self {
            device,
            queue,
            info,
            limits,
            pipelines: Mutex::new(vec![None; QuantType::ALL.len()]),
            kernels: Mutex::new(HashMap::new()),
            budget: None,
            budget_from: GPU_MEMORY,
        })
    }

    /// The adapter in words: its name, kind and backend (e.g. "llvmpipe (LLVM 15.0.6, 256 bits),
    /// Cpu, Vulkan").
    pub fn describe(&self) -> String {
        format!(
            "{}, {:?}, {:?}",
            self.info.name, self.info.device_type, self.info.backend
        )
    }

    /// The largest matrix, in bytes, one storage buffer of this adapter holds.
    pub fn max_matrix_bytes(&self) -> u64 {
        self.limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
    }

    /// The pipeline of `qtype`, built on first use; an error (not wgpu's default panic) when the
    /// device rejects the shader.
    fn pipeline(&self, qtype: QuantType) -> Result<wgpu::ComputePipeline> {
        let mut pipelines = self.pipelines.lock().expect("never poisoned");
        if let Some(p) = &pipelines[qtype as usize] {
            return Ok(p.clone());
        }
        let pipeline = self
            .build_pipeline(qtype.name(), &shader_source(qtype))
            .with_context(|| format!("{} rejected the {qtype} mat-vec shader", self.info.name))?;
        pipelines[qtype as usize] = Some(pipeline.clone());
        Ok(pipeline)
    }

    /// The pipeline of the kernel `name` whose WGSL is `source` (entry point `main`), built on
    /// first use.
    fn kernel(&self, name: &str, source: &str) -> Result<wgpu::ComputePipeline> {
        self.kernel_with(name, || source.to_string())
    }

    /// [`kernel`](Self::kernel) with its source made only when it is first built.
    fn kernel_with(
        &self,
        name: &str,
        source: impl FnOnce() -> String,
    ) -> Result<wgpu::ComputePipeline> {
        let mut kernels = self.kernels.lock().expect("never poisoned");
        if let Some(p) = kernels.get(name) {
            return Ok(p.clone());
        }
        let pipeline = self
            .build_pipeline(name, &source())
            .with_context(|| format!("{} rejected the {name} shader", self.info.name))?;
        kernels.insert(name.to_string(), pipeline.clone());
        Ok(pipeline)
    }

    /// The pipeline of the mat-vec over listed rows of `qtype` (`gather.wgsl`).
    fn gather_pipeline(&self, qtype: QuantType) -> Result<wgpu::ComputePipeline> {
        self.kernel_with(&format!("gather {qtype}"), || gather_source(qtype))
    }

    /// The pipeline of the mat-vec over pooled rows of `qtype` (`mapped.wgsl`).
    fn mapped_pipeline(&self, qtype: QuantType) -> Result<wgpu::ComputePipeline> {
        self.kernel_with(&format!("mapped {qtype}"), || mapped_source(qtype))
    }

    /// The pipeline of the down update over columns of `qtype` (`down.wgsl`).
    fn down_pipeline(&self, qtype: QuantType) -> Result<wgpu::ComputePipeline> {
        self.kernel_with(&format!("down {qtype}"), || down_source(qtype))
    }

    /// A compute pipeline of `source`'s `main`, its layout taken from the shader; an error (not
    /// wgpu's default panic) when the device rejects it.
    fn build_pipeline(&self, label: &str, source: &str) -> Result<wgpu::ComputePipeline> {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(label),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(label),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            bail!("{e}");
        }
        Ok(pipeline)
    }

    /// Uploads `weight`'s rows as stored, with the buffers its mat-vecs need; an error when they
    /// do not fit the budget ([`GPU_MEMORY`]) or the GPU's largest buffer.
    pub fn upload(&self, weight: &Weight) -> Result<GpuMatrix> {
        let (rows, cols, qtype) = (weight.rows(), weight.cols(), weight.qtype());
        let x_words = input_words(qtype, cols);
        let charge = self.charge("the matrix and its buffers");
        charge.take(weight_bytes(weight) as u64 + 4 * x_words as u64 + 8 * rows as u64)?;
        let weights = self.upload_weights(weight)?;
        let d = &self.device;
        let storage = wgpu::BufferUsages::STORAGE;
        let input = d.create_buffer(&wgpu::BufferDescriptor {
            label: Some("input"),
            size: 4 * x_words as u64,
            usage: storage | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let out_bytes = 4 * rows as u64;
        let output = d.create_buffer(&wgpu::BufferDescriptor {
            label: Some("output"),
            size: out_bytes,
            usage: storage | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let readback = d.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: out_bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let dispatch = self.matvec_dispatch(&weights, &input, &output, false);
        Ok(GpuMatrix {
            rows,
            cols,
            qtype,
            bytes: weights.bytes,
            dispatch,
            input,
            output,
            readback,
            x_words: Mutex::new(Vec::with_capacity(x_words)),
        })
    }

    /// Uploads `weight`'s rows as stored into one storage buffer: an error when it is larger than
    /// the largest one the GPU binds.
    pub fn upload_weights(&self, weight: &Weight) -> Result<GpuWeights> {
        self.upload_rows(
            &stored_bytes(weight),
            weight.rows(),
            weight.cols(),
            weight.qtype(),
        )
    }

    /// Uploads `rows` rows of `cols` values encoded as `qtype`, end to end in `bytes`, as they
    /// are: an error when `bytes` is not their length or is larger than the largest storage
    /// buffer the GPU binds.
    pub fn upload_rows(
        &self,
        bytes: &[u8],
        rows: usize,
        cols: usize,
        qtype: QuantType,
    ) -> Result<GpuWeights> {
        let row_bytes = row_bytes(qtype, cols)?;
        if bytes.len() != rows * row_bytes {
            bail!(
                "{} bytes are not {rows} rows of {cols} {qtype} values ({row_bytes} bytes each)",
                bytes.len()
            );
        }
        if rows == 0 || cols == 0 {
            bail!("a {rows}×{cols} matrix has nothing to upload");
        }
        let max = self.max_matrix_bytes();
        if bytes.len() as u64 > max || bytes.len() > u32::MAX as usize {
            bail!(
                "a {rows}×{cols} {qtype} matrix ({} bytes) is larger than the GPU's largest storage \
                 buffer ({max} bytes)",
                bytes.len()
            );
        }
        let buffer = self
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("weights"),
                contents: bytes,
                usage: wgpu::BufferUsages::STORAGE,
            });
        Ok(GpuWeights {
            rows,
            cols,
            qtype,
            bytes: bytes.len(),
            row_bytes,
            slots: Slots::WHOLE,
            buffer,
            pipeline: self.pipeline(qtype)?,
        })
    }

    /// The dispatch of `out = w · x` (or `out += w · x` with `accumulate`): `input` holds `x` as
    /// `common.wgsl` reads it for `w`'s encoding, `output` gets one f32 a row.
    fn matvec_dispatch(
        &self,
        w: &GpuWeights,
        input: &wgpu::Buffer,
        output: &wgpu::Buffer,
        accumulate: bool,
    ) -> Dispatch {
        self.matvec_dispatch_in(w, input, output, accumulate, Slots::WHOLE)
    }

    /// [`matvec_dispatch`](Self::matvec_dispatch) with the rows found in `slots` by the
    /// listed-row entries (`common.wgsl`'s `row_at`).
    fn matvec_dispatch_in(
        &self,
        w: &GpuWeights,
        input: &wgpu::Buffer,
        output: &wgpu::Buffer,
        accumulate: bool,
        slots: Slots,
    ) -> Dispatch {
        let (rows, cols, qtype) = (w.rows, w.cols, w.qtype);
        let (units, scales, sums) = if qtype.is_block() {
            let blocks = (cols / BLOCK_LEN) as u32;
            let q_words = (cols / 4) as u32;
            ((cols / qtype.block_len()) as u32, q_words, q_words + blocks)
        } else {
            (cols as u32, 0, 0)
        };
        let params = [
            rows as u32,
            units,
            w.row_bytes as u32,
            scales,
            sums,
            accumulate as u32,
            slots.neurons,
            slots.stride,
        ];
        let per_dim = self.limits.max_compute_workgroups_per_dimension.max(1);
        let rows32 = rows as u32;
        let groups = (rows32.min(per_dim), rows32.div_ceil(per_dim));
        self.dispatch(
            "matvec",
            &w.pipeline,
            &[&w.buffer, input, output],
            &params,
            groups,
        )
    }

    /// The mat-vec of `w`'s rows that `idx` lists (`gather.wgsl`), as many as the indirect
    /// counts at `indirect` say: `vals[k]`, an activation, becomes its coefficient with row
    /// `idx[k]`'s dot product (`max(·, 0)` too with `drelu`).
    #[allow(clippy::too_many_arguments)]
    fn gather_dispatch(
        &self,
        w: &GpuWeights,
        input: &wgpu::Buffer,
        vals: &wgpu::Buffer,
        idx: &wgpu::Buffer,
        drelu: bool,
        indirect: (&wgpu::Buffer, u64),
    ) -> Result<Dispatch> {
        let pipeline = self.gather_pipeline(w.qtype)?;
        let mut d = self.matvec_dispatch_in(w, input, vals, drelu, w.slots);
        let entries = [
            entry(0, &w.buffer),
            entry(1, input),
            entry(2, vals),
            entry(3, &d._params),
            entry(4, idx),
        ];
        d.bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("gather"),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        d.pipeline = pipeline;
        d.indirect = Some((indirect.0.clone(), indirect.1));
        Ok(d)
    }

    /// The mat-vec of a streamed layer's neurons (`mapped.wgsl`): `out[i]` = neuron `i`'s row
    /// (pool row `map[i]` in `w`'s slots) · `x`, for the neurons `map` does not skip.
    fn mapped_dispatch(
        &self,
        w: &GpuWeights,
        input: &wgpu::Buffer,
        out: &wgpu::Buffer,
        map: &wgpu::Buffer,
    ) -> Result<Dispatch> {
        let pipeline = self.mapped_pipeline(w.qtype)?;
        let mut d = self.matvec_dispatch_in(w, input, out, false, w.slots);
        let entries = [
            entry(0, &w.buffer),
            entry(1, input),
            entry(2, out),
            entry(3, &d._params),
            entry(4, map),
        ];
        d.bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("mapped"),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        d.pipeline = pipeline;
        Ok(d)
    }

    /// A dispatch of `pipeline` over `groups` workgroups with `buffers` at bindings 0, 1, … and a
    /// uniform of `params` after them.
    fn dispatch(
        &self,
        label: &str,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[&wgpu::Buffer],
        params: &[u32; 8],
        groups: (u32, u32),
    ) -> Dispatch {
        let params = self
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("params"),
                contents: &params.map(u32::to_le_bytes).concat(),
                usage: wgpu::BufferUsages::UNIFORM,
            });
        let entries: Vec<_> = buffers
            .iter()
            .chain([&&params])
            .enumerate()
            .map(|(i, b)| entry(i as u32, b))
            .collect();
        let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(label),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        Dispatch {
            pipeline: pipeline.clone(),
            bind,
            groups,
            indirect: None,
            _params: params,
        }
    }

    /// `out[r] = row r · x`, on the GPU. For block encodings `x` is quantized to q8 first, as the
    /// CPU kernels do.
    pub fn matvec(&self, m: &GpuMatrix, x: &[f32], out: &mut [f32]) -> Result<()> {
        self.matvec_repeated(m, x, out, 1).map(|_| ())
    }

    /// [`matvec`](Self::matvec) dispatched `times` times in one submission (the same result):
    /// the time it returns, from submission to the result read back, over `times` tells what a
    /// dispatch costs apart from the round trip. A bench's tool.
    pub fn matvec_repeated(
        &self,
        m: &GpuMatrix,
        x: &[f32],
        out: &mut [f32],
        times: usize,
    ) -> Result<Duration> {
        if x.len() != m.cols || out.len() != m.rows {
            bail!(
                "a {}×{} mat-vec got {} inputs and {} outputs",
                m.rows,
                m.cols,
                x.len(),
                out.len()
            );
        }
        // One caller at a time uses the matrix's input and output buffers.
        let mut words = m.x_words.lock().expect("never poisoned");
        pack_input(m.qtype, x, &mut words);
        self.queue
            .write_buffer(&m.input, 0, f32_bytes_u32(words.as_slice()));
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            for _ in 0..times.max(1) {
                m.dispatch.record(&mut pass);
            }
        }
        enc.copy_buffer_to_buffer(&m.output, 0, &m.readback, 0, None);
        let start = Instant::now();
        self.queue.submit([enc.finish()]);
        let mut elapsed = Duration::ZERO;
        self.read_back(&m.readback, m.readback.size(), |view| {
            elapsed = start.elapsed();
            for (o, b) in out.iter_mut().zip(view.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        })?;
        Ok(elapsed)
    }

    /// Waits for the work submitted, maps the first `bytes` of `readback` and hands them to `f`.
    pub(crate) fn read_back(
        &self,
        readback: &wgpu::Buffer,
        bytes: u64,
        f: impl FnOnce(&[u8]),
    ) -> Result<()> {
        let slice = readback.slice(..bytes);
        let (tx, rx) = mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .context("waiting for the GPU")?;
        rx.recv()
            .context("the GPU dropped a read-back")?
            .context("reading the GPU's result back")?;
        {
            let view = slice
                .get_mapped_range()
                .context("mapping the GPU's result")?;
            f(&view);
        }
        readback.unmap();
        Ok(())
    }
}

fn entry(binding: u32, buffer: &wgpu::Buffer) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: buffer.as_entire_binding(),
    }
}

/// A weight matrix on the GPU, with its mat-vec's input, output and read-back buffers.
pub struct GpuMatrix {
    pub rows: usize,
    pub cols: usize,
    pub qtype: QuantType,
    /// Bytes of its weights on the GPU (the encoded rows, as stored).
    pub bytes: usize,
    dispatch: Dispatch,
    input: wgpu::Buffer,
    output: wgpu::Buffer,
    readback: wgpu::Buffer,
    /// The packed input's words, kept between calls; its lock serialises the buffers' use.
    x_words: Mutex<Vec<u32>>,
}

/// A weight matrix's rows on the GPU, as stored, and its encoding's mat-vec pipeline.
pub struct GpuWeights {
    pub rows: usize,
    pub cols: usize,
    pub qtype: QuantType,
    /// Bytes on the GPU (the encoded rows, as stored).
    pub bytes: usize,
    row_bytes: usize,
    /// Where its rows lie in `buffer`: end to end, or in a neuron pool's slots.
    slots: Slots,
    buffer: wgpu::Buffer,
    pipeline: wgpu::ComputePipeline,
}

/// How the listed-row shaders find row `i` of a matrix (`common.wgsl`'s `row_at`): in slots of
/// `neurons` rows, `stride` bytes apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slots {
    neurons: u32,
    stride: u32,
}

impl Slots {
    /// Rows end to end: one slot.
    const WHOLE: Slots = Slots {
        neurons: u32::MAX,
        stride: 0,
    };
}

/// One kernel's dispatch with its buffers bound: recorded into a compute pass as often as needed.
struct Dispatch {
    pipeline: wgpu::ComputePipeline,
    bind: wgpu::BindGroup,
    /// Workgroups (x, y): for a mat-vec one per row, `x` within the adapter's limit.
    groups: (u32, u32),
    /// Where the GPU wrote the workgroups instead (a buffer and the byte offset of its three
    /// counts): an indirect dispatch.
    indirect: Option<(wgpu::Buffer, u64)>,
    /// Its uniform (held by the bind group too; kept here to say so).
    _params: wgpu::Buffer,
}

impl Dispatch {
    fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind, &[]);
        match &self.indirect {
            Some((buffer, offset)) => pass.dispatch_workgroups_indirect(buffer, *offset),
            None => pass.dispatch_workgroups(self.groups.0, self.groups.1, 1),
        }
    }
}

/// `weight`'s rows as stored, out of any row groups (what [`Gpu::upload_weights`] uploads).
fn stored_bytes(weight: &Weight) -> std::borrow::Cow<'_, [u8]> {
    match weight {
        Weight::F32(m) => std::borrow::Cow::Borrowed(f32_bytes(&m.data)),
        Weight::Encoded(q) => q.encoded(),
    }
}

/// Bytes [`Gpu::upload_weights`] puts on the GPU for `weight`.
fn weight_bytes(weight: &Weight) -> usize {
    weight.bytes()
}

/// Words of the input buffer: f32 values, or q8 quants (four a word), scales and scaled sums.
fn input_words(qtype: QuantType, cols: usize) -> usize {
    if qtype.is_block() {
        cols / 4 + 2 * (cols / BLOCK_LEN)
    } else {
        cols
    }
}

/// `x` as `common.wgsl` reads it for `qtype`.
fn pack_input(qtype: QuantType, x: &[f32], words: &mut Vec<u32>) {
    words.clear();
    if !qtype.is_block() {
        words.extend(x.iter().map(|v| v.to_bits()));
        return;
    }
    let q8 = Q8Vec::quantize(x);
    words.extend(
        q8.quants
            .chunks_exact(4)
            .map(|q| u32::from_le_bytes([q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8])),
    );
    words.extend(q8.scales.iter().map(|v| v.to_bits()));
    words.extend(q8.sums.iter().map(|v| v.to_bits()));
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: any f32's bytes are valid u8s; the slice covers exactly `v`'s memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn f32_bytes_u32(v: &[u32]) -> &[u8] {
    // SAFETY: as for `f32_bytes`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

/// How far a GPU mat-vec result may lie from the CPU kernels' for one row: both add the same f32
/// terms (one per value, block or super-block; each computed in the same order from the same exact
/// integer sums) in different orders, so by the standard bound on a sum of `n` terms each is within
/// `(n + c)·u·A` of the exact sum of those terms, with `u = 2⁻²⁴` and `A` the sum of the terms'
/// intermediate magnitudes; `c = 8` covers the roundings inside a term (a fused multiply-add
/// rounds once where the CPU rounds twice). Twice that bounds the difference of the two.
///
/// `magnitude` is `A`: for the float encodings `Σ |w_j·x_j|`; for the block encodings
/// `Σ_j 4·M_g(j)·|x̂_j|`, with `x̂` the q8 input's values and `M_g` the largest decoded magnitude
/// in the 32 values around `j` (4·M bounds a code times its scale plus the block's offset or
/// minimum for rows written by this format's encoders).
pub fn tolerance(qtype: QuantType, cols: usize, magnitude: f64) -> f64 {
    let unit = match qtype {
        q if q.is_k_quant() => K_BLOCK_LEN,
        q if q.is_block() => BLOCK_LEN,
        _ => 1,
    };
    let n = (cols / unit) as f64;
    // 2·(n + 8)·2⁻²⁴ = (n + 8)·2⁻²³.
    (n + 8.0) * f64::from(f32::EPSILON) * magnitude
}

#[cfg(test)]
mod tests;
