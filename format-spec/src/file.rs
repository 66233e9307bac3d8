//! Opening a file: the header and every index section are read, checksummed and cross-checked up
//! front; tensor and cluster extents are read on demand and checked as they arrive.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::container::Checksum;

use crate::bpe_vocab::BpeVocab;
use crate::codec::Dec;
use crate::container::{checksum, read_at, Encoding, Header, SectionEntry, SectionKind, PAGE};
use crate::dense::{DenseIndex, DenseTensor};
use crate::expert::ExpertIndex;
use crate::ffn::{ClusterLayout, FfnIndex};
use crate::input_basis::InputBasis;
use crate::meta::Meta;
use crate::predictor::{PredictorInput, Predictors};
use crate::refine::Refine;
use crate::sketch::{Sketch, SketchIndex, SketchLayer};
use crate::FormatError;

/// An open LeanStream file with its indexes decoded.
#[derive(Debug)]
pub struct LsbFile {
    pub path: PathBuf,
    pub header: Header,
    pub meta: Meta,
    pub tokenizer_json: Vec<u8>,
    pub dense: DenseIndex,
    pub ffn: FfnIndex,
    pub predictors: Predictors,
    /// Where each layer's certificate lies: its rows are read by [`LsbFile::read_sketch_layer`].
    pub sketch: SketchIndex,
    pub refine: Refine,
    /// The experts of a mixture (format 1.5); empty for a dense model.
    pub experts: ExpertIndex,
    dense_data: SectionEntry,
    ffn_data: SectionEntry,
    expert_data: Option<SectionEntry>,
}

impl LsbFile {
    /// Opens and validates `path`. Every error names the file and what is wrong with it.
    pub fn open(path: &Path) -> Result<Self, FormatError> {
        let mut file = File::open(path).map_err(|e| FormatError::io(path, e))?;
        Self::read(&mut file, path)
    }

    /// Reads and validates a file from `reader` (a `File`, or bytes in memory through
    /// `std::io::Cursor`): the same checks as [`LsbFile::open`], with `name` naming it in every
    /// error and kept as [`LsbFile::path`]. The extent readers that reopen the file by path
    /// ([`LsbFile::read_sketch_layer`], [`LsbFile::read_sketch`]) need `name` to be its path.
    pub fn read<R: Read + Seek>(reader: &mut R, name: &Path) -> Result<Self, FormatError> {
        Self::read_inner(reader, name).map_err(|e| naming(name, e))
    }

    /// Reads only the embedded `tokenizer.json` (checked). The runtime parses the tokenizer before
    /// opening the file whole, so that the parse's transient peak does not stack on the indexes.
    pub fn read_tokenizer_json(path: &Path) -> Result<Vec<u8>, FormatError> {
        let (mut file, header) = open_header(path).map_err(|e| naming(path, e))?;
        read_section(&mut file, path, &header, SectionKind::Tokenizer, |d| {
            d.bytes(d.remaining())
        })
        .map_err(|e| naming(path, e))
    }

    /// Reads each layer's FFN input directions (checked), if the file has them (FORMAT.md §9.1):
    /// only refine sparsity uses them, so they are not part of an open file.
    pub fn read_input_basis(path: &Path) -> Result<Option<InputBasis>, FormatError> {
        read_optional(path, SectionKind::InputBasis, InputBasis::decode)
    }

    /// Reads the compact tokenizer (checked), if the file has one (FORMAT.md §4.5).
    pub fn read_bpe_vocab(path: &Path) -> Result<Option<BpeVocab>, FormatError> {
        read_optional(path, SectionKind::BpeVocab, BpeVocab::decode)
    }

    /// How the file's cluster extents order their rows (FORMAT.md §6.3): split in a file whose
    /// clusters are in FFN_DATA_SPLIT (since 1.6).
    pub fn cluster_layout(&self) -> ClusterLayout {
        ffn_data(&self.header).map_or(ClusterLayout::Interleaved, |(_, layout)| layout)
    }

