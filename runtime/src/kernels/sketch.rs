//! A sign sketch of a matrix's rows, taken in a rotated basis: row `p` is kept as the signs of
//! `R·w_p` and one scale `s_p = mean |R·w_p|` (the scale that minimises `‖R·w_p − s_p·sign(R·w_p)‖₂`),
//! one bit per value, where `R` is a fixed orthogonal map ([`Rotation`]). Its dot with an input `x`
//! is `s_p · Σ sign((R·w_p)_i)·(R·x)_i`, an estimate of `w_p·x = (R·w_p)·(R·x)`, taken eight values at
//! a time from a table of the 256 signed sums of each eight rotated inputs
//! ([`SignSketch::prepare`]): one load and one add per byte of the sketch. The sums are taken in a
//! fixed order, so a row's estimate depends only on the row and `x`.
//!
//! Why rotate: the signs of a row keep its direction well only where its values are alike in size,
//! and the FFN input of a language model puts much of its energy into a few channels, where a
//! row's sign error then dominates the estimate. The rotation spreads every channel over a whole
//! block of others (and makes the rotated rows' values alike in size), so no channel's error
//! dominates: on SmolLM2 it halves the refine mode's KL divergence at the same bits
//! (docs/results.md, "Refine sparsity").

/// Rounds of [`Rotation`].
const ROUNDS: usize = 2;
/// The largest Walsh–Hadamard block [`Rotation`] uses.
const MAX_BLOCK: usize = 512;

/// A fixed orthogonal map of `ℝʰ`: [`ROUNDS`] rounds of random signs, a random permutation and a
/// normalised Walsh–Hadamard transform over each block of `block` consecutive values (`block` the
/// largest power of two that divides `h`, at most [`MAX_BLOCK`]). The signs and permutations come
/// from a fixed seed: every sketch of width `h` uses the same map, so one prepared input serves
/// the gate and up sketches of a layer alike. It is the runtime's own choice (sketches are built
/// when a model opens), not part of the file format.
#[derive(Debug, Clone)]
pub struct Rotation {
    /// Per round and output position: the input position it takes and that value's sign.
    rounds: [Vec<(u32, f32)>; ROUNDS],
    block: usize,
}

