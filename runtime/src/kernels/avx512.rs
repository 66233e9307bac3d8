//! Row kernels for x86-64 with AVX-512 (F, BW, VL) and VNNI: 16 floats per vector for the float
//! types, masked loads for tails; block types two blocks (64 values) per vector, with the integer
//! dot product in one `vpdpbusd` (unsigned × signed bytes, summed into 32-bit lanes).
//!
//! Every kernel bounds its loop by the shorter of its inputs, so a length mismatch cannot read out
//! of bounds (the dispatcher asserts the lengths match).

use std::arch::x86_64::*;

use leanstream_format::quant::BLOCK_LEN;

use super::operand::Q8Vec;
use super::portable::{self, f16_at, Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES};
use super::rows::{dots_by_count, RowKernels};

pub(super) fn detected() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// The AVX-512 kernel table.
///
/// # Safety
/// The CPU must have the features [`detected`] checks.
pub(super) unsafe fn kernels() -> RowKernels {
    // SAFETY (every entry): the caller checked the CPU features.
    RowKernels {
        isa: "avx512",
        dot_f32: |w, x| unsafe { dot_f32(w, x) },
        dot_f16: |w, x| unsafe { dot_f16(w, x) },
        dot_bf16: |w, x| unsafe { dot_bf16(w, x) },
        dot_q8_0: |w, x| unsafe { dot_q8_0(w, x) },
        dot_q4_0: |w, x| unsafe { dot_q4::<false>(w, x) },
        dot_q4_1: |w, x| unsafe { dot_q4::<true>(w, x) },
        dots_q8_0: |r, x, o| unsafe { dots_q8_0(r, x, o) },
        dots_q4_0: |r, x, o| unsafe { dots_q4::<false>(r, x, o) },
        dots_q4_1: |r, x, o| unsafe { dots_q4::<true>(r, x, o) },
        dot_rows: 1,
        axpy_f32: |a, w, o| unsafe { axpy_f32(a, w, o) },
        axpy_f16: |a, w, o| unsafe { axpy_f16(a, w, o) },
        axpy_bf16: |a, w, o| unsafe { axpy_bf16(a, w, o) },
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

/// The values at `p` selected by `mask` (up to 16) as f32.
#[inline(always)]
unsafe fn load16(p: *const u8, unit: Float, mask: __mmask16) -> __m512 {
    match unit {
        Float::F32 => _mm512_maskz_loadu_ps(mask, p as *const f32),
        Float::F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p as *const i16)),
        Float::Bf16 => {
            let h = _mm256_maskz_loadu_epi16(mask, p as *const i16);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
}

/// A mask of the first `min(left, 16)` lanes.
#[inline(always)]
fn lanes(left: usize) -> __mmask16 {
    if left >= 16 {
        !0
    } else {
        (1u16 << left) - 1
    }
}

#[inline(always)]
unsafe fn float_dot(w: &[u8], x: &[f32], unit: Float) -> f32 {
    let bytes = unit.bytes();
    let n = x.len().min(w.len() / bytes);
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i + 64 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            let j = i + 16 * k;
            let wv = load16(wp.add(j * bytes), unit, !0);
            *a = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp.add(j)), *a);
        }
        i += 64;
    }
    while i < n {
        let mask = lanes(n - i);
        let wv = load16(wp.add(i * bytes), unit, mask);
        let xv = _mm512_maskz_loadu_ps(mask, xp.add(i));
        acc[0] = _mm512_fmadd_ps(wv, xv, acc[0]);
        i += 16;
    }
    let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(s)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    float_dot(w, x, Float::F32)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn dot_f16(w: &[u8], x: &[f32]) -> f32 {
    float_dot(w, x, Float::F16)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn dot_bf16(w: &[u8], x: &[f32]) -> f32 {
    float_dot(w, x, Float::Bf16)
}

#[inline(always)]
unsafe fn float_axpy(a: f32, w: &[u8], out: &mut [f32], unit: Float) {
    let bytes = unit.bytes();
    let n = out.len().min(w.len() / bytes);
    let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
    let av = _mm512_set1_ps(a);
    let mut i = 0;
    while i < n {
        let mask = lanes(n - i);
        let wv = load16(wp.add(i * bytes), unit, mask);
        let o = _mm512_maskz_loadu_ps(mask, op.add(i));
        _mm512_mask_storeu_ps(op.add(i), mask, _mm512_fmadd_ps(av, wv, o));
        i += 16;
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn axpy_f32(a: f32, w: &[u8], out: &mut [f32]) {
    float_axpy(a, w, out, Float::F32)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn axpy_f16(a: f32, w: &[u8], out: &mut [f32]) {
    float_axpy(a, w, out, Float::F16)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn axpy_bf16(a: f32, w: &[u8], out: &mut [f32]) {
    float_axpy(a, w, out, Float::Bf16)
}

// Block types: the integer dot products of two blocks fill one vector (8 lanes per block); the
// scales of a group of blocks are fetched with one or two loads and a word permute (instead of two
// scalar loads per block), converted together, and spread over the lanes of each pair.

/// Two f16 values at `p` and `p + stride` as the low lanes of a vector (for the last pairs of a row).
#[inline(always)]
unsafe fn f16_pair(p: *const u8, stride: usize) -> __m128 {
    let h0 = (p as *const u16).read_unaligned() as u32;
    let h1 = (p.add(stride) as *const u16).read_unaligned() as u32;
    _mm_cvtph_ps(_mm_cvtsi32_si128((h0 | (h1 << 16)) as i32))
}

/// Two consecutive f32 at `p` as the low lanes of a vector.
#[inline(always)]
unsafe fn f32_pair(p: *const f32) -> __m128 {
    _mm_castpd_ps(_mm_load_sd(p as *const f64))
}

/// Lanes `2p` and `2p + 1` of `v`, each spread over 8 lanes: the scales of pair `p` of a group.
#[inline(always)]
unsafe fn spread(v: __m512, p: usize) -> __m512 {
    static IDX: [[i32; 16]; 4] = {
        let mut idx = [[0; 16]; 4];
        let mut p = 0;
        while p < 4 {
            let mut l = 0;
            while l < 16 {
                idx[p][l] = (2 * p + l / 8) as i32;
                l += 1;
            }
            p += 1;
        }
        idx
    };
    _mm512_permutexvar_ps(_mm512_loadu_si512(IDX[p].as_ptr() as *const _), v)
}

/// The f16 words at the word offsets `words` of the 64 bytes at `p` and the 64 at `p + HI` (words
/// 32..64), as f32; lanes past the offsets given repeat the first. Both spans must be readable:
/// the callers' group loops keep them within the row.
#[inline(always)]
unsafe fn gather_f16<const HI: usize>(p: *const u8, words: &[i16; 32]) -> __m512 {
    let idx = _mm512_loadu_si512(words.as_ptr() as *const _);
    _mm512_cvtph_ps(_mm512_castsi512_si256(permute_words::<HI>(p, idx)))
}

/// Word `i` of the result is word `idx[i]` of the 64 bytes at `p` followed by the 64 at `p + HI`:
/// one load and one `vpermi2w`. Written as assembly because LLVM, seeing the constant index and
/// the loads, rebuilds the neighbouring weight loads from these registers with a dozen shuffles.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn permute_words<const HI: usize>(p: *const u8, idx: __m512i) -> __m512i {
    let mut r = idx;
    let _t: __m512i;
    std::arch::asm!(
        "vmovdqu64 {t}, zmmword ptr [{p}]",
        "vpermi2w {r}, {t}, zmmword ptr [{p} + {hi}]",
        r = inout(zmm_reg) r,
        t = out(zmm_reg) _t,
        p = in(reg) p,
        hi = const HI,
        options(pure, readonly, nostack, preserves_flags),
    );
    r
}

/// Word offsets of the scales of 8 `Q4_0` blocks (18 bytes apart: 144 bytes, scales within the
/// first 128) and of 4 `Q8_0` blocks (34 bytes: 136, the first 128), read as one 128-byte span;
/// and of the `d` then `m` of 8 `Q4_1` blocks (20 bytes: 160), read as blocks 0..4 and 4..8.
static Q4_0_D: [i16; 32] = words(&[0, 9, 18, 27, 36, 45, 54, 63]);
static Q8_0_D: [i16; 32] = words(&[0, 17, 34, 51]);
static Q4_1_DM: [i16; 32] = words(&[0, 10, 20, 30, 32, 42, 52, 62, 1, 11, 21, 31, 33, 43, 53, 63]);

const fn words(w: &[i16]) -> [i16; 32] {
    let mut out = [0; 32];
    let mut i = 0;
    while i < w.len() {
        out[i] = w[i];
        i += 1;
    }
    out
}

/// `Σ q_w·q_x` per lane of two `Q8_0` blocks at `blk` against 64 activation quants `xv`, as f32.
#[inline(always)]
unsafe fn q8_0_pair(blk: *const u8, xv: __m512i) -> __m512 {
    let w0 = _mm256_loadu_si256(blk.add(2) as *const __m256i);
    let w1 = _mm256_loadu_si256(blk.add(Q8_0_BYTES + 2) as *const __m256i);
    let wv = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(w0), w1);
    // vpdpbusd multiplies unsigned by signed bytes: move w's sign onto x.
    let zero = _mm512_setzero_si512();
    let sx = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), zero, xv);
    _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, _mm512_abs_epi8(wv), sx))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
