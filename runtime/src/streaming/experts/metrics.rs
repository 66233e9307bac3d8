//! What an expert stream counts while it runs, and the figures `run --json` reports of it.

use serde::Serialize;

/// Counters since the last reset; per layer where the look-ahead is judged.
#[derive(Clone, Debug, Default)]
pub struct ExpertCounters {
    /// Experts the routers chose (per token and layer; a prompt chunk counts each expert once).
    pub needed: u64,
    /// Of those, resident when their layer routed.
    pub hits: u64,
    /// Per layer: experts chosen on decoded tokens, of those predicted by the look-ahead, and
    /// experts predicted.
    pub chosen_by_layer: Vec<u64>,
    pub found_by_layer: Vec<u64>,
    pub predicted_by_layer: Vec<u64>,
    /// Whole experts read (on demand and speculatively) and their bytes.
    pub reads: u64,
    pub bytes: u64,
    pub speculative_reads: u64,
    /// Speculative reads withdrawn before they reached the device.
    pub cancelled: u64,
    /// Neurons of the experts run in their stored encoding (per token), and of those the ones
    /// whose up row and down column were computed (all but those a ReLU-family activation zeroes).
    pub neurons: u64,
    pub neurons_computed: u64,
}

/// The expert figures of a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ExpertSummary {
    /// Share of the chosen experts resident when their layer routed.
    pub expert_hit_rate: f64,
    /// Of the experts decoded tokens chose, the share the look-ahead (a layer's router on the
    /// residual after the previous layer's attention) had predicted.
    pub expert_lookahead_recall: f64,
    /// Of the experts the look-ahead predicted, the share chosen.
    pub expert_lookahead_precision: f64,
    /// Per layer (null where nothing predicts it: the first mixture layer, dense layers).
    pub expert_lookahead_recall_by_layer: Vec<Option<f64>>,
    pub experts_read_per_token: f64,
    /// Experts' and streamed dense weights' bytes read per token.
    pub bytes_read_per_token: f64,
    /// Of those, the dense weights' (embedding, head, attention where the budget streams them).
    pub dense_bytes_read_per_token: f64,
    pub speculative_reads: u64,
    pub cancelled_reads: u64,
    /// Of the neurons of the experts run in their stored encoding, the share computed past the
    /// gate (1 for SiLU experts; below 1 where a ReLU-family activation zeroes some, exactly).
    pub expert_neuron_fraction: f64,
    pub tokens: u64,
    pub tokens_per_s: f64,
}

fn share(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

impl ExpertCounters {
    pub fn new(layers: usize) -> Self {
        Self {
            chosen_by_layer: vec![0; layers],
            found_by_layer: vec![0; layers],
            predicted_by_layer: vec![0; layers],
            ..Self::default()
        }
    }

    pub fn summary(&self, tokens: u64, seconds: f64) -> ExpertSummary {
        let sum = |v: &[u64]| v.iter().sum::<u64>();
        let found = sum(&self.found_by_layer);
        ExpertSummary {
            expert_hit_rate: share(self.hits, self.needed),
            expert_lookahead_recall: share(found, sum(&self.chosen_by_layer)),
            expert_lookahead_precision: share(found, sum(&self.predicted_by_layer)),
            expert_lookahead_recall_by_layer: self
                .found_by_layer
                .iter()
                .zip(&self.chosen_by_layer)
                .zip(&self.predicted_by_layer)
                .map(|((&f, &c), &p)| (p > 0).then(|| share(f, c)))
                .collect(),
            experts_read_per_token: share(self.reads, tokens),
            bytes_read_per_token: share(self.bytes, tokens),
            dense_bytes_read_per_token: 0.0,
            speculative_reads: self.speculative_reads,
            cancelled_reads: self.cancelled,
            expert_neuron_fraction: share(self.neurons_computed, self.neurons),
            tokens,
            tokens_per_s: if seconds > 0.0 {
                tokens as f64 / seconds
            } else {
                0.0
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recall_and_precision_per_layer_and_overall() {
        let mut c = ExpertCounters::new(3);
        c.chosen_by_layer = vec![0, 10, 10];
        c.found_by_layer = vec![0, 8, 5];
        c.predicted_by_layer = vec![0, 10, 20];
        (c.needed, c.hits, c.reads, c.bytes) = (20, 5, 30, 3000);
        (c.neurons, c.neurons_computed) = (400, 100);
        let s = c.summary(10, 2.0);
        assert_eq!(
            s.expert_lookahead_recall_by_layer,
            [None, Some(0.8), Some(0.5)]
        );
        assert_eq!(s.expert_lookahead_recall, 13.0 / 20.0);
        assert_eq!(s.expert_lookahead_precision, 13.0 / 30.0);
        assert_eq!(s.expert_hit_rate, 0.25);
        assert_eq!(
            (s.experts_read_per_token, s.bytes_read_per_token),
            (3.0, 300.0)
        );
        assert_eq!(s.tokens_per_s, 5.0);
        assert_eq!(s.expert_neuron_fraction, 0.25);
    }
}
