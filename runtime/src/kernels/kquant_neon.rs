//! NEON kernels of the 5-bit types and the K-quants (`Q5_0` … `Q6_K`), for the `neon` and
//! `neon-dotprod` sets, each giving the portable kernel's bits:
//!
//! - `Q5_0`, `Q5_1`: the 32-value block kernels of [`super::neon`] (`dot`, `dots` of up to four
//!   rows), their codes with the fifth bit or'd in from a byte-spread mask (`tbl` + `cmtst`).
//! - `Q4_K`, `Q5_K`, `Q6_K`: a super-block's 256 codes decoded into sixteen vectors once (for
//!   every input of a `dot_inputs`, up to [`WIDE_INPUTS`]); per input the eight q8 blocks'
//!   integer sums (`sdot`, or widening multiplies `smull`/`smull2` and pairwise adds `sadalp`;
//!   for `Q6_K` each 16-value half times its scale, `mul`/`mla`), exact in any order, gathered
//!   into two vectors by pairwise adds (`addp`). The float terms of the portable finish
//!   ([`super::portable::finish_q45_k`], [`super::portable::finish_q6_k`]) are formed in eight
//!   float lanes with its operations (multiplies and a subtraction, no fused multiply-add), then
//!   added in its order (`0 + t_0 + … + t_7`, scalar), and the super-blocks' sums in order.
//!
//! The super-block's `d` (and `dmin`) are converted from f16 by `fcvtl` (exact, the values of the
//! portable `f16_at`). The compiled loop of `neon-dotprod`'s `dot` is 129 instructions per
//! super-block for `Q4_K`, 169 for `Q5_K` and 211 for `Q6_K` (16 `sdot` each; counted in the
//! disassembly of the release build). The portable code is partly vectorized by the compiler; its
//! instruction count per super-block was not measured, and no speed is claimed (no ARM hardware).
//! `axpy` stays portable (compiler-vectorized; its bits).

use std::arch::aarch64::*;
use std::arch::asm;

use super::neon::{self, Block};
use super::operand::Q8Vec;
use super::portable::{
    scales_mins_k4_bytes, super_blocks, K_SUB, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES,
};
use super::rows::{by_inputs, each_row, MoreKernels, PORTABLE_MORE, WIDE_INPUTS};

/// The K-quant kinds, as const parameters.
const Q4_K: u8 = 0;
const Q5_K: u8 = 1;
const Q6_K: u8 = 2;

/// The plain NEON table (every ARMv8-A core).
pub(super) fn table() -> MoreKernels {
    // SAFETY (every entry): NEON is always present on aarch64; the kernels bound their reads.
    MoreKernels {
        dot: [
            |w, x| unsafe { neon::block_dot::<false>(Block::Q5_0, w, x) },
            |w, x| unsafe { neon::block_dot::<false>(Block::Q5_1, w, x) },
            |w, x| unsafe { kquant::<false, Q4_K, 1>(w, [x])[0] },
            |w, x| unsafe { kquant::<false, Q5_K, 1>(w, [x])[0] },
            |w, x| unsafe { kquant::<false, Q6_K, 1>(w, [x])[0] },
        ],
        dots: [
            |r, x, o| unsafe { neon::dots::<false>(Block::Q5_0, r, x, o) },
            |r, x, o| unsafe { neon::dots::<false>(Block::Q5_1, r, x, o) },
            |r, x, o| {
                each_row(r, x, o, |w, x| unsafe {
                    kquant::<false, Q4_K, 1>(w, [x])[0]
                })
            },
            |r, x, o| {
                each_row(r, x, o, |w, x| unsafe {
                    kquant::<false, Q5_K, 1>(w, [x])[0]
                })
            },
            |r, x, o| {
                each_row(r, x, o, |w, x| unsafe {
                    kquant::<false, Q6_K, 1>(w, [x])[0]
                })
            },
        ],
        inputs: [
            Some(|w, xs, o| unsafe { neon::inputs::<false>(Block::Q5_0, w, xs, o) }),
            Some(|w, xs, o| unsafe { neon::inputs::<false>(Block::Q5_1, w, xs, o) }),
            Some(|w, xs, o| unsafe { inputs::<false, Q4_K>(w, xs, o) }),
            Some(|w, xs, o| unsafe { inputs::<false, Q5_K>(w, xs, o) }),
            Some(|w, xs, o| unsafe { inputs::<false, Q6_K>(w, xs, o) }),
        ],
        inputs_width: [WIDE_INPUTS; 5],
        dots_ahead: PORTABLE_MORE.dots_ahead,
        axpy: PORTABLE_MORE.axpy,
    }
}

