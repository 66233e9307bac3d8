//! The `avx512` kernel set (x86-64 with AVX-512 F, BW, VL and VNNI): the AVX2 kernels, with the
//! `Q8_0`, `Q4_0` and `Q4_1` mat-vec rows on VNNI and the down columns' updates (`axpy` and
//! `axpy_rows` of the same types) in sixteen lanes.
//!
//! Every kernel set must compute the portable set's bits (the activation is quantized to q8 before
//! each mat-vec, and rounding is discontinuous, so a last-bit difference moves a value across a
//! rounding boundary now and then: the Q6_K fixture's perplexity differed by 1.5e-4 between this
//! set and the portable one). The earlier AVX-512 kernels added their float terms in their own
//! order (sixteen lanes with fused multiply-adds), so they were taken out.
//!
//! The mat-vec rows keep AVX2's 256-bit vectors and the portable order (each block's eight exact
//! lane sums, converted, times `d_w·d_x`, added to the row's lanes), with one `vpdpbusd` for a
//! block's lane sums where AVX2 needs `vpmaddubsw` and `vpmaddwd` (and, for `Q4_0`, two sign
//! operations and a subtraction: its offset starts the sums, [`Q8Vec::offsets`]), and two rows side
//! by side, so that two chains of float sums overlap and the input's loads are shared. 512-bit
//! rows (two blocks or two rows per vector) were measured no faster on an Intel Xeon
//! (docs/results.md, "AVX-512 VNNI rows: tried").
//!
//! The updates here do per output value exactly what the portable ones do, in the same order
//! (`out + s·q` for `Q8_0`, `out + (s·q + c)` for the 4-bit types: a product, then a sum, never
//! fused), sixteen values per instruction instead of eight. A 4-bit block has only sixteen codes,
//! so its sixteen values `s·k + c` (`k` = 0 … 15) are computed once per block and row, with the
//! same multiply and add each value would have had, and each code picks its value with one
//! permute (`vpermps` reads the low four bits of each index, so the low nibbles need no mask):
//! the same bits as converting and scaling each code, with a permute in place of a conversion,
//! a multiply and an add per sixteen values. Eight output blocks are updated side by side
//! (two at the end of a row), so that sixteen chains of sums wait on the adder's latency, each
//! column is read in runs of eight blocks, and the scales of eight blocks are converted at once
//! ([`q4_blocks8`]): 1.5× the updates' speed on columns in cache (docs/results.md).

use std::arch::x86_64::*;

use leanstream_format::quant::BLOCK_LEN;

use super::avx2::{common_blocks, f16_load, f16_scales8, row_dot, rows_dot, Q4_0, Q4_1, Q8_0};
use super::operand::Q8Vec;
use super::portable::{Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES};
use super::rows::RowKernels;

pub(super) fn detected() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && super::avx2::detected()
}

/// The AVX-512 kernel table.
///
/// # Safety
/// The CPU must have the features [`detected`] checks.
pub(super) unsafe fn kernels() -> RowKernels {
    // SAFETY (every entry): the caller checked the CPU features.
    RowKernels {
        isa: "avx512",
        dot_q8_0: |w, x| unsafe { dot_block::<Q8_0>(w, x) },
        dot_q4_0: |w, x| unsafe { dot_block::<Q4_0>(w, x) },
        dot_q4_1: |w, x| unsafe { dot_block::<Q4_1>(w, x) },
        dots_q8_0: |r, x, o| unsafe { dots_block::<Q8_0>(r, x, o) },
        dots_q4_0: |r, x, o| unsafe { dots_block::<Q4_0>(r, x, o) },
        dots_q4_1: |r, x, o| unsafe { dots_block::<Q4_1>(r, x, o) },
        dots_ahead: Some([
            |r, x, o| unsafe { dots_block_ahead::<Q8_0>(r, x, o) },
            |r, x, o| unsafe { dots_block_ahead::<Q4_0>(r, x, o) },
            |r, x, o| unsafe { dots_block_ahead::<Q4_1>(r, x, o) },
        ]),
        axpy_q8_0: |a, w, o| unsafe { axpy_rows_q8_0(&[a], &[w], o) },
        axpy_q4_0: |a, w, o| unsafe { axpy_rows_q4::<false>(&[a], &[w], o) },
        axpy_q4_1: |a, w, o| unsafe { axpy_rows_q4::<true>(&[a], &[w], o) },
        axpy_rows_q8_0: Some(|a, r, o| unsafe { axpy_rows_q8_0(a, r, o) }),
        axpy_rows_q4_0: Some(|a, r, o| unsafe { axpy_rows_q4::<false>(a, r, o) }),
        axpy_rows_q4_1: Some(|a, r, o| unsafe { axpy_rows_q4::<true>(a, r, o) }),
        // SAFETY: the caller checked the CPU features, AVX2's among them.
        ..unsafe { super::avx2::kernels() }
    }
}

