//! What a flash device does for the runtime: page-aligned positional reads, some of them in flight
//! at once. The real disk ([`super::DirectDevice`]) and the emulated phone flash
//! ([`super::FlashModel`]) both sit behind this trait, so the scheduler cannot tell them apart.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::Instant;

use super::{AlignedBuf, MAX_MERGE_BYTES};

/// A block device holding the model file.
pub trait Device: Send + Sync {
    /// Fills `buf` with the bytes at `offset`; blocks until the device has delivered them.
    /// `offset` and `buf.len()` are multiples of [`AlignedBuf::ALIGN`].
    fn read_at(&self, offset: u64, buf: &mut AlignedBuf) -> io::Result<()>;

    /// How many reads the device serves at once (its command queue depth).
    fn queue_depth(&self) -> usize;

    /// A human-readable name that includes the file, for error messages and reports.
    fn name(&self) -> String;

    /// Reads the consecutive bytes from `offset` into `bufs`, filled in order, as one device read:
    /// how merged reads land in their callers' buffers without a copy. A device that models time
    /// only moves the bytes here; the time is booked with [`Device::schedule`].
    ///
    /// The default reads through one bounce buffer with [`Device::read_at`].
    fn read_scattered(&self, offset: u64, bufs: &mut [AlignedBuf]) -> io::Result<()> {
        if let [buf] = bufs {
            return self.read_at(offset, buf);
        }
        let mut bounce = AlignedBuf::new(bufs.iter().map(|b| b.len()).sum());
        self.read_at(offset, &mut bounce)?;
        let mut start = 0;
        for buf in bufs {
            let len = buf.len();
            buf.copy_from_slice(&bounce[start..start + len]);
            start += len;
        }
        Ok(())
    }

    /// For a device that models time ([`Device::models_time`]): books a `len`-byte read that
    /// reached the device at `arrival` (at or before now) and returns when the modelled device
    /// completes it; the caller imposes the wait. Booking is separate from moving the bytes so
    /// that the read queue can book reads in the order they reach the device, under its own lock,
    /// however late the thread that copies them runs. Real devices take the time they take: `None`.
    fn schedule(&self, arrival: Instant, len: usize) -> Option<Instant> {
        let _ = (arrival, len);
        None
    }

    /// Whether reads are timed by [`Device::schedule`], so that [`Device::read_scattered`] costs
    /// only a copy and may run on the submitting thread.
    fn models_time(&self) -> bool {
        false
    }
}

/// The most buffers one [`pread_exact`] fills: a merged read's parts are whole pages within
/// [`MAX_MERGE_BYTES`].
const MAX_IOV: usize = MAX_MERGE_BYTES / AlignedBuf::ALIGN;

/// `preadv` of exactly the buffers' total length at `offset` (at most [`MAX_IOV`] buffers; their
/// list is on the stack, as reads happen in the token loop): retries `EINTR`; a short read is an
/// `UnexpectedEof` error that names the file and the offset, and other errors name them too.
pub(crate) fn pread_exact(
    file: &File,
    path: &Path,
    offset: u64,
    bufs: &mut [AlignedBuf],
) -> io::Result<()> {
    assert!(
        bufs.len() <= MAX_IOV,
        "a read into {} buffers, more than {MAX_IOV}",
        bufs.len()
    );
    let total: usize = bufs.iter().map(|b| b.len()).sum();
    let empty = libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    };
    let mut all = [empty; MAX_IOV];
    for (v, b) in all.iter_mut().zip(bufs.iter_mut()) {
        *v = libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        };
    }
    let iov = &all[..bufs.len()];
    let read = loop {
        // SAFETY: each iovec covers one live, exclusively borrowed buffer, and at most
        // `MAX_IOV` (far below IOV_MAX) of them are passed.
        let n = unsafe {
            libc::preadv(
                file.as_raw_fd(),
                iov.as_ptr(),
                iov.len() as libc::c_int,
                offset as libc::off_t,
            )
        };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(io::Error::new(
                e.kind(),
                format!(
                    "read of {total} bytes at offset {offset} of {}: {e}",
                    path.display()
                ),
            ));
        }
    };
    if read < total {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "short read of {}: {read} of {total} bytes at offset {offset}",
                path.display()
            ),
        ));
    }
    Ok(())
}
