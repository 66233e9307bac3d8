//! Memory-pressure signals, for `--memory auto` to give memory back before the limit is reached:
//! - PSI (Linux 4.20+): the share of time tasks stalled on memory over the last 10 s, from the
//!   process's v2 group (`memory.pressure`) or the whole system (`/proc/pressure/memory`);
//! - cgroup v1 `memory.pressure_level`: the kernel's reclaim events (low, medium, critical),
//!   delivered to eventfds registered through `cgroup.event_control`; a level holds for
//!   [`EVENT_HOLD`] after its last event.
//!
//! Both become one [`Pressure`] level; the budget `auto` publishes is the cgroup's budget times
//! the level's share ([`Pressure::share`]), the running model taking no less than its floor. The
//! levels are named after Android's `onTrimMemory` levels for a running app, which they mirror.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How hard the system is pressed for memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Pressure {
    None,
    /// Android's `TRIM_MEMORY_RUNNING_MODERATE`; v1 `low`: the kernel reclaims.
    Moderate,
    /// `TRIM_MEMORY_RUNNING_LOW`; v1 `medium`: reclaim is swapping or thrashing caches.
    Low,
    /// `TRIM_MEMORY_RUNNING_CRITICAL`; v1 `critical`: close to the OOM killer.
    Critical,
}

impl Pressure {
    /// The share of the cgroup's budget kept under this pressure (critical: nothing above the
    /// run's floor).
    pub fn share(self) -> f64 {
        match self {
            Pressure::None => 1.0,
            Pressure::Moderate => 0.875,
            Pressure::Low => 0.75,
            Pressure::Critical => 0.0,
        }
    }
}

/// PSI thresholds (% of the last 10 s): tasks stalled on memory (`some`) for moderate and low,
/// every task stalled (`full`) for critical.
const PSI_MODERATE: f64 = 10.0;
const PSI_LOW: f64 = 25.0;
const PSI_CRITICAL: f64 = 10.0;

/// The level a PSI file's text (`some avg10=… avg60=…` / `full avg10=…`) shows.
pub fn psi_level(text: &str) -> Pressure {
    let avg10 = |kind: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(kind)?.strip_prefix(' '))
            .and_then(|rest| {
                rest.split_whitespace()
                    .find_map(|f| f.strip_prefix("avg10="))
            })
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    if avg10("full") >= PSI_CRITICAL {
        Pressure::Critical
    } else if avg10("some") >= PSI_LOW {
        Pressure::Low
    } else if avg10("some") >= PSI_MODERATE {
        Pressure::Moderate
    } else {
        Pressure::None
    }
}

/// How long a v1 pressure event's level holds after it.
pub const EVENT_HOLD: Duration = Duration::from_secs(2);

/// The v1 `memory.pressure_level` levels, in [`Pressure`] order from `Moderate`.
const V1_LEVELS: [(&str, Pressure); 3] = [
    ("low", Pressure::Moderate),
    ("medium", Pressure::Low),
    ("critical", Pressure::Critical),
];

/// The signals of one process: PSI where the kernel has it, v1 events where a v1 group takes
/// them; either may be missing.
pub struct PressureSignals {
    psi: Option<PathBuf>,
    /// One eventfd per v1 level.
    events: Vec<(OwnedFd, Pressure)>,
    /// The v1 `memory.pressure_level` file the eventfds were registered with (kept open).
    _level_file: Option<File>,
    /// The latest v1 event's level and when it came.
    last_event: Option<(Pressure, Instant)>,
}

impl PressureSignals {
    /// The signals for a process in `v1` (its memory group) and `v2` (its group): the v2 group's
    /// `memory.pressure`, else the system's PSI; events of the v1 group where they can be
    /// registered. Nothing available is not an error: the level then stays `None`.
    pub fn open(v1: Option<&Path>, v2: Option<&Path>) -> Self {
        let psi = v2
            .map(|g| g.join("memory.pressure"))
            .into_iter()
            .chain([PathBuf::from("/proc/pressure/memory")])
            .find(|p| std::fs::read_to_string(p).is_ok());
        let (events, level_file) = match v1.map(register_v1) {
            Some(Ok((events, file))) => (events, Some(file)),
            _ => (Vec::new(), None),
        };
        Self {
            psi,
            events,
            _level_file: level_file,
            last_event: None,
        }
    }

