//! The streaming FFN's kernel over neuron bundles (issue [C]).
//!
//! A bundle is one FFN neuron's weights stored together so that one read fetches them: its gate
//! row, its up row and its down column, each `hidden` values in one encoding, `[gate | up | down]`.
//! The kernel reads bundles where they lie (the resident cache or a buffer just read from flash),
//! without gathering them into matrices, and skips the up and down work of every neuron whose
//! activation is negligible.

use anyhow::{ensure, Result};
use leanstream_format::quant::{row_bytes, QuantType};
use rayon::prelude::*;

use super::operand::Operand;
use super::rows::RowKernels;
use super::PARALLEL_MIN_WEIGHTS;
use crate::config::Activation;

/// Bundles per rayon task.
const BUNDLES_PER_TASK: usize = 64;

/// The shape of one layer's bundles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BundleLayout {
    pub qtype: QuantType,
    pub hidden: usize,
    row_bytes: usize,
}

impl BundleLayout {
    pub fn new(qtype: QuantType, hidden: usize) -> Result<Self> {
        Ok(Self {
            qtype,
            hidden,
            row_bytes: row_bytes(qtype, hidden)?,
        })
    }

    /// Bytes of one of the three parts.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    pub fn bundle_bytes(&self) -> usize {
        3 * self.row_bytes
    }
}

/// The FFN over a set of neurons: for each bundle `i`, `g = gate·x` is written to `gates[i]`;
/// `a = act(g)`; if `|a| > threshold`, `out += a · (up·x) · down`. Returns how many neurons were
/// computed (not skipped). With ReLU and threshold 0 the skip is exact.
///
/// `x` is the FFN input prepared for `layout.qtype`; `out` has `hidden` values and is added to.
pub fn ffn_bundles(
    layout: &BundleLayout,
    x: &Operand,
    bundles: &[&[u8]],
    act: Activation,
    threshold: f32,
    out: &mut [f32],
    gates: &mut [f32],
) -> Result<usize> {
    ensure!(
        x.x.len() == layout.hidden && out.len() == layout.hidden,
        "FFN input and output must have {} values (got {} and {})",
        layout.hidden,
        x.x.len(),
        out.len()
    );
    ensure!(
        gates.len() == bundles.len(),
        "{} gate slots for {} bundles",
        gates.len(),
        bundles.len()
    );
    if let Some(i) = bundles
        .iter()
        .position(|b| b.len() != layout.bundle_bytes())
    {
        anyhow::bail!(
            "bundle {i} has {} bytes, a {} bundle of {} values has {}",
            bundles[i].len(),
            layout.qtype,
            layout.hidden,
            layout.bundle_bytes()
        );
    }
    let k = RowKernels::best();
    let work = bundles.len() * layout.hidden;
    if work < 4 * PARALLEL_MIN_WEIGHTS || rayon::current_num_threads() == 1 {
        return Ok(run(k, layout, x, bundles, act, threshold, out, gates));
    }
    let (partial, computed) = bundles
        .par_chunks(BUNDLES_PER_TASK)
        .zip(gates.par_chunks_mut(BUNDLES_PER_TASK))
        .fold(
            || (vec![0.0f32; layout.hidden], 0),
            |(mut acc, n), (bs, gs)| {
                let m = run(k, layout, x, bs, act, threshold, &mut acc, gs);
                (acc, n + m)
            },
        )
        .reduce(
            || (vec![0.0f32; layout.hidden], 0),
            |(mut a, n), (b, m)| {
                a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                (a, n + m)
            },
        );
    out.iter_mut().zip(&partial).for_each(|(o, p)| *o += p);
    Ok(computed)
}

#[allow(clippy::too_many_arguments)]
fn run(
    k: &RowKernels,
    layout: &BundleLayout,
    x: &Operand,
    bundles: &[&[u8]],
    act: Activation,
    threshold: f32,
    out: &mut [f32],
    gates: &mut [f32],
) -> usize {
    let (q, rb) = (layout.qtype, layout.row_bytes);
    let mut computed = 0;
    for (i, (bundle, g)) in bundles.iter().zip(gates.iter_mut()).enumerate() {
        if let Some(next) = bundles.get(i + 1) {
            prefetch(&next[..rb]);
        }
        let (gate, rest) = bundle.split_at(rb);
        let (up, down) = rest.split_at(rb);
        *g = k.dot(q, gate, x);
        let a = act.apply(*g);
        if a.abs() > threshold {
            k.axpy(q, a * k.dot(q, up, x), down, out);
            computed += 1;
        }
    }
    computed
}

/// Asks for `bytes` to be brought into cache: bundles lie apart, so the hardware prefetcher, which
/// follows sequential reads, misses the start of every gate row.
#[inline(always)]
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for offset in (0..bytes.len()).step_by(64) {
        // SAFETY: a prefetch is a hint that never faults; the address lies within `bytes`.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(offset) as *const i8)
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}
