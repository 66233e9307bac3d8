//! An emulated phone or board flash device. This host's disk is slower than UFS 4.0 at small reads,
//! so throttling it could not emulate a phone; instead the bytes come from a copy of the file held
//! outside the process (the OS page cache, or a tmpfs copy such as one in /dev/shm), which plays
//! the flash and is not part of the process's memory budget, and the timing comes from a queue
//! model of the profile imposed in wall-clock time, so compute and I/O overlap for real.
//!
//! Under a cgroup memory limit the page cache is charged to the group that first reads a page, so
//! for budgeted runs cache the file (or write its tmpfs copy) from outside the group first.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use super::device::pread_exact;
use super::queue_model::QueueModel;
use super::{clock, AlignedBuf, Device, FlashProfile};

/// A file read through the page cache at the speed of a [`FlashProfile`].
pub struct FlashModel {
    file: File,
    path: PathBuf,
    profile: FlashProfile,
    model: Mutex<QueueModel>,
}

impl FlashModel {
    /// Emulates `profile` over the bytes of `path`, and asks the OS to load the file into its cache
    /// now so that the first reads are not served (slowly) by the real disk.
    pub fn open(path: &Path, profile: FlashProfile) -> io::Result<Self> {
        profile
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{e:#}")))?;
        let file = File::open(path).map_err(|e| {
            io::Error::new(e.kind(), format!("cannot open {}: {e}", path.display()))
        })?;
        prefetch(&file);
        Ok(Self {
            file,
            path: path.to_path_buf(),
            model: Mutex::new(QueueModel::new(&profile)),
            profile,
        })
    }

    /// The profile being emulated.
    pub fn profile(&self) -> &FlashProfile {
        &self.profile
    }
}

#[cfg(target_os = "linux")]
fn prefetch(file: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid descriptor; the advice is only a hint, so its result does not matter.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_WILLNEED);
    }
}

#[cfg(not(target_os = "linux"))]
fn prefetch(_file: &File) {}

impl Device for FlashModel {
    fn read_at(&self, offset: u64, buf: &mut AlignedBuf) -> io::Result<()> {
        let done = self.schedule(Instant::now(), buf.len());
        pread_exact(&self.file, &self.path, offset, std::slice::from_mut(buf))?;
        if let Some(done) = done {
            clock::sleep_until(done);
        }
        Ok(())
    }

    fn read_scattered(&self, offset: u64, bufs: &mut [AlignedBuf]) -> io::Result<()> {
        pread_exact(&self.file, &self.path, offset, bufs)
    }

    fn schedule(&self, arrival: Instant, len: usize) -> Option<Instant> {
        let mut model = self.model.lock().unwrap_or_else(|e| e.into_inner());
        Some(model.complete_at(arrival, len))
    }

    fn models_time(&self) -> bool {
        true
    }

    fn queue_depth(&self) -> usize {
        self.profile.queue_depth
    }

    fn name(&self) -> String {
        format!(
            "flash model {} over {}",
            self.profile.name,
            self.path.display()
        )
    }
}
