//! Row kernels for aarch64 (NEON is part of the base architecture), in two sets picked at run time.
//! Both give the portable kernels' result bit for bit, so an ARM board computes exactly what
//! `LEANSTREAM_KERNELS=portable` computes on any CPU:
//!
//! - `neon`: every ARMv8-A core. The block types' integer dot product through widening 8-bit
//!   multiplies (`smull`, `smull2`) and two pairwise adds (`saddlp`, `addp`): 5 instructions per 16
//!   byte pairs.
//! - `neon-dotprod`: cores with FEAT_DotProd (Cortex-A76 and later: Raspberry Pi 5, recent phones;
//!   `is_aarch64_feature_detected!("dotprod")`). The integer dot product is `sdot`, which sums four
//!   byte products into each 32-bit lane: 1 instruction per 16 byte pairs.
//!
//! Why bit for bit: the activation is quantized to q8 before each mat-vec, and rounding is
//! discontinuous, so a last-bit difference in a dot product (another summation order) moves a value
//! across a rounding boundary now and then and the two runs part by a whole quantization step. On
//! the embedded model's q8 file this turned float-order differences of 1e-7 into a 5.4e-4
//! perplexity difference (x86's AVX-512 and portable kernels once differed by as much). So the
//! block types follow the portable code's lane order: eight integer lanes of four byte products
//! each (`sdot` forms them natively; the widening multiply pairs them up), per block one
//! `d_w·d_x` (the same rounding), a multiply and an add into eight float lanes (no fused
//! multiply-add), and the lanes summed at the end in [`portable::lanes_total`]'s order. The
//! integer sums are exact whichever instruction
//! forms them. The float types and every `axpy` are the portable code itself (the compiler
//! vectorizes it for NEON; a fused multiply-add would change its bits).
//!
//! Block types: `Q8_0`, `Q4_0`, `Q4_1` (`dot`, `dots`) and the 5-bit `Q5_0`, `Q5_1` (`dot`,
//! `dots`, `dot_inputs` through [`block_inputs`]) here; the K-quants `Q4_K`, `Q5_K`, `Q6_K`
//! (`dot`, `dots`, `dot_inputs`) in [`super::kquant_neon`], which also holds the table that wires
//! the five newer types into both sets. Every one gives the portable bits; the kernel tests check
//! it under qemu on a CPU model with dotprod (`-cpu max`) and one without (`-cpu cortex-a72`).
//!
//! Rust has no stable `sdot` intrinsic yet (`vdotq_s32` is unstable even in 1.95), so it is one
//! instruction of inline assembly in a function compiled with the `dotprod` feature.
//!
//! `smmla` (FEAT_I8MM) is not used: it multiplies a 2×8 by an 8×2 byte matrix, 32 products, but a
//! batch-1 mat-vec has one activation vector, so half of them would be wasted and it does no more
//! useful work per instruction than `sdot` (it pays for two or more input vectors at once, which
//! here go through `gemm` on decoded rows from 16 tokens up).

use std::arch::aarch64::*;
use std::arch::asm;

use leanstream_format::quant::BLOCK_LEN;

use super::operand::Q8Vec;
use super::portable::{self, f16_at};
use super::rows::{by_inputs, dots_by_count, RowKernels, DOT_ROWS, PORTABLE};

/// The plain NEON kernel table.
pub(super) fn kernels() -> RowKernels {
    // SAFETY (every entry): NEON is always present on aarch64; the kernels bound their reads.
    RowKernels {
        isa: "neon",
        dot_q8_0: |w, x| unsafe { block_dot::<false>(Block::Q8_0, w, x) },
        dot_q4_0: |w, x| unsafe { block_dot::<false>(Block::Q4_0, w, x) },
        dot_q4_1: |w, x| unsafe { block_dot::<false>(Block::Q4_1, w, x) },
        dots_q8_0: |r, x, o| unsafe { dots::<false>(Block::Q8_0, r, x, o) },
        dots_q4_0: |r, x, o| unsafe { dots::<false>(Block::Q4_0, r, x, o) },
        dots_q4_1: |r, x, o| unsafe { dots::<false>(Block::Q4_1, r, x, o) },
        dot_rows: DOT_ROWS,
        more: super::kquant_neon::table(),
        ..PORTABLE
    }
}

