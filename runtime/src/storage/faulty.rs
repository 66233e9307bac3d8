//! A test tool: a [`Device`] wrapper that injects the faults a phone's flash produces — I/O errors
//! on chosen reads, short reads, slow reads and flipped bits — so that tests can show the runtime
//! answers each with a retry, a clear error, or the right tokens, and never a wrong token. It is
//! public so integration tests can pass it to [`crate::streaming::StreamingModel::open_on`]; the
//! command-line tool never uses it.

use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{AlignedBuf, Device};

/// What goes wrong with a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The read fails with `EIO`.
    Eio,
    /// The read delivers only its first half, then fails as a short read does.
    ShortRead,
    /// The read succeeds after this extra delay.
    Delay(Duration),
    /// The read succeeds with bit `bit` of the byte at file offset `at` inverted (only reads
    /// that cover `at` are affected).
    BitFlip { at: u64, bit: u8 },
}

/// A fault that strikes reads overlapping `range`, `times` times (`u32::MAX`: every time).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub kind: FaultKind,
    pub range: Range<u64>,
    pub times: u32,
}

impl Fault {
    /// A fault that strikes every read overlapping `range`.
    pub fn persistent(kind: FaultKind, range: Range<u64>) -> Self {
        Self {
            kind,
            range,
            times: u32::MAX,
        }
    }

    /// A fault that strikes the next `times` reads overlapping `range`, then clears.
    pub fn transient(kind: FaultKind, range: Range<u64>, times: u32) -> Self {
        Self { kind, range, times }
    }

    /// A bit flip at file offset `at`, on every read that covers it.
    pub fn bit_flip(at: u64, bit: u8) -> Self {
        Self::persistent(FaultKind::BitFlip { at, bit }, at..at + 1)
    }
}

/// A device whose reads go to `inner` except where a [`Fault`] strikes.
pub struct FaultyDevice {
    inner: Arc<dyn Device>,
    faults: Mutex<Vec<Fault>>,
    reads: AtomicU64,
    injected: AtomicU64,
}

impl FaultyDevice {
    pub fn new(inner: Arc<dyn Device>, faults: Vec<Fault>) -> Self {
        Self {
            inner,
            faults: Mutex::new(faults),
            reads: AtomicU64::new(0),
            injected: AtomicU64::new(0),
        }
    }

    /// Device reads so far, including failed ones.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// Faults injected so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    /// The faults striking a read of `len` bytes at `offset`, each spent once.
    fn strike(&self, offset: u64, len: usize) -> Vec<FaultKind> {
        let end = offset + len as u64;
        let mut faults = self.faults.lock().unwrap_or_else(|e| e.into_inner());
        let mut hit = Vec::new();
        for f in faults.iter_mut() {
            if f.times > 0 && f.range.start < end && offset < f.range.end {
                if f.times != u32::MAX {
                    f.times -= 1;
                }
                hit.push(f.kind);
            }
        }
        self.injected.fetch_add(hit.len() as u64, Ordering::Relaxed);
        hit
    }
}

impl Device for FaultyDevice {
    fn read_at(&self, offset: u64, buf: &mut AlignedBuf) -> io::Result<()> {
        self.read_scattered(offset, std::slice::from_mut(buf))
    }

    fn read_scattered(&self, offset: u64, bufs: &mut [AlignedBuf]) -> io::Result<()> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let len: usize = bufs.iter().map(|b| b.len()).sum();
        let faults = self.strike(offset, len);
        for kind in &faults {
            match *kind {
                FaultKind::Eio => return Err(io::Error::from_raw_os_error(libc::EIO)),
                FaultKind::Delay(d) => std::thread::sleep(d),
                FaultKind::ShortRead | FaultKind::BitFlip { .. } => {}
            }
        }
        self.inner.read_scattered(offset, bufs)?;
        for kind in faults {
            match kind {
                FaultKind::ShortRead => {
                    // The second half never arrived: what a short transfer leaves behind.
                    let mut start = 0;
                    for buf in bufs.iter_mut() {
                        let keep = (len / 2).saturating_sub(start).min(buf.len());
                        buf[keep..].fill(0);
                        start += buf.len();
                    }
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "short read (injected): {} of {len} bytes at offset {offset}",
                            len / 2
                        ),
                    ));
                }
                FaultKind::BitFlip { at, bit } => {
                    if let Some(pos) = at.checked_sub(offset) {
                        flip(bufs, pos, bit);
                    }
                }
                FaultKind::Eio | FaultKind::Delay(_) => {}
            }
        }
        Ok(())
    }

    fn queue_depth(&self) -> usize {
        self.inner.queue_depth()
    }

    fn name(&self) -> String {
        format!("{} (with injected faults)", self.inner.name())
    }

    fn schedule(&self, arrival: Instant, len: usize) -> Option<Instant> {
        self.inner.schedule(arrival, len)
    }

    fn models_time(&self) -> bool {
        self.inner.models_time()
    }
}

/// Inverts bit `bit` of byte `pos` of the buffers taken end to end.
fn flip(bufs: &mut [AlignedBuf], mut pos: u64, bit: u8) {
    for buf in bufs {
        if pos < buf.len() as u64 {
            buf[pos as usize] ^= 1 << (bit % 8);
            return;
        }
        pos -= buf.len() as u64;
    }
}
