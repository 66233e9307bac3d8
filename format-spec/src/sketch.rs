//! SKETCH: a low-bit copy of every layer's gate rows, kept in DRAM, with a per-neuron error norm
//! so that a neuron can be proven inactive without reading its bundle:
//! `|gate·x − sketch·x| ≤ err_norm · ‖x‖₂`. A layer with no neurons has no certificate (1.3).
//! See FORMAT.md §8.

use crate::codec::{Dec, Enc};
use crate::quant::{row_bytes, QuantType};
use crate::FormatError;

#[derive(Debug, Clone, PartialEq)]
pub struct SketchLayer {
    pub qtype: QuantType,
    pub hidden: u32,
    /// One encoded row per neuron, in stored order.
    pub rows: Vec<u8>,
    /// `‖gate_bundle − gate_sketch‖₂` per neuron, in stored order, where `gate_bundle` is the gate
    /// row as decoded from the neuron's bundle.
    pub err_norm: Vec<f32>,
}

impl SketchLayer {
    pub fn row(&self, p: usize) -> &[u8] {
        let rb = row_bytes(self.qtype, self.hidden as usize).expect("validated at decode");
        &self.rows[p * rb..(p + 1) * rb]
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sketch {
    pub layers: Vec<SketchLayer>,
}

impl Sketch {
    pub fn bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| (l.rows.len() + 4 * l.err_norm.len()) as u64)
            .sum()
    }

    /// The lowest minor format version this section needs: 1.3 when a layer has no certificate.
    pub fn minor_version(&self) -> u16 {
        if self.layers.iter().any(|l| l.err_norm.is_empty()) {
            3
        } else {
            1
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u32(self.layers.len() as u32);
        for l in &self.layers {
            e.u32(l.qtype as u32);
            e.u32(l.hidden);
            e.u32(l.err_norm.len() as u32);
            e.bytes(&l.rows);
            e.f32s(&l.err_norm);
        }
        e.buf
    }

    pub fn decode(d: &mut Dec) -> Result<Self, FormatError> {
        let n = d.count(12)?;
        let mut layers = Vec::with_capacity(n);
        for _ in 0..n {
            let qtype = QuantType::from_u32(d.u32()?)?;
            let hidden = d.u32()?;
            let neurons = d.count(4)?;
            let rb = row_bytes(qtype, hidden as usize)?;
            let rows = d.bytes(
                neurons
                    .checked_mul(rb)
                    .ok_or_else(|| d.invalid("size overflow"))?,
            )?;
            let err_norm = d.f32s(neurons)?;
            layers.push(SketchLayer {
                qtype,
                hidden,
                rows,
                err_norm,
            });
        }
        Ok(Self { layers })
    }
}