/// One row's `Q8_0` dot: the code of [`dots_q8_0_n`] for one row, kept as its own function
/// (the 1-row instance of the generic one was slower in the token loop).
unsafe fn dot_q8_0(w: &[u8], x: &Q8Vec) -> f32 {
    let nb = (w.len() / Q8_0_BYTES).min(x.scales.len());
    let (wp, xq, xd) = (w.as_ptr(), x.quants.as_ptr(), x.scales.as_ptr());
    let blk = |b: usize| wp.add(b * Q8_0_BYTES);
    let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut b = 0;
    // Groups of 4 blocks (136 bytes, of which the scales lie in the first 128).
    while b + 4 <= nb {
        let dw = gather_f16::<64>(blk(b), &Q8_0_D);
        let s = _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(0x0f, xd.add(b)));
        let p0 = q8_0_pair(blk(b), x_at(xq, b));
        let p1 = q8_0_pair(blk(b + 2), x_at(xq, b + 2));
        acc0 = _mm512_fmadd_ps(p0, spread(s, 0), acc0);
        acc1 = _mm512_fmadd_ps(p1, spread(s, 1), acc1);
        b += 4;
    }
    if b + 2 <= nb {
        let s = _mm_mul_ps(f16_pair(blk(b), Q8_0_BYTES), f32_pair(xd.add(b)));
        let p0 = q8_0_pair(blk(b), x_at(xq, b));
        acc0 = _mm512_fmadd_ps(p0, spread(_mm512_castps128_ps512(s), 0), acc0);
        b += 2;
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
        + portable::block_dot(w, x, b, Q8_0_BYTES, |blk, q, d, _| {
            portable::block_q8_0(blk, q, d)
        })
}

