//! INPUT_BASIS (since 1.10): each layer's FFN input's principal directions on the calibration
//! text, which the runtime's refine sparsity scores neurons with. See FORMAT.md §9.1.

use crate::codec::{Dec, Enc};
use crate::FormatError;

/// The minor version that introduced the section.
pub const INPUT_BASIS_SINCE_MINOR: u16 = 10;

/// One layer's directions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BasisLayer {
    /// The FFN input's width (`0` with `rank = 0`).
    pub hidden: usize,
    /// Share of the calibration inputs' mean squared norm the directions hold, in `[0, 1]`.
    pub captured: f32,
    /// `rank × hidden` values: direction `k` is `vectors[k·hidden .. (k+1)·hidden]`, unit length,
    /// orthogonal to the others, strongest first.
    pub vectors: Vec<f32>,
}

impl BasisLayer {
    /// How many directions the layer has.
    pub fn rank(&self) -> usize {
        self.vectors.len().checked_div(self.hidden).unwrap_or(0)
    }

    /// Direction `k`.
    pub fn direction(&self, k: usize) -> &[f32] {
        &self.vectors[k * self.hidden..(k + 1) * self.hidden]
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct InputBasis {
    pub layers: Vec<BasisLayer>,
}

impl InputBasis {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u32(self.layers.len() as u32);
        for l in &self.layers {
            let rank = l.rank();
            assert_eq!(l.vectors.len(), rank * l.hidden, "whole directions");
            e.u32(rank as u32);
            e.u32(if rank == 0 { 0 } else { l.hidden as u32 });
            e.f32(l.captured);
            e.f32s(&l.vectors);
        }
        e.buf
    }

    pub fn decode(d: &mut Dec) -> Result<Self, FormatError> {
        let n = d.count(12)?;
        let mut layers = Vec::with_capacity(n);
        for li in 0..n {
            let rank = d.count(0)?;
            let hidden = d.count(0)?;
            let captured = d.f32()?;
            if rank > hidden || (rank == 0) != (hidden == 0) {
                return Err(d.invalid(format!("layer {li}: {rank} directions of width {hidden}")));
            }
            if !(0.0..=1.0).contains(&captured) {
                return Err(d.invalid(format!("layer {li}: captured share {captured}")));
            }
            let values = rank.checked_mul(hidden).filter(|&v| v <= d.remaining() / 4);
            let Some(values) = values else {
                return Err(d.invalid(format!(
                    "layer {li}: {rank} × {hidden} values run past the section"
                )));
            };
            let vectors = d.f32s(values)?;
            if vectors.iter().any(|v| !v.is_finite()) {
                return Err(d.invalid(format!("layer {li}: a direction is not finite")));
            }
            layers.push(BasisLayer {
                hidden,
                captured,
                vectors,
            });
        }
        Ok(Self { layers })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_basis_reads_back_and_bad_records_are_refused() {
        let basis = InputBasis {
            layers: vec![
                BasisLayer {
                    hidden: 4,
                    captured: 0.75,
                    vectors: vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.6, 0.8, 0.0],
                },
                BasisLayer::default(),
            ],
        };
        let bytes = basis.encode();
        let mut d = Dec::new(&bytes, "INPUT_BASIS");
        let back = InputBasis::decode(&mut d).unwrap();
        d.finish().unwrap();
        assert_eq!(back, basis);
        assert_eq!(back.layers[0].rank(), 2);
        assert_eq!(back.layers[0].direction(1), &[0.0, 0.6, 0.8, 0.0]);
        assert_eq!(back.layers[1].rank(), 0);

        // More directions than the width, a share above one, a NaN, a short section.
        let bad = |edit: &dyn Fn(&mut Vec<u8>)| {
            let mut b = bytes.clone();
            edit(&mut b);
            let err = InputBasis::decode(&mut Dec::new(&b, "INPUT_BASIS")).unwrap_err();
            err.to_string()
        };
        assert!(bad(&|b| b[4..8].copy_from_slice(&5u32.to_le_bytes())).contains("5 directions"));
        assert!(bad(&|b| b[12..16].copy_from_slice(&1.5f32.to_le_bytes())).contains("captured"));
        assert!(bad(&|b| b[16..20].copy_from_slice(&f32::NAN.to_le_bytes())).contains("finite"));
        assert!(bad(&|b| b.truncate(30)).contains("past the section"));
    }
}
