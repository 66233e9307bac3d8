//! FFN_INDEX: per layer, the neuron permutation and the clusters of neuron bundles stored in
//! FFN_DATA. A bundle is one neuron's gate row, up row and down column, each `hidden` values of the
//! layer's type, stored `[gate | up | down]`. See FORMAT.md §6.

use crate::codec::{Dec, Enc};
use crate::container::page_align;
use crate::quant::{row_bytes, QuantType};
use crate::FormatError;

/// A run of consecutively stored neurons read with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cluster {
    /// Stored position of its first neuron.
    pub first: u32,
    pub count: u32,
    /// Offset of the extent within FFN_DATA (a multiple of 4096).
    pub offset: u64,
    /// `page_align(count × bundle_bytes)`.
    pub extent_size: u64,
    /// XXH3-64 of the whole extent.
    pub checksum: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct FfnLayer {
    pub qtype: QuantType,
    pub hidden: u32,
    /// `perm[p]` is the original index of the neuron stored at position `p`.
    pub perm: Vec<u32>,
    pub clusters: Vec<Cluster>,
}

impl FfnLayer {
    pub fn neurons(&self) -> usize {
        self.perm.len()
    }

    /// Bytes of one encoded row (gate, up or down) of a bundle.
    pub fn row_bytes(&self) -> usize {
        row_bytes(self.qtype, self.hidden as usize).expect("validated at decode")
    }

    pub fn bundle_bytes(&self) -> usize {
        3 * self.row_bytes()
    }

    /// Stored position of every original neuron (the inverse of `perm`).
    pub fn positions(&self) -> Vec<u32> {
        let mut pos = vec![0u32; self.perm.len()];
        for (p, &orig) in self.perm.iter().enumerate() {
            pos[orig as usize] = p as u32;
        }
        pos
    }

    /// The cluster holding stored position `p`.
    pub fn cluster_of(&self, p: u32) -> usize {
        self.clusters.partition_point(|c| c.first + c.count <= p)
    }

    /// Appends the layer record (FORMAT.md §6.2): an FFN_INDEX layer, or an expert (§6.5).
    pub(crate) fn encode(&self, e: &mut Enc) {
        e.u32(self.perm.len() as u32);
        e.u32(self.qtype as u32);
        e.u32(self.hidden);
        e.u32(self.clusters.len() as u32);
        e.u32s(&self.perm);
        for c in &self.clusters {
            e.u32(c.first);
            e.u32(c.count);
            e.u64(c.offset);
            e.u64(c.extent_size);
            e.u64(c.checksum);
        }
    }

    /// Decodes one layer record and checks it: `perm` is a permutation and the clusters cover the
    /// stored positions in order with extents that start at `*next` within their data section
    /// (advanced past them). `what` names the record in errors (`layer 3`, `layer 3 expert 5`).
    pub(crate) fn decode(d: &mut Dec, what: &str, next: &mut u64) -> Result<Self, FormatError> {
        let neurons = d.count(4)?;
        let qtype = QuantType::from_u32(d.u32()?)?;
        let hidden = d.u32()?;
        row_bytes(qtype, hidden as usize)?;
        let n_clusters = d.count(32)?;
        let perm = d.u32s(neurons)?;
        let mut seen = vec![false; neurons];
        for &o in &perm {
            match seen.get_mut(o as usize) {
                Some(s) if !*s => *s = true,
                _ => return Err(d.invalid(format!("{what}: the permutation is invalid"))),
            }
        }
        let mut clusters = Vec::with_capacity(n_clusters);
        let mut first = 0u32;
        let bundle = 3 * row_bytes(qtype, hidden as usize)? as u64;
        for ci in 0..n_clusters {
            let c = Cluster {
                first: d.u32()?,
                count: d.u32()?,
                offset: d.u64()?,
                extent_size: d.u64()?,
                checksum: d.u64()?,
            };
            if c.first != first
                || c.count == 0
                || c.count as usize > neurons - first as usize
                || c.offset != *next
                || c.extent_size != page_align(c.count as u64 * bundle)
            {
                return Err(d.invalid(format!("{what} cluster {ci} has an inconsistent extent")));
            }
            first += c.count;
            *next = next
                .checked_add(c.extent_size)
                .ok_or_else(|| d.invalid("extent overflow"))?;
            clusters.push(c);
        }
        if first as usize != neurons {
            return Err(d.invalid(format!("{what}: clusters do not cover every neuron")));
        }
        Ok(Self {
            qtype,
            hidden,
            perm,
            clusters,
        })
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct FfnIndex {
    pub layers: Vec<FfnLayer>,
}

impl FfnIndex {
    /// Bytes of all bundles, without padding.
    pub fn bundle_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| (l.neurons() * l.bundle_bytes()) as u64)
            .sum()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u32(self.layers.len() as u32);
        for l in &self.layers {
            l.encode(&mut e);
        }
        e.buf
    }

    /// Decodes the index and checks it: each `perm` is a permutation, clusters cover the stored
    /// positions in order, and the extents tile an FFN_DATA section of `data_len` bytes.
    pub fn decode(d: &mut Dec, data_len: u64) -> Result<Self, FormatError> {
        let n_layers = d.count(16)?;
        let mut layers = Vec::with_capacity(n_layers);
        let mut next = 0u64;
        for li in 0..n_layers {
            layers.push(FfnLayer::decode(d, &format!("layer {li}"), &mut next)?);
        }
        if next != data_len {
            return Err(FormatError::invalid(
                "FFN_INDEX extents do not tile FFN_DATA",
            ));
        }
        Ok(Self { layers })
    }
}