/// [`super::avx2::dots_block`] with VNNI's `vpdpbusd` for each block's exact lane sums.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn dots_block<const KIND: u8>(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    rows_dot::<KIND, true, false>(rows, x, out)
}

/// [`dots_block`] reading ahead ([`super::avx2::dots_block_ahead`]).
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn dots_block_ahead<const KIND: u8>(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    rows_dot::<KIND, true, true>(rows, x, out)
}

/// [`super::avx2::dot_block`] with VNNI's `vpdpbusd`.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn dot_block<const KIND: u8>(w: &[u8], x: &Q8Vec) -> f32 {
    row_dot::<KIND, true, false>(w, x)
}

/// `out += a[j] · row_j` for each `Q8_0` row in turn (the portable `axpy_q8_0`'s `out + s·q` per
/// value), `B` output blocks at a time kept in registers across the rows.
///
/// # Safety
/// The CPU has AVX-512 F (the callers' target features); blocks `b .. b + B` lie within every row
/// (`Q8_0_BYTES` each) and within the output at `op`.
#[inline(always)]
unsafe fn q8_0_blocks<const B: usize>(a: &[f32], rows: &[&[u8]], b: usize, op: *mut f32) {
    let dst = op.add(b * BLOCK_LEN);
    let mut acc: [[__m512; 2]; B] =
        core::array::from_fn(|i| [0, 16].map(|k| _mm512_loadu_ps(dst.add(i * BLOCK_LEN + k))));
    for (&a, w) in a.iter().zip(rows) {
        for (i, acc) in acc.iter_mut().enumerate() {
            let blk = w.as_ptr().add((b + i) * Q8_0_BYTES);
            let s = _mm512_set1_ps(a * f16_load(blk));
            for (k, acc) in acc.iter_mut().enumerate() {
                let q = _mm_loadu_si128(blk.add(2 + 16 * k) as *const __m128i);
                let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
                *acc = _mm512_add_ps(*acc, _mm512_mul_ps(s, v));
            }
        }
    }
    for (i, acc) in acc.into_iter().enumerate() {
        for (k, v) in acc.into_iter().enumerate() {
            _mm512_storeu_ps(dst.add(i * BLOCK_LEN + 16 * k), v);
        }
    }
}

