//! A memory cgroup to run a process under a hard memory limit: the kernel charges the process's
//! anonymous memory *and the page cache it fills* to the group and reclaims or kills at the limit,
//! the way a phone's memory pressure would. Tests use it to hold the runtime to its budget from
//! outside; benchmarks and the demo use it to run an `mmap` baseline in the same budget.
//!
//! The group is a child of the calling process's own group (from `/proc/self/cgroup`, under the
//! mount found in `/proc/self/mountinfo`), so no privileges beyond write access to that group are
//! needed. Version 1 (the `memory` hierarchy) is used where it is mounted; otherwise version 2,
//! where the child needs the memory controller delegated to it: enabled in the parent's
//! `cgroup.subtree_control`, which the kernel allows only in the root or in a group holding no
//! processes itself (the "no internal processes" rule) — [`v2_parent`] says which case applies.
//! It is removed on drop.

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
    version: Version,
}

/// Which cgroup interface a group's files follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    V1,
    V2,
}

impl Version {
    fn limit_file(self) -> &'static str {
        match self {
            Version::V1 => "memory.limit_in_bytes",
            Version::V2 => "memory.max",
        }
    }
}

impl MemoryGroup {
    /// Creates a child group of this process's memory group, limited to `limit` bytes (memory and,
    /// where the kernel accounts it, memory plus swap — v2: no swap — so the limit cannot be
    /// dodged by swapping). Fails with a message saying what is missing when no memory group can
    /// be made (no v1 memory controller, and no v2 group that can delegate one).
    pub fn create(limit: u64) -> io::Result<Self> {
        let groups = crate::platform::elastic::Groups::of_this_process()?;
        let (parent, version) = match (groups.v1(), groups.v2()) {
            (Some(v1), _) => (v1.to_path_buf(), Version::V1),
            (None, Some(v2)) => (v2_parent(v2)?, Version::V2),
            (None, None) => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "no memory cgroup hierarchy is mounted",
                ))
            }
        };
        Self::create_in(&parent, version, limit)
    }

    fn create_in(parent: &Path, version: Version, limit: u64) -> io::Result<Self> {
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
        let group = Self { path, version };
        group.write(version.limit_file(), limit)?;
        match version {
            Version::V1 if group.path.join("memory.memsw.limit_in_bytes").exists() => {
                group.write("memory.memsw.limit_in_bytes", limit)?
            }
            Version::V2 if group.path.join("memory.swap.max").exists() => {
                group.write("memory.swap.max", 0)?
            }
            _ => {}
        }
        Ok(group)
    }

    /// Changes the limit, as an OS taking memory back would. The kernel refuses (v1: EBUSY) a
    /// limit below what it cannot reclaim, or (v2) reclaims and kills to meet it, so the caller
    /// lowers it in steps the process can follow.
    pub fn set_limit(&self, limit: u64) -> io::Result<()> {
        if self.version == Version::V2 {
            return self.write("memory.max", limit);
        }
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
        self.read_u64(match self.version {
            Version::V1 => "memory.usage_in_bytes",
            Version::V2 => "memory.current",
        })
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

    /// The group's peak memory charge (anonymous memory and page cache) since it was created
    /// (v2: `memory.peak`, from Linux 5.19).
    pub fn peak_bytes(&self) -> io::Result<u64> {
        self.read_u64(match self.version {
            Version::V1 => "memory.max_usage_in_bytes",
            Version::V2 => "memory.peak",
        })
    }

    /// How many times the group hit its limit (the kernel then reclaimed, or killed).
    pub fn limit_hits(&self) -> io::Result<u64> {
        match self.version {
            Version::V1 => self.read_u64("memory.failcnt"),
            Version::V2 => self.event("max"),
        }
    }

    /// Processes the kernel's OOM killer killed in the group (0 where the kernel does not say).
    pub fn oom_kills(&self) -> io::Result<u64> {
        match self.version {
            Version::V1 => Ok(counter(&self.read("memory.oom_control")?, "oom_kill")),
            Version::V2 => self.event("oom_kill"),
        }
    }

    /// A v2 `memory.events` counter.
    fn event(&self, name: &str) -> io::Result<u64> {
        Ok(counter(&self.read("memory.events")?, name))
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

/// `name value` lines (`memory.events`, `memory.oom_control`): `name`'s value, 0 if absent.
fn counter(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// The v2 group under which a child group with the memory controller can be made: `own` (this
/// process's group) once the controller is enabled in its `cgroup.subtree_control`. That needs
/// the controller available in `own` (`cgroup.controllers`: delegated by its parent) and, unless
/// `own` is the hierarchy's root, no process in `own` itself — the kernel refuses (EBUSY) to
/// enable a controller for the children of a group that holds processes. Each refusal says why
/// and what to do.
pub fn v2_parent(own: &Path) -> io::Result<PathBuf> {
    let read = |file: &str| {
        let path = own.join(file);
        std::fs::read_to_string(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot read {}: {e}", path.display())))
    };
    let has_memory = |text: &str| text.split_whitespace().any(|c| c == "memory");
    if has_memory(&read("cgroup.subtree_control")?) {
        return Ok(own.to_path_buf());
    }
    if !has_memory(&read("cgroup.controllers")?) {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "the memory controller is not delegated to the cgroup v2 group {} (its cgroup.controllers lacks memory): enable it in the parent's cgroup.subtree_control, or run under systemd-run --user --scope -p Delegate=yes",
                own.display()
            ),
        ));
    }
    // The root holds no cgroup.type file; every other group does.
    let root = !own.join("cgroup.type").exists();
    if !root && !read("cgroup.procs")?.trim().is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "the cgroup v2 group {} holds processes, so the kernel will not enable the memory controller for a child of it (no internal processes): run from a group of its own, e.g. systemd-run --user --scope -p Delegate=yes",
                own.display()
            ),
        ));
    }
    let control = own.join("cgroup.subtree_control");
    std::fs::write(&control, "+memory").map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "cannot enable the memory controller in {}: {e}",
                control.display()
            ),
        )
    })?;
    Ok(own.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake v2 group: its interface files as plain files.
    fn fake_group(name: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("leanstream-v2-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (file, text) in files {
            std::fs::write(dir.join(file), text).unwrap();
        }
        dir
    }

    #[test]
    fn a_v2_group_with_the_controller_delegated_gets_a_limited_child() {
        // A leaf group of its own (no processes), the controller available but not yet enabled.
        let own = fake_group(
            "leaf",
            &[
                ("cgroup.controllers", "cpu io memory pids\n"),
                ("cgroup.subtree_control", ""),
                ("cgroup.type", "domain\n"),
                ("cgroup.procs", ""),
            ],
        );
        assert_eq!(v2_parent(&own).unwrap(), own);
        assert_eq!(
            std::fs::read_to_string(own.join("cgroup.subtree_control")).unwrap(),
            "+memory"
        );
        let group = MemoryGroup::create_in(&own, Version::V2, 64 << 20).unwrap();
        assert!(group.path().starts_with(&own));
        assert_eq!(
            std::fs::read_to_string(group.path().join("memory.max")).unwrap(),
            (64u64 << 20).to_string()
        );
        group.set_limit(32 << 20).unwrap();
        assert_eq!(group.read_u64("memory.max").unwrap(), 32 << 20);
        std::fs::write(
            group.path().join("memory.events"),
            "low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\n",
        )
        .unwrap();
        assert_eq!(
            (group.limit_hits().unwrap(), group.oom_kills().unwrap()),
            (7, 1)
        );
        std::fs::remove_dir_all(&own).unwrap();
    }

    #[test]
    fn the_root_delegates_even_with_processes_and_an_enabled_parent_is_used_as_is() {
        // The root: no cgroup.type, processes in it.
        let root = fake_group(
            "root",
            &[
                ("cgroup.controllers", "memory\n"),
                ("cgroup.subtree_control", ""),
                ("cgroup.procs", "1\n42\n"),
            ],
        );
        assert_eq!(v2_parent(&root).unwrap(), root);
        // Already enabled: nothing to write, processes or not.
        let enabled = fake_group(
            "enabled",
            &[
                ("cgroup.subtree_control", "memory pids\n"),
                ("cgroup.type", "domain\n"),
                ("cgroup.procs", "42\n"),
            ],
        );
        assert_eq!(v2_parent(&enabled).unwrap(), enabled);
        std::fs::remove_dir_all(&root).unwrap();
        std::fs::remove_dir_all(&enabled).unwrap();
    }

    #[test]
    fn a_v2_group_that_cannot_delegate_says_why() {
        let undelegated = fake_group(
            "undelegated",
            &[
                ("cgroup.controllers", "cpu pids\n"),
                ("cgroup.subtree_control", ""),
                ("cgroup.type", "domain\n"),
                ("cgroup.procs", ""),
            ],
        );
        let err = v2_parent(&undelegated).unwrap_err().to_string();
        assert!(
            err.contains("not delegated") && err.contains("Delegate=yes"),
            "{err}"
        );
        let busy = fake_group(
            "busy",
            &[
                ("cgroup.controllers", "memory\n"),
                ("cgroup.subtree_control", ""),
                ("cgroup.type", "domain\n"),
                ("cgroup.procs", "42\n"),
            ],
        );
        let err = v2_parent(&busy).unwrap_err().to_string();
        assert!(err.contains("holds processes"), "{err}");
        // Nothing was enabled.
        assert_eq!(
            std::fs::read_to_string(busy.join("cgroup.subtree_control")).unwrap(),
            ""
        );
        std::fs::remove_dir_all(&undelegated).unwrap();
        std::fs::remove_dir_all(&busy).unwrap();
    }
}
