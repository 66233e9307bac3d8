//! Faulty flash under the streaming engine: transient errors, short reads and slow reads are
//! retried or waited out and give the clean run's tokens; a persistent error stops generation with
//! a message naming the file and offset; a flipped bit in a bundle either stops generation at its
//! checksum or lies in a bundle the run never reads — it never yields a different token.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Result;
use leanstream::storage::{Device, DirectDevice, Fault, FaultKind, FaultyDevice, IoStats};
use leanstream::streaming::{Policy, Sparsity, StreamOptions, StreamingModel, Tuning};
use leanstream::text::generate::{generate, GenerateOptions};
use leanstream::text::sampler::SamplerConfig;
use leanstream::tokenizer::Tokenizer;
use leanstream_format::LsbFile;
use leanstream_tests::converted::embedded_default;

const CTX: usize = 64;

fn converted() -> &'static Path {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(embedded_default)
}

/// The byte range of the file's FFN bundles.
fn ffn_range() -> std::ops::Range<u64> {
    let f = LsbFile::open(converted()).unwrap();
    let s = f.header.section(f.cluster_layout().ffn_data()).unwrap();
    s.offset..s.offset + s.stored_size
}

/// Greedy tokens of a short prompt, streamed at the minimum budget (every bundle read from the
/// device) through `faults`; the tokens and the queue's counters, or the error.
fn generate_with(faults: Vec<Fault>) -> (Result<Vec<u32>>, Option<IoStats>, u64) {
    let path = converted();
    let inner: Arc<dyn Device> = Arc::new(DirectDevice::open(path, 8).unwrap());
    let device = Arc::new(FaultyDevice::new(inner, faults));
    let file = LsbFile::open(path).unwrap();
    let tokenizer = Tokenizer::from_bytes(&file.tokenizer_json).unwrap();
    let opts = StreamOptions {
        policy: Policy::Leanstream,
        sparsity: Sparsity::Certified,
        memory: Some(leanstream::streaming::minimum_memory(path, CTX).unwrap()),
        flash: None,
        ctx: CTX,
        ctx_floor: None,
        kv: Default::default(),
        tokenizer_bytes: None,
        tuning: Tuning::default(),
    };
    let mut model = match StreamingModel::open_on(path, file, device.clone(), &opts) {
        Ok(m) => m,
        Err(e) => return (Err(e), None, device.injected()),
    };
    let prompt = tokenizer
        .encode("It was a fine morning, and Emma", true)
        .unwrap();
    let gen = GenerateOptions {
        max_tokens: 12,
        ctx: CTX,
        sampler: SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        },
        eos_token_ids: Vec::new(),
    };
    let result = generate(&mut model, &tokenizer, &prompt, &gen, |_| {}).map(|g| g.tokens);
    (result, Some(model.io().stats()), device.injected())
}

fn clean_tokens() -> &'static [u32] {
    static TOKENS: OnceLock<Vec<u32>> = OnceLock::new();
    TOKENS.get_or_init(|| {
        let (tokens, stats, _) = generate_with(Vec::new());
        let stats = stats.unwrap();
        assert!(stats.device_reads > 0 && stats.retries == 0, "{stats:?}");
        tokens.unwrap()
    })
}

#[test]
fn transient_faults_are_retried_and_change_nothing() {
    let ffn = ffn_range();
    for (what, fault, min_retries) in [
        (
            "two EIOs",
            Fault::transient(FaultKind::Eio, ffn.clone(), 2),
            2,
        ),
        (
            "a short read",
            Fault::transient(FaultKind::ShortRead, ffn.clone(), 1),
            1,
        ),
        (
            "slow reads",
            Fault::transient(FaultKind::Delay(Duration::from_millis(3)), ffn.clone(), 30),
            0,
        ),
    ] {
        let (tokens, stats, injected) = generate_with(vec![fault]);
        let stats = stats.unwrap_or_else(|| panic!("{what}: open failed: {tokens:?}"));
        eprintln!("{what}: {injected} injected, {} retries", stats.retries);
        assert!(injected > 0, "{what}: no fault was injected");
        assert_eq!(stats.retries, min_retries, "{what}");
        assert_eq!(stats.failed, 0, "{what}");
        assert_eq!(tokens.unwrap(), clean_tokens(), "{what}");
    }
}

#[test]
fn persistent_faults_stop_generation_with_a_clear_error() {
    let name = converted().file_name().unwrap().to_str().unwrap();
    for (what, kind, cause) in [
        ("EIO", FaultKind::Eio, "Input/output error"),
        ("short reads", FaultKind::ShortRead, "short read"),
    ] {
        let (result, _, injected) = generate_with(vec![Fault::persistent(kind, ffn_range())]);
        let err = format!("{:#}", result.expect_err(what));
        eprintln!("{what}: {err}");
        assert!(injected > 0, "{what}");
        for needle in [name, "offset", cause] {
            assert!(
                err.contains(needle),
                "{what}: {needle:?} missing from: {err}"
            );
        }
    }
}

/// Bits flipped in bundles of every layer, one file position at a time.
#[test]
fn a_flipped_bit_never_yields_a_different_token() {
    let f = LsbFile::open(converted()).unwrap();
    let clean = clean_tokens();
    let (mut caught, mut unread) = (0, 0);
    for l in 0..f.ffn.layers.len() {
        let clusters = f.ffn.layers[l].clusters.len();
        for c in [0, clusters / 3, clusters / 2, clusters - 1] {
            let (offset, size) = f.cluster_extent(l, c);
            let at = offset + (size * 7 / 13 + l as u64 * 31) % size;
            let (result, _, _) = generate_with(vec![Fault::bit_flip(at, (c % 8) as u8)]);
            match result {
                Ok(tokens) => {
                    assert_eq!(tokens, clean, "layer {l} cluster {c}: a different answer");
                    unread += 1;
                }
                Err(e) => {
                    let err = format!("{e:#}");
                    assert!(
                        err.contains("checksum") && err.contains(&format!("layer {l} cluster {c}")),
                        "layer {l} cluster {c}: {err}"
                    );
                    caught += 1;
                }
            }
        }
    }
    eprintln!("{caught} flips caught by checksums, {unread} in bundles this prompt never read");
    assert!(
        caught > 0,
        "no flipped bundle was ever read: the test proves nothing"
    );
}
