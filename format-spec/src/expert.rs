//! EXPERT_INDEX (format 1.5): the experts of every mixture-of-experts layer. Each expert is an FFN
//! of its own whose neurons are bundles in page-aligned clusters stored in EXPERT_DATA, exactly as
//! a dense layer's are in FFN_DATA, so neuron sparsity can still apply inside an expert. An
//! expert's clusters are consecutive in EXPERT_DATA: it is read whole with one request (the unit a
//! runtime caches and evicts), or cluster by cluster. See FORMAT.md §6.5.

use crate::codec::{Dec, Enc};
use crate::ffn::{ClusterLayout, FfnLayer};
use crate::model_config::ModelConfig;
use crate::FormatError;

/// The DENSE_INDEX name of mixture layer `l`'s router (FORMAT.md §5.3).
pub fn router_name(l: usize) -> String {
    format!("model.layers.{l}.mlp.gate.weight")
}

/// Per layer, its experts in expert order (none for a layer whose FFN is dense).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExpertIndex {
    pub layers: Vec<Vec<FfnLayer>>,
}

impl ExpertIndex {
    /// Bytes of all experts' bundles, without padding.
    pub fn bundle_bytes(&self) -> u64 {
        self.layers
            .iter()
            .flatten()
            .map(|x| (x.neurons() * x.bundle_bytes()) as u64)
            .sum()
    }

