//! The queue's side that runs reads: taking requests in priority order, merging neighbours into
//! one device read, booking reads with a device that models time, moving bytes into callers'
//! buffers, retries, and the worker threads that do it.

use super::*;

impl State {
    /// Removes a request (redeemed or cancelled), keeping the watch set's counts.
    pub(super) fn take(&mut self, id: u64) -> Option<Request> {
        let r = self.requests.remove(&id)?;
        if r.watch.0 == self.watch_gen {
            self.watched_left -= 1;
            if matches!(r.state, ReqState::Pending) {
                self.watched_pending -= 1;
            }
        }
        Some(r)
    }

    /// Registers a read submitted at `now`; a misaligned one is failed at once.
    pub(super) fn insert(
        &mut self,
        offset: u64,
        len: usize,
        buf: Option<AlignedBuf>,
        priority: u32,
        now: Instant,
        hash: bool,
    ) -> Ticket {
        let align = AlignedBuf::ALIGN;
        let id = self.next_id;
        self.next_id += 1;
        self.stats.submitted += 1;
        let state = if len > 0 && len.is_multiple_of(align) && offset.is_multiple_of(align as u64) {
            self.pending.insert(id, Extent { offset, len }, priority);
            ReqState::Pending
        } else {
            self.stats.failed += 1;
            let msg = format!("read of {len} bytes at offset {offset} is not {align}-aligned");
            ReqState::Done(
                Err(io::Error::new(io::ErrorKind::InvalidInput, msg)),
                now,
                None,
            )
        };
        let request = Request {
            submitted: now,
            buf,
            state,
            hash,
            watch: (0, 0),
        };
        self.requests.insert(id, request);
        Ticket(id)
    }

