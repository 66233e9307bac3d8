//! Row kernels in plain Rust: the fallback for CPUs without a hand-written path. Loops keep several
//! independent accumulators and integer inner sums so that the compiler can vectorize them for the
//! baseline target.

use half::{bf16, f16};
use leanstream_format::quant::BLOCK_LEN;

use super::operand::Q8Vec;
use super::rows::dots_by_count;

pub(super) const LANES: usize = 16;
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
    acc.iter().sum::<f32>() + float_tail(wc.remainder(), xc.remainder(), unit, decode)
}

/// The last `x.len() % 16` products of [`float_dot`], summed in order (the SIMD kernels end with
/// it, so that their results have its bits).
#[inline(always)]
pub(super) fn float_tail(w: &[u8], x: &[f32], unit: usize, decode: impl Fn(&[u8]) -> f32) -> f32 {
    w.chunks_exact(unit)
        .zip(x)
        .map(|(u, x)| decode(u) * x)
        .sum()
}

pub(super) fn decode_f32(u: &[u8]) -> f32 {
    f32::from_le_bytes([u[0], u[1], u[2], u[3]])
}

pub(super) fn decode_f16(u: &[u8]) -> f32 {
    f16::from_le_bytes([u[0], u[1]]).to_f32()
}

pub(super) fn decode_bf16(u: &[u8]) -> f32 {
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

// The 32-value block types (`Q8_0`, `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`) against q8 activations, in
// the one order every instruction set uses (llama.cpp's shape: no horizontal sum per block):
// - a block's codes `c` are its values' integers with the type's offset taken off (`q − 8` for
//   `Q4_0`, `q − 16` for `Q5_0`), or the raw codes for the types with a minimum (`Q4_1`, `Q5_1`);
// - eight lanes: lane `j` takes `Σ c·q_x` over the block's values `4j..4j + 4` (exact, integer);
// - per block, `dd = d_w·d_x` (one rounding), and each lane `acc_j += dd·lane_j` (a product, then a
//   sum: no fused multiply-add); the types with a minimum add `m_w·sx` to a separate sum `mins`,
//   block after block (`sx = d_x·Σ q_x`, see [`Q8Vec`]);
// - the row's result is [`lanes_total`] of the eight lanes, plus `mins`.
// A SIMD kernel keeps the lanes in one vector and adds a block with one multiply and one add; the
// lane grouping is what `vpmaddubsw` + `vpmaddwd` (AVX2) and `sdot` (NEON) form natively.

/// The lanes of a block type's dot product (see above).
pub(super) const BLOCK_LANES: usize = 8;

/// A 32-value block encoding.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Block {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
}

impl Block {
    /// Bytes per block.
    #[inline(always)]
    pub(super) const fn bytes(self) -> usize {
        match self {
            Block::Q8_0 => Q8_0_BYTES,
            Block::Q4_0 => Q4_0_BYTES,
            Block::Q4_1 => Q4_1_BYTES,
            Block::Q5_0 => Q5_0_BYTES,
            Block::Q5_1 => Q5_1_BYTES,
        }
    }

    /// Whether a value is `d·q + m` (an f16 minimum after the scale) rather than `d·(q − offset)`.
    #[inline(always)]
    pub(super) const fn has_min(self) -> bool {
        matches!(self, Block::Q4_1 | Block::Q5_1)
    }

    /// The block's 32 codes in value order, offset taken off (they fit `i8`: `Q8_0` codes are
    /// stored as `i8`, the others are below 32).
    #[inline(always)]
    pub(super) fn codes(self, blk: &[u8]) -> [i8; BLOCK_LEN] {
        // 4-bit codes: byte `k` holds value `k` (low nibble) and value `k + 16` (high nibble); the
        // 5-bit types keep each value's fifth bit in the little-endian `u32` before the nibbles.
        let (at, qh) = match self {
            Block::Q8_0 => return std::array::from_fn(|k| blk[2 + k] as i8),
            Block::Q4_0 => (2, 0),
            Block::Q4_1 => (4, 0),
            Block::Q5_0 => (6, u32_at(blk, 2)),
            Block::Q5_1 => (8, u32_at(blk, 4)),
        };
        let offset = match self {
            Block::Q4_0 => 8,
            Block::Q5_0 => 16,
            _ => 0,
        };
        std::array::from_fn(|k| {
            let b = blk[at + k % HALF];
            let nibble = if k < HALF { b & 0x0f } else { b >> 4 };
            (nibble | (((qh >> k) & 1) << 4) as u8) as i8 - offset
        })
    }
}

