//! The container: a 4 KiB header page with the section table, then page-aligned sections, each
//! covered by an XXH3-64 checksum. See FORMAT.md §2–3.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use crate::atomic::AtomicFile;
use crate::FormatError;

/// The unit of alignment: every section and every extent starts on, and fills, whole pages.
pub const PAGE: u64 = 4096;
pub const MAGIC: [u8; 8] = *b"LEANSTRM";
pub const VERSION_MAJOR: u16 = 1;
/// The highest minor version this build knows; a writer writes the lowest one its features need
/// ([`SectionKind::since_minor`], [`ContainerWriter::require_minor`]).
pub const VERSION_MINOR: u16 = 10;
/// The minor version of a file that uses no later feature.
const BASE_MINOR: u16 = 1;
const SECTION_TABLE_OFFSET: usize = 32;
const SECTION_ENTRY_BYTES: usize = 48;
const HEADER_CHECKSUM_OFFSET: usize = PAGE as usize - 8;
/// Section entries that fit in the header page.
pub const MAX_SECTIONS: usize =
    (HEADER_CHECKSUM_OFFSET - SECTION_TABLE_OFFSET) / SECTION_ENTRY_BYTES;

/// XXH3-64 (seed 0), the checksum of every header, section and extent. The vector units are
/// chosen when it runs (AVX2 or SSE2 on x86-64, NEON on aarch64): the I/O threads check every
/// cluster they read with it.
pub fn checksum(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// [`checksum`] of bytes given piece by piece.
#[derive(Default, Clone)]
pub struct Checksum(twox_hash::XxHash3_64);

impl Checksum {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn update(&mut self, bytes: &[u8]) {
        std::hash::Hasher::write(&mut self.0, bytes);
    }

    /// The checksum of every byte given so far.
    pub fn digest(&self) -> u64 {
        std::hash::Hasher::finish(&self.0)
    }
}

/// Rounds `n` up to a whole number of pages.
pub fn page_align(n: u64) -> u64 {
    n.div_ceil(PAGE) * PAGE
}

/// Section kinds (FORMAT.md §3). Readers skip kinds they do not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum SectionKind {
    Meta = 1,
    Tokenizer = 2,
    DenseIndex = 3,
    DenseData = 4,
    FfnIndex = 5,
    FfnData = 6,
    Predictors = 7,
    Sketch = 8,
    Refine = 9,
    /// Optional (since 1.2): a compact byte-level BPE tokenizer.
    BpeVocab = 10,
    /// A mixture of experts' experts (since 1.5), present with [`SectionKind::ExpertData`].
    ExpertIndex = 11,
    ExpertData = 12,
    /// FFN_DATA with its clusters split (since 1.6, FORMAT.md §6.3): a new kind, so that a
    /// reader before 1.6, which knows only FFN_DATA's interleaved clusters, finds no FFN_DATA and
    /// refuses the file instead of misreading it.
    FfnDataSplit = 13,
    /// EXPERT_DATA with its clusters split (since 1.6), for the same reason.
    ExpertDataSplit = 14,
    /// Optional (since 1.10): each layer's FFN input's principal directions.
    InputBasis = 15,
}

impl SectionKind {
    pub const ALL: [SectionKind; 15] = [
        SectionKind::Meta,
        SectionKind::Tokenizer,
        SectionKind::DenseIndex,
        SectionKind::DenseData,
        SectionKind::FfnIndex,
        SectionKind::FfnData,
        SectionKind::Predictors,
        SectionKind::Sketch,
        SectionKind::Refine,
        SectionKind::BpeVocab,
        SectionKind::ExpertIndex,
        SectionKind::ExpertData,
        SectionKind::FfnDataSplit,
        SectionKind::ExpertDataSplit,
        SectionKind::InputBasis,
    ];

    pub fn from_u32(v: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|k| *k as u32 == v)
    }

    pub fn name(self) -> &'static str {
        match self {
            SectionKind::Meta => "META",
            SectionKind::Tokenizer => "TOKENIZER",
            SectionKind::DenseIndex => "DENSE_INDEX",
            SectionKind::DenseData => "DENSE_DATA",
            SectionKind::FfnIndex => "FFN_INDEX",
            SectionKind::FfnData => "FFN_DATA",
            SectionKind::Predictors => "PREDICTORS",
            SectionKind::Sketch => "SKETCH",
            SectionKind::Refine => "REFINE",
            SectionKind::BpeVocab => "BPE_VOCAB",
            SectionKind::ExpertIndex => "EXPERT_INDEX",
            SectionKind::ExpertData => "EXPERT_DATA",
            SectionKind::FfnDataSplit => "FFN_DATA_SPLIT",
            SectionKind::ExpertDataSplit => "EXPERT_DATA_SPLIT",
            SectionKind::InputBasis => "INPUT_BASIS",
        }
    }

    /// The minor version that introduced this kind.
    pub fn since_minor(self) -> u16 {
        match self {
            SectionKind::BpeVocab => 2,
            SectionKind::ExpertIndex | SectionKind::ExpertData => 5,
            SectionKind::FfnDataSplit | SectionKind::ExpertDataSplit => {
                crate::ffn::SPLIT_SINCE_MINOR
            }
            SectionKind::InputBasis => crate::input_basis::INPUT_BASIS_SINCE_MINOR,
            _ => BASE_MINOR,
        }
    }
}

