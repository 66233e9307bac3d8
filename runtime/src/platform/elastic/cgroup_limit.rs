//! The memory limit the kernel holds this process to: its memory cgroup's limit, the tightest
//! along the path to the root (a parent's limit binds its children). Version 1 (`memory`
//! hierarchy: `memory.limit_in_bytes`) and version 2 (the unified hierarchy: `memory.max`, the
//! hard limit, and `memory.high`, above which the kernel throttles and reclaims) are both read;
//! with both mounted, the tighter wins. Usage (`memory.usage_in_bytes` / `memory.current`) counts
//! every process in the group, so a budget that follows the limit leaves room for the others.

use std::io;
use std::path::{Path, PathBuf};

/// The limit and the group's current charge, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupMemory {
    /// The tightest limit on the way to the root; `None` when no level sets one.
    pub limit: Option<u64>,
    /// What the kernel charges to the group now (every process in it, and its page cache).
    pub usage: u64,
}

/// Where this process's memory groups are, from `/proc/self/cgroup` and `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Groups {
    v1: Option<PathBuf>,
    /// The v2 group, where the memory controller's files are.
    v2: Option<PathBuf>,
    /// The v2 group, with or without them (a child group may still get the controller).
    v2_dir: Option<PathBuf>,
}

impl Groups {
    /// This process's groups. Fails when neither a v1 memory hierarchy nor a v2 hierarchy is
    /// mounted (no cgroups: `--memory auto` has nothing to follow, no group can be made).
    pub fn of_this_process() -> io::Result<Self> {
        let cgroup = std::fs::read_to_string("/proc/self/cgroup")?;
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
        Self::parse(&cgroup, &mountinfo)
    }

    /// From the text of `/proc/self/cgroup` and `/proc/self/mountinfo`.
    pub fn parse(cgroup: &str, mountinfo: &str) -> io::Result<Self> {
        let mut v1 = None;
        let mut v2 = None;
        for line in cgroup.lines() {
            // `id:controllers:path`; v2 is `0::path`.
            let mut fields = line.splitn(3, ':');
            let (Some(id), Some(controllers), Some(path)) =
                (fields.next(), fields.next(), fields.next())
            else {
                continue;
            };
            let relative = path.trim_start_matches('/');
            if id == "0" && controllers.is_empty() {
                v2 = mount_of(mountinfo, |fstype, _| fstype == "cgroup2").map(|m| m.join(relative));
            } else if controllers.split(',').any(|c| c == "memory") {
                v1 = mount_of(mountinfo, |fstype, options| {
                    fstype == "cgroup" && options.split(',').any(|o| o == "memory")
                })
                .map(|m| m.join(relative));
            }
        }
        // A v2 hierarchy without the memory controller has no memory files: it does not count.
        let v2_dir = v2.clone();
        let v2 = v2.filter(|p| ancestors(p).any(|a| a.join("memory.max").exists()));
        let groups = Self { v1, v2, v2_dir };
        if groups.v2_dir.is_none() {
            groups.memory_files()?;
        }
        Ok(groups)
    }

    /// The v1 memory group's directory, where there is one.
    pub fn v1(&self) -> Option<&Path> {
        self.v1.as_deref()
    }

    /// The v2 group's directory and the hierarchy's mount point, where v2 is mounted (whether
    /// or not the memory controller is enabled down to the group).
    pub fn v2(&self) -> Option<&Path> {
        self.v2_dir.as_deref()
    }

    /// Fails when there is no group with memory files to read (no v1 memory hierarchy, and v2
    /// without the memory controller down to this process's group).
    fn memory_files(&self) -> io::Result<()> {
        if self.v1.is_none() && self.v2.is_none() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "this process is in no memory cgroup (neither a v1 memory hierarchy nor a v2 one with memory.max is mounted)",
            ));
        }
        Ok(())
    }

    /// The limit and usage now. A level whose files cannot be read (a container often hides its
    /// parents) is skipped.
    pub fn read(&self) -> io::Result<GroupMemory> {
        self.memory_files()?;
        let mut limit: Option<u64> = None;
        let mut usage = None;
        let mut tighten = |l: Option<u64>| {
            if let Some(l) = l {
                limit = Some(limit.map_or(l, |x| x.min(l)));
            }
        };
        if let Some(v1) = &self.v1 {
            for dir in ancestors(v1) {
                tighten(read_limit(&dir.join("memory.limit_in_bytes")));
            }
            usage = usage.or(read_number(&v1.join("memory.usage_in_bytes")));
        }
        if let Some(v2) = &self.v2 {
            for dir in ancestors(v2) {
                tighten(read_limit(&dir.join("memory.max")));
                tighten(read_limit(&dir.join("memory.high")));
            }
            usage = usage.or(read_number(&v2.join("memory.current")));
        }
        let usage = usage.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("cannot read the memory usage of {self:?}"),
            )
        })?;
        Ok(GroupMemory { limit, usage })
    }
}

