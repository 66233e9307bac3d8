//! DENSE_INDEX: the table of non-FFN tensors (embeddings, attention, norms, output head) stored in
//! DENSE_DATA, one page-aligned, checksummed extent each. See FORMAT.md §5.

use crate::codec::{Dec, Enc};
use crate::quant::{row_bytes, QuantType};
use crate::FormatError;

#[derive(Debug, Clone, PartialEq)]
pub struct DenseTensor {
    /// Hugging Face tensor name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    pub qtype: QuantType,
    /// `[rows, cols]`, or `[len]` for vectors; rows are encoded one after another.
    pub shape: Vec<u64>,
    /// Offset of the extent within DENSE_DATA.
    pub offset: u64,
    /// Bytes of encoded data at the start of the extent.
    pub size: u64,
    /// Bytes of the extent (`size` rounded up to whole pages).
    pub extent_size: u64,
    /// XXH3-64 of the whole extent.
    pub checksum: u64,
}

impl DenseTensor {
    pub fn rows(&self) -> usize {
        if self.shape.len() == 2 {
            self.shape[0] as usize
        } else {
            1
        }
    }

    pub fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&0) as usize
    }

    /// The encoded size its shape and type imply.
    pub fn expected_size(&self) -> Result<u64, FormatError> {
        (self.rows() as u64)
            .checked_mul(row_bytes(self.qtype, self.cols())? as u64)
            .ok_or_else(|| {
                FormatError::invalid(format!("tensor {} is impossibly large", self.name))
            })
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct DenseIndex {
    pub tensors: Vec<DenseTensor>,
}

impl DenseIndex {
    pub fn get(&self, name: &str) -> Option<&DenseTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The format minor version its tensors' encodings need (FORMAT.md §12): a writer declares it
    /// with `ContainerWriter::require_minor`.
    pub fn minor_version(&self) -> u16 {
        self.tensors
            .iter()
            .map(|t| t.qtype.since_minor())
            .fold(1, u16::max)
    }

    /// Bytes to hold every tensor's encoded data (no padding).
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.size).sum()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u32(self.tensors.len() as u32);
        for t in &self.tensors {
            e.str(&t.name);
            e.u32(t.qtype as u32);
            e.u32(t.shape.len() as u32);
            t.shape.iter().for_each(|d| e.u64(*d));
            e.u64(t.offset);
            e.u64(t.size);
            e.u64(t.extent_size);
            e.u64(t.checksum);
        }
        e.buf
    }

    /// Decodes the table and checks that its extents tile a DENSE_DATA section of `data_len` bytes.
    pub fn decode(d: &mut Dec, data_len: u64) -> Result<Self, FormatError> {
        let n = d.count(42)?;
        let mut tensors = Vec::with_capacity(n);
        let mut next = 0u64;
        for _ in 0..n {
            let name = d.str()?;
            let qtype = QuantType::from_u32(d.u32()?)?;
            let ndim = d.u32()?;
            if !(1..=2).contains(&ndim) {
                return Err(d.invalid(format!("tensor {name} has {ndim} dimensions")));
            }
            let shape = (0..ndim).map(|_| d.u64()).collect::<Result<Vec<_>, _>>()?;
            let t = DenseTensor {
                name,
                qtype,
                shape,
                offset: d.u64()?,
                size: d.u64()?,
                extent_size: d.u64()?,
                checksum: d.u64()?,
            };
            if t.offset != next
                || t.size > data_len
                || t.extent_size != crate::container::page_align(t.size)
                || t.size != t.expected_size()?
            {
                return Err(d.invalid(format!("tensor {} has an inconsistent extent", t.name)));
            }
            next = t
                .offset
                .checked_add(t.extent_size)
                .ok_or_else(|| d.invalid("extent overflow"))?;
            tensors.push(t);
        }
        if next != data_len {
            return Err(FormatError::invalid(
                "DENSE_INDEX extents do not tile DENSE_DATA",
            ));
        }
        Ok(Self { tensors })
    }
}
