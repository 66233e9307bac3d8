//! What the allocation tests share: a global allocator that counts the calls of the thread that
//! asks, and the loop that counts each decoding step's allocations, mapped read buffers and reads.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;

use leanstream::storage::AlignedBuf;
use leanstream::streaming::minimum_memory;
use leanstream::text::session::{PolicyChoice, Session};
use leanstream_tests::converted::{session_options, ufs4};

thread_local! {
    /// Allocations (and reallocations) made by this thread.
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

struct Counting;

fn count() {
    // `try_with`: a thread being torn down may still free and allocate.
    let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: every call is forwarded unchanged to the system allocator; counting touches only a
// const-initialised thread-local `Cell`, which itself never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

pub fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

pub const CTX: usize = 64;
pub const WARM_UP: usize = 8;
pub const COUNTED: usize = 24;

/// What decoding after warm-up cost.
pub struct Counts {
    /// Per token: heap allocations of this thread, and read buffers mapped by the process.
    pub per_token: Vec<(u64, u64)>,
    /// Reads submitted to the queue meanwhile.
    pub reads: u64,
    /// The last token's logits (to compare the policies).
    pub logits: Vec<f32>,
}

/// A session of `file` at context `CTX`: everything resident unless `memory` is given, then on
/// emulated UFS 4.0.
pub fn open(file: &Path, policy: PolicyChoice, memory: Option<u64>) -> Session {
    let options = session_options(file, policy, memory, CTX).flash(memory.and(ufs4()));
    Session::open(&options).unwrap()
}

/// Runs `step(s, i, logits)` for `i` in `0..steps`, counting the allocations, mapped buffers and
/// reads of each from the `WARM_UP`th.
pub fn counted(
    s: &mut Session,
    steps: usize,
    mut step: impl FnMut(&mut Session, usize, &mut Vec<f32>),
) -> Counts {
    let submitted = |s: &Session| s.io().map_or(0, |q| q.stats().submitted);
    let mut logits = Vec::new();
    let (mut per_token, mut reads) = (Vec::new(), 0);
    for i in 0..steps {
        let read_before = submitted(s);
        let (before, mapped) = (allocations(), AlignedBuf::made());
        step(s, i, &mut logits);
        if i >= WARM_UP {
            per_token.push((allocations() - before, AlignedBuf::made() - mapped));
            reads += submitted(s) - read_before;
        }
    }
    Counts {
        per_token,
        reads,
        logits,
    }
}

/// Asserts that the streamed `run` (`what`) gave the logits `want` and stayed under two
/// allocations per read.
pub fn check_streamed(what: &str, run: &Counts, want: &[f32]) {
    let allocated: u64 = run.per_token.iter().map(|n| n.0).sum();
    println!(
        "{what}: (allocations, read buffers made) per step {:?}; {allocated} allocations for {} \
         reads",
        run.per_token, run.reads
    );
    assert!(
        run.logits == want,
        "{what}: exact streaming equals resident"
    );
    assert!(run.reads > 0, "{what}: the budget makes it read");
    assert!(
        allocated < 2 * run.reads,
        "{what}: {allocated} allocations for {} reads",
        run.reads
    );
}

/// The budgets the streamed runs decode under: the minimum, where the dense weights stream too,
/// and a quarter of the FFN bundles more.
pub fn budgets(file: &Path) -> [u64; 2] {
    let min = minimum_memory(file, CTX).unwrap();
    let ffn = leanstream_format::LsbFile::open(file)
        .unwrap()
        .ffn
        .bundle_bytes();
    [min, min + ffn / 4]
}
