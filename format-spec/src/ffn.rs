//! FFN_INDEX: per layer, the neuron permutation and the clusters of neuron bundles stored in
//! FFN_DATA. A bundle is one neuron's gate row, up row and down column, each `hidden` values of the
//! layer's type. A cluster's extent holds its bundles' rows in the file's [`ClusterLayout`]:
//! since 1.6 `[gate rows | up rows | down columns]`, before it `[gate | up | down]` per neuron.
//! See FORMAT.md §6.

use crate::codec::{Dec, Enc};
use crate::container::{page_align, SectionKind};
use crate::quant::{row_bytes, QuantError, QuantType};
use crate::FormatError;

/// The first minor version with [`ClusterLayout::Split`] clusters (FORMAT.md §12): that of their
/// section kinds, FFN_DATA_SPLIT and EXPERT_DATA_SPLIT.
pub const SPLIT_SINCE_MINOR: u16 = 6;

/// How a cluster extent orders its neurons' rows (FORMAT.md §6.3). A file has one layout, named
/// by the kind of its FFN data section: every FFN layer and every expert of it uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterLayout {
    /// Up to 1.5: each neuron's bundle `[gate | up | down]`, the bundles back to back.
    Interleaved,
    /// Since 1.6: the gate rows of the cluster's neurons in stored order, then their up rows, then
    /// their down columns, so that a pass over the gates reads one contiguous run.
    Split,
}

/// One of a bundle's three rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Gate = 0,
    Up = 1,
    Down = 2,
}

impl ClusterLayout {
    /// The section kind of a file's FFN cluster extents in this layout: FFN_DATA, or since 1.6
    /// FFN_DATA_SPLIT (a kind of its own, so that an older reader refuses a split file).
    pub fn ffn_data(self) -> SectionKind {
        match self {
            Self::Interleaved => SectionKind::FfnData,
            Self::Split => SectionKind::FfnDataSplit,
        }
    }

    /// The section kind of a mixture's expert cluster extents in this layout.
    pub fn expert_data(self) -> SectionKind {
        match self {
            Self::Interleaved => SectionKind::ExpertData,
            Self::Split => SectionKind::ExpertDataSplit,
        }
    }

    /// The layout's name: `split` or `interleaved`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Interleaved => "interleaved",
            Self::Split => "split",
        }
    }

    /// The other layout.
    pub fn other(self) -> Self {
        match self {
            Self::Interleaved => Self::Split,
            Self::Split => Self::Interleaved,
        }
    }

    /// Offset within the extent of row `part` of neuron `k` of a cluster of `count` neurons whose
    /// gate rows, up rows and down columns are `rb[0]`, `rb[1]` and `rb[2]` bytes long.
    pub fn row_offset(self, part: Part, k: usize, count: usize, rb: [usize; 3]) -> usize {
        let before: usize = rb[..part as usize].iter().sum();
        let first = match self {
            Self::Interleaved => before,
            Self::Split => count * before,
        };
        first + k * self.neuron_stride(part, rb)
    }

    /// Bytes from row `part` of one neuron to the same row of the next: a whole bundle when
    /// interleaved, the row itself when split.
    pub fn neuron_stride(self, part: Part, rb: [usize; 3]) -> usize {
        match self {
            Self::Interleaved => rb.iter().sum(),
            Self::Split => rb[part as usize],
        }
    }

    /// A cluster extent of `count` neurons (padding or not) in this layout, rewritten in layout
    /// `to`: the same rows, each where `to` puts it; the padding stays.
    pub fn move_rows(self, to: Self, extent: &[u8], count: usize, rb: [usize; 3]) -> Vec<u8> {
        let mut out = extent.to_vec();
        for k in 0..count {
            for part in [Part::Gate, Part::Up, Part::Down] {
                let (a, b) = (
                    self.row_offset(part, k, count, rb),
                    to.row_offset(part, k, count, rb),
                );
                let len = rb[part as usize];
                out[b..b + len].copy_from_slice(&extent[a..a + len]);
            }
        }
        out
    }

    /// The extent (without its padding) of a cluster whose bundles, `[gate | up | down]` of
    /// `rb[0] + rb[1] + rb[2]` bytes, are `bundles` back to back: the same bytes in this layout.
    pub fn arrange(self, bundles: &[u8], rb: [usize; 3]) -> Vec<u8> {
        let bb: usize = rb.iter().sum();
        assert!(
            rb.iter().all(|&r| r > 0) && bundles.len().is_multiple_of(bb),
            "{} bytes are no whole number of {bb}-byte bundles",
            bundles.len()
        );
        match self {
            Self::Interleaved => bundles.to_vec(),
            Self::Split => {
                let mut out = Vec::with_capacity(bundles.len());
                let mut start = 0;
                for len in rb {
                    for b in bundles.chunks_exact(bb) {
                        out.extend_from_slice(&b[start..start + len]);
                    }
                    start += len;
                }
                out
            }
        }
    }
}

