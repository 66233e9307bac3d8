//! Neuron placement: order a layer's neurons so that those that fire together sit together, then
//! cut the order into clusters that each fill whole 4 KiB pages. Reading one cluster then brings in
//! mostly neurons the token needs.

use ndarray::Array2;

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
    let m = Array2::from_shape_fn((sample.len(), n), |(i, j)| {
        masks[sample[i] * n + j] as u8 as f32
    });
    let co = m.t().dot(&m);
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
}
