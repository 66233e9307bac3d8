//! A layer held whole in memory as three runs ([`LayerRuns`]): every neuron's gate row end to
//! end, then every up row, then every down column, in stored order. A cluster of the file keeps
//! its rows together so that one read fetches them; once a whole layer stays in memory (the
//! `resident` policy), the engine computes each reduction group's neurons in one pass over these
//! runs instead of cluster after cluster: three long streams for the prefetchers and no per-cluster
//! start-up. The rows, the order of the sums and so the bits are the clusters' own.
//!
//! Where the kernels have row groups for the gate and up rows' encodings
//! ([`crate::kernels::groups`]: `Q8_0`, `Q4_0`, `Q4_1`), those two runs are laid out in groups of eight neurons once filled
//! ([`LayerRuns::into_groups`]), so that the gate pass computes eight neurons per vector operation
//! ([`crate::kernels::bundles::gate_pass_groups`]); a cluster's plain rows are then copied out of
//! the groups where a caller needs them ([`LayerRuns::rows_into`]: a prompt chunk's pass).

use anyhow::Result;

use crate::kernels::bundles::{BundleLayout, ClusterRows, GroupedRuns, NeuronRows};
use crate::kernels::groups::{group_in_place, ungroup_rows, GROUP_ROWS};
use crate::kernels::RowKernels;
use crate::streaming::plan::LayerPlan;

pub(in crate::streaming) struct LayerRuns {
    bytes: Vec<u8>,
    /// Where each part's run starts: part `p` of neuron `n` at `start[p] + n · row_bytes[p]`
    /// (in plain rows; the same bytes in groups).
    start: [usize; 3],
    /// Whether the gate and up runs lie in row groups.
    grouped: bool,
}

impl LayerRuns {
    /// An empty layer of `plan`'s size, filled cluster by cluster ([`LayerRuns::put`]).
    pub(in crate::streaming) fn for_layer(plan: &LayerPlan) -> Self {
        let rb = plan.layout.row_bytes();
        let n = plan.cluster_of.len();
        let start = [0, n * rb[0], n * (rb[0] + rb[1])];
        Self {
            bytes: vec![0; n * plan.layout.bundle_bytes()],
            start,
            grouped: false,
        }
    }

    /// Lays the filled gate and up runs out in groups of eight neurons where `k` has row groups
    /// for both parts' encodings and the layer's neurons are whole groups; else unchanged. One
    /// group's rows at a time are copied aside ([`group_in_place`]).
    pub(in crate::streaming) fn into_groups(mut self, plan: &LayerPlan, k: &RowKernels) -> Self {
        let q = plan.layout.qtypes;
        let n = plan.cluster_of.len();
        if self.grouped
            || n == 0
            || !n.is_multiple_of(GROUP_ROWS)
            || !k.has_groups(q.gate)
            || !k.has_groups(q.up)
        {
            return self;
        }
        let rb = plan.layout.row_bytes();
        for (p, qtype) in [(0, q.gate), (1, q.up)] {
            let run = &mut self.bytes[self.start[p]..self.start[p] + n * rb[p]];
            group_in_place(qtype, run, rb[p]);
        }
        self.grouped = true;
        self
    }

    /// Whether the gate and up runs lie in row groups ([`LayerRuns::into_groups`]).
    pub(in crate::streaming) fn is_grouped(&self) -> bool {
        self.grouped
    }

    /// The whole layer's gate and up runs in groups, where they are.
    pub(in crate::streaming) fn groups(&self, layout: &BundleLayout) -> Option<GroupedRuns<'_>> {
        if !self.grouped {
            return None;
        }
        let n = (self.start[1] - self.start[0]) / layout.row_bytes()[0];
        Some(GroupedRuns {
            gate: &self.bytes[self.start[0]..self.start[1]],
            up: &self.bytes[self.start[1]..self.start[1] + n * layout.row_bytes()[1]],
        })
    }

    /// Copies cluster `ci`'s rows, its bytes as stored in the file, into place.
    pub(in crate::streaming) fn put(
        &mut self,
        plan: &LayerPlan,
        ci: usize,
        stored: &[u8],
    ) -> Result<()> {
        let cl = plan.clusters[ci];
        let rows = ClusterRows::new(&plan.layout, stored, cl.count)?;
        let rb = plan.layout.row_bytes();
        for i in 0..cl.count {
            for (p, row) in [rows.gate(i), rows.up(i), rows.down(i)]
                .into_iter()
                .enumerate()
            {
                let at = self.start[p] + (cl.first + i) * rb[p];
                self.bytes[at..at + rb[p]].copy_from_slice(row);
            }
        }
        Ok(())
    }

    /// Neurons `first .. first + count` of the layer as plain rows, in `scratch` where the gate
    /// and up runs lie in groups (their rows copied out, and the down columns with them), else
    /// where they lie ([`LayerRuns::rows`]).
    pub(in crate::streaming) fn rows_into<'a>(
        &'a self,
        layout: &BundleLayout,
        first: usize,
        count: usize,
        scratch: &'a mut Vec<u8>,
    ) -> ClusterRows<'a> {
        if !self.grouped {
            return self.rows(layout, first, count);
        }
        let rb = layout.row_bytes();
        let q = layout.qtypes;
        scratch.clear();
        scratch.resize(count * (rb[0] + rb[1] + rb[2]), 0);
        let at = [0, count * rb[0], count * (rb[0] + rb[1])];
        for (p, qtype) in [(0, q.gate), (1, q.up)] {
            let out = &mut scratch[at[p]..at[p] + count * rb[p]];
            ungroup_rows(qtype, &self.bytes[self.start[p]..], rb[p], first, out);
        }
        let down = self.start[2] + first * rb[2];
        scratch[at[2]..].copy_from_slice(&self.bytes[down..down + count * rb[2]]);
        ClusterRows::in_runs(layout, scratch, at, count).expect("rows laid out to fit")
    }

    /// Neurons `first .. first + count` of the layer, where they lie: their down columns only
    /// where the gate and up runs lie in groups ([`LayerRuns::rows_into`] for all three).
    pub(in crate::streaming) fn rows(
        &self,
        layout: &BundleLayout,
        first: usize,
        count: usize,
    ) -> ClusterRows<'_> {
        let rb = layout.row_bytes();
        let at = std::array::from_fn(|p| self.start[p] + first * rb[p]);
        ClusterRows::in_runs(layout, &self.bytes, at, count)
            .expect("neurons of the layer the runs were made for")
    }
}