/// [`q8_0_blocks`] for eight output blocks, each row's eight scales converted and multiplied at
/// once, eight rows at a time, as in [`q4_blocks8`].
///
/// # Safety
/// As [`q8_0_blocks`] with `B` = 8.
#[inline(always)]
unsafe fn q8_0_blocks8(a: &[f32], rows: &[&[u8]], b: usize, op: *mut f32) {
    const B: usize = 8;
    let dst = op.add(b * BLOCK_LEN);
    let mut acc: [[__m512; 2]; B] =
        core::array::from_fn(|i| [0, 16].map(|k| _mm512_loadu_ps(dst.add(i * BLOCK_LEN + k))));
    let mut s = [[0.0f32; B]; 8];
    for (a, rows) in a.chunks(8).zip(rows.chunks(8)) {
        for ((&a, w), s) in a.iter().zip(rows).zip(s.iter_mut()) {
            let p = w.as_ptr().add(b * Q8_0_BYTES);
            let sv = _mm256_mul_ps(_mm256_set1_ps(a), f16_scales8(p, Q8_0_BYTES));
            _mm256_storeu_ps(s.as_mut_ptr(), sv);
        }
        for (w, s) in rows.iter().zip(&s) {
            for (i, acc) in acc.iter_mut().enumerate() {
                let blk = w.as_ptr().add((b + i) * Q8_0_BYTES);
                let s = _mm512_set1_ps(s[i]);
                for (k, acc) in acc.iter_mut().enumerate() {
                    let q = _mm_loadu_si128(blk.add(2 + 16 * k) as *const __m128i);
                    let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
                    *acc = _mm512_add_ps(*acc, _mm512_mul_ps(s, v));
                }
            }
        }
    }
    for (i, acc) in acc.into_iter().enumerate() {
        for (k, v) in acc.into_iter().enumerate() {
            _mm512_storeu_ps(dst.add(i * BLOCK_LEN + 16 * k), v);
        }
    }
}

/// The portable `axpy_q8_0` of each row in turn.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn axpy_rows_q8_0(a: &[f32], rows: &[&[u8]], out: &mut [f32]) {
    let n = a.len().min(rows.len());
    let (a, rows) = (&a[..n], &rows[..n]);
    let nb = common_blocks(rows, Q8_0_BYTES, out);
    let op = out.as_mut_ptr();
    let mut b = 0;
    while b + 8 <= nb {
        // SAFETY: `b + 8 <= nb`, the whole blocks every row and `out` hold; our features.
        q8_0_blocks8(a, rows, b, op);
        b += 8;
    }
    while b + 2 <= nb {
        // SAFETY: `b + 2 <= nb`, the whole blocks every row and `out` hold; our features.
        q8_0_blocks::<2>(a, rows, b, op);
        b += 2;
    }
    if b < nb {
        // SAFETY: `b < nb`, as above.
        q8_0_blocks::<1>(a, rows, b, op);
    }
}

/// `out += a[j] · row_j` for each 4-bit row in turn (the portable `out + (s·q + c)` per value:
/// `Q4_0` has `c = −8s`, `Q4_1` `c = a·m`), `B` output blocks at a time kept in registers across
/// the rows.
///
/// # Safety
/// As [`q8_0_blocks`], for blocks of the 4-bit type.
#[inline(always)]
unsafe fn q4_blocks<const WITH_MIN: bool, const B: usize>(
    a: &[f32],
    rows: &[&[u8]],
    b: usize,
    op: *mut f32,
) {
    let (bytes, nib) = if WITH_MIN {
        (Q4_1_BYTES, 4)
    } else {
        (Q4_0_BYTES, 2)
    };
    let codes = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    let dst = op.add(b * BLOCK_LEN);
    let mut acc: [[__m512; 2]; B] =
        core::array::from_fn(|i| [0, 16].map(|k| _mm512_loadu_ps(dst.add(i * BLOCK_LEN + k))));
    for (&a, w) in a.iter().zip(rows) {
        for (i, acc) in acc.iter_mut().enumerate() {
            let blk = w.as_ptr().add((b + i) * bytes);
            let s = a * f16_load(blk);
            let c = if WITH_MIN {
                a * f16_load(blk.add(2))
            } else {
                -8.0 * s
            };
            // Lane k: s·k + c, the value of code k (a product, then a sum, as for each value).
            let table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(s), codes), _mm512_set1_ps(c));
            // Byte j of the block as lane j: its low nibble is value j, its high one value 16 + j.
            let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(blk.add(nib) as *const __m128i));
            let lo = _mm512_permutexvar_ps(q, table);
            let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), table);
            acc[0] = _mm512_add_ps(acc[0], lo);
            acc[1] = _mm512_add_ps(acc[1], hi);
        }
    }
    for (i, acc) in acc.into_iter().enumerate() {
        for (k, v) in acc.into_iter().enumerate() {
            _mm512_storeu_ps(dst.add(i * BLOCK_LEN + 16 * k), v);
        }
    }
}

