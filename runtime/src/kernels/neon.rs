//! Row kernels for aarch64 (NEON is part of the base architecture), in two sets picked at run time:
//!
//! - `neon`: every ARMv8-A core. 4 floats per vector with four accumulators; block types one block
//!   per step, the integer dot product through widening 8-bit multiplies (`smull`) and pairwise
//!   accumulation (`sadalp`): 4 instructions per 16 byte pairs.
//! - `neon-dotprod`: cores with FEAT_DotProd (Cortex-A76 and later: Raspberry Pi 5, recent phones;
//!   `is_aarch64_feature_detected!("dotprod")`). The block types' integer dot product is `sdot`,
//!   which sums four byte products into each 32-bit lane: 1 instruction per 16 byte pairs. The
//!   float types are the `neon` kernels.
//!
//! Rust has no stable `sdot` intrinsic yet (`vdotq_s32` is unstable even in 1.95), so it is one
//! instruction of inline assembly in a function compiled with the `dotprod` feature.
//!
//! `smmla` (FEAT_I8MM) is not used: it multiplies a 2×8 by an 8×2 byte matrix, 32 products, but a
//! batch-1 mat-vec has one activation vector, so half of them would be wasted and it does no more
//! useful work per instruction than `sdot` (it pays for two or more input vectors at once, which
//! here go through `gemm` on decoded rows from 16 tokens up).
//!
//! f16 rows (whose NEON conversion intrinsics need Rust 1.94, past this workspace's minimum) and
//! axpy of the block types use the portable code, which the compiler vectorizes for NEON by itself.
//! Loops are bounded by the shorter input; tails run the portable code.

use std::arch::aarch64::*;
use std::arch::asm;

use leanstream_format::quant::BLOCK_LEN;

use super::operand::Q8Vec;
use super::portable::{self, f16_at, Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES};
use super::rows::{RowKernels, PORTABLE};

/// The plain NEON kernel table.
pub(super) fn kernels() -> RowKernels {
    // SAFETY (every entry): NEON is always present on aarch64; the kernels bound their reads.
    RowKernels {
        isa: "neon",
        dot_f32: |w, x| unsafe { dot_float(w, x, Float::F32) },
        dot_bf16: |w, x| unsafe { dot_float(w, x, Float::Bf16) },
        dot_q8_0: |w, x| unsafe { dot_q8_0::<false>(w, x) },
        dot_q4_0: |w, x| unsafe { dot_q4::<false, false>(w, x) },
        dot_q4_1: |w, x| unsafe { dot_q4::<true, false>(w, x) },
        axpy_f32: |a, w, o| unsafe { axpy_f32(a, w, o) },
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
        dot_q8_0: |w, x| unsafe { dot_q8_0_sdot(w, x) },
        dot_q4_0: |w, x| unsafe { dot_q4_0_sdot(w, x) },
        dot_q4_1: |w, x| unsafe { dot_q4_1_sdot(w, x) },
        ..kernels()
    }
}

#[derive(Clone, Copy)]
enum Float {
    F32,
    Bf16,
}

impl Float {
    fn bytes(self) -> usize {
        match self {
            Float::F32 => 4,
            Float::Bf16 => 2,
        }
    }
}

/// 4 values at `p` as f32.
#[inline(always)]
unsafe fn load4(p: *const u8, unit: Float) -> float32x4_t {
    match unit {
        Float::F32 => vld1q_f32(p as *const f32),
        Float::Bf16 => {
            let h = vmovl_u16(vld1_u16(p as *const u16));
            vreinterpretq_f32_u32(vshlq_n_u32::<16>(h))
        }
    }
}

unsafe fn dot_float(w: &[u8], x: &[f32], unit: Float) -> f32 {
    let bytes = unit.bytes();
    let n = x.len().min(w.len() / bytes);
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [vdupq_n_f32(0.0); 4];
    let mut i = 0;
    while i + 16 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            let j = i + 4 * k;
            *a = vfmaq_f32(*a, load4(wp.add(j * bytes), unit), vld1q_f32(xp.add(j)));
        }
        i += 16;
    }
    let (tw, tx) = (&w[i * bytes..n * bytes], &x[i..n]);
    let tail = match unit {
        Float::F32 => portable::dot_f32(tw, tx),
        Float::Bf16 => portable::dot_bf16(tw, tx),
    };
    vaddvq_f32(vaddq_f32(
        vaddq_f32(acc[0], acc[1]),
        vaddq_f32(acc[2], acc[3]),
    )) + tail
}

