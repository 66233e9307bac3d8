//! Row kernels for aarch64 (NEON is part of the base architecture), in two sets picked at run time.
//! Both give the portable kernels' result bit for bit, so an ARM board computes exactly what
//! `LEANSTREAM_KERNELS=portable` computes on any CPU:
//!
//! - `neon`: every ARMv8-A core. The block types' integer dot product through widening 8-bit
//!   multiplies (`smull`) and pairwise accumulation (`sadalp`): 4 instructions per 16 byte pairs.
//! - `neon-dotprod`: cores with FEAT_DotProd (Cortex-A76 and later: Raspberry Pi 5, recent phones;
//!   `is_aarch64_feature_detected!("dotprod")`). The integer dot product is `sdot`, which sums four
//!   byte products into each 32-bit lane: 1 instruction per 16 byte pairs.
//!
//! Why bit for bit: the activation is quantized to q8 before each mat-vec, and rounding is
//! discontinuous, so a last-bit difference in a dot product (another summation order) moves a value
//! across a rounding boundary now and then and the two runs part by a whole quantization step. On
//! the embedded model's q8 file this turned float-order differences of 1e-7 into a 5.4e-4
//! perplexity difference (x86's AVX-512 and portable kernels once differed by as much). So each block's
//! term is computed with the portable code's operations (`d_w·d_x·Σq_w·q_x`, the same roundings,
//! no fused multiply-add), four blocks at a time in vector lanes, and the terms are added one block
//! after another as the portable code adds them. The integer sums are exact whichever instruction
//! forms them. The float types and every `axpy` are the portable code itself (the compiler
//! vectorizes it for NEON; a fused multiply-add would change its bits).
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
use super::portable::{self, f16_at, Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES};
use super::rows::{dots_by_count, RowKernels, DOT_ROWS, PORTABLE};

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
        ..kernels()
    }
}

/// `acc + Σ a·b` of 16 signed byte pairs, four consecutive products summed into each 32-bit lane.
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
#[inline]
unsafe fn sdot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
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

/// `Σ w·x` of 32 signed bytes each, spread over four 32-bit lanes: `sdot` when `DOT`, else
/// widening multiplies. (`DOT` is only instantiated inside functions compiled with `dotprod`.)
#[inline(always)]
unsafe fn isum32<const DOT: bool>(w: [int8x16_t; 2], x: [int8x16_t; 2]) -> int32x4_t {
    let mut acc = vdupq_n_s32(0);
    if DOT {
        for k in 0..2 {
            acc = sdot(acc, w[k], x[k]);
        }
    } else {
        for k in 0..2 {
            acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(w[k]), vget_low_s8(x[k])));
            acc = vpadalq_s16(acc, vmull_high_s8(w[k], x[k]));
        }
    }
    acc
}

/// A block encoding: `d·q` (`Q8_0`), `d·(q − 8)` (`Q4_0`) or `d·q + m` (`Q4_1`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    Q8_0,
    Q4_0,
    Q4_1,
}

impl Block {
    fn bytes(self) -> usize {
        match self {
            Block::Q8_0 => Q8_0_BYTES,
            Block::Q4_0 => Q4_0_BYTES,
            Block::Q4_1 => Q4_1_BYTES,
        }
    }

    /// The block's term in the portable code (`portable::block_*`).
    #[inline(always)]
    fn portable_term(self, blk: &[u8], qx: &[i8], dx: f32, sx: f32) -> f32 {
        match self {
            Block::Q8_0 => portable::block_q8_0(blk, qx, dx),
            Block::Q4_0 => portable::block_q4_0(blk, qx, dx, sx),
            Block::Q4_1 => portable::block_q4_1(blk, qx, dx, sx),
        }
    }

    /// Four blocks' terms, one per lane, each with the operations of [`portable_term`]:
    /// `isum` holds their integer sums, `d`/`m` their scales and minimums, `dx`/`sx` the
    /// activation blocks' scales and scaled sums.
    #[inline(always)]
    unsafe fn terms(
        self,
        isum: int32x4_t,
        d: float32x4_t,
        m: float32x4_t,
        dx: float32x4_t,
        sx: float32x4_t,
    ) -> float32x4_t {
        // `Σq_w·q_x` is at most 32·127·127 in magnitude: exact in f32, as `isum as f32` is.
        let s = vcvtq_f32_s32(isum);
        match self {
            Block::Q8_0 => vmulq_f32(vmulq_f32(d, dx), s),
            Block::Q4_0 => vmulq_f32(d, vsubq_f32(vmulq_f32(dx, s), vmulq_n_f32(sx, 8.0))),
            Block::Q4_1 => vaddq_f32(vmulq_f32(vmulq_f32(d, dx), s), vmulq_f32(m, sx)),
        }
    }
}