/// The eight lane sums of one block's codes against its 32 activation quants.
#[inline(always)]
pub(super) fn lane_isums(codes: &[i8; BLOCK_LEN], qx: &[i8]) -> [i32; BLOCK_LANES] {
    std::array::from_fn(|j| {
        (4 * j..4 * j + 4)
            .map(|k| codes[k] as i32 * qx[k] as i32)
            .sum()
    })
}

/// The sum of the eight lanes in the fixed order: `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 +
/// a7))` — the halves of a vector added, then its pairs (what a SIMD reduction does cheaply).
#[inline(always)]
pub(super) fn lanes_total(acc: [f32; BLOCK_LANES]) -> f32 {
    let s: [f32; 4] = std::array::from_fn(|i| acc[i] + acc[i + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
}

/// `R` rows of block type `kind` against `x`, each row's blocks in order (the shorter of the row
/// and `x` bounds it).
#[inline(always)]
pub(super) fn block_dots<const R: usize>(kind: Block, rows: [&[u8]; R], x: &Q8Vec) -> [f32; R] {
    let bytes = kind.bytes();
    let nx = x
        .scales
        .len()
        .min(x.sums.len())
        .min(x.quants.len() / BLOCK_LEN);
    rows.map(|w| {
        let mut acc = [0.0f32; BLOCK_LANES];
        let mut mins = 0.0f32;
        for b in 0..(w.len() / bytes).min(nx) {
            let blk = &w[b * bytes..(b + 1) * bytes];
            let dd = f16_at(blk, 0) * x.scales[b];
            let lanes = lane_isums(&kind.codes(blk), &x.quants[b * BLOCK_LEN..][..BLOCK_LEN]);
            for (a, l) in acc.iter_mut().zip(lanes) {
                *a += dd * l as f32;
            }
            if kind.has_min() {
                mins += f16_at(blk, 2) * x.sums[b];
            }
        }
        lanes_total(acc) + mins
    })
}

/// [`block_dots`] of one row.
#[inline(always)]
fn block_dot(kind: Block, w: &[u8], x: &Q8Vec) -> f32 {
    block_dots(kind, [w], x)[0]
}

pub fn dots_q8_0(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| block_dots::<R>(Block::Q8_0, r, x))
}

pub fn dots_q4_0(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| block_dots::<R>(Block::Q4_0, r, x))
}

pub fn dots_q4_1(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| block_dots::<R>(Block::Q4_1, r, x))
}

pub fn dot_q8_0(w: &[u8], x: &Q8Vec) -> f32 {
    block_dot(Block::Q8_0, w, x)
}

pub fn dot_q4_0(w: &[u8], x: &Q8Vec) -> f32 {
    block_dot(Block::Q4_0, w, x)
}

