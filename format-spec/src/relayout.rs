//! A file's cluster extents rewritten in another [`ClusterLayout`] (FORMAT.md §6.3, §12): a 1.5
//! file upgraded to 1.6 without converting the model again (`leanstream-prep upgrade`), or a 1.6
//! file written as 1.5 (the tests of older files). Only the extents' byte order changes, with the
//! checksums that cover it (each extent's in its index record, the data and index sections'), the
//! data sections' kinds, which name the layout (§3.2), and the header's minor version: the weights, their encodings, permutations and sizes stay as they
//! are, so every section keeps its place.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use crate::container::Checksum;

use crate::atomic::AtomicFile;
use crate::container::{checksum, read_at, Encoding, SectionKind};
use crate::ffn::{ClusterLayout, FfnLayer, SPLIT_SINCE_MINOR};
use crate::file::check_extent;
use crate::{FormatError, LsbFile};

/// Writes `src` to `dst` with every FFN and expert cluster in layout `to` (§6.3) and the minor
/// version that layout takes: at least 1.6 for [`ClusterLayout::Split`], at most 1.5 for
/// [`ClusterLayout::Interleaved`]. Every extent is checked against its checksum as it is read.
/// `dst` appears whole or not at all; an existing `dst` is replaced. An error if `src`'s clusters
/// are in layout `to` already.
pub fn relayout(src: &Path, dst: &Path, to: ClusterLayout) -> Result<(), FormatError> {
    let mut f = LsbFile::open(src)?;
    let from = f.cluster_layout();
    if from == to {
        return Err(FormatError::invalid(format!(
            "{} is format {}.{}: its clusters are {} already",
            src.display(),
            f.header.version_major,
            f.header.version_minor,
            to.name()
        )));
    }
    let mut reader = File::open(src).map_err(|e| FormatError::io(src, e))?;
    let mut out = AtomicFile::create(dst)?;
    let tmp = out.tmp_path().to_path_buf();
    let io = |e| FormatError::io(&tmp, e);
    std::io::copy(&mut reader, out.file()).map_err(io)?;
    let mut header = f.header.clone();
    // (the data section's kind now, its kind in `to`, its index section), for the FFN and the
    // experts: the kind names the layout (§3.2), so it changes with it.
    let mut pairs = vec![(from.ffn_data(), to.ffn_data(), SectionKind::FfnIndex)];
    if header.section(from.expert_data()).is_some() {
        pairs.push((
            from.expert_data(),
            to.expert_data(),
            SectionKind::ExpertIndex,
        ));
    }
    for (data, new_kind, index) in pairs {
        let slot = |kind: SectionKind| {
            header
                .sections
                .iter()
                .position(|s| s.kind == kind as u32)
                .ok_or_else(|| {
                    FormatError::invalid(format!("{}: no {}", src.display(), kind.name()))
                })
        };
        let (d, i) = (slot(data)?, slot(index)?);
        let base = header.sections[d].offset;
        // The extents tile the data section in order (§6.2, §6.5): its checksum is theirs in turn.
        let mut section = Checksum::new();
        let ffn = index == SectionKind::FfnIndex;
        let layers: Vec<(String, &mut FfnLayer)> = if ffn {
            let named = f.ffn.layers.iter_mut().enumerate();
            named.map(|(l, x)| (format!("layer {l}"), x)).collect()
        } else {
            let named = f.experts.layers.iter_mut().enumerate().flat_map(|(l, xs)| {
                xs.iter_mut()
                    .enumerate()
                    .map(move |(e, x)| (format!("layer {l} expert {e}"), x))
            });
            named.collect()
        };
        for (what, layer) in layers {
            let rb = layer.row_bytes();
            for (ci, c) in layer.clusters.iter_mut().enumerate() {
                let at = base + c.offset;
                let extent = read_at(&mut reader, src, at, c.extent_size)?;
                check_extent(&extent, c.checksum, || {
                    format!("{}: {what} cluster {ci}", src.display())
                })?;
                let moved = from.move_rows(to, &extent, c.count as usize, rb);
                out.file().seek(SeekFrom::Start(at)).map_err(io)?;
                out.file().write_all(&moved).map_err(io)?;
                c.checksum = checksum(&moved);
                section.update(&moved);
            }
            layer.layout = to;
        }
        header.sections[d].checksum = section.digest();
        header.sections[d].kind = new_kind as u32;
        let encoded = if ffn {
            f.ffn.encode()
        } else {
            f.experts.encode()
        };
        let entry = &mut header.sections[i];
        if entry.encoding != Encoding::Raw as u32 || entry.length != encoded.len() as u64 {
            return Err(FormatError::invalid(format!(
                "{}: {} is compressed or of another size: convert the model again instead",
                src.display(),
                index.name()
            )));
        }
        let mut stored = encoded;
        stored.resize(entry.stored_size as usize, 0);
        out.file().seek(SeekFrom::Start(entry.offset)).map_err(io)?;
        out.file().write_all(&stored).map_err(io)?;
        entry.checksum = checksum(&stored);
    }
    // Interleaved clusters go back below 1.6 unless another section kind needs more (INPUT_BASIS:
    // 1.10, whose layout the section kinds then name, §12).
    let other_kinds = header
        .sections
        .iter()
        .filter_map(|s| SectionKind::from_u32(s.kind))
        .filter(|k| !matches!(k, SectionKind::FfnDataSplit | SectionKind::ExpertDataSplit))
        .map(SectionKind::since_minor)
        .max()
        .unwrap_or(1);
    header.version_minor = match to {
        ClusterLayout::Split => header.version_minor.max(SPLIT_SINCE_MINOR),
        ClusterLayout::Interleaved => header
            .version_minor
            .min(SPLIT_SINCE_MINOR - 1)
            .max(other_kinds),
    };
    out.file().seek(SeekFrom::Start(0)).map_err(io)?;
    out.file().write_all(&header.encode()).map_err(io)?;
    out.commit(true)
}
