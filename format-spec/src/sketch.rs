//! SKETCH: a low-bit copy of every layer's gate rows with a per-neuron error norm, so that a
//! neuron can be proven inactive without reading its bundle:
//! `|gate·x − sketch·x| ≤ err_norm · ‖x‖₂`. A layer with no neurons has no certificate (1.3).
//! See FORMAT.md §8.
//!
//! A certificate often costs more DRAM than it saves in reads (SmolLM2 q4: 27 MiB of sketch against
//! 44 MiB of FFN bundles), and the runtime keeps only the layers whose certificate earns its bytes.
//! So opening a file reads no rows: [`SketchIndex`] records each layer's shape, place and hash, and
//! [`crate::LsbFile::read_sketch_layer`] reads a layer when it is kept. [`Sketch`] is the whole
//! section in memory, as writers build it.

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

/// The whole section, as a writer builds it.
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
}

/// The section as opened: every layer's shape and where its rows lie.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SketchIndex {
    pub layers: Vec<SketchEntry>,
}

/// One layer of [`SketchIndex`].
#[derive(Debug, Clone, PartialEq)]
pub struct SketchEntry {
    pub qtype: QuantType,
    pub hidden: u32,
    /// `0`: the layer has no certificate.
    pub neurons: u32,
    stored: Stored,
}

#[derive(Debug, Clone, PartialEq)]
enum Stored {
    /// At this file offset (the rows, then the error norms), with the XXH3-64 of those bytes
    /// taken while the section's checksum was verified.
    InFile { offset: u64, hash: u64 },
    /// Decoded when the file was opened: a zstd-encoded section cannot be read in part.
    Decoded(Box<SketchLayer>),
}

impl SketchIndex {
    /// Bytes of every layer's rows and error norms.
    pub fn bytes(&self) -> u64 {
        self.layers.iter().map(SketchEntry::bytes).sum()
    }

    /// Reads the section's layer records, skipping (and hashing) their rows and error norms.
    /// `base` is the file offset of the section's first byte when it is stored raw; `None` when
    /// `d` decompresses it, in which case the layers are decoded whole.
    pub fn decode(d: &mut Dec, base: Option<u64>) -> Result<Self, FormatError> {
        let n = d.count(12)?;
        let mut layers = Vec::with_capacity(n);
        for _ in 0..n {
            let qtype = QuantType::from_u32(d.u32()?)?;
            let hidden = d.u32()?;
            let neurons = d.count(4)?;
            let rb = row_bytes(qtype, hidden as usize)?;
            let rows = neurons
                .checked_mul(rb)
                .ok_or_else(|| d.invalid("size overflow"))?;
            let stored = match base {
                Some(base) => {
                    let offset = base + d.position() as u64;
                    let len = rows
                        .checked_add(4 * neurons)
                        .ok_or_else(|| d.invalid("size overflow"))?;
                    let hash = d.skip_hashed(len)?;
                    Stored::InFile { offset, hash }
                }
                None => Stored::Decoded(Box::new(SketchLayer {
                    qtype,
                    hidden,
                    rows: d.bytes(rows)?,
                    err_norm: d.f32s(neurons)?,
                })),
            };
            layers.push(SketchEntry {
                qtype,
                hidden,
                neurons: neurons as u32,
                stored,
            });
        }
        Ok(Self { layers })
    }
}

impl SketchEntry {
    /// Bytes of the layer's rows and error norms.
    pub fn bytes(&self) -> u64 {
        let rb = row_bytes(self.qtype, self.hidden as usize).expect("validated at decode");
        self.neurons as u64 * (rb as u64 + 4)
    }

    /// The layer, its rows and error norms read with `read(offset, len)` where the file holds
    /// them (two reads, so the rows are not copied) and checked against the hash taken at open.
    pub(crate) fn load(
        &self,
        mut read: impl FnMut(u64, u64) -> Result<Vec<u8>, FormatError>,
    ) -> Result<SketchLayer, FormatError> {
        let (offset, hash) = match &self.stored {
            Stored::Decoded(layer) => return Ok((**layer).clone()),
            Stored::InFile { offset, hash } => (*offset, *hash),
        };
        let n = self.neurons as u64;
        let rows_len = self.bytes() - 4 * n;
        let rows = read(offset, rows_len)?;
        let err = read(offset + rows_len, 4 * n)?;
        let mut h = crate::container::Checksum::new();
        h.update(&rows);
        h.update(&err);
        if h.digest() != hash {
            return Err(FormatError::Checksum {
                what: "a layer of the SKETCH section (the file changed since it was opened)"
                    .to_string(),
            });
        }
        let err_norm = Dec::new(&err, "SKETCH").f32s(n as usize)?;
        Ok(SketchLayer {
            qtype: self.qtype,
            hidden: self.hidden,
            rows,
            err_norm,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sketch() -> Sketch {
        let layer = |neurons: usize, seed: u8| SketchLayer {
            qtype: QuantType::Q8_0,
            hidden: 64,
            rows: (0..neurons * 68)
                .map(|i| (i as u8).wrapping_mul(seed))
                .collect(),
            err_norm: (0..neurons).map(|i| i as f32 * 0.5 + seed as f32).collect(),
        };
        Sketch {
            layers: vec![layer(3, 7), layer(0, 1), layer(5, 13)],
        }
    }

    #[test]
    fn an_index_loads_the_layers_the_writer_wrote_from_raw_and_from_decompressed_bytes() {
        let s = sketch();
        // Placed at file offset 4096, as in a file.
        let mut file = vec![0u8; 4096];
        file.extend(s.encode());
        let index =
            SketchIndex::decode(&mut Dec::new(&file[4096..], "SKETCH"), Some(4096)).unwrap();
        assert_eq!(index.bytes(), s.bytes());
        let read =
            |offset: u64, len: u64| Ok(file[offset as usize..(offset + len) as usize].to_vec());
        for (entry, layer) in index.layers.iter().zip(&s.layers) {
            assert_eq!(entry.neurons as usize, layer.err_norm.len());
            assert_eq!(&entry.load(read).unwrap(), layer);
        }
        let encoded = s.encode();
        let whole = SketchIndex::decode(&mut Dec::new(&encoded, "SKETCH"), None).unwrap();
        let unused = |_: u64, _: u64| -> Result<Vec<u8>, FormatError> { unreachable!() };
        for (entry, layer) in whole.layers.iter().zip(&s.layers) {
            assert_eq!(&entry.load(unused).unwrap(), layer);
        }
    }

    #[test]
    fn a_layer_changed_after_opening_is_refused() {
        let s = sketch();
        let mut file = s.encode();
        let index = SketchIndex::decode(&mut Dec::new(&file, "SKETCH"), Some(0)).unwrap();
        let last = file.len() - 1;
        file[last] ^= 1;
        let read =
            |offset: u64, len: u64| Ok(file[offset as usize..(offset + len) as usize].to_vec());
        assert!(matches!(
            index.layers[2].load(read),
            Err(FormatError::Checksum { .. })
        ));
        // The first layer's bytes did not change.
        assert_eq!(index.layers[0].load(read).unwrap(), s.layers[0]);
    }
}
