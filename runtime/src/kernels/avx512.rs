//! The `avx512` kernel set (x86-64 with AVX-512 F, BW, VL and VNNI): for now the AVX2 kernels,
//! which give the portable kernels' bits.
//!
//! Every kernel set must compute the portable set's bits (the activation is quantized to q8 before
//! each mat-vec, and rounding is discontinuous, so a last-bit difference moves a value across a
//! rounding boundary now and then: the Q6_K fixture's perplexity differed by 1.5e-4 between this
//! set and the portable one). The earlier AVX-512 kernels added their float terms in their own
//! order (sixteen lanes with fused multiply-adds), so they were taken out; AVX-512 versions that
//! keep the portable order (VNNI for the exact integer sums, the float terms in lanes as
//! the `avx2` kernels add them) are yet to be written and measured against these.

use super::rows::RowKernels;

pub(super) fn detected() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && super::avx2::detected()
}

/// The AVX-512 kernel table.
///
/// # Safety
/// The CPU must have the features [`detected`] checks.
pub(super) unsafe fn kernels() -> RowKernels {
    RowKernels {
        isa: "avx512",
        // SAFETY: the caller checked the CPU features, AVX2's among them.
        ..unsafe { super::avx2::kernels() }
    }
}