/// How a section's content is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Encoding {
    Raw = 0,
    Zstd = 1,
}

/// One entry of the header's section table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectionEntry {
    pub kind: u32,
    pub encoding: u32,
    /// File offset, a multiple of [`PAGE`].
    pub offset: u64,
    /// Bytes the section occupies in the file: `page_align(length)`, zero-padded.
    pub stored_size: u64,
    /// Bytes of stored content before padding.
    pub length: u64,
    /// XXH3-64 of all `stored_size` bytes (content and padding).
    pub checksum: u64,
}

impl SectionEntry {
    pub fn name(&self) -> String {
        SectionKind::from_u32(self.kind)
            .map(|k| k.name().to_string())
            .unwrap_or_else(|| format!("section kind {}", self.kind))
    }
}

/// The decoded header page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub version_major: u16,
    pub version_minor: u16,
    pub file_size: u64,
    pub sections: Vec<SectionEntry>,
}

impl Header {
    /// Encodes the header page, checksum included.
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.sections.len() <= MAX_SECTIONS);
        let mut page = vec![0u8; PAGE as usize];
        page[0..8].copy_from_slice(&MAGIC);
        page[8..10].copy_from_slice(&self.version_major.to_le_bytes());
        page[10..12].copy_from_slice(&self.version_minor.to_le_bytes());
        page[12..16].copy_from_slice(&(PAGE as u32).to_le_bytes());
        page[16..24].copy_from_slice(&self.file_size.to_le_bytes());
        page[24..28].copy_from_slice(&(self.sections.len() as u32).to_le_bytes());
        for (i, s) in self.sections.iter().enumerate() {
            let o = SECTION_TABLE_OFFSET + i * SECTION_ENTRY_BYTES;
            page[o..o + 4].copy_from_slice(&s.kind.to_le_bytes());
            page[o + 4..o + 8].copy_from_slice(&s.encoding.to_le_bytes());
            page[o + 8..o + 16].copy_from_slice(&s.offset.to_le_bytes());
            page[o + 16..o + 24].copy_from_slice(&s.stored_size.to_le_bytes());
            page[o + 24..o + 32].copy_from_slice(&s.length.to_le_bytes());
            page[o + 32..o + 40].copy_from_slice(&s.checksum.to_le_bytes());
        }
        let sum = checksum(&page[..HEADER_CHECKSUM_OFFSET]);
        page[HEADER_CHECKSUM_OFFSET..].copy_from_slice(&sum.to_le_bytes());
        page
    }

    /// Decodes and checks a header page: magic, version, checksum, and that the sections tile the
    /// file after the header exactly (so every byte of the file is covered by a checksum).
    pub fn decode(page: &[u8], actual_file_size: u64) -> Result<Self, FormatError> {
        if page.len() < 8 || page[0..8] != MAGIC {
            return Err(FormatError::invalid(
                "not a LeanStream file (bad magic): convert the model with `leanstream-prep convert`",
            ));
        }
        if page.len() < PAGE as usize {
            return Err(FormatError::invalid(format!(
                "truncated: the file has {} bytes, less than its 4096-byte header",
                page.len()
            )));
        }
        let u16_at = |o: usize| u16::from_le_bytes([page[o], page[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(page[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(page[o..o + 8].try_into().expect("8 bytes"));
        let (major, minor) = (u16_at(8), u16_at(10));
        if major != VERSION_MAJOR {
            return Err(FormatError::invalid(format!(
                "format version {major}.{minor} is not supported (this build reads {VERSION_MAJOR}.x): \
                 convert the model again with this version of leanstream-prep"
            )));
        }
        if u64_at(HEADER_CHECKSUM_OFFSET) != checksum(&page[..HEADER_CHECKSUM_OFFSET]) {
            return Err(FormatError::Checksum {
                what: "the header".into(),
            });
        }
        if u32_at(12) as u64 != PAGE {
            return Err(FormatError::invalid("header size is not 4096"));
        }
        let file_size = u64_at(16);
        if file_size != actual_file_size {
            return Err(FormatError::invalid(format!(
                "truncated or extended: the header records {file_size} bytes but the file has \
                 {actual_file_size}; copy the file again"
            )));
        }
        let count = u32_at(24) as usize;
        if count > MAX_SECTIONS {
            return Err(FormatError::invalid(format!(
                "{count} sections exceed the header's table"
            )));
        }
        let mut sections = Vec::with_capacity(count);
        let mut expected_offset = PAGE;
        for i in 0..count {
            let o = SECTION_TABLE_OFFSET + i * SECTION_ENTRY_BYTES;
            let s = SectionEntry {
                kind: u32_at(o),
                encoding: u32_at(o + 4),
                offset: u64_at(o + 8),
                stored_size: u64_at(o + 16),
                length: u64_at(o + 24),
                checksum: u64_at(o + 32),
            };
            // Sizes come from the file: compare without arithmetic that could overflow.
            if s.offset != expected_offset
                || s.length > file_size
                || s.stored_size > file_size
                || s.stored_size != page_align(s.length)
                || s.encoding > Encoding::Zstd as u32
            {
                return Err(FormatError::invalid(format!(
                    "{} has an invalid place in the section table",
                    s.name()
                )));
            }
            expected_offset = s.offset + s.stored_size;
            sections.push(s);
        }
        if expected_offset != file_size {
            return Err(FormatError::invalid(
                "the sections do not end at the end of the file",
            ));
        }
        Ok(Header {
            version_major: major,
            version_minor: minor,
            file_size,
            sections,
        })
    }

    pub fn section(&self, kind: SectionKind) -> Option<&SectionEntry> {
        self.sections.iter().find(|s| s.kind == kind as u32)
    }
}

/// Writes a file section by section to a temporary name next to the target, and renames it into
/// place only in [`ContainerWriter::finish`]; dropped unfinished, it removes the temporary file.
pub struct ContainerWriter {
    out: AtomicFile,
    pos: u64,
    sections: Vec<SectionEntry>,
    open: Option<OpenSection>,
    /// The highest minor version declared with [`Self::require_minor`] (features other than a
    /// section's kind); the header gets the max of it and the sections' (§12).
    minor: u16,
    /// zstd level of compressed sections ([`Self::add_section`]).
    level: i32,
}

/// A section being streamed: its start and a running hash of its bytes.
struct OpenSection {
    kind: SectionKind,
    start: u64,
    hasher: Checksum,
}

impl ContainerWriter {
    pub fn create(path: &Path) -> Result<Self, FormatError> {
        let mut w = Self {
            out: AtomicFile::create(path)?,
            pos: 0,
            sections: Vec::new(),
            open: None,
            minor: BASE_MINOR,
            level: 19,
        };
        w.write_raw(&vec![0u8; PAGE as usize])?;
        Ok(w)
    }

    fn write_raw(&mut self, bytes: &[u8]) -> Result<(), FormatError> {
        let tmp = self.out.tmp_path().to_path_buf();
        self.out
            .file()
            .write_all(bytes)
            .map_err(|e| FormatError::io(tmp, e))?;
        if let Some(open) = &mut self.open {
            open.hasher.update(bytes);
        }
        self.pos += bytes.len() as u64;
        Ok(())
    }

    /// Starts a section whose content is streamed with [`Self::write_extent`].
    pub fn begin_section(&mut self, kind: SectionKind) {
        assert!(self.open.is_none(), "a section is already open");
        self.open = Some(OpenSection {
            kind,
            start: self.pos,
            hasher: Default::default(),
        });
    }

    /// Appends `bytes` to the open section as one extent, zero-padded to whole pages. Returns
    /// `(offset within the section, extent size, checksum of the padded extent)`.
    pub fn write_extent(&mut self, bytes: &[u8]) -> Result<(u64, u64, u64), FormatError> {
        let start = self.open.as_ref().expect("no section is open").start;
        let offset = self.pos - start;
        let size = page_align(bytes.len() as u64);
        let mut padded = bytes.to_vec();
        padded.resize(size as usize, 0);
        let sum = checksum(&padded);
        self.write_raw(&padded)?;
        Ok((offset, size, sum))
    }

    /// Closes the open section.
    pub fn end_section(&mut self) {
        let open = self.open.take().expect("no section is open");
        let length = self.pos - open.start;
        self.sections.push(SectionEntry {
            kind: open.kind as u32,
            encoding: Encoding::Raw as u32,
            offset: open.start,
            stored_size: length,
            length,
            checksum: open.hasher.digest(),
        });
    }

    /// Writes a whole section at once, zstd-compressed when `compress`.
    pub fn add_section(
        &mut self,
        kind: SectionKind,
        content: &[u8],
        compress: bool,
    ) -> Result<(), FormatError> {
        let stored = if compress {
            zstd::bulk::compress(content, self.level)
                .map_err(|e| FormatError::io(self.out.tmp_path(), e))?
        } else {
            content.to_vec()
        };
        let start = self.pos;
        let length = stored.len() as u64;
        let mut padded = stored;
        padded.resize(page_align(length) as usize, 0);
        let sum = checksum(&padded);
        self.write_raw(&padded)?;
        self.sections.push(SectionEntry {
            kind: kind as u32,
            encoding: if compress {
                Encoding::Zstd
            } else {
                Encoding::Raw
            } as u32,
            offset: start,
            stored_size: padded.len() as u64,
            length,
            checksum: sum,
        });
        Ok(())
    }

    /// The zstd level of the sections written compressed from now on (19 unless set: the
    /// smallest; a writer in a hurry takes a low one, e.g. 3, at a little more size).
    pub fn compression_level(&mut self, level: i32) {
        self.level = level;
    }

    /// Raises the minor version written to at least `minor`: the writer of a feature inside a
    /// section (a META key, an empty SKETCH layer) says which version introduced it; sections'
    /// kinds count by themselves ([`SectionKind::since_minor`]). The file gets the highest (§12).
    pub fn require_minor(&mut self, minor: u16) {
        self.minor = self.minor.max(minor);
    }

    /// Writes the header, syncs, and renames the file into place.
    pub fn finish(mut self) -> Result<(), FormatError> {
        assert!(self.open.is_none(), "a section is still open");
        if self.sections.len() > MAX_SECTIONS {
            return Err(FormatError::invalid("too many sections for the header"));
        }
        // The highest minor version among the file's features: its sections' kinds and what
        // its writers declared with `require_minor` (META keys, SKETCH layers).
        let version_minor = self
            .sections
            .iter()
            .filter_map(|s| SectionKind::from_u32(s.kind))
            .map(SectionKind::since_minor)
            .fold(self.minor, u16::max);
        let header = Header {
            version_major: VERSION_MAJOR,
            version_minor,
            file_size: self.pos,
            sections: self.sections.clone(),
        };
        let tmp = self.out.tmp_path().to_path_buf();
        let io = |e| FormatError::io(&tmp, e);
        let file = self.out.file();
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&header.encode()).map_err(io)?;
        self.out.commit(true)
    }
}

/// Reads `len` bytes at `offset`.
pub fn read_at<R: Read + Seek>(
    file: &mut R,
    path: &Path,
    offset: u64,
    len: u64,
) -> Result<Vec<u8>, FormatError> {
    let mut buf = vec![0u8; len as usize];
    file.seek(SeekFrom::Start(offset))
        .map_err(|e| FormatError::io(path, e))?;
    file.read_exact(&mut buf)
        .map_err(|e| FormatError::io(path, e))?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checksum_is_xxh3_64_whole_or_in_pieces() {
        // FORMAT.md's test vectors: files written by earlier builds keep their checksums.
        assert_eq!(checksum(b""), 0x2D06_8005_38D3_94C2);
        assert_eq!(checksum(&[0; 4096]), 0x93D7_6FE1_48C6_89BA);
        let bytes: Vec<u8> = (0..300_000u32).map(|i| (i * 31 + i / 7) as u8).collect();
        for len in [1, 16, 17, 128, 129, 240, 241, 1024, 1025, 65_536, 300_000] {
            let whole = checksum(&bytes[..len]);
            let mut pieces = Checksum::new();
            for piece in bytes[..len].chunks(97) {
                pieces.update(piece);
            }
            assert_eq!(pieces.digest(), whole, "{len} bytes");
        }
        assert_ne!(checksum(&bytes[..1024]), checksum(&bytes[1..1025]));
    }

    #[test]
    fn header_round_trip_and_damage() {
        let h = Header {
            version_major: VERSION_MAJOR,
            version_minor: VERSION_MINOR,
            file_size: 3 * PAGE,
            sections: vec![SectionEntry {
                kind: 1,
                encoding: 0,
                offset: PAGE,
                stored_size: 2 * PAGE,
                length: 5000,
                checksum: 42,
            }],
        };
        let page = h.encode();
        assert_eq!(Header::decode(&page, 3 * PAGE).unwrap(), h);
        assert!(Header::decode(&page, 4 * PAGE).is_err());
        // A checksummed header with impossible sizes is an error, not an overflow.
        let mut huge = h.clone();
        huge.sections[0].length = u64::MAX;
        huge.sections[0].stored_size = 0;
        assert!(Header::decode(&huge.encode(), 3 * PAGE).is_err());
        for i in 0..PAGE as usize {
            let mut bad = page.clone();
            bad[i] ^= 0x10;
            assert!(Header::decode(&bad, 3 * PAGE).is_err(), "byte {i}");
        }
    }
}
