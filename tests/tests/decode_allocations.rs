//! The decode loop does not allocate: after a few tokens of warm-up, decoding a token through
//! `forward_into` makes no heap allocation on the decoding thread with every bundle resident
//! (model, engine, kernels, neuron cache); streaming under a budget where the dense weights stream
//! and FFN clusters are read, cached and evicted every token, what remains is the read queue's own
//! bookkeeping — B-tree nodes of its pending set (by priority and position, for merging), under
//! two allocations per submitted read. The same holds for a mixture of experts (the trained tiny
//! Qwen3-MoE): routing, the look-ahead after each attention and the experts run where they lie,
//! with every expert resident and with experts read and evicted every token. Counted by a global
//! allocator that counts the calls of the thread that asks (on an emulated device that thread also
//! issues the reads), and the read buffers the process maps (those bypass the allocator; printed,
//! not asserted, while streaming: at the minimum the dense weights' stream maps some).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;

use leanstream::model::kv_cache::KvType;
use leanstream::storage::AlignedBuf;
use leanstream::streaming::{experts, minimum_memory};
use leanstream::text::session::{PolicyChoice, Session, SessionOptions};
use leanstream::tokenizer::Tokenizer;
use leanstream_tests::converted::{convert, embedded, exact_options, heldout_ids, ufs4, workspace};
use leanstream_tests::scratch_dir;

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

fn open(file: &Path, policy: PolicyChoice, memory: Option<u64>) -> Session {
    Session::open(
        &SessionOptions::new(file, Some(policy))
            .memory(memory)
            .flash(memory.and(ufs4()))
            .ctx(CTX),
    )
    .unwrap()
}

/// Decodes `ids` one token at a time, counting from the `WARM_UP`th.
fn decode(mut s: Session, ids: &[u32]) -> Counts {
    let mut cache = s.model().new_cache(CTX);
    counted(&mut s, ids.len(), |s, i, logits| {
        s.model()
            .forward_into(&[ids[i]], &mut cache, false, logits)
            .unwrap();
    })
}

