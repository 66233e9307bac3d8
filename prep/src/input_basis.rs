//! Each layer's FFN input's principal directions (FORMAT.md §9.1, INPUT_BASIS), which refine
//! sparsity scores neurons with: the part of a layer input that lies in them is scored exactly,
//! the rest by the runtime's sign sketch. A language model's FFN input puts most of its energy
//! into a few directions (a few channels alone hold a quarter to four fifths of it in SmolLM2),
//! which is where a one-bit sketch errs most.

use leanstream_format::input_basis::BasisLayer;
use rayon::prelude::*;

/// Subspace iterations: enough that the directions hold all but a sliver of the energy the
/// exact principal directions would (the subspace converges at the rate of the eigenvalue gap;
/// the energy it holds converges much faster).
const ITERATIONS: usize = 12;
/// Rows per task of a pass: partial sums are added in this order, so the result does not
/// depend on the thread count.
const CHUNK: usize = 128;

/// The directions refine sparsity takes for an FFN input of width `hidden`: a sixteenth of it,
/// a multiple of 8 from 16 to 64.
pub fn rank_for(hidden: usize) -> usize {
    ((hidden / 16) / 8 * 8).clamp(16, 64).min(hidden)
}

/// The `rank` strongest directions of `x`'s rows `rows` (`x` is `… × hidden`, row-major), by
/// subspace iteration on their second moment `Σ x·xᵀ` (not centred: what the runtime removes
/// from an input is its projection), strongest first, and the share of `Σ ‖x‖²` they hold.
pub fn principal_directions(x: &[f32], hidden: usize, rows: &[usize], rank: usize) -> BasisLayer {
    let rank = rank.min(hidden).min(rows.len());
    if rank == 0 {
        return BasisLayer::default();
    }
    // A fixed pseudo-random start (xorshift64).
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut q: Vec<Vec<f64>> = (0..rank)
        .map(|_| {
            (0..hidden)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 11) as f64 / (1u64 << 53) as f64 - 0.5
                })
                .collect()
        })
        .collect();
    orthonormalise(&mut q);
    for _ in 0..ITERATIONS {
        q = second_moment_times(x, hidden, rows, &q);
        orthonormalise(&mut q);
    }
    // Each direction's energy `Σ (q·x)²`, strongest first.
    let energy = |d: &[f64]| -> f64 {
        rows.iter()
            .map(|&r| {
                let row = &x[r * hidden..(r + 1) * hidden];
                let p: f64 = row.iter().zip(d).map(|(&a, &b)| a as f64 * b).sum();
                p * p
            })
            .sum()
    };
    let mut ranked: Vec<(f64, Vec<f64>)> = q.into_par_iter().map(|d| (energy(&d), d)).collect();
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
    let total: f64 = rows
        .iter()
        .flat_map(|&r| &x[r * hidden..(r + 1) * hidden])
        .map(|&v| v as f64 * v as f64)
        .sum();
    let held: f64 = ranked.iter().map(|(e, _)| e).sum();
    BasisLayer {
        hidden,
        captured: if total > 0.0 {
            (held / total).clamp(0.0, 1.0) as f32
        } else {
            0.0
        },
        vectors: ranked
            .iter()
            .flat_map(|(_, d)| d.iter().map(|&v| v as f32))
            .collect(),
    }
}

/// `(Σ_rows x·xᵀ)·q_k` for every direction `k`: in f32 within a chunk of rows (eight lanes, a
/// fixed order), the chunks' sums added in f64 in order.
fn second_moment_times(x: &[f32], hidden: usize, rows: &[usize], q: &[Vec<f64>]) -> Vec<Vec<f64>> {
    let rank = q.len();
    let q32: Vec<Vec<f32>> = q
        .iter()
        .map(|d| d.iter().map(|&v| v as f32).collect())
        .collect();
    let partial: Vec<Vec<f32>> = rows
        .par_chunks(CHUNK)
        .map(|chunk| {
            let mut y = vec![0.0f32; rank * hidden];
            let mut c = vec![0.0f32; rank];
            for &r in chunk {
                let row = &x[r * hidden..(r + 1) * hidden];
                for (ck, qk) in c.iter_mut().zip(&q32) {
                    *ck = dot(row, qk);
                }
                for (yk, &ck) in y.chunks_exact_mut(hidden).zip(&c) {
                    for (yi, &a) in yk.iter_mut().zip(row) {
                        *yi += ck * a;
                    }
                }
            }
            y
        })
        .collect();
    let mut y = vec![0.0f64; rank * hidden];
    for p in &partial {
        for (a, &b) in y.iter_mut().zip(p) {
            *a += b as f64;
        }
    }
    y.chunks_exact(hidden).map(<[f64]>::to_vec).collect()
}

/// `a·b` in eight lanes, added in a fixed order.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
}