/// Block `b`'s and `b + 1`'s 64 activation quants.
#[inline(always)]
unsafe fn x_at(xq: *const i8, b: usize) -> __m512i {
    _mm512_loadu_si512(xq.add(b * BLOCK_LEN) as *const _)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn dots_q8_0(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| dots_q8_0_n::<R>(r, x))
}

/// `R` rows' `Q8_0` dots, each with [`dot_q8_0`]'s operations in its order (the same bits), the
/// activation quants and scales loaded once for all of them.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn dots_q8_0_n<const R: usize>(rows: [&[u8]; R], x: &Q8Vec) -> [f32; R] {
    let nb = rows
        .iter()
        .fold(x.scales.len(), |n, w| n.min(w.len() / Q8_0_BYTES));
    let (xq, xd) = (x.quants.as_ptr(), x.scales.as_ptr());
    let wp = rows.map(|w| w.as_ptr());
    let (mut acc0, mut acc1) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
    let mut b = 0;
    // Groups of 4 blocks (136 bytes, of which the scales lie in the first 128).
    while b + 4 <= nb {
        let xdv = _mm512_maskz_loadu_ps(0x0f, xd.add(b));
        let xv0 = _mm512_loadu_si512(xq.add(b * BLOCK_LEN) as *const _);
        let xv1 = _mm512_loadu_si512(xq.add((b + 2) * BLOCK_LEN) as *const _);
        for r in 0..R {
            let blk = |b: usize| wp[r].add(b * Q8_0_BYTES);
            let dw = gather_f16::<64>(blk(b), &Q8_0_D);
            let s = _mm512_mul_ps(dw, xdv);
            let p0 = q8_0_pair(blk(b), xv0);
            let p1 = q8_0_pair(blk(b + 2), xv1);
            acc0[r] = _mm512_fmadd_ps(p0, spread(s, 0), acc0[r]);
            acc1[r] = _mm512_fmadd_ps(p1, spread(s, 1), acc1[r]);
        }
        b += 4;
    }
    if b + 2 <= nb {
        let xdv = f32_pair(xd.add(b));
        let xv0 = _mm512_loadu_si512(xq.add(b * BLOCK_LEN) as *const _);
        for r in 0..R {
            let blk = wp[r].add(b * Q8_0_BYTES);
            let s = _mm_mul_ps(f16_pair(blk, Q8_0_BYTES), xdv);
            let p0 = q8_0_pair(blk, xv0);
            acc0[r] = _mm512_fmadd_ps(p0, spread(_mm512_castps128_ps512(s), 0), acc0[r]);
        }
        b += 2;
    }
    let mut heads = [0.0f32; R];
    for (h, (a0, a1)) in heads.iter_mut().zip(acc0.into_iter().zip(acc1)) {
        *h = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
    portable::q8_0_tails(heads, rows, x, b)
}