    /// The slot the next pending read goes to, and from when: the free slot that frees first,
    /// or for a background read, later if need be, once fewer background reads than allowed hold
    /// slots. `None` if every slot (or every background allowance) is mid-read.
    pub(super) fn free_slot(&self) -> Option<(usize, Instant)> {
        let (slot, free_at) = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.reading)
            .min_by_key(|(_, s)| s.free_at)
            .map(|(i, s)| (i, s.free_at))?;
        let (Some((below, allowed)), Some(top)) = (self.background, self.pending.top_priority())
        else {
            return Some((slot, free_at));
        };
        if top >= below {
            return Some((slot, free_at));
        }
        // Background reads holding slots after `free_at`, latest end first (on the stack: this
        // runs for every read).
        let mut all = [None; MAX_SLOTS];
        let mut n = 0;
        for s in &self.slots {
            if s.background && (s.reading || s.free_at > free_at) {
                all[n] = (!s.reading).then_some(s.free_at);
                n += 1;
            }
        }
        let ends = &mut all[..n];
        if ends.len() < allowed {
            return Some((slot, free_at));
        }
        // Reading slots (end unknown) sort first; the allowed-th latest end opens the way.
        ends.sort_unstable_by(|a, b| match (a, b) {
            (None, None) => std::cmp::Ordering::Equal,
            (None, _) => std::cmp::Ordering::Less,
            (_, None) => std::cmp::Ordering::Greater,
            (Some(a), Some(b)) => b.cmp(a),
        });
        ends[allowed - 1].map(|at| (slot, at.max(free_at)))
    }

    /// Whether pending work needs a worker woken: bytes to move and no worker awake, or a read
    /// pending and a slot free now, or one that frees later and no worker timing it yet (a thread
    /// finishing a read re-checks by itself).
    pub(super) fn worker_needed(&self, now: Instant) -> bool {
        // Bytes to move: one worker awake is enough (it moves them one after another), so a
        // submission does not pay a wake-up while one is.
        let all_idle = self.idle_workers == self.slots.len();
        (!self.booked.is_empty() && all_idle)
            || !self.pending.is_empty()
                && self
                    .free_slot()
                    .is_some_and(|(_, at)| at <= now || self.timer.is_none_or(|t| t > at))
    }
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gets newly queued reads going: on a timed device they are issued (booked) here while
    /// slots are free, and a worker moves the bytes of those of [`HAND_OFF_MIN_BYTES`] or more,
    /// so that the submitting thread — the one computing — goes on computing, as a phone's DMA
    /// would leave it (smaller ones it moves itself: waking a worker would cost it more);
    /// otherwise a worker issues and reads them.
    pub(super) fn kick<'a>(&'a self, mut st: MutexGuard<'a, State>) {
        if self.timed {
            loop {
                let now = Instant::now();
                match st.free_slot() {
                    Some((slot, free_at)) if free_at <= now && !st.pending.is_empty() => {
                        let booked = self.book(&mut st, slot, free_at, now);
                        if booked.run.len >= HAND_OFF_MIN_BYTES {
                            st.booked.push_back(booked);
                        } else {
                            st = self.transfer(st, booked);
                        }
                    }
                    _ => break,
                }
            }
        }
        self.wake_worker(&st, Instant::now());
    }

    /// One wait of a caller whose read is not done: when one of its reads is still pending on a
    /// timed device (`mine_pending`), it issues reads itself as slots free, in priority order,
    /// rather than be woken by whoever issues them (it has nothing else to do); otherwise it
    /// blocks until a read finishes.
    pub(super) fn wait_step<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        mine_pending: bool,
    ) -> MutexGuard<'a, State> {
        if self.timed {
            // Reads issued and not moved yet: the waiter moves them rather than wait for a
            // worker to wake (its own is likely among them).
            if let Some(booked) = st.booked.pop_front() {
                return self.transfer(st, booked);
            }
            if mine_pending {
                return self.step(st, Role::Waiter);
            }
        }
        self.block(st, Role::Waiter, None)
    }

    pub(super) fn wake_worker(&self, st: &State, now: Instant) {
        if st.idle_workers > 0 && st.worker_needed(now) {
            self.work.notify_one();
        }
    }

    pub(super) fn work_loop(&self) {
        clock::precise_timers();
        let mut st = self.lock();
        while !st.shutdown {
            st = self.step(st, Role::Worker);
        }
    }

    /// Moves the bytes of a read issued and not moved yet, if there is one; else serves one
    /// pending read if a slot is free now; otherwise blocks until a slot frees (or, if nothing
    /// is pending or every slot is mid-read, until woken).
    pub(super) fn step<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        role: Role,
    ) -> MutexGuard<'a, State> {
        if let Some(booked) = st.booked.pop_front() {
            return self.transfer(st, booked);
        }
        let now = Instant::now();
        match st.free_slot() {
            Some((slot, free_at)) if !st.pending.is_empty() => {
                if free_at > now {
                    self.sleep_until_slot_frees(st, role, free_at, now)
                } else {
                    self.serve(st, slot, free_at, now)
                }
            }
            _ => self.block(st, role, None),
        }
    }

    /// Blocks a worker on `work` or a waiter on `done`, for at most `timeout`.
    pub(super) fn block<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        role: Role,
        timeout: Option<Duration>,
    ) -> MutexGuard<'a, State> {
        let (condvar, count) = match role {
            Role::Worker => (&self.work, &mut st.idle_workers),
            Role::Waiter => (&self.done, &mut st.waiters),
        };
        *count += 1;
        st = match timeout {
            None => condvar.wait(st).unwrap_or_else(|e| e.into_inner()),
            Some(t) => {
                clock::precise_timers();
                condvar
                    .wait_timeout(st, t)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
        };
        match role {
            Role::Worker => st.idle_workers -= 1,
            Role::Waiter => st.waiters -= 1,
        }
        st
    }

    /// Sleeps until `free_at`, when the next slot frees, unless another thread already times an
    /// earlier or equal instant, in which case it blocks until woken. Waking late costs nothing:
    /// the read issued then still arrives at `free_at`.
    pub(super) fn sleep_until_slot_frees<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        role: Role,
        free_at: Instant,
        now: Instant,
    ) -> MutexGuard<'a, State> {
        if st.timer.is_some_and(|t| t <= free_at) {
            return self.block(st, role, None);
        }
        st.timer = Some(free_at);
        st = self.block(st, role, Some(free_at - now));
        if st.timer == Some(free_at) {
            st.timer = None;
        }
        st
    }

    /// Issues the most urgent pending read (merged with its neighbours) in `slot`, which freed at
    /// `free_at`, reads it with the lock released, and records the outcome.
    pub(super) fn serve<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        slot: usize,
        free_at: Instant,
        now: Instant,
    ) -> MutexGuard<'a, State> {
        let booked = self.book(&mut st, slot, free_at, now);
        self.transfer(st, booked)
    }

    /// Issues the most urgent pending read (merged with its neighbours) in `slot`, which freed at
    /// `free_at`: its requests are marked issued, and a timed device books it, so that it holds
    /// the slot until its modelled completion whoever moves its bytes and whenever.
    pub(super) fn book(
        &self,
        st: &mut State,
        slot: usize,
        free_at: Instant,
        now: Instant,
    ) -> Booked {
        let background = match (st.background, st.pending.top_priority()) {
            (Some((below, _)), Some(top)) => top < below,
            _ => false,
        };
        let parts = st.spare_parts.pop().unwrap_or_default();
        let run = st
            .pending
            .pop_run(MAX_MERGE_BYTES, parts)
            .expect("pending is not empty");
        st.slots[slot].background = background;
        let mut arrival = free_at;
        let mut bufs = st.spare_bufs.pop().unwrap_or_default();
        let mut hash = [false; MAX_PARTS];
        let generation = st.watch_gen;
        for (i, (id, extent)) in run.parts.iter().enumerate() {
            let request = st.requests.get_mut(id).expect("pending reads are known");
            request.state = ReqState::Issued;
            hash[i] = request.hash;
            arrival = arrival.max(request.submitted);
            // A read submitted without a buffer gets a new one (not in the token loop, whose
            // reads bring their own).
            bufs.push(
                request
                    .buf
                    .take()
                    .unwrap_or_else(|| AlignedBuf::new(extent.len)),
            );
            if request.watch.0 == generation {
                st.watched_pending -= 1;
            }
        }
        // A timed read is booked now, in the order reads reach the device, and frees its slot
        // when the modelled device completes it, however late its bytes are moved.
        let scheduled = self.device.schedule(arrival, run.len);
        match scheduled {
            Some(at) => st.slots[slot].free_at = at,
            None => st.slots[slot].reading = true,
        }
        if !self.timed {
            self.wake_worker(st, now);
        }
        Booked {
            slot,
            run,
            bufs,
            hash,
            scheduled,
            arrival,
            now,
        }
    }

    /// Moves a booked read's bytes (hashing those asked for) with the lock released, and records
    /// the outcome.
    pub(super) fn transfer<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        booked: Booked,
    ) -> MutexGuard<'a, State> {
        let Booked {
            slot,
            run,
            mut bufs,
            hash,
            scheduled,
            arrival,
            now,
        } = booked;
        drop(st);

        let (result, retries) = read_with_retries(&*self.device, run.offset, &mut bufs);
        let mut sums = [None; MAX_PARTS];
        if result.is_ok() {
            for ((sum, &want), buf) in sums.iter_mut().zip(&hash).zip(&bufs) {
                if want {
                    *sum = Some(leanstream_format::container::checksum(buf));
                }
            }
        }
        let finished = Instant::now();
        // A timed read occupies the device from its arrival to its modelled completion.
        let (busy_from, completes) = match scheduled {
            Some(at) => (arrival, at),
            None => (now, finished),
        };
        let failure = result.err().map(|e| {
            (
                e.kind(),
                format!("{}: {e}", self.failure_context(&run, retries)),
            )
        });

        let mut st = self.lock();
        st.stats.device_reads += 1;
        st.stats.merged += run.parts.len() as u64 - 1;
        st.stats.retries += u64::from(retries);
        if failure.is_some() {
            st.stats.failed += run.parts.len() as u64;
        } else {
            st.stats.bytes_read += run.len as u64;
        }
        st.busy.add(busy_from, completes);
        if let Some(spans) = &mut st.spans {
            spans.push(ReadSpan {
                slot,
                start: busy_from,
                end: completes,
                offset: run.offset,
                len: run.len,
                parts: run.parts.len(),
            });
        }
        if scheduled.is_none() {
            st.slots[slot] = Slot {
                reading: false,
                free_at: finished,
                background: false,
            };
        }
        let generation = st.watch_gen;
        for (((id, _), buf), sum) in run.parts.iter().zip(bufs.drain(..)).zip(sums) {
            let outcome = match &failure {
                None => Ok(buf),
                Some((kind, msg)) => Err(io::Error::new(*kind, msg.clone())),
            };
            if let Some(request) = st.requests.get_mut(id) {
                request.state = ReqState::Done(outcome, completes, sum);
                let (g, tag) = request.watch;
                if g == generation {
                    st.ready.push(Reverse((completes, *id, tag)));
                }
            }
        }
        st.spare_parts.push(run.parts);
        st.spare_bufs.push(bufs);
        if st.waiters > 0 {
            self.done.notify_all();
        }
        st
    }

    pub(super) fn failure_context(&self, run: &Run, retries: u32) -> String {
        let after = if retries > 0 {
            format!(" (after {retries} retries)")
        } else {
            String::new()
        };
        format!(
            "{}: read of {} bytes at offset {}{after}",
            self.device.name(),
            run.len,
            run.offset
        )
    }
}

/// One device read, retried on failures that may pass (see [`MAX_RETRIES`]), each retry after a
/// longer pause (0.1, 0.2, 0.4 ms); returns the outcome and the retries spent.
pub(super) fn read_with_retries(
    device: &dyn Device,
    offset: u64,
    bufs: &mut [AlignedBuf],
) -> (io::Result<()>, u32) {
    let mut retries = 0;
    let mut short_read_retried = false;
    loop {
        let e = match device.read_scattered(offset, bufs) {
            Ok(()) => return (Ok(()), retries),
            Err(e) => e,
        };
        let may_pass = match e.kind() {
            io::ErrorKind::InvalidInput => false,
            io::ErrorKind::UnexpectedEof => !std::mem::replace(&mut short_read_retried, true),
            _ => true,
        };
        if !may_pass || retries == MAX_RETRIES {
            return (Err(e), retries);
        }
        if !matches!(e.kind(), io::ErrorKind::Interrupted) {
            std::thread::sleep(Duration::from_micros(100 << retries));
        }
        retries += 1;
    }
}
