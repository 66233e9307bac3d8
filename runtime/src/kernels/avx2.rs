//! Row kernels for x86-64 with AVX2, FMA and F16C (also the `avx512` set's): each result has the
//! portable kernels' bits. Float types: sixteen lane sums of unfused products, added lane after
//! lane as the portable code adds them. Block types: the lane order of [`portable`] (eight 32-bit
//! lanes of exact integer sums, `vpmaddubsw` then `vpmaddwd`, which cannot overflow for these
//! codes; per block one `d_w·d_x`, one multiply and one add into eight float lanes, no fused
//! multiply-add), one row after another so the rows stream through the cache in one sequential
//! read (two to four rows side by side measured 12 % slower on Zen 2: more streams than the
//! prefetcher follows). `axpy`
//! multiplies, then adds, as the portable code does.
//!
//! Loops are bounded by the shorter input; tails run the portable code.

use std::arch::x86_64::*;

use leanstream_format::quant::BLOCK_LEN;

use super::kquant_avx2::q5_codes;
use super::operand::Q8Vec;
use super::portable::{self, Block, Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES};
use super::rows::{Packed, RowKernels, DOT_ROWS, INPUTS, WIDE_INPUTS};

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
        dots_next: Some([
            |r, b, x, o| unsafe { dots_float_next(r, b, x, o, Float::F32) },
            |r, b, x, o| unsafe { dots_float_next(r, b, x, o, Float::F16) },
        ]),
        axpy_next: Some([
            |a, r, b, o| unsafe { axpy_float_next(a, r, b, o, Float::F32) },
            |a, r, b, o| unsafe { axpy_float_next(a, r, b, o, Float::F16) },
        ]),
        more: super::kquant_avx2::table(),
        sign_sum: |bits, q| unsafe { sign_sum(bits, q) },
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

/// [`portable::dot_f32`]'s arithmetic: 16 lane sums (two vectors) of unfused products, added
/// lane after lane, then the tail's products in order, so the same bits.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_float(w: &[u8], x: &[f32], unit: Float) -> f32 {
    let bytes = unit.bytes();
    let n = x.len().min(w.len() / bytes);
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    while i + portable::LANES <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            let j = i + 8 * k;
            let p = _mm256_mul_ps(load8(wp.add(j * bytes), unit), _mm256_loadu_ps(xp.add(j)));
            *a = _mm256_add_ps(*a, p);
        }
        i += portable::LANES;
    }
    let mut lanes = [0.0f32; 16];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
    lanes.iter().sum::<f32>() + float_tail(&w[i * bytes..n * bytes], &x[i..n], unit)
}

/// [`dot_float`]'s tail: the last `n % 16` products, summed in the portable order.
#[inline(always)]
fn float_tail(tw: &[u8], tx: &[f32], unit: Float) -> f32 {
    match unit {
        Float::F32 => portable::float_tail(tw, tx, 4, portable::decode_f32),
        Float::F16 => portable::float_tail(tw, tx, 2, portable::decode_f16),
        Float::Bf16 => portable::float_tail(tw, tx, 2, portable::decode_bf16),
    }
}

/// Rows laid one after another in `rows` (`rb` bytes each) against `x`: `out[j]` has
/// [`dot_float`]'s bits of row `j`. Four rows at a time share `x`'s loads, and their sixteen lane
/// sums are added for the four at once: the lanes transposed, each row's still added in order
/// from the empty sum, where one row alone waits on fifteen dependent scalar additions (a KV
/// cache's 64-value key rows spent most of their time there).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots_float_next(rows: &[u8], rb: usize, x: &[f32], out: &mut [f32], unit: Float) {
    let bytes = unit.bytes();
    let nr = out.len().min(rows.len() / rb.max(1));
    let n = x.len().min(rb / bytes);
    let full = n - n % portable::LANES;
    // Where the portable sum of the lanes starts (`Iterator::sum` of f32 folds from it).
    let empty: f32 = std::iter::empty::<f32>().sum();
    let (rp, xp) = (rows.as_ptr(), x.as_ptr());
    let mut r = 0;
    while r + 4 <= nr {
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        let mut i = 0;
        while i < full {
            let xv = [_mm256_loadu_ps(xp.add(i)), _mm256_loadu_ps(xp.add(i + 8))];
            for (j, a) in acc.iter_mut().enumerate() {
                let wp = rp.add((r + j) * rb + i * bytes);
                for (k, a) in a.iter_mut().enumerate() {
                    let p = _mm256_mul_ps(load8(wp.add(8 * k * bytes), unit), xv[k]);
                    *a = _mm256_add_ps(*a, p);
                }
            }
            i += portable::LANES;
        }
        let mut sums = [0.0f32; 4];
        _mm_storeu_ps(sums.as_mut_ptr(), lane_sums4(&acc, empty));
        for (j, s) in sums.into_iter().enumerate() {
            let row = &rows[(r + j) * rb..(r + j + 1) * rb];
            out[r + j] = s + float_tail(&row[full * bytes..n * bytes], &x[full..n], unit);
        }
        r += 4;
    }
    for (j, o) in out.iter_mut().enumerate().take(nr).skip(r) {
        *o = dot_float(&rows[j * rb..(j + 1) * rb], x, unit);
    }
}

