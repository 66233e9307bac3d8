//! What a streaming run did: predictor quality against the true active sets, cache behaviour,
//! reads issued, cancelled and late. The truth is the recorded trace when the run has one, else
//! what was computed — complete in certified and exact modes, only the predicted neurons in
//! predicted mode (whose recall then reads 1: give it a trace to measure it).

use serde::Serialize;

#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// FFN evaluations (token × layer).
    pub layer_steps: u64,
    pub active: u64,
    pub neurons: u64,
    pub own_hits: u64,
    pub own_predicted: u64,
    /// Active neurons of the layer steps the own predictor ran on.
    pub own_active: u64,
    pub lookahead_hits: u64,
    pub lookahead_predicted: u64,
    pub lookahead_active: u64,
    pub cluster_hits: u64,
    pub cluster_misses: u64,
    /// Clusters whose gates a decoded token computed from memory, and those of them computed in
    /// row groups (eight neurons per vector operation): kept by the cache in groups, or of a
    /// resident layer's grouped runs. (A prompt chunk copies its clusters' rows out as stored.)
    pub resident_gates: u64,
    pub grouped_gates: u64,
    pub clusters_needed: u64,
    pub clusters_total: u64,
    pub speculative_reads: u64,
    /// Tokens (or prompt chunks) on which leanstream speculated.
    pub speculating_tokens: u64,
    pub cancelled_reads: u64,
    /// Speculative reads that completed but were not needed.
    pub wasted_reads: u64,
    pub late_reads: u64,
    /// Bytes of clusters evicted when the budget shrank that were queued for reading again: what
    /// giving memory back cost in reads once it came back.
    pub reread_bytes: u64,
    /// Reads refilling the cache after the budget grew ([`super::refill`]).
    pub refill_reads: u64,
    /// Truly active clusters (token × layer), those of them in memory when their layer's input
    /// was ready, and the bytes of the others: what any policy must read at least.
    pub active_clusters: u64,
    pub active_cluster_hits: u64,
    pub active_uncached_bytes: u64,
    /// Seconds computing bundles; choosing neurons (predictors, sketch bounds, speculation);
    /// waiting for reads the computation needed.
    pub compute_s: f64,
    pub select_s: f64,
    pub stall_s: f64,
    /// Refine sparsity: neurons its sketch scored and skipped (token × layer), and the bytes of
    /// the clusters none of whose neurons it kept (not read, not computed).
    pub refine_scored: u64,
    pub refine_skipped: u64,
    pub refine_skipped_bytes: u64,
}

impl Metrics {
    /// Records one token's layer: the true active set, the own predictor's set, the look-ahead's
    /// set (if it ran) and how many clusters were needed.
    pub fn record_layer(
        &mut self,
        active: &[bool],
        own: Option<&[bool]>,
        lookahead: Option<&[bool]>,
        needed: usize,
        clusters: usize,
    ) {
        self.layer_steps += 1;
        self.neurons += active.len() as u64;
        let count = |v: &[bool]| v.iter().filter(|&&b| b).count() as u64;
        let both =
            |a: &[bool], b: &[bool]| a.iter().zip(b).filter(|(x, y)| **x && **y).count() as u64;
        let n_active = count(active);
        self.active += n_active;
        if let Some(own) = own {
            self.own_hits += both(active, own);
            self.own_predicted += count(own);
            self.own_active += n_active;
        }
        if let Some(la) = lookahead {
            self.lookahead_hits += both(active, la);
            self.lookahead_predicted += count(la);
            self.lookahead_active += n_active;
        }
        self.clusters_needed += needed as u64;
        self.clusters_total += clusters as u64;
    }

    pub fn summary(
        &self,
        tokens: u64,
        bytes_read: u64,
        requests: u64,
        io_busy: f64,
        wall_s: f64,
    ) -> Summary {
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let per_token = |v: u64| {
            if tokens == 0 {
                0.0
            } else {
                v as f64 / tokens as f64
            }
        };
        Summary {
            bytes_read_per_token: per_token(bytes_read),
            reads_per_token: per_token(requests),
            dense_bytes_read_per_token: 0.0,
            budget_changes: Vec::new(),
            cache_hit_rate: ratio(self.cluster_hits, self.cluster_hits + self.cluster_misses),
            grouped_hit_fraction: ratio(self.grouped_gates, self.resident_gates),
            whole_layers: 0,
            kv_lent_bytes: 0,
            predictor_recall: ratio(self.own_hits, self.own_active),
            predictor_precision: ratio(self.own_hits, self.own_predicted),
            lookahead_recall: ratio(self.lookahead_hits, self.lookahead_active),
            lookahead_precision: ratio(self.lookahead_hits, self.lookahead_predicted),
            active_fraction: ratio(self.active, self.neurons),
            needed_cluster_fraction: ratio(self.clusters_needed, self.clusters_total),
            active_uncached_bytes_per_token: per_token(self.active_uncached_bytes),
            read_amplification: ratio(bytes_read, self.active_uncached_bytes),
            active_hit_rate: ratio(self.active_cluster_hits, self.active_clusters),
            speculative_reads: self.speculative_reads,
            speculating_token_fraction: ratio(self.speculating_tokens, tokens),
            cancelled_reads: self.cancelled_reads,
            wasted_reads: self.wasted_reads,
            late_reads: self.late_reads,
            reread_bytes: self.reread_bytes,
            refill_reads: self.refill_reads,
            io_busy_fraction: io_busy,
            compute_busy_fraction: ratio_s(self.compute_s, wall_s),
            select_busy_fraction: ratio_s(self.select_s, wall_s),
            io_wait_fraction: ratio_s(self.stall_s, wall_s),
            refine_skipped_neuron_fraction: ratio(self.refine_skipped, self.refine_scored),
            refine_skipped_neurons_per_token: per_token(self.refine_skipped),
            refine_skipped_bytes_per_token: per_token(self.refine_skipped_bytes),
        }
    }
}