/// The scales `d` (lanes 0..8) of the 8 blocks at `blk`, and what multiplies the activation sums:
/// `d` again (`Q4_0`) or the minimums `m` (`Q4_1`, lanes 0..8).
#[inline(always)]
unsafe fn q4_group_scales<const WITH_MIN: bool>(blk: *const u8) -> (__m512, __m512) {
    if WITH_MIN {
        let dm = gather_f16::<{ 4 * Q4_1_BYTES }>(blk, &Q4_1_DM);
        // m to lanes 0..8.
        (dm, _mm512_shuffle_f32x4::<0b11_10_11_10>(dm, dm))
    } else {
        let d = gather_f16::<64>(blk, &Q4_0_D);
        (d, d)
    }
}

/// `Σ q_w·q_x` per lane of two 4-bit blocks (16 nibble bytes each at `n0`, `n1`) against 64
/// activation quants `xv`, as f32.
#[inline(always)]
unsafe fn q4_pair(n0: *const u8, n1: *const u8, xv: __m512i) -> __m512 {
    // Each block's 16 bytes twice; shifting the second copy right by 4 (64-bit lanes 2, 3, 6, 7)
    // and masking gives the codes in element order (low nibbles: 0..15, high: 16..31).
    let a = _mm256_broadcastsi128_si256(_mm_loadu_si128(n0 as *const __m128i));
    let b = _mm256_broadcastsi128_si256(_mm_loadu_si128(n1 as *const __m128i));
    let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
    let shifts = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
    let wv = _mm512_and_si512(_mm512_srlv_epi64(v, shifts), _mm512_set1_epi8(0x0f));
    _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv))
}