/// The table with `sdot` (FEAT_DotProd).
///
/// # Safety
/// The CPU must have FEAT_DotProd ([`neon::dotprod_detected`]).
pub(super) unsafe fn dotprod_table() -> MoreKernels {
    // SAFETY (every entry): the caller checked the CPU feature; the kernels bound their reads.
    MoreKernels {
        dot: [
            |w, x| unsafe { neon::dot_sdot(Block::Q5_0, w, x) },
            |w, x| unsafe { neon::dot_sdot(Block::Q5_1, w, x) },
            |w, x| unsafe { dot_sdot::<Q4_K>(w, x) },
            |w, x| unsafe { dot_sdot::<Q5_K>(w, x) },
            |w, x| unsafe { dot_sdot::<Q6_K>(w, x) },
        ],
        dots: [
            |r, x, o| unsafe { neon::dots_sdot(Block::Q5_0, r, x, o) },
            |r, x, o| unsafe { neon::dots_sdot(Block::Q5_1, r, x, o) },
            |r, x, o| unsafe { dots_sdot::<Q4_K>(r, x, o) },
            |r, x, o| unsafe { dots_sdot::<Q5_K>(r, x, o) },
            |r, x, o| unsafe { dots_sdot::<Q6_K>(r, x, o) },
        ],
        inputs: [
            Some(|w, xs, o| unsafe { neon::inputs_sdot(Block::Q5_0, w, xs, o) }),
            Some(|w, xs, o| unsafe { neon::inputs_sdot(Block::Q5_1, w, xs, o) }),
            Some(|w, xs, o| unsafe { inputs_sdot::<Q4_K>(w, xs, o) }),
            Some(|w, xs, o| unsafe { inputs_sdot::<Q5_K>(w, xs, o) }),
            Some(|w, xs, o| unsafe { inputs_sdot::<Q6_K>(w, xs, o) }),
        ],
        ..table()
    }
}

/// `acc + Σ c·x` of 16 signed byte pairs into four 32-bit lanes (which products go into which
/// lane differs between the paths; only the total is used, exact): `sdot` when `DOT`, else
/// widening multiplies (`|c·x| ≤ 32·128` fits 16 bits) with pairwise accumulating adds.
#[inline(always)]
unsafe fn isum16<const DOT: bool>(acc: int32x4_t, c: int8x16_t, x: int8x16_t) -> int32x4_t {
    if DOT {
        neon::sdot(acc, c, x)
    } else {
        let lo = vpadalq_s16(acc, vmull_s8(vget_low_s8(c), vget_low_s8(x)));
        vpadalq_s16(lo, vmull_high_s8(c, x))
    }
}

/// A super-block's 256 codes as signed bytes in value order, q8 block `j`'s 32 in `[j]`: the
/// 4-bit codes of `Q4_K`, the 5-bit ones of `Q5_K` (bit `j` of `qh[l]` as 0x10), `q − 32` for
/// `Q6_K` (the low four bits from `ql`, two more from `qh`), as the portable kernel reads them.
#[inline(always)]
unsafe fn codes<const K: u8>(blk: *const u8) -> [[int8x16_t; 2]; K_SUB] {
    let low = vdupq_n_u8(0x0f);
    if K == Q6_K {
        return std::array::from_fn(|j| {
            let (h, k) = (j / 4, j % 4);
            std::array::from_fn(|half| {
                let ql = vld1q_u8(blk.add(64 * h + 32 * (k & 1) + 16 * half));
                let qh = vld1q_u8(blk.add(128 + 32 * h + 16 * half));
                let nib = if k < 2 {
                    vandq_u8(ql, low)
                } else {
                    vshrq_n_u8::<4>(ql)
                };
                // Bits 2k, 2k + 1 of qh as bits 4, 5.
                let hi = match k {
                    0 => vshlq_n_u8::<4>(qh),
                    1 => vshlq_n_u8::<2>(qh),
                    2 => qh,
                    _ => vshrq_n_u8::<2>(qh),
                };
                let q = vorrq_u8(nib, vandq_u8(hi, vdupq_n_u8(0x30)));
                vsubq_s8(vreinterpretq_s8_u8(q), vdupq_n_s8(32))
            })
        });
    }
    let qs = blk.add(if K == Q5_K { 48 } else { 16 });
    let qh = [vld1q_u8(blk.add(16)), vld1q_u8(blk.add(32))];
    std::array::from_fn(|j| {
        std::array::from_fn(|half| {
            // Sub-blocks 2g and 2g + 1: the low and high nibbles of the 32 bytes of group g.
            let q = vld1q_u8(qs.add(32 * (j / 2) + 16 * half));
            let mut c = if j % 2 == 0 {
                vandq_u8(q, low)
            } else {
                vshrq_n_u8::<4>(q)
            };
            if K == Q5_K {
                let set = vtstq_u8(qh[half], vdupq_n_u8(1 << j));
                c = vorrq_u8(c, vandq_u8(set, vdupq_n_u8(0x10)));
            }
            vreinterpretq_s8_u8(c)
        })
    })
}

