//! The transfer archive (`*.lsb.zst`, FORMAT.md §14): a LeanStream file compressed as one zstd
//! frame, preceded by a manifest and followed by the file's XXH3, both in zstd skippable frames.
//! Packing and unpacking stream through fixed-size buffers, so memory does not grow with the
//! file; `zstd -d` also restores the file, since standard decoders skip the skippable frames.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, ErrorKind, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::container::Checksum;
use serde::{Deserialize, Serialize};

use crate::atomic::{exists_error, AtomicFile};
use crate::container::{checksum, read_at, Header, PAGE};
use crate::{verify, FormatError};

/// The archive layout version written into the manifest.
pub const ARCHIVE_VERSION: u32 = 1;
/// Skippable-frame magic numbers (RFC 8878 §3.1.2) of the manifest and of the checksum trailer.
const MANIFEST_FRAME: u32 = 0x184D_2A5C;
const CHECKSUM_FRAME: u32 = 0x184D_2A5D;
/// The magic number of an ordinary zstd frame, to recognise a plain `.zst` file.
const ZSTD_FRAME: u32 = 0xFD2F_B528;
/// The manifest frame's payload starts with this tag.
const MANIFEST_TAG: &[u8; 8] = b"LSARCHIV";
/// Bound on the manifest frame's payload, checked before it is read.
const MAX_MANIFEST: u32 = 64 << 10;
/// Bytes read or written at a time; with zstd's own buffers this bounds memory.
const CHUNK: usize = 1 << 20;
/// Input bytes per zstd compression job: the multi-threaded compressor holds a few jobs per
/// thread, so this bounds its memory (zstd's default at level 3, 8 MiB, peaked at ≈ 57 MiB with
/// two threads).
const JOB_SIZE: u32 = 2 << 20;
/// Largest zstd window accepted when unpacking (8 MiB: what levels ≤ 19 use), so a damaged or
/// hostile frame cannot make the decoder allocate more.
const MAX_WINDOW_LOG: u32 = 23;
/// Highest compression level `pack` accepts (levels 20–22 need windows beyond `MAX_WINDOW_LOG`).
pub const MAX_LEVEL: i32 = 19;

/// What the archive says about the file it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub archive_version: u32,
    /// The packed file's format and version, e.g. `LeanStream 1.0`.
    pub format: String,
    /// The packed file's name, without folders.
    pub name: String,
    /// The packed file's size in bytes.
    pub size: u64,
}

/// How to compress.
#[derive(Debug, Clone, Copy)]
pub struct PackOptions {
    /// zstd level, 1 ..= [`MAX_LEVEL`].
    pub level: i32,
    /// zstd compression worker threads (at least 1).
    pub threads: u32,
}

/// The outcome of [`pack`].
#[derive(Debug, Clone, Serialize)]
pub struct PackReport {
    pub manifest: Manifest,
    pub archive_bytes: u64,
    /// XXH3 of the packed file, as recorded in the trailer.
    pub checksum: u64,
}

/// The two phases of [`unpack`], for progress reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Unpack,
    Verify,
}

/// The outcome of [`unpack`].
#[derive(Debug, Clone)]
pub struct UnpackReport {
    pub manifest: Manifest,
    /// Where the file was written.
    pub output: PathBuf,
}

