//! A weight matrix as the model holds it: f32 (the reference path, unchanged) or encoded.

use anyhow::Result;
use leanstream_format::quant::QuantType;

use super::matrix::{matmul_t, matmul_t_whole, Matrix};
use super::qmatrix::QMatrix;

#[derive(Debug, Clone)]
pub enum Weight {
    F32(Matrix),
    Encoded(QMatrix),
}

impl Weight {
    pub fn rows(&self) -> usize {
        match self {
            Weight::F32(m) => m.rows,
            Weight::Encoded(q) => q.rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Weight::F32(m) => m.cols,
            Weight::Encoded(q) => q.cols,
        }
    }

    pub fn qtype(&self) -> QuantType {
        match self {
            Weight::F32(_) => QuantType::F32,
            Weight::Encoded(q) => q.qtype,
        }
    }

    /// Bytes held in DRAM.
    pub fn bytes(&self) -> usize {
        match self {
            Weight::F32(m) => m.bytes(),
            Weight::Encoded(q) => q.bytes(),
        }
    }

    /// Row `r` as f32.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match self {
            Weight::F32(m) => out.copy_from_slice(m.row(r)),
            Weight::Encoded(q) => q.dequantize_row(r, out),
        }
    }

    /// Rows `rows` as f32, one after another in `out` (an embedding lookup).
    pub fn rows_f32(&self, rows: &[u32], out: &mut [f32]) {
        for (dst, &r) in out.chunks_exact_mut(self.cols()).zip(rows) {
            self.row_f32(r as usize, dst);
        }
    }

    /// The same weight encoded as `qtype` (from its f32 values; `F32` keeps the reference path).
    pub fn quantize(&self, qtype: QuantType) -> Result<Weight> {
        let f32 = match self {
            Weight::F32(m) => m.clone(),
            Weight::Encoded(q) => {
                let mut data = vec![0.0; q.rows * q.cols];
                for (r, row) in data.chunks_exact_mut(q.cols).enumerate() {
                    q.dequantize_row(r, row);
                }
                Matrix::new(q.rows, q.cols, data)
            }
        };
        Ok(match qtype {
            QuantType::F32 => Weight::F32(f32),
            _ => Weight::Encoded(QMatrix::quantize(&f32, qtype)?),
        })
    }

    /// `out (t × rows) = X (t × cols) · Wᵀ` for `t` row-major input vectors.
    pub fn matmul_t(&self, x: &[f32], t: usize, out: &mut [f32]) {
        match self {
            Weight::F32(m) => matmul_t(m, x, t, out),
            Weight::Encoded(q) => q.matmul_t(x, t, out),
        }
    }

    /// [`Weight::matmul_t`], or with `whole` in one product over all `t` inputs where the weight
    /// is f32 ([`matmul_t_whole`]: its bits depend on `t`; the profiler's choice,
    /// `Model::set_whole_products`); an encoded weight multiplies as always.
    pub fn matmul_t_with(&self, x: &[f32], t: usize, out: &mut [f32], whole: bool) {
        match self {
            Weight::F32(m) if whole => matmul_t_whole(m, x, t, out),
            _ => self.matmul_t(x, t, out),
        }
    }
}
