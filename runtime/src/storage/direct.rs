//! The real disk, read with `O_DIRECT` so that the page cache never serves (or keeps) a read: what
//! the memory budget says is not resident must come from the device again.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use super::device::pread_exact;
use super::{AlignedBuf, Device};

/// A file read with direct I/O, one blocking `preadv` per read.
pub struct DirectDevice {
    file: File,
    path: PathBuf,
    queue_depth: usize,
}

impl DirectDevice {
    /// Reads in flight when the caller does not say: enough to keep an NVMe or UFS queue busy.
    pub const DEFAULT_QUEUE_DEPTH: usize = 32;

    /// Opens `path` for direct reads with `queue_depth` reads in flight at most.
    ///
    /// On Linux the file is opened with `O_DIRECT`. Elsewhere there is no portable equivalent and
    /// reads go through the OS cache; [`Device::name`] says so.
    pub fn open(path: &Path, queue_depth: usize) -> io::Result<Self> {
        let file = open_direct(path).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot open {} for direct I/O: {e}", path.display()),
            )
        })?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
            queue_depth: queue_depth.max(1),
        })
    }
}

#[cfg(target_os = "linux")]
fn open_direct(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

#[cfg(not(target_os = "linux"))]
fn open_direct(path: &Path) -> io::Result<File> {
    File::open(path)
}

/// Notes in the device name how reads reach the disk on this platform.
const MODE: &str = if cfg!(target_os = "linux") {
    "O_DIRECT"
} else {
    "buffered: O_DIRECT is Linux-only, the OS cache may serve reads"
};

impl Device for DirectDevice {
    fn read_at(&self, offset: u64, buf: &mut AlignedBuf) -> io::Result<()> {
        pread_exact(&self.file, &self.path, offset, std::slice::from_mut(buf))
    }

    fn read_scattered(&self, offset: u64, bufs: &mut [AlignedBuf]) -> io::Result<()> {
        pread_exact(&self.file, &self.path, offset, bufs)
    }

    fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    fn name(&self) -> String {
        format!("{} ({MODE})", self.path.display())
    }
}
