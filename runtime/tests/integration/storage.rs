//! Storage: the flash model's timing against its profile, the read queue's ordering, cancelling,
//! boosting, merging and error handling, and direct I/O bypassing the page cache.
//!
//! Timing tests hold `TIMING` so that they never run alongside each other on this small machine.

use std::collections::VecDeque;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use rand::{Rng, RngCore, SeedableRng};

use leanstream::storage::{
    open_device, AlignedBuf, Device, DirectDevice, FlashModel, FlashProfile, IoQueue,
    MAX_MERGE_BYTES,
};

const PAGE: usize = AlignedBuf::ALIGN;

static TIMING: Mutex<()> = Mutex::new(());

fn timing_lock() -> MutexGuard<'static, ()> {
    TIMING.lock().unwrap_or_else(|e| e.into_inner())
}

fn tmp(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("storage-{name}"))
}

/// A 64 MiB file of seeded random bytes (written once, kept for later runs), and its contents.
fn data_file() -> &'static (PathBuf, Vec<u8>) {
    static FILE: OnceLock<(PathBuf, Vec<u8>)> = OnceLock::new();
    FILE.get_or_init(|| {
        let path = tmp("data.bin");
        let mut bytes = vec![0u8; 64 << 20];
        rand::rngs::StdRng::seed_from_u64(7).fill_bytes(&mut bytes);
        if std::fs::read(&path).ok().as_ref() != Some(&bytes) {
            let partial = tmp(&format!("data-{}.part", std::process::id()));
            std::fs::write(&partial, &bytes).unwrap();
            std::fs::rename(&partial, &path).unwrap();
        }
        (path, bytes)
    })
}

fn ufs4_queue() -> IoQueue {
    let (path, _) = data_file();
    IoQueue::new(Arc::new(
        FlashModel::open(path, FlashProfile::ufs4()).unwrap(),
    ))
}

fn within(measured: f64, expected: f64, what: &str) {
    let err = measured / expected - 1.0;
    eprintln!(
        "{what}: {measured:.1} against {expected:.1} ({:+.1} %)",
        err * 100.0
    );
    assert!(
        err.abs() <= 0.10,
        "{what}: {measured:.1} is not within 10 % of {expected:.1}"
    );
}

/// Device reads per second of busy time (some read in flight) while `f` runs. On this shared
/// machine another process can stall the submitting thread and leave the emulated device idle:
/// busy time leaves those gaps out, so it measures the device rather than the host. Wall-clock
/// time only checks that the emulation is never faster than `expected` reads per second.
fn device_rate(queue: &IoQueue, expected: f64, f: impl FnOnce()) -> f64 {
    let before = queue.stats();
    let start = Instant::now();
    f();
    let wall = start.elapsed().as_secs_f64();
    let after = queue.stats();
    let reads = (after.device_reads - before.device_reads) as f64;
    let busy = (after.busy - before.busy).as_secs_f64();
    eprintln!("  {reads} reads: busy {busy:.3} s of {wall:.3} s");
    assert!(
        reads / wall <= 1.05 * expected,
        "{} reads/s is faster than the device",
        reads / wall
    );
    reads / busy
}

/// Reads `n` blocks of `len` bytes at random offsets that are multiples of `stride` (so never end
/// to end: no merging), keeping `qd` in flight and recycling the buffers as the engine's cache
/// does; returns reads per second of device busy time.
fn closed_loop(
    queue: &IoQueue,
    qd: usize,
    len: usize,
    stride: u64,
    n: usize,
    expected: f64,
) -> f64 {
    let slots = (64 << 20) / stride;
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut next = || rng.random_range(0..slots) * stride;
    device_rate(queue, expected, || {
        let mut in_flight: VecDeque<_> = (0..qd).map(|_| queue.submit(next(), len, 0)).collect();
        for i in 0..n {
            let buf = queue.wait(in_flight.pop_front().unwrap()).unwrap();
            if i + qd < n {
                in_flight.push_back(queue.submit_into(buf, next(), 0));
            }
        }
    })
}

