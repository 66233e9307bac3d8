//! The operating system as the runtime sees it: process memory, the default thread count (the fast
//! cores), memory cgroups, the elastic budget that follows memory pressure, memory sizes as users
//! write them, and closed output pipes.

#[cfg(target_os = "linux")]
pub mod cgroup;
pub mod closed_pipe;
pub mod cores;
pub mod elastic;
pub mod memory;
pub mod memory_size;
