//! Loads a converted LeanStream file whole into DRAM as the dense f32 model ([`crate::source::open`]
//! of a converted file): every tensor and every neuron bundle is read, checked against its
//! checksum, decoded and put back in the original neuron order, so the conversion can be compared
//! with the model it came from. (`--policy dense` on a converted file instead keeps the weights as
//! stored and computes every neuron through the streaming engine: the same bytes as `resident`.)

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;

use anyhow::{bail, Context, Result};
use leanstream_format::container::read_at;
use leanstream_format::dense::DenseTensor;
use leanstream_format::expert::router_name;
use leanstream_format::ffn::{FfnLayer, Part};
use leanstream_format::file::check_extent;
use leanstream_format::quant::dequantize_row;
use leanstream_format::LsbFile;

use crate::model::{expert_tensor_names, router_tensor_name, Model};

/// One FFN's f32 gate, up (`n × h`) and down (`h × n`) matrices.
type FfnMatrices = [Vec<f32>; 3];

/// The file's tensors decoded to f32 under their Hugging Face names, with their shapes.
pub type Tensors = HashMap<String, (Vec<usize>, Vec<f32>)>;

/// Builds the dense model from an open file.
pub fn load(file: &LsbFile) -> Result<Model> {
    let tensors = RefCell::new(tensors(file, true)?);
    Model::from_hf_tensors(file.meta.model.clone(), |name, shape| {
        take(&tensors, file, name, shape)
    })
}

/// Removes tensor `name` of the expected `shape` from `tensors` (decoded from `file`).
pub fn take(
    tensors: &RefCell<Tensors>,
    file: &LsbFile,
    name: &str,
    shape: &[usize],
) -> Result<Vec<f32>> {
    let path = &file.path;
    let (stored_shape, data) = tensors
        .borrow_mut()
        .remove(name)
        .with_context(|| format!("{}: tensor {name} is missing", path.display()))?;
    if stored_shape != shape {
        bail!(
            "{}: tensor {name} has shape {stored_shape:?}, the config implies {shape:?}",
            path.display()
        );
    }
    Ok(data)
}

/// Every dense tensor, dense FFN and router of `file` decoded to f32 under its Hugging Face name,
/// and every expert too when `with_experts` (an expert stream decodes them one at a time instead).
pub fn tensors(file: &LsbFile, with_experts: bool) -> Result<Tensors> {
    tensors_of(file, with_experts, &|_| false)
}

/// [`tensors`] without the experts, and without the dense tensors (by file name) that `skip`
/// names (a caller that keeps them encoded).
pub fn tensors_except(file: &LsbFile, skip: &dyn Fn(&str) -> bool) -> Result<Tensors> {
    tensors_of(file, false, skip)
}

/// Dense tensor `t` decoded to f32 from its stored `bytes` (as [`LsbFile::read_dense`] gives them).
pub fn decode_dense(t: &DenseTensor, bytes: &[u8]) -> Result<Vec<f32>> {
    let (rows, cols) = (t.rows(), t.cols());
    let mut data = vec![0.0f32; rows * cols];
    let row_bytes = bytes.len() / rows.max(1);
    for (r, out) in data.chunks_exact_mut(cols).enumerate() {
        dequantize_row(t.qtype, &bytes[r * row_bytes..(r + 1) * row_bytes], out)?;
    }
    Ok(data)
}

