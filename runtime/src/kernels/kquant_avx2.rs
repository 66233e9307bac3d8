//! AVX2 kernels of the 5-bit types and the K-quants (`Q5_0` … `Q6_K`), for the AVX2 and AVX-512
//! sets: the integer sums of eight 32-value blocks at a time in vectors (`vpmaddubsw` of the
//! unsigned codes and the signed activation quants, which cannot overflow for codes below 64, then
//! `vpmaddwd`), exact, and the float terms in scalar code shared with the portable kernels, in
//! their order, so each result has the portable kernel's bits. `axpy` stays portable.

use std::arch::x86_64::*;

use super::avx2;
use super::operand::Q8Vec;
use super::portable::{finish_q45_k, finish_q6_k, K_SUB, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES};
use super::rows::{MoreKernels, PORTABLE_MORE};

/// The table for a CPU with AVX2 (the caller checked it).
pub(super) fn table() -> MoreKernels {
    // SAFETY (every entry): only installed in kernel sets whose CPU check includes AVX2.
    MoreKernels {
        dot: [
            |w, x| unsafe { avx2::dot_block::<{ avx2::Q5_0 }>(w, x) },
            |w, x| unsafe { avx2::dot_block::<{ avx2::Q5_1 }>(w, x) },
            |w, x| unsafe { dot_q45_k::<false>(w, x) },
            |w, x| unsafe { dot_q45_k::<true>(w, x) },
            |w, x| unsafe { dot_q6_k(w, x) },
        ],
        dots: [
            |r, x, o| unsafe { avx2::dots_block::<{ avx2::Q5_0 }>(r, x, o) },
            |r, x, o| unsafe { avx2::dots_block::<{ avx2::Q5_1 }>(r, x, o) },
            |r, x, o| each(r, x, o, |w, x| unsafe { dot_q45_k::<false>(w, x) }),
            |r, x, o| each(r, x, o, |w, x| unsafe { dot_q45_k::<true>(w, x) }),
            |r, x, o| each(r, x, o, |w, x| unsafe { dot_q6_k(w, x) }),
        ],
        inputs: [
            Some(|w, xs, o| unsafe { avx2::dot_inputs_block::<{ avx2::Q5_0 }>(w, xs, o) }),
            Some(|w, xs, o| unsafe { avx2::dot_inputs_block::<{ avx2::Q5_1 }>(w, xs, o) }),
            None,
            None,
            None,
        ],
        axpy: PORTABLE_MORE.axpy,
    }
}

/// `dots` as one `dot` per row (each row streams its own bytes; the input is in cache).
#[inline(always)]
fn each(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32], dot: impl Fn(&[u8], &Q8Vec) -> f32) {
    for (o, w) in out.iter_mut().zip(rows) {
        *o = dot(w, x);
    }
}

/// The lane sums of four vectors of 32-bit integers.
#[inline(always)]
unsafe fn reduce4(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m128i {
    let ab = _mm256_hadd_epi32(a, b);
    let cd = _mm256_hadd_epi32(c, d);
    let abcd = _mm256_hadd_epi32(ab, cd);
    _mm_add_epi32(
        _mm256_castsi256_si128(abcd),
        _mm256_extracti128_si256::<1>(abcd),
    )
}

/// The eight lane sums of eight vectors of 32-bit integers.
#[inline(always)]
unsafe fn reduce8(v: [__m256i; 8]) -> [i32; 8] {
    let lo = reduce4(v[0], v[1], v[2], v[3]);
    let hi = reduce4(v[4], v[5], v[6], v[7]);
    let mut out = [0i32; 8];
    _mm_storeu_si128(out.as_mut_ptr() as *mut __m128i, lo);
    _mm_storeu_si128(out.as_mut_ptr().add(4) as *mut __m128i, hi);
    out
}

/// `Σ q·x` of 32 unsigned codes (below 64) and 32 signed quants, in eight 32-bit lanes.
#[inline(always)]
unsafe fn isum32(q: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1))
}

#[inline(always)]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// 32 bytes, byte `j` 0x10 where bit `j` of `bits` is set (ggml's `bytes_from_bits_32`).
#[inline(always)]
unsafe fn fifth_bits(bits: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuf);
    let set = _mm256_cmpeq_epi8(
        _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe)),
        _mm256_set1_epi64x(-1),
    );
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// Bit `j` of each byte of `qh`, as 0x10.
#[inline(always)]
unsafe fn fifth_bit(qh: __m256i, j: i32, one: __m256i) -> __m256i {
    let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(j));
    _mm256_slli_epi16::<4>(_mm256_and_si256(h, one))
}

