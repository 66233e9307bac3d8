//! Compute kernels: the f32 reference path ([`Matrix`], [`dot`], [`matvec`], [`matmul_t`]), mat-vec
//! and mat-mat over every weight encoding of the file format ([`QMatrix`], [`Weight`]), and the
//! sparse FFN over neuron bundles ([`bundles`]).
//!
//! Batch-1 decode is bound by memory bandwidth, so the encoded kernels read each weight byte once
//! and decode it in registers (fused dequantize-and-dot). For block types the input vector is
//! quantized to q8 once per mat-vec ([`Operand`]) so that a block's dot product is an integer
//! dot product (AVX-512 VNNI, AVX2 `maddubs`, NEON `sdot` or widening multiplies). Each
//! instruction set has its own file; [`RowKernels::best`] picks one at run time (or the one
//! `LEANSTREAM_KERNELS` names), with a portable fallback always there.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod bundles;
mod gemm;
pub mod grouped_cluster;
pub mod groups;
#[cfg(target_arch = "x86_64")]
mod kquant_avx2;
#[cfg(target_arch = "aarch64")]
mod kquant_neon;
mod matrix;
#[cfg(target_arch = "aarch64")]
mod neon;
mod operand;
pub mod parallel;
mod portable;
mod qmatrix;
mod rows;
pub mod sketch;
mod weight;

#[cfg(test)]
mod tests;

pub use matrix::{dot, matmul_t, matvec, portable_dot, Matrix};
pub use operand::{Operand, Q8Vec};
pub use qmatrix::{matvec_rows, QMatrix, RowStream};
pub use rows::{Packed, RowKernels, INPUTS, WIDE_INPUTS};
pub use weight::Weight;

/// Below this many weights a mat-vec runs on the calling thread: splitting costs more than it saves.
pub(crate) const PARALLEL_MIN_WEIGHTS: usize = 1 << 16;
