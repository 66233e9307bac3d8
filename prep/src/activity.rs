//! Activity statistics of a layer from its true active sets: how skewed activity is over neurons
//! (hot set), how much consecutive tokens share (overlap), and how strongly neighbours in stored
//! order fire together (co-activation). `convert` records them for a source model, `synth` plants
//! and then measures them, `inspect` compares the two.

use leanstream_format::meta::Activity;

use crate::placement::cluster_fill;

/// Stored positions per co-activation group.
pub const GROUP: usize = 8;

/// The statistics of `masks` (`rows × n` over all calibration rows) on `rows`, with neurons in the
/// stored order `perm`; `prev[i]` is the row before `rows[i]` in the same window, if any.
pub fn measure(
    masks: &[bool],
    n: usize,
    rows: &[usize],
    prev: &[Option<usize>],
    perm: &[u32],
) -> Activity {
    let mut freq = vec![0u64; n];
    let (mut shared, mut active) = (0u64, 0u64);
    for (&r, &p) in rows.iter().zip(prev) {
        let row = &masks[r * n..(r + 1) * n];
        for (f, &a) in freq.iter_mut().zip(row) {
            *f += a as u64;
        }
        if let Some(p) = p {
            let before = &masks[p * n..(p + 1) * n];
            active += row.iter().filter(|&&a| a).count() as u64;
            shared += row.iter().zip(before).filter(|(a, b)| **a && **b).count() as u64;
        }
    }
    Activity {
        hot10_share: hot_share(&freq, 0.1),
        token_overlap: if active == 0 {
            0.0
        } else {
            (shared as f64 / active as f64) as f32
        },
        group_fill: cluster_fill(masks, n, rows, perm, GROUP),
    }
}

/// Share of the total count held by the top `fraction` of entries.
pub fn hot_share(counts: &[u64], fraction: f64) -> f32 {
    let mut c = counts.to_vec();
    c.sort_unstable_by(|a, b| b.cmp(a));
    let top = ((c.len() as f64 * fraction).ceil() as usize).max(1);
    let total: u64 = c.iter().sum();
    if total == 0 {
        return 0.0;
    }
    (c[..top].iter().sum::<u64>() as f64 / total as f64) as f32
}

/// For each of `rows`, the row before it in the same window (rows are concatenated windows that
/// start at `starts`).
pub fn previous_rows(rows: &[usize], is_start: impl Fn(usize) -> bool) -> Vec<Option<usize>> {
    rows.iter()
        .map(|&r| (r > 0 && !is_start(r)).then(|| r - 1))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_of_a_known_pattern() {
        // 10 neurons, 4 tokens in one window: neuron 0 always active, neuron 1 on tokens 0 and 1.
        let n = 10;
        let mut masks = vec![false; 4 * n];
        for t in 0..4 {
            masks[t * n] = true;
        }
        masks[1] = true;
        masks[n + 1] = true;
        let rows: Vec<usize> = (0..4).collect();
        let prev = previous_rows(&rows, |r| r == 0);
        assert_eq!(prev, vec![None, Some(0), Some(1), Some(2)]);
        let perm: Vec<u32> = (0..n as u32).collect();
        let a = measure(&masks, n, &rows, &prev, &perm);
        // Top 10 % = 1 neuron holds 4 of 6 activations.
        assert!((a.hot10_share - 4.0 / 6.0).abs() < 1e-6);
        // Tokens 1..3 have 2 + 1 + 1 active, of which 2 + 1 + 1 were active before.
        assert!((a.token_overlap - 1.0).abs() < 1e-6);
        // Group 0 (neurons 0..8): 2/8, 2/8, 1/8, 1/8.
        assert!((a.group_fill - 6.0 / 32.0).abs() < 1e-6);
    }
}