/// Packs the LeanStream file `src` into the archive `dst`, written to a temporary name and renamed
/// into place. Only `src`'s header is checked (magic, version, checksum, size), so that packing
/// stays cheap; unpacking verifies everything. `progress(done, total)` reports bytes read.
pub fn pack(
    src: &Path,
    dst: &Path,
    opts: &PackOptions,
    progress: impl FnMut(u64, u64),
) -> Result<PackReport, FormatError> {
    if !(1..=MAX_LEVEL).contains(&opts.level) || opts.threads == 0 {
        return Err(FormatError::invalid(format!(
            "the compression level must be 1 to {MAX_LEVEL} and threads at least 1"
        )));
    }
    if same_file(src, dst) {
        return Err(FormatError::invalid(format!(
            "{} is the file being packed: choose another output",
            dst.display()
        )));
    }
    let mut input = File::open(src).map_err(|e| FormatError::io(src, e))?;
    let len = (input.metadata())
        .map_err(|e| FormatError::io(src, e))?
        .len();
    let header = Header::decode(&read_at(&mut input, src, 0, len.min(PAGE))?, len)
        .map_err(|e| FormatError::invalid(format!("{}: {e}", src.display())))?;
    input
        .seek(SeekFrom::Start(0))
        .map_err(|e| FormatError::io(src, e))?;
    let name = src
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| FormatError::invalid(format!("{} is not a file", src.display())))?;
    let manifest = Manifest {
        archive_version: ARCHIVE_VERSION,
        format: format!(
            "LeanStream {}.{}",
            header.version_major, header.version_minor
        ),
        name,
        size: header.file_size,
    };
    let mut out = AtomicFile::create(dst)?;
    let tmp = out.tmp_path().to_path_buf();
    let mut writer = BufWriter::with_capacity(CHUNK, out.file());
    let checksum = write_archive(
        (&mut input, src),
        (&mut writer, &tmp),
        &manifest,
        opts,
        progress,
    )?;
    writer.flush().map_err(|e| FormatError::io(&tmp, e))?;
    drop(writer);
    let archive_bytes = (out.file().metadata())
        .map_err(|e| FormatError::io(&tmp, e))?
        .len();
    out.commit(true)?;
    Ok(PackReport {
        manifest,
        archive_bytes,
        checksum,
    })
}

/// Unpacks `archive` to `output` (default: the name in its manifest, next to the archive; a
/// folder means that name inside it). The bytes go to a temporary name in the output's folder,
/// are checked against the archive's XXH3 and then by [`verify`], and only then renamed into
/// place; an existing output is replaced only with `force`. On any error nothing is left under
/// the output name.
pub fn unpack(
    archive: &Path,
    output: Option<&Path>,
    force: bool,
    mut progress: impl FnMut(Stage, u64, u64),
) -> Result<UnpackReport, FormatError> {
    let file = File::open(archive).map_err(|e| FormatError::io(archive, e))?;
    let mut reader = BufReader::with_capacity(CHUNK, file);
    let manifest = read_manifest(&mut reader, archive)?;
    let dest = output_path(archive, output, &manifest.name)?;
    if same_file(archive, &dest) {
        return Err(FormatError::invalid(format!(
            "{} is the archive itself: choose another output",
            dest.display()
        )));
    }
    if !force && dest.exists() {
        return Err(exists_error(&dest));
    }
    let mut out = AtomicFile::create(&dest)?;
    let tmp = out.tmp_path().to_path_buf();
    let mut writer = BufWriter::with_capacity(CHUNK, out.file());
    read_body(
        (&mut reader, archive),
        (&mut writer, &tmp),
        &manifest,
        |d, t| progress(Stage::Unpack, d, t),
    )?;
    writer.flush().map_err(|e| FormatError::io(&tmp, e))?;
    drop(writer);
    verify(&tmp, |d, t| progress(Stage::Verify, d, t)).map_err(|e| {
        FormatError::invalid(format!(
            "{}: the unpacked file fails verification, so it was not kept: {e}",
            archive.display()
        ))
    })?;
    out.commit(force)?;
    Ok(UnpackReport {
        manifest,
        output: dest,
    })
}

/// Whether two paths name the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Where [`unpack`] writes. The manifest's name comes from the archive, so it must be a plain
/// file name: it may not lead out of the chosen folder.
fn output_path(archive: &Path, output: Option<&Path>, name: &str) -> Result<PathBuf, FormatError> {
    let dir = match output {
        Some(p) if !p.is_dir() => return Ok(p.to_path_buf()),
        Some(dir) => dir.to_path_buf(),
        None => archive.parent().map(Path::to_path_buf).unwrap_or_default(),
    };
    let plain = !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && Path::new(name).file_name().is_some();
    if !plain {
        return Err(FormatError::invalid(format!(
            "{}: the archive names its file {name:?}, which is not a plain file name: give the \
             output file with -o",
            archive.display()
        )));
    }
    Ok(dir.join(name))
}