/// Row `j`'s sixteen lanes (`acc[j]`: lanes 0–7, then 8–15) summed in order from `empty`, for the
/// four rows at once: each quarter of the lanes transposed, so that vector `k` holds lane `k` of
/// every row.
#[inline(always)]
unsafe fn lane_sums4(acc: &[[__m256; 2]; 4], empty: f32) -> __m128 {
    let mut s = _mm_set1_ps(empty);
    // Lanes 0–3, 4–7, 8–11, 12–15: (vector, half).
    for (k, h) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
        let v: [__m128; 4] = std::array::from_fn(|j| {
            if h == 0 {
                _mm256_castps256_ps128(acc[j][k])
            } else {
                _mm256_extractf128_ps::<1>(acc[j][k])
            }
        });
        let (t0, t1) = (_mm_unpacklo_ps(v[0], v[1]), _mm_unpacklo_ps(v[2], v[3]));
        let (t2, t3) = (_mm_unpackhi_ps(v[0], v[1]), _mm_unpackhi_ps(v[2], v[3]));
        for lane in [
            _mm_movelh_ps(t0, t1),
            _mm_movehl_ps(t1, t0),
            _mm_movelh_ps(t2, t3),
            _mm_movehl_ps(t3, t2),
        ] {
            s = _mm_add_ps(s, lane);
        }
    }
    s
}

/// `out += Σ a[j]·row_j` for the rows laid one after another in `rows` (`rb` bytes each), with
/// the bits of [`axpy_float`] row after row: 64 outputs at a time stay in registers across all
/// the rows (a KV cache's values: one row per position, where a load and a store of the output
/// per row waited on each other).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_float_next(a: &[f32], rows: &[u8], rb: usize, out: &mut [f32], unit: Float) {
    let bytes = unit.bytes();
    let nr = a.len().min(rows.len() / rb.max(1));
    let n = out.len().min(rb / bytes);
    let (rp, op) = (rows.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + 64 <= n {
        let mut acc: [__m256; 8] = std::array::from_fn(|k| _mm256_loadu_ps(op.add(i + 8 * k)));
        for (j, &a) in a[..nr].iter().enumerate() {
            let av = _mm256_set1_ps(a);
            let wp = rp.add(j * rb + i * bytes);
            for (k, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_add_ps(*acc, _mm256_mul_ps(av, load8(wp.add(8 * k * bytes), unit)));
            }
        }
        for (k, acc) in acc.into_iter().enumerate() {
            _mm256_storeu_ps(op.add(i + 8 * k), acc);
        }
        i += 64;
    }
    while i + 8 <= n {
        let mut acc = _mm256_loadu_ps(op.add(i));
        for (j, &a) in a[..nr].iter().enumerate() {
            let v = load8(rp.add(j * rb + i * bytes), unit);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(a), v));
        }
        _mm256_storeu_ps(op.add(i), acc);
        i += 8;
    }
    if i < n {
        for (j, &a) in a[..nr].iter().enumerate() {
            let tw = &rows[j * rb + i * bytes..j * rb + n * bytes];
            let to = &mut out[i..n];
            match unit {
                Float::F32 => portable::axpy_f32(a, tw, to),
                Float::F16 => portable::axpy_f16(a, tw, to),
                Float::Bf16 => portable::axpy_bf16(a, tw, to),
            }
        }
    }
}

