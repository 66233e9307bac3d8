//! Row kernels for x86-64 with AVX2, FMA and F16C (CPUs without AVX-512 VNNI): 8 floats per vector;
//! block types one block (32 values) per vector, the integer dot product through `vpmaddubsw`
//! (unsigned × signed bytes into 16-bit pairs, which cannot overflow for these codes) and
//! `vpmaddwd`.
//!
//! Loops are bounded by the shorter input; tails run the portable code.

use std::arch::x86_64::*;

use leanstream_format::quant::BLOCK_LEN;

use super::operand::Q8Vec;
use super::portable::{self, Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES};
use super::rows::{dots_by_count, RowKernels, DOT_ROWS};

pub(super) fn detected() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// The AVX2 kernel table.
///
/// # Safety
/// The CPU must have the features [`detected`] checks.
pub(super) unsafe fn kernels() -> RowKernels {
    // SAFETY (every entry): the caller checked the CPU features.
    RowKernels {
        isa: "avx2",
        dot_f32: |w, x| unsafe { dot_float(w, x, Float::F32) },
        dot_f16: |w, x| unsafe { dot_float(w, x, Float::F16) },
        dot_bf16: |w, x| unsafe { dot_float(w, x, Float::Bf16) },
        dot_q8_0: |w, x| unsafe { dot_q8_0(w, x) },
        dot_q4_0: |w, x| unsafe { dot_q4::<false>(w, x) },
        dot_q4_1: |w, x| unsafe { dot_q4::<true>(w, x) },
        dots_q8_0: |r, x, o| unsafe { dots_q8_0(r, x, o) },
        dots_q4_0: |r, x, o| unsafe { dots_q4::<false>(r, x, o) },
        dots_q4_1: |r, x, o| unsafe { dots_q4::<true>(r, x, o) },
        dot_rows: DOT_ROWS,
        axpy_f32: |a, w, o| unsafe { axpy_float(a, w, o, Float::F32) },
        axpy_f16: |a, w, o| unsafe { axpy_float(a, w, o, Float::F16) },
        axpy_bf16: |a, w, o| unsafe { axpy_float(a, w, o, Float::Bf16) },
        axpy_q8_0: |a, w, o| unsafe { axpy_q8_0(a, w, o) },
        axpy_q4_0: |a, w, o| unsafe { axpy_q4::<false>(a, w, o) },
        axpy_q4_1: |a, w, o| unsafe { axpy_q4::<true>(a, w, o) },
        axpy_rows_q8_0: Some(|a, r, o| unsafe { axpy_rows_q8_0(a, r, o) }),
        axpy_rows_q4_0: Some(|a, r, o| unsafe { axpy_rows_q4::<false>(a, r, o) }),
        axpy_rows_q4_1: Some(|a, r, o| unsafe { axpy_rows_q4::<true>(a, r, o) }),
        more: super::kquant_avx2::table(),
    }
}

#[derive(Clone, Copy)]
enum Float {
    F32,
    F16,
    Bf16,
}

impl Float {
    fn bytes(self) -> usize {
        match self {
            Float::F32 => 4,
            Float::F16 | Float::Bf16 => 2,
        }
    }
}

/// 8 values at `p` as f32.
#[inline(always)]
unsafe fn load8(p: *const u8, unit: Float) -> __m256 {
    match unit {
        Float::F32 => _mm256_loadu_ps(p as *const f32),
        Float::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
        Float::Bf16 => {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
        }
    }
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_float(w: &[u8], x: &[f32], unit: Float) -> f32 {
    let bytes = unit.bytes();
    let n = x.len().min(w.len() / bytes);
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            let j = i + 8 * k;
            *a = _mm256_fmadd_ps(
                load8(wp.add(j * bytes), unit),
                _mm256_loadu_ps(xp.add(j)),
                *a,
            );
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(
            load8(wp.add(i * bytes), unit),
            _mm256_loadu_ps(xp.add(i)),
            acc[0],
        );
        i += 8;
    }
    let (tw, tx) = (&w[i * bytes..n * bytes], &x[i..n]);
    let tail = match unit {
        Float::F32 => portable::dot_f32(tw, tx),
        Float::F16 => portable::dot_f16(tw, tx),
        Float::Bf16 => portable::dot_bf16(tw, tx),
    };
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    hsum(s) + tail
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_float(a: f32, w: &[u8], out: &mut [f32], unit: Float) {
    let bytes = unit.bytes();
    let n = out.len().min(w.len() / bytes);
    let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        let o = op.add(i);
        _mm256_storeu_ps(
            o,
            _mm256_fmadd_ps(av, load8(wp.add(i * bytes), unit), _mm256_loadu_ps(o)),
        );
        i += 8;
    }
    let (tw, to) = (&w[i * bytes..n * bytes], &mut out[i..n]);
    match unit {
        Float::F32 => portable::axpy_f32(a, tw, to),
        Float::F16 => portable::axpy_f16(a, tw, to),
        Float::Bf16 => portable::axpy_bf16(a, tw, to),
    }
}