    /// Whether the file holds a mixture of experts (an EXPERT_INDEX section, format 1.5), from its
    /// header alone.
    pub fn has_experts(path: &Path) -> Result<bool, FormatError> {
        let (_, header) = open_header(path).map_err(|e| naming(path, e))?;
        Ok(header.section(SectionKind::ExpertIndex).is_some())
    }

    fn read_inner<R: Read + Seek>(file: &mut R, path: &Path) -> Result<Self, FormatError> {
        let header = read_header(file, path)?;
        let meta = read_section(file, path, &header, SectionKind::Meta, |d| {
            serde_json::from_slice::<Meta>(&d.bytes(d.remaining())?)
                .map_err(|e| FormatError::invalid(format!("META section: {e}")))
        })?;
        let tokenizer_json = read_section(file, path, &header, SectionKind::Tokenizer, |d| {
            d.bytes(d.remaining())
        })?;
        let dense_data = *header
            .section(SectionKind::DenseData)
            .ok_or_else(|| missing("DENSE_DATA"))?;
        let (ffn_data, layout) = ffn_data(&header)?;
        let dense = read_section(file, path, &header, SectionKind::DenseIndex, |d| {
            DenseIndex::decode(d, dense_data.length)
        })?;
        let ffn = read_section(file, path, &header, SectionKind::FfnIndex, |d| {
            FfnIndex::decode(d, ffn_data.length, layout)
        })?;
        let predictors = read_section(
            file,
            path,
            &header,
            SectionKind::Predictors,
            Predictors::decode,
        )?;
        let sketch_base = header
            .section(SectionKind::Sketch)
            .filter(|s| s.encoding == Encoding::Raw as u32)
            .map(|s| s.offset);
        let sketch = read_section(file, path, &header, SectionKind::Sketch, |d| {
            SketchIndex::decode(d, sketch_base)
        })?;
        let refine = read_section(file, path, &header, SectionKind::Refine, Refine::decode)?;
        if header.section(layout.other().expert_data()).is_some() {
            return Err(FormatError::invalid(format!(
                "{} beside {}: a file has one cluster layout",
                layout.other().expert_data().name(),
                layout.ffn_data().name()
            )));
        }
        let expert_data = header.section(layout.expert_data()).copied();
        let experts = match (header.section(SectionKind::ExpertIndex), expert_data) {
            (None, None) => ExpertIndex::default(),
            (Some(_), Some(data)) => {
                read_section(file, path, &header, SectionKind::ExpertIndex, |d| {
                    ExpertIndex::decode(d, data.length, layout)
                })?
            }
            _ => {
                return Err(missing(
                    "EXPERT_INDEX or EXPERT_DATA (one without the other)",
                ))
            }
        };
        let f = Self {
            path: path.to_path_buf(),
            header,
            meta,
            tokenizer_json,
            dense,
            ffn,
            predictors,
            sketch,
            refine,
            experts,
            dense_data,
            ffn_data,
            expert_data,
        };
        f.cross_check()?;
        Ok(f)
    }