/// `out += a·w` with [`portable::axpy_f32`]'s arithmetic (a product, then a sum).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_float(a: f32, w: &[u8], out: &mut [f32], unit: Float) {
    let bytes = unit.bytes();
    let n = out.len().min(w.len() / bytes);
    let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        let o = op.add(i);
        let p = _mm256_mul_ps(av, load8(wp.add(i * bytes), unit));
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), p));
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
pub(super) unsafe fn f16_load(p: *const u8) -> f32 {
    let h = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// [`f16_load`] of an f16 that two more bytes of its block follow (a block's leading scale, or
/// `Q4_1`'s minimum): one 32-bit load straight into a vector register. Of a 16-bit load the
/// compiler makes an insert into whatever register it picks, keeping that register's other lanes,
/// so the conversion waits on the register's last writer: a chain from block to block when that
/// is an accumulator (a prompt kernel ran at 0.55–0.65× its speed). The empty statement takes the
/// whole register, so it is written whole (`vmovd`, which zeroes the rest) and waits on nothing.
#[inline(always)]
pub(super) unsafe fn f16_lead(p: *const u8) -> f32 {
    let mut v = _mm_cvtsi32_si128((p as *const i32).read_unaligned());
    std::arch::asm!("/* {0} */", inout(xmm_reg) v, options(pure, nomem, nostack, preserves_flags));
    _mm_cvtss_f32(_mm_cvtph_ps(v))
}

/// The f16 scales at the start of eight consecutive blocks (`bytes` apart) from `p`, as f32 lanes.
#[inline(always)]
pub(super) unsafe fn f16_scales8(p: *const u8, bytes: usize) -> __m256 {
    let h = |k: usize| (p.add(k * bytes) as *const i16).read_unaligned();
    _mm256_cvtph_ps(_mm_setr_epi16(
        h(0),
        h(1),
        h(2),
        h(3),
        h(4),
        h(5),
        h(6),
        h(7),
    ))
}

/// Block `b`'s 32 activation quants.
#[inline(always)]
pub(super) unsafe fn x_block(x: &Q8Vec, b: usize) -> __m256i {
    _mm256_loadu_si256(x.quants.as_ptr().add(b * BLOCK_LEN) as *const __m256i)
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

/// The 32-value block types by number (a const parameter; see [`block_kind`]).
pub(super) const Q8_0: u8 = 0;
pub(super) const Q4_0: u8 = 1;
pub(super) const Q4_1: u8 = 2;
pub(super) const Q5_0: u8 = 3;
pub(super) const Q5_1: u8 = 4;

#[inline(always)]
pub(super) const fn block_kind(kind: u8) -> Block {
    match kind {
        Q8_0 => Block::Q8_0,
        Q4_0 => Block::Q4_0,
        Q4_1 => Block::Q4_1,
        Q5_0 => Block::Q5_0,
        _ => Block::Q5_1,
    }
}

/// A block's 32 codes in value order, offset taken off ([`portable`]'s `Block::codes`).
#[inline(always)]
unsafe fn codes<const KIND: u8>(blk: *const u8) -> __m256i {
    match KIND {
        Q8_0 => _mm256_loadu_si256(blk.add(2) as *const __m256i),
        Q4_0 => _mm256_sub_epi8(unpack(blk.add(2)), _mm256_set1_epi8(8)),
        Q4_1 => unpack(blk.add(4)),
        Q5_0 => q5_codes::<true>(blk, 2),
        _ => q5_codes::<false>(blk, 4),
    }
}

/// The eight lane sums of one block against its 32 activation quants `xv` (lane `j`: values
/// `4j..4j + 4`), exact: `vpmaddubsw` multiplies unsigned by signed bytes, so codes that can be
/// negative multiply `|c|` by `x` with `c`'s sign; no pair sum reaches 2¹⁵.
#[inline(always)]
unsafe fn lane_isums<const KIND: u8>(blk: *const u8, xv: __m256i) -> __m256i {
    code_isums::<KIND>(codes::<KIND>(blk), xv)
}

/// [`lane_isums`] of a block's codes `c` ([`codes`]).
#[inline(always)]
unsafe fn code_isums<const KIND: u8>(c: __m256i, xv: __m256i) -> __m256i {
    let p16 = if block_kind(KIND).has_min() {
        _mm256_maddubs_epi16(c, xv)
    } else {
        _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(xv, c))
    };
    _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
}

/// A block's codes as [`input_isums`] takes them, decoded once for several inputs: [`codes`],
/// except that with `VNNI` the 4-bit codes stay unsigned (`Q4_0`'s offset then starts each
/// input's sums, [`Q8Vec::offsets`]).
#[inline(always)]
pub(super) unsafe fn input_codes<const KIND: u8, const VNNI: bool>(blk: *const u8) -> __m256i {
    match (KIND, VNNI) {
        (Q4_0, true) => unpack(blk.add(2)),
        _ => codes::<KIND>(blk),
    }
}

/// Block `b`'s eight exact lane sums against input `x`, from the codes [`input_codes`] gave:
/// with `VNNI` one `vpdpbusd` (the caller's target has AVX-512 VNNI and VL), else
/// [`code_isums`]. The same integers either way.
#[inline(always)]
unsafe fn input_isums<const KIND: u8, const VNNI: bool>(
    c: __m256i,
    x: &Q8Vec,
    b: usize,
) -> __m256i {
    let xv = x_block(x, b);
    if !VNNI {
        return code_isums::<KIND>(c, xv);
    }
    match KIND {
        Q4_0 => _mm256_dpbusd_epi32(
            _mm256_loadu_si256(x.offsets.as_ptr().add(8 * b) as *const __m256i),
            c,
            xv,
        ),
        Q4_1 => _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, xv),
        Q8_0 => _mm256_dpbusd_epi32(
            _mm256_setzero_si256(),
            _mm256_sign_epi8(c, c),
            _mm256_sign_epi8(xv, c),
        ),
        _ => code_isums::<KIND>(c, xv),
    }
}

/// [`portable::lanes_total`] of a vector's eight lanes: the halves added, then the pairs.
#[inline(always)]
pub(super) unsafe fn lanes_total(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)))
}

/// Rows of a 32-value block type against `x`, each with the bits of the portable `dot`
/// ([`portable::block_dots`]), one row after another: a row is read as one sequential stream,
/// which the hardware prefetcher follows (four rows read side by side, sharing the activation's
/// loads, ran at 0.88× this speed on AMD EPYC Zen 2; the `avx512` set, for CPUs with more
/// streams to follow, takes them in pairs: [`rows_dot`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dots_block<const KIND: u8>(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    for (o, w) in out.iter_mut().zip(rows) {
        *o = row_dot::<KIND, false, false>(w, x);
    }
}

