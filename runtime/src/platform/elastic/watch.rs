//! Watches where the budget comes from and publishes each new value for the token loop to take
//! between tokens. A background thread polls the source — a file holding a size
//! (`--memory-file`: re-read when its modification time or length changes, and at once on
//! SIGUSR1), or the memory cgroup and the memory-pressure signals (`--memory auto`) — so the
//! token loop only loads an atomic: a budget that does not change costs nothing per token.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context, Result};

use super::cgroup_limit::{GroupMemory, Groups};
use super::pressure::PressureSignals;
use crate::platform::memory_size::{format_size, parse_budget};

/// Where the budget comes from.
#[derive(Debug, Clone)]
pub enum BudgetSource {
    /// A file holding one size (`300MiB`, `1.5GiB`, bytes), rewritten to change the budget.
    File(PathBuf),
    /// The memory cgroup's limit, less what the group's other processes use and a margin.
    Cgroup(Groups),
}

/// How often the thread looks at the source. A change takes at most this long to be seen (a
/// file's at once on SIGUSR1), plus the rest of the token being computed.
const POLL: Duration = Duration::from_millis(20);
/// The file's metadata is looked at every this many polls; the cgroup's every poll.
const FILE_EVERY: u32 = 5;

/// The budget `--memory auto` sets under `m` when this process holds `own_rss`: the limit less
/// what the group's other processes (and page cache) hold and less a margin for what the kernel
/// charges without the process asking (4 MiB and 1/32 of the limit). `None` without a limit.
pub fn auto_budget(m: GroupMemory, own_rss: u64) -> Option<u64> {
    let limit = m.limit?;
    let others = m.usage.saturating_sub(own_rss);
    let margin = (4 << 20) + limit / 32;
    Some(limit.saturating_sub(others).saturating_sub(margin))
}

/// The budget a source sets now.
pub fn read_budget(source: &BudgetSource) -> Result<u64> {
    match source {
        BudgetSource::File(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the budget file {}", path.display()))?;
            parse_budget(text.trim()).map_err(|e| {
                anyhow::anyhow!(
                    "{} holds {:?}, not a budget ({e}): write one size such as 300MiB",
                    path.display(),
                    text.trim()
                )
            })
        }
        BudgetSource::Cgroup(groups) => {
            let m = groups.read().context("cannot read the memory cgroup")?;
            let own = crate::platform::memory::current_rss_bytes().unwrap_or(0);
            match (m.limit, auto_budget(m, own)) {
                (Some(_), Some(b)) if b > 0 => Ok(b),
                (Some(limit), _) => bail!(
                    "the memory cgroup's limit ({}) leaves nothing for the model once its other processes ({}) and a margin are counted",
                    format_size(limit),
                    format_size(m.usage.saturating_sub(own))
                ),
                (None, _) => bail!(
                    "--memory auto: this process's memory cgroup sets no limit; give --memory a size"
                ),
            }
        }
    }
}

/// Set by the SIGUSR1 handler: re-read the budget file now.
static USR1: AtomicBool = AtomicBool::new(false);

extern "C" fn on_usr1(_: libc::c_int) {
    USR1.store(true, Ordering::SeqCst);
}