/// Modified Gram–Schmidt, twice (a second pass restores orthogonality lost to rounding). A
/// direction with nothing left (the rows span fewer dimensions) becomes a unit vector
/// orthogonal to the others.
fn orthonormalise(q: &mut [Vec<f64>]) {
    let hidden = q.first().map_or(0, Vec::len);
    for k in 0..q.len() {
        for _ in 0..2 {
            for j in 0..k {
                let (done, rest) = q.split_at_mut(k);
                let d: f64 = rest[0].iter().zip(&done[j]).map(|(a, b)| a * b).sum();
                rest[0]
                    .iter_mut()
                    .zip(&done[j])
                    .for_each(|(a, b)| *a -= d * b);
            }
        }
        let norm = q[k].iter().map(|v| v * v).sum::<f64>().sqrt();
        if norm > 1e-150 {
            q[k].iter_mut().for_each(|v| *v /= norm);
        } else {
            // Try the axes in turn until one has a part outside the others.
            for axis in 0..hidden {
                let mut e = vec![0.0; hidden];
                e[axis] = 1.0;
                for done in &q[..k] {
                    let d = done[axis];
                    e.iter_mut().zip(done).for_each(|(a, b)| *a -= d * b);
                }
                let n = e.iter().map(|v| v * v).sum::<f64>().sqrt();
                if n > 0.5 {
                    q[k] = e.into_iter().map(|v| v / n).collect();
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_orthonormal(b: &BasisLayer) {
        for i in 0..b.rank() {
            for j in 0..b.rank() {
                let d: f32 = b
                    .direction(i)
                    .iter()
                    .zip(b.direction(j))
                    .map(|(x, y)| x * y)
                    .sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((d - want).abs() < 1e-5, "q{i}·q{j} = {d}");
            }
        }
    }

    /// Rows planted in a known subspace plus small noise: the directions found span it, are
    /// orthonormal, come strongest first, and hold the planted share of the energy.
    #[test]
    fn the_directions_span_the_planted_subspace() {
        let (hidden, n, rank) = (48, 600, 4);
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut noise = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f32 / (1u64 << 53) as f32 - 0.5
        };
        // Planted directions: four axes mixed by a fixed rotation of pairs, with scales 8, 4, 2, 1.
        let (c, s) = (0.6f32, 0.8f32);
        let mut planted = vec![vec![0.0f32; hidden]; rank];
        for (k, p) in planted.iter_mut().enumerate() {
            p[2 * k] = c;
            p[2 * k + 1] = if k % 2 == 0 { s } else { -s };
        }
        let scales = [8.0f32, 4.0, 2.0, 1.0];
        let mut x = vec![0.0f32; n * hidden];
        for row in x.chunks_exact_mut(hidden) {
            for (p, sc) in planted.iter().zip(scales) {
                let a = noise() * sc;
                row.iter_mut().zip(p).for_each(|(v, d)| *v += a * d);
            }
            row.iter_mut().for_each(|v| *v += 0.01 * noise());
        }
        let rows: Vec<usize> = (0..n).collect();
        let b = principal_directions(&x, hidden, &rows, rank);
        assert_eq!((b.rank(), b.hidden), (rank, hidden));
        assert_orthonormal(&b);
        // Strongest first: direction k is planted direction k (up to sign).
        for (k, p) in planted.iter().enumerate() {
            let d: f32 = b.direction(k).iter().zip(p).map(|(a, b)| a * b).sum();
            assert!(d.abs() > 0.999, "direction {k}: {d}");
        }
        assert!(b.captured > 0.999 && b.captured <= 1.0, "{}", b.captured);
        // The same rows give the same bits, and a subset of rows is respected.
        assert_eq!(principal_directions(&x, hidden, &rows, rank), b);
        let half = principal_directions(&x, hidden, &rows[..n / 2], 2);
        assert_eq!(half.rank(), 2);
        assert!(
            half.captured > 0.9 && half.captured < 1.0,
            "{}",
            half.captured
        );
    }

    /// Rows that span fewer dimensions than asked still give orthonormal directions.
    #[test]
    fn a_degenerate_input_gives_orthonormal_directions() {
        let hidden = 8;
        let x: Vec<f32> = (0..10)
            .flat_map(|i| [i as f32, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
            .collect();
        let rows: Vec<usize> = (0..10).collect();
        let b = principal_directions(&x, hidden, &rows, 3);
        assert_eq!(b.rank(), 3);
        assert!((b.direction(0)[0].abs() - 1.0).abs() < 1e-6);
        assert_orthonormal(&b);
        assert!((b.captured - 1.0).abs() < 1e-6);
        assert_eq!(principal_directions(&x, hidden, &[], 3).rank(), 0);
        assert_eq!(rank_for(576), 32);
        assert_eq!(rank_for(256), 16);
        assert_eq!(rank_for(4096), 64);
        assert_eq!(rank_for(8), 8);
    }
}