pub fn dot_q4_1(w: &[u8], x: &Q8Vec) -> f32 {
    block_dot(Block::Q4_1, w, x)
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

// The 5-bit types and the K-quants against the same q8 input (blocks of 32, f32 scales). A K-quant
// super-block of 256 values is eight q8 blocks; its integer sums are exact and its float terms are
// added in a fixed order (sub-block by sub-block, the same in every instruction set):
// - `Q4_K`/`Q5_K`, per q8 block `j`: `(d·sc_j)·(d_x·Σ q·q_x) − (dmin·m_j)·sx_j`;
// - `Q6_K`, per q8 block `j` (two 16-value sub-blocks): `d·(d_x·Σ_k sc_k·Σ (q − 32)·q_x)`;
// each super-block's terms summed from 0 in order, the super-blocks' sums added as the 32-value
// types' blocks are.

pub(super) const Q5_0_BYTES: usize = 6 + HALF;
pub(super) const Q5_1_BYTES: usize = 8 + HALF;
pub(super) const Q4_K_BYTES: usize = 144;
pub(super) const Q5_K_BYTES: usize = 176;
pub(super) const Q6_K_BYTES: usize = 210;
/// q8 blocks per K-quant super-block.
pub(super) const K_SUB: usize = 8;

#[inline(always)]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The integer sums `Σ q·q_x` of the eight 32-value sub-blocks of a `Q4_K` (`qh` `None`) or
/// `Q5_K` super-block against its 256 activation quants.
#[inline(always)]
pub(super) fn isums_q45_k(qs: &[u8], qh: Option<&[u8]>, qx: &[i8]) -> [i32; K_SUB] {
    let mut sums = [0i32; K_SUB];
    for (j, s) in sums.iter_mut().enumerate() {
        let group = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        let x = &qx[32 * j..32 * j + 32];
        let shift = 4 * (j % 2);
        *s = match qh {
            None => group
                .iter()
                .zip(x)
                .map(|(b, x)| ((b >> shift) & 0x0f) as i32 * *x as i32)
                .sum(),
            Some(qh) => group
                .iter()
                .zip(&qh[..32])
                .zip(x)
                .map(|((b, h), x)| {
                    (((b >> shift) & 0x0f) | (((h >> j) & 1) << 4)) as i32 * *x as i32
                })
                .sum(),
        };
    }
    sums
}

/// The float part of a `Q4_K`/`Q5_K` super-block's dot from its integer sums (the fixed order
/// every instruction set uses).
#[inline(always)]
pub(super) fn finish_q45_k(blk: &[u8], isums: &[i32; K_SUB], dx: &[f32], sx: &[f32]) -> f32 {
    let d = f16_at(blk, 0);
    let dmin = f16_at(blk, 2);
    let s = &blk[4..16];
    let mut sum = 0.0f32;
    for j in 0..K_SUB {
        let (sc, m) = leanstream_format::quant_k::scale_min_k4(j, s);
        sum += (d * sc as f32) * (dx[j] * isums[j] as f32) - (dmin * m as f32) * sx[j];
    }
    sum
}

/// The integer sums `Σ_k sc_k·Σ (q − 32)·q_x` of a `Q6_K` super-block per 32-value q8 block.
#[inline(always)]
pub(super) fn isums_q6_k(blk: &[u8], qx: &[i8]) -> [i32; K_SUB] {
    let mut sums = [0i32; K_SUB];
    for (j, s) in sums.iter_mut().enumerate() {
        let (h, k) = (j / 4, j % 4);
        let ql = &blk[64 * h + 32 * (k & 1)..][..32];
        let qh = &blk[128 + 32 * h..][..32];
        let x = &qx[32 * j..32 * j + 32];
        let shift = if k < 2 { 0 } else { 4 };
        let mut part = [0i32; 2];
        for (half, p) in part.iter_mut().enumerate() {
            *p = (16 * half..16 * half + 16)
                .map(|l| {
                    let q = ((ql[l] >> shift) & 0x0f) | (((qh[l] >> (2 * k)) & 3) << 4);
                    (q as i32 - 32) * x[l] as i32
                })
                .sum();
        }
        *s = blk[192 + 2 * j] as i8 as i32 * part[0] + blk[193 + 2 * j] as i8 as i32 * part[1];
    }
    sums
}

/// The float part of a `Q6_K` super-block's dot.
#[inline(always)]
pub(super) fn finish_q6_k(blk: &[u8], isums: &[i32; K_SUB], dx: &[f32]) -> f32 {
    let d = f16_at(blk, 208);
    let mut sum = 0.0f32;
    for j in 0..K_SUB {
        sum += d * (dx[j] * isums[j] as f32);
    }
    sum
}

#[inline(always)]
pub(super) fn block_q4_k(blk: &[u8], x: &Q8Vec, b: usize) -> f32 {
    let r = K_SUB * b..K_SUB * (b + 1);
    let isums = isums_q45_k(&blk[16..144], None, &x.quants[BLOCK_LEN * r.start..]);
    finish_q45_k(blk, &isums, &x.scales[r.clone()], &x.sums[r])
}

#[inline(always)]
pub(super) fn block_q5_k(blk: &[u8], x: &Q8Vec, b: usize) -> f32 {
    let r = K_SUB * b..K_SUB * (b + 1);
    let isums = isums_q45_k(
        &blk[48..176],
        Some(&blk[16..48]),
        &x.quants[BLOCK_LEN * r.start..],
    );
    finish_q45_k(blk, &isums, &x.scales[r.clone()], &x.sums[r])
}

#[inline(always)]
pub(super) fn block_q6_k(blk: &[u8], x: &Q8Vec, b: usize) -> f32 {
    let r = K_SUB * b..K_SUB * (b + 1);
    let isums = isums_q6_k(blk, &x.quants[BLOCK_LEN * r.start..]);
    finish_q6_k(blk, &isums, &x.scales[r])
}

/// Super-blocks `from..` of a K-quant row against `x`, their sums added in order.
#[inline(always)]
pub(super) fn kblock_dot(
    w: &[u8],
    x: &Q8Vec,
    from: usize,
    bytes: usize,
    block: impl Fn(&[u8], &Q8Vec, usize) -> f32,
) -> f32 {
    let nb = (w.len() / bytes).min(x.scales.len() / K_SUB);
    (from..nb).map(|b| block(&w[b * bytes..], x, b)).sum()
}

/// [`kblock_dot`] of `R` rows side by side, each with the bits of its own.
#[inline(always)]
pub(super) fn kblock_dots<const R: usize>(
    rows: [&[u8]; R],
    x: &Q8Vec,
    bytes: usize,
    block: impl Fn(&[u8], &Q8Vec, usize) -> f32,
) -> [f32; R] {
    let mut sums = [-0.0f32; R];
    for (sum, w) in sums.iter_mut().zip(rows) {
        let nb = (w.len() / bytes).min(x.scales.len() / K_SUB);
        for b in 0..nb {
            *sum += block(&w[b * bytes..], x, b);
        }
    }
    sums
}

/// A `Q4_K`/`Q5_K` super-block's eight 6-bit scales and eight minimums, unpacked from its 12
/// bytes `s` as [`leanstream_format::quant_k::scale_min_k4`] reads them, as the bytes
/// (little-endian, byte `j` sub-block `j`'s) of two `u64`: `(scales, minimums)`. The SIMD kernels
/// widen them into float lanes.
#[inline(always)]
pub(super) fn scales_mins_k4_bytes(s: &[u8]) -> (u64, u64) {
    const K1: u32 = 0x3f3f_3f3f;
    const K2: u32 = 0x0f0f_0f0f;
    const K3: u32 = 0x0303_0303;
    let (u0, u1, u2) = (u32_at(s, 0), u32_at(s, 4), u32_at(s, 8));
    let sc = (u0 & K1) as u64 | (((u2 & K2) | (((u0 >> 6) & K3) << 4)) as u64) << 32;
    let m = (u1 & K1) as u64 | ((((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4)) as u64) << 32;
    (sc, m)
}

/// Whole super-blocks that the row (`bytes` each) and every input hold.
#[inline(always)]
pub(super) fn super_blocks<const N: usize>(w: &[u8], bytes: usize, xs: &[&Q8Vec; N]) -> usize {
    xs.iter().fold(w.len() / bytes, |nb, x| {
        nb.min(x.scales.len() / K_SUB)
            .min(x.sums.len() / K_SUB)
            .min(x.quants.len() / 256)
    })
}

pub fn dot_q5_0(w: &[u8], x: &Q8Vec) -> f32 {
    block_dot(Block::Q5_0, w, x)
}

pub fn dot_q5_1(w: &[u8], x: &Q8Vec) -> f32 {
    block_dot(Block::Q5_1, w, x)
}

pub fn dot_q4_k(w: &[u8], x: &Q8Vec) -> f32 {
    kblock_dot(w, x, 0, Q4_K_BYTES, block_q4_k)
}

pub fn dot_q5_k(w: &[u8], x: &Q8Vec) -> f32 {
    kblock_dot(w, x, 0, Q5_K_BYTES, block_q5_k)
}

pub fn dot_q6_k(w: &[u8], x: &Q8Vec) -> f32 {
    kblock_dot(w, x, 0, Q6_K_BYTES, block_q6_k)
}

pub fn dots_q5_0(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| block_dots::<R>(Block::Q5_0, r, x))
}

pub fn dots_q5_1(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| block_dots::<R>(Block::Q5_1, r, x))
}