/// The eight integer sums of a super-block (the portable `isums_q45_k`/`isums_q6_k`), lane `j`
/// of the two vectors q8 block `j`'s: the codes against the input's 256 quants at `xq`, for
/// `Q6_K` each 16-value half times its scale (`scales`, the super-block's 16 `i8`).
#[inline(always)]
unsafe fn isums<const DOT: bool, const K: u8>(
    codes: &[[int8x16_t; 2]; K_SUB],
    scales: *const u8,
    xq: *const i8,
) -> [int32x4_t; 2] {
    let zero = vdupq_n_s32(0);
    let acc: [int32x4_t; K_SUB] = std::array::from_fn(|j| {
        let x = [vld1q_s8(xq.add(32 * j)), vld1q_s8(xq.add(32 * j + 16))];
        if K == Q6_K {
            let sc = |h: usize| *scales.add(2 * j + h) as i8 as i32;
            let p0 = isum16::<DOT>(zero, codes[j][0], x[0]);
            let p1 = isum16::<DOT>(zero, codes[j][1], x[1]);
            vmlaq_n_s32(vmulq_n_s32(p0, sc(0)), p1, sc(1))
        } else {
            isum16::<DOT>(isum16::<DOT>(zero, codes[j][0], x[0]), codes[j][1], x[1])
        }
    });
    // Pairs, then pairs of pairs: lane j the total of acc[j] (vector h holds j = 4h..4h + 4).
    std::array::from_fn(|h| {
        let a = &acc[4 * h..];
        vpaddq_s32(vpaddq_s32(a[0], a[1]), vpaddq_s32(a[2], a[3]))
    })
}

/// A `Q4_K`/`Q5_K` super-block's eight 6-bit scales and eight minimums (its 12 bytes at `s`,
/// [`scales_mins_k4_bytes`]), as f32 lanes `j = 0..8`.
#[inline(always)]
unsafe fn scales_mins_k4(s: &[u8]) -> [[float32x4_t; 2]; 2] {
    let (sc, m) = scales_mins_k4_bytes(s);
    [sc, m].map(|v| {
        let w = vmovl_u8(vcreate_u8(v));
        [
            vcvtq_f32_u32(vmovl_u16(vget_low_u16(w))),
            vcvtq_f32_u32(vmovl_high_u16(w)),
        ]
    })
}

/// The four f16 values of `h` as f32: `fcvtl`, exact (the `half` crate's conversion gives the
/// same values, but checks for FEAT_FP16 on every call; `fcvtl` is base ARMv8 Advanced SIMD).
#[inline(always)]
unsafe fn f16x4(h: uint16x4_t) -> float32x4_t {
    let f: float32x4_t;
    // SAFETY: registers only; every aarch64 CPU runs `fcvtl`.
    asm!(
        "fcvtl {f:v}.4s, {h:v}.4h",
        f = out(vreg) f,
        h = in(vreg) h,
        options(pure, nomem, nostack, preserves_flags)
    );
    f
}

/// `0 + t_0 + t_1 + … + t_7` in that order (the portable finish's sum of its terms).
#[inline(always)]
unsafe fn ordered_sum(t: [float32x4_t; 2]) -> f32 {
    let mut lanes = [0.0f32; 8];
    vst1q_f32(lanes.as_mut_ptr(), t[0]);
    vst1q_f32(lanes.as_mut_ptr().add(4), t[1]);
    let mut sum = 0.0f32;
    for l in lanes {
        sum += l;
    }
    sum
}

