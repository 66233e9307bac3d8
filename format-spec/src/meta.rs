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
    /// What the threshold is compared with (format 1.3): `gate` (`|act(gate·x)|`, also when
    /// absent) or `gate_up` (`|act(gate·x)·(up·x)|`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sparsity_rule: Option<String>,
    pub cluster_kib: u32,
    pub layers: Vec<LayerMeta>,
    /// Free-form provenance: source model, calibration, converter version, timings.
    pub provenance: serde_json::Value,
    /// The source model's chat template; absent in files written before it was stored and for
    /// models without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<ChatTemplate>,
    /// Present in files written by `leanstream-prep synth` (format 1.1): what was planted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub synthetic: Option<Synthetic>,
    /// Written without calibration (format 1.8): bundles in their original order, every
    /// threshold 0, no certificate and no trained predictors, so exact mode computes every neuron
    /// as the dense model does. `leanstream-prep calibrate` upgrades such a file in place.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub layout_only: bool,
}

/// A Jinja chat template (Hugging Face `chat_template`, GGUF `tokenizer.chat_template`) and the
/// special-token texts it is rendered with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatTemplate {
    pub template: String,
    #[serde(default)]
    pub bos_token: Option<String>,
    #[serde(default)]
    pub eos_token: Option<String>,
}

/// How a synthetic file was made: its shape, and the statistics of the source it imitates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Synthetic {
    /// The published shape it copies, e.g. `llama2-7b`.
    pub shape: String,
    /// The file whose activation statistics were planted.
    pub source: String,
    pub seed: u64,
    /// For each layer, the source layer whose statistics it was given.
    pub source_layer: Vec<usize>,
    /// The source file's own per-layer measurements, as in its META (by source layer).
    pub source_layers: Vec<LayerMeta>,
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
    /// Activity statistics (format 1.1; absent in older files), held-out split.
    #[serde(flatten)]
    pub activity: Option<Activity>,
    /// Fraction of the layer's cluster reads per token (nothing cached) that its certificate
    /// avoids on the held-out split (format 1.3; absent when the layer has no certificate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate_saves: Option<f32>,
    /// How the layer's router chose experts on the calibration text (format 1.5; only in a
    /// mixture-of-experts layer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<Routing>,
}

/// A mixture layer's routing profile on the converter's held-out split (FORMAT.md §4.2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Routing {
    /// Per expert, the fraction of tokens that chose it (they sum to `experts_per_token`).
    pub expert_freq: Vec<f32>,
    /// Of the experts a token chose, the fraction the previous token of its window also chose.
    pub token_reuse: f32,
    /// Of the experts a token chose, the fraction found by this layer's router applied to the
    /// residual entering the layer (normalised with the layer's FFN norm), before its attention.
    pub lookahead_recall: f32,
    /// Co-selection with the next mixture layer: per expert, the expert there that the tokens
    /// choosing it most often choose (empty on the last mixture layer).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub next_partners: Vec<u32>,
    /// Per expert, the fraction of the tokens choosing it that choose its partner next.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub next_partner_share: Vec<f32>,
}

impl Meta {
    /// The lowest minor format version whose META features this file uses (FORMAT.md §12).
    pub fn minor_version(&self) -> u16 {
        let v13 = self.sparsity_rule.is_some()
            || self.layers.iter().any(|l| l.certificate_saves.is_some());
        let v15 = self.model.moe.is_some() || self.layers.iter().any(|l| l.routing.is_some());
        let base = if self.layout_only {
            8
        } else if v15 {
            5
        } else if v13 {
            3
        } else {
            1
        };
        base.max(self.model.minor_version())
    }
}

