//! `mmap`, the llama.cpp-like baseline: the file is memory-mapped and clusters are computed
//! straight from the mapping; the OS pages them in on first touch and evicts under pressure (the
//! budget is enforced around the process by a cgroup, which charges it the page cache). Its I/O
//! is what the kernel reports for the process.

use std::fs::File;
use std::path::Path;

use anyhow::{Context, Result};
use memmap2::Mmap;

use super::plan::ClusterRef;

pub(super) struct Mapping {
    map: Mmap,
}

impl Mapping {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: the file is opened read-only and the model files are not modified while a
        // model runs (a truncation under us would fault, as it would for llama.cpp).
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot memory-map {}", path.display()))?;
        Ok(Self { map })
    }

    /// A cluster's bytes (its extent, clipped to the file).
    pub fn cluster(&self, cl: &ClusterRef) -> &[u8] {
        let start = (cl.offset as usize).min(self.map.len());
        let end = (cl.offset + cl.size).min(self.map.len() as u64) as usize;
        &self.map[start..end]
    }

    /// Whether every page of a cluster is in the page cache now (a hit: no fault will read).
    pub fn is_resident(&self, cl: &ClusterRef) -> bool {
        let bytes = self.cluster(cl);
        if bytes.is_empty() {
            return true;
        }
        let page = 4096;
        let mut vec = vec![0u8; bytes.len().div_ceil(page)];
        // SAFETY: the range lies inside the live mapping and starts on a page boundary (cluster
        // extents are 4 KiB-aligned, the mapping page-aligned); `vec` has one byte per page.
        let rc = unsafe {
            libc::mincore(
                bytes.as_ptr() as *mut libc::c_void,
                bytes.len(),
                vec.as_mut_ptr(),
            )
        };
        rc == 0 && vec.iter().all(|&v| v & 1 == 1)
    }
}

/// Bytes the process caused to be read from storage and its major page faults (the reads a
/// mapping makes), from the kernel.
pub(super) fn process_io() -> (u64, u64) {
    let bytes = std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("read_bytes:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0);
    // SAFETY: getrusage fills the zeroed struct it is given.
    let faults = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u.ru_majflt as u64
    };
    (bytes, faults)
}
