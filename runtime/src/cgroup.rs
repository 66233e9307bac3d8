//! A cgroup v1 memory group to run a process under a hard memory limit: the kernel charges the
//! process's anonymous memory *and the page cache it fills* to the group and reclaims or kills at
//! the limit, the way a phone's memory pressure would. Tests use it to hold the runtime to its
//! budget from outside; benchmarks use it to run an `mmap` baseline in the same budget.
//!
//! The group is a child of the calling process's own memory group (from `/proc/self/cgroup`, under
//! the v1 `memory` mount found in `/proc/self/mountinfo`), so no privileges beyond write access
//! to that group are needed. It is removed on drop.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU32, Ordering};

/// A child memory group with a limit; removed (after its processes have exited) on drop.
#[derive(Debug)]
pub struct MemoryGroup {
    path: PathBuf,
}

impl MemoryGroup {
    /// Creates a child group of this process's memory group, limited to `limit` bytes (memory and,
    /// where the kernel accounts it, memory plus swap, so the limit cannot be dodged by swapping).
    /// Fails with a message saying what is missing when there is no writable v1 memory controller.
    pub fn create(limit: u64) -> io::Result<Self> {
        let parent = own_memory_group()?;
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "leanstream-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let path = parent.join(name);
        std::fs::create_dir(&path).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot create the memory cgroup {}: {e}", path.display()),
            )
        })?;
        let group = Self { path };
        group.write("memory.limit_in_bytes", limit)?;
        if group.path.join("memory.memsw.limit_in_bytes").exists() {
            group.write("memory.memsw.limit_in_bytes", limit)?;
        }
        Ok(group)
    }

    /// Changes the limit, as an OS taking memory back would. The kernel refuses (EBUSY) a limit
    /// below what it cannot reclaim, so the caller lowers it in steps the process can follow.
    pub fn set_limit(&self, limit: u64) -> io::Result<()> {
        // memsw must stay at least the memory limit: lower memory first, raise memsw first.
        let memsw = self.path.join("memory.memsw.limit_in_bytes").exists();
        let lowering = limit < self.read_u64("memory.limit_in_bytes")?;
        if memsw && !lowering {
            self.write("memory.memsw.limit_in_bytes", limit)?;
        }
        self.write("memory.limit_in_bytes", limit)?;
        if memsw && lowering {
            self.write("memory.memsw.limit_in_bytes", limit)?;
        }
        Ok(())
    }

    /// What the kernel charges to the group now.
    pub fn usage_bytes(&self) -> io::Result<u64> {
        self.read_u64("memory.usage_in_bytes")
    }

    /// The group's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves process `pid` into the group; memory it already holds stays charged where it was.
    pub fn add(&self, pid: u32) -> io::Result<()> {
        self.write("cgroup.procs", pid)
    }

    /// Spawns `cmd` inside the group: the child joins it before it executes the program, so
    /// everything the program allocates or reads is charged to the group.
    pub fn spawn(&self, cmd: &mut Command) -> io::Result<Child> {
        let procs = CString::new(self.path.join("cgroup.procs").as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the closure runs in the forked child before exec, where only async-signal-safe
        // calls are allowed: it allocates nothing and calls only open, write and close on a path
        // prepared before the fork. Writing "0" to cgroup.procs moves the writing process.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                let result = if written == 1 {
                    Ok(())
                } else {
                    Err(io::Error::last_os_error())
                };
                libc::close(fd);
                result
            })
        };
        cmd.spawn()
    }

    /// The group's peak memory charge (anonymous memory and page cache) since it was created.
    pub fn peak_bytes(&self) -> io::Result<u64> {
        self.read_u64("memory.max_usage_in_bytes")
    }

    /// How many times the group hit its limit (the kernel then reclaimed, or killed).
    pub fn limit_hits(&self) -> io::Result<u64> {
        self.read_u64("memory.failcnt")
    }

    /// Processes the kernel's OOM killer killed in the group (0 where the kernel does not say).
    pub fn oom_kills(&self) -> io::Result<u64> {
        let text = self.read("memory.oom_control")?;
        Ok(text
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0))
    }

    fn write(&self, file: &str, value: impl ToString) -> io::Result<()> {
        let path = self.path.join(file);
        std::fs::write(&path, value.to_string())
            .map_err(|e| io::Error::new(e.kind(), format!("cannot write {}: {e}", path.display())))
    }

    fn read(&self, file: &str) -> io::Result<String> {
        let path = self.path.join(file);
        std::fs::read_to_string(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot read {}: {e}", path.display())))
    }

    fn read_u64(&self, file: &str) -> io::Result<u64> {
        let text = self.read(file)?;
        text.trim().parse().map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}/{file} holds {text:?}, not a number",
                    self.path.display()
                ),
            )
        })
    }
}

impl Drop for MemoryGroup {
    fn drop(&mut self) {
        // A group can only be removed once its processes have exited; its page cache is handed to
        // the parent.
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// The directory of this process's own v1 memory group (found as `--memory auto` finds it).
fn own_memory_group() -> io::Result<PathBuf> {
    crate::elastic::Groups::of_this_process()?
        .v1()
        .map(Path::to_path_buf)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::Unsupported,
                "no cgroup v1 memory controller: this process's memory cgroup is v2",
            )
        })
}