fn tensors_of(file: &LsbFile, with_experts: bool, skip: &dyn Fn(&str) -> bool) -> Result<Tensors> {
    let config = &file.meta.model;
    let path = &file.path;
    let mut f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut tensors = Tensors::new();
    for t in file.dense.tensors.iter().filter(|t| !skip(&t.name)) {
        let data = decode_dense(t, &file.read_dense(&mut f, t)?)?;
        tensors.insert(
            t.name.clone(),
            (t.shape.iter().map(|&d| d as usize).collect(), data),
        );
    }
    let (h, n) = (config.hidden_size, config.intermediate_size);
    for (l, layer) in file.ffn.layers.iter().enumerate() {
        if config.is_moe_layer(l) {
            continue;
        }
        let [gate, up, down] = decode_ffn(&mut f, file, layer, h, n, |c| {
            (file.cluster_extent(l, c), format!("layer {l} cluster {c}"))
        })?;
        let p = format!("model.layers.{l}.mlp");
        tensors.insert(format!("{p}.gate_proj.weight"), (vec![n, h], gate));
        tensors.insert(format!("{p}.up_proj.weight"), (vec![n, h], up));
        tensors.insert(format!("{p}.down_proj.weight"), (vec![h, n], down));
    }
    // A mixture's experts (format 1.5), under the architecture's Hugging Face names, and its
    // routers, which the file names as Qwen3-MoE does.
    for (l, experts) in file.experts.layers.iter().enumerate() {
        let arch = config.architecture;
        if let Some(router) = tensors.remove(&router_name(l)) {
            tensors.insert(router_tensor_name(arch, l), router);
        }
        if !with_experts {
            continue;
        }
        for (e, expert) in experts.iter().enumerate() {
            let m = expert.neurons();
            let weights = decode_ffn(&mut f, file, expert, h, m, |c| {
                (
                    file.expert_cluster_extent(l, e, c),
                    format!("layer {l} expert {e} cluster {c}"),
                )
            })?;
            let shapes = [vec![m, h], vec![m, h], vec![h, m]];
            for ((name, shape), data) in expert_tensor_names(arch, l, e)
                .into_iter()
                .zip(shapes)
                .zip(weights)
            {
                tensors.insert(name, (shape, data));
            }
        }
    }
    Ok(tensors)
}

/// Reads every cluster of an FFN's bundles (`extent(c)` = its file extent and name), checks it
/// and decodes it into matrices of the original neuron order.
fn decode_ffn(
    f: &mut File,
    file: &LsbFile,
    layer: &FfnLayer,
    h: usize,
    n: usize,
    extent: impl Fn(usize) -> ((u64, u64), String),
) -> Result<FfnMatrices> {
    let path = &file.path;
    let (mut gate, mut up, mut down) = (
        vec![0.0f32; n * h],
        vec![0.0f32; n * h],
        vec![0.0f32; h * n],
    );
    let mut column = vec![0.0f32; h];
    for (ci, c) in layer.clusters.iter().enumerate() {
        let ((offset, size), what) = extent(ci);
        let bytes = read_at(f, path, offset, size)?;
        check_extent(&bytes, c.checksum, || format!("{}: {what}", path.display()))?;
        decode_cluster(
            layer,
            ci,
            &bytes,
            [&mut gate, &mut up, &mut down],
            &mut column,
        )?;
    }
    Ok([gate, up, down])
}

/// Decodes cluster `ci` of `layer` from its extent's `bytes` into the f32 gate, up (`n × h`) and
/// down (`h × n`) matrices `[gate, up, down]` at its neurons' original rows (columns of down);
/// `column` is scratch of `h`.
pub fn decode_cluster(
    layer: &FfnLayer,
    ci: usize,
    bytes: &[u8],
    [gate, up, down]: [&mut [f32]; 3],
    column: &mut [f32],
) -> Result<()> {
    let c = &layer.clusters[ci];
    let (h, n) = (column.len(), layer.neurons());
    for k in 0..c.count as usize {
        let orig = layer.perm[c.first as usize + k] as usize;
        let row = |part| layer.row(bytes, ci, k, part);
        dequantize_row(
            layer.qtypes.gate,
            row(Part::Gate),
            &mut gate[orig * h..(orig + 1) * h],
        )?;
        dequantize_row(
            layer.qtypes.up,
            row(Part::Up),
            &mut up[orig * h..(orig + 1) * h],
        )?;
        dequantize_row(layer.qtypes.down, row(Part::Down), column)?;
        for (r, v) in column.iter().enumerate() {
            down[r * n + orig] = *v;
        }
    }
    Ok(())
}