/// How a layer's activity is distributed over neurons and tokens (FORMAT.md §4.2).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Activity {
    /// Fraction of all activations that fall on the 10 % most frequently active neurons.
    pub hot10_share: f32,
    /// Of the neurons active for a token, the fraction also active for the token before it.
    pub token_overlap: f32,
    /// Mean fraction of active neurons in the groups of 8 consecutive stored positions a token
    /// touches (co-activation: placement puts neurons that fire together side by side).
    pub group_fill: f32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_config::ModelConfig;

    fn meta(chat_template: Option<ChatTemplate>) -> Meta {
        let model: ModelConfig = serde_json::from_value(serde_json::json!({
            "architecture": "Llama", "activation": "Relu", "hidden_size": 8,
            "intermediate_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
            "head_dim": 4, "vocab_size": 32, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "rope_scaling": null, "sliding_window": null,
            "tie_word_embeddings": true, "qk_norm": false, "bos_token_id": 1, "eos_token_ids": [2]
        }))
        .unwrap();
        Meta {
            model,
            dense_quant: "q8_0".into(),
            ffn_quant: "q8_0".into(),
            sparsity_mode: "relu".into(),
            sparsity_target: None,
            sparsity_rule: None,
            cluster_kib: 32,
            layers: Vec::new(),
            provenance: serde_json::Value::Null,
            chat_template,
            synthetic: None,
            layout_only: false,
        }
    }

    /// A 1.7 file's model (no 1.8 keys) loads with the default block options, keeps minor 1 and
    /// writes none of the keys; Gemma's keys sit at the model's level, round-trip, and make the
    /// file 1.8.
    #[test]
    fn block_options_are_optional_and_make_a_file_1_8() {
        let old = meta(None);
        assert_eq!(old.model.block, Default::default());
        assert_eq!(old.minor_version(), 1);
        let json = serde_json::to_value(&old.model).unwrap();
        assert!(json.get("full_attention_layers").is_none() && json.get("block").is_none());
        let mut gemma = old.clone();
        gemma.model.block.full_attention_layers = vec![0];
        gemma.model.block.attn_logit_softcap = Some(50.0);
        let json = serde_json::to_value(&gemma).unwrap();
        assert_eq!(json["model"]["attn_logit_softcap"], 50.0);
        assert_eq!(serde_json::from_value::<Meta>(json).unwrap(), gemma);
        assert_eq!(gemma.minor_version(), 8);
        let mut gelu = old;
        gelu.model.activation = crate::model_config::Activation::GeluTanh;
        assert_eq!(gelu.minor_version(), 8);
    }

    /// FATReLU (with its threshold) and dReLU round-trip through META and make a file 1.9.
    #[test]
    fn sparsity_native_activations_round_trip_and_make_a_file_1_9() {
        use crate::model_config::Activation;
        for act in [Activation::FatRelu { threshold: 0.01 }, Activation::DRelu] {
            let mut m = meta(None);
            m.model.activation = act;
            let json = serde_json::to_string(&m).unwrap();
            let back: Meta = serde_json::from_str(&json).unwrap();
            assert_eq!(back.model.activation, act, "{json}");
            assert_eq!(back.minor_version(), 9);
        }
        let mut m = meta(None);
        m.model.activation = Activation::FatRelu { threshold: -0.5 };
        assert!(m.model.validate().is_err());
        m.model.activation = Activation::FatRelu { threshold: 0.25 };
        assert_eq!(m.model.activation.apply(0.2499), 0.0);
        assert_eq!(m.model.activation.apply(0.25), 0.25);
        assert_eq!(
            Activation::DRelu.coef(Activation::DRelu.apply(2.0), -3.0),
            0.0
        );
        assert_eq!(
            Activation::DRelu.coef(Activation::DRelu.apply(2.0), 3.0),
            6.0
        );
        assert_eq!(Activation::Relu.coef(2.0, -3.0), -6.0);
    }

    #[test]
    fn chat_template_is_optional_and_round_trips() {
        let old = meta(None);
        let json = serde_json::to_value(&old).unwrap();
        assert!(
            json.get("chat_template").is_none(),
            "absent when there is none"
        );
        assert_eq!(serde_json::from_value::<Meta>(json).unwrap(), old);
        let new = meta(Some(ChatTemplate {
            template: "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}".into(),
            bos_token: Some("<s>".into()),
            eos_token: None,
        }));
        let json = serde_json::to_string(&new).unwrap();
        assert_eq!(serde_json::from_str::<Meta>(&json).unwrap(), new);
    }
}