/// Writes a whole archive: manifest frame, the zstd frame of `src`'s bytes, checksum frame.
/// Returns the XXH3 of the bytes read. Each side comes with the path its errors name.
pub fn write_archive(
    (src, src_path): (&mut impl Read, &Path),
    (out, out_path): (&mut impl Write, &Path),
    manifest: &Manifest,
    opts: &PackOptions,
    mut progress: impl FnMut(u64, u64),
) -> Result<u64, FormatError> {
    let write_err = |e| FormatError::io(out_path, e);
    let json = serde_json::to_vec(manifest).expect("a manifest serializes");
    let mut payload = MANIFEST_TAG.to_vec();
    payload.extend_from_slice(&json);
    payload.extend_from_slice(&checksum(&payload).to_le_bytes());
    write_skippable(out, MANIFEST_FRAME, &payload).map_err(write_err)?;

    let mut encoder =
        zstd::stream::write::Encoder::new(&mut *out, opts.level).map_err(write_err)?;
    encoder.include_checksum(true).map_err(write_err)?;
    encoder.multithread(opts.threads).map_err(write_err)?;
    (encoder.set_parameter(zstd::zstd_safe::CParameter::JobSize(JOB_SIZE))).map_err(write_err)?;
    encoder
        .set_pledged_src_size(Some(manifest.size))
        .map_err(write_err)?;
    let mut hasher = Checksum::new();
    let mut buf = vec![0u8; CHUNK];
    let mut done = 0u64;
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(FormatError::io(src_path, e)),
        };
        done += n as u64;
        if done > manifest.size {
            break;
        }
        hasher.update(&buf[..n]);
        encoder.write_all(&buf[..n]).map_err(write_err)?;
        progress(done, manifest.size);
    }
    if done != manifest.size {
        return Err(FormatError::invalid(format!(
            "{} changed while it was packed (expected {} bytes): pack it again",
            src_path.display(),
            manifest.size
        )));
    }
    encoder.finish().map_err(write_err)?;
    let sum = hasher.digest();
    write_skippable(out, CHECKSUM_FRAME, &sum.to_le_bytes()).map_err(write_err)?;
    Ok(sum)
}

fn write_skippable(out: &mut impl Write, magic: u32, payload: &[u8]) -> std::io::Result<()> {
    out.write_all(&magic.to_le_bytes())?;
    out.write_all(&(payload.len() as u32).to_le_bytes())?;
    out.write_all(payload)
}

/// Reads and checks the manifest frame at the start of an archive.
pub fn read_manifest(r: &mut impl Read, path: &Path) -> Result<Manifest, FormatError> {
    let bad = |what: &str| FormatError::invalid(format!("{}: {what}", path.display()));
    let not_archive = || {
        bad("not a LeanStream archive (they are made by `leanstream-prep pack`); a plain .lsb file \
             needs no unpacking")
    };
    let (magic, len) = match read_frame_header(r, path)? {
        Some(h) => h,
        None => return Err(not_archive()),
    };
    if magic == ZSTD_FRAME {
        return Err(bad(
            "a plain zstd file, not a LeanStream archive: decompress it with `zstd -d`",
        ));
    }
    if magic != MANIFEST_FRAME || len > MAX_MANIFEST || (len as usize) < MANIFEST_TAG.len() + 8 {
        return Err(not_archive());
    }
    let mut payload = vec![0u8; len as usize];
    read_exact(r, &mut payload, path)?;
    let (body, sum) = payload.split_at(payload.len() - 8);
    if &body[..MANIFEST_TAG.len()] != MANIFEST_TAG {
        return Err(not_archive());
    }
    if checksum(body).to_le_bytes() != sum {
        return Err(bad(
            "checksum mismatch in the archive's manifest: the archive is corrupted; copy it again",
        ));
    }
    let manifest: Manifest = serde_json::from_slice(&body[MANIFEST_TAG.len()..])
        .map_err(|e| bad(&format!("the archive's manifest is invalid: {e}")))?;
    if manifest.archive_version != ARCHIVE_VERSION {
        return Err(bad(&format!(
            "archive version {} is not supported (this build reads {ARCHIVE_VERSION}): update \
             leanstream, or pack the file with this version",
            manifest.archive_version
        )));
    }
    Ok(manifest)
}

