//! The compact tokenizer's resident size for SmolLM2's 49k vocabulary, counted by the allocator
//! after it tokenized a long text (so any cache that grows with use would be counted): at most
//! 3 MiB, and equal to what it reports for the memory planner. The `tokenizers` crate's parse of the
//! same `tokenizer.json` is measured alongside, for the record. One test in this binary: the
//! counter is process-wide.

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use leanstream::source::gguf::GgufFile;
use leanstream::tokenizer::gguf as gguf_tokenizer;
use leanstream::tokenizer::{bpe_vocab, Tokenizer};
use leanstream_format::bpe_vocab::BpeVocab;

/// Bytes allocated and not yet freed.
static LIVE: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: every call is forwarded unchanged to the system allocator; only a counter is updated.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const MIB: f64 = (1 << 20) as f64;

/// Live bytes `make` leaves behind once the tokenizer it returns has encoded and decoded `text`.
fn resident(make: impl FnOnce() -> Tokenizer, text: &str) -> (Tokenizer, usize) {
    let before = LIVE.load(Ordering::SeqCst);
    let tokenizer = make();
    let ids = tokenizer.encode(text, true).unwrap();
    assert!(ids.len() > 10_000);
    drop(tokenizer.decode(&ids).unwrap());
    drop(ids);
    let after = LIVE.load(Ordering::SeqCst);
    (tokenizer, (after - before) as usize)
}

#[test]
fn smollm2_compact_tokenizer_holds_at_most_3_mib_after_use() {
    let gguf = gguf_tokenizer::from_gguf(&GgufFile::open(&support::smollm2()).unwrap()).unwrap();
    let json = gguf.tokenizer.to_json().unwrap();
    drop(gguf);
    let section = bpe_vocab(&json).unwrap().encode();
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/heldout.txt"),
    )
    .unwrap();

    let (compact, bytes) = resident(
        || Tokenizer::compact(BpeVocab::from_bytes(&section).unwrap()),
        &text,
    );
    let reported = compact.compact_bytes().unwrap();
    let (_, parsed) = resident(|| Tokenizer::from_bytes(&json).unwrap(), &text);
    eprintln!(
        "SmolLM2 tokenizer after {} bytes of text: compact {:.2} MiB (reports {:.2} MiB; \
         section {:.2} MiB), tokenizer.json parsed {:.2} MiB (JSON {:.2} MiB)",
        text.len(),
        bytes as f64 / MIB,
        reported as f64 / MIB,
        section.len() as f64 / MIB,
        parsed as f64 / MIB,
        json.len() as f64 / MIB
    );
    assert!(
        bytes as f64 <= 3.0 * MIB,
        "compact tokenizer holds {bytes} B"
    );
    // What it reports (the planner's figure) covers what it holds, within the allocations'
    // bookkeeping that the tables' `Vec`s and the `Arc` add.
    assert!(
        bytes <= reported + 4096 && reported <= bytes + 64 * 1024,
        "reports {reported} B, holds {bytes} B"
    );
    assert!(
        parsed > 4 * bytes,
        "the parsed tokenizer.json holds {parsed} B"
    );
}
