//! Page-aligned heap buffers: `O_DIRECT` transfers need the memory, the file offset and the
//! length aligned to the device's logical block, and 4096 covers every device we target.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// A zero-initialised heap buffer whose address and length are multiples of [`AlignedBuf::ALIGN`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively, like a `Box<[u8]>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Alignment of the address and granularity of the length, in bytes.
    pub const ALIGN: usize = 4096;

    /// Allocates `len` zeroed bytes.
    ///
    /// # Panics
    /// If `len` is zero or not a multiple of [`Self::ALIGN`] (a caller bug, not a data error), or
    /// if the allocation fails.
    pub fn new(len: usize) -> Self {
        assert!(
            len > 0 && len.is_multiple_of(Self::ALIGN),
            "AlignedBuf length {len} is not a positive multiple of {}",
            Self::ALIGN
        );
        MAPPED.fetch_add(1, Ordering::Relaxed);
        Self {
            ptr: alloc_pages(len),
            len,
        }
    }

    /// Buffers made so far by the whole process: each is a mapping and a fault per page, which
    /// the token loop avoids by reusing read buffers (the decode-allocation test watches this).
    pub fn made() -> u64 {
        MAPPED.load(Ordering::Relaxed)
    }
}

static MAPPED: AtomicU64 = AtomicU64::new(0);

/// Read buffers come straight from the kernel (anonymous `mmap`) and go straight back on drop:
/// page-aligned by construction, and — unlike `malloc`'s aligned allocations, which I/O threads
/// churning through thousands of them per token fragment into a growing heap — never held after
/// use, so the memory budget sees only the buffers actually in flight.
#[cfg(unix)]
fn alloc_pages(len: usize) -> NonNull<u8> {
    // SAFETY: an anonymous private mapping; the arguments are valid for any positive `len`.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        alloc::handle_alloc_error(layout(len));
    }
    NonNull::new(p.cast()).expect("mmap never returns null on success")
}

#[cfg(unix)]
fn free_pages(ptr: NonNull<u8>, len: usize) {
    // SAFETY: `ptr`/`len` describe a mapping made by `alloc_pages` and not yet unmapped.
    unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
}

#[cfg(not(unix))]
fn alloc_pages(len: usize) -> NonNull<u8> {
    // SAFETY: the layout has a non-zero size.
    let raw = unsafe { alloc::alloc_zeroed(layout(len)) };
    NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout(len)))
}

#[cfg(not(unix))]
fn free_pages(ptr: NonNull<u8>, len: usize) {
    // SAFETY: allocated in `alloc_pages` with exactly this layout.
    unsafe { alloc::dealloc(ptr.as_ptr(), layout(len)) }
}

fn layout(len: usize) -> Layout {
    Layout::from_size_align(len, AlignedBuf::ALIGN).expect("buffer length overflows a Layout")
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        free_pages(self.ptr, self.len);
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_writable() {
        let mut b = AlignedBuf::new(3 * AlignedBuf::ALIGN);
        assert_eq!(b.as_ptr() as usize % AlignedBuf::ALIGN, 0);
        assert_eq!(b.len(), 3 * 4096);
        assert!(b.iter().all(|&x| x == 0));
        b[4095] = 7;
        assert_eq!(b[4095], 7);
    }

    #[test]
    #[should_panic(expected = "not a positive multiple")]
    fn rejects_unaligned_length() {
        let _ = AlignedBuf::new(100);
    }
}