    /// Offset within EXPERT_DATA and size of expert `expert` of layer `layer`: the extents of its
    /// clusters, back to back (one read fetches the whole expert).
    pub fn expert_range(&self, layer: usize, expert: usize) -> (u64, u64) {
        let clusters = &self.layers[layer][expert].clusters;
        match (clusters.first(), clusters.last()) {
            (Some(a), Some(b)) => (a.offset, b.offset + b.extent_size - a.offset),
            _ => (0, 0),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u32(self.layers.len() as u32);
        for experts in &self.layers {
            e.u32(experts.len() as u32);
            for x in experts {
                x.encode(&mut e);
            }
        }
        e.buf
    }

    /// Decodes the index and checks every expert as an FFN_INDEX layer (§6.2), with extents that
    /// tile an EXPERT_DATA section of `data_len` bytes in (layer, expert, cluster) order. `layout`
    /// is the file's (from the kind of its FFN data section).
    pub fn decode(d: &mut Dec, data_len: u64, layout: ClusterLayout) -> Result<Self, FormatError> {
        let n_layers = d.count(4)?;
        let mut layers = Vec::with_capacity(n_layers);
        let mut next = 0u64;
        for li in 0..n_layers {
            let n_experts = d.count(16)?;
            let mut experts = Vec::with_capacity(n_experts);
            for e in 0..n_experts {
                let what = format!("layer {li} expert {e}");
                experts.push(FfnLayer::decode(d, &what, &mut next, layout)?);
            }
            layers.push(experts);
        }
        if next != data_len {
            return Err(FormatError::invalid(
                "EXPERT_INDEX extents do not tile EXPERT_DATA",
            ));
        }
        Ok(Self { layers })
    }

    /// Checks the index against the configuration (§11.1): one entry per layer, `num_experts`
    /// experts of `expert_intermediate_size` neurons of width `hidden_size` in every mixture
    /// layer, none elsewhere.
    pub fn check(&self, c: &ModelConfig) -> Result<(), FormatError> {
        let Some(m) = &c.moe else {
            return Err(FormatError::invalid(
                "the file has experts (EXPERT_INDEX) but its model config has no mixture of experts",
            ));
        };
        if self.layers.len() != c.num_layers {
            return Err(FormatError::invalid(format!(
                "EXPERT_INDEX has {} layers, the model config {}",
                self.layers.len(),
                c.num_layers
            )));
        }
        for (l, experts) in self.layers.iter().enumerate() {
            let want = if c.is_moe_layer(l) { m.num_experts } else { 0 };
            if experts.len() != want {
                return Err(FormatError::invalid(format!(
                    "EXPERT_INDEX layer {l} has {} experts, the model config {want}",
                    experts.len()
                )));
            }
            if let Some(e) = experts.iter().position(|x| {
                x.neurons() != m.expert_intermediate_size || x.hidden as usize != c.hidden_size
            }) {
                return Err(FormatError::invalid(format!(
                    "EXPERT_INDEX layer {l} expert {e} disagrees with the model config ({} \
                     neurons of width {} expected)",
                    m.expert_intermediate_size, c.hidden_size
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::container::page_align;
    use crate::ffn::Cluster;
    use crate::quant::QuantType;

    /// Two layers (the first dense, no experts), the second with two experts of 3 and 2 neurons in
    /// clusters of 2.
    fn index() -> ExpertIndex {
        let bundle = 3 * 2 * 34;
        let mut next = 0;
        let mut expert = |perm: Vec<u32>| {
            let clusters = perm
                .chunks(2)
                .enumerate()
                .map(|(i, c)| {
                    let size = page_align((c.len() * bundle) as u64);
                    let cl = Cluster {
                        first: 2 * i as u32,
                        count: c.len() as u32,
                        offset: next,
                        extent_size: size,
                        checksum: 0x1234 + next,
                    };
                    next += size;
                    cl
                })
                .collect();
            FfnLayer {
                qtypes: crate::ffn::PartTypes::uniform(QuantType::Q8_0),
                hidden: 64,
                perm,
                clusters,
                layout: ClusterLayout::Split,
            }
        };
        let experts = vec![expert(vec![2, 0, 1]), expert(vec![1, 0])];
        ExpertIndex {
            layers: vec![Vec::new(), experts],
        }
    }

    fn decode(bytes: &[u8], data_len: u64) -> Result<ExpertIndex, FormatError> {
        let mut d = Dec::new(bytes, "EXPERT_INDEX");
        let v = ExpertIndex::decode(&mut d, data_len, ClusterLayout::Split)?;
        d.finish()?;
        Ok(v)
    }

    #[test]
    fn round_trips_and_locates_each_expert() {
        let x = index();
        let bytes = x.encode();
        assert_eq!(decode(&bytes, 3 * PAGE).unwrap(), x);
        // Expert 0: clusters of 2 and 1 neurons, one page each; expert 1: one page after them.
        assert_eq!(x.expert_range(1, 0), (0, 2 * PAGE));
        assert_eq!(x.expert_range(1, 1), (2 * PAGE, PAGE));
        assert_eq!(x.bundle_bytes(), 5 * 3 * 2 * 34);
    }

    const PAGE: u64 = crate::container::PAGE;

    #[test]
    fn damage_is_an_error_never_a_panic() {
        let bytes = index().encode();
        // Extents that do not tile the data section.
        assert!(decode(&bytes, 2 * PAGE).is_err());
        // Truncated or extended.
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut], 3 * PAGE).is_err(), "cut at {cut}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(decode(&long, 3 * PAGE).is_err());
        // Any flipped bit either fails or changes only a checksum or a permutation that stays
        // valid; it never panics.
        for i in 0..bytes.len() {
            for bit in [0x01, 0x80] {
                let mut bad = bytes.clone();
                bad[i] ^= bit;
                let _ = decode(&bad, 3 * PAGE);
            }
        }
        // A repeated neuron in a permutation: layer count, layer 0's expert count, layer 1's
        // expert count, then expert 0's header (16 bytes) and its perm.
        let mut bad = bytes.clone();
        let perm = 4 + 4 + 4 + 16;
        bad[perm..perm + 4].copy_from_slice(&0u32.to_le_bytes());
        let err = decode(&bad, 3 * PAGE).unwrap_err().to_string();
        assert!(err.contains("layer 1 expert 0"), "{err}");
    }

    #[test]
    fn is_checked_against_the_config() {
        let mut c: ModelConfig = serde_json::from_value(serde_json::json!({
            "architecture": "Qwen3", "activation": "Silu", "hidden_size": 64,
            "intermediate_size": 96, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
            "head_dim": 32, "vocab_size": 32, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "rope_scaling": null, "sliding_window": null,
            "tie_word_embeddings": true, "qk_norm": true, "bos_token_id": null, "eos_token_ids": [],
            "moe": { "num_experts": 2, "experts_per_token": 1, "expert_intermediate_size": 3,
                     "norm_topk_prob": false, "dense_layers": [0] }
        }))
        .unwrap();
        let mut x = index();
        // The second expert has 2 neurons, the config says 3.
        let err = x.check(&c).unwrap_err().to_string();
        assert!(err.contains("layer 1 expert 1"), "{err}");
        x.layers[1].pop();
        let err = x.check(&c).unwrap_err().to_string();
        assert!(err.contains("layer 1 has 1 experts"), "{err}");
        c.moe.as_mut().unwrap().num_experts = 1;
        x.check(&c).unwrap();
        c.moe = None;
        assert!(x.check(&c).is_err());
    }
}