/// The encodings of a bundle's gate row, up row and down column (FORMAT.md §6.1). One `u32` in a
/// layer record: the encoding itself when the three are the same (every file before 1.8), else,
/// since 1.8, [`MIXED_FLAG`] with the gate's encoding in the low byte, the up row's in the next
/// and the down column's in the third.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartTypes {
    pub gate: QuantType,
    pub up: QuantType,
    pub down: QuantType,
}

/// The flag of a layer record's `qtype` whose parts differ (format 1.8).
pub const MIXED_FLAG: u32 = 1 << 24;
/// The first minor version whose layer records may give each part its own encoding.
pub const MIXED_SINCE_MINOR: u16 = 8;

impl PartTypes {
    /// All three parts in `q`.
    pub fn uniform(q: QuantType) -> Self {
        Self {
            gate: q,
            up: q,
            down: q,
        }
    }

    /// The encoding of `part`.
    pub fn of(&self, part: Part) -> QuantType {
        match part {
            Part::Gate => self.gate,
            Part::Up => self.up,
            Part::Down => self.down,
        }
    }

    /// The one encoding of all three parts, if they share one.
    pub fn single(&self) -> Option<QuantType> {
        (self.gate == self.up && self.up == self.down).then_some(self.gate)
    }

    /// Whether every part is block-encoded (none is f32, f16 or bf16).
    pub fn all_block(&self) -> bool {
        [self.gate, self.up, self.down].iter().all(|q| q.is_block())
    }

    /// Bytes of each part's row of `hidden` values.
    pub fn row_bytes(&self, hidden: usize) -> Result<[usize; 3], QuantError> {
        Ok([
            row_bytes(self.gate, hidden)?,
            row_bytes(self.up, hidden)?,
            row_bytes(self.down, hidden)?,
        ])
    }

    /// The format minor version a layer record of these encodings needs (FORMAT.md §12).
    pub fn since_minor(&self) -> u16 {
        let each = [self.gate, self.up, self.down].map(QuantType::since_minor);
        let own = each.into_iter().fold(1, u16::max);
        match self.single() {
            Some(_) => own,
            None => own.max(MIXED_SINCE_MINOR),
        }
    }

    /// The record's `qtype` field.
    pub fn to_u32(&self) -> u32 {
        match self.single() {
            Some(q) => q as u32,
            None => {
                MIXED_FLAG | self.gate as u32 | (self.up as u32) << 8 | (self.down as u32) << 16
            }
        }
    }

    /// The encodings a record's `qtype` field names.
    pub fn from_u32(v: u32) -> Result<Self, QuantError> {
        if v & !0x00FF_FFFF != MIXED_FLAG {
            return QuantType::from_u32(v).map(Self::uniform);
        }
        let part = |shift: u32| QuantType::from_u32((v >> shift) & 0xFF);
        let t = Self {
            gate: part(0)?,
            up: part(8)?,
            down: part(16)?,
        };
        // One writer, one spelling: three equal parts are the plain value.
        match t.single() {
            Some(_) => Err(QuantError::UnknownType(v)),
            None => Ok(t),
        }
    }
}