    /// The sections agree with each other and with the model config.
    fn cross_check(&self) -> Result<(), FormatError> {
        let c = &self.meta.model;
        c.validate()?;
        let layers = c.num_layers;
        let bad = |what: &str| {
            Err(FormatError::invalid(format!(
                "{what} disagrees with the model config"
            )))
        };
        if self.meta.layers.len() != layers {
            return bad("META's layer list");
        }
        // A mixture's layers keep their experts apart (1.5): their FFN_INDEX layer is empty, and
        // every layer's per-neuron side data may be empty.
        let neurons = |l: usize| {
            if c.is_moe_layer(l) {
                0
            } else {
                c.intermediate_size
            }
        };
        let may_be_empty = c.moe.is_some();
        if self.ffn.layers.len() != layers
            || self
                .ffn
                .layers
                .iter()
                .enumerate()
                .any(|(i, l)| l.neurons() != neurons(i) || l.hidden as usize != c.hidden_size)
        {
            return bad("FFN_INDEX");
        }
        match self.expert_data {
            Some(_) => self.experts.check(c)?,
            None if c.moe.is_some() => {
                return Err(missing("EXPERT_INDEX (the model is a mixture of experts)"))
            }
            None => {}
        }
        if self.sketch.layers.len() != layers
            || self.sketch.layers.iter().any(|l| {
                // An empty layer (format 1.3) has no certificate.
                !(l.neurons == 0 || l.neurons as usize == c.intermediate_size)
                    || l.hidden as usize != c.hidden_size
            })
        {
            return bad("SKETCH");
        }
        let p = &self.predictors;
        if p.own.len() != layers
            || p.lookahead.len() != layers
            || p.own
                .iter()
                .zip(&p.lookahead)
                .enumerate()
                .flat_map(|(l, (o, a))| [(l, o), (l, a)])
                .any(|(l, q)| {
                    let empty = may_be_empty && q.rank == 0 && q.outputs == 0;
                    q.input_dim as usize != c.hidden_size
                        || (q.outputs as usize != neurons(l) && !empty)
                })
            || p.own
                .iter()
                .enumerate()
                .any(|(l, q)| q.input != PredictorInput::FfnInput || q.source_layer as usize != l)
            || p.lookahead
                .iter()
                .enumerate()
                .any(|(l, q)| q.input != PredictorInput::Residual || q.source_layer as usize > l)
        {
            return bad("PREDICTORS");
        }
        if self.refine.layers.len() != layers
            || self
                .refine
                .layers
                .iter()
                .zip(&self.ffn.layers)
                .any(|(r, f)| {
                    let empty =
                        may_be_empty && r.cluster_freq.is_empty() && r.neuron_freq.is_empty();
                    (r.cluster_freq.len() != f.clusters.len() || r.neuron_freq.len() != f.neurons())
                        && !empty
                })
        {
            return bad("REFINE");
        }
        Ok(())
    }

    /// File offset and size of a dense tensor's extent.
    pub fn dense_extent(&self, t: &DenseTensor) -> (u64, u64) {
        (self.dense_data.offset + t.offset, t.extent_size)
    }

    /// File offset and size of cluster `cluster` of layer `layer`.
    pub fn cluster_extent(&self, layer: usize, cluster: usize) -> (u64, u64) {
        let c = &self.ffn.layers[layer].clusters[cluster];
        (self.ffn_data.offset + c.offset, c.extent_size)
    }

    /// File offset and size of cluster `cluster` of expert `expert` of layer `layer` (1.5).
    pub fn expert_cluster_extent(&self, layer: usize, expert: usize, cluster: usize) -> (u64, u64) {
        let c = &self.experts.layers[layer][expert].clusters[cluster];
        (self.expert_data_offset() + c.offset, c.extent_size)
    }

    /// File offset and size of expert `expert` of layer `layer`: its clusters' extents, which
    /// follow each other, so one read fetches the whole expert (1.5).
    pub fn expert_extent(&self, layer: usize, expert: usize) -> (u64, u64) {
        let (offset, size) = self.experts.expert_range(layer, expert);
        (self.expert_data_offset() + offset, size)
    }

    fn expert_data_offset(&self) -> u64 {
        self.expert_data
            .expect("a file with experts has EXPERT_DATA")
            .offset
    }

    /// Reads a dense tensor (checked against its checksum); returns its encoded data.
    pub fn read_dense(&self, file: &mut File, t: &DenseTensor) -> Result<Vec<u8>, FormatError> {
        let (offset, size) = self.dense_extent(t);
        let mut bytes = read_at(file, &self.path, offset, size)?;
        check_extent(&bytes, t.checksum, || {
            format!("{}: tensor {}", self.path.display(), t.name)
        })?;
        bytes.truncate(t.size as usize);
        Ok(bytes)
    }

