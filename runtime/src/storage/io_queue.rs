//! The priority read queue the scheduler streams through: thousands of reads per token, most
//! urgent first; reads no longer wanted are cancelled before they reach the device; reads found
//! urgent late are boosted; pending reads that lie end to end go to the device as one read that
//! lands directly in each caller's buffer.
//!
//! The device has `queue_depth` command slots. A read holds a slot from the moment it reaches the
//! device until it completes. For a real device that is while a worker thread blocks in it (one
//! worker per slot). For a device that models time ([`Device::models_time`]) the read is booked
//! with the model when its slot frees, in slot order (by whichever thread finds the slot free:
//! usually the submitting or the waiting one, a worker otherwise), and holds the slot until the
//! modelled completion; moving its bytes is only a copy (with, if asked, their XXH3), done by a
//! worker — not by the submitting thread, which is the one computing, as a phone's DMA moves bytes
//! without the CPU that asked for them — or by a caller waiting for a read whose bytes have not
//! been moved yet (it has nothing else to do); the waiting caller sleeps out the completion
//! itself. So no thread
//! is tied up per emulated read, and a read reaches the device when its slot frees (or when it is
//! submitted, if later) even if the thread that books it runs a little after that, as the kernel
//! would have sent it from its own queue.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::busy::BusyClock;
use super::pending::{Extent, PendingSet, Run};
use super::{clock, AlignedBuf, Device};

/// Reads that continue each other are merged into device reads of at most this many bytes, so a
/// merge never delays the read that started it by more than one such transfer.
pub const MAX_MERGE_BYTES: usize = 1 << 20;
/// The most device slots a queue has (one I/O thread each).
const MAX_SLOTS: usize = 256;
/// On a timed device, the submitting thread moves the bytes of a device read shorter than this
/// itself and hands longer ones to a worker: handing over costs a wake-up and a lock round trip
/// (several µs on a loaded VM, about the copy and hash of 16–32 KiB), so the 4 KiB reads of the
/// queue's own throughput test would lose IOPS to it, while a cluster of 32 KiB or more gains.
const HAND_OFF_MIN_BYTES: usize = 32 << 10;
/// The most submitted reads one device read serves: whole pages within [`MAX_MERGE_BYTES`].
const MAX_PARTS: usize = MAX_MERGE_BYTES / AlignedBuf::ALIGN;

/// Retries of a failed device read before the failure counts. Flash can fail a read once and
/// serve it on the next try, and nothing tells such an `EIO` from a lasting one but trying again,
/// so every failure is retried, except a malformed request and a second short read in a row (the
/// file really ends there).
const MAX_RETRIES: u32 = 3;

/// A submitted read; redeem it with [`IoQueue::wait`] or [`IoQueue::poll`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket(u64);

/// Counters since the queue started.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct IoStats {
    /// Reads submitted.
    pub submitted: u64,
    /// Reads sent to the device (after merging).
    pub device_reads: u64,
    /// Submitted reads served by a device read started for another one.
    pub merged: u64,
    /// Reads cancelled before they were issued.
    pub cancelled: u64,
    /// Device reads retried after a failure (see [`MAX_RETRIES`]).
    pub retries: u64,
    /// Submitted reads that ended in an error.
    pub failed: u64,
    /// Bytes delivered by the device.
    pub bytes_read: u64,
    /// Time during which at least one read was in flight.
    pub busy: Duration,
    /// Time since the queue started.
    pub elapsed: Duration,
}

impl IoStats {
    /// The share of the time the device was busy.
    pub fn io_busy_fraction(&self) -> f64 {
        let elapsed = self.elapsed.as_secs_f64();
        if elapsed > 0.0 {
            (self.busy.as_secs_f64() / elapsed).min(1.0)
        } else {
            0.0
        }
    }
}

/// One device read on the timeline (`leanstream bench --trace`): the slot it held, from its
/// arrival at the device to its completion.
#[derive(Clone, Copy, Debug)]
pub struct ReadSpan {
    pub slot: usize,
    pub start: Instant,
    pub end: Instant,
    pub offset: u64,
    pub len: usize,
    /// Submitted reads it served (more than one when merged).
    pub parts: usize,
}

