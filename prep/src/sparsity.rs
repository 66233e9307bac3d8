//! Which neurons count as active: ReLU's exact zero test, or a per-layer magnitude threshold on
//! the activation calibrated to skip a target fraction of neurons (CATS/TEAL style).

use leanstream::config::Activation;

/// How neurons are declared skippable.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SparsityMode {
    /// Active iff gate·x > 0: exact for ReLU models.
    Relu,
    /// Skip neurons with `|act(gate·x)|` at or below the per-layer quantile `target`.
    Threshold(f32),
}

impl SparsityMode {
    /// Parses `auto`, `relu` or `threshold:F` (`auto` is relu for ReLU models, else threshold:0.5).
    pub fn parse(s: &str, act: Activation) -> anyhow::Result<Self> {
        match s {
            "auto" if act == Activation::Relu => Ok(Self::Relu),
            "auto" => Ok(Self::Threshold(0.5)),
            "relu" if act == Activation::Relu => Ok(Self::Relu),
            "relu" => anyhow::bail!(
                "--sparsity relu needs a ReLU model; this one uses SiLU: use threshold:F"
            ),
            _ => {
                let f: f32 = s
                    .strip_prefix("threshold:")
                    .and_then(|v| v.parse().ok())
                    .filter(|f| (0.0..1.0).contains(f))
                    .ok_or_else(|| anyhow::anyhow!("--sparsity must be auto, relu or threshold:F with 0 <= F < 1, got {s:?}"))?;
                Ok(Self::Threshold(f))
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Relu => "relu",
            Self::Threshold(_) => "threshold",
        }
    }

    pub fn target(self) -> Option<f32> {
        match self {
            Self::Relu => None,
            Self::Threshold(f) => Some(f),
        }
    }
}

/// At most this many activations are sorted to find a quantile.
const QUANTILE_SAMPLE: usize = 1 << 22;

/// The layer's skip threshold from the gate pre-activations of the training rows.
pub fn threshold(
    mode: SparsityMode,
    act: Activation,
    gate: &[f32],
    n: usize,
    train_rows: &[usize],
) -> f32 {
    let SparsityMode::Threshold(target) = mode else {
        return 0.0;
    };
    let total = train_rows.len() * n;
    let stride = total.div_ceil(QUANTILE_SAMPLE).max(1);
    let mut mags: Vec<f32> = train_rows
        .iter()
        .flat_map(|&r| gate[r * n..(r + 1) * n].iter())
        .step_by(stride)
        .map(|&g| act.apply(g).abs())
        .collect();
    if mags.is_empty() {
        return 0.0;
    }
    let k = ((mags.len() as f64 * target as f64) as usize).min(mags.len() - 1);
    *mags.select_nth_unstable_by(k, f32::total_cmp).1
}

/// Activity of every (row, neuron): `|act(gate)| > threshold`.
pub fn masks(act: Activation, gate: &[f32], threshold: f32) -> Vec<bool> {
    gate.iter()
        .map(|&g| act.apply(g).abs() > threshold)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_threshold_skips_the_target_fraction() {
        let n = 100;
        let gate: Vec<f32> = (0..10 * n)
            .map(|i| ((i * 37) % 1000) as f32 / 100.0 - 5.0)
            .collect();
        let rows: Vec<usize> = (0..10).collect();
        let t = threshold(
            SparsityMode::Threshold(0.3),
            Activation::Silu,
            &gate,
            n,
            &rows,
        );
        let skipped = masks(Activation::Silu, &gate, t)
            .iter()
            .filter(|a| !**a)
            .count();
        assert!(
            (skipped as f64 / gate.len() as f64 - 0.3).abs() < 0.01,
            "{skipped}"
        );
        assert_eq!(
            threshold(SparsityMode::Relu, Activation::Relu, &gate, n, &rows),
            0.0
        );
    }

    #[test]
    fn parses_modes() {
        assert_eq!(
            SparsityMode::parse("auto", Activation::Relu).unwrap(),
            SparsityMode::Relu
        );
        assert_eq!(
            SparsityMode::parse("auto", Activation::Silu).unwrap(),
            SparsityMode::Threshold(0.5)
        );
        assert_eq!(
            SparsityMode::parse("threshold:0.7", Activation::Silu).unwrap(),
            SparsityMode::Threshold(0.7)
        );
        assert!(SparsityMode::parse("relu", Activation::Silu).is_err());
        assert!(SparsityMode::parse("threshold:1.5", Activation::Silu).is_err());
    }
}
