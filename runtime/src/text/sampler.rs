//! Next-token choice: greedy, or temperature sampling with top-k / min-p / top-p, after a
//! repetition penalty; seeded so a run can be repeated.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone)]
pub struct SamplerConfig {
    /// 0 = greedy.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `p` (1 = off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0 = off).
    pub min_p: f32,
    /// CTRL-style penalty on tokens seen in the last `repeat_last_n` tokens (1 = off).
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

pub struct Sampler {
    config: SamplerConfig,
    rng: StdRng,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Self {
        let rng = StdRng::seed_from_u64(config.seed);
        Self { config, rng }
    }

    /// Picks the next token from `logits` (modified in place); `history` holds the tokens so far.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let c = &self.config;
        if c.repeat_penalty != 1.0 {
            let recent = &history[history.len().saturating_sub(c.repeat_last_n)..];
            let mut seen = std::collections::HashSet::new();
            for &tok in recent {
                if seen.insert(tok) {
                    if let Some(l) = logits.get_mut(tok as usize) {
                        *l = if *l > 0.0 {
                            *l / c.repeat_penalty
                        } else {
                            *l * c.repeat_penalty
                        };
                    }
                }
            }
        }
        if c.temperature <= 0.0 {
            return argmax(logits);
        }
        // Candidates sorted by descending logit, cut by top-k, turned into probabilities.
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        if c.top_k > 0 && c.top_k < cand.len() {
            cand.select_nth_unstable_by(c.top_k - 1, |a, b| b.1.total_cmp(&a.1));
            cand.truncate(c.top_k);
        }
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
        let max = cand[0].1;
        let mut total = 0.0f64;
        for (_, l) in cand.iter_mut() {
            *l = (((*l - max) / c.temperature) as f64).exp() as f32;
            total += *l as f64;
        }
        if c.min_p > 0.0 {
            // The most likely candidate has weight 1: keep weights of at least `min_p`.
            let keep = cand.partition_point(|&(_, p)| p >= c.min_p).max(1);
            cand.truncate(keep);
            total = cand.iter().map(|(_, p)| *p as f64).sum();
        }
        if c.top_p < 1.0 {
            let mut cum = 0.0f64;
            let keep = cand
                .iter()
                .position(|(_, p)| {
                    cum += *p as f64 / total;
                    cum >= c.top_p as f64
                })
                .map_or(cand.len(), |i| i + 1);
            cand.truncate(keep);
            total = cand.iter().map(|(_, p)| *p as f64).sum();
        }
        let mut r = self.rng.random::<f64>() * total;
        for &(tok, p) in &cand {
            r -= p as f64;
            if r < 0.0 {
                return tok;
            }
        }
        cand.last().expect("vocabulary is not empty").0
    }
}

/// Index of the largest value (the first one on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.5, -1.0, 0.0]
    }

    fn sampler(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Sampler {
        Sampler::new(SamplerConfig {
            temperature,
            top_k,
            top_p,
            seed,
            ..Default::default()
        })
    }

    #[test]
    fn greedy_and_degenerate_filters_pick_the_argmax() {
        assert_eq!(sampler(0.0, 0, 1.0, 0).sample(&mut logits(), &[]), 1);
        for seed in 0..20 {
            assert_eq!(sampler(1.0, 1, 1.0, seed).sample(&mut logits(), &[]), 1);
            assert_eq!(sampler(1.0, 0, 0.01, seed).sample(&mut logits(), &[]), 1);
        }
    }

    #[test]
    fn same_seed_same_tokens() {
        let run = |seed| {
            let mut s = sampler(1.0, 0, 1.0, seed);
            (0..50)
                .map(|_| s.sample(&mut logits(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn frequencies_follow_softmax_and_top_k() {
        let mut s = sampler(1.0, 3, 1.0, 42);
        let n = 20000;
        let mut counts = [0usize; 5];
        for _ in 0..n {
            counts[s.sample(&mut logits(), &[]) as usize] += 1;
        }
        // top-3 keeps tokens 1, 2, 0 with softmax weights e^3, e^2.5, e^1.
        let z = 3f64.exp() + 2.5f64.exp() + 1f64.exp();
        for (tok, w) in [(1, 3f64.exp()), (2, 2.5f64.exp()), (0, 1f64.exp())] {
            let got = counts[tok] as f64 / n as f64;
            assert!(
                (got - w / z).abs() < 0.015,
                "token {tok}: {got} vs {}",
                w / z
            );
        }
        assert_eq!(counts[3] + counts[4], 0);
    }

    #[test]
    fn top_p_keeps_the_smallest_sufficient_set() {
        // Probabilities ≈ [0.12, 0.50, 0.30, 0.02, 0.05]: p = 0.7 keeps tokens 1 and 2 only.
        let mut s = sampler(1.0, 0, 0.7, 1);
        for _ in 0..2000 {
            let tok = s.sample(&mut logits(), &[]);
            assert!(tok == 1 || tok == 2, "{tok}");
        }
    }

    #[test]
    fn min_p_drops_tokens_below_a_share_of_the_best() {
        // Probabilities ∝ e^[1, 3, 2.5, -1, 0]: relative to token 1, token 2 has e^-0.5 ≈ 0.61,
        // token 0 e^-2 ≈ 0.14, tokens 4 and 3 less. min_p = 0.5 keeps 1 and 2; 0.1 adds 0.
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            min_p: 0.5,
            seed: 3,
            ..Default::default()
        });
        let mut seen = [0usize; 5];
        for _ in 0..2000 {
            seen[s.sample(&mut logits(), &[]) as usize] += 1;
        }
        assert_eq!((seen[0], seen[3], seen[4]), (0, 0, 0), "{seen:?}");
        assert!(seen[1] > seen[2] && seen[2] > 400, "{seen:?}");
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            min_p: 0.1,
            seed: 3,
            ..Default::default()
        });
        let mut seen = [0usize; 5];
        for _ in 0..4000 {
            seen[s.sample(&mut logits(), &[]) as usize] += 1;
        }
        assert_eq!((seen[3], seen[4]), (0, 0), "{seen:?}");
        assert!(seen[0] > 100, "{seen:?}");
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut s = Sampler::new(SamplerConfig {
            repeat_penalty: 1.5,
            ..Default::default()
        });
        // 3.0 / 1.5 = 2.0 < 2.5, so token 2 wins once token 1 was seen.
        assert_eq!(s.sample(&mut logits(), &[1]), 2);
        assert_eq!(s.sample(&mut logits(), &[3]), 1);
    }
}