pub(super) fn dotprod_detected() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

/// The NEON kernel table with `sdot` for the block types.
///
/// # Safety
/// The CPU must have FEAT_DotProd ([`dotprod_detected`]).
pub(super) unsafe fn dotprod_kernels() -> RowKernels {
    // SAFETY (every entry): the caller checked the CPU feature; the kernels bound their reads.
    RowKernels {
        isa: "neon-dotprod",
        dot_q8_0: |w, x| unsafe { dot_sdot(Block::Q8_0, w, x) },
        dot_q4_0: |w, x| unsafe { dot_sdot(Block::Q4_0, w, x) },
        dot_q4_1: |w, x| unsafe { dot_sdot(Block::Q4_1, w, x) },
        dots_q8_0: |r, x, o| unsafe { dots_sdot(Block::Q8_0, r, x, o) },
        dots_q4_0: |r, x, o| unsafe { dots_sdot(Block::Q4_0, r, x, o) },
        dots_q4_1: |r, x, o| unsafe { dots_sdot(Block::Q4_1, r, x, o) },
        more: super::kquant_neon::dotprod_table(),
        ..kernels()
    }
}

/// `acc + Σ a·b` of 16 signed byte pairs, four consecutive products summed into each 32-bit lane.
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
#[inline]
pub(super) unsafe fn sdot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: `sdot` reads and writes registers only; the caller guarantees the CPU runs it.
    asm!(
        "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
        acc = inout(vreg) acc,
        a = in(vreg) a,
        b = in(vreg) b,
        options(pure, nomem, nostack, preserves_flags)
    );
    acc
}

/// The eight lane sums of 32 codes `w` against 32 activation quants `x` ([`portable`]'s lanes:
/// lane `j` sums values `4j..4j + 4`), as two vectors of four: `sdot` when `DOT`, which forms
/// exactly these groups, else widening multiplies and pairwise adds. (`DOT` is only instantiated
/// inside functions compiled with `dotprod`.)
#[inline(always)]
unsafe fn lane_isums<const DOT: bool>(w: [int8x16_t; 2], x: [int8x16_t; 2]) -> [int32x4_t; 2] {
    std::array::from_fn(|h| {
        if DOT {
            sdot(vdupq_n_s32(0), w[h], x[h])
        } else {
            // Products of values 0..8 and 8..16 (|c·x| ≤ 128·127 fits 16 bits), pairs summed,
            // then pairs of pairs.
            let lo = vpaddlq_s16(vmull_s8(vget_low_s8(w[h]), vget_low_s8(x[h])));
            let hi = vpaddlq_s16(vmull_high_s8(w[h], x[h]));
            vpaddq_s32(lo, hi)
        }
    })
}

/// The 32-value block types the NEON kernels take (all of them).
fn block_of(kind: Block) -> portable::Block {
    match kind {
        Block::Q8_0 => portable::Block::Q8_0,
        Block::Q4_0 => portable::Block::Q4_0,
        Block::Q4_1 => portable::Block::Q4_1,
        Block::Q5_0 => portable::Block::Q5_0,
        Block::Q5_1 => portable::Block::Q5_1,
    }
}

/// A block encoding: `d·q` (`Q8_0`), `d·(q − 8)` (`Q4_0`), `d·q + m` (`Q4_1`), `d·(q − 16)`
/// (`Q5_0`) or `d·q + m` with 5-bit `q` (`Q5_1`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Block {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
}

