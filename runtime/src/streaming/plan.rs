//! What the scheduler knows about one layer before any token runs: where each cluster of neuron
//! bundles lives on flash, the predictors, the gate sketch and its skip rule, and the profile's
//! statistics — all decoded once from the file. A certificate is read only where the planner keeps
//! it ([`LayerPlan::load_certificates`]).

use anyhow::Result;
use leanstream_format::refine::RefineLayer;
use leanstream_format::LsbFile;

use crate::kernels::bundles::BundleLayout;
use crate::streaming::certify::Certificate;
use crate::streaming::refine_sketch::RefineSketch;
use crate::streaming::skip_rule::{Skip, SkipRule};

use super::predict::QuantPredictor;

/// One cluster: a run of stored neurons read with one request.
#[derive(Debug, Clone, Copy)]
pub struct ClusterRef {
    /// Stored position of its first neuron.
    pub first: usize,
    pub count: usize,
    /// File offset and size of its page-aligned extent.
    pub offset: u64,
    pub size: u64,
    pub checksum: u64,
}

pub struct LayerPlan {
    pub layout: BundleLayout,
    pub clusters: Vec<ClusterRef>,
    /// Cluster of each stored position.
    pub cluster_of: Vec<u32>,
    /// The file's skip rule and this layer's threshold.
    pub skip: Skip,
    /// What proves neurons inactive without their bundles, where the plan keeps it.
    pub certificate: Option<Certificate>,
    /// Resident bytes of the layer's certificate in the file (`None`: it has none the skip rule
    /// can use); counted where `certify` is set.
    pub certificate_bytes: Option<u64>,
    /// The plan keeps the certificate: [`LayerPlan::load_certificates`] reads it.
    pub certify: bool,
    /// The layer's own predictor, resident where it decides something (predicted sparsity).
    pub own: Option<QuantPredictor>,
    /// Otherwise the file offset and size of its record, read for the metrics now and then.
    pub own_on_flash: Option<(u64, u64)>,
    /// The look-ahead predictor, resident where a policy speculates with it.
    pub lookahead: Option<QuantPredictor>,
    pub refine: RefineLayer,
    /// The one-bit gate sketch refine sparsity chooses neurons with, where it runs.
    pub refine_sketch: Option<RefineSketch>,
}

/// Which predictors the run uses, so only those stay resident.
#[derive(Debug, Clone, Copy)]
pub struct PredictorUse {
    pub own: bool,
    pub lookahead: bool,
}

impl LayerPlan {
    /// Drops the layer's certificate and its look-ahead predictor with it: a certified layer
    /// without a certificate reads every uncached cluster, so there is nothing left to guess.
    /// True if anything was dropped.
    pub fn uncertify(&mut self) -> bool {
        let had = self.certify || self.lookahead.is_some();
        self.certify = false;
        self.lookahead = None;
        had
    }

    /// Decodes every layer's plan from an open file (no certificate read yet), taking over its predictors and
    /// statistics (so they are not held twice); keeps the predictors `uses` names, as int8.
    pub fn all(file: &mut LsbFile, uses: PredictorUse) -> Result<Vec<LayerPlan>> {
        let own_extents = file.own_predictor_extents();
        let mut own = std::mem::take(&mut file.predictors.own).into_iter();
        let mut lookahead = std::mem::take(&mut file.predictors.lookahead).into_iter();
        let mut refine = std::mem::take(&mut file.refine.layers).into_iter();
        let c = &file.meta.model;
        let rule = SkipRule::parse(file.meta.sparsity_rule.as_deref()).ok_or_else(|| {
            anyhow::anyhow!(
                "{}: unknown sparsity_rule {:?} in META (this build knows gate and gate_up): \
                 update leanstream",
                file.path.display(),
                file.meta.sparsity_rule
            )
        })?;
        let mut plans = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let f = &file.ffn.layers[l];
            let clusters: Vec<ClusterRef> = f
                .clusters
                .iter()
                .enumerate()
                .map(|(ci, cl)| {
                    let (offset, size) = file.cluster_extent(l, ci);
                    ClusterRef {
                        first: cl.first as usize,
                        count: cl.count as usize,
                        offset,
                        size,
                        checksum: cl.checksum,
                    }
                })
                .collect();
            let mut cluster_of = vec![0u32; f.neurons()];
            for (ci, cl) in clusters.iter().enumerate() {
                cluster_of[cl.first..cl.first + cl.count].fill(ci as u32);
            }
            let skip = Skip {
                act: c.activation,
                rule,
                threshold: file.meta.layers[l].threshold,
            };
            let certificate_bytes = Certificate::resident_bytes(&file.sketch.layers[l], skip);
            plans.push(LayerPlan {
                layout: BundleLayout::of(f)?,
                clusters,
                cluster_of,
                skip,
                certificate: None,
                certificate_bytes,
                certify: certificate_bytes.is_some(),
                own: own
                    .next()
                    .filter(|_| uses.own)
                    .map(|p| QuantPredictor::new(&p)),
                own_on_flash: own_extents.as_ref().filter(|_| !uses.own).map(|e| e[l]),
                lookahead: lookahead
                    .next()
                    .filter(|_| uses.lookahead)
                    .map(|p| QuantPredictor::new(&p)),
                refine: refine.next().expect("validated: one per layer"),
                refine_sketch: None,
            });
        }
        Ok(plans)
    }

    /// Bytes of the resident per-layer state (sketch, resident predictors, statistics).
    pub fn resident_bytes(&self) -> u64 {
        self.certificate_bytes.filter(|_| self.certify).unwrap_or(0)
            + 4 * self.cluster_of.len() as u64
            + self.refine_sketch.as_ref().map_or(0, |s| s.bytes() as u64)
            + self.predictor_bytes()
            + 8 * self.refine.neuron_freq.len() as u64
            + 12 * self.refine.cluster_freq.len() as u64
                * (1 + self.refine.neighbours.first().map_or(0, Vec::len) as u64)
    }

    /// Reads the certificates the plans keep and drops the others.
    pub fn load_certificates(file: &LsbFile, plans: &mut [LayerPlan]) -> Result<()> {
        for (l, p) in plans.iter_mut().enumerate() {
            p.certificate = None;
            if p.certify {
                let mut layer = file.read_sketch_layer(l)?;
                p.certificate = Certificate::new(&mut layer, p.skip, p.cluster_of.len())?;
            }
        }
        Ok(())
    }

    /// Bytes of the resident predictors.
    pub fn predictor_bytes(&self) -> u64 {
        self.own
            .iter()
            .chain(&self.lookahead)
            .map(|p| p.bytes())
            .sum()
    }

    /// Whether the bundles' type quantizes the FFN input (so the gates use its q8 form).
    pub fn block_bundles(&self) -> bool {
        self.layout.operand_type().is_block()
    }
}
