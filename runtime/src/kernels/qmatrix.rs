//! A weight matrix kept in one of the file format's encodings, with batch-1 mat-vec (decode) that
//! decodes in registers, and mat-mat (prompt chunks) that decodes tiles of rows to f32 for `gemm`.

use anyhow::{bail, Result};
use leanstream_format::quant::{quantize_row, row_bytes, QuantType};
use rayon::prelude::*;

use super::matrix::{gemm_t, Matrix};
use super::operand::Operand;
use super::rows::RowKernels;

/// Rows per rayon task in a mat-vec: enough work to amortize the task, few enough to balance.
const ROWS_PER_TASK: usize = 32;
/// Below this many encoded bytes a mat-vec runs on the calling thread: waking a parked worker
/// costs more than the second thread saves (measured on this project's 2-vCPU machines).
const PARALLEL_MIN_BYTES: usize = 1 << 20;
/// Prompt chunks shorter than this run as one mat-vec per token: decoding every row to f32 for
/// `gemm` costs about as much as ten mat-vecs.
pub(super) const GEMM_MIN_TOKENS: usize = 16;
/// Weights per decoded tile in a mat-mat: a tile (f32) stays within L2 while `gemm` reads it.
const TILE_WEIGHTS: usize = 1 << 18;

/// `rows × cols` values, row-major, each row `row_bytes(qtype, cols)` bytes.
#[derive(Debug, Clone)]
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub qtype: QuantType,
    pub data: Vec<u8>,
    row_bytes: usize,
}

impl QMatrix {
    /// Wraps encoded rows (e.g. a GGUF tensor as stored); checks the length.
    pub fn new(rows: usize, cols: usize, qtype: QuantType, data: Vec<u8>) -> Result<Self> {
        let row_bytes = row_bytes(qtype, cols)?;
        if data.len() != rows * row_bytes {
            bail!(
                "{} bytes do not hold a {rows}×{cols} {qtype} matrix ({} bytes)",
                data.len(),
                rows * row_bytes
            );
        }
        Ok(Self {
            rows,
            cols,
            qtype,
            data,
            row_bytes,
        })
    }

    /// Encodes an f32 matrix row by row.
    pub fn quantize(m: &Matrix, qtype: QuantType) -> Result<Self> {
        let mut data = Vec::with_capacity(m.rows * row_bytes(qtype, m.cols)?);
        for r in 0..m.rows {
            data.extend(quantize_row(qtype, m.row(r))?);
        }
        Self::new(m.rows, m.cols, qtype, data)
    }

    pub fn row(&self, r: usize) -> &[u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Decodes row `r` into `out`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        RowKernels::best().dequantize(self.qtype, self.row(r), out);
    }

    /// `out[r] = row r · x`, with `x` prepared for this matrix's encoding.
    pub fn matvec(&self, x: &Operand, out: &mut [f32]) {
        self.matvec_with(RowKernels::best(), x, out)
    }

    /// [`matvec`](Self::matvec) with a given kernel set (tests and benches compare them).
    pub fn matvec_with(&self, k: &RowKernels, x: &Operand, out: &mut [f32]) {
        assert_eq!(x.x.len(), self.cols);
        assert_eq!(out.len(), self.rows);
        let rows = |r0: usize, chunk: &mut [f32]| {
            for (i, o) in chunk.iter_mut().enumerate() {
                *o = k.dot(self.qtype, self.row(r0 + i), x);
            }
        };
        if self.bytes() >= PARALLEL_MIN_BYTES && rayon::current_num_threads() > 1 {
            out.par_chunks_mut(ROWS_PER_TASK)
                .enumerate()
                .for_each(|(c, chunk)| rows(c * ROWS_PER_TASK, chunk));
        } else {
            rows(0, out);
        }
    }

    /// `out (t × rows) = X (t × cols) · Wᵀ` for `t` row-major input vectors.
    pub fn matmul_t(&self, x: &[f32], t: usize, out: &mut [f32]) {
        assert_eq!(x.len(), t * self.cols);
        assert_eq!(out.len(), t * self.rows);
        if t < GEMM_MIN_TOKENS {
            for (xi, oi) in x
                .chunks_exact(self.cols)
                .zip(out.chunks_exact_mut(self.rows))
            {
                self.matvec(&Operand::new(xi, self.qtype), oi);
            }
            return;
        }
        let k = RowKernels::best();
        let tile_rows = (TILE_WEIGHTS / self.cols).clamp(1, self.rows);
        let mut tile = vec![0.0f32; tile_rows * self.cols];
        for r0 in (0..self.rows).step_by(tile_rows) {
            let n = tile_rows.min(self.rows - r0);
            let tile = &mut tile[..n * self.cols];
            for (i, dst) in tile.chunks_exact_mut(self.cols).enumerate() {
                k.dequantize(self.qtype, self.row(r0 + i), dst);
            }
            gemm_t(tile, n, self.cols, x, t, &mut out[r0..], self.rows);
        }
    }
}