/// The f16 at `p` as f32.
#[inline(always)]
unsafe fn f16_load(p: *const u8) -> f32 {
    let h = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// Sums adjacent pairs of the 16-bit products into 32-bit lanes, as f32.
#[inline(always)]
unsafe fn widen(p16: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)))
}

/// One `Q8_0` block against 32 activation quants `xv`: per-lane sums as f32.
#[inline(always)]
unsafe fn q8_0_block(blk: *const u8, xv: __m256i) -> __m256 {
    let wv = _mm256_loadu_si256(blk.add(2) as *const __m256i);
    // vpmaddubsw multiplies unsigned by signed bytes: |w| and x with w's sign.
    widen(_mm256_maddubs_epi16(
        _mm256_sign_epi8(wv, wv),
        _mm256_sign_epi8(xv, wv),
    ))
}

/// Block `b`'s 32 activation quants.
#[inline(always)]
unsafe fn x_block(x: &Q8Vec, b: usize) -> __m256i {
    _mm256_loadu_si256(x.quants.as_ptr().add(b * BLOCK_LEN) as *const __m256i)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0(w: &[u8], x: &Q8Vec) -> f32 {
    dots_q8_0_n::<1>([w], x)[0]
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots_q8_0(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| dots_q8_0_n::<R>(r, x))
}

/// `R` rows' [`dot_q8_0`], each with one row's operations in its order (the same bits), each
/// activation block loaded once for all of them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // `k` picks the accumulator of each row
unsafe fn dots_q8_0_n<const R: usize>(rows: [&[u8]; R], x: &Q8Vec) -> [f32; R] {
    let nb = rows
        .iter()
        .fold(x.scales.len().min(x.quants.len() / BLOCK_LEN), |n, w| {
            n.min(w.len() / Q8_0_BYTES)
        });
    let wp = rows.map(|w| w.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let mut b = 0;
    while b + 2 <= nb {
        for k in 0..2 {
            let (xv, xd) = (x_block(x, b + k), x.scales[b + k]);
            for r in 0..R {
                let blk = wp[r].add((b + k) * Q8_0_BYTES);
                let scale = _mm256_set1_ps(f16_load(blk) * xd);
                acc[r][k] = _mm256_fmadd_ps(q8_0_block(blk, xv), scale, acc[r][k]);
            }
        }
        b += 2;
    }
    let mut heads = [0.0f32; R];
    for (h, [a0, a1]) in heads.iter_mut().zip(acc) {
        *h = hsum(_mm256_add_ps(a0, a1));
    }
    portable::q8_0_tails(heads, rows, x, b)
}

/// A 4-bit block's 16 nibble bytes as 32 codes in element order.
#[inline(always)]
unsafe fn unpack(nibbles: *const u8) -> __m256i {
    let n = _mm_loadu_si128(nibbles as *const __m128i);
    let low = _mm_set1_epi8(0x0f);
    _mm256_set_m128i(
        _mm_and_si128(_mm_srli_epi16::<4>(n), low),
        _mm_and_si128(n, low),
    )
}

/// `Q4_0` (`WITH_MIN` false: the offset −8 is taken off in the integer products, as
/// `(q_w − 8)·q_x = q_w·q_x − 8·q_x`, so no scalar sum runs alongside) or `Q4_1` (`m_w·d_x·Σ q_x`
/// per block, in two scalar sums so that neither waits on the other).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4<const WITH_MIN: bool>(w: &[u8], x: &Q8Vec) -> f32 {
    dots_q4_n::<WITH_MIN, 1>([w], x)[0]
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots_q4<const WITH_MIN: bool>(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| dots_q4_n::<WITH_MIN, R>(r, x))
}

/// `R` rows' [`dot_q4`], each with one row's operations in its order (the same bits), each
/// activation block (and `Q4_0`'s `8·Σ q_x` products) loaded and formed once for all of them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // `k` picks the accumulator of each row
unsafe fn dots_q4_n<const WITH_MIN: bool, const R: usize>(rows: [&[u8]; R], x: &Q8Vec) -> [f32; R] {
    let (bytes, nib) = if WITH_MIN {
        (Q4_1_BYTES, 4)
    } else {
        (Q4_0_BYTES, 2)
    };
    let nb = rows.iter().fold(
        x.scales
            .len()
            .min(x.sums.len())
            .min(x.quants.len() / BLOCK_LEN),
        |n, w| n.min(w.len() / bytes),
    );
    let (xd, xs) = (x.scales.as_ptr(), x.sums.as_ptr());
    let wp = rows.map(|w| w.as_ptr());
    let eights = _mm256_set1_epi8(8);
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let mut offsets = [[0.0f32; 2]; R];
    let mut b = 0;
    while b + 2 <= nb {
        for k in 0..2 {
            let xv = x_block(x, b + k);
            // |Σ pairs| ≤ 2·15·128 and 2·8·128: the difference fits 16 bits.
            let x8 = _mm256_maddubs_epi16(eights, xv);
            let (xd, xs) = (*xd.add(b + k), *xs.add(b + k));
            for r in 0..R {
                let blk = wp[r].add((b + k) * bytes);
                let mut p16 = _mm256_maddubs_epi16(unpack(blk.add(nib)), xv);
                if !WITH_MIN {
                    p16 = _mm256_sub_epi16(p16, x8);
                }
                let d = f16_load(blk) * xd;
                acc[r][k] = _mm256_fmadd_ps(widen(p16), _mm256_set1_ps(d), acc[r][k]);
                if WITH_MIN {
                    offsets[r][k] += f16_load(blk.add(2)) * xs;
                }
            }
        }
        b += 2;
    }
    // A plain loop, not `array::from_fn`: its closure was not inlined (4 % of a profile).
    let mut out = [0.0f32; R];
    for (r, res) in out.iter_mut().enumerate() {
        let head = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
        let tail = if WITH_MIN {
            portable::block_dot(rows[r], x, b, bytes, portable::block_q4_1)
        } else {
            portable::block_dot(rows[r], x, b, bytes, portable::block_q4_0)
        };
        *res = head + (offsets[r][0] + offsets[r][1]) + tail;
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_q8_0(a: f32, w: &[u8], out: &mut [f32]) {
    let nb = (w.len() / Q8_0_BYTES).min(out.len() / BLOCK_LEN);
    let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
    for b in 0..nb {
        let blk = wp.add(b * Q8_0_BYTES);
        let s = _mm256_set1_ps(a * f16_load(blk));
        for k in 0..4 {
            let q = _mm_loadl_epi64(blk.add(2 + 8 * k) as *const __m128i);
            let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            let dst = op.add(b * BLOCK_LEN + 8 * k);
            _mm256_storeu_ps(dst, _mm256_fmadd_ps(s, v, _mm256_loadu_ps(dst)));
        }
    }
}

/// `out += s·q + c` per block: `Q4_0` has `c = −8s`, `Q4_1` `c = a·m`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_q4<const WITH_MIN: bool>(a: f32, w: &[u8], out: &mut [f32]) {
    let (bytes, nib) = if WITH_MIN {
        (Q4_1_BYTES, 4)
    } else {
        (Q4_0_BYTES, 2)
    };
    let nb = (w.len() / bytes).min(out.len() / BLOCK_LEN);
    let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
    for b in 0..nb {
        let blk = wp.add(b * bytes);
        let s = a * f16_load(blk);
        let c = if WITH_MIN {
            a * f16_load(blk.add(2))
        } else {
            -8.0 * s
        };
        let (sv, cv) = (_mm256_set1_ps(s), _mm256_set1_ps(c));
        let codes = unpack(blk.add(nib));
        let halves = [
            _mm256_castsi256_si128(codes),
            _mm256_extracti128_si256::<1>(codes),
        ];
        for (h, q) in halves.into_iter().enumerate() {
            for (k, q8) in [q, _mm_unpackhi_epi64(q, q)].into_iter().enumerate() {
                let v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8));
                let dst = op.add(b * BLOCK_LEN + 16 * h + 8 * k);
                let o = _mm256_add_ps(_mm256_loadu_ps(dst), cv);
                _mm256_storeu_ps(dst, _mm256_fmadd_ps(sv, v, o));
            }
        }
    }
}