/// Block `blk`'s 32 codes in value order, offset taken off (`portable::Block::codes`).
#[inline(always)]
unsafe fn codes(kind: Block, blk: *const u8) -> [int8x16_t; 2] {
    match kind {
        Block::Q8_0 => [
            vld1q_s8(blk.add(2) as *const i8),
            vld1q_s8(blk.add(18) as *const i8),
        ],
        Block::Q4_0 | Block::Q4_1 => {
            let n = vld1q_u8(blk.add(if kind == Block::Q4_1 { 4 } else { 2 }));
            // Low nibbles are the block's first 16 values, high nibbles the last 16.
            let c = [
                vreinterpretq_s8_u8(vandq_u8(n, vdupq_n_u8(0x0f))),
                vreinterpretq_s8_u8(vshrq_n_u8::<4>(n)),
            ];
            if kind == Block::Q4_0 {
                c.map(|c| vsubq_s8(c, vdupq_n_s8(8)))
            } else {
                c
            }
        }
        Block::Q5_0 | Block::Q5_1 => {
            // The fifth bits: the little-endian `u32` at 2 (`Q5_0`) or 4 (`Q5_1`), bit `k` value
            // `k`'s, before the 16 nibble bytes (low nibbles values 0..16, high nibbles 16..32).
            let at = if kind == Block::Q5_1 { 4 } else { 2 };
            let qh =
                vreinterpretq_u8_u32(vdupq_n_u32((blk.add(at) as *const u32).read_unaligned()));
            let n = vld1q_u8(blk.add(at + 4));
            let nib = [vandq_u8(n, vdupq_n_u8(0x0f)), vshrq_n_u8::<4>(n)];
            // Byte `k` of half `h` 0xff where bit `16h + k` is set: qh's byte `2h + k / 8`
            // spread over eight lanes, tested against bit `k % 8`.
            let bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040_2010_0804_0201));
            let spread = [
                vcombine_u8(vdup_n_u8(0), vdup_n_u8(1)),
                vcombine_u8(vdup_n_u8(2), vdup_n_u8(3)),
            ];
            std::array::from_fn(|h| {
                let set = vtstq_u8(vqtbl1q_u8(qh, spread[h]), bit);
                let high = if kind == Block::Q5_0 {
                    // `q − 16` as `i8` in one operation: 0xf0 or'd in where the bit is clear.
                    vbicq_u8(vdupq_n_u8(0xf0), set)
                } else {
                    vandq_u8(set, vdupq_n_u8(0x10))
                };
                vreinterpretq_s8_u8(vorrq_u8(nib[h], high))
            })
        }
    }
}

/// `row · x` for a block-encoded row: bit for bit the portable `dot_q8_0`/`dot_q4_0`/`dot_q4_1`.
#[inline(always)]
pub(super) unsafe fn block_dot<const DOT: bool>(kind: Block, w: &[u8], x: &Q8Vec) -> f32 {
    block_dots::<DOT, 1>(kind, [w], x)[0]
}

/// One row's running sum against one input: the eight float lanes (two vectors) and the
/// minimum's terms (a scalar sum).
#[derive(Clone, Copy)]
struct RowSum {
    acc: [float32x4_t; 2],
    mins: f32,
}

impl RowSum {
    #[inline(always)]
    unsafe fn zero() -> Self {
        RowSum {
            acc: [vdupq_n_f32(0.0); 2],
            mins: 0.0,
        }
    }

    /// Adds block `b` (its bytes `blk`, its codes `c`) against input `x` (its block's quants
    /// `xs`): the eight lane sums converted, multiplied by `d_w·d_x` and added to the lanes; the
    /// minimum's term `m_w·sx` to `mins`.
    #[inline(always)]
    unsafe fn add<const DOT: bool>(
        &mut self,
        kind: Block,
        blk: &[u8],
        c: [int8x16_t; 2],
        xs: [int8x16_t; 2],
        x: &Q8Vec,
        b: usize,
    ) {
        let lanes = lane_isums::<DOT>(c, xs);
        let dd = vdupq_n_f32(f16_at(blk, 0) * x.scales[b]);
        for (a, l) in self.acc.iter_mut().zip(lanes) {
            *a = vaddq_f32(*a, vmulq_f32(dd, vcvtq_f32_s32(l)));
        }
        if block_of(kind).has_min() {
            self.mins += f16_at(blk, 2) * x.sums[b];
        }
    }

    /// The lanes in [`portable::lanes_total`]'s order (halves, then pairs), plus `mins`.
    #[inline(always)]
    unsafe fn total(self) -> f32 {
        let s = vaddq_f32(self.acc[0], self.acc[1]);
        let t = vadd_f32(vget_low_f32(s), vget_high_f32(s));
        (vget_lane_f32::<0>(t) + vget_lane_f32::<1>(t)) + self.mins
    }
}