/// Decompresses the file's bytes after the manifest into `out`, then checks their size, the
/// trailer's XXH3 and that nothing follows. Each side comes with the path its errors name.
pub fn read_body(
    (r, path): (&mut impl BufRead, &Path),
    (out, out_path): (&mut impl Write, &Path),
    manifest: &Manifest,
    mut progress: impl FnMut(u64, u64),
) -> Result<(), FormatError> {
    let bad = |what: String| FormatError::invalid(format!("{}: {what}", path.display()));
    let corrupted = |e: std::io::Error| {
        bad(format!(
            "the archive is corrupted or truncated ({e}): copy it again"
        ))
    };
    let size = manifest.size;
    let mut hasher = Checksum::new();
    let mut decoder = zstd::stream::read::Decoder::with_buffer(&mut *r)
        .map_err(corrupted)?
        .single_frame();
    decoder.window_log_max(MAX_WINDOW_LOG).map_err(corrupted)?;
    let mut buf = vec![0u8; CHUNK];
    let mut done = 0u64;
    loop {
        let n = match decoder.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(corrupted(e)),
        };
        done += n as u64;
        if done > size {
            return Err(bad(format!(
                "the archive holds more than the {size} bytes its manifest records: it is \
                 corrupted; copy it again"
            )));
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(|e| FormatError::io(out_path, e))?;
        progress(done, size);
    }
    drop(decoder);
    if done != size {
        return Err(bad(format!(
            "truncated: it holds {done} of the {size} bytes its manifest records; copy it again"
        )));
    }
    let truncated = || bad("truncated: the checksum at its end is missing; copy it again".into());
    let mut sum = [0u8; 8];
    match read_frame_header(r, path)? {
        Some((CHECKSUM_FRAME, 8)) => read_exact(r, &mut sum, path).map_err(|_| truncated())?,
        Some(_) => {
            return Err(bad(
                "the archive is corrupted after the compressed file; copy it again".into(),
            ))
        }
        None => return Err(truncated()),
    }
    if !r
        .fill_buf()
        .map_err(|e| FormatError::io(path, e))?
        .is_empty()
    {
        return Err(bad(
            "unexpected bytes after the end of the archive; copy it again".into(),
        ));
    }
    if hasher.digest() != u64::from_le_bytes(sum) {
        return Err(bad(format!(
            "checksum mismatch: the unpacked bytes differ from the packed {}; the archive is \
             corrupted, copy it again",
            manifest.name
        )));
    }
    Ok(())
}

/// Reads a frame's magic number and (for skippable frames) its length; `None` at a clean or
/// truncated end.
fn read_frame_header(r: &mut impl Read, path: &Path) -> Result<Option<(u32, u32)>, FormatError> {
    let mut h = [0u8; 8];
    match r.read_exact(&mut h) {
        Ok(()) => Ok(Some((
            u32::from_le_bytes(h[..4].try_into().expect("4 bytes")),
            u32::from_le_bytes(h[4..].try_into().expect("4 bytes")),
        ))),
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => Ok(None),
        Err(e) => Err(FormatError::io(path, e)),
    }
}

