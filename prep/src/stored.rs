//! A converted file as the calibration's source: its dense tensors kept in their stored encoding
//! (or decoded, for the norms), each layer's FFN decoded to f32 in the original neuron order for
//! profiling, and its bundles' encoded rows for writing them again in a new order without
//! encoding anything twice.

use std::cell::RefCell;
use std::fs::File;
use std::path::Path;

use anyhow::{bail, Context, Result};
use leanstream::kernels::{Matrix, QMatrix, Weight};
use leanstream::model::{Attention, Model};
use leanstream::source::config::ModelConfig;
use leanstream::source::lsb_dense::{decode_cluster, decode_dense};
use leanstream_format::dense::DenseTensor;
use leanstream_format::ffn::Part;
use leanstream_format::quant::QuantType;
use leanstream_format::LsbFile;

pub struct Stored {
    pub file: LsbFile,
    handle: RefCell<File>,
}

/// One layer's bundles in the original neuron order: `n` runs of `[gate | up | down]` encoded rows
/// (`row_bytes` of the gate row, the up row and the down column; per-part encodings, FORMAT.md
/// §6.2), as FORMAT.md §6.1 defines a bundle.
pub struct Bundles {
    pub bytes: Vec<u8>,
    pub row_bytes: [usize; 3],
}

impl Bundles {
    /// Bytes of one bundle.
    pub fn bundle_bytes(&self) -> usize {
        self.row_bytes.iter().sum()
    }

    /// Neuron `i`'s bundle.
    pub fn bundle(&self, i: usize) -> &[u8] {
        let b = self.bundle_bytes();
        &self.bytes[i * b..(i + 1) * b]
    }

    /// Neuron `i`'s encoded gate row.
    pub fn gate(&self, i: usize) -> &[u8] {
        &self.bundle(i)[..self.row_bytes[0]]
    }
}

impl Stored {
    /// Opens a converted file of a dense (not mixture) model.
    pub fn open(path: &Path) -> Result<Self> {
        let file = LsbFile::open(path)?;
        if file.meta.model.moe.is_some() {
            bail!(
                "{} is a mixture of experts, which calibrate does not handle yet: convert its \
                 source model with `leanstream-prep convert`",
                path.display()
            );
        }
        let handle = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        Ok(Self {
            file,
            handle: RefCell::new(handle),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.file.meta.model
    }

    fn tensor(&self, name: &str) -> Result<&DenseTensor> {
        self.file
            .dense
            .tensors
            .iter()
            .find(|t| t.name == name)
            .with_context(|| format!("{}: tensor {name} is missing", self.file.path.display()))
    }

    /// A dense tensor's encoded bytes, checked against its checksum.
    pub fn dense_bytes(&self, t: &DenseTensor) -> Result<Vec<u8>> {
        Ok(self.file.read_dense(&mut self.handle.borrow_mut(), t)?)
    }

    /// Dense tensor `name` decoded to f32, checked against `shape`.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        self.check_shape(t, shape)?;
        decode_dense(t, &self.dense_bytes(t)?)
    }

    /// Dense matrix `name` (`rows × cols`) as stored: encoded, or f32.
    pub fn weight(&self, name: &str, rows: usize, cols: usize) -> Result<Weight> {
        let t = self.tensor(name)?;
        self.check_shape(t, &[rows, cols])?;
        if t.qtype == QuantType::F32 {
            return Ok(Weight::F32(Matrix::new(
                rows,
                cols,
                self.f32(name, &[rows, cols])?,
            )));
        }
        Ok(Weight::Encoded(QMatrix::new(
            rows,
            cols,
            t.qtype,
            self.dense_bytes(t)?,
        )?))
    }

    fn check_shape(&self, t: &DenseTensor, shape: &[usize]) -> Result<()> {
        let stored: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
        if stored != shape {
            bail!(
                "{}: tensor {} has shape {stored:?}, the config implies {shape:?}",
                self.file.path.display(),
                t.name
            );
        }
        Ok(())
    }

    /// The model the calibration runs: embedding and head as stored, norms in f32, and no block's
    /// attention or FFN until [`crate::calibrate::install`] puts them in (the attention's shapes
    /// checked here).
    pub fn profiling_model(&self) -> Result<Model> {
        Model::without_ffn(
            self.config().clone(),
            |name, shape| self.f32(name, shape),
            |name, rows, cols| {
                if !name.contains(".self_attn.") {
                    return self.weight(name, rows, cols);
                }
                // Checked now, read when its block is installed: every block's attention as
                // stored would be held from the start (1.2 GB at a 7B shape in q4_0).
                self.check_shape(self.tensor(name)?, &[rows, cols])?;
                Ok(crate::convert::placeholder())
            },
        )
    }

    /// Layer `l`'s attention projections as stored.
    pub fn attention(&self, l: usize) -> Result<Attention> {
        let c = self.config();
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q, kv) = (c.num_heads * hd, c.num_kv_heads * hd);
        let p = format!("model.layers.{l}.self_attn");
        let mat = |name: &str, rows, cols| self.weight(&format!("{p}.{name}.weight"), rows, cols);
        Ok(Attention {
            wq: mat("q_proj", q, h)?,
            wk: mat("k_proj", kv, h)?,
            wv: mat("v_proj", kv, h)?,
            wo: mat("o_proj", h, q)?,
        })
    }

    /// Layer `l`'s FFN decoded: gate, up (`n × h`) and down (`h × n`) in the original order, and
    /// its bundles as stored, in the original order too.
    pub fn ffn(&self, l: usize) -> Result<([Vec<f32>; 3], Bundles)> {
        let c = self.config();
        let (h, n) = (c.hidden_size, c.intermediate_size);
        let layer = &self.file.ffn.layers[l];
        let rb = layer.row_bytes();
        let mut weights = [
            vec![0.0f32; n * h],
            vec![0.0f32; n * h],
            vec![0.0f32; h * n],
        ];
        let bb: usize = rb.iter().sum();
        let mut bytes = vec![0u8; n * bb];
        let mut column = vec![0.0f32; h];
        for ci in 0..layer.clusters.len() {
            let extent = self
                .file
                .read_cluster(&mut self.handle.borrow_mut(), l, ci)?;
            let [gate, up, down] = &mut weights;
            decode_cluster(layer, ci, &extent, [gate, up, down], &mut column)?;
            let cl = &layer.clusters[ci];
            for k in 0..cl.count as usize {
                let orig = layer.perm[cl.first as usize + k] as usize;
                let mut bundle = &mut bytes[orig * bb..(orig + 1) * bb];
                for (j, part) in [Part::Gate, Part::Up, Part::Down].into_iter().enumerate() {
                    let (row, rest) = bundle.split_at_mut(rb[j]);
                    row.copy_from_slice(layer.row(&extent, ci, k, part));
                    bundle = rest;
                }
            }
        }
        Ok((
            weights,
            Bundles {
                bytes,
                row_bytes: rb,
            },
        ))
    }
}