/// Block `blk`'s codes (32, as signed bytes) against 32 activation quants `x`: the integer sum
/// over four lanes.
#[inline(always)]
unsafe fn block_isum<const DOT: bool>(kind: Block, blk: *const u8, x: [int8x16_t; 2]) -> int32x4_t {
    let w = match kind {
        Block::Q8_0 => [
            vld1q_s8(blk.add(2) as *const i8),
            vld1q_s8(blk.add(18) as *const i8),
        ],
        Block::Q4_0 | Block::Q4_1 => {
            let n = vld1q_u8(blk.add(if kind == Block::Q4_1 { 4 } else { 2 }));
            // Low nibbles are the block's first 16 values, high nibbles the last 16.
            [
                vreinterpretq_s8_u8(vandq_u8(n, vdupq_n_u8(0x0f))),
                vreinterpretq_s8_u8(vshrq_n_u8::<4>(n)),
            ]
        }
    };
    isum32::<DOT>(w, x)
}

/// The f16 at byte `offset` of each of four consecutive blocks from `b`, as f32 lanes.
#[inline(always)]
unsafe fn f16_lanes(w: &[u8], b: usize, bytes: usize, offset: usize) -> float32x4_t {
    let v: [f32; 4] = std::array::from_fn(|i| f16_at(w, (b + i) * bytes + offset));
    vld1q_f32(v.as_ptr())
}

/// `row · x` for a block-encoded row: bit for bit the portable `dot_q8_0`/`dot_q4_0`/`dot_q4_1`.
#[inline(always)]
unsafe fn block_dot<const DOT: bool>(kind: Block, w: &[u8], x: &Q8Vec) -> f32 {
    block_dots::<DOT, 1>(kind, [w], x)[0]
}

/// [`block_dot`] of `R` rows, each with one row's operations in its order (the same bits), each
/// activation block and its scale and sum loaded once for all of them.
#[inline(always)]
unsafe fn block_dots<const DOT: bool, const R: usize>(
    kind: Block,
    rows: [&[u8]; R],
    x: &Q8Vec,
) -> [f32; R] {
    let bytes = kind.bytes();
    let nb = rows
        .iter()
        .fold(x.scales.len(), |n, w| n.min(w.len() / bytes));
    let xq = x.quants.as_ptr();
    let xblock = |b: usize| {
        let q = xq.add(b * BLOCK_LEN);
        [vld1q_s8(q), vld1q_s8(q.add(16))]
    };
    // The portable code's `Iterator::sum` starts from −0.0 (so a sum of −0.0 terms stays −0.0).
    let mut sums = [-0.0f32; R];
    let mut b = 0;
    while b + 4 <= nb {
        let xs = [xblock(b), xblock(b + 1), xblock(b + 2), xblock(b + 3)];
        let (dx, sx) = (
            vld1q_f32(x.scales.as_ptr().add(b)),
            vld1q_f32(x.sums.as_ptr().add(b)),
        );
        for (w, sum) in rows.iter().zip(&mut sums) {
            let wp = w.as_ptr();
            let isum = |i: usize| block_isum::<DOT>(kind, wp.add((b + i) * bytes), xs[i]);
            // Pairwise adds of the lanes leave block b+i's integer sum in lane i.
            let isum = vpaddq_s32(vpaddq_s32(isum(0), isum(1)), vpaddq_s32(isum(2), isum(3)));
            let m = if kind == Block::Q4_1 {
                f16_lanes(w, b, bytes, 2)
            } else {
                vdupq_n_f32(0.0)
            };
            let terms = kind.terms(isum, f16_lanes(w, b, bytes, 0), m, dx, sx);
            let mut t = [0.0f32; 4];
            vst1q_f32(t.as_mut_ptr(), terms);
            for v in t {
                *sum += v;
            }
        }
        b += 4;
    }
    for (w, sum) in rows.iter().zip(&mut sums) {
        let nw = (w.len() / bytes).min(x.scales.len());
        for b in b..nw {
            *sum += kind.portable_term(
                &w[b * bytes..(b + 1) * bytes],
                &x.quants[b * BLOCK_LEN..],
                x.scales[b],
                x.sums[b],
            );
        }
    }
    sums
}

/// [`block_dots`] on 1 to `DOT_ROWS` rows.
#[inline(always)]
unsafe fn dots<const DOT: bool>(kind: Block, rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots_by_count!(rows, out, |r: R| block_dots::<DOT, R>(kind, r, x))
}

/// [`dots`] through `sdot`.
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
unsafe fn dots_sdot(kind: Block, rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    dots::<true>(kind, rows, x, out)
}

/// [`block_dot`] through `sdot`.
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
unsafe fn dot_sdot(kind: Block, w: &[u8], x: &Q8Vec) -> f32 {
    block_dot::<true>(kind, w, x)
}