/// [`q4_blocks`] for eight output blocks, with each row's eight scales (and `Q4_1`'s minimums)
/// converted and multiplied at once, eight rows at a time, before the rows' updates: each block's
/// `s` and `c` then come to its sixteen values from memory (a broadcast load) rather than through
/// the shuffle unit, which the permutes keep busy.
///
/// # Safety
/// As [`q4_blocks`] with `B` = 8.
#[inline(always)]
unsafe fn q4_blocks8<const WITH_MIN: bool>(a: &[f32], rows: &[&[u8]], b: usize, op: *mut f32) {
    const B: usize = 8;
    let (bytes, nib) = if WITH_MIN {
        (Q4_1_BYTES, 4)
    } else {
        (Q4_0_BYTES, 2)
    };
    let codes = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    let dst = op.add(b * BLOCK_LEN);
    let mut acc: [[__m512; 2]; B] =
        core::array::from_fn(|i| [0, 16].map(|k| _mm512_loadu_ps(dst.add(i * BLOCK_LEN + k))));
    let (mut s, mut c) = ([[0.0f32; B]; 8], [[0.0f32; B]; 8]);
    for (a, rows) in a.chunks(8).zip(rows.chunks(8)) {
        for ((&a, w), (s, c)) in a.iter().zip(rows).zip(s.iter_mut().zip(&mut c)) {
            let p = w.as_ptr().add(b * bytes);
            let sv = _mm256_mul_ps(_mm256_set1_ps(a), f16_scales8(p, bytes));
            let cv = if WITH_MIN {
                _mm256_mul_ps(_mm256_set1_ps(a), f16_scales8(p.add(2), bytes))
            } else {
                _mm256_mul_ps(_mm256_set1_ps(-8.0), sv)
            };
            _mm256_storeu_ps(s.as_mut_ptr(), sv);
            _mm256_storeu_ps(c.as_mut_ptr(), cv);
        }
        for (w, (s, c)) in rows.iter().zip(s.iter().zip(&c)) {
            for (i, acc) in acc.iter_mut().enumerate() {
                let blk = w.as_ptr().add((b + i) * bytes);
                // Lane k: s·k + c, as in `q4_blocks`.
                let table = _mm512_add_ps(
                    _mm512_mul_ps(_mm512_set1_ps(s[i]), codes),
                    _mm512_set1_ps(c[i]),
                );
                let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(blk.add(nib) as *const __m128i));
                let lo = _mm512_permutexvar_ps(q, table);
                let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), table);
                acc[0] = _mm512_add_ps(acc[0], lo);
                acc[1] = _mm512_add_ps(acc[1], hi);
            }
        }
    }
    for (i, acc) in acc.into_iter().enumerate() {
        for (k, v) in acc.into_iter().enumerate() {
            _mm512_storeu_ps(dst.add(i * BLOCK_LEN + 16 * k), v);
        }
    }
}

/// The portable `axpy_q4_0` (`axpy_q4_1` with `WITH_MIN`) of each row in turn.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn axpy_rows_q4<const WITH_MIN: bool>(a: &[f32], rows: &[&[u8]], out: &mut [f32]) {
    let bytes = if WITH_MIN { Q4_1_BYTES } else { Q4_0_BYTES };
    let n = a.len().min(rows.len());
    let (a, rows) = (&a[..n], &rows[..n]);
    let nb = common_blocks(rows, bytes, out);
    let op = out.as_mut_ptr();
    let mut b = 0;
    while b + 8 <= nb {
        // SAFETY: `b + 8 <= nb`, the whole blocks every row and `out` hold; our features.
        q4_blocks8::<WITH_MIN>(a, rows, b, op);
        b += 8;
    }
    while b + 2 <= nb {
        // SAFETY: `b + 2 <= nb`, the whole blocks every row and `out` hold; our features.
        q4_blocks::<WITH_MIN, 2>(a, rows, b, op);
        b += 2;
    }
    if b < nb {
        // SAFETY: `b < nb`, as above.
        q4_blocks::<WITH_MIN, 1>(a, rows, b, op);
    }
}