    /// Whether any signal is there to be read.
    pub fn any(&self) -> bool {
        self.psi.is_some() || !self.events.is_empty()
    }

    /// Whether v1 events are registered.
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// The pressure now: the highest of PSI's and of the v1 events of the last [`EVENT_HOLD`].
    pub fn level(&mut self) -> Pressure {
        let psi = self
            .psi
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .map_or(Pressure::None, |t| psi_level(&t));
        self.event_level().max(psi)
    }

    /// The level of the v1 events of the last [`EVENT_HOLD`] (the latest event's).
    pub fn event_level(&mut self) -> Pressure {
        let now = Instant::now();
        let fired = (self.events.iter())
            .filter(|(fd, _)| drain_eventfd(fd) > 0)
            .map(|&(_, level)| level)
            .max();
        if let Some(level) = fired {
            self.last_event = Some((level, now));
        }
        match self.last_event {
            Some((level, at)) if now - at <= EVENT_HOLD => level,
            _ => Pressure::None,
        }
    }
}

/// Registers an eventfd for each v1 level of `group`'s `memory.pressure_level`.
fn register_v1(group: &Path) -> io::Result<(Vec<(OwnedFd, Pressure)>, File)> {
    let level_file = File::open(group.join("memory.pressure_level"))?;
    let control = group.join("cgroup.event_control");
    let mut events = Vec::new();
    for (name, level) in V1_LEVELS {
        // SAFETY: eventfd takes no pointers; a non-negative result is a new descriptor that
        // nothing else owns, handed to OwnedFd, which closes it.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a valid descriptor just created and owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        std::fs::write(
            &control,
            format!("{} {} {name}", fd.as_raw_fd(), level_file.as_raw_fd()),
        )
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot register for {name} memory pressure in {}: {e}",
                    control.display()
                ),
            )
        })?;
        events.push((fd, level));
    }
    Ok((events, level_file))
}

/// The events an eventfd counted since the last read (0 when none: it is non-blocking).
fn drain_eventfd(fd: &OwnedFd) -> u64 {
    let mut count = 0u64;
    // SAFETY: reads at most 8 bytes into `count`, a live u64 on the stack; the descriptor is a
    // valid eventfd for the borrow's duration.
    let n = unsafe {
        libc::read(
            fd.as_raw_fd(),
            (&mut count as *mut u64).cast(),
            std::mem::size_of::<u64>(),
        )
    };
    if n == 8 {
        count
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psi_text_becomes_a_level() {
        let psi = |some: f64, full: f64| {
            format!(
                "some avg10={some:.2} avg60=1.00 avg300=0.50 total=123\nfull avg10={full:.2} avg60=0.00 avg300=0.00 total=45\n"
            )
        };
        assert_eq!(psi_level(&psi(2.13, 0.75)), Pressure::None);
        assert_eq!(psi_level(&psi(12.0, 1.0)), Pressure::Moderate);
        assert_eq!(psi_level(&psi(30.0, 5.0)), Pressure::Low);
        assert_eq!(psi_level(&psi(30.0, 10.0)), Pressure::Critical);
        // Older kernels' system file has no `full` line; garbage is no pressure.
        assert_eq!(
            psi_level("some avg10=40.00 avg60=1 avg300=0 total=1\n"),
            Pressure::Low
        );
        assert_eq!(psi_level("nonsense"), Pressure::None);
        assert!(Pressure::Critical > Pressure::Low && Pressure::Low > Pressure::Moderate);
    }

    #[test]
    fn an_eventfd_counts_what_was_signalled_since_the_last_read() {
        // SAFETY: as in register_v1.
        let fd = unsafe { OwnedFd::from_raw_fd(libc::eventfd(0, libc::EFD_NONBLOCK)) };
        assert_eq!(drain_eventfd(&fd), 0);
        let one = 3u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live array to a valid eventfd.
        assert_eq!(
            unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), 8) },
            8
        );
        assert_eq!(drain_eventfd(&fd), 3);
        assert_eq!(drain_eventfd(&fd), 0);
    }
}
