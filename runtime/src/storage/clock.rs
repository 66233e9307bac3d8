//! Waiting until an instant with microsecond precision, which the flash model needs to impose
//! 50–100 µs device latencies in wall-clock time.
//!
//! Linux rounds every timed sleep up by the thread's timer slack (50 µs by default; sleeps here
//! overshot by ≈ 70 µs), and even with the slack at 1 ns a virtual machine wakes ≈ 20 µs late. So
//! the thread lowers its slack once, sleeps until [`SPIN`] before the deadline, then spins.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// The tail of a wait that is spun rather than slept: above the wake-up overshoot measured here
/// (p90 ≈ 26 µs with 1 ns slack).
const SPIN: Duration = Duration::from_micros(50);

/// Returns at `deadline` (or at once if it has passed), within about a microsecond.
pub(crate) fn sleep_until(deadline: Instant) {
    let now = Instant::now();
    if deadline <= now {
        return;
    }
    precise_timers();
    let left = deadline - now;
    if left > SPIN {
        std::thread::sleep(left - SPIN);
    }
    while Instant::now() < deadline {
        std::hint::spin_loop();
    }
}

/// Sets the calling thread's timer slack to 1 ns (once per thread), so timed sleeps and condvar
/// timeouts end when asked instead of up to 50 µs later. Elsewhere than Linux it does nothing.
pub(crate) fn precise_timers() {
    thread_local!(static DONE: Cell<bool> = const { Cell::new(false) });
    if DONE.replace(true) {
        return;
    }
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument and affects only this thread.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
}
