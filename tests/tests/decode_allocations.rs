//! The decode loop does not allocate: after a few tokens of warm-up, decoding a token through
//! `forward_into` makes no heap allocation on the decoding thread with every bundle resident
//! (model, engine, kernels, neuron cache); streaming under a budget where the dense weights stream
//! and FFN clusters are read, cached and evicted every token, what remains is the read queue's own
//! bookkeeping — B-tree nodes of its pending set (by priority and position, for merging), under
//! two allocations per submitted read. Counted by a global allocator that counts the calls of the
//! thread that asks (on an emulated device that thread also issues the reads), and the read
//! buffers the process maps (those bypass the allocator).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;

use leanstream::session::{PolicyChoice, Session, SessionOptions};
use leanstream::storage::{AlignedBuf, FlashProfile};
use leanstream::streaming::{minimum_memory, Sparsity, Tuning};
use leanstream_tests::converted::{embedded, heldout_ids};

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

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

const CTX: usize = 64;
const WARM_UP: usize = 8;
const COUNTED: usize = 24;

/// What decoding after warm-up cost.
struct Counts {
    /// Per token: heap allocations of this thread, and read buffers mapped by the process.
    per_token: Vec<(u64, u64)>,
    /// Reads submitted to the queue meanwhile.
    reads: u64,
    /// The last token's logits (to compare the policies).
    logits: Vec<f32>,
}

fn decode(file: &Path, policy: PolicyChoice, memory: Option<u64>) -> Counts {
    let mut s = Session::open(&SessionOptions {
        model: file.to_path_buf(),
        policy: Some(policy),
        memory,
        flash: if memory.is_some() {
            FlashProfile::from_flash_arg("ufs4").unwrap()
        } else {
            None
        },
        sparsity: Sparsity::Certified,
        ctx: Some(CTX),
        default_ctx: CTX,
        kv: Default::default(),
        tuning: Tuning::default(),
    })
    .unwrap();
    let ids = heldout_ids(&s.tokenizer, WARM_UP + COUNTED);
    let submitted = |s: &Session| s.io().map_or(0, |q| q.stats().submitted);
    let mut cache = s.model().new_cache(CTX);
    let mut logits = Vec::new();
    let (mut per_token, mut reads) = (Vec::new(), 0);
    for (i, &tok) in ids.iter().enumerate() {
        let read_before = submitted(&s);
        let (before, mapped) = (allocations(), AlignedBuf::made());
        s.model()
            .forward_into(&[tok], &mut cache, false, &mut logits)
            .unwrap();
        if i >= WARM_UP {
            per_token.push((allocations() - before, AlignedBuf::made() - mapped));
            reads += submitted(&s) - read_before;
        }
    }
    Counts {
        per_token,
        reads,
        logits,
    }
}

#[test]
fn decoding_a_token_allocates_nothing_once_warm() {
    let file = embedded("q8");
    let f = leanstream_format::LsbFile::open(&file).unwrap();
    let min = minimum_memory(&file, CTX).unwrap();
    let ffn = f.ffn.bundle_bytes();
    let resident = decode(&file, PolicyChoice::Resident, None);
    println!(
        "resident: (allocations, read buffers made) per token {:?}",
        resident.per_token
    );
    assert!(
        resident.per_token.iter().all(|&n| n == (0, 0)),
        "resident allocates while decoding: {:?}",
        resident.per_token
    );
    for memory in [min, min + ffn / 4] {
        let streamed = decode(&file, PolicyChoice::Leanstream, Some(memory));
        let allocated: u64 = streamed.per_token.iter().map(|n| n.0).sum();
        println!(
            "leanstream at {memory} bytes: (allocations, read buffers made) per token {:?}; \
             {allocated} allocations for {} reads",
            streamed.per_token, streamed.reads
        );
        assert_eq!(
            streamed.logits, resident.logits,
            "certified streaming equals resident"
        );
        assert!(streamed.reads > 0, "the budget makes it read");
        assert!(
            allocated < 2 * streamed.reads,
            "leanstream at {memory} bytes: {allocated} allocations for {} reads",
            streamed.reads
        );
    }
}
