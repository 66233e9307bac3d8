//! Row kernels in plain Rust: the fallback for CPUs without a hand-written path. Loops keep several
//! independent accumulators and integer inner sums so that the compiler can vectorize them for the
//! baseline target.

use half::{bf16, f16};
use leanstream_format::quant::BLOCK_LEN;

use super::operand::Q8Vec;
use super::rows::dots_by_count;

const LANES: usize = 16;
const HALF: usize = BLOCK_LEN / 2;
pub(super) const Q8_0_BYTES: usize = 2 + BLOCK_LEN;
pub(super) const Q4_0_BYTES: usize = 2 + HALF;
pub(super) const Q4_1_BYTES: usize = 4 + HALF;

#[inline(always)]
pub(super) fn f16_at(bytes: &[u8], offset: usize) -> f32 {
    f16::from_le_bytes([bytes[offset], bytes[offset + 1]]).to_f32()
}

#[inline(always)]
fn float_dot(w: &[u8], x: &[f32], unit: usize, decode: impl Fn(&[u8]) -> f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut wc = w.chunks_exact(unit * LANES);
    let mut xc = x.chunks_exact(LANES);
    for (wb, xb) in (&mut wc).zip(&mut xc) {
        for i in 0..LANES {
            acc[i] += decode(&wb[i * unit..]) * xb[i];
        }
    }
    let tail: f32 = wc
        .remainder()
        .chunks_exact(unit)
        .zip(xc.remainder())
        .map(|(u, x)| decode(u) * x)
        .sum();
    acc.iter().sum::<f32>() + tail
}

fn decode_f32(u: &[u8]) -> f32 {
    f32::from_le_bytes([u[0], u[1], u[2], u[3]])
}

fn decode_f16(u: &[u8]) -> f32 {
    f16::from_le_bytes([u[0], u[1]]).to_f32()
}

fn decode_bf16(u: &[u8]) -> f32 {
    bf16::from_le_bytes([u[0], u[1]]).to_f32()
}

pub fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    float_dot(w, x, 4, decode_f32)
}

pub fn dot_f16(w: &[u8], x: &[f32]) -> f32 {
    float_dot(w, x, 2, decode_f16)
}

pub fn dot_bf16(w: &[u8], x: &[f32]) -> f32 {
    float_dot(w, x, 2, decode_bf16)
}

/// `Σ q_w·q_x` of one 4-bit block's codes (0..15, no offset) against 32 activation quants.
#[inline(always)]
fn isum_q4(nibbles: &[u8], qx: &[i8]) -> i32 {
    let (lo, hi) = qx.split_at(HALF);
    nibbles
        .iter()
        .zip(lo.iter().zip(hi))
        .map(|(b, (l, h))| (b & 0x0f) as i32 * *l as i32 + (b >> 4) as i32 * *h as i32)
        .sum()
}

/// One `Q8_0` block times 32 activation quants of scale `dx`.
#[inline(always)]
pub(super) fn block_q8_0(blk: &[u8], qx: &[i8], dx: f32) -> f32 {
    let isum: i32 = blk[2..Q8_0_BYTES]
        .iter()
        .zip(qx)
        .map(|(w, x)| (*w as i8 as i32) * (*x as i32))
        .sum();
    f16_at(blk, 0) * dx * isum as f32
}

/// One `Q4_0` block: `d_w·(d_x·Σ q_w·q_x − 8·sx)` with `sx = d_x·Σ q_x` (the −8 offset folded into
/// the activation's precomputed sum).
#[inline(always)]
pub(super) fn block_q4_0(blk: &[u8], qx: &[i8], dx: f32, sx: f32) -> f32 {
    f16_at(blk, 0) * (dx * isum_q4(&blk[2..Q4_0_BYTES], qx) as f32 - 8.0 * sx)
}

/// One `Q4_1` block: `d_w·d_x·Σ q_w·q_x + m_w·sx`.
#[inline(always)]
pub(super) fn block_q4_1(blk: &[u8], qx: &[i8], dx: f32, sx: f32) -> f32 {
    f16_at(blk, 0) * dx * isum_q4(&blk[4..Q4_1_BYTES], qx) as f32 + f16_at(blk, 2) * sx
}

/// Blocks `from..` of a block-encoded row against `x` (`block` is one of the above, `bytes` its size).
#[inline(always)]
pub(super) fn block_dot(
    w: &[u8],
    x: &Q8Vec,
    from: usize,
    bytes: usize,
    block: impl Fn(&[u8], &[i8], f32, f32) -> f32,
) -> f32 {
    let nb = (w.len() / bytes).min(x.scales.len());
    (from..nb)
        .map(|b| {
            block(
                &w[b * bytes..],
                &x.quants[b * BLOCK_LEN..],
                x.scales[b],
                x.sums[b],
            )
        })
        .sum()
}

