//! `--threads N` changes who computes, never what: a layer's bundle FFN is split across threads by
//! its fixed reduction groups and the dense mat-vecs by rows, so logits at 2 threads are bitwise
//! those at 1, and certified streaming at 2 threads bitwise `resident` at 1 — on the embedded ReLU
//! model and on a SwiGLU model with a calibrated threshold, decoding and in a prompt chunk.
//! (This machine's 2 vCPUs act as about one core: the test checks the bits, not the speed.)

use std::path::Path;

use leanstream::kernels::bundles::PARALLEL_MIN_BYTES;
use leanstream::text::session::{PolicyChoice, Session, SessionOptions};
use leanstream_tests::converted::{convert_tiny, embedded, heldout_ids, ufs4};
use leanstream_tests::tiny::{random_ids, TinySpec};

const CTX: usize = 128;

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

/// A session of `file` (everything resident unless `memory` is given: then on emulated UFS 4.0).
fn open(file: &Path, policy: PolicyChoice, memory: Option<u64>) -> Session {
    Session::open(
        &SessionOptions::new(file, Some(policy))
            .memory(memory)
            .flash(memory.and(ufs4()))
            .ctx(CTX),
    )
    .unwrap()
}

/// Logits of `ids` with `policy` on `threads` threads: decoded one token at a time, then the same
/// tokens as one prompt chunk (both rows of every position).
fn logits(
    file: &Path,
    policy: PolicyChoice,
    memory: Option<u64>,
    threads: usize,
    ids: &[u32],
) -> (Vec<f32>, Vec<f32>) {
    pool(threads).install(|| {
        let mut s = open(file, policy, memory);
        assert_eq!(rayon::current_num_threads(), threads);
        let model = s.model();
        let mut cache = model.new_cache(CTX);
        let decoded = ids
            .iter()
            .flat_map(|&t| model.forward(&[t], &mut cache, true).unwrap())
            .collect();
        let mut cache = model.new_cache(CTX);
        let chunk = model.forward(ids, &mut cache, true).unwrap();
        (decoded, chunk)
    })
}

fn assert_bitwise(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let differ = a
        .iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    assert_eq!(differ, 0, "{what}: {differ} of {} logits differ", a.len());
}

/// Every layer's bundles are large enough that 2 threads split it (else the test checks nothing).
fn assert_split(file: &Path) {
    let f = leanstream_format::LsbFile::open(file).unwrap();
    let layers = f.ffn.layers.len() as u64;
    let per_layer = f.ffn.bundle_bytes() / layers;
    assert!(
        per_layer >= PARALLEL_MIN_BYTES as u64,
        "{}: {per_layer} B of bundles per layer, below the {PARALLEL_MIN_BYTES} B split",
        file.display()
    );
}

fn two_threads_equal_one(file: &Path, ids: &[u32]) {
    assert_split(file);
    let (resident, resident_chunk) = logits(file, PolicyChoice::Resident, None, 1, ids);
    let (r2, r2_chunk) = logits(file, PolicyChoice::Resident, None, 2, ids);
    assert_bitwise("resident, 2 threads vs 1, decoding", &r2, &resident);
    assert_bitwise(
        "resident, 2 threads vs 1, chunk",
        &r2_chunk,
        &resident_chunk,
    );
    let (dense, dense_chunk) = logits(file, PolicyChoice::Dense, None, 1, ids);
    let (d2, d2_chunk) = logits(file, PolicyChoice::Dense, None, 2, ids);
    assert_bitwise("dense, 2 threads vs 1, decoding", &d2, &dense);
    assert_bitwise("dense, 2 threads vs 1, chunk", &d2_chunk, &dense_chunk);
    // Streaming with part of the FFN cached: resident clusters are computed by both threads, the
    // reads as they land; certified output stays resident's.
    let min = leanstream::streaming::minimum_memory(file, CTX).unwrap();
    let ffn = leanstream_format::LsbFile::open(file)
        .unwrap()
        .ffn
        .bundle_bytes();
    let budget = Some(min + ffn / 2);
    let (s2, s2_chunk) = logits(file, PolicyChoice::Leanstream, budget, 2, ids);
    assert_bitwise(
        "leanstream, 2 threads vs resident, decoding",
        &s2,
        &resident,
    );
    assert_bitwise(
        "leanstream, 2 threads vs resident, chunk",
        &s2_chunk,
        &resident_chunk,
    );
}

#[test]
fn embedded_relu_model_at_two_threads_equals_one() {
    let file = embedded("q8");
    let tokenizer = open(&file, PolicyChoice::Resident, None).tokenizer;
    two_threads_equal_one(&file, &heldout_ids(&tokenizer, 40));
}

#[test]
fn swiglu_threshold_model_at_two_threads_equals_one() {
    let spec = TinySpec {
        hidden: 128,
        intermediate: 1024,
        heads: 8,
        kv_heads: 8,
        ..TinySpec::llama()
    };
    let file = convert_tiny(
        "tiny-silu-threads",
        &spec,
        &["--quant", "q8", "--sparsity", "threshold:0.5"],
    );
    two_threads_equal_one(&file, &random_ids(5, 40, spec.vocab));
}
