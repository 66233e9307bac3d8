//! A cluster held in memory with its gate and up rows in row groups ([`super::groups`]): the
//! cache lays a cluster out this way when it keeps it ([`group_cluster`]), so that every later
//! token's gate pass over it computes eight neurons per vector operation
//! ([`gate_pass_grouped_cluster`], bitwise [`gate_pass`]). Only the first `⌊count / 8⌋ · 8`
//! neurons lie in groups; the others, and every down column, stay as stored. A caller that needs
//! the stored bytes back (a prompt chunk's pass, the GPU's upload) copies them out
//! ([`ungroup_cluster_into`]).
//!
//! The cluster must be in the split layout (format 1.6 on: each part's rows end to end); a file
//! in the interleaved layout keeps its clusters as stored ([`groupable_cluster`]).

use leanstream_format::ffn::{ClusterLayout, PartTypes};

use super::bundles::{gate_pass, gate_pass_groups, BundleLayout, ClusterRows, RUN_PASS};
use super::groups::{group_in_place_with, groupable, ungroup_rows, GROUP_ROWS};
use super::operand::Operand;
use super::rows::RowKernels;
use crate::streaming::skip_rule::Skip;

/// Neurons per cluster for a converter's target of `cluster_kib` KiB: as many bundles of
/// `bundle_bytes` as fill it, at least one, at most the layer's `n`; where the gate and up rows
/// have a grouped layout (`parts`), that is less than one row group and a group's bundles fit in
/// twice the target, one group ([`GROUP_ROWS`]), so that the cache can compute the cluster in
/// groups. A 7B layer's q4 bundles (6,912 bytes) fill the default 32 KiB with 4 neurons; 8 make
/// 56 KiB clusters (read in one request as well).
pub fn cluster_neurons(cluster_kib: u32, bundle_bytes: usize, n: usize, parts: PartTypes) -> usize {
    let (target, bundle) = (cluster_kib as usize * 1024, bundle_bytes.max(1));
    let fit = target / bundle;
    let grouped = groupable(parts.gate) && groupable(parts.up);
    let fit = if grouped && fit < GROUP_ROWS && GROUP_ROWS * bundle <= 2 * target {
        GROUP_ROWS
    } else {
        fit
    };
    fit.clamp(1, n.max(1))
}

/// Whether clusters of `layout` with `count` neurons are laid out in row groups when kept, by
/// kernels `k`: a split layout, gate and up encodings the kernels group, and one group at least.
pub fn groupable_cluster(k: &RowKernels, layout: &BundleLayout, count: usize) -> bool {
    layout.cluster == ClusterLayout::Split
        && count >= GROUP_ROWS
        && k.has_groups(layout.qtypes.gate)
        && k.has_groups(layout.qtypes.up)
}

/// Where part `p` (0 gate, 1 up) of a split cluster of `count` neurons starts.
fn part_start(layout: &BundleLayout, p: usize, count: usize) -> usize {
    count * layout.row_bytes()[..p].iter().sum::<usize>()
}

/// Lays the gate and up rows of a cluster (`bytes`, its extent as stored, `count` neurons) out in
/// row groups in place, through `buf` (one group's rows, reused). The caller checked
/// [`groupable_cluster`].
pub fn group_cluster(layout: &BundleLayout, bytes: &mut [u8], count: usize, buf: &mut Vec<u8>) {
    let rb = layout.row_bytes();
    let grouped = count / GROUP_ROWS * GROUP_ROWS;
    for (p, qtype) in [(0, layout.qtypes.gate), (1, layout.qtypes.up)] {
        let at = part_start(layout, p, count);
        group_in_place_with(qtype, &mut bytes[at..at + grouped * rb[p]], rb[p], buf);
    }
}

/// The stored bytes of a cluster [`group_cluster`] laid out (`bytes`), into `out` (resized to
/// `bytes`' length; its allocation reused).
pub fn ungroup_cluster_into(layout: &BundleLayout, bytes: &[u8], count: usize, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(bytes);
    let rb = layout.row_bytes();
    let grouped = count / GROUP_ROWS * GROUP_ROWS;
    for (p, qtype) in [(0, layout.qtypes.gate), (1, layout.qtypes.up)] {
        let run = part_start(layout, p, count)..part_start(layout, p, count) + grouped * rb[p];
        ungroup_rows(qtype, &bytes[run.clone()], rb[p], 0, &mut out[run]);
    }
}

/// [`gate_pass`] over every neuron of a cluster laid out by [`group_cluster`]: its groups
/// [`RUN_PASS`] neurons at a time through [`gate_pass_groups`], then the plain rows after them.
/// `rows` is the cluster read as stored (only its down columns, which grouping leaves in place,
/// are read through it, and the tail's rows). Scores, active neurons (ascending) and
/// coefficients are bitwise [`gate_pass`]'s over the stored cluster.
#[allow(clippy::too_many_arguments)]
pub fn gate_pass_grouped_cluster<'b>(
    k: &RowKernels,
    layout: &BundleLayout,
    x: &Operand,
    bytes: &'b [u8],
    rows: &ClusterRows<'b>,
    candidate: impl Fn(usize) -> bool,
    skip: Skip,
    scores: &mut [f32],
    active: &mut [u32],
    coef: &mut [f32],
) -> usize {
    let count = rows.len();
    let rb = layout.row_bytes();
    let grouped = count / GROUP_ROWS * GROUP_ROWS;
    let part = |p: usize| {
        let at = part_start(layout, p, count);
        &bytes[at..at + grouped * rb[p]]
    };
    let runs = super::bundles::GroupedRuns {
        gate: part(0),
        up: part(1),
    };
    let mut m = 0;
    let mut start = 0;
    while start < grouped {
        let end = (start + RUN_PASS).min(grouped);
        let got = gate_pass_groups(
            k,
            layout,
            x,
            runs,
            start,
            &rows.from(start),
            |i| candidate(start + i),
            skip,
            &mut scores[start..end],
            &mut active[m..],
            &mut coef[m..],
        );
        active[m..m + got]
            .iter_mut()
            .for_each(|a| *a += start as u32);
        m += got;
        start = end;
    }
    if grouped < count {
        let got = gate_pass(
            k,
            layout,
            x,
            &rows.from(grouped),
            None,
            |i| candidate(grouped + i),
            skip,
            &mut scores[grouped..count],
            &mut active[m..],
            &mut coef[m..],
        );
        active[m..m + got]
            .iter_mut()
            .for_each(|a| *a += grouped as u32);
        m += got;
    }
    m
}
