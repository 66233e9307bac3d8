//! AVX2 kernels of the 5-bit types and the K-quants (`Q5_0` … `Q6_K`), for the AVX2 and AVX-512
//! sets: the integer sums of eight 32-value blocks at a time in vectors (`vpmaddubsw` of the
//! unsigned codes and the signed activation quants, which cannot overflow for codes below 64, then
//! `vpmaddwd`), exact, and the float terms of a super-block formed in eight lanes with the portable
//! finish's operations (unfused) and added in its order, so each result has the portable kernel's
//! bits. `dot_inputs` decodes a row's super-block once for up to eight inputs. `axpy` stays
//! portable.

use std::arch::x86_64::*;

use super::avx2::{self, f16_lead, f16_load};
use super::operand::Q8Vec;
use super::portable::{
    scales_mins_k4_bytes, super_blocks, K_SUB, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES,
};
use super::rows::{by_inputs, each_row as each, MoreKernels, PORTABLE_MORE, WIDE_INPUTS};

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
        dots_ahead: [
            Some(|r, x, o| unsafe { avx2::dots_block_ahead::<{ avx2::Q5_0 }>(r, x, o) }),
            Some(|r, x, o| unsafe { avx2::dots_block_ahead::<{ avx2::Q5_1 }>(r, x, o) }),
            Some(|r, x, o| each(r, x, o, |w, x| unsafe { dot_q45_k_ahead::<false>(w, x) })),
            Some(|r, x, o| each(r, x, o, |w, x| unsafe { dot_q45_k_ahead::<true>(w, x) })),
            Some(|r, x, o| each(r, x, o, |w, x| unsafe { dot_q6_k_ahead(w, x) })),
        ],
        inputs: [
            Some(|w, xs, o| unsafe { avx2::dot_inputs_wide::<{ avx2::Q5_0 }>(w, xs, o) }),
            Some(|w, xs, o| unsafe { avx2::dot_inputs_wide::<{ avx2::Q5_1 }>(w, xs, o) }),
            Some(|w, xs, o| unsafe { inputs_q45_k::<false>(w, xs, o) }),
            Some(|w, xs, o| unsafe { inputs_q45_k::<true>(w, xs, o) }),
            Some(|w, xs, o| unsafe { inputs_q6_k(w, xs, o) }),
        ],
        inputs_width: [WIDE_INPUTS; 5],
        axpy: PORTABLE_MORE.axpy,
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

/// `Σ q·x` of 32 unsigned codes (below 64) and 32 signed quants, in eight 32-bit lanes.
#[inline(always)]
unsafe fn isum32(q: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1))
}

#[inline(always)]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// 32 bytes, byte `j` 0xff where bit `j` of `bits` is set, else 0 (ggml's `bytes_from_bits_32`).
#[inline(always)]
unsafe fn fifth_mask(bits: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuf);
    _mm256_cmpeq_epi8(
        _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe)),
        _mm256_set1_epi64x(-1),
    )
}

/// Bit `j` of each byte of `qh`, as 0x10.
#[inline(always)]
unsafe fn fifth_bit(qh: __m256i, j: i32, one: __m256i) -> __m256i {
    let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(j));
    _mm256_slli_epi16::<4>(_mm256_and_si256(h, one))
}

/// A 5-bit block's 32 codes in element order, less 16 when `OFFSET` (`Q5_0`'s `q − 16`): the
/// fifth bit's 0x10 or'd in, or 0xf0 or'd in where the fifth bit is clear (`q − 16` as `i8` in one
/// operation, llama.cpp's trick).
#[inline(always)]
pub(super) unsafe fn q5_codes<const OFFSET: bool>(blk: *const u8, at: usize) -> __m256i {
    let qh = (blk.add(at) as *const u32).read_unaligned();
    let n = _mm_loadu_si128(blk.add(at + 4) as *const __m128i);
    let low = _mm_set1_epi8(0x0f);
    let nib = _mm256_set_m128i(
        _mm_and_si128(_mm_srli_epi16::<4>(n), low),
        _mm_and_si128(n, low),
    );
    let set = fifth_mask(qh);
    let high = if OFFSET {
        _mm256_andnot_si256(set, _mm256_set1_epi8(0xf0u8 as i8))
    } else {
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    };
    _mm256_or_si256(nib, high)
}

