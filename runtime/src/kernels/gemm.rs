//! Mat-mat of block-encoded rows against several inputs (a prompt chunk), on the integer kernels
//! that decode uses: each input quantized to q8 per block of 32 once ([`Operand`]), then the rows
//! taken a tile at a time, and every input of the chunk multiplied against the tile while its
//! bytes stay in the first-level cache (the weights are read from memory once per chunk, not once
//! per token). Each result is the kernel set's `dot` of that row and that input — decode's
//! arithmetic, with decode's bits — so a prompt token's projections do not depend on the chunk
//! it came in, the chunk's length or the thread count.

use rayon::prelude::*;

use leanstream_format::quant::QuantType;

use super::operand::{Operand, Q8Vec};
use super::rows::{Packed, RowKernels, DOT_ROWS, WIDE_INPUTS};

/// Rows per tile: 16 rows of a 4-bit 576-wide matrix are 5.8 KB, of a 4096-wide one 36 KB, both
/// within a first-level data cache while every input passes over them.
const TILE_ROWS: usize = 16;
/// Below this many multiply-adds a mat-mat runs on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 20;

/// Where a task writes its tile's columns of the output (the tiles' columns are disjoint).
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: tasks write disjoint elements (their own rows' columns) of one output that outlives them.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// `out[i·stride + r] = row r · xs[i]` for the `data.len() / row_bytes` rows laid end to end in
/// `data` (encoded as `qtype`, a block type): bitwise `k.dot(qtype, row r, &xs[i])` for every
/// `r` and `i`. `out` holds the rows' columns of `xs.len()` output rows, `stride` apart.
pub(crate) fn gemm_rows(
    k: &RowKernels,
    qtype: QuantType,
    data: &[u8],
    row_bytes: usize,
    xs: &[Operand],
    out: &mut [f32],
    stride: usize,
) {
    let rows = data.len() / row_bytes.max(1);
    assert_eq!(data.len(), rows * row_bytes, "a partial row");
    if rows == 0 || xs.is_empty() {
        return;
    }
    assert!(stride >= rows && out.len() >= (xs.len() - 1) * stride + rows);
    let dst = Out(out.as_mut_ptr());
    let tiles = rows.div_ceil(TILE_ROWS);
    let run = |tile_index: usize| {
        let r0 = tile_index * TILE_ROWS;
        let n = TILE_ROWS.min(rows - r0);
        // SAFETY: rows r0..r0+n of every output row lie inside `out` (asserted above) and no
        // other tile writes them; `out` outlives the tasks.
        unsafe {
            tile(
                k,
                qtype,
                &data[r0 * row_bytes..],
                row_bytes,
                n,
                xs,
                dst,
                r0,
                stride,
            )
        }
    };
    let macs = data.len() * 2 * xs.len();
    if macs >= PARALLEL_MIN_MACS && rayon::current_num_threads() > 1 {
        (0..tiles).into_par_iter().for_each(run);
    } else {
        (0..tiles).for_each(run);
    }
}

/// One tile of `n` rows from `data` against every input.
///
/// # Safety
/// `out.0 + i·stride + r0 + j` must be writable, and written by no one else meanwhile, for every
/// input `i` and `j < n`.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn tile(
    k: &RowKernels,
    qtype: QuantType,
    data: &[u8],
    row_bytes: usize,
    n: usize,
    xs: &[Operand],
    out: Out,
    r0: usize,
    stride: usize,
) {
    let mut views: [&[u8]; TILE_ROWS] = [&[]; TILE_ROWS];
    for (j, v) in views[..n].iter_mut().enumerate() {
        *v = &data[j * row_bytes..(j + 1) * row_bytes];
    }
    if let Some(kernel) = k.inputs(qtype) {
        // A few inputs at a time against every row of the tile: each row's codes decoded once
        // for all of them (the set's kernel called directly, the group's q8 forms gathered once
        // for the tile's rows).
        let width = k.inputs_width(qtype);
        let mut group: [&Operand; WIDE_INPUTS] = [&xs[0]; WIDE_INPUTS];
        let mut q8: [&Q8Vec; WIDE_INPUTS] = [xs[0].q8(); WIDE_INPUTS];
        let mut o = [0.0f32; WIDE_INPUTS];
        for (c, chunk) in xs.chunks(width).enumerate() {
            for ((g, q), x) in group.iter_mut().zip(q8.iter_mut()).zip(chunk) {
                *g = x;
                *q = x.q8();
            }
            let m = chunk.len();
            let packed = Packed::new(qtype, &group[..m]);
            for (j, row) in views[..n].iter().enumerate() {
                match &packed {
                    Some(p) => k.dot_packed(qtype, row, &group[..m], p, &mut o[..m]),
                    None => kernel(row, &q8[..m], &mut o[..m]),
                }
                for (i, &v) in o[..m].iter().enumerate() {
                    // SAFETY: the caller's promise.
                    unsafe { *out.0.add((c * width + i) * stride + r0 + j) = v };
                }
            }
        }
        return;
    }
    for (i, x) in xs.iter().enumerate() {
        // SAFETY: the caller's promise.
        let o = unsafe { std::slice::from_raw_parts_mut(out.0.add(i * stride + r0), n) };
        k.dots_by(qtype, &views[..n], x, o, DOT_ROWS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use leanstream_format::quant::{quantize_row, row_bytes};
    use rand::{Rng, SeedableRng};

    /// Every result is bitwise the kernel set's own mat-vec `dot` (decode's), in every kernel set,
    /// on one thread and on three (tiles split among them), with a row count that leaves a
    /// partial tile; and it is the product (against an f64 reference of the decoded rows and the
    /// q8 inputs), so a mixed-up index cannot pass as equal to itself.
    #[test]
    fn gemm_rows_is_decodes_dot_bit_for_bit() {
        let seed = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (rows, cols, t) = (301, 512, 7);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for qtype in QuantType::ALL.into_iter().filter(|q| q.is_block()) {
            let rb = row_bytes(qtype, cols).unwrap();
            let mut data = Vec::with_capacity(rows * rb);
            for _ in 0..rows {
                let row: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
                data.extend(quantize_row(qtype, &row).unwrap());
            }
            let x: Vec<f32> = (0..t * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let xs: Vec<Operand> = x
                .chunks_exact(cols)
                .map(|x| Operand::new(x, qtype))
                .collect();
            for k in RowKernels::available() {
                let stride = rows + 3;
                let mut one = vec![f32::NAN; t * stride];
                gemm_rows(&k, qtype, &data, rb, &xs, &mut one, stride);
                let mut three = vec![f32::NAN; t * stride];
                pool.install(|| gemm_rows(&k, qtype, &data, rb, &xs, &mut three, stride));
                let mut decoded = vec![0.0; cols];
                for (i, x) in xs.iter().enumerate() {
                    for r in 0..rows {
                        let row = &data[r * rb..(r + 1) * rb];
                        let want = k.dot(qtype, row, x);
                        let what = format!("seed {seed}: {} {qtype} input {i} row {r}", k.isa);
                        assert_eq!(one[i * stride + r].to_bits(), want.to_bits(), "{what}");
                        assert_eq!(three[i * stride + r].to_bits(), want.to_bits(), "{what}");
                        k.dequantize(qtype, row, &mut decoded);
                        let exact: f64 = decoded
                            .iter()
                            .enumerate()
                            .map(|(j, w)| *w as f64 * x.q8().value(j) as f64)
                            .sum();
                        assert!(
                            (want as f64 - exact).abs() < 1e-3,
                            "{what}: {want} vs {exact}"
                        );
                    }
                    // Columns past the rows are not written.
                    assert!(one[i * stride + rows..(i + 1) * stride]
                        .iter()
                        .all(|v| v.is_nan()));
                }
            }
        }
    }
}