/// A K-quant row (`K`) against `N` inputs, one super-block at a time: its codes decoded once for
/// every input; per input the eight integer sums ([`isums`]), the portable finish's terms in
/// eight float lanes (`Q4_K`/`Q5_K`: `(d·sc_j)·(d_x·isum_j) − (dmin·m_j)·sx_j`; `Q6_K`:
/// `d·(d_x·isum_j)`), [`ordered_sum`] of them added to the input's sum. Each result has the bits
/// of the portable `dot`.
#[inline(always)]
unsafe fn kquant<const DOT: bool, const K: u8, const N: usize>(
    w: &[u8],
    xs: [&Q8Vec; N],
) -> [f32; N] {
    let bytes = match K {
        Q4_K => Q4_K_BYTES,
        Q5_K => Q5_K_BYTES,
        _ => Q6_K_BYTES,
    };
    let nb = super_blocks(w, bytes, &xs);
    let mut sums = [-0.0f32; N];
    for b in 0..nb {
        let blk = &w[b * bytes..(b + 1) * bytes];
        let p = blk.as_ptr();
        let codes = codes::<K>(p);
        let lanes = |v: &[f32]| {
            let v = v[K_SUB * b..K_SUB * (b + 1)].as_ptr();
            [vld1q_f32(v), vld1q_f32(v.add(4))]
        };
        if K == Q6_K {
            let d =
                vdupq_laneq_f32::<0>(f16x4(vdup_n_u16(u16::from_le_bytes([blk[208], blk[209]]))));
            for (sum, x) in sums.iter_mut().zip(xs) {
                let is = isums::<DOT, K>(&codes, p.add(192), x.quants.as_ptr().add(256 * b));
                let dx = lanes(&x.scales);
                let t = [0, 1].map(|h| vmulq_f32(d, vmulq_f32(dx[h], vcvtq_f32_s32(is[h]))));
                *sum += ordered_sum(t);
            }
        } else {
            let [sc, m] = scales_mins_k4(&blk[4..16]);
            // d and dmin, the f16 pair at the block's start.
            let dm = f16x4(vcreate_u16(
                u32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]) as u64,
            ));
            let (d, dmin) = (vdupq_laneq_f32::<0>(dm), vdupq_laneq_f32::<1>(dm));
            let dsc = sc.map(|s| vmulq_f32(d, s));
            let dmm = m.map(|m| vmulq_f32(dmin, m));
            for (sum, x) in sums.iter_mut().zip(xs) {
                let is = isums::<DOT, K>(&codes, p, x.quants.as_ptr().add(256 * b));
                let (dx, sx) = (lanes(&x.scales), lanes(&x.sums));
                let t = [0, 1].map(|h| {
                    let a = vmulq_f32(dsc[h], vmulq_f32(dx[h], vcvtq_f32_s32(is[h])));
                    vsubq_f32(a, vmulq_f32(dmm[h], sx[h]))
                });
                *sum += ordered_sum(t);
            }
        }
    }
    sums
}

/// One K-quant row against 1 to [`WIDE_INPUTS`] inputs.
#[inline(always)]
unsafe fn inputs<const DOT: bool, const K: u8>(w: &[u8], xs: &[&Q8Vec], out: &mut [f32]) {
    by_inputs!(xs, out, |N, arr| kquant::<DOT, K, N>(w, arr))
}

/// [`kquant`] of one input through `sdot`.
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
unsafe fn dot_sdot<const K: u8>(w: &[u8], x: &Q8Vec) -> f32 {
    kquant::<true, K, 1>(w, [x])[0]
}

/// One [`dot_sdot`] per row.
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
unsafe fn dots_sdot<const K: u8>(rows: &[&[u8]], x: &Q8Vec, out: &mut [f32]) {
    for (o, w) in out.iter_mut().zip(rows) {
        *o = kquant::<true, K, 1>(w, [x])[0];
    }
}

/// [`inputs`] through `sdot`.
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
unsafe fn inputs_sdot<const K: u8>(w: &[u8], xs: &[&Q8Vec], out: &mut [f32]) {
    inputs::<true, K>(w, xs, out)
}