/// A running watch; stopped on drop.
pub struct BudgetWatch {
    latest: Arc<AtomicU64>,
    taken: u64,
    /// The source lowers the budget under memory pressure as far as it will go: a budget below
    /// the run's floor means the floor ([`BudgetWatch::to_floor`]).
    to_floor: bool,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl BudgetWatch {
    /// Reads the source once (an unreadable or invalid source is an error here, at start-up),
    /// then watches it. Returns the watch and the budget to start with.
    pub fn start(source: BudgetSource) -> Result<(Self, u64)> {
        // Stamped before the first read: a change after it is seen by the first poll.
        let stamp = file_stamp(&source);
        let first = read_budget(&source)?;
        let to_floor = matches!(source, BudgetSource::Cgroup(_));
        if let BudgetSource::File(_) = source {
            // SAFETY: the handler only stores to an atomic, which is async-signal-safe; it
            // replaces SIGUSR1's default action (terminate), which nothing else here relies on.
            unsafe {
                libc::signal(libc::SIGUSR1, on_usr1 as *const () as libc::sighandler_t);
            }
        }
        let latest = Arc::new(AtomicU64::new(first));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name("budget-watch".into())
            .spawn({
                let (latest, stop) = (Arc::clone(&latest), Arc::clone(&stop));
                move || watch(source, stamp, &latest, &stop)
            })
            .context("cannot start the budget watch thread")?;
        let watch = Self {
            latest,
            taken: first,
            to_floor,
            stop,
            thread: Some(thread),
        };
        Ok((watch, first))
    }

    /// A watch that a program sets itself (the C API's `ls_set_memory_budget`, from any thread),
    /// starting at `budget`: no thread, no source.
    pub fn manual(budget: u64) -> (Self, BudgetHandle) {
        let latest = Arc::new(AtomicU64::new(budget));
        let watch = Self {
            latest: Arc::clone(&latest),
            taken: budget,
            to_floor: false,
            stop: Arc::new(AtomicBool::new(false)),
            thread: None,
        };
        (watch, BudgetHandle(latest))
    }

    /// Whether a budget below the run's floor means "the floor" (memory pressure asking for all
    /// that can be given) rather than a value to refuse.
    pub fn to_floor(&self) -> bool {
        self.to_floor
    }

    /// The new budget, once per change since the last call.
    pub fn changed(&mut self) -> Option<u64> {
        let now = self.latest.load(Ordering::Acquire);
        (now != self.taken).then(|| {
            self.taken = now;
            now
        })
    }
}

/// Sets the budget a [`BudgetWatch::manual`] publishes; cheap to clone and safe from any thread.
#[derive(Clone)]
pub struct BudgetHandle(Arc<AtomicU64>);

impl BudgetHandle {
    pub fn set(&self, budget: u64) {
        self.0.store(budget, Ordering::Release);
    }
}

impl Drop for BudgetWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A file's modification time and length (`None` for a cgroup, or a file that cannot be seen).
type Stamp = Option<(SystemTime, u64)>;

fn file_stamp(source: &BudgetSource) -> Stamp {
    let BudgetSource::File(path) = source else {
        return None;
    };
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

fn watch(source: BudgetSource, mut last_stamp: Stamp, latest: &AtomicU64, stop: &AtomicBool) {
    let mut tick = 0u32;
    let mut pressure = match &source {
        BudgetSource::Cgroup(groups) => Some(PressureSignals::open(groups.v1(), groups.v2())),
        BudgetSource::File(_) => None,
    };
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(POLL);
        tick = tick.wrapping_add(1);
        let due = match &source {
            BudgetSource::File(_) => {
                let signalled = USR1.swap(false, Ordering::SeqCst);
                let changed = tick.is_multiple_of(FILE_EVERY) && {
                    let s = file_stamp(&source);
                    std::mem::replace(&mut last_stamp, s) != s
                };
                signalled || changed
            }
            BudgetSource::Cgroup(_) => true,
        };
        if !due {
            continue;
        }
        match read_budget(&source) {
            Ok(b) => {
                let share = pressure.as_mut().map_or(1.0, |p| p.level().share());
                latest.store((b as f64 * share) as u64, Ordering::Release)
            }
            // A file caught half-written, or a bad value: keep the budget and say so once.
            Err(e) => {
                if let BudgetSource::File(_) = source {
                    eprintln!("leanstream: budget unchanged: {e:#}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn auto_leaves_the_others_and_a_margin() {
        let m = |limit, usage| GroupMemory { limit, usage };
        // 320 MiB limit, 100 MiB used of which 60 MiB are ours: 40 MiB are others'.
        assert_eq!(
            auto_budget(m(Some(320 * MIB), 100 * MIB), 60 * MIB),
            Some(320 * MIB - 40 * MIB - 4 * MIB - 10 * MIB)
        );
        assert_eq!(auto_budget(m(None, 100 * MIB), 60 * MIB), None);
        assert_eq!(auto_budget(m(Some(8 * MIB), 100 * MIB), 0), Some(0));
    }

    #[test]
    fn a_rewritten_file_is_seen_and_a_bad_one_is_not_taken() {
        let path = std::env::temp_dir().join(format!("leanstream-budget-{}", std::process::id()));
        std::fs::write(&path, "300MiB\n").unwrap();
        let (mut watch, first) = BudgetWatch::start(BudgetSource::File(path.clone())).unwrap();
        assert_eq!(first, 300 * MIB);
        assert_eq!(watch.changed(), None);
        let seen = |watch: &mut BudgetWatch| {
            (0..100).find_map(|_| {
                std::thread::sleep(POLL);
                watch.changed()
            })
        };
        // A different length, so the change is seen even where mtime is coarse.
        std::fs::write(&path, "1GiB").unwrap();
        assert_eq!(seen(&mut watch), Some(1 << 30));
        std::fs::write(&path, "lots").unwrap();
        std::thread::sleep(POLL * FILE_EVERY * 4);
        assert_eq!(watch.changed(), None);
        // SIGUSR1 re-reads at once, whatever the metadata says.
        std::fs::write(&path, "64MiB").unwrap();
        // SAFETY: raising a signal whose handler (installed by `start`) only sets an atomic.
        unsafe {
            libc::raise(libc::SIGUSR1);
        }
        assert_eq!(seen(&mut watch), Some(64 * MIB));
        drop(watch);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_manual_watch_publishes_what_its_handle_sets() {
        let (mut watch, handle) = BudgetWatch::manual(100 * MIB);
        assert_eq!(watch.changed(), None);
        let other_thread = handle.clone();
        std::thread::spawn(move || other_thread.set(50 * MIB))
            .join()
            .unwrap();
        assert_eq!(watch.changed(), Some(50 * MIB));
        assert_eq!(watch.changed(), None);
        handle.set(50 * MIB);
        assert_eq!(watch.changed(), None);
    }

    #[test]
    fn a_bad_file_is_refused_at_start_with_its_name() {
        let path = std::env::temp_dir().join(format!("leanstream-nobudget-{}", std::process::id()));
        let err = BudgetWatch::start(BudgetSource::File(path.clone()))
            .err()
            .unwrap();
        assert!(format!("{err:#}").contains(&path.display().to_string()));
        std::fs::write(&path, "0").unwrap();
        let err = format!(
            "{:#}",
            BudgetWatch::start(BudgetSource::File(path.clone()))
                .err()
                .unwrap()
        );
        assert!(
            err.contains("not a budget") && err.contains("positive"),
            "{err}"
        );
        std::fs::remove_file(&path).unwrap();
    }
}
