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
//! ([`block_scales`]): 1.5× the updates' speed on columns in cache (docs/results.md).

use std::arch::x86_64::*;

use leanstream_format::quant::BLOCK_LEN;

use super::avx2::{
    block_kind, common_blocks, f16_lead, f16_scales8, groups_dot_with, input_codes,
    inputs_by_count, lanes_total, packed_by_count, row_dot, rows_dot, x_block, Q4_0, Q4_1, Q8_0,
};
use super::operand::Q8Vec;
use super::portable::{Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES};
use super::rows::{Packed, RowKernels, INPUTS};

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
        groups_dot: Some([
            |d, x, o| unsafe { groups_dot::<Q8_0>(d, x, o) },
            |d, x, o| unsafe { groups_dot::<Q4_0>(d, x, o) },
            |d, x, o| unsafe { groups_dot::<Q4_1>(d, x, o) },
        ]),
        inputs_q8_0: Some(|w, xs, o| unsafe { dot_inputs_block::<Q8_0>(w, xs, o) }),
        inputs_q4_0: Some(|w, xs, o| unsafe { dot_inputs_block::<Q4_0>(w, xs, o) }),
        inputs_q4_1: Some(|w, xs, o| unsafe { dot_inputs_block::<Q4_1>(w, xs, o) }),
        packed_inputs: Some([
            |w, xs, p, o| unsafe { dot_packed_block::<Q8_0>(w, xs, p, o) },
            |w, xs, p, o| unsafe { dot_packed_block::<Q4_0>(w, xs, p, o) },
            |w, xs, p, o| unsafe { dot_packed_block::<Q4_1>(w, xs, p, o) },
        ]),
        axpy_q8_0: |a, w, o| unsafe { axpy_rows_q8_0(&[a], &[w], o) },
        axpy_q4_0: |a, w, o| unsafe { axpy_rows_q4::<false>(&[a], &[w], o) },
        axpy_q4_1: |a, w, o| unsafe { axpy_rows_q4::<true>(&[a], &[w], o) },
        axpy_rows_q8_0: Some(|a, r, o| unsafe { axpy_rows_q8_0(a, r, o) }),
        axpy_rows_q4_0: Some(|a, r, o| unsafe { axpy_rows_q4::<false>(a, r, o) }),
        axpy_rows_q4_1: Some(|a, r, o| unsafe { axpy_rows_q4::<true>(a, r, o) }),
        // SAFETY: the caller checked the CPU features, AVX2's among them.
        sign_sum: |bits, q| unsafe { sign_sum(bits, q) },
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

/// [`super::avx2::dot_inputs_block`] (a row against a prompt chunk's inputs) with VNNI's
/// `vpdpbusd` for each block's exact lane sums.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn dot_inputs_block<const KIND: u8>(w: &[u8], xs: &[&Q8Vec], out: &mut [f32]) {
    inputs_by_count::<KIND, true>(w, xs, out)
}

/// [`dot_inputs_block`] with the inputs' scales and sums packed side by side
/// (`super::avx2::dot_packed_block`).
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn dot_packed_block<const KIND: u8>(w: &[u8], xs: &[&Q8Vec], p: &Packed, out: &mut [f32]) {
    match xs.len().min(out.len()).min(p.inputs) {
        2 => packed_pairs::<KIND, 1>(w, xs, p, out),
        4 => packed_pairs::<KIND, 2>(w, xs, p, out),
        _ => packed_by_count::<KIND, true>(w, xs, p, out),
    }
}

