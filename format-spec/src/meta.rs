//! META: the file's JSON description — model config, quantization, sparsity thresholds and the
//! converter's measurements. See FORMAT.md §4.

use serde::{Deserialize, Serialize};

use crate::model_config::ModelConfig;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    pub model: ModelConfig,
    /// Encoding of the dense matrices (norm vectors are always f32).
    pub dense_quant: String,
    /// Encoding of the FFN bundles.
    pub ffn_quant: String,
    /// `relu` (a neuron is active iff gate·x > 0) or `threshold`.
    pub sparsity_mode: String,
    /// For `threshold`: the fraction of neurons calibrated to be skipped.
    pub sparsity_target: Option<f32>,
    pub cluster_kib: u32,
    pub layers: Vec<LayerMeta>,
    /// Free-form provenance: source model, calibration, converter version, timings.
    pub provenance: serde_json::Value,
}

/// Per layer: the normative skip threshold and the converter's held-out measurements.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerMeta {
    /// A neuron may be skipped when `|act(gate·x)| <= threshold` (0 for ReLU: exact).
    pub threshold: f32,
    /// Mean fraction of skipped neurons on the held-out profile split.
    pub sparsity: f32,
    pub predictor_recall: f32,
    pub predictor_precision: f32,
    pub lookahead_recall: f32,
    pub lookahead_precision: f32,
    /// Recall of the static most-frequent set of the same size (the baseline predictors must beat).
    pub static_recall: f32,
    /// Mean fraction of active neurons in a cluster that has any active neuron.
    pub cluster_fill: f32,
    /// The same for the original neuron order, clustered identically (what placement gained).
    pub cluster_fill_unordered: f32,
}