/// [`dots_block`] on consecutive rows of one matrix (a dense mat-vec), each block asking for the
/// bytes [`AHEAD_BYTES`] past it ([`read_ahead`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dots_block_ahead<const KIND: u8>(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    for (o, w) in out.iter_mut().zip(rows) {
        *o = row_dot::<KIND, false, true>(w, x);
    }
}

/// How far ahead of the block it reads a mat-vec asks for its rows' bytes: the hardware
/// prefetcher alone left one core's `Q4_0` mat-vec from DRAM at half the bandwidth a plain read
/// reaches (docs/results.md, "Reading ahead").
pub(super) const AHEAD_BYTES: usize = 16 << 10;

/// How often the row groups' kernel asks for its bytes ahead ([`groups_dot_with`]).
const ASK_EVERY: usize = 512;

/// Asks for the cache line [`AHEAD_BYTES`] past `p` (a hint: an address past the matrix is never
/// read, and a prefetch does not fault).
#[inline(always)]
pub(super) unsafe fn read_ahead(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(AHEAD_BYTES) as *const i8);
}

/// Rows in pairs ([`row_dot2`]), an odd last row alone.
#[inline(always)]
pub(super) unsafe fn rows_dot<const KIND: u8, const VNNI: bool, const AHEAD: bool>(
    rows: &[&[u8]],
    x: &Q8Vec,
    out: &mut [f32],
) {
    let n = out.len().min(rows.len());
    let mut i = 0;
    while i + 2 <= n {
        let (a, b) = row_dot2::<KIND, VNNI, AHEAD>(rows[i], rows[i + 1], x);
        out[i] = a;
        out[i + 1] = b;
        i += 2;
    }
    if i < n {
        out[i] = row_dot::<KIND, VNNI, AHEAD>(rows[i], x);
    }
}

/// [`row_dot`] of two rows side by side (two chains of sums, the input's loads shared), each
/// with its own bits.
#[inline(always)]
unsafe fn row_dot2<const KIND: u8, const VNNI: bool, const AHEAD: bool>(
    w0: &[u8],
    w1: &[u8],
    x: &Q8Vec,
) -> (f32, f32) {
    let kind = block_kind(KIND);
    let bytes = kind.bytes();
    if w0.len() != w1.len() {
        return (
            row_dot::<KIND, VNNI, AHEAD>(w0, x),
            row_dot::<KIND, VNNI, AHEAD>(w1, x),
        );
    }
    let nb = (w0.len() / bytes)
        .min(x.scales.len())
        .min(x.sums.len())
        .min(x.quants.len() / BLOCK_LEN)
        .min(x.offsets.len() / 8);
    let (p0, p1, scales, sums) = (w0.as_ptr(), w1.as_ptr(), x.scales.as_ptr(), x.sums.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut mins = [0.0f32; 2];
    let mut dd = [[0.0f32; 8]; 2];
    let mut b = 0;
    while b < nb {
        let group = (nb - b).min(8);
        if group == 8 {
            let dx = _mm256_loadu_ps(scales.add(b));
            for (dd, p) in dd.iter_mut().zip([p0, p1]) {
                _mm256_storeu_ps(
                    dd.as_mut_ptr(),
                    _mm256_mul_ps(f16_scales8(p.add(b * bytes), bytes), dx),
                );
            }
        } else {
            for (dd, p) in dd.iter_mut().zip([p0, p1]) {
                for (k, dd) in dd[..group].iter_mut().enumerate() {
                    *dd = f16_lead(p.add((b + k) * bytes)) * *scales.add(b + k);
                }
            }
        }
        let [d0, d1] = &dd;
        for (k, (d0, d1)) in d0[..group].iter().zip(&d1[..group]).enumerate() {
            for (r, (p, d)) in [(p0, d0), (p1, d1)].into_iter().enumerate() {
                let blk = p.add((b + k) * bytes);
                if AHEAD {
                    read_ahead(blk);
                }
                let lanes = _mm256_cvtepi32_ps(row_isums::<KIND, VNNI>(blk, x, b + k));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_broadcast_ss(d), lanes));
                if kind.has_min() {
                    mins[r] += f16_lead(blk.add(2)) * *sums.add(b + k);
                }
            }
        }
        b += group;
    }
    (lanes_total(acc[0]) + mins[0], lanes_total(acc[1]) + mins[1])
}

/// One row of a 32-value block type against `x`, with the bits of the portable `dot`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_block<const KIND: u8>(w: &[u8], x: &Q8Vec) -> f32 {
    row_dot::<KIND, false, false>(w, x)
}

/// A 4-bit block's 16 nibble bytes as 32 codes in element order: one load into both halves of
/// the vector, the high half shifted right by four, then masked.
#[inline(always)]
unsafe fn unpack_wide(nibbles: *const u8) -> __m256i {
    let n = _mm256_broadcastsi128_si256(_mm_loadu_si128(nibbles as *const __m128i));
    let n = _mm256_srlv_epi64(n, _mm256_setr_epi64x(0, 0, 4, 4));
    _mm256_and_si256(n, _mm256_set1_epi8(0x0f))
}