    /// Reads cluster `cluster` of layer `layer` (checked against its checksum): its neurons' rows
    /// in the file's [`ClusterLayout`] (locate one with [`crate::ffn::FfnLayer::row`]), then the
    /// extent's padding.
    pub fn read_cluster(
        &self,
        file: &mut File,
        layer: usize,
        cluster: usize,
    ) -> Result<Vec<u8>, FormatError> {
        let (offset, size) = self.cluster_extent(layer, cluster);
        let bytes = read_at(file, &self.path, offset, size)?;
        check_extent(
            &bytes,
            self.ffn.layers[layer].clusters[cluster].checksum,
            || format!("{}: layer {layer} cluster {cluster}", self.path.display()),
        )?;
        Ok(bytes)
    }

    /// Reads layer `l`'s certificate, checked against what opening the file checksummed.
    pub fn read_sketch_layer(&self, l: usize) -> Result<SketchLayer, FormatError> {
        let mut file = File::open(&self.path).map_err(|e| FormatError::io(&self.path, e))?;
        self.sketch.layers[l]
            .load(|offset, len| read_at(&mut file, &self.path, offset, len))
            .map_err(|e| naming(&self.path, e))
    }

    /// The whole SKETCH section (tools and tests; the runtime reads only the layers it keeps).
    pub fn read_sketch(&self) -> Result<Sketch, FormatError> {
        let layers = (0..self.sketch.layers.len())
            .map(|l| self.read_sketch_layer(l))
            .collect::<Result<_, _>>()?;
        Ok(Sketch { layers })
    }

    /// File offset and size of every layer's own predictor record, for a reader that keeps it on
    /// flash and reads it when needed; `None` when PREDICTORS is zstd-encoded (not readable in
    /// part). Call before taking the decoded predictors.
    pub fn own_predictor_extents(&self) -> Option<Vec<(u64, u64)>> {
        let s = self.header.section(SectionKind::Predictors)?;
        if s.encoding != Encoding::Raw as u32 {
            return None;
        }
        let p = &self.predictors;
        // The layer count, then per layer the look-ahead record and the own record.
        let mut at = s.offset + 4;
        let mut extents = Vec::with_capacity(p.own.len());
        for (lookahead, own) in p.lookahead.iter().zip(&p.own) {
            at += lookahead.record_bytes();
            extents.push((at, own.record_bytes()));
            at += own.record_bytes();
        }
        Some(extents)
    }

    /// Bytes of the file's sections, by name (for `inspect`).
    pub fn section_sizes(&self) -> Vec<(String, u64)> {
        self.header
            .sections
            .iter()
            .map(|s| (s.name(), s.stored_size))
            .collect()
    }
}

/// Prefixes the file's name to an error about its content (I/O errors already carry it).
fn naming(path: &Path, e: FormatError) -> FormatError {
    match e {
        FormatError::Io { .. } => e,
        other => FormatError::invalid(format!("{}: {other}", path.display())),
    }
}

/// Opens `path` and decodes its header page.
fn open_header(path: &Path) -> Result<(File, Header), FormatError> {
    let mut file = File::open(path).map_err(|e| FormatError::io(path, e))?;
    let header = read_header(&mut file, path)?;
    Ok((file, header))
}

/// Decodes the header page of what `reader` holds (its length is where it ends).
fn read_header<R: Read + Seek>(reader: &mut R, path: &Path) -> Result<Header, FormatError> {
    let len = reader
        .seek(SeekFrom::End(0))
        .map_err(|e| FormatError::io(path, e))?;
    let page = read_at(reader, path, 0, len.min(PAGE))?;
    Header::decode(&page, len)
}

/// An optional section of the file at `path`, read and checked apart from the others: `None`
/// where the file has none.
fn read_optional<T>(
    path: &Path,
    kind: SectionKind,
    decode: impl FnOnce(&mut Dec) -> Result<T, FormatError>,
) -> Result<Option<T>, FormatError> {
    let (mut file, header) = open_header(path).map_err(|e| naming(path, e))?;
    if header.section(kind).is_none() {
        return Ok(None);
    }
    read_section(&mut file, path, &header, kind, decode)
        .map(Some)
        .map_err(|e| naming(path, e))
}

