//! How many compute threads to run by default: the fastest cores this process may run on. A phone's
//! big.LITTLE CPU has a few fast cores and several slow ones; a thread on a slow core finishes its
//! share of a layer last, and every thread waits for it, so the default leaves the slow cores out.
//! Cores are told apart by the kernel's `cpu_capacity` (ARM: the core's compute capacity, 1024 for
//! the biggest, which accounts for the microarchitecture as well as the clock) or else by
//! `cpufreq/cpuinfo_max_freq`; a core counts when it reaches [`FAST_SHARE`] of the fastest one.
//! Where the cores report nothing (most virtual machines), every available core counts.

use std::path::Path;

/// A core is fast when its capacity (or maximum frequency) is at least this share of the fastest
/// core's. Phone SoCs' middle cores reach 0.8–0.9 of the prime core's clock and their little cores
/// 0.55–0.77 (Snapdragon 8 Gen 3: 3.30 / 3.15 / 2.96 / 2.27 GHz; Tensor G3: 2.91 / 2.37 / 1.70).
pub const FAST_SHARE: f64 = 0.8;

/// The default thread count: the number of fast cores (see [`FAST_SHARE`]) among those this
/// process may run on; every available core where the cores do not say how fast they are.
pub fn default_threads() -> usize {
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    fast_cores(Path::new("/sys/devices/system/cpu"), &allowed_cpus())
        .unwrap_or(available)
        .clamp(1, available)
}

/// Counts the fast CPUs of `allowed`, judged by `cpuN/cpu_capacity` under `sysfs` where every one
/// has it, else by `cpuN/cpufreq/cpuinfo_max_freq`. `None` when neither is there for all of them.
pub fn fast_cores(sysfs: &Path, allowed: &[usize]) -> Option<usize> {
    let read = |file: &str| -> Option<Vec<u64>> {
        allowed
            .iter()
            .map(|cpu| {
                let text = std::fs::read_to_string(sysfs.join(format!("cpu{cpu}/{file}"))).ok()?;
                text.trim().parse().ok()
            })
            .collect()
    };
    let speeds = read("cpu_capacity").or_else(|| read("cpufreq/cpuinfo_max_freq"))?;
    let top = *speeds.iter().max()? as f64;
    Some(
        speeds
            .iter()
            .filter(|&&s| s as f64 >= FAST_SHARE * top)
            .count(),
    )
}

/// The CPUs this process may run on (its affinity mask); CPUs 0..n where it cannot be read.
fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `set` is a plain bit set that sched_getaffinity fills for this process (pid 0).
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
                    .filter(|&c| libc::CPU_ISSET(c, &set))
                    .collect();
                if !cpus.is_empty() {
                    return cpus;
                }
            }
        }
    }
    (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/sys/devices/system/cpu` with one value per CPU in `file` (`None`: no file).
    fn sysfs(name: &str, file: &str, values: &[Option<u64>]) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("leanstream-cores-{}-{name}", std::process::id()));
        for (cpu, value) in values.iter().enumerate() {
            let path = dir.join(format!("cpu{cpu}/{file}"));
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            if let Some(v) = value {
                std::fs::write(path, format!("{v}\n")).unwrap();
            }
        }
        dir
    }

    #[test]
    fn big_little_leaves_the_little_cores_out() {
        // Snapdragon 8 Gen 3: 2 efficiency, 2 + 3 performance and 1 prime core.
        let ghz = [
            2_265_600, 2_265_600, 2_960_000, 2_960_000, 3_150_000, 3_150_000, 3_150_000,
        ];
        let mut freqs: Vec<Option<u64>> = ghz.iter().map(|&f| Some(f)).collect();
        freqs.push(Some(3_302_400));
        let dir = sysfs("sd8g3", "cpufreq/cpuinfo_max_freq", &freqs);
        assert_eq!(fast_cores(&dir, &[0, 1, 2, 3, 4, 5, 6, 7]), Some(6));
        // An affinity mask of the little cores alone: they are the fastest the process has.
        assert_eq!(fast_cores(&dir, &[0, 1]), Some(2));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn capacity_wins_over_frequency() {
        // Equal clocks, unequal cores: the kernel's capacity tells them apart.
        let dir = sysfs(
            "capacity",
            "cpufreq/cpuinfo_max_freq",
            &[Some(2_000_000); 4],
        );
        for (cpu, cap) in [1024, 1024, 480, 480].iter().enumerate() {
            std::fs::write(dir.join(format!("cpu{cpu}/cpu_capacity")), cap.to_string()).unwrap();
        }
        assert_eq!(fast_cores(&dir, &[0, 1, 2, 3]), Some(2));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn equal_or_unknown_speeds_count_every_core() {
        let dir = sysfs("equal", "cpufreq/cpuinfo_max_freq", &[Some(3_000_000); 4]);
        assert_eq!(fast_cores(&dir, &[0, 1, 2, 3]), Some(4));
        std::fs::remove_dir_all(dir).unwrap();
        let dir = sysfs(
            "partial",
            "cpufreq/cpuinfo_max_freq",
            &[Some(3_000_000), None],
        );
        assert_eq!(fast_cores(&dir, &[0, 1]), None);
        std::fs::remove_dir_all(dir).unwrap();
        let available = std::thread::available_parallelism().unwrap().get();
        assert!((1..=available).contains(&default_threads()));
    }
}