/// Block `b`'s eight exact lane sums (lane `j`: values `4j..4j + 4`) for the mat-vec rows: the
/// 4-bit codes multiplied unsigned (`Q4_0`'s offset from [`Q8Vec::offsets`]), with one VNNI
/// `vpdpbusd` in place of `vpmaddubsw` and `vpmaddwd` where `VNNI` (the caller's target then has
/// AVX-512 VNNI and VL). The same integers as [`lane_isums`].
#[inline(always)]
unsafe fn row_isums<const KIND: u8, const VNNI: bool>(
    blk: *const u8,
    x: &Q8Vec,
    b: usize,
) -> __m256i {
    let xv = x_block(x, b);
    let (c, start) = match KIND {
        Q4_0 => (
            unpack_wide(blk.add(2)),
            _mm256_loadu_si256(x.offsets.as_ptr().add(8 * b) as *const __m256i),
        ),
        Q4_1 => (unpack_wide(blk.add(4)), _mm256_setzero_si256()),
        Q8_0 => {
            let c = codes::<KIND>(blk);
            let xs = _mm256_sign_epi8(xv, c);
            let c = _mm256_sign_epi8(c, c);
            if VNNI {
                return _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, xs);
            }
            return _mm256_madd_epi16(_mm256_maddubs_epi16(c, xs), _mm256_set1_epi16(1));
        }
        _ => return lane_isums::<KIND>(blk, xv),
    };
    if VNNI {
        _mm256_dpbusd_epi32(start, c, xv)
    } else {
        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(c, xv), _mm256_set1_epi16(1));
        _mm256_add_epi32(p, start)
    }
}

/// One row: per block, the eight lane sums in a vector, converted, multiplied by the broadcast
/// `d_w·d_x` and added to the row's lanes; the minimum's term in a scalar sum.
#[inline(always)]
pub(super) unsafe fn row_dot<const KIND: u8, const VNNI: bool, const AHEAD: bool>(
    w: &[u8],
    x: &Q8Vec,
) -> f32 {
    let kind = block_kind(KIND);
    let bytes = kind.bytes();
    let nb = (w.len() / bytes)
        .min(x.scales.len())
        .min(x.sums.len())
        .min(x.quants.len() / BLOCK_LEN)
        .min(x.offsets.len() / 8);
    let (wp, scales, sums) = (w.as_ptr(), x.scales.as_ptr(), x.sums.as_ptr());
    let mut acc = _mm256_setzero_ps();
    let mut mins = 0.0f32;
    // Eight blocks at a time: their `d_w·d_x` in one vector product (the same products as one
    // at a time), broadcast from memory per block.
    let mut dd = [0.0f32; 8];
    let mut b = 0;
    while b < nb {
        let group = (nb - b).min(8);
        if group == 8 {
            let dx = _mm256_loadu_ps(scales.add(b));
            _mm256_storeu_ps(
                dd.as_mut_ptr(),
                _mm256_mul_ps(f16_scales8(wp.add(b * bytes), bytes), dx),
            );
        } else {
            for (k, dd) in dd[..group].iter_mut().enumerate() {
                *dd = f16_lead(wp.add((b + k) * bytes)) * *scales.add(b + k);
            }
        }
        for (k, dd) in dd[..group].iter().enumerate() {
            let blk = wp.add((b + k) * bytes);
            if AHEAD {
                read_ahead(blk);
            }
            let lanes = _mm256_cvtepi32_ps(row_isums::<KIND, VNNI>(blk, x, b + k));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(dd), lanes));
            if kind.has_min() {
                mins += f16_lead(blk.add(2)) * *sums.add(b + k);
            }
        }
        b += group;
    }
    lanes_total(acc) + mins
}

/// [`super::groups::groups_dot`] of `Q4_0` or `Q4_1` row groups: per block, lane `j` of eight
/// rows in one vector (the rows' four codes of the lane against the input's four values
/// broadcast), so each row keeps the portable order, and its bits.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn groups_dot<const KIND: u8>(data: &[u8], x: &Q8Vec, out: &mut [f32]) {
    groups_dot_with::<KIND, false>(data, x, out)
}