/// `Q4_0` (`WITH_MIN` false: the offset −8 enters through the activation sums as `−8·d_w·d_x·Σ q_x`)
/// or `Q4_1` (`m_w·d_x·Σ q_x`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
/// (One row: [`dots_q4_n`]'s operations for one row, kept as its own function: the 1-row
/// instance of the generic one was slower in the token loop.)
unsafe fn dot_q4<const WITH_MIN: bool>(w: &[u8], x: &Q8Vec) -> f32 {
    let (bytes, nib) = if WITH_MIN {
        (Q4_1_BYTES, 4)
    } else {
        (Q4_0_BYTES, 2)
    };
    let nb = (w.len() / bytes).min(x.scales.len());
    let (wp, xq, xd, xs) = (
        w.as_ptr(),
        x.quants.as_ptr(),
        x.scales.as_ptr(),
        x.sums.as_ptr(),
    );
    let blk = |b: usize| wp.add(b * bytes);
    let pair = |b: usize| q4_pair(blk(b).add(nib), blk(b + 1).add(nib), x_at(xq, b));
    let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    // Σ o·d_x·Σ q_x per block, o = d_w (Q4_0) or m_w (Q4_1).
    let mut offsets = _mm512_setzero_ps();
    let mut b = 0;
    // Groups of 8 blocks.
    const GROUP: usize = 8;
    while b + GROUP <= nb {
        // Exactly the group's lanes, zeros beyond.
        let load = |p: *const f32| _mm512_maskz_loadu_ps(0xff, p);
        let (dw, o) = q4_group_scales::<WITH_MIN>(blk(b));
        let s = _mm512_mul_ps(dw, load(xd.add(b)));
        offsets = _mm512_fmadd_ps(o, load(xs.add(b)), offsets);
        acc0 = _mm512_fmadd_ps(pair(b), spread(s, 0), acc0);
        acc1 = _mm512_fmadd_ps(pair(b + 2), spread(s, 1), acc1);
        acc0 = _mm512_fmadd_ps(pair(b + 4), spread(s, 2), acc0);
        acc1 = _mm512_fmadd_ps(pair(b + 6), spread(s, 3), acc1);
        b += GROUP;
    }
    let mut offset = _mm512_reduce_add_ps(offsets);
    while b + 2 <= nb {
        let dw = f16_pair(blk(b), bytes);
        let s = _mm_mul_ps(dw, f32_pair(xd.add(b)));
        acc0 = _mm512_fmadd_ps(pair(b), spread(_mm512_castps128_ps512(s), 0), acc0);
        let o = if WITH_MIN {
            f16_pair(blk(b).add(2), bytes)
        } else {
            dw
        };
        let t = _mm_mul_ps(o, f32_pair(xs.add(b)));
        offset += _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
        b += 2;
    }
    let head = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    let tail = if WITH_MIN {
        portable::block_dot(w, x, b, bytes, portable::block_q4_1)
    } else {
        portable::block_dot(w, x, b, bytes, portable::block_q4_0)
    };
    head + if WITH_MIN { offset } else { -8.0 * offset } + tail
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn dots_q4<const WITH_MIN: bool>(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| dots_q4_n::<WITH_MIN, R>(r, x))
}