/// [`dot_packed_block`] of `2·P` inputs, two to a 512-bit vector: input `2j`'s eight lanes in the
/// low half, input `2j + 1`'s in the high half, so that one `vpdpbusd`, one conversion, one
/// multiply and one add serve both. Each lane does what the 256-bit kernel's lane does for its
/// input (the block's exact lane sum, converted, times `d_w·d_x`, added), so every result keeps
/// its bits.
///
/// # Safety
/// The CPU has AVX-512 F, BW, VL and VNNI; `xs` has `2·P` inputs, `p` packs them.
#[inline(always)]
unsafe fn packed_pairs<const KIND: u8, const P: usize>(
    w: &[u8],
    xs: &[&Q8Vec],
    p: &Packed,
    out: &mut [f32],
) {
    let kind = block_kind(KIND);
    let bytes = kind.bytes();
    let xs: [[&Q8Vec; 2]; P] = std::array::from_fn(|j| [xs[2 * j], xs[2 * j + 1]]);
    let nb = xs
        .iter()
        .flatten()
        .fold((w.len() / bytes).min(p.blocks), |nb, x| {
            nb.min(x.scales.len())
                .min(x.sums.len())
                .min(x.quants.len() / BLOCK_LEN)
                .min(x.offsets.len() / 8)
        });
    let (wp, sp, mp) = (
        w.as_ptr(),
        p.scales.as_ptr() as *const f32,
        p.sums.as_ptr() as *const f32,
    );
    // Lanes 0–7 take element 2j of the four products, lanes 8–15 element 2j + 1.
    let pick: [__m512i; P] = std::array::from_fn(|j| {
        let low = _mm512_set1_epi32(2 * j as i32);
        _mm512_inserti64x4::<1>(low, _mm256_set1_epi32(2 * j as i32 + 1))
    });
    let both = |x: [&Q8Vec; 2], b: usize, of: fn(&Q8Vec, usize) -> __m256i| {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(of(x[0], b)), of(x[1], b))
    };
    let offsets =
        |x: &Q8Vec, b: usize| _mm256_loadu_si256(x.offsets.as_ptr().add(8 * b) as *const __m256i);
    let mut acc = [_mm512_setzero_ps(); P];
    let mut mins = _mm_setzero_ps();
    for b in 0..nb {
        let blk = wp.add(b * bytes);
        let c = _mm512_broadcast_i64x4(input_codes::<KIND, true>(blk));
        // Element i: d_w times input i's scale (the 256-bit kernel's products).
        let dd = _mm512_castps128_ps512(_mm_mul_ps(
            _mm_set1_ps(f16_lead(blk)),
            _mm_loadu_ps(sp.add(b * INPUTS)),
        ));
        if kind.has_min() {
            let m = _mm_set1_ps(f16_lead(blk.add(2)));
            mins = _mm_add_ps(mins, _mm_mul_ps(m, _mm_loadu_ps(mp.add(b * INPUTS))));
        }
        for (j, acc) in acc.iter_mut().enumerate() {
            let xv = both(xs[j], b, |x, b| x_block(x, b));
            let isums = match KIND {
                Q4_0 => _mm512_dpbusd_epi32(both(xs[j], b, offsets), c, xv),
                Q8_0 => {
                    // `vpsignb` has no 512-bit form: |c| times x negated where c is negative.
                    let neg = _mm512_movepi8_mask(c);
                    let xs = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(c), xs)
                }
                _ => _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, xv),
            };
            let ddj = _mm512_permutexvar_ps(pick[j], dd);
            *acc = _mm512_add_ps(*acc, _mm512_mul_ps(ddj, _mm512_cvtepi32_ps(isums)));
        }
    }
    let mut m = [0.0f32; 4];
    _mm_storeu_ps(m.as_mut_ptr(), mins);
    for (j, acc) in acc.into_iter().enumerate() {
        out[2 * j] = lanes_total(_mm512_castps512_ps256(acc)) + m[2 * j];
        out[2 * j + 1] = lanes_total(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
            _mm512_castps_pd(acc),
        ))) + m[2 * j + 1];
    }
}

