//! The input vector of a mat-vec in the forms the row kernels read: f32, and for block-encoded
//! weights its q8 form, made once and shared by every row (llama.cpp's `vec_dot_q4_0_q8_0` idea).

use std::cell::RefCell;

use leanstream_format::quant::{QuantType, BLOCK_LEN};

/// A vector quantized in blocks of 32: `x ≈ scales[b] · quants[i]` for `i` in block `b`. The scale is
/// kept in f32 (not f16 as in ggml's `block_q8_0`): it costs nothing here and loses less.
#[derive(Debug, Clone, Default)]
pub struct Q8Vec {
    pub(crate) quants: Vec<i8>,
    pub(crate) scales: Vec<f32>,
    /// `scales[b] · Σ quants` of each block: the term that `Q4_0`'s offset (−8) and `Q4_1`'s minimum
    /// multiply.
    pub(crate) sums: Vec<f32>,
    /// `−8 ·` the sum of each four consecutive quants (eight per block): `Q4_0`'s offset term in
    /// the lanes of the exact integer sums, so that a kernel can start a block's lanes from it and
    /// multiply the codes unsigned (`Σ (c − 8)·x = Σ c·x − 8·Σ x`, the same integers).
    pub(crate) offsets: Vec<i32>,
}

impl Q8Vec {
    /// Quantizes `x` (a whole number of blocks): `d = amax/127`, `q = round(x/d)`, so
    /// `|x − d·q| ≤ d/2`.
    pub fn quantize(x: &[f32]) -> Self {
        let mut v = Q8Vec::default();
        v.quantize_into(x);
        v
    }

    /// [`quantize`](Self::quantize) into this vector's storage: no allocation once it has held a
    /// vector as long.
    pub fn quantize_into(&mut self, x: &[f32]) {
        assert!(
            x.len().is_multiple_of(BLOCK_LEN),
            "q8 input of {} values is not a whole number of blocks",
            x.len()
        );
        self.quants.clear();
        self.quants.resize(x.len(), 0);
        self.scales.clear();
        self.sums.clear();
        self.scales.reserve(x.len() / BLOCK_LEN);
        self.sums.reserve(x.len() / BLOCK_LEN);
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            unsafe { self.quantize_avx2(x) };
            self.offsets_from_quants();
            return;
        }
        for (xb, qb) in x
            .chunks_exact(BLOCK_LEN)
            .zip(self.quants.chunks_exact_mut(BLOCK_LEN))
        {
            push_block(&mut self.scales, &mut self.sums, quantize_block(xb, qb));
        }
        self.offsets_from_quants();
    }

    /// Fills [`offsets`](Self::offsets) from the quants.
    fn offsets_from_quants(&mut self) {
        self.offsets.clear();
        self.offsets.extend(
            self.quants
                .chunks_exact(4)
                .map(|q| -8 * q.iter().map(|&v| v as i32).sum::<i32>()),
        );
    }

    /// [`quantize_into`](Self::quantize_into)'s blocks with AVX2, bit for bit: the same scale (the
    /// maximum of the magnitudes is exact in any order), the same products, sums and rounding of
    /// each value, eight at a time; a block holding a NaN or an infinity, or with a subnormal
    /// scale, whose scalar maximum or saturating conversion a vector does not reproduce, goes to
    /// [`quantize_block`].
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn quantize_avx2(&mut self, x: &[f32]) {
        use std::arch::x86_64::*;
        let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let finite = _mm256_set1_ps(f32::MAX);
        let magic = _mm256_set1_ps(MAGIC);
        // Bytes of the packed vector back in value order (see below).
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (xb, qb) in x
            .chunks_exact(BLOCK_LEN)
            .zip(self.quants.chunks_exact_mut(BLOCK_LEN))
        {
            let p = xb.as_ptr();
            let v = [0, 8, 16, 24].map(|i| _mm256_loadu_ps(p.add(i)));
            let a = v.map(|v| _mm256_and_ps(v, magnitude));
            let ok = a.map(|a| _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_LE_OQ>(a, finite)));
            if ok != [0xff; 4] {
                push_block(&mut self.scales, &mut self.sums, quantize_block(xb, qb));
                continue;
            }
            let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            if inv > f32::MAX {
                // A subnormal scale: the products overflow where the scalar conversion saturates.
                push_block(&mut self.scales, &mut self.sums, quantize_block(xb, qb));
                continue;
            }
            let inv = _mm256_set1_ps(inv);
            // Integers in −127..=127, so the truncating conversion is exact.
            let q = v.map(|v| {
                let r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v, inv), magic), magic);
                _mm256_cvttps_epi32(r)
            });
            // Packing works within 128-bit halves: 4-byte group k of the result holds values
            // 4·(k / 2) … of vector k % 4 in the low half order 0, 1, 2, 3 | 4 … 7 of the high.
            let w = _mm256_packs_epi16(
                _mm256_packs_epi32(q[0], q[1]),
                _mm256_packs_epi32(q[2], q[3]),
            );
            let bytes = _mm256_permutevar8x32_epi32(w, order);
            _mm256_storeu_si256(qb.as_mut_ptr() as *mut __m256i, bytes);
            let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)));
            push_block(&mut self.scales, &mut self.sums, (d, sum));
        }
    }

    pub fn len(&self) -> usize {
        self.quants.len()
    }

    pub fn is_empty(&self) -> bool {
        self.quants.is_empty()
    }

    /// The value of element `i` as the kernels see it.
    pub fn value(&self, i: usize) -> f32 {
        self.scales[i / BLOCK_LEN] * self.quants[i] as f32
    }
}

