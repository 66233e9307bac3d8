//! The rule that decides whether an FFN neuron counts for a token (FORMAT.md §4.1
//! `sparsity_rule`). A neuron's whole contribution is `act(g)·u·d` (`g = gate·x`, `u = up·x`, `d`
//! its down column); the rule compares a score with the layer's threshold:
//! - `gate`: `|act(g)|` — decided before the up projection, so a skipped neuron saves the up and
//!   down work (ReLU models, where `relu(g) = 0` is exact, and files before format 1.3);
//! - `gate_up`: `|act(g)·u|` — the neuron's coefficient on its down column. It ranks SwiGLU neurons
//!   by what they add far better than `|silu(g)|` alone, but `u` must be computed, so a skipped
//!   neuron saves only the down projection (and, in predicted mode, the read).
//!
//! Every path that computes a sparse FFN — the bundle kernel, the certificate, the converter's
//! calibration — applies the rule through [`Skip`], so they agree bit for bit.

use crate::source::config::Activation;

/// What a neuron's skip test measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipRule {
    Gate,
    GateUp,
}

impl SkipRule {
    /// The META spelling; an absent key means `gate` (files before 1.3).
    pub fn parse(name: Option<&str>) -> Option<Self> {
        match name {
            None | Some("gate") => Some(Self::Gate),
            Some("gate_up") => Some(Self::GateUp),
            Some(_) => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Gate => "gate",
            Self::GateUp => "gate_up",
        }
    }
}

/// One layer's skip test: a neuron is active iff its score exceeds `threshold`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Skip {
    pub act: Activation,
    pub rule: SkipRule,
    pub threshold: f32,
}

impl Skip {
    /// The score when the rule needs only the gate (`None` under `gate_up`).
    #[inline(always)]
    pub fn gate_score(&self, a: f32) -> Option<f32> {
        match self.rule {
            SkipRule::Gate => Some(a.abs()),
            SkipRule::GateUp => None,
        }
    }

    /// The score of a neuron with activation `a = act(g)` and up value `u` (under `gate_up`, its
    /// coefficient's magnitude, [`Activation::coef`]).
    #[inline(always)]
    pub fn score(&self, a: f32, u: f32) -> f32 {
        match self.rule {
            SkipRule::Gate => a.abs(),
            SkipRule::GateUp => self.act.coef(a, u).abs(),
        }
    }

    #[inline(always)]
    pub fn active(&self, score: f32) -> bool {
        score > self.threshold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_score_and_parse() {
        let gate = Skip {
            act: Activation::Silu,
            rule: SkipRule::Gate,
            threshold: 0.5,
        };
        let gate_up = Skip {
            rule: SkipRule::GateUp,
            ..gate
        };
        assert_eq!(gate.score(-0.75, 10.0), 0.75);
        assert_eq!(gate.gate_score(-0.75), Some(0.75));
        assert_eq!(gate_up.score(-0.75, 0.5), 0.375);
        assert_eq!(gate_up.gate_score(-0.75), None);
        assert!(gate.active(0.75) && !gate_up.active(0.375) && !gate.active(0.5));
        assert_eq!(SkipRule::parse(None), Some(SkipRule::Gate));
        assert_eq!(SkipRule::parse(Some("gate_up")), Some(SkipRule::GateUp));
        assert_eq!(SkipRule::parse(Some("both")), None);
        for r in [SkipRule::Gate, SkipRule::GateUp] {
            assert_eq!(SkipRule::parse(Some(r.name())), Some(r));
        }
    }
}