pub fn dots_q4_k(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| kblock_dots::<R>(
        r, x, Q4_K_BYTES, block_q4_k
    ))
}

pub fn dots_q5_k(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| kblock_dots::<R>(
        r, x, Q5_K_BYTES, block_q5_k
    ))
}

pub fn dots_q6_k(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| kblock_dots::<R>(
        r, x, Q6_K_BYTES, block_q6_k
    ))
}

/// `out += s·(q − 16)` (`Q5_0`) or `out += s·q + c` (`Q5_1`) over a 5-bit block.
#[inline(always)]
fn axpy_q5(s: f32, c: Option<f32>, qh: u32, nibbles: &[u8], out: &mut [f32]) {
    let (lo, hi) = out.split_at_mut(HALF);
    for (j, (b, (l, h))) in nibbles.iter().zip(lo.iter_mut().zip(hi)).enumerate() {
        let q0 = (b & 0x0f) as i32 | (((qh >> j) & 1) << 4) as i32;
        let q1 = (b >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32;
        match c {
            None => {
                *l += s * (q0 - 16) as f32;
                *h += s * (q1 - 16) as f32;
            }
            Some(c) => {
                *l += s * q0 as f32 + c;
                *h += s * q1 as f32 + c;
            }
        }
    }
}

pub fn axpy_q5_0(a: f32, w: &[u8], out: &mut [f32]) {
    for (blk, o) in w
        .chunks_exact(Q5_0_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_LEN))
    {
        axpy_q5(a * f16_at(blk, 0), None, u32_at(blk, 2), &blk[6..], o);
    }
}