impl std::fmt::Display for PartTypes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.single() {
            Some(q) => write!(f, "{q}"),
            None => write!(f, "gate {} up {} down {}", self.gate, self.up, self.down),
        }
    }
}

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
    /// The encodings of its bundles' gate rows, up rows and down columns.
    pub qtypes: PartTypes,
    pub hidden: u32,
    /// `perm[p]` is the original index of the neuron stored at position `p`.
    pub perm: Vec<u32>,
    pub clusters: Vec<Cluster>,
    /// How the clusters' extents order their rows: not encoded in the record, but the file's
    /// (from the kind of its data section).
    pub layout: ClusterLayout,
}

impl FfnLayer {
    pub fn neurons(&self) -> usize {
        self.perm.len()
    }

    /// Bytes of a bundle's encoded gate row, up row and down column.
    pub fn row_bytes(&self) -> [usize; 3] {
        (self.qtypes.row_bytes(self.hidden as usize)).expect("validated at decode")
    }

    pub fn bundle_bytes(&self) -> usize {
        self.row_bytes().iter().sum()
    }

    /// Row `part` of neuron `k` of cluster `ci`, within that cluster's `extent` (as read, padding
    /// included or not).
    pub fn row<'a>(&self, extent: &'a [u8], ci: usize, k: usize, part: Part) -> &'a [u8] {
        let (count, rb) = (self.clusters[ci].count as usize, self.row_bytes());
        let at = self.layout.row_offset(part, k, count, rb);
        &extent[at..at + rb[part as usize]]
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
        e.u32(self.qtypes.to_u32());
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
    /// (advanced past them). `what` names the record in errors (`layer 3`, `layer 3 expert 5`);
    /// `layout` is the file's (§6.3).
    pub(crate) fn decode(
        d: &mut Dec,
        what: &str,
        next: &mut u64,
        layout: ClusterLayout,
    ) -> Result<Self, FormatError> {
        let neurons = d.count(4)?;
        let qtypes = PartTypes::from_u32(d.u32()?)?;
        let hidden = d.u32()?;
        let rb = qtypes.row_bytes(hidden as usize)?;
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
        let bundle = rb.iter().sum::<usize>() as u64;
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
            qtypes,
            hidden,
            perm,
            clusters,
            layout,
        })
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct FfnIndex {
    pub layers: Vec<FfnLayer>,
}

