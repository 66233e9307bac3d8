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

mod worker;

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