pub fn axpy_q5_1(a: f32, w: &[u8], out: &mut [f32]) {
    for (blk, o) in w
        .chunks_exact(Q5_1_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_LEN))
    {
        let c = Some(a * f16_at(blk, 2));
        axpy_q5(a * f16_at(blk, 0), c, u32_at(blk, 4), &blk[8..], o);
    }
}

/// `out += (a·d·sc_j)·q + (−a·dmin·m_j)` per sub-block of a `Q4_K`/`Q5_K` row: with `a = 1` the
/// reference decoding's `(d·sc_j)·q − dmin·m_j`, bit for bit.
fn axpy_q45_k(a: f32, w: &[u8], out: &mut [f32], bytes: usize) {
    let five = bytes == Q5_K_BYTES;
    for (blk, o) in w.chunks_exact(bytes).zip(out.chunks_exact_mut(256)) {
        let d = f16_at(blk, 0);
        let dmin = f16_at(blk, 2);
        let (qh, qs) = if five {
            (&blk[16..48], &blk[48..176])
        } else {
            (&blk[..0], &blk[16..144])
        };
        for (j, o) in o.chunks_exact_mut(32).enumerate() {
            let (sc, m) = leanstream_format::quant_k::scale_min_k4(j, &blk[4..16]);
            let s = a * (d * sc as f32);
            let c = -(a * (dmin * m as f32));
            let group = &qs[32 * (j / 2)..32 * (j / 2) + 32];
            let shift = 4 * (j % 2);
            for (l, (o, b)) in o.iter_mut().zip(group).enumerate() {
                let mut q = (b >> shift) & 0x0f;
                if five {
                    q |= ((qh[l] >> j) & 1) << 4;
                }
                *o += s * q as f32 + c;
            }
        }
    }
}

pub fn axpy_q4_k(a: f32, w: &[u8], out: &mut [f32]) {
    axpy_q45_k(a, w, out, Q4_K_BYTES)
}

pub fn axpy_q5_k(a: f32, w: &[u8], out: &mut [f32]) {
    axpy_q45_k(a, w, out, Q5_K_BYTES)
}

/// `out += (a·d·sc_k)·(q − 32)` per 16-value sub-block of a `Q6_K` row.
pub fn axpy_q6_k(a: f32, w: &[u8], out: &mut [f32]) {
    for (blk, o) in w.chunks_exact(Q6_K_BYTES).zip(out.chunks_exact_mut(256)) {
        let d = f16_at(blk, 208);
        for h in 0..2 {
            let ql = &blk[64 * h..64 * h + 64];
            let qh = &blk[128 + 32 * h..128 + 32 * h + 32];
            for k in 0..4 {
                let shift = if k < 2 { 0 } else { 4 };
                for l in 0..32 {
                    let e = 128 * h + 32 * k + l;
                    let s = a * (d * blk[192 + e / 16] as i8 as f32);
                    let q =
                        ((ql[l + 32 * (k & 1)] >> shift) & 0x0f) | (((qh[l] >> (2 * k)) & 3) << 4);
                    o[e] += s * (q as i32 - 32) as f32;
                }
            }
        }
    }
}