/// [`block_dot`] of `R` rows from block 0, block by block with each row's sum beside the others':
/// each row's terms added in the same order, from the same start (`Iterator::sum` of f32 starts
/// at −0.0), so each result has the bits of [`block_dot`] of its row alone.
#[inline(always)]
pub(super) fn block_dots<const R: usize>(
    rows: [&[u8]; R],
    x: &Q8Vec,
    bytes: usize,
    block: impl Fn(&[u8], &[i8], f32, f32) -> f32,
) -> [f32; R] {
    let nb = rows
        .iter()
        .fold(x.scales.len(), |n, w| n.min(w.len() / bytes));
    let mut sums = [-0.0f32; R];
    for b in 0..nb {
        let (q, d, s) = (&x.quants[b * BLOCK_LEN..], x.scales[b], x.sums[b]);
        for (sum, w) in sums.iter_mut().zip(rows) {
            *sum += block(&w[b * bytes..], q, d, s);
        }
    }
    // Rows longer than the shortest (a caller's mistake: the dispatcher asserts equal lengths)
    // finish alone.
    for (sum, w) in sums.iter_mut().zip(rows) {
        let nw = (w.len() / bytes).min(x.scales.len());
        for b in nb..nw {
            *sum += block(
                &w[b * bytes..],
                &x.quants[b * BLOCK_LEN..],
                x.scales[b],
                x.sums[b],
            );
        }
    }
    sums
}

/// `heads[r]` (a SIMD kernel's sum of row `r`'s first `from` blocks) plus the row's `Q8_0` blocks
/// from `from` on, as [`block_dot`] adds them. (Plain loops: `array::from_fn`'s closure was not
/// inlined into the kernels, 4 % of a profile.)
#[inline(always)]
pub(super) fn q8_0_tails<const R: usize>(
    mut heads: [f32; R],
    rows: [&[u8]; R],
    x: &Q8Vec,
    from: usize,
) -> [f32; R] {
    for (h, w) in heads.iter_mut().zip(rows) {
        *h += block_dot(w, x, from, Q8_0_BYTES, |blk, q, d, _| block_q8_0(blk, q, d));
    }
    heads
}

pub fn dots_q8_0(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| block_dots::<R>(
        r,
        x,
        Q8_0_BYTES,
        |b, q, d, _| { block_q8_0(b, q, d) }
    ))
}

pub fn dots_q4_0(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| block_dots::<R>(
        r, x, Q4_0_BYTES, block_q4_0
    ))
}

pub fn dots_q4_1(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| block_dots::<R>(
        r, x, Q4_1_BYTES, block_q4_1
    ))
}

pub fn dot_q8_0(w: &[u8], x: &Q8Vec) -> f32 {
    block_dot(w, x, 0, Q8_0_BYTES, |b, q, d, _| block_q8_0(b, q, d))
}

pub fn dot_q4_0(w: &[u8], x: &Q8Vec) -> f32 {
    block_dot(w, x, 0, Q4_0_BYTES, block_q4_0)
}

pub fn dot_q4_1(w: &[u8], x: &Q8Vec) -> f32 {
    block_dot(w, x, 0, Q4_1_BYTES, block_q4_1)
}

#[inline(always)]
fn float_axpy(a: f32, w: &[u8], out: &mut [f32], unit: usize, decode: impl Fn(&[u8]) -> f32) {
    for (o, u) in out.iter_mut().zip(w.chunks_exact(unit)) {
        *o += a * decode(u);
    }
}

pub fn axpy_f32(a: f32, w: &[u8], out: &mut [f32]) {
    float_axpy(a, w, out, 4, decode_f32)
}

pub fn axpy_f16(a: f32, w: &[u8], out: &mut [f32]) {
    float_axpy(a, w, out, 2, decode_f16)
}

pub fn axpy_bf16(a: f32, w: &[u8], out: &mut [f32]) {
    float_axpy(a, w, out, 2, decode_bf16)
}

pub fn axpy_q8_0(a: f32, w: &[u8], out: &mut [f32]) {
    for (blk, o) in w
        .chunks_exact(Q8_0_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_LEN))
    {
        let s = a * f16_at(blk, 0);
        for (o, q) in o.iter_mut().zip(&blk[2..]) {
            *o += s * (*q as i8) as f32;
        }
    }
}

/// `out += s·q + c` over a 4-bit block's 32 codes.
#[inline(always)]
fn axpy_nibbles(s: f32, c: f32, nibbles: &[u8], out: &mut [f32]) {
    let (lo, hi) = out.split_at_mut(HALF);
    for (b, (l, h)) in nibbles.iter().zip(lo.iter_mut().zip(hi)) {
        *l += s * (b & 0x0f) as f32 + c;
        *h += s * (b >> 4) as f32 + c;
    }
}

pub fn axpy_q4_0(a: f32, w: &[u8], out: &mut [f32]) {
    for (blk, o) in w
        .chunks_exact(Q4_0_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_LEN))
    {
        let s = a * f16_at(blk, 0);
        axpy_nibbles(s, -8.0 * s, &blk[2..], o);
    }
}

pub fn axpy_q4_1(a: f32, w: &[u8], out: &mut [f32]) {
    for (blk, o) in w
        .chunks_exact(Q4_1_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_LEN))
    {
        axpy_nibbles(a * f16_at(blk, 0), a * f16_at(blk, 2), &blk[4..], o);
    }
}