/// A 5-bit block's 32 codes in element order.
#[inline(always)]
pub(super) unsafe fn q5_codes(blk: *const u8, at: usize) -> __m256i {
    let qh = (blk.add(at) as *const u32).read_unaligned();
    let n = _mm_loadu_si128(blk.add(at + 4) as *const __m128i);
    let low = _mm_set1_epi8(0x0f);
    let nib = _mm256_set_m128i(
        _mm_and_si128(_mm_srli_epi16::<4>(n), low),
        _mm_and_si128(n, low),
    );
    _mm256_or_si256(nib, fifth_bits(qh))
}

/// `Q4_K` (`FIVE` false) or `Q5_K`, one super-block (eight q8 blocks) at a time.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q45_k<const FIVE: bool>(w: &[u8], x: &Q8Vec) -> f32 {
    let bytes = if FIVE { Q5_K_BYTES } else { Q4_K_BYTES };
    let nb = (w.len() / bytes)
        .min(x.scales.len() / K_SUB)
        .min(x.quants.len() / 256);
    let xp = x.quants.as_ptr() as *const u8;
    let low = _mm256_set1_epi8(0x0f);
    let one = _mm256_set1_epi8(1);
    let mut sum = -0.0f32;
    for b in 0..nb {
        let blk = w.as_ptr().add(b * bytes);
        let qs = blk.add(if FIVE { 48 } else { 16 });
        let qh = if FIVE {
            load(blk.add(16))
        } else {
            _mm256_setzero_si256()
        };
        let mut v = [_mm256_setzero_si256(); 8];
        for g in 0..4 {
            let q = load(qs.add(32 * g));
            let mut lo = _mm256_and_si256(q, low);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low);
            if FIVE {
                lo = _mm256_or_si256(lo, fifth_bit(qh, 2 * g as i32, one));
                hi = _mm256_or_si256(hi, fifth_bit(qh, 2 * g as i32 + 1, one));
            }
            let xq = xp.add(b * 256 + 64 * g);
            v[2 * g] = isum32(lo, load(xq));
            v[2 * g + 1] = isum32(hi, load(xq.add(32)));
        }
        let isums = reduce8(v);
        let r = K_SUB * b..K_SUB * (b + 1);
        sum += finish_q45_k(&w[b * bytes..], &isums, &x.scales[r.clone()], &x.sums[r]);
    }
    sum
}

/// `Q6_K`, one super-block at a time: `(q − 32)` pair sums scaled by each 16-value sub-block's
/// scale in `vpmaddwd`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k(w: &[u8], x: &Q8Vec) -> f32 {
    let nb = (w.len() / Q6_K_BYTES)
        .min(x.scales.len() / K_SUB)
        .min(x.quants.len() / 256);
    let xp = x.quants.as_ptr() as *const u8;
    let low = _mm256_set1_epi8(0x0f);
    let three = _mm256_set1_epi8(3);
    let offset = _mm256_set1_epi8(32);
    let mut sum = -0.0f32;
    for b in 0..nb {
        let blk = w.as_ptr().add(b * Q6_K_BYTES);
        let mut v = [_mm256_setzero_si256(); 8];
        for (j, v) in v.iter_mut().enumerate() {
            let (h, k) = (j / 4, j % 4);
            let ql = load(blk.add(64 * h + 32 * (k & 1)));
            let nib = if k < 2 {
                _mm256_and_si256(ql, low)
            } else {
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql), low)
            };
            let qh = _mm256_srl_epi16(load(blk.add(128 + 32 * h)), _mm_cvtsi32_si128(2 * k as i32));
            let q = _mm256_or_si256(nib, _mm256_slli_epi16::<4>(_mm256_and_si256(qh, three)));
            let xv = load(xp.add(b * 256 + 32 * j));
            let pairs = _mm256_sub_epi16(
                _mm256_maddubs_epi16(q, xv),
                _mm256_maddubs_epi16(offset, xv),
            );
            let s0 = *blk.add(192 + 2 * j) as i8 as i16;
            let s1 = *blk.add(193 + 2 * j) as i8 as i16;
            let scales = _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0));
            *v = _mm256_madd_epi16(pairs, scales);
        }
        let isums = reduce8(v);
        let r = K_SUB * b..K_SUB * (b + 1);
        sum += finish_q6_k(&w[b * Q6_K_BYTES..], &isums, &x.scales[r]);
    }
    sum
}
