//! A sign sketch of a matrix's rows: row `p` is kept as the signs of its values and one scale
//! `s_p = mean |w_p|` (the scale that minimises `‖w_p − s_p·sign(w_p)‖₂`), one bit per value. Its
//! dot with an input `x` is `s_p · Σ sign(w_pi)·x_i`, taken eight values at a time from a table
//! of the 256 signed sums of each eight inputs ([`SignSketch::prepare`]): one load and one add per
//! byte of the sketch. The sums are taken in a fixed order, so a row's estimate depends only on
//! the row and `x`.

/// The rows' signs (one bit per value, least significant bit first, each row padded to whole
/// bytes) and scales.
#[derive(Debug, Clone)]
pub struct SignSketch {
    hidden: usize,
    row_bytes: usize,
    bits: Vec<u8>,
    scale: Vec<f32>,
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
        }
    }

    /// Sets row `p` to the sketch of `w` (`hidden` values).
    pub fn set_row(&mut self, p: usize, w: &[f32]) {
        assert_eq!(w.len(), self.hidden, "sketch row width");
        let out = &mut self.bits[p * self.row_bytes..(p + 1) * self.row_bytes];
        out.fill(0);
        let mut sum = 0.0f64;
        for (i, &v) in w.iter().enumerate() {
            sum += v.abs() as f64;
            if v > 0.0 {
                out[i / 8] |= 1 << (i % 8);
            }
        }
        self.scale[p] = (sum / self.hidden.max(1) as f64) as f32;
    }

    pub fn rows(&self) -> usize {
        self.scale.len()
    }

    /// Resident bytes.
    pub fn bytes(&self) -> usize {
        self.bits.len() + 4 * self.scale.len()
    }

    /// Fills `table` (reused) with the signed sums of each eight values of `x`: entry
    /// `256·j + b` is `Σ_k ±x_{8j+k}`, `+` where bit `k` of `b` is set. Values past the end count
    /// as zero.
    pub fn prepare(&self, x: &[f32], table: &mut Vec<f32>) {
        assert_eq!(x.len(), self.hidden, "sketch input width");
        table.clear();
        table.resize(self.row_bytes * 256, 0.0);
        for (j, t) in table.chunks_exact_mut(256).enumerate() {
            let vals: [f32; 8] = std::array::from_fn(|k| x.get(8 * j + k).copied().unwrap_or(0.0));
            t[0] = -vals.iter().sum::<f32>();
            for b in 1..256usize {
                t[b] = t[b & (b - 1)] + 2.0 * vals[b.trailing_zeros() as usize];
            }
        }
    }

    /// Row `p`'s estimate of `w_p · x`, from `table` as [`SignSketch::prepare`] filled it.
    #[inline]
    pub fn dot(&self, p: usize, table: &[f32]) -> f32 {
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

    /// The table sum equals the plain signed sum, and the estimate tracks the exact dot.
    #[test]
    fn sign_sketch_matches_signed_sum_and_tracks_dot() {
        let (rows, h) = (64, 100);
        let w: Vec<f32> = (0..rows * h)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * (1.0 + (i % 3) as f32))
            .collect();
        let x: Vec<f32> = (0..h).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
        let s = SignSketch::new(rows, h, |p, out| {
            out.copy_from_slice(&w[p * h..(p + 1) * h])
        });
        assert_eq!(s.rows(), rows);
        assert_eq!(s.bytes(), rows * 13 + rows * 4);
        let mut table = Vec::new();
        s.prepare(&x, &mut table);
        let (mut est, mut exact) = (Vec::new(), Vec::new());
        for p in 0..rows {
            let r = &w[p * h..(p + 1) * h];
            let scale = r.iter().map(|v| v.abs()).sum::<f32>() / h as f32;
            let signed: f32 = r
                .iter()
                .zip(&x)
                .map(|(&v, &xi)| if v > 0.0 { xi } else { -xi })
                .sum();
            let e = s.dot(p, &table);
            assert!(
                (e - scale * signed).abs() <= 1e-4 * (1.0 + e.abs()),
                "row {p}"
            );
            est.push(e as f64);
            exact.push(r.iter().zip(&x).map(|(a, b)| a * b).sum::<f32>() as f64);
        }
        // The estimate correlates with the exact dot (about √(2/π) for such rows).
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (me, mx) = (mean(&est), mean(&exact));
        let cov: f64 = est
            .iter()
            .zip(&exact)
            .map(|(a, b)| (a - me) * (b - mx))
            .sum();
        let var = |v: &[f64], m: f64| v.iter().map(|a| (a - m).powi(2)).sum::<f64>();
        let corr = cov / (var(&est, me) * var(&exact, mx)).sqrt();
        assert!(corr > 0.6, "correlation {corr}");
    }
}
