//! Independent correctness harness: tiny random HF models and an f64 reference forward.

pub mod cli;
pub mod converted;
pub mod gguf;
pub mod reference;
pub mod tiny;

use std::path::{Path, PathBuf};

/// Tolerance on `max|Δ| / max|ref|` for logits compared with the f64 reference.
pub const LOGIT_TOL: f64 = 1e-4;

/// `max|Δ| / max|ref|` over all positions and vocab entries; panics on a shape mismatch
/// because that is a harness bug, not a numerical disagreement.
pub fn max_rel_diff(reference: &[Vec<f64>], other: &[Vec<f64>]) -> f64 {
    assert_eq!(
        reference.len(),
        other.len(),
        "different number of positions"
    );
    let mut max_ref = 0.0f64;
    let mut max_d = 0.0f64;
    for (r, o) in reference.iter().zip(other) {
        assert_eq!(r.len(), o.len(), "different row length");
        for (a, b) in r.iter().zip(o) {
            max_ref = max_ref.max(a.abs());
            let d = (a - b).abs();
            // NaN must fail the comparison, not vanish in `max`.
            max_d = if d.is_nan() {
                f64::INFINITY
            } else {
                max_d.max(d)
            };
        }
    }
    max_d / max_ref
}

/// Splits a flat row-major `[T * vocab]` f32 buffer into f64 rows.
pub fn rows_f64(flat: &[f32], vocab: usize) -> Vec<Vec<f64>> {
    assert_eq!(flat.len() % vocab, 0, "buffer not a multiple of vocab");
    flat.chunks_exact(vocab)
        .map(|r| r.iter().map(|&v| v as f64).collect())
        .collect()
}

/// This test process's scratch directory, `$TMPDIR/{prefix}-{pid}`. Test binaries have no
/// teardown, so each run first removes the directories earlier runs of the same prefix left
/// behind (on Linux, those whose process is gone); a live run's directory is never touched.
pub fn scratch_dir(prefix: &str) -> PathBuf {
    let tmp = std::env::temp_dir();
    if Path::new("/proc/self").exists() {
        let stale = std::fs::read_dir(&tmp).into_iter().flatten().flatten();
        for entry in stale {
            let name = entry.file_name();
            let pid = name
                .to_str()
                .and_then(|n| n.strip_prefix(prefix)?.strip_prefix('-'))
                .filter(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()));
            if pid.is_some_and(|pid| !Path::new("/proc").join(pid).exists()) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    let d = tmp.join(format!("{prefix}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("create the test's scratch directory");
    d
}

/// A fresh (emptied) directory `base/name` for one test's model.
pub fn fresh_dir(base: &Path, name: &str) -> PathBuf {
    let d = base.join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create test dir");
    d
}

/// Logit spread statistics `(std, mean max softmax prob)`; used to show a model is not trivial.
pub fn logit_stats(logits: &[Vec<f64>]) -> (f64, f64) {
    let n: usize = logits.iter().map(Vec::len).sum();
    let mean = logits.iter().flatten().sum::<f64>() / n as f64;
    let var = logits
        .iter()
        .flatten()
        .map(|v| (v - mean).powi(2))
        .sum::<f64>()
        / n as f64;
    let mut pmax = 0.0;
    for row in logits {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
        pmax += 1.0 / z;
    }
    (var.sqrt(), pmax / logits.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::max_rel_diff;

    #[test]
    fn nan_counts_as_infinite_difference() {
        let r = vec![vec![1.0, -2.0]];
        assert_eq!(max_rel_diff(&r, &[vec![1.0, -2.0]]), 0.0);
        assert_eq!(max_rel_diff(&r, &[vec![1.0, -1.0]]), 0.5);
        assert!(max_rel_diff(&r, &[vec![f64::NAN, -2.0]]).is_infinite());
    }
}
