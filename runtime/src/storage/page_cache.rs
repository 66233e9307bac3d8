//! Seeing and emptying what the OS page cache holds of a file, to check that direct reads leave
//! nothing behind (a cached page would be memory outside the budget serving reads for free) and to
//! start measurements cold.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

/// How many of the file's pages are in the page cache, and how many pages it has.
pub fn resident_pages(path: &Path) -> io::Result<(usize, usize)> {
    let file = File::open(path)?;
    let len = file.metadata()?.len() as usize;
    if len == 0 {
        return Ok((0, 0));
    }
    // SAFETY: the map is only passed to mincore, never read, so concurrent changes to the file
    // cannot be observed through it (mapping does not fault pages in).
    let map = unsafe { memmap2::Mmap::map(&file)? };
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let mut flags = vec![0u8; len.div_ceil(page)];
    // SAFETY: the address is the page-aligned start of a live mapping of `len` bytes and `flags`
    // has one byte per page of it.
    let rc = unsafe { libc::mincore(map.as_ptr() as *mut libc::c_void, len, flags.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((flags.iter().filter(|&&f| f & 1 != 0).count(), flags.len()))
}

/// Writes back the file's dirty pages and asks the kernel to drop its cached pages.
pub fn evict(path: &Path) -> io::Result<()> {
    let file = File::open(path)?;
    file.sync_data()?;
    drop_cached(&file)
}

/// Asks the kernel to drop the file's clean cached pages: what buffered reads of it (its index
/// sections, resident tensors) left behind once they are decoded.
pub fn forget(path: &Path) -> io::Result<()> {
    drop_cached(&File::open(path)?)
}

fn drop_cached(file: &File) -> io::Result<()> {
    // SAFETY: a valid descriptor; offset 0 with length 0 covers the whole file.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}
