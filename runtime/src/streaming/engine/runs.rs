//! A layer held whole in memory as three runs ([`LayerRuns`]): every neuron's gate row end to
//! end, then every up row, then every down column, in stored order. A cluster of the file keeps
//! its rows together so that one read fetches them; once a whole layer stays in memory (the
//! `resident` policy), the engine computes each reduction group's neurons in one pass over these
//! runs instead of cluster after cluster: three long streams for the prefetchers and no per-cluster
//! start-up. The rows, the order of the sums and so the bits are the clusters' own.

use anyhow::Result;

use crate::kernels::bundles::{BundleLayout, ClusterRows, NeuronRows};
use crate::streaming::plan::LayerPlan;

pub(in crate::streaming) struct LayerRuns {
    bytes: Vec<u8>,
    /// Where each part's run starts: part `p` of neuron `n` at `start[p] + n · row_bytes[p]`.
    start: [usize; 3],
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
        }
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

    /// Neurons `first .. first + count` of the layer.
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
