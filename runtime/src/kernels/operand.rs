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
        for (xb, qb) in x
            .chunks_exact(BLOCK_LEN)
            .zip(self.quants.chunks_exact_mut(BLOCK_LEN))
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
            self.scales.push(d);
            self.sums.push(d * sum as f32);
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