/// Round to nearest even by adding and removing 1.5·2²³ (exact for |v| < 2²²; the baseline target
/// has no rounding instruction, so `round_ties_even` is a libm call).
const MAGIC: f32 = 12_582_912.0;

/// One block of [`Q8Vec::quantize_into`]: `d = amax/127`, `q = round(x/d)`; returns `d` and `Σ q`.
#[inline]
fn quantize_block(xb: &[f32], qb: &mut [i8]) -> (f32, i32) {
    let amax = xb.iter().fold(0.0f32, |m, a| m.max(a.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, a) in qb.iter_mut().zip(xb) {
        // `as` saturates, so a value just past ±127 cannot wrap.
        *q = ((a * inv + MAGIC) - MAGIC) as i8;
        sum += *q as i32;
    }
    (d, sum)
}

/// Appends a block's scale `d` and its `d·Σ q`.
#[inline(always)]
fn push_block(scales: &mut Vec<f32>, sums: &mut Vec<f32>, (d, sum): (f32, i32)) {
    scales.push(d);
    sums.push(d * sum as f32);
}

thread_local! {
    /// The q8 buffers of operands this thread dropped, for the next operands it makes: every
    /// mat-vec input of a decoded token is quantized without allocating once the first tokens
    /// have grown them (each buffer only grows, to the longest input it held). A handful per
    /// thread: as many as operands live at once, at most [`SPARE_OPERANDS`].
    static SPARE: RefCell<Vec<Q8Vec>> = const { RefCell::new(Vec::new()) };
}

/// The most q8 buffers a thread keeps (a prompt chunk short of `gemm` holds up to 15 operands).
const SPARE_OPERANDS: usize = 32;

/// A mat-vec input: the f32 vector, plus its q8 form when the weights are block-encoded.
pub struct Operand<'a> {
    pub x: &'a [f32],
    q8: Option<Q8Vec>,
}

impl<'a> Operand<'a> {
    /// `x` prepared for rows encoded as `qtype`.
    pub fn new(x: &'a [f32], qtype: QuantType) -> Self {
        let q8 = qtype.is_block().then(|| {
            let mut v = SPARE
                .try_with(|s| s.borrow_mut().pop())
                .ok()
                .flatten()
                .unwrap_or_default();
            v.quantize_into(x);
            v
        });
        Self { x, q8 }
    }

    /// The q8 form; present whenever the operand was made for a block type.
    pub fn q8(&self) -> &Q8Vec {
        self.q8
            .as_ref()
            .expect("operand made for float weights used with block-encoded weights")
    }
}

impl Drop for Operand<'_> {
    fn drop(&mut self) {
        if let Some(v) = self.q8.take() {
            // `try_with`: a thread being torn down has no pool left; the buffer is then freed.
            let _ = SPARE.try_with(|s| {
                let mut spare = s.borrow_mut();
                if spare.len() < SPARE_OPERANDS {
                    spare.push(v);
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The quantizer this CPU runs gives [`quantize_block`]'s bits block by block, on blocks of
    /// every magnitude and on those it hands back to the scalar code (a NaN, an infinity, a
    /// subnormal scale, zeros).
    #[test]
    fn quantize_into_is_the_scalar_blocks_bit_for_bit() {
        let seed = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut x = Vec::new();
        for b in 0..400 {
            let scale = match b % 8 {
                0 => 0.0,
                1 => 1e-40,
                2 => 1e-37,
                3 => 1e30,
                _ => 10f32.powi(rng.random_range(-6..6)),
            };
            let mut block: Vec<f32> = (0..BLOCK_LEN)
                .map(|_| scale * rng.random_range(-1.0f32..1.0))
                .collect();
            match b % 16 {
                5 => block[rng.random_range(0..BLOCK_LEN)] = f32::NAN,
                6 => block[rng.random_range(0..BLOCK_LEN)] = f32::INFINITY,
                7 => block[3] = -0.0,
                _ => {}
            }
            x.extend(block);
        }
        let got = Q8Vec::quantize(&x);
        for (b, xb) in x.chunks_exact(BLOCK_LEN).enumerate() {
            let mut q = [0i8; BLOCK_LEN];
            let (d, sum) = quantize_block(xb, &mut q);
            let what = format!("seed {seed}: block {b}");
            assert_eq!(&got.quants[b * BLOCK_LEN..][..BLOCK_LEN], &q, "{what}");
            assert_eq!(got.scales[b].to_bits(), d.to_bits(), "{what}");
            assert_eq!(got.sums[b].to_bits(), (d * sum as f32).to_bits(), "{what}");
            for (j, four) in q.chunks_exact(4).enumerate() {
                let want = -8 * four.iter().map(|&v| v as i32).sum::<i32>();
                assert_eq!(got.offsets[8 * b + j], want, "{what}, lane {j}");
            }
        }
    }
}