/// A `Q4_K`/`Q5_K` super-block's eight 6-bit scales and eight minimums (the 12 bytes at `s`,
/// [`scales_mins_k4_bytes`]), as f32 lanes `j = 0..8`.
#[inline(always)]
unsafe fn scales_mins_k4(s: *const u8) -> (__m256, __m256) {
    let (sc, m) = scales_mins_k4_bytes(std::slice::from_raw_parts(s, 12));
    let lanes = |v: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)));
    (lanes(sc), lanes(m))
}

/// `0 + t_0 + t_1 + … + t_7` in that order: a super-block's terms summed as the portable finish
/// sums them (the terms themselves are formed in lanes with the portable operations, unfused).
#[inline(always)]
unsafe fn ordered_sum(t: __m256) -> f32 {
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), t);
    let mut sum = 0.0f32;
    for l in lanes {
        sum += l;
    }
    sum
}

/// [`ordered_sum`] of each of up to four inputs' terms (`t[i]`, zero vectors past the inputs) at
/// once, lane `i` of the result input `i`'s: the four vectors transposed so that one vector add
/// takes term `k` of every input, `0 + t_0 + … + t_7` in order in each lane, the same operations
/// on the same values as four scalar sums (which wait on 32 dependent scalar additions and a
/// store and reload of each vector).
#[inline(always)]
unsafe fn ordered_sums4(t: [__m256; 4]) -> __m128 {
    // Lane j of row i is t[i][j]: after the unpacks and shuffles, `v[k]` holds term k of every
    // input in its low half and term k + 4 in its high half.
    let (a, b) = (
        _mm256_unpacklo_ps(t[0], t[1]),
        _mm256_unpacklo_ps(t[2], t[3]),
    );
    let (c, d) = (
        _mm256_unpackhi_ps(t[0], t[1]),
        _mm256_unpackhi_ps(t[2], t[3]),
    );
    let v = [
        _mm256_shuffle_ps::<0x44>(a, b),
        _mm256_shuffle_ps::<0xee>(a, b),
        _mm256_shuffle_ps::<0x44>(c, d),
        _mm256_shuffle_ps::<0xee>(c, d),
    ];
    let mut s = _mm_setzero_ps();
    for v in v {
        s = _mm_add_ps(s, _mm256_castps256_ps128(v));
    }
    for v in v {
        s = _mm_add_ps(s, _mm256_extractf128_ps::<1>(v));
    }
    s
}

/// Adds each input's super-block sum to its running sum (input `i`'s terms in `t[i]`):
/// [`ordered_sum`] into `sums` for one input, else [`ordered_sums4`] of inputs `0..4` into
/// `all[0]` and of `4..8` into `all[1]`.
#[inline(always)]
unsafe fn add_ordered<const N: usize>(sums: &mut [f32; N], all: &mut [__m128; 2], t: [__m256; N]) {
    if N == 1 {
        sums[0] += ordered_sum(t[0]);
        return;
    }
    for (q, all) in all.iter_mut().enumerate().take(N.div_ceil(4)) {
        let t4 = std::array::from_fn(|k| t.get(4 * q + k).copied().unwrap_or(_mm256_setzero_ps()));
        *all = _mm_add_ps(*all, ordered_sums4(t4));
    }
}

/// The results of [`add_ordered`]: `sums` for one input, else the lanes of `all`.
#[inline(always)]
unsafe fn ordered_results<const N: usize>(sums: [f32; N], all: [__m128; 2]) -> [f32; N] {
    if N == 1 {
        return sums;
    }
    let mut lanes = [0.0f32; 8];
    _mm_storeu_ps(lanes.as_mut_ptr(), all[0]);
    _mm_storeu_ps(lanes.as_mut_ptr().add(4), all[1]);
    std::array::from_fn(|i| lanes[i])
}