impl Rotation {
    pub fn new(h: usize) -> Self {
        let block = 1usize << h.trailing_zeros().min(MAX_BLOCK.trailing_zeros());
        // xorshift64: a fixed, self-contained sequence (the map must not change with a crate's
        // version).
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let rounds = std::array::from_fn(|_| {
            let signs: Vec<f32> = (0..h)
                .map(|_| if next() & 1 == 1 { -1.0 } else { 1.0 })
                .collect();
            let mut perm: Vec<u32> = (0..h as u32).collect();
            for i in (1..h).rev() {
                perm.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            perm.iter().map(|&j| (j, signs[j as usize])).collect()
        });
        Self { rounds, block }
    }

    /// `out = R·x`; `tmp` is scratch. Both are resized to `x.len()` (reused: no allocation once
    /// they have that length).
    pub fn apply(&self, x: &[f32], out: &mut Vec<f32>, tmp: &mut Vec<f32>) {
        let h = self.rounds[0].len();
        assert_eq!(x.len(), h, "rotation width");
        tmp.resize(h, 0.0);
        out.resize(h, 0.0);
        gather(x, &self.rounds[0], tmp);
        hadamard_blocks(tmp, self.block);
        gather(tmp, &self.rounds[1], out);
        hadamard_blocks(out, self.block);
    }
}

fn gather(src: &[f32], from: &[(u32, f32)], dst: &mut [f32]) {
    for (d, &(j, sign)) in dst.iter_mut().zip(from) {
        *d = sign * src[j as usize];
    }
}

/// The Walsh–Hadamard transform of each `block` values of `v`, scaled by `1/√block` (orthogonal).
fn hadamard_blocks(v: &mut [f32], block: usize) {
    let norm = 1.0 / (block as f32).sqrt();
    for b in v.chunks_exact_mut(block) {
        let mut len = 1;
        if block >= 8 {
            // The first three levels within each eight values, unrolled (the same additions).
            for c in b.chunks_exact_mut(8) {
                for (step, starts) in [(1, [0, 2, 4, 6]), (2, [0, 1, 4, 5]), (4, [0, 1, 2, 3])] {
                    for j in starts {
                        (c[j], c[j + step]) = (c[j] + c[j + step], c[j] - c[j + step]);
                    }
                }
            }
            len = 8;
        }
        while len < block {
            for pair in b.chunks_exact_mut(2 * len) {
                let (lo, hi) = pair.split_at_mut(len);
                for (a, c) in lo.iter_mut().zip(hi) {
                    (*a, *c) = (*a + *c, *a - *c);
                }
            }
            len *= 2;
        }
        b.iter_mut().for_each(|x| *x *= norm);
    }
}

/// An input prepared for [`SignSketch::dot`] ([`SignSketch::prepare`]): its rotation and the
/// table of signed sums. Kept between calls so that scoring does not allocate.
#[derive(Debug, Default)]
pub struct SketchInput {
    table: Vec<f32>,
    rotated: Vec<f32>,
    tmp: Vec<f32>,
}

/// The rows' signs (one bit per rotated value, least significant bit first, each row padded to
/// whole bytes) and scales.
#[derive(Debug, Clone)]
pub struct SignSketch {
    hidden: usize,
    row_bytes: usize,
    bits: Vec<u8>,
    scale: Vec<f32>,
    rotation: Rotation,
}

impl SignSketch {
    /// The sketch of `rows` rows of `hidden` values; `row(p, out)` writes row `p` into `out`.
    pub fn new(rows: usize, hidden: usize, mut row: impl FnMut(usize, &mut [f32])) -> Self {
        let mut s = Self::zeros(rows, hidden);
        let mut w = vec![0.0f32; hidden];
        for p in 0..rows {
            row(p, &mut w);
            s.set_row(p, &w);
        }
        s
    }

    /// A sketch of `rows` zero rows of `hidden` values, to fill with [`SignSketch::set_row`].
    pub fn zeros(rows: usize, hidden: usize) -> Self {
        let row_bytes = hidden.div_ceil(8);
        Self {
            hidden,
            row_bytes,
            bits: vec![0u8; rows * row_bytes],
            scale: vec![0.0f32; rows],
            rotation: Rotation::new(hidden),
        }
    }

    /// Sets row `p` to the sketch of `w` (`hidden` values).
    pub fn set_row(&mut self, p: usize, w: &[f32]) {
        self.set_row_with(p, w, &mut SketchInput::default());
    }

    /// [`set_row`](Self::set_row) with `scratch`'s buffers for the rotation (reused over a
    /// sketch's rows: no allocation per row).
    pub fn set_row_with(&mut self, p: usize, w: &[f32], scratch: &mut SketchInput) {
        assert_eq!(w.len(), self.hidden, "sketch row width");
        let (rotated, tmp) = (&mut scratch.rotated, &mut scratch.tmp);
        self.rotation.apply(w, rotated, tmp);
        let out = &mut self.bits[p * self.row_bytes..(p + 1) * self.row_bytes];
        // Eight partial sums of the magnitudes (one per bit position), added at the end.
        let mut sums = [0.0f64; 8];
        for (byte, chunk) in out.iter_mut().zip(rotated.chunks(8)) {
            let mut bits = 0u8;
            for (k, &v) in chunk.iter().enumerate() {
                sums[k] += v.abs() as f64;
                bits |= u8::from(v > 0.0) << k;
            }
            *byte = bits;
        }
        let sum: f64 = sums.iter().sum();
        self.scale[p] = (sum / self.hidden.max(1) as f64) as f32;
    }

    pub fn rows(&self) -> usize {
        self.scale.len()
    }