/// A priority read queue with `device.queue_depth()` reads in flight at most.
pub struct IoQueue {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

struct Shared {
    device: Arc<dyn Device>,
    /// `device.models_time()`: reads are issued by whichever thread finds a slot free.
    timed: bool,
    state: Mutex<State>,
    /// Wakes workers: new work, a slot to time, shutdown.
    work: Condvar,
    /// Wakes callers of `wait`: a read finished.
    done: Condvar,
    started: Instant,
}

struct State {
    next_id: u64,
    pending: PendingSet,
    requests: HashMap<u64, Request, BuildHasherDefault<IdHasher>>,
    slots: Vec<Slot>,
    /// When the worker sleeping until a slot frees will wake, if one is.
    timer: Option<Instant>,
    /// Workers blocked on `work`, and callers blocked on `done`: nobody to notify, no syscall.
    idle_workers: usize,
    waiters: usize,
    shutdown: bool,
    stats: IoStats,
    busy: BusyClock,
    /// Device reads kept for a timeline, when asked for.
    spans: Option<Vec<ReadSpan>>,
    /// Reads below this priority are background: at most `.1` of them hold slots at once.
    background: Option<(u32, usize)>,
    /// The part lists and buffer lists of device reads done with, for the next ones (one each
    /// per read in progress): issuing a read allocates nothing.
    spare_parts: Vec<Vec<(u64, Extent)>>,
    spare_bufs: Vec<Vec<AlignedBuf>>,
    /// The watch set ([`IoQueue::watch_all`]): its generation (from 1, so never that of an
    /// unwatched request; a request watched under an older one is not in it), how many of its reads are not issued yet, and its reads that are done,
    /// earliest completion first, with their tags. Each completion costs O(log n), not a scan.
    watch_gen: u64,
    watched_pending: usize,
    watched_left: usize,
    ready: BinaryHeap<Reverse<(Instant, u64, u32)>>,
    /// Timed reads issued by a submitting thread, whose bytes a worker (or a waiting caller)
    /// moves, oldest first.
    booked: VecDeque<Booked>,
}

struct Request {
    submitted: Instant,
    /// The caller's buffer to read into (`submit_into`), until the read is issued.
    buf: Option<AlignedBuf>,
    state: ReqState,
    /// Hash the bytes once read, on the thread that moved them (`Done::hash`).
    hash: bool,
    /// The watch generation and tag it is watched under (generation 0: not watched).
    watch: (u64, u32),
}

enum ReqState {
    Pending,
    Issued,
    /// The result, and when the read completed: past for a real read, possibly still to come
    /// for a timed device's modelled one (it must not be handed out before).
    Done(io::Result<AlignedBuf>, Instant, Option<u64>),
}

/// Hashes a request's id, a counter, by one multiplication: the map is looked up several times
/// per read, where SipHash showed in profiles. The golden-ratio factor spreads consecutive ids over the high bits, which
/// the map's buckets and control bytes use.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A device read issued (and, on a timed device, booked) whose bytes have not been moved yet.
struct Booked {
    slot: usize,
    run: Run,
    bufs: Vec<AlignedBuf>,
    /// Which parts want their bytes hashed.
    hash: [bool; MAX_PARTS],
    /// The modelled completion (timed devices).
    scheduled: Option<Instant>,
    arrival: Instant,
    now: Instant,
}

/// Who is blocking: a worker thread, or a caller of `wait`.
#[derive(Clone, Copy)]
enum Role {
    Worker,
    Waiter,
}

#[derive(Clone, Copy)]
struct Slot {
    /// A thread is inside a (real) device's read.
    reading: bool,
    /// When the slot's latest read completes (or completed).
    free_at: Instant,
    /// The slot's latest read was a background read.
    background: bool,
}

impl IoQueue {
    /// Starts one worker thread per device slot.
    pub fn new(device: Arc<dyn Device>) -> Self {
        let depth = device.queue_depth().max(1);
        assert!(
            depth <= MAX_SLOTS,
            "a queue depth of {depth} is more than {MAX_SLOTS}"
        );
        let now = Instant::now();
        let free = Slot {
            reading: false,
            free_at: now,
            background: false,
        };
        let shared = Arc::new(Shared {
            timed: device.models_time(),
            device,
            state: Mutex::new(State {
                next_id: 0,
                pending: PendingSet::default(),
                requests: HashMap::default(),
                slots: vec![free; depth],
                timer: None,
                idle_workers: 0,
                waiters: 0,
                shutdown: false,
                stats: IoStats::default(),
                busy: BusyClock::default(),
                spans: None,
                background: None,
                spare_parts: Vec::new(),
                spare_bufs: Vec::new(),
                watch_gen: 1,
                watched_pending: 0,
                watched_left: 0,
                ready: BinaryHeap::new(),
                booked: VecDeque::new(),
            }),
            work: Condvar::new(),
            done: Condvar::new(),
            started: now,
        });
        let workers = (0..depth)
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("leanstream-io-{i}"))
                    .spawn(move || shared.work_loop())
                    .expect("cannot start an I/O thread")
            })
            .collect();
        Self { shared, workers }
    }

    /// The device the queue reads from.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.shared.device
    }

    /// Queues a read of `len` bytes at `offset` (both multiples of [`AlignedBuf::ALIGN`]) into a
    /// new buffer; higher `priority` goes first, equal priorities in submission order. A
    /// misaligned read fails at `wait` with `InvalidInput`.
    pub fn submit(&self, offset: u64, len: usize, priority: u32) -> Ticket {
        self.submit_batch(&[(offset, len, priority)])[0]
    }

    /// Queues several `(offset, len, priority)` reads at once, before any of them is issued, so
    /// that those lying end to end merge even while device slots are free (like the kernel's
    /// request plugging).
    pub fn submit_batch(&self, reads: &[(u64, usize, u32)]) -> Vec<Ticket> {
        let now = Instant::now();
        let mut st = self.shared.lock();
        let tickets = reads
            .iter()
            .map(|&(offset, len, priority)| st.insert(offset, len, None, priority, now, false))
            .collect();
        self.shared.kick(st);
        tickets
    }

    /// Like [`IoQueue::submit`], reading `buf.len()` bytes into `buf`, so that callers can recycle
    /// buffers instead of faulting in fresh memory for every read. A cancelled read drops `buf`.
    pub fn submit_into(&self, buf: AlignedBuf, offset: u64, priority: u32) -> Ticket {
        let now = Instant::now();
        let mut st = self.shared.lock();
        let ticket = st.insert(offset, buf.len(), Some(buf), priority, now, false);
        self.shared.kick(st);
        ticket
    }

    /// [`IoQueue::submit_into`] for several reads at once: one lock and one wake-up for all. Their
    /// tickets replace `tickets`' contents, in order (the caller keeps the vector: no allocation).
    /// With `hash`, the thread that moves each read's bytes also takes their XXH3
    /// ([`IoQueue::wait_hashed`], [`IoQueue::wait_watched`]): with a timed device, an I/O thread
    /// rather than the caller, as a phone's DMA moves the bytes and another core may hash them.
    pub fn submit_batch_into(
        &self,
        reads: impl IntoIterator<Item = (AlignedBuf, u64, u32)>,
        tickets: &mut Vec<Ticket>,
        hash: bool,
    ) {
        let now = Instant::now();
        let mut st = self.shared.lock();
        tickets.clear();
        tickets.extend(reads.into_iter().map(|(buf, offset, priority)| {
            st.insert(offset, buf.len(), Some(buf), priority, now, hash)
        }));
        self.shared.kick(st);
    }

    /// Makes `reads` (ticket, tag) the watch set, replacing the previous one: [`IoQueue::wait_watched`]
    /// hands them over in completion order, each in O(log n), not a scan of every ticket per
    /// wake-up. Unknown tickets are left out.
    pub fn watch_all(&self, reads: impl IntoIterator<Item = (Ticket, u32)>) {
        let mut guard = self.shared.lock();
        let st = &mut *guard;
        st.watch_gen += 1;
        st.watched_pending = 0;
        st.watched_left = 0;
        st.ready.clear();
        let generation = st.watch_gen;
        for (ticket, tag) in reads {
            let Some(r) = st.requests.get_mut(&ticket.0) else {
                continue;
            };
            if r.watch.0 == generation {
                continue;
            }
            r.watch = (generation, tag);
            st.watched_left += 1;
            match r.state {
                ReqState::Pending => st.watched_pending += 1,
                ReqState::Done(_, at, _) => st.ready.push(Reverse((at, ticket.0, tag))),
                ReqState::Issued => {}
            }
        }
    }

    /// Blocks until a read of the watch set is done and hands it over: its tag, its buffer and
    /// (submitted with `hash`, and read) the XXH3 of its bytes. The one that completed first, on
    /// a timed device the earliest completion time among those done. `None` once every watched
    /// read was handed over (or redeemed otherwise).
    pub fn wait_watched(&self) -> Option<(u32, io::Result<AlignedBuf>, Option<u64>)> {
        let mut st = self.shared.lock();
        let (id, tag) = loop {
            if let Some(Reverse((_, id, tag))) = st.ready.pop() {
                // Redeemed by `wait` or `poll` meanwhile: not there any more.
                if st.requests.contains_key(&id) {
                    break (id, tag);
                }
                continue;
            }
            if st.watched_left == 0 {
                return None;
            }
            let mine_pending = st.watched_pending > 0;
            st = self.shared.wait_step(st, mine_pending);
        };
        let Some(ReqState::Done(result, at, hash)) = st.take(id).map(|r| r.state) else {
            unreachable!("only done reads are ready")
        };
        self.shared.wake_worker(&st, Instant::now());
        drop(st);
        clock::sleep_until(at);
        Some((tag, result, hash))
    }

    /// Lets reads below priority `below` (guesses, such as speculative reads) hold at most
    /// `slots` device slots at once; the others stay queued, where they can still be cancelled,
    /// and reads at or above `below` never find every slot taken by guesses.
    pub fn limit_background(&self, below: u32, slots: usize) {
        let mut st = self.shared.lock();
        st.background = Some((below, slots.max(1)));
    }

    /// Withdraws a read that has not been issued yet; it will never be. False if it was already
    /// issued (its result still comes through `wait`) or the ticket is unknown.
    pub fn cancel(&self, ticket: Ticket) -> bool {
        let mut st = self.shared.lock();
        if !st.pending.remove(ticket.0) {
            return false;
        }
        st.take(ticket.0);
        st.stats.cancelled += 1;
        true
    }

    /// Gives a read that has not been issued yet a new priority; false if it was already issued.
    pub fn boost(&self, ticket: Ticket, priority: u32) -> bool {
        self.shared.lock().pending.set_priority(ticket.0, priority)
    }

    /// Blocks until the read is done and hands over its buffer. A failure names the device, the
    /// offset and the cause; an unknown, cancelled or already redeemed ticket is `InvalidInput`.
    pub fn wait(&self, ticket: Ticket) -> io::Result<AlignedBuf> {
        self.wait_hashed(ticket).0
    }

    /// [`IoQueue::wait`], with the XXH3 of the bytes when the read was submitted with `hash`
    /// (and succeeded).
    pub fn wait_hashed(&self, ticket: Ticket) -> (io::Result<AlignedBuf>, Option<u64>) {
        let mut st = self.shared.lock();
        loop {
            match st.requests.get(&ticket.0).map(|r| &r.state) {
                None => return (Err(unknown(ticket)), None),
                Some(ReqState::Done(..)) => break,
                Some(ReqState::Pending) => st = self.shared.wait_step(st, true),
                Some(_) => st = self.shared.wait_step(st, false),
            }
        }
        let Some(ReqState::Done(result, at, hash)) = st.take(ticket.0).map(|r| r.state) else {
            unreachable!("checked above")
        };
        // This thread may have been timing the next free slot: hand that over to a worker.
        self.shared.wake_worker(&st, Instant::now());
        drop(st);
        clock::sleep_until(at);
        (result, hash)
    }

    /// The read's result if it is done, without blocking; `None` while it is in progress. An
    /// unknown, cancelled or already redeemed ticket gives `InvalidInput`, as with `wait`.
    pub fn poll(&self, ticket: Ticket) -> Option<io::Result<AlignedBuf>> {
        let mut st = self.shared.lock();
        let Some(request) = st.requests.get(&ticket.0) else {
            return Some(Err(unknown(ticket)));
        };
        if !is_ready(&request.state, Instant::now()) {
            return None;
        }
        match st.take(ticket.0)?.state {
            ReqState::Done(result, _, _) => Some(result),
            _ => unreachable!("checked above"),
        }
    }

    /// Whether `wait` would return at once.
    pub fn is_done(&self, ticket: Ticket) -> bool {
        let st = self.shared.lock();
        st.requests
            .get(&ticket.0)
            .is_none_or(|r| is_ready(&r.state, Instant::now()))
    }

    /// Starts keeping every device read for a timeline (see [`IoQueue::take_spans`]).
    pub fn record_spans(&self) {
        self.shared.lock().spans.get_or_insert_with(Vec::new);
    }

    /// The device reads kept since [`IoQueue::record_spans`] or the last call.
    pub fn take_spans(&self) -> Vec<ReadSpan> {
        self.shared
            .lock()
            .spans
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Counters since the queue started.
    pub fn stats(&self) -> IoStats {
        let st = self.shared.lock();
        IoStats {
            busy: st.busy.total(),
            elapsed: self.shared.started.elapsed(),
            ..st.stats
        }
    }
}

