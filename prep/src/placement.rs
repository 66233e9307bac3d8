//! Neuron placement: order a layer's neurons so that those that fire together sit together, then
//! cut the order into clusters that each fill whole 4 KiB pages. Reading one cluster then brings in
//! mostly neurons the token needs.

use ndarray::Array2;
use rayon::prelude::*;

/// At most this many tokens feed the co-activation counts (they cost `tokens × n²`).
const COACT_TOKENS: usize = 4096;

/// Greedy co-activation clustering: seed each cluster with the most frequent unplaced neuron and
/// grow it with the unplaced neuron that co-fired most often with its members (ties: frequency).
/// Frequent neurons are seeded first, so the hot set ends up packed at the front. Returns `perm`:
/// `perm[p]` is the original neuron stored at position `p`; clusters are runs of `cluster_size`
/// positions (the last may be shorter).
pub fn place(masks: &[bool], n: usize, rows: &[usize], cluster_size: usize) -> Vec<u32> {
    let sample: Vec<usize> = rows
        .iter()
        .copied()
        .step_by(rows.len().div_ceil(COACT_TOKENS).max(1))
        .collect();
    let co = coactivation(masks, n, &sample);
    let freq: Vec<f32> = (0..n).map(|j| co[[j, j]]).collect();
    let mut by_freq: Vec<usize> = (0..n).collect();
    by_freq.sort_by(|&a, &b| freq[b].total_cmp(&freq[a]).then(a.cmp(&b)));
    let mut placed = vec![false; n];
    let mut perm = Vec::with_capacity(n);
    let mut affinity = vec![0.0f32; n];
    let mut next_seed = 0;
    while perm.len() < n {
        while placed[by_freq[next_seed]] {
            next_seed += 1;
        }
        let seed = by_freq[next_seed];
        affinity.iter_mut().for_each(|a| *a = 0.0);
        let mut member = seed;
        for _ in 0..cluster_size {
            placed[member] = true;
            perm.push(member as u32);
            if perm.len() == n {
                break;
            }
            let row = co.row(member);
            let mut best = usize::MAX;
            for j in 0..n {
                if placed[j] {
                    continue;
                }
                affinity[j] += row[j];
                if best == usize::MAX
                    || affinity[j] > affinity[best]
                    || (affinity[j] == affinity[best] && freq[j] > freq[best])
                {
                    best = j;
                }
            }
            member = best;
        }
    }
    perm
}

/// How often each pair of neurons fired together on the `sample` rows (`n × n`; the diagonal:
/// how often each fired), as f32: whole numbers, so the same bits whatever order they are counted
/// in. Each neuron's activity is a bit set over the rows, and a pair's count the popcount of their
/// intersection, the rows of the matrix on every core.
fn coactivation(masks: &[bool], n: usize, sample: &[usize]) -> Array2<f32> {
    let words = sample.len().div_ceil(64);
    let mut bits = vec![0u64; n * words];
    for (i, &r) in sample.iter().enumerate() {
        for (j, _) in masks[r * n..(r + 1) * n]
            .iter()
            .enumerate()
            .filter(|(_, &a)| a)
        {
            bits[j * words + i / 64] |= 1 << (i % 64);
        }
    }
    let mut co = vec![0.0f32; n * n];
    if words > 0 {
        co.par_chunks_mut(n)
            .zip(bits.par_chunks(words))
            .for_each(|(row, a)| {
                for (c, b) in row.iter_mut().zip(bits.chunks(words)) {
                    *c = and_count(a, b) as f32;
                }
            });
    }
    Array2::from_shape_vec((n, n), co).expect("n × n counts")
}

/// The bits set in both `a` and `b`.
fn and_count(a: &[u64], b: &[u64]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("popcnt") {
        // SAFETY: the CPU has POPCNT (checked just above).
        return unsafe { and_count_popcnt(a, b) };
    }
    and_count_plain(a, b)
}

/// [`and_count`] with the POPCNT instruction (the plain build counts bits with shifts and masks).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "popcnt")]
fn and_count_popcnt(a: &[u64], b: &[u64]) -> u32 {
    and_count_plain(a, b)
}

#[inline(always)]
fn and_count_plain(a: &[u64], b: &[u64]) -> u32 {
    a.iter().zip(b).map(|(x, y)| (x & y).count_ones()).sum()
}

/// Mean fraction of active neurons among the clusters a token touches (clusters holding at least
/// one active neuron), over `rows`: how much of each read is useful.
pub fn cluster_fill(
    masks: &[bool],
    n: usize,
    rows: &[usize],
    perm: &[u32],
    cluster_size: usize,
) -> f32 {
    let (mut sum, mut touched) = (0.0f64, 0usize);
    for &r in rows {
        let row = &masks[r * n..(r + 1) * n];
        for chunk in perm.chunks(cluster_size) {
            let active = chunk.iter().filter(|&&j| row[j as usize]).count();
            if active > 0 {
                sum += active as f64 / chunk.len() as f64;
                touched += 1;
            }
        }
    }
    if touched == 0 {
        0.0
    } else {
        (sum / touched as f64) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_co_firing_neurons() {
        // Neurons {0, 3} and {1, 2} fire as pairs, alternately.
        let n = 4;
        let mut masks = Vec::new();
        for t in 0..20 {
            let a = t % 2 == 0;
            masks.extend([a, !a, !a, a]);
        }
        let rows: Vec<usize> = (0..20).collect();
        let perm = place(&masks, n, &rows, 2);
        let mut pairs: Vec<Vec<u32>> = perm
            .chunks(2)
            .map(|c| {
                let mut v = c.to_vec();
                v.sort();
                v
            })
            .collect();
        pairs.sort();
        assert_eq!(pairs, vec![vec![0, 3], vec![1, 2]]);
        assert_eq!(cluster_fill(&masks, n, &rows, &perm, 2), 1.0);
        assert_eq!(cluster_fill(&masks, n, &rows, &[0, 1, 2, 3], 2), 0.5);
    }

    /// The bit counts are the product of the 0/1 activity matrix with itself, over more rows than
    /// one word holds.
    #[test]
    fn coactivation_counts_are_the_activity_matrix_product() {
        let (n, rows) = (7, 150);
        let masks: Vec<bool> = (0..rows * n).map(|i| (i * 7919) % 13 < 5).collect();
        let sample: Vec<usize> = (0..rows).step_by(2).collect();
        let m = Array2::from_shape_fn((sample.len(), n), |(i, j)| {
            masks[sample[i] * n + j] as u8 as f32
        });
        let co = coactivation(&masks, n, &sample);
        assert_eq!(co, m.t().dot(&m));
        assert!(co[[0, 0]] > 10.0 && co[[0, 1]] > 0.0, "{co:?}");
        assert_eq!(and_count(&[0b1011, u64::MAX], &[0b0110, 1 << 63]), 2);
        assert_eq!(and_count_plain(&[0b1011], &[0b0011]), 2);
    }
}