/// `Q4_K` (`FIVE` false) or `Q5_K` against `N` inputs, one super-block (eight q8 blocks) at a
/// time: the row's codes and scales decoded once for every input; per input the eight integer
/// sums in a vector, the portable finish's terms (`(d·sc_j)·(d_x·isum_j) − (dmin·m_j)·sx_j`) in
/// eight float lanes, added in order. Each result has the bits of [`super::portable::finish_q45_k`]'s order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q45_k<const FIVE: bool, const N: usize, const AHEAD: bool>(
    w: &[u8],
    xs: [&Q8Vec; N],
) -> [f32; N] {
    let bytes = if FIVE { Q5_K_BYTES } else { Q4_K_BYTES };
    let nb = super_blocks(w, bytes, &xs);
    let low = _mm256_set1_epi8(0x0f);
    let one = _mm256_set1_epi8(1);
    let mut sums = [-0.0f32; N];
    let mut all = [_mm_set1_ps(-0.0); 2];
    for b in 0..nb {
        let blk = w.as_ptr().add(b * bytes);
        if AHEAD {
            read_ahead(blk, bytes);
        }
        let qs = blk.add(if FIVE { 48 } else { 16 });
        let qh = if FIVE {
            load(blk.add(16))
        } else {
            _mm256_setzero_si256()
        };
        let mut half = [[_mm_setzero_si128(); 2]; N];
        for (h, g) in [(0, 0), (1, 2)] {
            // Sub-blocks 4h..4h + 4: the low and high nibbles of groups g and g + 1.
            let mut c = [_mm256_setzero_si256(); 4];
            for k in 0..2 {
                let q = load(qs.add(32 * (g + k)));
                let mut lo = _mm256_and_si256(q, low);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low);
                if FIVE {
                    let j = 2 * (g + k) as i32;
                    lo = _mm256_or_si256(lo, fifth_bit(qh, j, one));
                    hi = _mm256_or_si256(hi, fifth_bit(qh, j + 1, one));
                }
                c[2 * k] = lo;
                c[2 * k + 1] = hi;
            }
            for (i, x) in xs.iter().enumerate() {
                let xq = (x.quants.as_ptr() as *const u8).add(b * 256 + 128 * h);
                let v: [__m256i; 4] = std::array::from_fn(|k| isum32(c[k], load(xq.add(32 * k))));
                half[i][h] = reduce4(v[0], v[1], v[2], v[3]);
            }
        }
        let (sc, m) = scales_mins_k4(blk.add(4));
        let dsc = _mm256_mul_ps(_mm256_set1_ps(f16_lead(blk)), sc);
        let dmm = _mm256_mul_ps(_mm256_set1_ps(f16_lead(blk.add(2))), m);
        let t = std::array::from_fn(|i| {
            let x = xs[i];
            let isums = _mm256_cvtepi32_ps(_mm256_set_m128i(half[i][1], half[i][0]));
            let dx = _mm256_loadu_ps(x.scales.as_ptr().add(K_SUB * b));
            let sx = _mm256_loadu_ps(x.sums.as_ptr().add(K_SUB * b));
            _mm256_sub_ps(
                _mm256_mul_ps(dsc, _mm256_mul_ps(dx, isums)),
                _mm256_mul_ps(dmm, sx),
            )
        });
        add_ordered(&mut sums, &mut all, t);
    }
    ordered_results(sums, all)
}