impl Drop for IoQueue {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

fn unknown(ticket: Ticket) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "unknown read ticket {} (cancelled or already redeemed)",
            ticket.0
        ),
    )
}

fn is_ready(state: &ReqState, now: Instant) -> bool {
    matches!(state, ReqState::Done(_, at, _) if *at <= now)
}

impl State {
    /// Removes a request (redeemed or cancelled), keeping the watch set's counts.
    fn take(&mut self, id: u64) -> Option<Request> {
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
    fn insert(
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
    fn free_slot(&self) -> Option<(usize, Instant)> {
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
    fn worker_needed(&self, now: Instant) -> bool {
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
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gets newly queued reads going: on a timed device they are issued (booked) here while
    /// slots are free, and a worker moves the bytes of those of [`HAND_OFF_MIN_BYTES`] or more,
    /// so that the submitting thread — the one computing — goes on computing, as a phone's DMA
    /// would leave it (smaller ones it moves itself: waking a worker would cost it more);
    /// otherwise a worker issues and reads them.
    fn kick<'a>(&'a self, mut st: MutexGuard<'a, State>) {
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
    fn wait_step<'a>(
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

    fn wake_worker(&self, st: &State, now: Instant) {
        if st.idle_workers > 0 && st.worker_needed(now) {
            self.work.notify_one();
        }
    }

    fn work_loop(&self) {
        clock::precise_timers();
        let mut st = self.lock();
        while !st.shutdown {
            st = self.step(st, Role::Worker);
        }
    }

    /// Moves the bytes of a read issued and not moved yet, if there is one; else serves one
    /// pending read if a slot is free now; otherwise blocks until a slot frees (or, if nothing
    /// is pending or every slot is mid-read, until woken).
    fn step<'a>(&'a self, mut st: MutexGuard<'a, State>, role: Role) -> MutexGuard<'a, State> {
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
    fn block<'a>(
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
    fn sleep_until_slot_frees<'a>(
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
    fn serve<'a>(
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
    fn book(&self, st: &mut State, slot: usize, free_at: Instant, now: Instant) -> Booked {
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
    fn transfer<'a>(&'a self, st: MutexGuard<'a, State>, booked: Booked) -> MutexGuard<'a, State> {
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

    fn failure_context(&self, run: &Run, retries: u32) -> String {
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
fn read_with_retries(
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