/// [`groups_dot`], with one VNNI `vpdpbusd` per lane where `VNNI` (the caller's target then has
/// AVX-512 VNNI and VL).
///
/// The groups are one sequential stream, asked for [`AHEAD_BYTES`] ahead once per
/// [`ASK_EVERY`] bytes (docs/results.md, "Row groups"): with no requests SmolLM2's small
/// matrices ran 1.3× slower (the hardware prefetcher starts again on each one); one per cache
/// line cost a 7B-wide matrix a sixth of its speed. Two groups side by side, sharing the input's
/// broadcasts, ran at 0.6–0.7× one group's speed.
#[inline(always)]
pub(super) unsafe fn groups_dot_with<const KIND: u8, const VNNI: bool>(
    data: &[u8],
    x: &Q8Vec,
    out: &mut [f32],
) {
    let kind = block_kind(KIND);
    let bytes = kind.bytes();
    let groups = out.len() / 8;
    if groups == 0 {
        return;
    }
    let group_bytes = data.len() / groups;
    let nb = (group_bytes / (8 * bytes))
        .min(x.scales.len())
        .min(x.sums.len())
        .min(x.quants.len() / BLOCK_LEN)
        .min(x.offsets.len() / 8);
    let head = super::groups::head_bytes(kind.has_min());
    let (scales, sums) = (x.scales.as_ptr(), x.sums.as_ptr());
    let (quants, offsets) = (x.quants.as_ptr() as *const i32, x.offsets.as_ptr());
    let mask = _mm256_set1_epi8(0x0f);
    // The next cache line to ask for, as an offset into `data`.
    let mut asked = 0;
    for g in 0..groups {
        let gp = data.as_ptr().add(g * group_bytes);
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut mins = _mm256_setzero_ps();
        for b in 0..nb {
            let blk = gp.add(b * 8 * bytes);
            let end = g * group_bytes + (b + 1) * 8 * bytes;
            while asked < end {
                read_ahead(data.as_ptr().add(asked));
                asked += ASK_EVERY;
            }
            let dd = _mm256_mul_ps(
                _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i)),
                _mm256_set1_ps(*scales.add(b)),
            );
            if kind.has_min() {
                let m = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i));
                mins = _mm256_add_ps(mins, _mm256_mul_ps(m, _mm256_set1_ps(*sums.add(b))));
            }
            if KIND == Q8_0 {
                // Signed codes: their magnitudes against the input's values given their signs.
                for (j, acc) in acc.iter_mut().enumerate() {
                    let c = _mm256_loadu_si256(blk.add(head + 32 * j) as *const __m256i);
                    let xv = _mm256_set1_epi32(quants.add(8 * b + j).read_unaligned());
                    let (a, xs) = (_mm256_sign_epi8(c, c), _mm256_sign_epi8(xv, c));
                    let isums = if VNNI {
                        _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, xs)
                    } else {
                        _mm256_madd_epi16(_mm256_maddubs_epi16(a, xs), _mm256_set1_epi16(1))
                    };
                    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isums)));
                }
                continue;
            }
            for c in 0..4 {
                let v = _mm256_loadu_si256(blk.add(head + 32 * c) as *const __m256i);
                let lo = _mm256_and_si256(v, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
                for (j, codes) in [(c, lo), (c + 4, hi)] {
                    let xv = _mm256_set1_epi32(quants.add(8 * b + j).read_unaligned());
                    let start = match KIND {
                        Q4_0 => _mm256_set1_epi32(*offsets.add(8 * b + j)),
                        _ => _mm256_setzero_si256(),
                    };
                    let isums = if VNNI {
                        _mm256_dpbusd_epi32(start, codes, xv)
                    } else {
                        let p = _mm256_maddubs_epi16(codes, xv);
                        _mm256_add_epi32(_mm256_madd_epi16(p, _mm256_set1_epi16(1)), start)
                    };
                    acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isums)));
                }
            }
        }
        // `lanes_total` of each row, lane by lane across the vectors, then the minimums' sum.
        let s: [__m256; 4] = std::array::from_fn(|i| _mm256_add_ps(acc[i], acc[i + 4]));
        let t = _mm256_add_ps(_mm256_add_ps(s[0], s[2]), _mm256_add_ps(s[1], s[3]));
        _mm256_storeu_ps(out.as_mut_ptr().add(8 * g), _mm256_add_ps(t, mins));
    }
}

/// One row against 1 to [`INPUTS`] inputs (a prompt chunk's tokens): `out[i]` has the bits of
/// [`dot_block`] of the row and `xs[i]`, with the row's codes and scales decoded once per block for
/// every input instead of once per input.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_inputs_block<const KIND: u8>(w: &[u8], xs: &[&Q8Vec], out: &mut [f32]) {
    inputs_by_count::<KIND, false>(w, xs, out)
}

/// [`dot_inputs_block`] by the number of inputs, with VNNI's `vpdpbusd` where `VNNI` (the
/// caller's target then has AVX-512 VNNI and VL).
#[inline(always)]
pub(super) unsafe fn inputs_by_count<const KIND: u8, const VNNI: bool>(
    w: &[u8],
    xs: &[&Q8Vec],
    out: &mut [f32],
) {
    match xs.len().min(out.len()) {
        0 => {}
        1 => out[0] = row_dot::<KIND, VNNI, false>(w, xs[0]),
        2 => inputs_block::<KIND, 2, VNNI>(w, xs, out),
        3 => inputs_block::<KIND, 3, VNNI>(w, xs, out),
        _ => inputs_block::<KIND, INPUTS, VNNI>(w, xs, out),
    }
}

