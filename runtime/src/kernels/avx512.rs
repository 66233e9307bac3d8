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
use super::rows::RowKernels;

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
        axpy_f32: |a, w, o| unsafe { axpy_f32(a, w, o) },
        axpy_f16: |a, w, o| unsafe { axpy_f16(a, w, o) },
        axpy_bf16: |a, w, o| unsafe { axpy_bf16(a, w, o) },
        axpy_q8_0: |a, w, o| unsafe { axpy_q8_0(a, w, o) },
        axpy_q4_0: |a, w, o| unsafe { axpy_q4::<false>(a, w, o) },
        axpy_q4_1: |a, w, o| unsafe { axpy_q4::<true>(a, w, o) },
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

/// Two f16 values at `p` and `p + stride` as the low lanes of a vector.
#[inline(always)]
unsafe fn f16_pair(p: *const u8, stride: usize) -> __m128 {
    let h0 = (p as *const u16).read_unaligned() as u32;
    let h1 = (p.add(stride) as *const u16).read_unaligned() as u32;
    _mm_cvtph_ps(_mm_cvtsi32_si128((h0 | (h1 << 16)) as i32))
}

/// Lanes 0..8 from lane 0 of `v`, lanes 8..16 from its lane 1: one scale per block of a pair.
#[inline(always)]
unsafe fn spread_pair(v: __m128) -> __m512 {
    let idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v))
}

/// Two consecutive f32 at `p` as the low lanes of a vector.
#[inline(always)]
unsafe fn f32_pair(p: *const f32) -> __m128 {
    _mm_castpd_ps(_mm_load_sd(p as *const f64))
}

/// Two `Q8_0` blocks at `blk` times 64 activation quants at `xq`: per-lane integer sums (8 lanes per
/// block) as f32, and the two blocks' `d_w·d_x` spread over their lanes.
#[inline(always)]
unsafe fn q8_0_pair(blk: *const u8, xq: *const i8, xd: *const f32) -> (__m512, __m512) {
    let w0 = _mm256_loadu_si256(blk.add(2) as *const __m256i);
    let w1 = _mm256_loadu_si256(blk.add(Q8_0_BYTES + 2) as *const __m256i);
    let wv = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(w0), w1);
    let xv = _mm512_loadu_si512(xq as *const _);
    // vpdpbusd multiplies unsigned by signed bytes: move w's sign onto x.
    let zero = _mm512_setzero_si512();
    let sx = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), zero, xv);
    let p = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(wv), sx);
    let scale = _mm_mul_ps(f16_pair(blk, Q8_0_BYTES), f32_pair(xd));
    (_mm512_cvtepi32_ps(p), spread_pair(scale))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn dot_q8_0(w: &[u8], x: &Q8Vec) -> f32 {
    let nb = (w.len() / Q8_0_BYTES).min(x.scales.len());
    let (wp, xq, xd) = (w.as_ptr(), x.quants.as_ptr(), x.scales.as_ptr());
    let pair = |b: usize| q8_0_pair(wp.add(b * Q8_0_BYTES), xq.add(b * BLOCK_LEN), xd.add(b));
    let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut b = 0;
    while b + 4 <= nb {
        let (p0, s0) = pair(b);
        let (p1, s1) = pair(b + 2);
        acc0 = _mm512_fmadd_ps(p0, s0, acc0);
        acc1 = _mm512_fmadd_ps(p1, s1, acc1);
        b += 4;
    }
    if b + 2 <= nb {
        let (p0, s0) = pair(b);
        acc0 = _mm512_fmadd_ps(p0, s0, acc0);
        b += 2;
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
        + portable::block_dot(w, x, b, Q8_0_BYTES, |blk, q, d, _| {
            portable::block_q8_0(blk, q, d)
        })
}

/// The 32 codes of two 4-bit blocks (16 nibble bytes each at `n0`, `n1`) as 64 bytes in element
/// order: block 0's low nibbles, its high nibbles, then block 1's.
#[inline(always)]
unsafe fn unpack_pair(n0: *const u8, n1: *const u8) -> __m512i {
    let a = _mm256_broadcastsi128_si256(_mm_loadu_si128(n0 as *const __m128i));
    let b = _mm256_broadcastsi128_si256(_mm_loadu_si128(n1 as *const __m128i));
    let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
    // Shift the second copy of each block's bytes right by 4 (64-bit lanes 2, 3, 6, 7); the mask
    // drops the bits that cross byte boundaries.
    let shifts = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
    _mm512_and_si512(_mm512_srlv_epi64(v, shifts), _mm512_set1_epi8(0x0f))
}

/// Two 4-bit blocks: per-lane integer sums as f32, the spread `d_w·d_x`, and the pair's offset
/// term `o·d_x·Σ q_x` (two lanes), where `o` is `d_w` for `Q4_0` (times −8 by the caller) and `m_w`
/// for `Q4_1`.
#[inline(always)]
unsafe fn q4_pair<const WITH_MIN: bool>(
    blk: *const u8,
    x: (*const i8, *const f32, *const f32),
) -> (__m512, __m512, __m128) {
    let (bytes, nib) = if WITH_MIN {
        (Q4_1_BYTES, 4)
    } else {
        (Q4_0_BYTES, 2)
    };
    let wv = unpack_pair(blk.add(nib), blk.add(bytes + nib));
    let xv = _mm512_loadu_si512(x.0 as *const _);
    let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
    let dw = f16_pair(blk, bytes);
    let scale = _mm_mul_ps(dw, f32_pair(x.1));
    let o = if WITH_MIN {
        f16_pair(blk.add(2), bytes)
    } else {
        dw
    };
    (
        _mm512_cvtepi32_ps(p),
        spread_pair(scale),
        _mm_mul_ps(o, f32_pair(x.2)),
    )
}

/// `Q4_0` (`WITH_MIN` false: offset −8 through the activation sums) or `Q4_1`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn dot_q4<const WITH_MIN: bool>(w: &[u8], x: &Q8Vec) -> f32 {
    let bytes = if WITH_MIN { Q4_1_BYTES } else { Q4_0_BYTES };
    let nb = (w.len() / bytes).min(x.scales.len());
    let (wp, xq, xd, xs) = (
        w.as_ptr(),
        x.quants.as_ptr(),
        x.scales.as_ptr(),
        x.sums.as_ptr(),
    );
    let pair = |b: usize| {
        q4_pair::<WITH_MIN>(wp.add(b * bytes), (xq.add(b * BLOCK_LEN), xd.add(b), xs.add(b)))
    };
    let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut offsets = _mm_setzero_ps();
    let mut b = 0;
    while b + 4 <= nb {
        let (p0, s0, o0) = pair(b);
        let (p1, s1, o1) = pair(b + 2);
        acc0 = _mm512_fmadd_ps(p0, s0, acc0);
        acc1 = _mm512_fmadd_ps(p1, s1, acc1);
        offsets = _mm_add_ps(offsets, _mm_add_ps(o0, o1));
        b += 4;
    }
    if b + 2 <= nb {
        let (p0, s0, o0) = pair(b);
        acc0 = _mm512_fmadd_ps(p0, s0, acc0);
        offsets = _mm_add_ps(offsets, o0);
        b += 2;
    }
    let offsets = _mm_cvtss_f32(_mm_add_ss(offsets, _mm_movehdup_ps(offsets)));
    let head = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    let tail = if WITH_MIN {
        portable::block_dot(w, x, b, bytes, portable::block_q4_1)
    } else {
        portable::block_dot(w, x, b, bytes, portable::block_q4_0)
    };
    head + if WITH_MIN { offsets } else { -8.0 * offsets } + tail
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
