//! A fork-join for the decode loop over a fixed set of parked helper threads: [`for_each`] calls
//! `f(i)` for every `i` in `0..n`, each exactly once, on the calling thread and up to `threads − 1`
//! helpers, and returns when all are done. Items are taken in turn from one counter, so which
//! thread runs an item varies, never what it computes: a caller whose items write disjoint state
//! gets the same bits with any number of threads.
//!
//! Why not rayon: a thread outside rayon's pool (the decoding thread, which the binary does not
//! run inside the pool) hands each job to the pool through its injector queue, which allocates a
//! block every 63 jobs, and the decode loop allocates nothing (`tests/tests/decode_allocations.rs`).
//! A call here takes two uncontended locks and one wake-up (a futex), and allocates nothing once
//! the helpers exist (they are spawned the first time as many are asked for). A second caller
//! while one call runs (tests run side by side) runs its items on its own thread.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};

/// The work of one call as the helpers see it: a borrowed closure whose lifetime is erased.
#[derive(Clone, Copy)]
struct Job(*const (dyn Fn() + Sync + 'static));

// SAFETY: the pointee is `Sync` (so callable from any thread), and [`for_each`] keeps it alive
// until every helper that took it has returned (see there).
unsafe impl Send for Job {}

#[derive(Default)]
struct State {
    /// Bumped by each call, so that a helper takes part at most once per call.
    epoch: u64,
    job: Option<Job>,
    /// Helpers that may still join the current call (0 once its caller has finished its share).
    wanted: usize,
    /// Helpers running the current job.
    running: usize,
    /// A helper's share panicked.
    panicked: bool,
}

#[derive(Default)]
struct Pool {
    state: Mutex<State>,
    /// Helpers wait here for a call.
    call: Condvar,
    /// The caller waits here for the helpers that joined.
    done: Condvar,
    /// Held by the call under way.
    busy: Mutex<()>,
    /// Helpers spawned.
    spawned: Mutex<usize>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic is caught before it can poison these locks; tolerate it anyway.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(Pool::default)
}

impl Pool {
    /// Spawns helpers until there are `n`; returns how many there are (fewer if the OS refuses).
    fn ensure(&'static self, n: usize) -> usize {
        let mut spawned = lock(&self.spawned);
        while *spawned < n {
            let ok = std::thread::Builder::new()
                .name("leanstream-ffn".into())
                .spawn(move || self.helper())
                .is_ok();
            if !ok {
                break;
            }
            *spawned += 1;
        }
        *spawned
    }

    fn helper(&self) {
        let mut seen = 0;
        loop {
            let mut st = lock(&self.state);
            let job = loop {
                if st.epoch != seen {
                    seen = st.epoch;
                    if st.wanted > 0 {
                        break st.job.expect("a call with helpers wanted has a job");
                    }
                }
                st = self.call.wait(st).unwrap_or_else(|e| e.into_inner());
            };
            st.wanted -= 1;
            st.running += 1;
            drop(st);
            // SAFETY: `running` was raised under the lock while the call still wanted helpers,
            // so its caller waits for it to fall back before the job's borrow ends.
            let ok = catch_unwind(AssertUnwindSafe(|| unsafe { (*job.0)() })).is_ok();
            let mut st = lock(&self.state);
            st.running -= 1;
            st.panicked |= !ok;
            if st.running == 0 {
                self.done.notify_all();
            }
        }
    }
}

/// Calls `f(i)` for every `i` in `0..n` on this thread and up to `threads − 1` helpers; returns
/// when every call has returned. A panic in `f` is raised again here.
pub fn for_each(threads: usize, n: usize, f: &(dyn Fn(usize) + Sync)) {
    let helpers = threads.min(n).saturating_sub(1);
    let pool = pool();
    let busy = if helpers > 0 {
        pool.busy.try_lock().ok()
    } else {
        None
    };
    let helpers = match &busy {
        Some(_) => helpers.min(pool.ensure(helpers)),
        None => 0,
    };
    if helpers == 0 {
        (0..n).for_each(f);
        return;
    }
    let next = AtomicUsize::new(0);
    let work = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i);
    };
    let job: &(dyn Fn() + Sync) = &work;
    // SAFETY: only the lifetime is erased. Helpers call the job only after joining under the
    // lock while `wanted > 0`; below, `wanted` is set to 0 and this call waits until `running`
    // (every helper that joined) is back to 0 before `work` goes out of scope, even if `work`
    // panicked on this thread.
    let job = Job(unsafe {
        std::mem::transmute::<*const (dyn Fn() + Sync + '_), *const (dyn Fn() + Sync + 'static)>(
            job,
        )
    });
    {
        let mut st = lock(&pool.state);
        st.epoch += 1;
        st.job = Some(job);
        st.wanted = helpers;
        st.panicked = false;
        pool.call.notify_all();
    }
    let mine = catch_unwind(AssertUnwindSafe(work));
    let helper_panicked = {
        let mut st = lock(&pool.state);
        st.wanted = 0;
        while st.running > 0 {
            st = pool.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.job = None;
        std::mem::take(&mut st.panicked)
    };
    drop(busy);
    if let Err(e) = mine {
        resume_unwind(e);
    }
    assert!(
        !helper_panicked,
        "a helper thread panicked (its message is above)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// Every item exactly once, for any thread count (more threads than items included), with
    /// the closure borrowing the caller's stack.
    #[test]
    fn every_item_runs_once_on_any_number_of_threads() {
        for threads in [1, 2, 3, 5] {
            for n in [0, 1, 2, 7, 64] {
                for _ in 0..20 {
                    let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                    let values: Vec<u32> = (0..n as u32).map(|i| i * 3 + 1).collect();
                    let sum = AtomicU32::new(0);
                    for_each(threads, n, &|i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                        sum.fetch_add(values[i], Ordering::Relaxed);
                    });
                    assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                    let want: u32 = values.iter().sum();
                    assert_eq!(sum.load(Ordering::Relaxed), want, "{threads} threads, {n}");
                }
            }
        }
    }

    /// Per-item state behind its own lock, as the FFN uses it: the results equal a serial run's.
    #[test]
    fn disjoint_writes_equal_the_serial_result() {
        let n = 16;
        let serial: Vec<f32> = (0..n)
            .map(|i| (0..1000).map(|j| ((i * j) as f32).sin()).sum())
            .collect();
        let cells: Vec<Mutex<f32>> = (0..n).map(|_| Mutex::new(0.0)).collect();
        for_each(2, n, &|i| {
            *cells[i].lock().unwrap() = (0..1000).map(|j| ((i * j) as f32).sin()).sum();
        });
        let got: Vec<f32> = cells.into_iter().map(|c| c.into_inner().unwrap()).collect();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            serial.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    /// A panic in an item reaches the caller, and the helpers keep serving later calls.
    #[test]
    fn a_panic_reaches_the_caller_and_the_pool_survives() {
        let r = catch_unwind(|| {
            for_each(2, 8, &|i| {
                if i == 5 {
                    panic!("item five");
                }
            })
        });
        assert!(r.is_err());
        let count = AtomicU32::new(0);
        for_each(2, 100, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 100);
    }

    /// Callers on several threads at once (the second runs its items itself).
    #[test]
    fn concurrent_callers_each_get_all_their_items() {
        std::thread::scope(|s| {
            for t in 0..4u32 {
                s.spawn(move || {
                    for _ in 0..50 {
                        let sum = AtomicU32::new(0);
                        for_each(2, 32, &|i| {
                            sum.fetch_add(i as u32 + t, Ordering::Relaxed);
                        });
                        assert_eq!(sum.load(Ordering::Relaxed), 496 + 32 * t);
                    }
                });
            }
        });
    }
}