/// [`dot_inputs_block`] for 1 to [`WIDE_INPUTS`] inputs (the 5-bit types'): eight inputs share
/// each block's decoded codes and the row's scales, and five to seven run as eight with the
/// first input repeated, the extra results dropped.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_inputs_wide<const KIND: u8>(w: &[u8], xs: &[&Q8Vec], out: &mut [f32]) {
    let m = xs.len().min(out.len());
    if m <= INPUTS {
        return dot_inputs_block::<KIND>(w, xs, out);
    }
    let padded: [&Q8Vec; WIDE_INPUTS] = std::array::from_fn(|i| xs[if i < m { i } else { 0 }]);
    let mut all = [0.0f32; WIDE_INPUTS];
    inputs_block::<KIND, WIDE_INPUTS, false>(w, &padded, &mut all);
    out[..m].copy_from_slice(&all[..m]);
}

/// [`dot_inputs_block`] of the first `N` inputs.
#[allow(clippy::needless_range_loop)] // block k and input i index several arrays
#[inline(always)]
unsafe fn inputs_block<const KIND: u8, const N: usize, const VNNI: bool>(
    w: &[u8],
    xs: &[&Q8Vec],
    out: &mut [f32],
) {
    let kind = block_kind(KIND);
    let bytes = kind.bytes();
    let xs: [&Q8Vec; N] = std::array::from_fn(|i| xs[i]);
    let nb = xs.iter().fold(w.len() / bytes, |nb, x| {
        nb.min(x.scales.len())
            .min(x.sums.len())
            .min(x.quants.len() / BLOCK_LEN)
            .min(x.offsets.len() / 8)
    });
    let wp = w.as_ptr();
    let mut acc = [_mm256_setzero_ps(); N];
    let mut mins = [0.0f32; N];
    // Eight blocks at a time, their `d_w·d_x` formed for every input in one vector product each
    // (the same products as one at a time) and broadcast from memory per block.
    let mut dd = [[0.0f32; 8]; N];
    let mut b = 0;
    while b < nb {
        let group = (nb - b).min(8);
        if group == 8 {
            let dwv = f16_scales8(wp.add(b * bytes), bytes);
            for i in 0..N {
                let dx = _mm256_loadu_ps(xs[i].scales.as_ptr().add(b));
                _mm256_storeu_ps(dd[i].as_mut_ptr(), _mm256_mul_ps(dwv, dx));
            }
        } else {
            for k in 0..group {
                let d = f16_lead(wp.add((b + k) * bytes));
                for i in 0..N {
                    dd[i][k] = d * *xs[i].scales.get_unchecked(b + k);
                }
            }
        }
        for k in 0..group {
            let blk = wp.add((b + k) * bytes);
            let c = input_codes::<KIND, VNNI>(blk);
            let m = if kind.has_min() {
                f16_lead(blk.add(2))
            } else {
                0.0
            };
            for i in 0..N {
                let x = xs[i];
                let lanes = _mm256_cvtepi32_ps(input_isums::<KIND, VNNI>(c, x, b + k));
                let ddv = _mm256_broadcast_ss(&dd[i][k]);
                acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(ddv, lanes));
                if kind.has_min() {
                    mins[i] += m * *x.sums.get_unchecked(b + k);
                }
            }
        }
        b += group;
    }
    for i in 0..N {
        out[i] = lanes_total(acc[i]) + mins[i];
    }
}

/// [`dot_inputs_block`] with the inputs' scales and sums packed side by side (`p`, made of `xs`):
/// per block one vector multiply gives every input's `d_w·d_x` and one multiply and add every
/// input's minimum term (lane `i` the same operation on the same values as input `i`'s scalar
/// one), instead of a scalar multiply, a broadcast and a multiply-add for each input.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_packed_block<const KIND: u8>(w: &[u8], xs: &[&Q8Vec], p: &Packed, out: &mut [f32]) {
    packed_by_count::<KIND, false>(w, xs, p, out)
}

/// [`dot_packed_block`] by the number of inputs, with VNNI's `vpdpbusd` where `VNNI` (as
/// [`inputs_by_count`]).
#[inline(always)]
pub(super) unsafe fn packed_by_count<const KIND: u8, const VNNI: bool>(
    w: &[u8],
    xs: &[&Q8Vec],
    p: &Packed,
    out: &mut [f32],
) {
    match xs.len().min(out.len()).min(p.inputs) {
        0 => {}
        1 => packed_block::<KIND, 1, VNNI>(w, xs, p, out),
        2 => packed_block::<KIND, 2, VNNI>(w, xs, p, out),
        3 => packed_block::<KIND, 3, VNNI>(w, xs, p, out),
        _ => packed_block::<KIND, INPUTS, VNNI>(w, xs, p, out),
    }
}