/// `Q6_K` against `N` inputs, one super-block at a time: `(q − 32)` pair sums (`|q − 32|` times
/// the activation with `q − 32`'s sign, at most 2·32·127 per pair) scaled by each 16-value
/// sub-block's scale in `vpmaddwd`, the row decoded once for every input; per input the
/// terms `d·(d_x·isum_j)` in eight float lanes, added in order ([`super::portable::finish_q6_k`]'s bits).
#[allow(clippy::needless_range_loop)] // half h indexes the row and every input
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k<const N: usize, const AHEAD: bool>(w: &[u8], xs: [&Q8Vec; N]) -> [f32; N] {
    let nb = super_blocks(w, Q6_K_BYTES, &xs);
    let low = _mm256_set1_epi8(0x0f);
    let three = _mm256_set1_epi8(3);
    let offset = _mm256_set1_epi8(32);
    let mut sums = [-0.0f32; N];
    let mut all = [_mm_set1_ps(-0.0); 2];
    for b in 0..nb {
        let blk = w.as_ptr().add(b * Q6_K_BYTES);
        if AHEAD {
            read_ahead(blk, Q6_K_BYTES);
        }
        // The sixteen 16-value sub-blocks' scales as 16-bit words, 0–7 in the low half, 8–15 in
        // the high half.
        let scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192) as *const __m128i));
        let mut half = [[_mm_setzero_si128(); 2]; N];
        for h in 0..2 {
            // Sub-blocks j = 4h + k; their scales (words 8h .. 8h + 8) in both halves.
            let sh = if h == 0 {
                _mm256_permute2x128_si256::<0x00>(scales, scales)
            } else {
                _mm256_permute2x128_si256::<0x11>(scales, scales)
            };
            let qh = load(blk.add(128 + 32 * h));
            let mut c = [_mm256_setzero_si256(); 4];
            let mut a = [_mm256_setzero_si256(); 4];
            let mut s = [_mm256_setzero_si256(); 4];
            for k in 0..4 {
                let ql = load(blk.add(64 * h + 32 * (k & 1)));
                let nib = if k < 2 {
                    _mm256_and_si256(ql, low)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql), low)
                };
                let hb = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32));
                let q = _mm256_or_si256(nib, _mm256_slli_epi16::<4>(_mm256_and_si256(hb, three)));
                c[k] = _mm256_sub_epi8(q, offset);
                a[k] = _mm256_sign_epi8(c[k], c[k]);
                // Word 2k of the half (sub-block 2j's scale) in every word of the low half,
                // word 2k + 1 in the high half.
                let (w0, w1) = (4 * k as i16, 4 * k as i16 + 2);
                let pick = _mm256_set_m128i(
                    _mm_set1_epi16(w1 | (w1 + 1) << 8),
                    _mm_set1_epi16(w0 | (w0 + 1) << 8),
                );
                s[k] = _mm256_shuffle_epi8(sh, pick);
            }
            for (i, x) in xs.iter().enumerate() {
                let xq = (x.quants.as_ptr() as *const u8).add(b * 256 + 128 * h);
                let v: [__m256i; 4] = std::array::from_fn(|k| {
                    let xv = load(xq.add(32 * k));
                    let pairs = _mm256_maddubs_epi16(a[k], _mm256_sign_epi8(xv, c[k]));
                    _mm256_madd_epi16(pairs, s[k])
                });
                half[i][h] = reduce4(v[0], v[1], v[2], v[3]);
            }
        }
        let d = _mm256_set1_ps(f16_load(blk.add(208)));
        let t = std::array::from_fn(|i| {
            let isums = _mm256_cvtepi32_ps(_mm256_set_m128i(half[i][1], half[i][0]));
            let dx = _mm256_loadu_ps(xs[i].scales.as_ptr().add(K_SUB * b));
            _mm256_mul_ps(d, _mm256_mul_ps(dx, isums))
        });
        add_ordered(&mut sums, &mut all, t);
    }
    ordered_results(sums, all)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q45_k<const FIVE: bool>(w: &[u8], x: &Q8Vec) -> f32 {
    q45_k::<FIVE, 1, false>(w, [x])[0]
}

/// [`dot_q45_k`] reading ahead in its matrix (a dense mat-vec's rows, [`read_ahead`]).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q45_k_ahead<const FIVE: bool>(w: &[u8], x: &Q8Vec) -> f32 {
    q45_k::<FIVE, 1, true>(w, [x])[0]
}

/// [`dot_q6_k`] reading ahead in its matrix.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k_ahead(w: &[u8], x: &Q8Vec) -> f32 {
    q6_k::<1, true>(w, [x])[0]
}

/// Asks for the lines of a super-block of `bytes` at `blk` [`avx2::AHEAD_BYTES`] ahead.
#[inline(always)]
unsafe fn read_ahead(blk: *const u8, bytes: usize) {
    for line in (0..bytes).step_by(64) {
        avx2::read_ahead(blk.add(line));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k(w: &[u8], x: &Q8Vec) -> f32 {
    q6_k::<1, false>(w, [x])[0]
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn inputs_q45_k<const FIVE: bool>(w: &[u8], xs: &[&Q8Vec], out: &mut [f32]) {
    by_inputs!(xs, out, |N, arr| q45_k::<FIVE, N, false>(w, arr))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn inputs_q6_k(w: &[u8], xs: &[&Q8Vec], out: &mut [f32]) {
    by_inputs!(xs, out, |N, arr| q6_k::<N, false>(w, arr))
}