/// Whole blocks that `out` and every row hold (each row `bytes` per block).
#[inline(always)]
fn common_blocks(rows: &[&[u8]], bytes: usize, out: &[f32]) -> usize {
    rows.iter()
        .map(|r| r.len() / bytes)
        .fold(out.len() / BLOCK_LEN, usize::min)
}

/// The 32 floats of the output block at `dst`, four vectors.
#[inline(always)]
unsafe fn load_block(dst: *const f32) -> [__m256; 4] {
    [0, 8, 16, 24].map(|i| _mm256_loadu_ps(dst.add(i)))
}

#[inline(always)]
unsafe fn store_block(dst: *mut f32, acc: [__m256; 4]) {
    for (k, v) in acc.into_iter().enumerate() {
        _mm256_storeu_ps(dst.add(8 * k), v);
    }
}

/// [`axpy_q8_0`] of each row in turn, each output block kept in registers across the rows.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_rows_q8_0(a: &[f32], rows: &[&[u8]], out: &mut [f32]) {
    let n = a.len().min(rows.len());
    let nb = common_blocks(&rows[..n], Q8_0_BYTES, out);
    let op = out.as_mut_ptr();
    for b in 0..nb {
        let dst = op.add(b * BLOCK_LEN);
        let mut acc = load_block(dst);
        for (&a, w) in a[..n].iter().zip(&rows[..n]) {
            let blk = w.as_ptr().add(b * Q8_0_BYTES);
            let s = _mm256_set1_ps(a * f16_load(blk));
            for (k, acc) in acc.iter_mut().enumerate() {
                let q = _mm_loadl_epi64(blk.add(2 + 8 * k) as *const __m128i);
                let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                *acc = _mm256_fmadd_ps(s, v, *acc);
            }
        }
        store_block(dst, acc);
    }
}

