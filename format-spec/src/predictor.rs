//! PREDICTORS: two tiny low-rank MLPs per layer that score which FFN neurons will be active.
//! `score = sigmoid(W2 · relu(W1 · x̂ + b1) + b2)` over the neurons in stored order, where `x̂` is
//! the input divided by its RMS (no weight). See FORMAT.md §7.

use crate::codec::{Dec, Enc};
use crate::FormatError;

/// What a predictor reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum PredictorInput {
    /// The residual stream entering `source_layer` (available before that layer's attention).
    Residual = 0,
    /// The layer's own FFN input (after attention and the FFN norm).
    FfnInput = 1,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Predictor {
    pub source_layer: u32,
    pub input: PredictorInput,
    pub input_dim: u32,
    pub rank: u32,
    pub outputs: u32,
    /// A neuron is predicted active when its score is at or above this.
    pub threshold: f32,
    /// `rank × input_dim`, row-major.
    pub w1: Vec<f32>,
    pub b1: Vec<f32>,
    /// `outputs × rank`, row-major.
    pub w2: Vec<f32>,
    pub b2: Vec<f32>,
}

impl Predictor {
    pub fn params(&self) -> usize {
        self.w1.len() + self.b1.len() + self.w2.len() + self.b2.len()
    }

    /// Sigmoid scores for one input (already RMS-normalised with [`normalise_input`]).
    pub fn scores(&self, x: &[f32]) -> Vec<f32> {
        let (d, r) = (self.input_dim as usize, self.rank as usize);
        let hidden: Vec<f32> = (0..r)
            .map(|i| {
                let row = &self.w1[i * d..(i + 1) * d];
                (row.iter().zip(x).map(|(a, b)| a * b).sum::<f32>() + self.b1[i]).max(0.0)
            })
            .collect();
        (0..self.outputs as usize)
            .map(|o| {
                let row = &self.w2[o * r..(o + 1) * r];
                let z = row.iter().zip(&hidden).map(|(a, b)| a * b).sum::<f32>() + self.b2[o];
                1.0 / (1.0 + (-z).exp())
            })
            .collect()
    }

    /// Bytes of its record in PREDICTORS (§7): the 24-byte header, then the f16 weights.
    pub fn record_bytes(&self) -> u64 {
        24 + 2 * self.params() as u64
    }

    /// Decodes one record read on its own from the file (see [`crate::LsbFile::own_predictor_extents`]).
    pub fn from_record(bytes: &[u8]) -> Result<Self, FormatError> {
        let mut d = Dec::new(bytes, "PREDICTORS");
        let p = Self::decode(&mut d)?;
        d.finish()?;
        Ok(p)
    }

    fn encode(&self, e: &mut Enc) {
        e.u32(self.source_layer);
        e.u32(self.input as u32);
        e.u32(self.input_dim);
        e.u32(self.rank);
        e.u32(self.outputs);
        e.f32(self.threshold);
        e.f16s(&self.w1);
        e.f16s(&self.b1);
        e.f16s(&self.w2);
        e.f16s(&self.b2);
    }

    fn decode(d: &mut Dec) -> Result<Self, FormatError> {
        let source_layer = d.u32()?;
        let input = match d.u32()? {
            0 => PredictorInput::Residual,
            1 => PredictorInput::FfnInput,
            v => return Err(d.invalid(format!("unknown predictor input {v}"))),
        };
        let (input_dim, rank, outputs) = (d.u32()?, d.u32()?, d.u32()?);
        let threshold = d.f32()?;
        let (di, r, o) = (input_dim as usize, rank as usize, outputs as usize);
        let n1 = r
            .checked_mul(di)
            .ok_or_else(|| d.invalid("size overflow"))?;
        let n2 = o.checked_mul(r).ok_or_else(|| d.invalid("size overflow"))?;
        Ok(Self {
            source_layer,
            input,
            input_dim,
            rank,
            outputs,
            threshold,
            w1: d.f16s(n1)?,
            b1: d.f16s(r)?,
            w2: d.f16s(n2)?,
            b2: d.f16s(o)?,
        })
    }
}

/// A predictor's input as it is trained and applied: `x / sqrt(mean(x²) + 1e-6)` (FORMAT.md §7).
pub fn normalise_input(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::new();
    normalise_input_into(x, &mut out);
    out
}

/// [`normalise_input`] into `out` (resized): no allocation once it has held as many values.
pub fn normalise_input_into(x: &[f32], out: &mut Vec<f32>) {
    let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len().max(1) as f32 + 1e-6).sqrt();
    out.clear();
    out.extend(x.iter().map(|v| v / rms));
}

/// The look-ahead and own predictor of every layer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Predictors {
    pub lookahead: Vec<Predictor>,
    pub own: Vec<Predictor>,
}

impl Predictors {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u32(self.own.len() as u32);
        for (a, b) in self.lookahead.iter().zip(&self.own) {
            a.encode(&mut e);
            b.encode(&mut e);
        }
        e.buf
    }

    pub fn decode(d: &mut Dec) -> Result<Self, FormatError> {
        let n = d.count(48)?;
        let mut p = Self::default();
        for _ in 0..n {
            p.lookahead.push(Predictor::decode(d)?);
            p.own.push(Predictor::decode(d)?);
        }
        Ok(p)
    }
}
