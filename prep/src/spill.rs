//! The dense model's layer profiles, written to a temporary file by the pass that measures the
//! sparsity curves and read back by the calibration's main pass, which would otherwise run every
//! calibration window through every block a second time for the same values. Memory holds one
//! layer's profile either way; the file holds every layer's (removed when dropped).

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::profile::LayerProfile;

/// f32 values converted per read or write (bounds the buffer beside the profile).
const CHUNK: usize = 1 << 16;

/// The spilled profiles may take at most this share of the free space of the output's disk.
const DISK_SHARE: u64 = 2;

pub struct Spill {
    path: PathBuf,
    file: BufWriter<File>,
    /// Each layer's offset and its arrays' lengths (residual, FFN input, gate, coefficients).
    layers: Vec<(u64, [usize; 4])>,
    end: u64,
}

impl Spill {
    /// A spill file at `path` for `bytes` of profiles, or none (the profiles are then computed
    /// again) where the disk has less than [`DISK_SHARE`] times that free or the file cannot be
    /// made.
    pub fn create(path: &Path, bytes: u64) -> Option<Self> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if free_bytes(dir)? < DISK_SHARE * bytes {
            return None;
        }
        let file = File::options()
            .create_new(true)
            .read(true)
            .write(true)
            .open(path)
            .ok()?;
        Some(Self {
            path: path.to_path_buf(),
            file: BufWriter::new(file),
            layers: Vec::new(),
            end: 0,
        })
    }

    /// Appends layer `l`'s profile (layers in order from 0; `gate` may be left empty where the
    /// rule does not use it).
    pub fn put(&mut self, l: usize, p: &LayerProfile) -> Result<()> {
        if l != self.layers.len() {
            bail!(
                "profiles are spilled in layer order: layer {l} after {}",
                self.layers.len()
            );
        }
        let parts = [&p.residual, &p.ffn_input, &p.gate, &p.coef];
        for part in parts {
            for chunk in part.chunks(CHUNK) {
                let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
                self.file
                    .write_all(&bytes)
                    .with_context(|| format!("cannot write {}", self.path.display()))?;
            }
        }
        let lens = parts.map(Vec::len);
        self.layers.push((self.end, lens));
        self.end += 4 * lens.iter().sum::<usize>() as u64;
        Ok(())
    }

    /// Layer `l`'s profile as [`Spill::put`] wrote it.
    pub fn take(&mut self, l: usize) -> Result<LayerProfile> {
        let &(offset, lens) = self
            .layers
            .get(l)
            .with_context(|| format!("layer {l}'s profile was not spilled"))?;
        self.file.flush()?;
        let file = self.file.get_mut();
        file.seek(SeekFrom::Start(offset))?;
        let mut reader = BufReader::new(&*file);
        let mut read = |len: usize| -> Result<Vec<f32>> {
            let mut out = Vec::with_capacity(len);
            let mut bytes = vec![0u8; 4 * CHUNK.min(len)];
            while out.len() < len {
                let n = CHUNK.min(len - out.len());
                reader
                    .read_exact(&mut bytes[..4 * n])
                    .with_context(|| format!("cannot read {}", self.path.display()))?;
                out.extend(
                    bytes[..4 * n]
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                );
            }
            Ok(out)
        };
        let p = LayerProfile {
            residual: read(lens[0])?,
            ffn_input: read(lens[1])?,
            gate: read(lens[2])?,
            coef: read(lens[3])?,
        };
        drop(reader);
        file.seek(SeekFrom::Start(self.end))?;
        Ok(p)
    }
}

impl Drop for Spill {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Bytes free to an unprivileged writer on the file system of `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `s` a statvfs the call fills.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return None;
    }
    Some(s.f_bavail as u64 * s.f_frsize as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spilled_profiles_come_back_bit_for_bit_in_any_order() {
        let dir = std::env::temp_dir().join(format!("ls-spill-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p");
        let profile = |l: usize| LayerProfile {
            residual: (0..3 * CHUNK + 5)
                .map(|i| (i * (l + 1)) as f32 * 0.5)
                .collect(),
            ffn_input: vec![f32::MIN_POSITIVE, -0.0, f32::MAX, 1e-40],
            gate: Vec::new(),
            coef: (0..7).map(|i| -(i as f32) / (l as f32 + 3.0)).collect(),
        };
        {
            let mut spill = Spill::create(&path, 1 << 20).expect("disk space for 1 MiB");
            spill.put(0, &profile(0)).unwrap();
            spill.put(1, &profile(1)).unwrap();
            assert!(spill.put(3, &profile(3)).is_err());
            for l in [1, 0, 1] {
                let (got, want) = (spill.take(l).unwrap(), profile(l));
                for (a, b) in [
                    (&got.residual, &want.residual),
                    (&got.ffn_input, &want.ffn_input),
                    (&got.gate, &want.gate),
                    (&got.coef, &want.coef),
                ] {
                    let bits = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(a), bits(b));
                }
            }
            // Appending after a read continues at the end.
            spill.put(2, &profile(2)).unwrap();
            assert_eq!(spill.take(2).unwrap().coef, profile(2).coef);
            assert!(spill.take(3).is_err());
            assert!(path.exists());
        }
        assert!(!path.exists(), "removed when dropped");
        // No spill where the disk cannot hold it.
        assert!(Spill::create(&path, u64::MAX / 4).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