/// [`axpy_q4`] of each row in turn, each output block kept in registers across the rows.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_rows_q4<const WITH_MIN: bool>(a: &[f32], rows: &[&[u8]], out: &mut [f32]) {
    let (bytes, nib) = if WITH_MIN {
        (Q4_1_BYTES, 4)
    } else {
        (Q4_0_BYTES, 2)
    };
    let n = a.len().min(rows.len());
    let nb = common_blocks(&rows[..n], bytes, out);
    let op = out.as_mut_ptr();
    for b in 0..nb {
        let dst = op.add(b * BLOCK_LEN);
        let mut acc = load_block(dst);
        for (&a, w) in a[..n].iter().zip(&rows[..n]) {
            let blk = w.as_ptr().add(b * bytes);
            let s = a * f16_load(blk);
            let c = if WITH_MIN {
                a * f16_load(blk.add(2))
            } else {
                -8.0 * s
            };
            let (sv, cv) = (_mm256_set1_ps(s), _mm256_set1_ps(c));
            let codes = unpack(blk.add(nib));
            let halves = [
                _mm256_castsi256_si128(codes),
                _mm256_extracti128_si256::<1>(codes),
            ];
            for (h, q) in halves.into_iter().enumerate() {
                for (k, q8) in [q, _mm_unpackhi_epi64(q, q)].into_iter().enumerate() {
                    let v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8));
                    let acc = &mut acc[2 * h + k];
                    *acc = _mm256_fmadd_ps(sv, v, _mm256_add_ps(*acc, cv));
                }
            }
        }
        store_block(dst, acc);
    }
}
