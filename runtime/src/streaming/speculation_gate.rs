//! Whether speculating pays, measured rather than assumed. Reading a layer's likely clusters
//! early hides flash latency behind compute, but the look-ahead predictor and the guesses it gets
//! wrong cost the compute thread: on this machine's emulated UFS 4.0 the embedded model decoded
//! 8 % slower with speculation, on UFS 3.1 it broke even, and a slower device or a larger model
//! tips it the other way. So leanstream times decoded tokens with and without it, interleaved,
//! and speculates while that is the faster of the two, still trying the other now and then.

use std::time::Instant;

/// What trying the slower way may cost, as a share of the time: a probe runs every
/// `gap / PROBE_COST` tokens for a relative gap `gap` between the two ways, at most every
/// [`PROBE_MIN`] and at least every [`PROBE_MAX`] tokens, to keep both figures current.
const PROBE_COST: f64 = 0.01;
const PROBE_MIN: u64 = 8;
const PROBE_MAX: u64 = 64;
/// Weight of a new token's time in its mode's moving average.
const WEIGHT: f64 = 0.125;

#[derive(Debug, Default)]
pub(super) struct SpeculationGate {
    /// Moving average of seconds per decoded token without (`[0]`) and with (`[1]`) speculation.
    mean: [Option<f64>; 2],
    /// Tokens since the slower way was last tried.
    since_probe: u64,
    /// The previous token: its position, when it began, whether it speculated.
    last: Option<(usize, Instant, bool)>,
    /// The previous call was one decoded token (not a prompt chunk).
    last_was_decode: bool,
}

impl SpeculationGate {
    /// The first layer of `token` begins (for a prompt chunk, `token` is its last row): records
    /// how long the previous token took and says whether this one speculates.
    pub fn begin_token(&mut self, token: usize) -> bool {
        self.begin_token_at(token, Instant::now())
    }

    fn begin_token_at(&mut self, token: usize, now: Instant) -> bool {
        if let Some((prev, at, on)) = self.last {
            let decode = token == prev + 1;
            // Only a single decoded token's time counts: a prompt chunk takes far longer.
            if decode && self.last_was_decode {
                let secs = (now - at).as_secs_f64();
                let m = &mut self.mean[on as usize];
                *m = Some(m.map_or(secs, |m| m + WEIGHT * (secs - m)));
            }
            self.last_was_decode = decode;
        }
        let on = self.choose();
        self.last = Some((token, now, on));
        on
    }

    /// Speculate first (the design's bet), then measure without; after that the faster way,
    /// except for a probe of the other now and then.
    fn choose(&mut self) -> bool {
        let [Some(off), Some(on)] = self.mean else {
            return self.mean[1].is_none();
        };
        let gap = (on - off).abs() / on.min(off).max(1e-9);
        let every = ((gap / PROBE_COST).ceil() as u64).clamp(PROBE_MIN, PROBE_MAX);
        self.since_probe += 1;
        let probe = self.since_probe >= every;
        if probe {
            self.since_probe = 0;
        }
        (on < off) != probe
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Feeds decoded tokens taking `on` or `off` seconds by mode; returns the modes chosen.
    fn run(gate: &mut SpeculationGate, tokens: usize, on: f64, off: f64) -> Vec<bool> {
        let mut now = Instant::now();
        let start = gate.last.map_or(0, |(t, _, _)| t + 1);
        let mut chosen = Vec::new();
        for t in start..start + tokens {
            let mode = gate.begin_token_at(t, now);
            chosen.push(mode);
            now += Duration::from_secs_f64(if mode { on } else { off });
        }
        chosen
    }

    #[test]
    fn speculates_while_it_is_faster_and_probes_the_other_way() {
        let mut g = SpeculationGate::default();
        let chosen = run(&mut g, 80, 0.001, 0.002);
        let on = chosen.iter().filter(|&&m| m).count();
        // Both tried at first, then on except a probe at most every 64 tokens (the gap is 100 %).
        assert!(!chosen[..4].iter().all(|&m| m), "{chosen:?}");
        assert!((77..=79).contains(&on), "{on} of 80 speculated");
    }

    #[test]
    fn stops_speculating_when_that_is_slower_and_follows_a_change() {
        let mut g = SpeculationGate::default();
        let chosen = run(&mut g, 80, 0.002, 0.001);
        let on = chosen[8..].iter().filter(|&&m| m).count();
        assert!(on <= 2, "{on} of 72 speculated");
        // The device slows down: speculation starts to pay, and the probes notice.
        let chosen = run(&mut g, 200, 0.002, 0.004);
        let on = chosen[100..].iter().filter(|&&m| m).count();
        assert!(on >= 95, "{on} of 100 speculated after the change");
    }

    #[test]
    fn a_prompt_chunk_is_not_timed() {
        let mut g = SpeculationGate::default();
        let t0 = Instant::now();
        // A chunk of rows 0..=63 (slow), then decoded tokens 64, 65.
        assert!(g.begin_token_at(63, t0));
        g.begin_token_at(64, t0 + Duration::from_secs(5));
        assert_eq!(
            g.mean,
            [None, None],
            "the chunk's 5 s is not a token's time"
        );
        g.begin_token_at(65, t0 + Duration::from_secs(5) + Duration::from_millis(1));
        assert!(g.mean.iter().flatten().all(|&m| m < 0.01), "{:?}", g.mean);
    }
}