fn read_exact(r: &mut impl Read, buf: &mut [u8], path: &Path) -> Result<(), FormatError> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        ErrorKind::UnexpectedEof => FormatError::invalid(format!(
            "{}: the archive is truncated; copy it again",
            path.display()
        )),
        _ => FormatError::io(path, e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packs `data` in memory (without the LeanStream-file check of [`pack`]).
    fn archive_of(data: &[u8], threads: u32) -> (Manifest, Vec<u8>) {
        let manifest = Manifest {
            archive_version: ARCHIVE_VERSION,
            format: "LeanStream 1.0".into(),
            name: "m.lsb".into(),
            size: data.len() as u64,
        };
        let mut out = Vec::new();
        let opts = PackOptions { level: 3, threads };
        let p = Path::new("mem");
        write_archive(
            (&mut &data[..], p),
            (&mut out, p),
            &manifest,
            &opts,
            |_, _| {},
        )
        .unwrap();
        (manifest, out)
    }

    fn unpack_mem(archive: &[u8]) -> Result<(Manifest, Vec<u8>), FormatError> {
        let p = Path::new("mem");
        let mut r = archive;
        let manifest = read_manifest(&mut r, p)?;
        let mut out = Vec::new();
        read_body((&mut r, p), (&mut out, p), &manifest, |_, _| {})?;
        Ok((manifest, out))
    }

    /// Compressible but not trivial bytes.
    fn sample(len: usize) -> Vec<u8> {
        let mut x = 0x9E37_79B9u32;
        (0..len)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                if i % 3 == 0 {
                    x as u8
                } else {
                    (i / 97) as u8
                }
            })
            .collect()
    }

    #[test]
    fn round_trip_is_byte_identical_and_plain_zstd_reads_it() {
        let data = sample(3 * CHUNK + 12345);
        for threads in [1, 2] {
            let (manifest, archive) = archive_of(&data, threads);
            // A third of the bytes are random: they stay, the rest compresses.
            let (len, n) = (archive.len(), data.len());
            assert!(len > n / 3 && len < n * 9 / 10, "{len} of {n}");
            let (m, out) = unpack_mem(&archive).unwrap();
            assert_eq!(m, manifest);
            assert!(out == data, "threads {threads}: bytes differ");
            // A standard decoder skips the manifest and trailer frames.
            assert!(zstd::stream::decode_all(&archive[..]).unwrap() == data);
        }
    }

    #[test]
    fn every_flipped_byte_and_every_truncation_is_refused() {
        let data = sample(20_000);
        let (_, archive) = archive_of(&data, 1);
        for i in 0..archive.len() {
            let mut bad = archive.clone();
            bad[i] ^= 0x04;
            assert!(
                unpack_mem(&bad).is_err(),
                "flip at {i} of {}",
                archive.len()
            );
        }
        for cut in 0..archive.len() {
            let err = unpack_mem(&archive[..cut]).expect_err("truncated");
            assert!(err.to_string().contains("mem:"), "{err}");
        }
        let mut longer = archive.clone();
        longer.push(0);
        let err = unpack_mem(&longer).unwrap_err().to_string();
        assert!(err.contains("after the end"), "{err}");
    }

    #[test]
    fn other_files_are_refused_with_a_hint() {
        let plain = zstd::stream::encode_all(&b"hello"[..], 3).unwrap();
        let err = unpack_mem(&plain).unwrap_err().to_string();
        assert!(err.contains("zstd -d"), "{err}");
        let err = unpack_mem(b"LEANSTRM and more bytes")
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a LeanStream archive"), "{err}");
    }

    #[test]
    fn output_names_from_the_archive_stay_in_the_folder() {
        let a = Path::new("dir/m.lsb.zst");
        assert_eq!(
            output_path(a, None, "m.lsb").unwrap(),
            Path::new("dir/m.lsb")
        );
        for name in ["", ".", "..", "../x", "a/b", "/etc/passwd"] {
            assert!(output_path(a, None, name).is_err(), "{name:?}");
        }
        assert_eq!(
            output_path(a, Some(Path::new("out.lsb")), "../x").unwrap(),
            Path::new("out.lsb")
        );
    }
}
