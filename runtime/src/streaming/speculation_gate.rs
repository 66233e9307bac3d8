//! Whether speculating pays, measured rather than assumed. Reading a layer's likely clusters
//! early hides flash latency behind compute, but the look-ahead predictor and the guesses it gets
//! wrong cost the compute thread: on this machine's emulated UFS 4.0 the embedded model decoded
//! 8 % slower with speculation, on UFS 3.1 it broke even, and a slower device or a larger model
//! tips it the other way. So leanstream times decoded tokens with and without it, interleaved,
//! and speculates while that is the faster of the two, still trying the other now and then.
//! Single token times are noisy (one slow token in a shared machine's hiccup is twice the
//! median), so each way is judged by the median of its recent tokens, and both ways are tried a
//! few times before either is preferred.

use std::time::Instant;

/// What trying the slower way may cost, as a share of the time: a probe runs every
/// `gap / PROBE_COST` tokens for a relative gap `gap` between the two ways, at most every
/// [`PROBE_MIN`] and at least every [`PROBE_MAX`] tokens, to keep both figures current.
const PROBE_COST: f64 = 0.01;
const PROBE_MIN: u64 = 8;
const PROBE_MAX: u64 = 32;
/// Recent token times kept per way; their median is the way's figure.
const WINDOW: usize = 5;
/// Tokens each way gets, alternating, before either is preferred.
const TRIALS: usize = 3;

#[derive(Debug, Default)]
pub(super) struct SpeculationGate {
    /// Seconds of recent decoded tokens without (`[0]`) and with (`[1]`) speculation, oldest
    /// first.
    recent: [Vec<f64>; 2],
    /// Decoded tokens timed each way.
    timed: [usize; 2],
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
                let recent = &mut self.recent[on as usize];
                if recent.len() == WINDOW {
                    recent.remove(0);
                }
                recent.push((now - at).as_secs_f64());
                self.timed[on as usize] += 1;
            }
            self.last_was_decode = decode;
        }
        let on = self.choose();
        self.last = Some((token, now, on));
        on
    }

    /// Both ways in turn, speculating first, until each has [`TRIALS`] tokens; then the faster
    /// way, except for a probe of the other now and then.
    fn choose(&mut self) -> bool {
        if self.timed.iter().any(|&n| n < TRIALS) {
            return self.timed[1] <= self.timed[0];
        }
        let (off, on) = (median(&self.recent[0]), median(&self.recent[1]));
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

/// The median of at most [`WINDOW`] times, sorted in a copy on the stack.
fn median(v: &[f64]) -> f64 {
    let mut copy = [0.0; WINDOW];
    let sorted = &mut copy[..v.len()];
    sorted.copy_from_slice(v);
    sorted.sort_unstable_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Feeds decoded tokens, `time(mode, i)` seconds each; returns the modes chosen.
    fn run_with(
        gate: &mut SpeculationGate,
        tokens: usize,
        time: impl Fn(bool, usize) -> f64,
    ) -> Vec<bool> {
        let mut now = Instant::now();
        let start = gate.last.map_or(0, |(t, _, _)| t + 1);
        let mut chosen = Vec::new();
        for (i, t) in (start..start + tokens).enumerate() {
            let mode = gate.begin_token_at(t, now);
            chosen.push(mode);
            now += Duration::from_secs_f64(time(mode, i));
        }
        chosen
    }

    fn run(gate: &mut SpeculationGate, tokens: usize, on: f64, off: f64) -> Vec<bool> {
        run_with(gate, tokens, |mode, _| if mode { on } else { off })
    }

    fn count(v: &[bool]) -> usize {
        v.iter().filter(|&&m| m).count()
    }

    #[test]
    fn speculates_while_it_is_faster_and_probes_the_other_way() {
        let mut g = SpeculationGate::default();
        let chosen = run(&mut g, 80, 0.001, 0.002);
        // Both tried three times at first, then on except a probe every 32 tokens.
        assert_eq!(
            &chosen[..8],
            [true, true, false, true, false, true, false, true]
        );
        assert_eq!(count(&chosen[8..]), 72 - 2, "{chosen:?}");
    }

    #[test]
    fn stops_speculating_when_that_is_slower_and_follows_a_change() {
        let mut g = SpeculationGate::default();
        let chosen = run(&mut g, 80, 0.002, 0.001);
        assert!(count(&chosen[8..]) <= 3, "{chosen:?}");
        // The device slows down: speculation starts to pay, and the probes notice.
        let chosen = run(&mut g, 200, 0.002, 0.004);
        assert!(count(&chosen[100..]) >= 95, "{chosen:?}");
    }

    #[test]
    fn one_slow_token_does_not_decide() {
        // Not speculating is faster, but the first such token hits a hiccup 10 times as long.
        let mut g = SpeculationGate::default();
        let chosen = run_with(&mut g, 64, |mode, i| match (mode, i) {
            (false, 2) => 0.010,
            (false, _) => 0.001,
            (true, _) => 0.0015,
        });
        assert!(count(&chosen[8..]) <= 3, "{chosen:?}");
    }

    #[test]
    fn a_prompt_chunk_is_not_timed() {
        let mut g = SpeculationGate::default();
        let t0 = Instant::now();
        // A chunk of rows 0..=63 (slow), then decoded tokens 64, 65.
        assert!(g.begin_token_at(63, t0));
        g.begin_token_at(64, t0 + Duration::from_secs(5));
        assert_eq!(g.timed, [0, 0], "the chunk's 5 s is not a token's time");
        g.begin_token_at(65, t0 + Duration::from_secs(5) + Duration::from_millis(1));
        assert_eq!(g.recent, [vec![], vec![0.001]]);
    }
}