/// `R` rows' [`dot_q4`], each with the operations of one row's in its order (the same bits), the
/// activation quants, scales and sums loaded once for all of them.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn dots_q4_n<const WITH_MIN: bool, const R: usize>(rows: [&[u8]; R], x: &Q8Vec) -> [f32; R] {
    let (bytes, nib) = if WITH_MIN {
        (Q4_1_BYTES, 4)
    } else {
        (Q4_0_BYTES, 2)
    };
    let nb = rows
        .iter()
        .fold(x.scales.len(), |n, w| n.min(w.len() / bytes));
    let (xq, xd, xs) = (x.quants.as_ptr(), x.scales.as_ptr(), x.sums.as_ptr());
    let wp = rows.map(|w| w.as_ptr());
    let xv = |b: usize| _mm512_loadu_si512(xq.add(b * BLOCK_LEN) as *const _);
    let (mut acc0, mut acc1) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
    // Σ o·d_x·Σ q_x per block, o = d_w (Q4_0) or m_w (Q4_1).
    let mut offsets = [_mm512_setzero_ps(); R];
    let mut b = 0;
    // Groups of 8 blocks.
    const GROUP: usize = 8;
    while b + GROUP <= nb {
        // Exactly the group's lanes, zeros beyond.
        let load = |p: *const f32| _mm512_maskz_loadu_ps(0xff, p);
        let (xdv, xsv) = (load(xd.add(b)), load(xs.add(b)));
        let xvs = [xv(b), xv(b + 2), xv(b + 4), xv(b + 6)];
        for r in 0..R {
            let blk = |b: usize| wp[r].add(b * bytes);
            let pair = |b: usize, xv: __m512i| q4_pair(blk(b).add(nib), blk(b + 1).add(nib), xv);
            let (dw, o) = q4_group_scales::<WITH_MIN>(blk(b));
            let s = _mm512_mul_ps(dw, xdv);
            offsets[r] = _mm512_fmadd_ps(o, xsv, offsets[r]);
            acc0[r] = _mm512_fmadd_ps(pair(b, xvs[0]), spread(s, 0), acc0[r]);
            acc1[r] = _mm512_fmadd_ps(pair(b + 2, xvs[1]), spread(s, 1), acc1[r]);
            acc0[r] = _mm512_fmadd_ps(pair(b + 4, xvs[2]), spread(s, 2), acc0[r]);
            acc1[r] = _mm512_fmadd_ps(pair(b + 6, xvs[3]), spread(s, 3), acc1[r]);
        }
        b += GROUP;
    }
    let mut offset = [0.0f32; R];
    for (o, v) in offset.iter_mut().zip(offsets) {
        *o = _mm512_reduce_add_ps(v);
    }
    while b + 2 <= nb {
        let (xdv, xsv, xv) = (f32_pair(xd.add(b)), f32_pair(xs.add(b)), xv(b));
        for r in 0..R {
            let blk = wp[r].add(b * bytes);
            let dw = f16_pair(blk, bytes);
            let s = _mm_mul_ps(dw, xdv);
            let p = q4_pair(blk.add(nib), blk.add(bytes + nib), xv);
            acc0[r] = _mm512_fmadd_ps(p, spread(_mm512_castps128_ps512(s), 0), acc0[r]);
            let o = if WITH_MIN {
                f16_pair(blk.add(2), bytes)
            } else {
                dw
            };
            let t = _mm_mul_ps(o, xsv);
            offset[r] += _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
        }
        b += 2;
    }
    // A plain loop, not `array::from_fn`: its closure was not inlined (4 % of a profile).
    let mut out = [0.0f32; R];
    for (r, res) in out.iter_mut().enumerate() {
        let head = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
        let tail = if WITH_MIN {
            portable::block_dot(rows[r], x, b, bytes, portable::block_q4_1)
        } else {
            portable::block_dot(rows[r], x, b, bytes, portable::block_q4_0)
        };
        *res =
            head + if WITH_MIN {
                offset[r]
            } else {
                -8.0 * offset[r]
            } + tail;
    }
    out
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn axpy_q8_0(a: f32, w: &[u8], out: &mut [f32]) {
    let nb = (w.len() / Q8_0_BYTES).min(out.len() / BLOCK_LEN);
    let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
    for b in 0..nb {
        let blk = wp.add(b * Q8_0_BYTES);
        let s = _mm512_set1_ps(a * f16_at(w, b * Q8_0_BYTES));
        let o = op.add(b * BLOCK_LEN);
        for half in 0..2 {
            let q = _mm_loadu_si128(blk.add(2 + 16 * half) as *const __m128i);
            let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
            let dst = o.add(16 * half);
            _mm512_storeu_ps(dst, _mm512_fmadd_ps(s, v, _mm512_loadu_ps(dst)));
        }
    }
}