fn ratio_s(part: f64, wall: f64) -> f64 {
    if wall > 0.0 {
        part / wall
    } else {
        0.0
    }
}

/// A budget change while the model ran.
#[derive(Debug, Clone, Serialize)]
pub struct BudgetChange {
    /// Tokens computed before it was taken.
    pub at_token: u64,
    pub from: Option<u64>,
    pub to: u64,
    /// From the request to the memory returned to the OS.
    pub micros: u64,
    /// The process's resident set right after (from the OS).
    pub rss_after: Option<u64>,
    /// Which dense weights stream under the new budget.
    pub dense_streamed: super::planner::DenseStreamed,
}

/// The per-run figures printed in `--json`.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Bytes of FFN bundles read per token (the dense weights' reads are not included).
    pub bytes_read_per_token: f64,
    /// Device reads of FFN bundles per token.
    pub reads_per_token: f64,
    /// Bytes of dense weights (attention, output head, embedding rows) read per token when they
    /// stream; 0 when all are resident. Separate from `bytes_read_per_token`: the device read
    /// the sum.
    pub dense_bytes_read_per_token: f64,
    pub cache_hit_rate: f64,
    /// Layers whose bundles the cache holds whole, computed as one run each (the rest are kept
    /// cluster by cluster, or read).
    pub whole_layers: usize,
    /// Bytes of the KV cache's planned share that no sequence had reached at the end, which the
    /// neuron cache held clusters in (0 where nothing was lent).
    pub kv_lent_bytes: u64,
    /// Of the clusters whose gates decoded tokens computed from memory, the share computed in row
    /// groups (0 where the kernels have none, for the interleaved layout, or clusters of fewer
    /// than 8 neurons).
    pub grouped_hit_fraction: f64,
    pub predictor_recall: f64,
    pub predictor_precision: f64,
    pub lookahead_recall: f64,
    pub lookahead_precision: f64,
    pub active_fraction: f64,
    /// Fraction of clusters that held a candidate neuron.
    pub needed_cluster_fraction: f64,
    /// Bytes of the truly active clusters that were not in memory when their layer ran, per
    /// token: the reads no policy can avoid with this cache content.
    pub active_uncached_bytes_per_token: f64,
    /// `bytes_read / active-not-cached bytes`: 1 reads only what was needed.
    pub read_amplification: f64,
    /// Share of the truly active clusters in memory when their layer ran: unlike
    /// `cache_hit_rate` (over the clusters each policy chose to compute), the same denominator
    /// for every policy.
    pub active_hit_rate: f64,
    pub speculative_reads: u64,
    /// Share of the tokens on which leanstream found speculating worth it and did.
    pub speculating_token_fraction: f64,
    pub cancelled_reads: u64,
    pub wasted_reads: u64,
    /// Clusters needed but neither resident nor requested when the FFN input was ready.
    pub late_reads: u64,
    /// Bytes of clusters the cache gave up when the budget shrank, read again since.
    pub reread_bytes: u64,
    /// Reads that refilled the cache in the background after the budget grew.
    pub refill_reads: u64,
    pub io_busy_fraction: f64,
    /// Shares of the wall time spent computing bundles, choosing neurons (predictors, sketch
    /// bounds, speculation) and waiting for reads: what is left is attention, norms and the head.
    pub compute_busy_fraction: f64,
    pub select_busy_fraction: f64,
    pub io_wait_fraction: f64,
    /// `--sparsity refine`: the share of the neurons scored that were skipped (0 in other
    /// modes), per token the neurons skipped and the FFN bytes of the clusters skipped whole
    /// (neither read nor computed). Skipped neurons are not proven inactive: quality is traded.
    pub refine_skipped_neuron_fraction: f64,
    pub refine_skipped_neurons_per_token: f64,
    pub refine_skipped_bytes_per_token: f64,
    /// Each budget change taken so far ([`super::StreamingModel::set_budget`]).
    pub budget_changes: Vec<BudgetChange>,
}
