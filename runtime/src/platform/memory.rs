//! Process memory as the OS measures it.

/// Peak resident set size (`VmHWM`) in bytes, or `None` where `/proc` is unavailable.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Current resident set size (`VmRSS`) in bytes.
pub fn current_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The resident set size when first asked (call early, e.g. at the top of `main`): the process
/// before any model is loaded.
pub fn startup_rss_bytes() -> u64 {
    use std::sync::OnceLock;
    static AT_START: OnceLock<u64> = OnceLock::new();
    *AT_START.get_or_init(|| current_rss_bytes().unwrap_or(16 << 20))
}

/// Hands memory the allocator holds but nothing uses back to the OS (glibc keeps freed heap pages
/// resident until the top of the heap is free). Elsewhere a no-op.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only returns free pages of the allocator's arenas to the OS.
    unsafe {
        libc::malloc_trim(0);
    }
}