/// Reads, checks and decodes one section. A raw section streams through `decode` and is never
/// held whole (see [`Dec`]); a zstd one is decompressed first. Every byte must be decoded, and
/// damage is reported as a checksum mismatch even where it also breaks decoding.
fn read_section<T, R: Read + Seek>(
    file: &mut R,
    path: &Path,
    header: &Header,
    kind: SectionKind,
    decode: impl FnOnce(&mut Dec) -> Result<T, FormatError>,
) -> Result<T, FormatError> {
    /// Hashes what passes through it.
    struct Hashed<R> {
        inner: R,
        hash: Checksum,
    }
    impl<R: Read> Read for Hashed<R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.inner.read(buf)?;
            self.hash.update(&buf[..n]);
            Ok(n)
        }
    }
    let s = header.section(kind).ok_or_else(|| missing(kind.name()))?;
    let io = |e| FormatError::io(path, e);
    file.seek(SeekFrom::Start(s.offset)).map_err(io)?;
    let mut stored = Hashed {
        inner: BufReader::with_capacity(1 << 16, Read::take(&mut *file, s.stored_size)),
        hash: Checksum::new(),
    };
    let decoded = (|| {
        let content;
        let mut d = if s.encoding == Encoding::Zstd as u32 {
            content = zstd::stream::decode_all(Read::take(&mut stored, s.length))
                .map_err(|e| FormatError::invalid(format!("{} section: {e}", kind.name())))?;
            Dec::new(&content, kind.name())
        } else {
            let raw = Read::take(&mut stored, s.length);
            Dec::from_reader(raw, s.length as usize, kind.name())
        };
        let value = decode(&mut d)?;
        d.finish()?;
        Ok(value)
    })();
    // The padding, or what a failed decode left, still counts towards the checksum.
    std::io::copy(&mut stored, &mut std::io::sink()).map_err(io)?;
    if stored.hash.digest() != s.checksum {
        return Err(FormatError::Checksum {
            what: format!("the {} section", kind.name()),
        });
    }
    decoded
}

/// The section of the FFN's cluster extents and the layout its kind declares (FORMAT.md §6.3):
/// FFN_DATA interleaved, FFN_DATA_SPLIT split.
fn ffn_data(header: &Header) -> Result<(SectionEntry, ClusterLayout), FormatError> {
    let of = |layout: ClusterLayout| header.section(layout.ffn_data()).copied();
    match (of(ClusterLayout::Interleaved), of(ClusterLayout::Split)) {
        (Some(s), None) => Ok((s, ClusterLayout::Interleaved)),
        (None, Some(s)) => Ok((s, ClusterLayout::Split)),
        (None, None) => Err(missing("FFN_DATA (or FFN_DATA_SPLIT)")),
        (Some(_), Some(_)) => Err(FormatError::invalid(
            "both FFN_DATA and FFN_DATA_SPLIT: a file has one cluster layout",
        )),
    }
}

fn missing(name: &str) -> FormatError {
    FormatError::invalid(format!("the {name} section is missing"))
}

/// Checks an extent read from the file against its stored checksum.
pub fn check_extent(
    bytes: &[u8],
    expected: u64,
    what: impl FnOnce() -> String,
) -> Result<(), FormatError> {
    if checksum(bytes) != expected {
        return Err(FormatError::Checksum { what: what() });
    }
    Ok(())
}

/// Bytes read at a time by [`verify`]: extents (an embedding table can be tens of MiB) are hashed
/// in pieces, so checking a file of any size takes bounded memory.
const VERIFY_CHUNK: usize = 1 << 20;

/// Checks every checksum of the file: the header, each section, each tensor and each cluster
/// extent (FORMAT.md §11.2). Returns the number of bytes checked; the error names the file and the
/// first bad extent. `progress(done, total)` is called as bytes are checked.
pub fn verify(path: &Path, progress: impl FnMut(u64, u64)) -> Result<u64, FormatError> {
    let mut file = File::open(path).map_err(|e| FormatError::io(path, e))?;
    verify_reader(&mut file, path, progress)
}

