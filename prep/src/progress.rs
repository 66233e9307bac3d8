//! Progress of a conversion's phases on stderr, with an estimate of the time left: one line per
//! phase redrawn in place on a terminal, plain lines (at most one every [`PLAIN_EVERY`] seconds,
//! and one when the phase ends) otherwise, so a log or a pipe gets readable text.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// The least time between two plain progress lines of one phase.
const PLAIN_EVERY: Duration = Duration::from_secs(10);

enum Shown {
    Hidden,
    Bar(ProgressBar),
    Plain { last: Instant },
}

/// One phase (a pass over the layers): `total` steps.
pub struct Phase {
    name: &'static str,
    total: usize,
    done: usize,
    start: Instant,
    shown: Shown,
}

impl Phase {
    /// Starts phase `name`; shows nothing unless `show`.
    pub fn start(show: bool, name: &'static str, total: usize) -> Self {
        let shown = match (show, std::io::stderr().is_terminal()) {
            (false, _) => Shown::Hidden,
            (true, true) => {
                let b = ProgressBar::new(total as u64);
                b.set_style(
                    ProgressStyle::with_template(&format!(
                        "{name:<18} {{bar:30}} {{pos}}/{{len}} layers  {{elapsed}} (eta {{eta}})  \
                         {{msg}}"
                    ))
                    .expect("valid template"),
                );
                Shown::Bar(b)
            }
            (true, false) => {
                eprintln!("{name}: {total} layers");
                Shown::Plain {
                    last: Instant::now(),
                }
            }
        };
        Self {
            name,
            total,
            done: 0,
            start: Instant::now(),
            shown,
        }
    }

    /// Says what the phase is doing now (the bar's message; nothing in plain lines).
    pub fn message(&self, msg: String) {
        if let Shown::Bar(b) = &self.shown {
            b.set_message(msg);
        }
    }

    /// One step done.
    pub fn step(&mut self) {
        self.done += 1;
        match &mut self.shown {
            Shown::Hidden => {}
            Shown::Bar(b) => b.inc(1),
            Shown::Plain { last } => {
                if last.elapsed() >= PLAIN_EVERY && self.done < self.total {
                    *last = Instant::now();
                    let elapsed = self.start.elapsed().as_secs_f64();
                    eprintln!(
                        "{}: {}/{} layers, {elapsed:.0} s, about {:.0} s left",
                        self.name,
                        self.done,
                        self.total,
                        eta(elapsed, self.done, self.total)
                    );
                }
            }
        }
    }

    /// Ends the phase; returns its seconds.
    pub fn finish(self) -> f64 {
        let seconds = self.start.elapsed().as_secs_f64();
        match self.shown {
            Shown::Hidden => {}
            Shown::Bar(b) => {
                b.finish_and_clear();
                eprintln!("{}: {} layers in {seconds:.1} s", self.name, self.done);
            }
            Shown::Plain { .. } => {
                eprintln!("{}: {} layers in {seconds:.1} s", self.name, self.done)
            }
        }
        seconds
    }
}

/// Seconds left after `done` of `total` steps took `elapsed` seconds, at the same pace.
fn eta(elapsed: f64, done: usize, total: usize) -> f64 {
    if done == 0 {
        return 0.0;
    }
    elapsed / done as f64 * total.saturating_sub(done) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_assumes_the_pace_so_far() {
        assert_eq!(eta(10.0, 2, 10), 40.0);
        assert_eq!(eta(10.0, 10, 10), 0.0);
        assert_eq!(eta(0.0, 0, 10), 0.0);
        let mut p = Phase::start(false, "test", 3);
        p.step();
        p.step();
        assert_eq!(p.done, 2);
        assert!(p.finish() >= 0.0);
    }
}