/// `out += s·q + c` per block: `Q4_0` has `c = −8s`, `Q4_1` `c = a·m`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn axpy_q4<const WITH_MIN: bool>(a: f32, w: &[u8], out: &mut [f32]) {
    let (bytes, nib) = if WITH_MIN {
        (Q4_1_BYTES, 4)
    } else {
        (Q4_0_BYTES, 2)
    };
    let nb = (w.len() / bytes).min(out.len() / BLOCK_LEN);
    let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
    let low = _mm_set1_epi8(0x0f);
    for b in 0..nb {
        let s = a * f16_at(w, b * bytes);
        let c = if WITH_MIN {
            a * f16_at(w, b * bytes + 2)
        } else {
            -8.0 * s
        };
        let (sv, cv) = (_mm512_set1_ps(s), _mm512_set1_ps(c));
        let n = _mm_loadu_si128(wp.add(b * bytes + nib) as *const __m128i);
        let codes = [
            _mm_and_si128(n, low),
            _mm_and_si128(_mm_srli_epi16::<4>(n), low),
        ];
        for (half, q) in codes.into_iter().enumerate() {
            let v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
            let dst = op.add(b * BLOCK_LEN + 16 * half);
            let o = _mm512_add_ps(_mm512_loadu_ps(dst), cv);
            _mm512_storeu_ps(dst, _mm512_fmadd_ps(sv, v, o));
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

/// Rows [`axpy_rows_q8_0`] and [`axpy_rows_q4`] take at a time: each output block is loaded and
/// stored once per this many rows, and their scales are converted and multiplied together.
const ROW_GROUP: usize = 8;

/// The f16 word at byte `at` of each of 8 rows (`ptrs`), as f32.
#[inline(always)]
unsafe fn f16_column(ptrs: &[*const u8; ROW_GROUP], at: usize) -> __m256 {
    let w = |j: usize| (ptrs[j].add(at) as *const u16).read_unaligned() as i32;
    let lo = _mm_cvtsi32_si128(w(0) | (w(1) << 16));
    let lo = _mm_insert_epi32::<1>(lo, w(2) | (w(3) << 16));
    let lo = _mm_insert_epi32::<2>(lo, w(4) | (w(5) << 16));
    let lo = _mm_insert_epi32::<3>(lo, w(6) | (w(7) << 16));
    _mm256_cvtph_ps(lo)
}

/// Up to [`ROW_GROUP`] rows as pointers (the missing ones repeat the first, so every pointer can
/// be read; their coefficients are zero and their lanes unused) and their coefficients.
#[inline(always)]
unsafe fn row_group(a: &[f32], rows: &[&[u8]]) -> ([*const u8; ROW_GROUP], __m256) {
    let mut ptrs = [rows[0].as_ptr(); ROW_GROUP];
    let mut coef = [0.0f32; ROW_GROUP];
    for (j, (&a, r)) in a.iter().zip(rows).enumerate() {
        ptrs[j] = r.as_ptr();
        coef[j] = a;
    }
    (ptrs, _mm256_loadu_ps(coef.as_ptr()))
}

/// [`axpy_q8_0`] of each row in turn, each output block kept in registers across the rows, the
/// rows' scales `a·d` of a block computed eight at a time (the same f32 products as one by one).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn axpy_rows_q8_0(a: &[f32], rows: &[&[u8]], out: &mut [f32]) {
    let n = a.len().min(rows.len());
    let nb = common_blocks(&rows[..n], Q8_0_BYTES, out);
    let op = out.as_mut_ptr();
    for (a, rows) in a[..n].chunks(ROW_GROUP).zip(rows[..n].chunks(ROW_GROUP)) {
        let m = rows.len();
        let (ptrs, av) = row_group(a, rows);
        let mut scales = [0.0f32; ROW_GROUP];
        for b in 0..nb {
            let at = b * Q8_0_BYTES;
            _mm256_storeu_ps(
                scales.as_mut_ptr(),
                _mm256_mul_ps(f16_column(&ptrs, at), av),
            );
            let dst = op.add(b * BLOCK_LEN);
            let mut acc = [_mm512_loadu_ps(dst), _mm512_loadu_ps(dst.add(16))];
            for (&p, &s) in ptrs[..m].iter().zip(&scales) {
                let s = _mm512_set1_ps(s);
                for (half, acc) in acc.iter_mut().enumerate() {
                    let q = _mm_loadu_si128(p.add(at + 2 + 16 * half) as *const __m128i);
                    let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
                    *acc = _mm512_fmadd_ps(s, v, *acc);
                }
            }
            _mm512_storeu_ps(dst, acc[0]);
            _mm512_storeu_ps(dst.add(16), acc[1]);
        }
    }
}

/// [`axpy_q4`] of each row in turn, each output block kept in registers across the rows, the
/// rows' `s = a·d` and `c` (`a·m`, or `−8s`) of a block computed eight at a time (the same f32
/// products as one by one).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn axpy_rows_q4<const WITH_MIN: bool>(a: &[f32], rows: &[&[u8]], out: &mut [f32]) {
    let (bytes, nib) = if WITH_MIN {
        (Q4_1_BYTES, 4)
    } else {
        (Q4_0_BYTES, 2)
    };
    let n = a.len().min(rows.len());
    let nb = common_blocks(&rows[..n], bytes, out);
    let op = out.as_mut_ptr();
    let low = _mm_set1_epi8(0x0f);
    for (a, rows) in a[..n].chunks(ROW_GROUP).zip(rows[..n].chunks(ROW_GROUP)) {
        let m = rows.len();
        let (ptrs, av) = row_group(a, rows);
        let (mut s, mut c) = ([0.0f32; ROW_GROUP], [0.0f32; ROW_GROUP]);
        for b in 0..nb {
            let at = b * bytes;
            let sv = _mm256_mul_ps(f16_column(&ptrs, at), av);
            let cv = if WITH_MIN {
                _mm256_mul_ps(f16_column(&ptrs, at + 2), av)
            } else {
                _mm256_mul_ps(_mm256_set1_ps(-8.0), sv)
            };
            _mm256_storeu_ps(s.as_mut_ptr(), sv);
            _mm256_storeu_ps(c.as_mut_ptr(), cv);
            let dst = op.add(b * BLOCK_LEN);
            let mut acc = [_mm512_loadu_ps(dst), _mm512_loadu_ps(dst.add(16))];
            for ((&p, &s), &c) in ptrs[..m].iter().zip(&s).zip(&c) {
                let (sv, cv) = (_mm512_set1_ps(s), _mm512_set1_ps(c));
                let q = _mm_loadu_si128(p.add(at + nib) as *const __m128i);
                let codes = [
                    _mm_and_si128(q, low),
                    _mm_and_si128(_mm_srli_epi16::<4>(q), low),
                ];
                for (acc, q) in acc.iter_mut().zip(codes) {
                    let v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
                    *acc = _mm512_fmadd_ps(sv, v, _mm512_add_ps(*acc, cv));
                }
            }
            _mm512_storeu_ps(dst, acc[0]);
            _mm512_storeu_ps(dst.add(16), acc[1]);
        }
    }
}