    /// Resident bytes: the signs, the scales and the rotation's tables (8 bytes per value and
    /// round).
    pub fn bytes(&self) -> usize {
        self.bits.len() + 4 * self.scale.len() + ROUNDS * 8 * self.hidden
    }

    /// Prepares `x` for [`SignSketch::dot`] of this or any sketch of the same width: rotates it
    /// and fills the table of the signed sums of each eight rotated values (entry `256·j + b` is
    /// `Σ_k ±(R·x)_{8j+k}`, `+` where bit `k` of `b` is set; values past the end count as zero).
    pub fn prepare(&self, x: &[f32], input: &mut SketchInput) {
        assert_eq!(x.len(), self.hidden, "sketch input width");
        self.rotation.apply(x, &mut input.rotated, &mut input.tmp);
        let rx = &input.rotated;
        let table = &mut input.table;
        table.clear();
        table.resize(self.row_bytes * 256, 0.0);
        for (j, t) in table.chunks_exact_mut(256).enumerate() {
            let vals: [f32; 8] = std::array::from_fn(|k| rx.get(8 * j + k).copied().unwrap_or(0.0));
            t[0] = -vals.iter().sum::<f32>();
            for b in 1..256usize {
                t[b] = t[b & (b - 1)] + 2.0 * vals[b.trailing_zeros() as usize];
            }
        }
    }