unsafe fn axpy_f32(a: f32, w: &[u8], out: &mut [f32]) {
    let n = out.len().min(w.len() / 4);
    let (wp, op) = (w.as_ptr() as *const f32, out.as_mut_ptr());
    let mut i = 0;
    while i + 4 <= n {
        let o = op.add(i);
        vst1q_f32(o, vfmaq_n_f32(vld1q_f32(o), vld1q_f32(wp.add(i)), a));
        i += 4;
    }
    portable::axpy_f32(a, &w[i * 4..n * 4], &mut out[i..n]);
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

/// `Σ w·x` of 32 signed bytes each, as 32-bit lanes: `sdot` when `DOT`, else widening multiplies.
/// (`DOT` is only instantiated inside functions compiled with `dotprod`.)
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

#[inline(always)]
unsafe fn dot_q8_0<const DOT: bool>(w: &[u8], x: &Q8Vec) -> f32 {
    let nb = (w.len() / Q8_0_BYTES).min(x.scales.len());
    let (wp, xq) = (w.as_ptr(), x.quants.as_ptr());
    let mut acc = vdupq_n_f32(0.0);
    for b in 0..nb {
        let blk = wp.add(b * Q8_0_BYTES + 2) as *const i8;
        let q = xq.add(b * BLOCK_LEN);
        let s = isum32::<DOT>(
            [vld1q_s8(blk), vld1q_s8(blk.add(16))],
            [vld1q_s8(q), vld1q_s8(q.add(16))],
        );
        let scale = f16_at(w, b * Q8_0_BYTES) * x.scales[b];
        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), scale);
    }
    vaddvq_f32(acc)
}

/// `Q4_0` (`WITH_MIN` false: offset −8 through the activation sums) or `Q4_1`.
#[inline(always)]
unsafe fn dot_q4<const WITH_MIN: bool, const DOT: bool>(w: &[u8], x: &Q8Vec) -> f32 {
    let (bytes, nib) = if WITH_MIN {
        (Q4_1_BYTES, 4)
    } else {
        (Q4_0_BYTES, 2)
    };
    let nb = (w.len() / bytes).min(x.scales.len());
    let (wp, xq) = (w.as_ptr(), x.quants.as_ptr());
    let low = vdupq_n_u8(0x0f);
    let mut acc = vdupq_n_f32(0.0);
    let mut offsets = 0.0f32;
    for b in 0..nb {
        let n = vld1q_u8(wp.add(b * bytes + nib));
        let codes = [
            vreinterpretq_s8_u8(vandq_u8(n, low)),
            vreinterpretq_s8_u8(vshrq_n_u8::<4>(n)),
        ];
        let q = xq.add(b * BLOCK_LEN);
        let s = isum32::<DOT>(codes, [vld1q_s8(q), vld1q_s8(q.add(16))]);
        let dw = f16_at(w, b * bytes);
        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), dw * x.scales[b]);
        let o = if WITH_MIN {
            f16_at(w, b * bytes + 2)
        } else {
            dw
        };
        offsets += o * x.sums[b];
    }
    vaddvq_f32(acc) + if WITH_MIN { offsets } else { -8.0 * offsets }
}

#[target_feature(enable = "dotprod")]
unsafe fn dot_q8_0_sdot(w: &[u8], x: &Q8Vec) -> f32 {
    dot_q8_0::<true>(w, x)
}

#[target_feature(enable = "dotprod")]
unsafe fn dot_q4_0_sdot(w: &[u8], x: &Q8Vec) -> f32 {
    dot_q4::<false, true>(w, x)
}

#[target_feature(enable = "dotprod")]
unsafe fn dot_q4_1_sdot(w: &[u8], x: &Q8Vec) -> f32 {
    dot_q4::<true, true>(w, x)
}
