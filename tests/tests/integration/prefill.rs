//! A prompt's logits do not depend on how it is split into chunks or on the thread count: the
//! same prompt at 1 and 3 threads, fed in chunks of 16 and in one chunk of 256 (a prompt of that
//! length is one chunk of `run`), gives the same bits — dense, resident and certified streaming
//! with part of the FFN on flash — on the embedded ReLU model (q8) and on a SwiGLU model in 4-bit
//! (the prompt chunk's mat-mats on the integer kernels, the bundle FFN's rows shared among
//! threads).

use std::path::Path;

use leanstream::text::session::{PolicyChoice, Session, SessionOptions};
use leanstream_tests::converted::{convert_tiny, embedded, heldout_ids, ufs4};
use leanstream_tests::tiny::{random_ids, TinySpec};

const CTX: usize = 320;

/// The last position's logits after every chunk of `ids` (`chunk` tokens each) with `policy` on
/// `threads` threads: one row per chunk.
fn chunked(
    file: &Path,
    policy: PolicyChoice,
    memory: Option<u64>,
    threads: usize,
    ids: &[u32],
    chunk: usize,
) -> Vec<f32> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        let mut s = Session::open(
            &SessionOptions::new(file, Some(policy))
                .memory(memory)
                .flash(memory.and(ufs4()))
                .ctx(CTX),
        )
        .unwrap();
        let model = s.model();
        let mut cache = model.new_cache(CTX);
        let mut last = Vec::new();
        for c in ids.chunks(chunk) {
            last = model.forward(c, &mut cache, false).unwrap();
        }
        last
    })
}

fn assert_bitwise(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    assert!(!a.is_empty() && a.iter().all(|v| v.is_finite()), "{what}");
    let differ = a
        .iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    assert_eq!(differ, 0, "{what}: {differ} of {} logits differ", a.len());
}

/// 1 thread and chunks of 16 against 3 threads and chunks of 16, and both thread counts in one
/// chunk of 256; each policy, and certified streaming against resident.
fn chunking_and_threads_keep_the_bits(file: &Path, ids: &[u32]) {
    assert!(ids.len() > 16 * 4 && ids.len() <= 256, "{} ids", ids.len());
    let min = leanstream::streaming::minimum_memory(file, CTX).unwrap();
    let ffn = leanstream_format::LsbFile::open(file)
        .unwrap()
        .ffn
        .bundle_bytes();
    let mut resident = None;
    for (policy, memory) in [
        (PolicyChoice::Dense, None),
        (PolicyChoice::Resident, None),
        (PolicyChoice::Leanstream, Some(min + ffn / 3)),
    ] {
        let base = chunked(file, policy, memory, 1, ids, 16);
        for (threads, chunk) in [(3, 16), (1, 256), (3, 256)] {
            let got = chunked(file, policy, memory, threads, ids, chunk);
            let what = format!("{policy:?}, {threads} threads, chunks of {chunk}");
            assert_bitwise(&what, &got, &base);
        }
        match policy {
            PolicyChoice::Resident => resident = Some(base),
            PolicyChoice::Leanstream => {
                assert_bitwise("leanstream vs resident", &base, resident.as_ref().unwrap())
            }
            _ => {}
        }
    }
}

#[test]
fn embedded_model_prompt_bits_ignore_chunking_and_threads() {
    let file = embedded("q8");
    let tokenizer = Session::open(&SessionOptions::new(&file, Some(PolicyChoice::Resident)))
        .unwrap()
        .tokenizer;
    chunking_and_threads_keep_the_bits(&file, &heldout_ids(&tokenizer, 150));
}

#[test]
fn swiglu_q4_prompt_bits_ignore_chunking_and_threads() {
    let spec = TinySpec {
        hidden: 128,
        intermediate: 1024,
        heads: 8,
        kv_heads: 4,
        ..TinySpec::llama()
    };
    let file = convert_tiny(
        "tiny-silu-q4-prefill",
        &spec,
        &["--quant", "q4_1", "--sparsity", "threshold:0.5"],
    );
    chunking_and_threads_keep_the_bits(&file, &random_ids(7, 120, spec.vocab));
}