/// [`super::avx2::groups_dot`] with VNNI's `vpdpbusd` for each lane's sums of eight rows.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn groups_dot<const KIND: u8>(data: &[u8], x: &Q8Vec, out: &mut [f32]) {
    groups_dot_with::<KIND, true>(data, x, out)
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
    let mut s = [[0.0f32; 8]; 8];
    for (a, rows) in a.chunks(8).zip(rows.chunks(8)) {
        for ((&a, w), s) in a.iter().zip(rows).zip(s.iter_mut()) {
            *s = block_scales::<B>(a, w.as_ptr().add(b * Q8_0_BYTES), Q8_0_BYTES);
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

/// `a` times the f16 scales at the start of `B` (at most eight) consecutive blocks, `bytes` apart,
/// from `p` (the portable kernels' `a · d`, the same products): eight converted and multiplied
/// at once, fewer one at a time. Kept in an array, each reaches its block's sixteen values by a
/// broadcast load rather than through the shuffle unit, which the 4-bit updates' permutes keep
/// busy (docs/results.md, "Down columns while they are in cache").
///
/// # Safety
/// AVX2 and F16C; blocks `0 .. B` from `p` lie within the row.
#[inline(always)]
unsafe fn block_scales<const B: usize>(a: f32, p: *const u8, bytes: usize) -> [f32; 8] {
    let mut s = [0.0f32; 8];
    if B == 8 {
        _mm256_storeu_ps(
            s.as_mut_ptr(),
            _mm256_mul_ps(_mm256_set1_ps(a), f16_scales8(p, bytes)),
        );
    } else {
        for (i, s) in s.iter_mut().enumerate().take(B) {
            *s = a * f16_lead(p.add(i * bytes));
        }
    }
    s
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
        q8_0_blocks::<8>(a, rows, b, op);
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
    let (mut s, mut c) = ([[0.0f32; 8]; 8], [[0.0f32; 8]; 8]);
    for (a, rows) in a.chunks(8).zip(rows.chunks(8)) {
        for ((&a, w), (s, c)) in a.iter().zip(rows).zip(s.iter_mut().zip(&mut c)) {
            let p = w.as_ptr().add(b * bytes);
            *s = block_scales::<B>(a, p, bytes);
            *c = if WITH_MIN {
                block_scales::<B>(a, p.add(2), bytes)
            } else {
                s.map(|s| -8.0 * s)
            };
        }
        for (w, (s, c)) in rows.iter().zip(s.iter().zip(&c)) {
            for (i, acc) in acc.iter_mut().enumerate() {
                let blk = w.as_ptr().add((b + i) * bytes);
                // Lane k: s·k + c, the value of code k (a product, then a sum, as for each value).
                let table = _mm512_add_ps(
                    _mm512_mul_ps(_mm512_set1_ps(s[i]), codes),
                    _mm512_set1_ps(c[i]),
                );
                // Byte j of the block as lane j: its low nibble is value j, its high one 16 + j.
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
        q4_blocks::<WITH_MIN, 8>(a, rows, b, op);
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

/// [`super::sketch::sign_sum`] 64 values at a time: eight bytes of signs are the mask of one
/// masked move of 64 codes, summed by one `vpdpbusd` against ones: exact integers.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn sign_sum(bits: &[u8], q: &[i8]) -> i32 {
    let n = q.len();
    assert!(bits.len() * 8 >= n, "a sign for every value");
    let ones = _mm512_set1_epi8(1);
    let mut acc = _mm512_setzero_si512();
    let blocks = n / 64;
    for b in 0..blocks {
        let mask = u64::from_le_bytes(bits[8 * b..8 * b + 8].try_into().expect("eight bytes"));
        // SAFETY: 64 codes from 64·b lie within `q` (b < n / 64).
        let codes = unsafe { _mm512_loadu_si512(q.as_ptr().add(64 * b).cast()) };
        acc = _mm512_dpbusd_epi32(acc, ones, _mm512_maskz_mov_epi8(mask, codes));
    }
    let tail = super::sketch::sign_sum(&bits[8 * blocks..], &q[64 * blocks..]);
    _mm512_reduce_add_epi32(acc) + tail
}