#[test]
fn flash_model_qd1_latency_matches_ufs4() {
    let _t = timing_lock();
    let queue = ufs4_queue();
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    // One buffer reused throughout, as the engine's cache does, so that the allocator's work
    // (freeing and faulting in fresh pages) is not counted as device latency.
    let mut buf = Some(AlignedBuf::new(PAGE));
    let mut latencies: Vec<f64> = (0..2000)
        .map(|_| {
            let offset = rng.random_range(0..(64 << 20) / PAGE as u64) * PAGE as u64;
            let start = Instant::now();
            let ticket = queue.submit_into(buf.take().unwrap(), offset, 0);
            buf = Some(queue.wait(ticket).unwrap());
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    latencies.sort_by(f64::total_cmp);
    within(
        latencies[latencies.len() / 2],
        FlashProfile::ufs4().latency_us,
        "QD1 4 KiB latency (µs)",
    );
}

#[test]
fn flash_model_qd32_iops_matches_ufs4() {
    let _t = timing_lock();
    let queue = ufs4_queue();
    let expected = FlashProfile::ufs4().iops_4k;
    closed_loop(&queue, 32, PAGE, 2 * PAGE as u64, 2000, expected); // warm up
    let iops = closed_loop(&queue, 32, PAGE, 2 * PAGE as u64, 40_000, expected);
    within(iops, FlashProfile::ufs4().iops_4k, "QD32 4 KiB IOPS");
    assert_eq!(queue.stats().merged, 0);
}

#[test]
fn flash_model_keeps_its_iops_through_a_burst() {
    // All reads queued at once: most wait in the queue and are issued as slots free.
    let _t = timing_lock();
    let queue = ufs4_queue();
    let reads: Vec<_> = (0..20_000u64)
        .map(|i| ((i * 7919 % 8192) * 2 * PAGE as u64, PAGE, 0))
        .collect();
    let iops = device_rate(&queue, FlashProfile::ufs4().iops_4k, || {
        for ticket in queue.submit_batch(&reads) {
            queue.wait(ticket).unwrap();
        }
    });
    within(
        iops,
        FlashProfile::ufs4().iops_4k,
        "4 KiB IOPS of a 20 000-read burst",
    );
}

#[test]
fn queued_reads_progress_without_a_waiter() {
    // The waiter issues queued reads while it waits; once it leaves, the workers take over.
    let _t = timing_lock();
    let queue = ufs4_queue();
    let reads: Vec<_> = (0..500u64)
        .map(|i| (i * 2 * PAGE as u64, PAGE, 0))
        .collect();
    let tickets = queue.submit_batch(&reads);
    queue.wait(tickets[0]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    while !tickets.iter().all(|&t| queue.is_done(t)) {
        assert!(
            Instant::now() < deadline,
            "queued reads stalled: {:?}",
            queue.stats()
        );
        std::thread::sleep(Duration::from_micros(100));
    }
    assert_eq!(queue.stats().device_reads, 500);
}

#[test]
fn flash_model_512k_bandwidth_matches_ufs4() {
    let _t = timing_lock();
    let queue = ufs4_queue();
    let len = 512 << 10;
    let expected = FlashProfile::ufs4().bandwidth_mb_s * 1e6 / len as f64;
    closed_loop(&queue, 32, len, 1 << 20, 100, expected); // warm up
    let mb_s = closed_loop(&queue, 32, len, 1 << 20, 2000, expected) * len as f64 / 1e6;
    within(
        mb_s,
        FlashProfile::ufs4().bandwidth_mb_s,
        "512 KiB bandwidth (MB/s)",
    );
}

#[test]
fn flash_model_completes_no_earlier_than_its_latency() {
    let _t = timing_lock();
    let queue = ufs4_queue();
    for _ in 0..20 {
        let start = Instant::now();
        let ticket = queue.submit(0, PAGE, 0);
        assert!(!queue.is_done(ticket) || start.elapsed() >= Duration::from_micros(60));
        while !queue.is_done(ticket) {
            std::hint::spin_loop();
        }
        assert!(start.elapsed() >= Duration::from_micros(60));
        queue.wait(ticket).unwrap();
    }
    let ticket = queue.submit(0, PAGE, 0);
    while !queue.is_done(ticket) {
        std::hint::spin_loop();
    }
    let bytes = queue.poll(ticket).unwrap().unwrap();
    assert_eq!(&bytes[..], &data_file().1[..PAGE]);
    assert!(
        queue.poll(ticket).unwrap().is_err(),
        "a ticket is redeemed once"
    );
}

/// An in-memory device with one slot that holds its first read until released, logs the offsets
/// it reads and fails as told.
struct TestDevice {
    data: Vec<u8>,
    gate: Mutex<bool>,
    opened: Condvar,
    log: Mutex<Vec<(u64, usize)>>,
    /// Reads at or past this offset fail with EIO.
    bad_from: u64,
    /// Transient failures still to give (EINTR, then a short read, then EAGAIN, in turn).
    transient: AtomicU32,
}

impl TestDevice {
    fn new(pages: usize) -> Arc<Self> {
        let data = (0..pages * PAGE)
            .map(|i| (i / PAGE * 31 + i % 251) as u8)
            .collect();
        Arc::new(Self {
            data,
            gate: Mutex::new(false),
            opened: Condvar::new(),
            log: Mutex::new(Vec::new()),
            bad_from: u64::MAX,
            transient: AtomicU32::new(0),
        })
    }

    fn release(&self) {
        *self.gate.lock().unwrap() = true;
        self.opened.notify_all();
    }

    fn offsets(&self) -> Vec<u64> {
        self.log.lock().unwrap().iter().map(|r| r.0).collect()
    }

    /// Waits until the device has started `n` reads.
    fn started(&self, n: usize) {
        while self.log.lock().unwrap().len() < n {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Device for TestDevice {
    fn read_at(&self, offset: u64, buf: &mut AlignedBuf) -> io::Result<()> {
        self.log.lock().unwrap().push((offset, buf.len()));
        let mut open = self.gate.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
        drop(open);
        let left = self.transient.load(Ordering::SeqCst);
        if left > 0 {
            self.transient.store(left - 1, Ordering::SeqCst);
            let kind = [
                io::ErrorKind::WouldBlock,
                io::ErrorKind::UnexpectedEof,
                io::ErrorKind::Interrupted,
            ];
            return Err(io::Error::new(kind[left as usize % 3], "transient"));
        }
        if offset + buf.len() as u64 > self.bad_from {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        let (start, len) = (offset as usize, buf.len());
        buf.copy_from_slice(&self.data[start..start + len]);
        Ok(())
    }

    fn queue_depth(&self) -> usize {
        1
    }

    fn name(&self) -> String {
        "test device".into()
    }
}

/// The device is busy with a read of page 0 when this returns.
fn blocked_queue(device: &Arc<TestDevice>) -> (IoQueue, leanstream::storage::Ticket) {
    let queue = IoQueue::new(device.clone());
    let blocker = queue.submit(0, PAGE, 0);
    device.started(1);
    (queue, blocker)
}

fn page(i: u64) -> u64 {
    i * PAGE as u64
}

#[test]
fn priority_order_is_honoured() {
    let device = TestDevice::new(64);
    let (queue, blocker) = blocked_queue(&device);
    let low = queue.submit(page(10), PAGE, 1);
    let high = queue.submit(page(20), PAGE, 9);
    let mid = queue.submit(page(30), PAGE, 5);
    let mid2 = queue.submit(page(40), PAGE, 5);
    std::thread::sleep(Duration::from_millis(20));
    device.release();
    for t in [blocker, low, high, mid, mid2] {
        queue.wait(t).unwrap();
    }
    assert_eq!(
        device.offsets(),
        [0, page(20), page(30), page(40), page(10)]
    );
    // The device was busy at least while it held the first read.
    let stats = queue.stats();
    assert!(stats.busy >= Duration::from_millis(20), "{stats:?}");
    assert!(stats.busy <= stats.elapsed && stats.io_busy_fraction() <= 1.0);
}

#[test]
fn watched_reads_done_before_the_watch_come_in_completion_order() {
    let device = TestDevice::new(64);
    let (queue, blocker) = blocked_queue(&device);
    let late = queue.submit(page(10), PAGE, 1);
    let early = queue.submit(page(20), PAGE, 9);
    device.release();
    // Both done before anyone asks: the one that completed first still comes first, although
    // it is listed second.
    while !(queue.is_done(late) && queue.is_done(early)) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(device.offsets(), [0, page(20), page(10)]);
    queue.watch_all([(late, 0), (early, 1)]);
    let (tag, buf, _) = queue.wait_watched().unwrap();
    assert_eq!(tag, 1);
    assert_eq!(&buf.unwrap()[..], &device.data[page(20) as usize..][..PAGE]);
    queue.watch_all([(late, 0), (blocker, 1)]);
    let (tag, buf, _) = queue.wait_watched().unwrap();
    assert_eq!(tag, 1, "the blocker completed before both");
    assert_eq!(&buf.unwrap()[..], &device.data[..PAGE]);
    let (tag, buf, _) = queue.wait_watched().unwrap();
    assert_eq!(tag, 0);
    assert_eq!(&buf.unwrap()[..], &device.data[page(10) as usize..][..PAGE]);
    // A redeemed ticket is left out of a watch set, and `wait` names it as unknown.
    queue.watch_all([(late, 0)]);
    assert!(queue.wait_watched().is_none());
    assert_eq!(
        queue.wait(late).unwrap_err().kind(),
        io::ErrorKind::InvalidInput
    );
}

#[test]
fn watched_reads_come_in_completion_order_with_their_hashes() {
    let device = TestDevice::new(64);
    let (queue, blocker) = blocked_queue(&device);
    let bufs = [10u64, 20, 30].map(|_| AlignedBuf::new(PAGE));
    let mut tickets = Vec::new();
    let reads = bufs
        .into_iter()
        .zip([(page(10), 1), (page(20), 9), (page(30), 5)])
        .map(|(b, (offset, priority))| (b, offset, priority));
    queue.submit_batch_into(reads, &mut tickets, true);
    // Watched under tags 100, 200, 300; the first is also redeemed by `wait` before its turn.
    queue.watch_all(tickets.iter().zip([100, 200, 300]).map(|(&t, g)| (t, g)));
    device.release();
    queue.wait(blocker).unwrap();
    let data = |p: u64| &device.data[page(p) as usize..][..PAGE];
    let mut order = Vec::new();
    while let Some((tag, buf, hash)) = queue.wait_watched() {
        let buf = buf.unwrap();
        let p = u64::from(tag / 10);
        assert_eq!(&buf[..], data(p));
        assert_eq!(hash, Some(leanstream_format::container::checksum(data(p))));
        order.push(tag);
        if order.len() == 1 {
            assert_eq!(queue.wait(tickets[0]).unwrap()[..], *data(10));
        }
    }
    // Most urgent first (the device serves one read at a time); the redeemed one is skipped.
    assert_eq!(order, [200, 300]);
    assert_eq!(device.offsets(), [0, page(20), page(30), page(10)]);
    // Without `hash`, no hash; a new watch set replaces the old.
    let mut plain = Vec::new();
    queue.submit_batch_into([(AlignedBuf::new(PAGE), page(5), 1)], &mut plain, false);
    queue.watch_all([(plain[0], 7)]);
    let (tag, buf, hash) = queue.wait_watched().unwrap();
    assert_eq!((tag, hash), (7, None));
    assert_eq!(&buf.unwrap()[..], data(5));
    assert!(queue.wait_watched().is_none());
}

#[test]
fn watched_reads_arrive_from_the_flash_model_checked() {
    let _t = timing_lock();
    let (_, bytes) = data_file();
    let queue = ufs4_queue();
    let offsets: Vec<u64> = (0..64).map(|i| i * 37 * PAGE as u64).collect();
    let mut tickets = Vec::new();
    let reads = offsets.iter().map(|&o| (AlignedBuf::new(2 * PAGE), o, 1));
    queue.submit_batch_into(reads, &mut tickets, true);
    queue.watch_all(tickets.iter().enumerate().map(|(i, &t)| (t, i as u32)));
    let mut seen = vec![false; offsets.len()];
    while let Some((tag, buf, hash)) = queue.wait_watched() {
        let o = offsets[tag as usize] as usize;
        let want = &bytes[o..o + 2 * PAGE];
        assert_eq!(&buf.unwrap()[..], want);
        assert_eq!(hash, Some(leanstream_format::container::checksum(want)));
        assert!(!std::mem::replace(&mut seen[tag as usize], true));
    }
    assert!(seen.iter().all(|&s| s));
}

#[test]
fn cancel_prevents_the_read() {
    let device = TestDevice::new(64);
    let (queue, blocker) = blocked_queue(&device);
    let doomed = queue.submit(page(10), PAGE, 5);
    let kept = queue.submit(page(20), PAGE, 1);
    assert!(queue.cancel(doomed));
    assert!(!queue.cancel(doomed), "a second cancel finds nothing");
    assert!(!queue.cancel(blocker), "an issued read cannot be cancelled");
    device.release();
    queue.wait(kept).unwrap();
    queue.wait(blocker).unwrap();
    let err = queue.wait(doomed).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    assert_eq!(device.offsets(), [0, page(20)]);
    assert_eq!(queue.stats().cancelled, 1);
}

#[test]
fn background_reads_leave_slots_to_urgent_ones() {
    // A slow device (100 ms per read, 8 slots) so that nothing completes during the test.
    let (path, _) = data_file();
    let slow =
        "name = \"slow\"\nlatency_us = 100000\niops_4k = 10\nbandwidth_mb_s = 1\nqueue_depth = 8\n";
    let profile = FlashProfile::from_toml(slow).unwrap();
    let queue = IoQueue::new(Arc::new(FlashModel::open(path, profile).unwrap()));
    queue.limit_background(100, 2);
    let guesses: Vec<_> = (0..6u64).map(|i| queue.submit(page(i), PAGE, 1)).collect();
    let urgent: Vec<_> = (0..3u64)
        .map(|i| queue.submit(page(10 + i), PAGE, 100))
        .collect();
    // Two guesses went to the device; the other four still wait and can be withdrawn; the
    // urgent reads found free slots at once although guesses were queued first.
    let cancelled = guesses.iter().filter(|&&t| queue.cancel(t)).count();
    assert_eq!(cancelled, 4);
    assert!(
        urgent.iter().all(|&t| !queue.cancel(t)),
        "urgent reads were issued"
    );
    for t in urgent.into_iter().chain(guesses[..2].iter().copied()) {
        queue.wait(t).unwrap();
    }
    assert_eq!(queue.stats().device_reads, 5);
}

#[test]
fn boost_reorders() {
    let device = TestDevice::new(64);
    let (queue, blocker) = blocked_queue(&device);
    let a = queue.submit(page(10), PAGE, 1);
    let b = queue.submit(page(20), PAGE, 2);
    assert!(queue.boost(a, 3));
    assert!(!queue.boost(blocker, 9), "an issued read cannot be boosted");
    device.release();
    for t in [a, b, blocker] {
        queue.wait(t).unwrap();
    }
    assert_eq!(device.offsets(), [0, page(10), page(20)]);
}

#[test]
fn adjacent_reads_merge_and_split_back() {
    let device = TestDevice::new(1024);
    let (queue, blocker) = blocked_queue(&device);
    // Pages 10..14 out of order with mixed sizes, a gap, then a run longer than the merge bound.
    let parts = [(12, 2), (10, 1), (11, 1), (14, 1), (16, 1)];
    let mut tickets: Vec<_> = parts
        .iter()
        .map(|&(p, n)| ((p, n), queue.submit(page(p), n * PAGE, 0)))
        .collect();
    let big = MAX_MERGE_BYTES / PAGE / 2;
    for i in 0..3 {
        let p = 100 + (i * big) as u64;
        tickets.push(((p, big), queue.submit(page(p), big * PAGE, 0)));
    }
    device.release();
    queue.wait(blocker).unwrap();
    for ((p, n), t) in tickets {
        let bytes = queue.wait(t).unwrap();
        let start = page(p) as usize;
        assert_eq!(
            &bytes[..],
            &device.data[start..start + n * PAGE],
            "page {p}"
        );
    }
    let log = device.log.lock().unwrap().clone();
    assert!(log.contains(&(page(10), 5 * PAGE)), "{log:?}");
    assert!(log.contains(&(page(16), PAGE)), "{log:?}");
    assert!(
        log.iter().all(|&(_, len)| len <= MAX_MERGE_BYTES),
        "{log:?}"
    );
    let stats = queue.stats();
    assert_eq!(stats.submitted, 9);
    assert_eq!(stats.device_reads as usize, log.len());
    assert_eq!(stats.merged, 9 - log.len() as u64);
}

#[test]
fn reads_return_the_files_bytes_through_both_devices() {
    let _t = timing_lock();
    let (path, bytes) = data_file();
    for flash in [None, Some(FlashProfile::ufs4())] {
        let queue = IoQueue::new(open_device(path, flash).unwrap());
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut tickets = Vec::new();
        for _ in 0..300 {
            // Batches of 1–4 adjacent reads of 1–8 pages, so that some merge.
            let mut offset = rng.random_range(0..(60 << 20) / PAGE as u64) * PAGE as u64;
            let mut batch = Vec::new();
            for _ in 0..rng.random_range(1..=4) {
                let len = rng.random_range(1..=8) * PAGE;
                batch.push((offset, len, rng.random_range(0..4)));
                offset += len as u64;
            }
            let issued = queue.submit_batch(&batch);
            tickets.extend(batch.iter().zip(issued).map(|(&(o, l, _), t)| (o, l, t)));
        }
        for (offset, len, t) in tickets {
            let got = queue.wait(t).unwrap();
            assert!(
                got[..] == bytes[offset as usize..offset as usize + len],
                "{offset}+{len}"
            );
        }
        let stats = queue.stats();
        assert!(
            stats.merged > 0,
            "{} merged nothing: {stats:?}",
            queue.device().name()
        );
    }
}

#[test]
fn direct_reads_leave_nothing_in_the_page_cache() {
    use leanstream::storage::page_cache::{evict, resident_pages};
    let path = tmp(&format!("cold-{}.bin", std::process::id()));
    let mut bytes = vec![0u8; 8 << 20];
    rand::rngs::StdRng::seed_from_u64(9).fill_bytes(&mut bytes);
    std::fs::write(&path, &bytes).unwrap();
    evict(&path).unwrap();
    let (before, pages) = resident_pages(&path).unwrap();
    assert_eq!(pages, bytes.len() / PAGE);
    assert_eq!(before, 0, "eviction left pages cached");

    let queue = IoQueue::new(Arc::new(DirectDevice::open(&path, 8).unwrap()));
    let tickets: Vec<_> = (0..pages as u64)
        .step_by(4)
        .map(|p| (p, queue.submit(page(p), 4 * PAGE, 0)))
        .collect();
    for (p, t) in tickets {
        let start = page(p) as usize;
        assert!(queue.wait(t).unwrap()[..] == bytes[start..start + 4 * PAGE]);
    }
    assert_eq!(queue.stats().bytes_read, bytes.len() as u64);
    assert_eq!(
        resident_pages(&path).unwrap().0,
        0,
        "direct reads entered the page cache"
    );

    // The check can see cached pages: a buffered read fills the cache.
    std::fs::read(&path).unwrap();
    assert!(resident_pages(&path).unwrap().0 > pages / 2);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn transient_failures_are_retried() {
    let device = TestDevice::new(64);
    device.transient.store(3, Ordering::SeqCst);
    let (queue, blocker) = blocked_queue(&device);
    device.release();
    assert_eq!(&queue.wait(blocker).unwrap()[..], &device.data[..PAGE]);
    assert_eq!(queue.stats().retries, 3);
}

#[test]
fn persistent_failures_surface_with_device_and_offset() {
    let mut device = TestDevice::new(64);
    Arc::get_mut(&mut device).unwrap().bad_from = page(32);
    device.release();
    let queue = IoQueue::new(device.clone());
    let bad = queue.submit(page(40), PAGE, 0);
    let good = queue.submit(page(8), PAGE, 0);
    let err = queue.wait(bad).unwrap_err();
    assert_eq!(err.raw_os_error(), None, "wrapped with context");
    let msg = err.to_string();
    assert!(
        msg.contains("test device") && msg.contains(&page(40).to_string()),
        "{msg}"
    );
    assert!(queue.wait(good).is_ok());
    let misaligned = queue.submit(100, PAGE, 0);
    assert_eq!(
        queue.wait(misaligned).unwrap_err().kind(),
        io::ErrorKind::InvalidInput
    );
    assert_eq!(queue.stats().failed, 2);
}

#[test]
fn short_reads_are_errors_naming_the_file() {
    let path = tmp(&format!("short-{}.bin", std::process::id()));
    std::fs::write(&path, vec![1u8; 3 * PAGE]).unwrap();
    let device = DirectDevice::open(&path, 1).unwrap();
    let mut buf = AlignedBuf::new(4 * PAGE);
    let err = device.read_at(0, &mut buf).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    let msg = err.to_string();
    assert!(msg.contains("short-") && msg.contains("offset 0"), "{msg}");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn probe_flash_writes_a_loadable_profile() {
    let _t = timing_lock();
    let out = tmp(&format!("probe-{}.toml", std::process::id()));
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .args([
            "probe-flash",
            env!("CARGO_TARGET_TMPDIR"),
            "--seconds",
            "0.7",
            "--size-mib",
            "16",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let profile = FlashProfile::load(&out).unwrap();
    assert!(
        profile.latency_us > 0.0 && profile.iops_4k > 0.0,
        "{profile:?}"
    );
    let leftovers = std::fs::read_dir(env!("CARGO_TARGET_TMPDIR"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(".leanstream-probe")
        })
        .count();
    assert_eq!(leftovers, 0, "the probe's temporary file was left behind");
    // An existing profile is the user's: refused (before measuring) unless --force.
    let again = std::process::Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .args(["probe-flash", env!("CARGO_TARGET_TMPDIR"), "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&again.stderr);
    assert_eq!(again.status.code(), Some(1), "{err}");
    assert!(
        err.contains("already exists") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(FlashProfile::load(&out).unwrap(), profile);
    std::fs::remove_file(&out).unwrap();
}