/// `dir` and its parents up to the hierarchy's mount point (where the memory files stop).
fn ancestors(dir: &Path) -> impl Iterator<Item = &Path> {
    dir.ancestors()
        .take_while(|d| d.join("memory.limit_in_bytes").exists() || d.join("memory.max").exists())
}

/// A limit file: a number of bytes; `max` (v2) or a value near 2^63 (v1's "unlimited") is none.
fn read_limit(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: u64 = text.trim().parse().ok()?;
    (v < 1 << 62).then_some(v)
}

fn read_number(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The mount point of the first mount in `/proc/self/mountinfo` text whose file system type and
/// super options `want` accepts.
fn mount_of(mountinfo: &str, want: impl Fn(&str, &str) -> bool) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // Fields: id parent dev root mountpoint options [optional…] - fstype source superoptions
        let (left, right) = line.split_once(" - ")?;
        let mut right = right.split(' ');
        let (fstype, _source, options) = (right.next()?, right.next()?, right.next()?);
        want(fstype, options)
            .then(|| left.split(' ').nth(4).map(PathBuf::from))
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, file: &str, text: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(file), text).unwrap();
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("leanstream-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn v1_takes_the_tightest_limit_on_the_way_up() {
        let root = scratch("cgroup-v1");
        let mount = root.join("memory");
        let own = mount.join("app/worker");
        // The root's "unlimited", a parent's 300 MiB, the group's own 500 MiB.
        write(&mount, "memory.limit_in_bytes", "9223372036854771712\n");
        write(&mount.join("app"), "memory.limit_in_bytes", "314572800\n");
        write(&own, "memory.limit_in_bytes", "524288000\n");
        write(&own, "memory.usage_in_bytes", "1048576\n");
        let mountinfo = format!(
            "31 24 0:27 / /sys/fs/cgroup/cpu rw,relatime shared:9 - cgroup cgroup rw,cpu\n\
             35 24 0:31 / {} rw,relatime shared:13 - cgroup cgroup rw,memory\n",
            mount.display()
        );
        let groups = Groups::parse("4:memory:/app/worker\n1:cpu:/\n0::/\n", &mountinfo).unwrap();
        assert_eq!(
            groups.read().unwrap(),
            GroupMemory {
                limit: Some(300 << 20),
                usage: 1 << 20
            }
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn v2_reads_max_and_high() {
        let root = scratch("cgroup-v2");
        let own = root.join("user.slice/app");
        write(&root, "memory.max", "max\n"); // never at the real root; a test tree may have it
        write(&root.join("user.slice"), "memory.max", "max\n");
        write(&root.join("user.slice"), "memory.high", "max\n");
        write(&own, "memory.max", "209715200\n");
        write(&own, "memory.high", "157286400\n");
        write(&own, "memory.current", "4096\n");
        let mountinfo = format!(
            "29 23 0:26 / {} rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n",
            root.display()
        );
        let groups = Groups::parse("0::/user.slice/app\n", &mountinfo).unwrap();
        let m = groups.read().unwrap();
        assert_eq!((m.limit, m.usage), (Some(150 << 20), 4096));
        // Unlimited everywhere: no limit.
        write(&own, "memory.max", "max\n");
        write(&own, "memory.high", "max\n");
        assert_eq!(groups.read().unwrap().limit, None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn no_memory_hierarchy_is_an_error_that_says_so() {
        let err = Groups::parse("1:cpu:/\n", "22 1 0:20 / /sys rw - sysfs sysfs rw\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("no memory cgroup"), "{err}");
    }
}
