//! f32 kernels of the dense reference path: dot product, batch-1 mat-vec (decode) and mat-mat
//! (prompt chunks, through `gemm`).
//!
//! The dot product keeps several independent accumulators so that the compiler can vectorize it
//! (strict float order blocks that in a single-accumulator loop), and is compiled a second time with
//! AVX2+FMA enabled, picked at run time.

use rayon::prelude::*;

use super::qmatrix::GEMM_MIN_TOKENS;
use super::PARALLEL_MIN_WEIGHTS;

/// A row-major matrix of `rows × cols` f32 (a Hugging Face linear weight is `[out, in]`).
#[derive(Debug, Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Matrix {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(
            data.len(),
            rows * cols,
            "matrix data does not match its shape"
        );
        Self { rows, cols, data }
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    pub fn bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<f32>()
    }
}

const LANES: usize = 16;

#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..LANES {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    let mut s = [0.0f32; 4];
    for (i, v) in acc.iter().enumerate() {
        s[i % 4] += v;
    }
    (s[0] + s[1]) + (s[2] + s[3]) + tail
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_body(a, b)
}

/// Dot product of two equally long slices.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
        return unsafe { dot_avx2(a, b) };
    }
    portable_dot(a, b)
}

/// The dot product without run-time CPU dispatch (a portable fallback, also used in tests).
pub fn portable_dot(a: &[f32], b: &[f32]) -> f32 {
    dot_body(a, b)
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn has_avx2_fma() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

const ROWS_PER_TASK: usize = 32;

/// `out[r] = W[r,:] · x` for every row of `w`.
pub fn matvec(w: &Matrix, x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), w.cols);
    assert_eq!(out.len(), w.rows);
    if w.rows * w.cols >= PARALLEL_MIN_WEIGHTS && rayon::current_num_threads() > 1 {
        out.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(c, chunk)| {
                let r0 = c * ROWS_PER_TASK;
                for (i, o) in chunk.iter_mut().enumerate() {
                    *o = dot(w.row(r0 + i), x);
                }
            });
    } else {
        for (r, o) in out.iter_mut().enumerate() {
            *o = dot(w.row(r), x);
        }
    }
}

/// `out (t × rows) = X (t × cols) · Wᵀ` for `t` row-major input vectors, by the rule of
/// [`gemm_inputs`] (as [`super::qmatrix::RowStream`]).
pub fn matmul_t(w: &Matrix, x: &[f32], t: usize, out: &mut [f32]) {
    assert_eq!(x.len(), t * w.cols);
    assert_eq!(out.len(), t * w.rows);
    let g = gemm_inputs(t);
    let (xs, last_x) = x.split_at(g * w.cols);
    let (outs, last_out) = out.split_at_mut(g * w.rows);
    gemm_t_blocked(&w.data, w.rows, w.cols, xs, g, outs, w.rows);
    if g < t {
        matvec(w, last_x, last_out);
    }
}

/// `out (t × rows) = X (t × cols) · Wᵀ` in one product over all `t` inputs: each token's bits then
/// depend on `t` (`gemm`'s blocking follows its `m`), so a prompt's chunking would change them, but
/// the weights are read once for every input instead of once per [`GEMM_MIN_TOKENS`]. For
/// calibration passes over fixed windows ([`crate::model::Model::set_whole_products`]).
pub fn matmul_t_whole(w: &Matrix, x: &[f32], t: usize, out: &mut [f32]) {
    assert_eq!(x.len(), t * w.cols);
    assert_eq!(out.len(), t * w.rows);
    match t {
        0 => {}
        1 => matvec(w, x, out),
        _ => gemm_t(&w.data, w.rows, w.cols, x, t, out, w.rows),
    }
}

/// How many of `t` inputs go through `gemm`: all but a single input left after the whole blocks of
/// [`GEMM_MIN_TOKENS`] (that one, or a lone decoded token, is a mat-vec). A token's result then
/// depends only on its place in the input, not on the input's length: a prompt split into chunks of
/// any multiple of the block gives one chunk's bits (the budget sizes prompt chunks), while
/// `gemm`'s summation order may depend on its `m`.
pub(super) fn gemm_inputs(t: usize) -> usize {
    if t % GEMM_MIN_TOKENS == 1 {
        t - 1
    } else {
        t
    }
}

/// [`gemm_t`] over `t` inputs in whole blocks of [`GEMM_MIN_TOKENS`], then the rest in one call.
pub(super) fn gemm_t_blocked(
    w: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    t: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    assert_eq!(x.len(), t * cols);
    for (b, x) in x.chunks(GEMM_MIN_TOKENS * cols).enumerate() {
        let dst = &mut out[b * GEMM_MIN_TOKENS * out_stride..];
        gemm_t(w, rows, cols, x, x.len() / cols, dst, out_stride);
    }
}

/// `out[i·out_stride + r] = X[i,:] · W[r,:]` for a row-major `rows × cols` weight `w` and `t` input
/// vectors, through `gemm` (which reads `W` transposed through its strides).
pub(super) fn gemm_t(
    w: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    t: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    assert_eq!(w.len(), rows * cols);
    assert_eq!(x.len(), t * cols);
    assert!(t > 0 && out_stride >= rows && out.len() >= (t - 1) * out_stride + rows);
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 && t * rows * cols >= PARALLEL_MIN_WEIGHTS {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    let (m, n, k) = (t, rows, cols);
    // SAFETY: the pointers cover m×k (lhs), k×n (rhs, Wᵀ read through strides) and m rows of n
    // f32 at stride out_stride (dst), as asserted above; dst does not alias the inputs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            out_stride as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, rng: &mut impl Rng) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn dot_f64(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
    }

    #[test]
    fn dot_matches_f64_for_odd_lengths() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        for n in [0, 1, 7, 15, 16, 17, 63, 100, 1001] {
            let (a, b) = (random(n, &mut rng), random(n, &mut rng));
            let want = dot_f64(&a, &b);
            for got in [dot(&a, &b), portable_dot(&a, &b)] {
                assert!(
                    (got as f64 - want).abs() <= 1e-5 * (n as f64).max(1.0),
                    "n={n}"
                );
            }
            // Fused multiply-adds in the same lanes: the same bits with and without the CPU's
            // own instructions (refine's directions rely on it).
            assert_eq!(
                dot(&a, &b).to_bits(),
                portable_dot(&a, &b).to_bits(),
                "n={n}"
            );
        }
    }

    #[test]
    fn matvec_and_matmul_match_f64() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        let (rows, cols, t) = (300, 257, 5);
        let w = Matrix::new(rows, cols, random(rows * cols, &mut rng));
        let x = random(t * cols, &mut rng);
        let mut out = vec![0.0; t * rows];
        matmul_t(&w, &x, t, &mut out);
        let mut one = vec![0.0; rows];
        for i in 0..t {
            let xi = &x[i * cols..(i + 1) * cols];
            matvec(&w, xi, &mut one);
            for r in 0..rows {
                let want = dot_f64(w.row(r), xi);
                assert!(
                    (out[i * rows + r] as f64 - want).abs() < 1e-4,
                    "matmul {i},{r}"
                );
                assert!((one[r] as f64 - want).abs() < 1e-4, "matvec {i},{r}");
            }
        }
    }
}
