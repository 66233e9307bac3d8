//! A sign sketch of a matrix's rows, taken in a rotated basis: row `p` is kept as the signs of
//! `R·w_p` and one scale `s_p = mean |R·w_p|` (the scale that minimises `‖R·w_p − s_p·sign(R·w_p)‖₂`),
//! one bit per value, where `R` is a fixed orthogonal map ([`Rotation`]). Its dot with an input `x`
//! is `s_p · Σ sign((R·w_p)_i)·(R·x)_i`, an estimate of `w_p·x = (R·w_p)·(R·x)`. The rotated input
//! is quantized to int8 once per input (`R·x ≈ d·q`, [`SignSketch::prepare`]), so that the sum is
//! exact integer arithmetic: `Σ sign_i·q_i = 2·Σ_{bit i set} q_i − Σ q_i`, the first sum one
//! masked add per value in the kernel sets' [`RowKernels::sign_sum`](super::RowKernels) (64
//! values per instruction with AVX-512, 32 with AVX2), every set giving the same integer, so a
//! row's estimate depends only on the row and `x`.
//!
//! Why rotate: the signs of a row keep its direction well only where its values are alike in size,
//! and the FFN input of a language model puts much of its energy into a few channels, where a
//! row's sign error then dominates the estimate. The rotation spreads every channel over a whole
//! block of others (and makes the rotated rows' values alike in size), so no channel's error
//! dominates: on SmolLM2 it halves the refine mode's KL divergence at the same bits
//! (docs/results.md, "Refine sparsity").

use super::rows::{RowKernels, SignSum};

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

/// An input prepared for [`SignSketch::dot`] ([`SignSketch::prepare`]): its rotation quantized to
/// int8 and the sum of its codes. Kept between calls so that scoring does not allocate.
#[derive(Debug)]
pub struct SketchInput {
    /// `R·x ≈ scale·codes`.
    codes: Vec<i8>,
    scale: f32,
    /// `Σ codes`.
    total: i32,
    rotated: Vec<f32>,
    tmp: Vec<f32>,
    sign_sum: SignSum,
}

impl Default for SketchInput {
    fn default() -> Self {
        Self {
            codes: Vec::new(),
            scale: 0.0,
            total: 0,
            rotated: Vec::new(),
            tmp: Vec::new(),
            sign_sum: RowKernels::best().sign_sum,
        }
    }
}

/// `values ≈ d·codes`, one scale for them all: `d = max |v| / 127`, each value rounded to the
/// nearest code (ties away from zero). Returns `d`.
pub(crate) fn quantize_i8(values: &[f32], codes: &mut [i8]) -> f32 {
    let max = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let inv = if max > 0.0 { 127.0 / max } else { 0.0 };
    for (c, v) in codes.iter_mut().zip(values) {
        *c = (v * inv).round().clamp(-127.0, 127.0) as i8;
    }
    max / 127.0
}

/// `Σ_{bit i of bits set} q_i` over `q.len()` values (bit `i` is bit `i % 8` of byte `i / 8`):
/// the portable kernel, which every kernel set's must equal.
pub(crate) fn sign_sum(bits: &[u8], q: &[i8]) -> i32 {
    q.iter()
        .enumerate()
        .filter(|(i, _)| bits[i / 8] >> (i % 8) & 1 == 1)
        .map(|(_, &v)| v as i32)
        .sum()
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
    /// and quantizes the rotation to int8 (`d = max |R·x| / 127`, each value rounded to the
    /// nearest code, ties away from zero).
    pub fn prepare(&self, x: &[f32], input: &mut SketchInput) {
        assert_eq!(x.len(), self.hidden, "sketch input width");
        self.rotation.apply(x, &mut input.rotated, &mut input.tmp);
        input.codes.resize(x.len(), 0);
        input.scale = quantize_i8(&input.rotated, &mut input.codes);
        input.total = input.codes.iter().map(|&c| c as i32).sum();
    }

    /// Row `p`'s estimate of `w_p · x`, from `x` as [`SignSketch::prepare`] prepared it:
    /// `s_p · d · (2·Σ_{sign +} q − Σ q)`.
    #[inline]
    pub fn dot(&self, p: usize, input: &SketchInput) -> f32 {
        let row = &self.bits[p * self.row_bytes..(p + 1) * self.row_bytes];
        let plus = (input.sign_sum)(row, &input.codes);
        self.scale[p] * input.scale * (2 * plus - input.total) as f32
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
        // The input's codes as `prepare` makes them.
        let max = rx.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = max / 127.0;
        let codes: Vec<i32> = rx
            .iter()
            .map(|v| (v * 127.0 / max).round() as i32)
            .collect();
        let total: i32 = codes.iter().sum();
        let (mut est, mut exact) = (Vec::new(), Vec::new());
        for p in 0..rows {
            let r = &w[p * h..(p + 1) * h];
            rotation.apply(r, &mut rw, &mut tmp);
            let scale = rw.iter().map(|v| v.abs()).sum::<f32>() / h as f32;
            let plus: i32 = rw
                .iter()
                .zip(&codes)
                .filter(|(&v, _)| v > 0.0)
                .map(|(_, &c)| c)
                .sum();
            let e = s.dot(p, &input);
            let want = scale * d * (2 * plus - total) as f32;
            assert!(
                (e - want).abs() <= 1e-5 * want.abs().max(1e-3),
                "row {p}: {e} against {want}"
            );
            // Within the codes' rounding of the float signed sum.
            let signed: f32 = rw
                .iter()
                .zip(&rx)
                .map(|(&v, &xi)| if v > 0.0 { xi } else { -xi })
                .sum();
            assert!(
                (e - scale * signed).abs() <= scale * d / 2.0 * h as f32,
                "row {p}"
            );
            est.push(e as f64);
            exact.push(dot(r, &x));
        }
        // About √(2/π) for such rows.
        let corr = correlation(&est, &exact);
        assert!(corr > 0.6, "correlation {corr}");
    }

    /// Every kernel set's masked sum is the portable one's, at lengths around each set's step.
    #[test]
    fn every_kernel_set_sums_the_portable_integer() {
        for n in [0usize, 1, 7, 31, 32, 33, 63, 64, 65, 100, 576, 4096, 4100] {
            let bits: Vec<u8> = (0..n.div_ceil(8))
                .map(|i| (i * 151 % 256) as u8 ^ 0x5a)
                .collect();
            let q: Vec<i8> = (0..n).map(|i| (noise(i + 3) * 127.0) as i8).collect();
            let want = sign_sum(&bits, &q);
            let brute: i32 = (0..n)
                .filter(|&i| bits[i / 8] >> (i % 8) & 1 == 1)
                .map(|i| q[i] as i32)
                .sum();
            assert_eq!(want, brute, "n {n}");
            // Extremes: every code -127 or 127 and every bit set.
            let all = vec![0xffu8; n.div_ceil(8)];
            let big = vec![-127i8; n];
            for k in RowKernels::available() {
                assert_eq!((k.sign_sum)(&bits, &q), want, "{} n {n}", k.isa);
                assert_eq!((k.sign_sum)(&all, &big), -127 * n as i32, "{} n {n}", k.isa);
            }
        }
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
