//! The input vector of a mat-vec in the forms the row kernels read: f32, and for block-encoded
//! weights its q8 form, made once and shared by every row (llama.cpp's `vec_dot_q4_0_q8_0` idea).

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
}

impl Q8Vec {
    /// Quantizes `x` (a whole number of blocks): `d = amax/127`, `q = round(x/d)`, so
    /// `|x − d·q| ≤ d/2`.
    pub fn quantize(x: &[f32]) -> Self {
        assert!(
            x.len().is_multiple_of(BLOCK_LEN),
            "q8 input of {} values is not a whole number of blocks",
            x.len()
        );
        let blocks = x.len() / BLOCK_LEN;
        let mut v = Q8Vec {
            quants: vec![0; x.len()],
            scales: Vec::with_capacity(blocks),
            sums: Vec::with_capacity(blocks),
        };
        for (xb, qb) in x
            .chunks_exact(BLOCK_LEN)
            .zip(v.quants.chunks_exact_mut(BLOCK_LEN))
        {
            let amax = xb.iter().fold(0.0f32, |m, a| m.max(a.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (q, a) in qb.iter_mut().zip(xb) {
                // Round to nearest even by adding and removing 1.5·2²³ (exact for |v| < 2²²; the
                // baseline target has no rounding instruction, so `round_ties_even` is a libm
                // call). `as` saturates, so a value just past ±127 cannot wrap.
                const MAGIC: f32 = 12_582_912.0;
                *q = ((a * inv + MAGIC) - MAGIC) as i8;
                sum += *q as i32;
            }
            v.scales.push(d);
            v.sums.push(d * sum as f32);
        }
        v
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

/// A mat-vec input: the f32 vector, plus its q8 form when the weights are block-encoded.
pub struct Operand<'a> {
    pub x: &'a [f32],
    q8: Option<Q8Vec>,
}

impl<'a> Operand<'a> {
    /// `x` prepared for rows encoded as `qtype`.
    pub fn new(x: &'a [f32], qtype: QuantType) -> Self {
        let q8 = qtype.is_block().then(|| Q8Vec::quantize(x));
        Self { x, q8 }
    }

    /// The q8 form; present whenever the operand was made for a block type.
    pub fn q8(&self) -> &Q8Vec {
        self.q8
            .as_ref()
            .expect("operand made for float weights used with block-encoded weights")
    }
}