/// [`verify`] of what `reader` holds (a `File`, or bytes in memory through `std::io::Cursor`),
/// `path` naming it in every error.
pub fn verify_reader<R: Read + Seek>(
    reader: &mut R,
    path: &Path,
    mut progress: impl FnMut(u64, u64),
) -> Result<u64, FormatError> {
    /// `(file offset, size)`, and what an extent is called with its own checksum.
    type Extent = (u64, u64);
    type NamedChecksum = (String, u64);
    let f = LsbFile::read(reader, path)?;
    let mut reader = ChunkReader {
        file: reader,
        path,
        buf: vec![0u8; VERIFY_CHUNK],
    };
    let total = f.header.file_size;
    let mut done = PAGE;
    let named = |what: String| FormatError::invalid(format!("{}: {what}", path.display()));
    for s in &f.header.sections {
        // The section in pieces: (file offset, size) and, for a tensor or cluster extent, its name
        // and own checksum.
        let mut pieces: Vec<(Extent, Option<NamedChecksum>)> = Vec::new();
        if s.kind == SectionKind::DenseData as u32 {
            for t in &f.dense.tensors {
                let check = (format!("tensor {}", t.name), t.checksum);
                pieces.push((f.dense_extent(t), Some(check)));
            }
        } else if s.kind == SectionKind::FfnData as u32
            || s.kind == SectionKind::FfnDataSplit as u32
        {
            for (l, layer) in f.ffn.layers.iter().enumerate() {
                for (c, cluster) in layer.clusters.iter().enumerate() {
                    let check = (format!("layer {l} cluster {c}"), cluster.checksum);
                    pieces.push((f.cluster_extent(l, c), Some(check)));
                }
            }
        } else if s.kind == SectionKind::ExpertData as u32
            || s.kind == SectionKind::ExpertDataSplit as u32
        {
            for (l, experts) in f.experts.layers.iter().enumerate() {
                for (e, expert) in experts.iter().enumerate() {
                    for (c, cluster) in expert.clusters.iter().enumerate() {
                        let check = (
                            format!("layer {l} expert {e} cluster {c}"),
                            cluster.checksum,
                        );
                        pieces.push((f.expert_cluster_extent(l, e, c), Some(check)));
                    }
                }
            }
        } else {
            pieces.push(((s.offset, s.stored_size), None));
        }
        let mut section = Checksum::new();
        for ((offset, size), check) in pieces {
            let own = reader.hash(offset, size, &mut section)?;
            if let Some((what, _)) = check.filter(|(_, expected)| *expected != own) {
                let what = format!("{what} at offset {offset}");
                return Err(named(FormatError::Checksum { what }.to_string()));
            }
            done += size;
            progress(done, total);
        }
        if section.digest() != s.checksum {
            return Err(named(format!(
                "checksum mismatch in the {} section",
                s.name()
            )));
        }
    }
    Ok(total)
}

/// Reads ranges of a file through one bounded buffer.
struct ChunkReader<'a, R> {
    file: &'a mut R,
    path: &'a Path,
    buf: Vec<u8>,
}

impl<R: Read + Seek> ChunkReader<'_, R> {
    /// Hashes `size` bytes at `offset`, feeding them to `also` as well; returns their own XXH3.
    fn hash(&mut self, offset: u64, size: u64, also: &mut Checksum) -> Result<u64, FormatError> {
        let io = |e| FormatError::io(self.path, e);
        self.file.seek(SeekFrom::Start(offset)).map_err(io)?;
        let mut own = Checksum::new();
        let mut left = size;
        while left > 0 {
            let n = left.min(self.buf.len() as u64) as usize;
            self.file.read_exact(&mut self.buf[..n]).map_err(io)?;
            own.update(&self.buf[..n]);
            also.update(&self.buf[..n]);
            left -= n as u64;
        }
        Ok(own.digest())
    }
}