impl FfnIndex {
    /// The format minor version its layers' encodings need (FORMAT.md §12), for
    /// `ContainerWriter::require_minor`.
    pub fn minor_version(&self) -> u16 {
        self.layers
            .iter()
            .map(|l| l.qtypes.since_minor())
            .fold(1, u16::max)
    }

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
    /// positions in order, and the extents tile an FFN_DATA section of `data_len` bytes. `layout`
    /// is the file's (from the kind of that section).
    pub fn decode(d: &mut Dec, data_len: u64, layout: ClusterLayout) -> Result<Self, FormatError> {
        let n_layers = d.count(16)?;
        let mut layers = Vec::with_capacity(n_layers);
        let mut next = 0u64;
        for li in 0..n_layers {
            layers.push(FfnLayer::decode(
                d,
                &format!("layer {li}"),
                &mut next,
                layout,
            )?);
        }
        if next != data_len {
            return Err(FormatError::invalid(
                "FFN_INDEX extents do not tile FFN_DATA",
            ));
        }
        Ok(Self { layers })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row `part` of neuron `k` of three, `[10 + k | 20 + k | 30 + k]` repeated over its `rb` bytes,
    /// lies where `row_offset` says in the `interleaved` and `split` extents.
    fn check_places(interleaved: &[u8], split: &[u8], rb: [usize; 3]) {
        for (layout, bytes) in [
            (ClusterLayout::Interleaved, interleaved),
            (ClusterLayout::Split, split),
        ] {
            for k in 0..3 {
                for (part, base) in [(Part::Gate, 10), (Part::Up, 20), (Part::Down, 30)] {
                    let (at, len) = (layout.row_offset(part, k, 3, rb), rb[part as usize]);
                    let want = vec![base + k as u8; len];
                    assert_eq!(bytes[at..at + len], want[..], "{layout:?} {part:?} {k}");
                }
            }
        }
    }

    #[test]
    fn layouts_place_each_row() {
        // Three neurons, rows of 2 bytes: bundle k is [g_k g_k | u_k u_k | d_k d_k].
        let bundles: Vec<u8> = (0..3u8)
            .flat_map(|k| [10 + k, 10 + k, 20 + k, 20 + k, 30 + k, 30 + k])
            .collect();
        assert_eq!(
            ClusterLayout::Interleaved.arrange(&bundles, [2; 3]),
            bundles
        );
        let split = ClusterLayout::Split.arrange(&bundles, [2; 3]);
        assert_eq!(
            split,
            [10, 10, 11, 11, 12, 12, 20, 20, 21, 21, 22, 22, 30, 30, 31, 31, 32, 32]
        );
        check_places(&bundles, &split, [2; 3]);
        let mut padded = split.clone();
        padded.extend([0, 0]);
        let back = ClusterLayout::Split.move_rows(ClusterLayout::Interleaved, &padded, 3, [2; 3]);
        assert_eq!(back[..18], bundles[..]);
        assert_eq!(back[18..], [0, 0]);
        assert_eq!(ClusterLayout::Split.ffn_data().since_minor(), 6);
        assert_eq!(ClusterLayout::Split.expert_data().since_minor(), 6);
        assert_eq!(ClusterLayout::Interleaved.ffn_data().since_minor(), 1);
    }

    #[test]
    fn parts_of_their_own_encodings() {
        // Three neurons whose gate rows are 1 byte, up rows 2 and down columns 3.
        let rb = [1, 2, 3];
        let bundles: Vec<u8> = (0..3u8)
            .flat_map(|k| [10 + k, 20 + k, 20 + k, 30 + k, 30 + k, 30 + k])
            .collect();
        let split = ClusterLayout::Split.arrange(&bundles, rb);
        assert_eq!(
            split,
            [10, 11, 12, 20, 20, 21, 21, 22, 22, 30, 30, 30, 31, 31, 31, 32, 32, 32]
        );
        check_places(&bundles, &split, rb);
        let back = ClusterLayout::Split.move_rows(ClusterLayout::Interleaved, &split, 3, rb);
        assert_eq!(back, bundles);

        // The record's field: one value when the parts agree, as every file before 1.8.
        let q4k = PartTypes::uniform(QuantType::Q4_K);
        assert_eq!(q4k.to_u32(), QuantType::Q4_K as u32);
        assert_eq!(
            (q4k.since_minor(), q4k.single()),
            (7, Some(QuantType::Q4_K))
        );
        assert_eq!(PartTypes::uniform(QuantType::Q8_0).since_minor(), 1);
        let mixed = PartTypes {
            down: QuantType::Q6_K,
            ..q4k
        };
        assert_eq!(mixed.to_u32(), 0x0100_0000 | 8 | 8 << 8 | 10 << 16);
        assert_eq!(PartTypes::from_u32(mixed.to_u32()), Ok(mixed));
        assert_eq!(
            PartTypes::from_u32(3),
            Ok(PartTypes::uniform(QuantType::Q8_0))
        );
        assert_eq!((mixed.since_minor(), mixed.single()), (8, None));
        assert_eq!(mixed.to_string(), "gate q4_k up q4_k down q6_k");
        assert_eq!(mixed.row_bytes(256), Ok([144, 144, 210]));
        // Unknown part values, three equal parts spelled mixed, and stray high bits are refused.
        for bad in [0x0100_0B08, 0x0103_0303, 0x0300_0003, 11] {
            assert!(PartTypes::from_u32(bad).is_err(), "{bad:#x}");
        }
    }
}