/// Runs `step(s, i, logits)` for `i` in `0..steps`, counting the allocations, mapped buffers and
/// reads of each from the `WARM_UP`th.
fn counted(
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

/// Asserts that `resident` decoded without allocating or mapping, and that each streamed run
/// gave its logits and stayed under two allocations per read.
fn check(resident: &Counts, streamed: &[(u64, Counts)]) {
    println!(
        "resident: (allocations, read buffers made) per token {:?}",
        resident.per_token
    );
    assert!(
        resident.per_token.iter().all(|&n| n == (0, 0)),
        "resident allocates while decoding: {:?}",
        resident.per_token
    );
    for (memory, run) in streamed {
        check_streamed(
            &format!("leanstream at {memory} bytes"),
            run,
            &resident.logits,
        );
    }
}

/// Asserts that the streamed `run` (`what`) gave the logits `want` and stayed under two
/// allocations per read.
fn check_streamed(what: &str, run: &Counts, want: &[f32]) {
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

#[test]
fn decoding_a_token_allocates_nothing_once_warm() {
    let file = embedded("q8");
    let f = leanstream_format::LsbFile::open(&file).unwrap();
    let min = minimum_memory(&file, CTX).unwrap();
    let ffn = f.ffn.bundle_bytes();
    let session = open(&file, PolicyChoice::Resident, None);
    let ids = heldout_ids(&session.tokenizer, WARM_UP + COUNTED);
    let resident = decode(session, &ids);
    let streamed: Vec<_> = [min, min + ffn / 4]
        .into_iter()
        .map(|m| {
            (
                m,
                decode(open(&file, PolicyChoice::Leanstream, Some(m)), &ids),
            )
        })
        .collect();
    check(&resident, &streamed);
}

#[test]
fn decoding_a_token_of_a_streamed_mixture_allocates_nothing_once_warm() {
    let dir = workspace().join("models/qwen3-moe-austen");
    let ids = heldout_ids(&Tokenizer::from_dir(&dir).unwrap(), WARM_UP + COUNTED);
    let file = scratch_dir("moe-allocations").join("qwen3-moe-austen.lsb");
    convert(&dir, &file, &["--quant", "q8"]);
    let session =
        |policy, memory| Session::open(&exact_options(&file, policy, memory, CTX)).unwrap();
    let resident = decode(session(PolicyChoice::Resident, None), &ids);
    let minimum = experts::minimum_memory(&file, CTX, KvType::F32).unwrap();
    let slot = session(PolicyChoice::Leanstream, None).report()["expert_split"]["expert_bytes"]
        .as_u64()
        .unwrap();
    let streamed: Vec<_> = [minimum, minimum + 8 * slot]
        .into_iter()
        .map(|m| (m, decode(session(PolicyChoice::Leanstream, Some(m)), &ids)))
        .collect();
    check(&resident, &streamed);
}

/// Rows decoded together in a batched step (a server's slots).
const ROWS: usize = 4;

/// Decodes `ROWS` sequences together with [`LanguageModel::forward_batch`], each after a prompt of
/// its own length (so the rows sit at different positions), counting from the `WARM_UP`th step;
/// `logits` are the last step's rows.
///
/// [`LanguageModel::forward_batch`]: leanstream::model::LanguageModel::forward_batch
fn decode_batched(mut s: Session, ids: &[u32]) -> Counts {
    let mut caches: Vec<_> = (0..ROWS).map(|_| s.model().new_cache(CTX)).collect();
    let mut logits = Vec::new();
    for (i, cache) in caches.iter_mut().enumerate() {
        s.model()
            .forward_into(&ids[..1 + i], cache, false, &mut logits)
            .unwrap();
    }
    let mut tokens = [0u32; ROWS];
    counted(&mut s, ids.len() - ROWS, |s, step, logits| {
        for (i, t) in tokens.iter_mut().enumerate() {
            *t = ids[1 + i + step];
        }
        let mut refs: [_; ROWS] = {
            let mut it = caches.iter_mut();
            std::array::from_fn(|_| it.next().unwrap())
        };
        s.model().forward_batch(&tokens, &mut refs, logits).unwrap();
    })
}

/// Each row of the last batched step, decoded alone by `s` (its prompt, then its tokens).
fn rows_alone(mut s: Session, ids: &[u32]) -> Vec<f32> {
    let mut out = Vec::new();
    let steps = ids.len() - ROWS;
    for i in 0..ROWS {
        let mut cache = s.model().new_cache(CTX);
        let mut logits = Vec::new();
        s.model()
            .forward_into(&ids[..1 + i], &mut cache, false, &mut logits)
            .unwrap();
        for &tok in &ids[1 + i..1 + i + steps] {
            s.model()
                .forward_into(&[tok], &mut cache, false, &mut logits)
                .unwrap();
        }
        out.extend_from_slice(&logits);
    }
    out
}

#[test]
fn a_batched_step_allocates_nothing_once_warm() {
    let file = embedded("q8");
    let f = leanstream_format::LsbFile::open(&file).unwrap();
    let min = minimum_memory(&file, CTX).unwrap();
    let ffn = f.ffn.bundle_bytes();
    let mut session = open(&file, PolicyChoice::Resident, None);
    let ids = heldout_ids(&session.tokenizer, ROWS + WARM_UP + COUNTED);
    // What the kernels allocate in a product of several rows (`RowStream::new`'s list of the
    // prepared rows): one for each of a layer's four attention projections, one for the head;
    // now and then one more on this thread, as the single-token test above also sees at times
    // (not the batched step's own).
    let lists = 4 * session.model().config().num_layers as u64 + 1;
    let alone = rows_alone(session, &ids);
    let resident = decode_batched(open(&file, PolicyChoice::Resident, None), &ids);
    println!(
        "resident, {ROWS} rows a step: (allocations, read buffers made) per step {:?}",
        resident.per_token
    );
    assert!(
        resident.logits == alone,
        "a batched step's rows equal decoding each alone"
    );
    assert!(
        resident.per_token.iter().all(|&(a, _)| a <= lists + 1)
            && resident
                .per_token
                .iter()
                .filter(|&&(a, _)| a > lists)
                .count()
                <= 2,
        "resident allocates in batched steps beyond the kernels' {lists} lists: {:?}",
        resident.per_token
    );
    for m in [min, min + ffn / 4] {
        let run = decode_batched(open(&file, PolicyChoice::Leanstream, Some(m)), &ids);
        check_streamed(
            &format!("leanstream at {m} bytes, {ROWS} rows a step"),
            &run,
            &alone,
        );
    }
}