/// [`dot_packed_block`] of the first `N` inputs.
#[inline(always)]
unsafe fn packed_block<const KIND: u8, const N: usize, const VNNI: bool>(
    w: &[u8],
    xs: &[&Q8Vec],
    p: &Packed,
    out: &mut [f32],
) {
    let kind = block_kind(KIND);
    let bytes = kind.bytes();
    let xs: [&Q8Vec; N] = std::array::from_fn(|i| xs[i]);
    let nb = xs.iter().fold((w.len() / bytes).min(p.blocks), |nb, x| {
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
    let mut acc = [_mm256_setzero_ps(); N];
    let mut mins = _mm_setzero_ps();
    for b in 0..nb {
        let blk = wp.add(b * bytes);
        let c = input_codes::<KIND, VNNI>(blk);
        // Lane i (of each half): d_w times input i's scale.
        let s = _mm_loadu_ps(sp.add(b * INPUTS));
        let dd = _mm256_mul_ps(_mm256_set1_ps(f16_lead(blk)), _mm256_set_m128(s, s));
        if kind.has_min() {
            let m = _mm_set1_ps(f16_lead(blk.add(2)));
            mins = _mm_add_ps(mins, _mm_mul_ps(m, _mm_loadu_ps(mp.add(b * INPUTS))));
        }
        for (i, acc) in acc.iter_mut().enumerate() {
            let lanes = _mm256_cvtepi32_ps(input_isums::<KIND, VNNI>(c, xs[i], b));
            let ddi = match i {
                0 => _mm256_permute_ps::<0x00>(dd),
                1 => _mm256_permute_ps::<0x55>(dd),
                2 => _mm256_permute_ps::<0xaa>(dd),
                _ => _mm256_permute_ps::<0xff>(dd),
            };
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(ddi, lanes));
        }
    }
    let mut m = [0.0f32; 4];
    _mm_storeu_ps(m.as_mut_ptr(), mins);
    for i in 0..N {
        out[i] = lanes_total(acc[i]) + m[i];
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_q8_0(a: f32, w: &[u8], out: &mut [f32]) {
    let nb = (w.len() / Q8_0_BYTES).min(out.len() / BLOCK_LEN);
    let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
    for b in 0..nb {
        let blk = wp.add(b * Q8_0_BYTES);
        let s = _mm256_set1_ps(a * f16_lead(blk));
        for k in 0..4 {
            let q = _mm_loadl_epi64(blk.add(2 + 8 * k) as *const __m128i);
            let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            let dst = op.add(b * BLOCK_LEN + 8 * k);
            _mm256_storeu_ps(
                dst,
                _mm256_add_ps(_mm256_loadu_ps(dst), _mm256_mul_ps(s, v)),
            );
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
        let s = a * f16_lead(blk);
        let c = if WITH_MIN {
            a * f16_lead(blk.add(2))
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
                let t = _mm256_add_ps(_mm256_mul_ps(sv, v), cv);
                _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), t));
            }
        }
    }
}

/// Whole blocks that `out` and every row hold (each row `bytes` per block).
#[inline(always)]
pub(super) fn common_blocks(rows: &[&[u8]], bytes: usize, out: &[f32]) -> usize {
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
            let s = _mm256_set1_ps(a * f16_lead(blk));
            for (k, acc) in acc.iter_mut().enumerate() {
                let q = _mm_loadl_epi64(blk.add(2 + 8 * k) as *const __m128i);
                let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                *acc = _mm256_add_ps(*acc, _mm256_mul_ps(s, v));
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
            let s = a * f16_lead(blk);
            let c = if WITH_MIN {
                a * f16_lead(blk.add(2))
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
                    *acc = _mm256_add_ps(*acc, _mm256_add_ps(_mm256_mul_ps(sv, v), cv));
                }
            }
        }
        store_block(dst, acc);
    }
}

/// [`super::sketch::sign_sum`] 32 values at a time: each value's bit spread to a byte mask
/// (a byte shuffle, an AND with the bit's place, a compare), the masked codes summed in pairs
/// (`vpmaddubsw` by ones: at most 2·127, no saturation) and in fours (`vpmaddwd`): exact integers.
#[target_feature(enable = "avx2")]
unsafe fn sign_sum(bits: &[u8], q: &[i8]) -> i32 {
    let n = q.len();
    assert!(bits.len() * 8 >= n, "a sign for every value");
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let place = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let (ones8, ones16) = (_mm256_set1_epi8(1), _mm256_set1_epi16(1));
    let mut acc = _mm256_setzero_si256();
    let blocks = n / 32;
    for b in 0..blocks {
        let word = u32::from_le_bytes(bits[4 * b..4 * b + 4].try_into().expect("four bytes"));
        let spread_bits = _mm256_shuffle_epi8(_mm256_set1_epi32(word as i32), spread);
        let mask = _mm256_cmpeq_epi8(_mm256_and_si256(spread_bits, place), place);
        // SAFETY: 32 codes from 32·b lie within `q` (b < n / 32).
        let codes = unsafe { _mm256_loadu_si256(q.as_ptr().add(32 * b).cast()) };
        let pairs = _mm256_maddubs_epi16(ones8, _mm256_and_si256(mask, codes));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones16));
    }
    let lanes: [i32; 8] = std::mem::transmute(acc);
    let tail = super::sketch::sign_sum(&bits[4 * blocks..], &q[32 * blocks..]);
    lanes.iter().sum::<i32>() + tail
}