    /// Row `p`'s estimate of `w_p · x`, from `x` as [`SignSketch::prepare`] prepared it.
    #[inline]
    pub fn dot(&self, p: usize, input: &SketchInput) -> f32 {
        let table = &input.table;
        let row = &self.bits[p * self.row_bytes..(p + 1) * self.row_bytes];
        let mut acc = [0.0f32; 4];
        let mut chunks = row.chunks_exact(4);
        let mut j = 0;
        for c in &mut chunks {
            for (k, (&b, a)) in c.iter().zip(&mut acc).enumerate() {
                *a += table[(j + k) * 256 + b as usize];
            }
            j += 4;
        }
        for (k, &b) in chunks.remainder().iter().enumerate() {
            acc[k] += table[(j + k) * 256 + b as usize];
        }
        self.scale[p] * ((acc[0] + acc[1]) + (acc[2] + acc[3]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dot(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
    }

    fn correlation(a: &[f64], b: &[f64]) -> f64 {
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (ma, mb) = (mean(a), mean(b));
        let cov: f64 = a.iter().zip(b).map(|(x, y)| (x - ma) * (y - mb)).sum();
        let var = |v: &[f64], m: f64| v.iter().map(|x| (x - m).powi(2)).sum::<f64>();
        cov / (var(a, ma) * var(b, mb)).sqrt()
    }

    /// A deterministic value in [-1, 1).
    fn noise(i: usize) -> f32 {
        ((i.wrapping_mul(2654435761) % 10007) as f32 / 10007.0) * 2.0 - 1.0
    }

    /// The rotation keeps lengths and dot products (it is orthogonal), mixes every value into
    /// others, and is the same map every time.
    #[test]
    fn rotation_is_orthogonal_and_fixed() {
        for h in [576, 100, 4096, 7] {
            let r = Rotation::new(h);
            let a: Vec<f32> = (0..h).map(noise).collect();
            let b: Vec<f32> = (0..h).map(|i| noise(i + 7 * h)).collect();
            let (mut ra, mut rb, mut tmp) = (Vec::new(), Vec::new(), Vec::new());
            r.apply(&a, &mut ra, &mut tmp);
            r.apply(&b, &mut rb, &mut tmp);
            let tol = 1e-5 * (dot(&a, &a) * dot(&b, &b)).sqrt();
            assert!(
                (dot(&ra, &ra) - dot(&a, &a)).abs() < 1e-5 * dot(&a, &a),
                "h {h}: norm"
            );
            assert!((dot(&ra, &rb) - dot(&a, &b)).abs() < tol, "h {h}: dot");
            let mut again = Vec::new();
            Rotation::new(h).apply(&a, &mut again, &mut tmp);
            assert_eq!(ra, again, "h {h}: the same map");
        }
        // One channel spreads over a whole block (64 values for h = 576).
        let mut e = vec![0.0f32; 576];
        e[3] = 1.0;
        let (mut re, mut tmp) = (Vec::new(), Vec::new());
        Rotation::new(576).apply(&e, &mut re, &mut tmp);
        assert!(re.iter().filter(|v| v.abs() > 1e-3).count() >= 64);
    }

    /// The table sum equals the plain signed sum of the rotated values, and the estimate tracks
    /// the exact dot.
    #[test]
    fn sign_sketch_matches_signed_sum_and_tracks_dot() {
        let (rows, h) = (64, 96);
        let w: Vec<f32> = (0..rows * h)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * (1.0 + (i % 3) as f32))
            .collect();
        let x: Vec<f32> = (0..h).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
        let s = SignSketch::new(rows, h, |p, out| {
            out.copy_from_slice(&w[p * h..(p + 1) * h])
        });
        assert_eq!(s.rows(), rows);
        assert_eq!(s.bytes(), rows * 12 + rows * 4 + 2 * 8 * h);
        let mut input = SketchInput::default();
        s.prepare(&x, &mut input);
        let rotation = Rotation::new(h);
        let (mut rx, mut rw, mut tmp) = (Vec::new(), Vec::new(), Vec::new());
        rotation.apply(&x, &mut rx, &mut tmp);
        let (mut est, mut exact) = (Vec::new(), Vec::new());
        for p in 0..rows {
            let r = &w[p * h..(p + 1) * h];
            rotation.apply(r, &mut rw, &mut tmp);
            let scale = rw.iter().map(|v| v.abs()).sum::<f32>() / h as f32;
            let signed: f32 = rw
                .iter()
                .zip(&rx)
                .map(|(&v, &xi)| if v > 0.0 { xi } else { -xi })
                .sum();
            let e = s.dot(p, &input);
            assert!(
                (e - scale * signed).abs() <= 1e-4 * (1.0 + e.abs()),
                "row {p}"
            );
            est.push(e as f64);
            exact.push(dot(r, &x));
        }
        // About √(2/π) for such rows.
        let corr = correlation(&est, &exact);
        assert!(corr > 0.6, "correlation {corr}");
    }

    /// Against an input with a few large channels (as a language model's FFN input has) and
    /// heavy-tailed rows, the rotated sketch ranks the rows' dots far better than the signs of the
    /// rows as they are.
    #[test]
    fn rotation_helps_where_a_few_channels_dominate() {
        let (rows, h) = (400, 256);
        // Rows with heavy tails: a cube spreads the values' sizes.
        let w: Vec<f32> = (0..rows * h).map(|i| noise(i).powi(3)).collect();
        let x: Vec<f32> = (0..h)
            .map(|i| match i {
                5 => 12.0,
                77 => -9.0,
                _ => noise(i + 99_991),
            })
            .collect();
        let rotated = SignSketch::new(rows, h, |p, out| {
            out.copy_from_slice(&w[p * h..(p + 1) * h])
        });
        let mut input = SketchInput::default();
        rotated.prepare(&x, &mut input);
        let (mut with, mut without, mut exact) = (Vec::new(), Vec::new(), Vec::new());
        for p in 0..rows {
            let r = &w[p * h..(p + 1) * h];
            let scale = r.iter().map(|v| v.abs()).sum::<f32>() / h as f32;
            let signs: f32 = r.iter().zip(&x).map(|(v, xi)| xi.copysign(*v)).sum();
            without.push((scale * signs) as f64);
            with.push(rotated.dot(p, &input) as f64);
            exact.push(dot(r, &x));
        }
        let (c_with, c_without) = (correlation(&with, &exact), correlation(&without, &exact));
        assert!(
            c_with > 0.75 && c_with > c_without + 0.15,
            "rotated {c_with}, as stored {c_without}"
        );
    }
}