/// Block `b`'s 32 quants of input `x`.
#[inline(always)]
unsafe fn xblock(x: &Q8Vec, b: usize) -> [int8x16_t; 2] {
    let q = x.quants.as_ptr().add(b * BLOCK_LEN);
    [vld1q_s8(q), vld1q_s8(q.add(16))]
}

/// Whole blocks that input `x` holds.
#[inline(always)]
fn x_blocks(x: &Q8Vec) -> usize {
    x.scales
        .len()
        .min(x.sums.len())
        .min(x.quants.len() / BLOCK_LEN)
}

/// [`block_dot`] of `R` rows, each with one row's operations in its order (the same bits), each
/// activation block and its scale loaded once for all of them ([`RowSum`]).
#[inline(always)]
unsafe fn block_dots<const DOT: bool, const R: usize>(
    kind: Block,
    rows: [&[u8]; R],
    x: &Q8Vec,
) -> [f32; R] {
    let bytes = block_of(kind).bytes();
    let nx = x_blocks(x);
    let nb = rows.iter().fold(nx, |n, w| n.min(w.len() / bytes));
    let mut sums = [RowSum::zero(); R];
    let step = |sum: &mut RowSum, w: &[u8], b: usize, xs| {
        let blk = &w[b * bytes..(b + 1) * bytes];
        sum.add::<DOT>(kind, blk, codes(kind, blk.as_ptr()), xs, x, b);
    };
    for b in 0..nb {
        let xs = xblock(x, b);
        for r in 0..R {
            step(&mut sums[r], rows[r], b, xs);
        }
    }
    // Rows longer than the shortest (a caller's mistake the dispatcher asserts against) finish
    // alone.
    for r in 0..R {
        for b in nb..(rows[r].len() / bytes).min(nx) {
            step(&mut sums[r], rows[r], b, xblock(x, b));
        }
    }
    sums.map(|s| s.total())
}

/// One row against `N` inputs, each result [`block_dot`]'s bits: each block's codes decoded once
/// for all of them ([`RowSum`] per input). The blocks every input holds.
#[inline(always)]
unsafe fn block_inputs<const DOT: bool, const N: usize>(
    kind: Block,
    w: &[u8],
    xs: [&Q8Vec; N],
) -> [f32; N] {
    let bytes = block_of(kind).bytes();
    let nb = xs.iter().fold(w.len() / bytes, |n, x| n.min(x_blocks(x)));
    let mut sums = [RowSum::zero(); N];
    for b in 0..nb {
        let blk = &w[b * bytes..(b + 1) * bytes];
        let c = codes(kind, blk.as_ptr());
        for (sum, x) in sums.iter_mut().zip(xs) {
            sum.add::<DOT>(kind, blk, c, xblock(x, b), x, b);
        }
    }
    sums.map(|s| s.total())
}

/// [`block_inputs`] on 1 to [`super::WIDE_INPUTS`] inputs.
#[inline(always)]
pub(super) unsafe fn inputs<const DOT: bool>(
    kind: Block,
    w: &[u8],
    xs: &[&Q8Vec],
    out: &mut [f32],
) {
    by_inputs!(xs, out, |N, arr| block_inputs::<DOT, N>(kind, w, arr))
}

/// [`inputs`] through `sdot`.
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
pub(super) unsafe fn inputs_sdot(kind: Block, w: &[u8], xs: &[&Q8Vec], out: &mut [f32]) {
    inputs::<true>(kind, w, xs, out)
}

/// [`block_dots`] on 1 to `DOT_ROWS` rows.
#[inline(always)]
pub(super) unsafe fn dots<const DOT: bool>(
    kind: Block,
    rows: &[&[u8]],
    x: &Q8Vec,
    out: &mut [f32],
) {
    dots_by_count!(rows, out, |r: R| block_dots::<DOT, R>(kind, r, x))
}

/// [`dots`] through `sdot`.
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
pub(super) unsafe fn dots_sdot(kind: Block, rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots::<true>(kind, rows, x, out)
}

/// [`block_dot`] through `sdot`.
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
pub(super) unsafe fn dot_sdot(kind: Block, w: &[u8], x: &Q8Vec) -> f32 {
    block_dot::<true>(kind, w, x)
}
