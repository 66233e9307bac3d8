//! Read buffers done with, kept for the next reads of their size: a fresh [`AlignedBuf`] costs a
//! mapping, a fault per page and an unmapping, which made up a third of the CPU time of a 32 KiB
//! read, and more than the read itself for streamed dense weights.

use std::collections::VecDeque;

use super::AlignedBuf;

/// A pool of spare read buffers holding at most `cap` bytes; the oldest go first.
pub struct SpareBuffers {
    bufs: VecDeque<AlignedBuf>,
    bytes: usize,
    cap: usize,
}

impl SpareBuffers {
    pub fn new(cap_bytes: usize) -> Self {
        Self {
            bufs: VecDeque::new(),
            bytes: 0,
            cap: cap_bytes,
        }
    }

    /// A spare buffer of exactly `len` bytes, or a new one.
    pub fn take(&mut self, len: usize) -> AlignedBuf {
        match self.bufs.iter().position(|b| b.len() == len) {
            Some(i) => {
                self.bytes -= len;
                self.bufs.remove(i).expect("found above")
            }
            None => AlignedBuf::new(len),
        }
    }

    /// Keeps `buf` for a later read, dropping the oldest spares if the pool would exceed its cap
    /// (and `buf` itself if it alone does).
    pub fn give(&mut self, buf: AlignedBuf) {
        if buf.len() > self.cap {
            return;
        }
        while self.bytes + buf.len() > self.cap {
            let old = self.bufs.pop_front().expect("bytes > 0 means buffers");
            self.bytes -= old.len();
        }
        self.bytes += buf.len();
        self.bufs.push_back(buf);
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_what_fits_and_reuses_by_size() {
        let page = AlignedBuf::ALIGN;
        let mut s = SpareBuffers::new(3 * page);
        s.give(AlignedBuf::new(page));
        s.give(AlignedBuf::new(2 * page));
        assert_eq!(s.bytes(), 3 * page);
        // A third buffer pushes the oldest out.
        s.give(AlignedBuf::new(page));
        assert_eq!(s.bytes(), 3 * page);
        assert_eq!(s.take(2 * page).len(), 2 * page);
        assert_eq!(s.bytes(), page);
        // No spare of that size: a new buffer, the pool untouched.
        assert_eq!(s.take(4 * page).len(), 4 * page);
        assert_eq!(s.bytes(), page);
        // Larger than the whole pool: not kept.
        s.give(AlignedBuf::new(4 * page));
        assert_eq!(s.bytes(), page);
    }
}
