//! Budgets below the dense weights: attention, output head and embedding stream from flash, the
//! results stay those of the resident model, the process stays within its budget, a budget below
//! the new minimum is refused with it, and a corrupted streamed tensor is caught by its checksum.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, OnceLock};

use leanstream::storage::{Device, DirectDevice, Fault, FaultyDevice};
use leanstream::streaming::{
    minimum_memory, streaming_minimum_memory, Policy, Sparsity, StreamOptions, StreamingModel,
    Tuning,
};
use leanstream::text::generate::{generate, GenerateOptions};
use leanstream::text::perplexity::perplexity;
use leanstream::text::sampler::SamplerConfig;
use leanstream::text::session::{PolicyChoice, Session};
use leanstream::tokenizer::Tokenizer;
use leanstream_format::LsbFile;
use leanstream_tests::cli::stated_size;
use leanstream_tests::converted::{
    bin, convert, convert_tiny, heldout_ids, scratch, session_options, workspace,
};
use leanstream_tests::tiny::{random_ids, TinySpec};
use serde_json::Value;

const CTX: usize = 128;

fn session(file: &Path, policy: PolicyChoice, memory: Option<u64>) -> Session {
    Session::open(&session_options(file, policy, memory, CTX)).unwrap()
}

/// Perplexity of `ids` and the run's report.
fn ppl(file: &Path, policy: PolicyChoice, memory: Option<u64>, ids: &[u32]) -> (f64, Value) {
    let mut s = session(file, policy, memory);
    let p = perplexity(s.model(), ids, 64, false).unwrap().perplexity;
    (p, s.report())
}

/// A tiny Llama with an untied output head, so that head and embedding stream separately.
fn untied() -> &'static Path {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        // Large enough that streaming each part saves more than its buffers cost.
        let spec = TinySpec {
            hidden: 256,
            intermediate: 512,
            layers: 4,
            head_dim: 64,
            ..TinySpec::llama()
        };
        assert!(!spec.tied);
        convert_tiny(
            "tiny-untied",
            &spec,
            &["--quant", "q8", "--certificate", "none"],
        )
    })
}

/// The embedded model at q8 without a certificate: which dense weights stream is then the
/// planner's order alone (where a file has one, a tight budget may first give up the optional
/// certificate instead; streaming.rs tests that).
fn uncertified() -> PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let file = scratch().join("austen-q8-uncertified.lsb");
        let model = workspace().join("models/austen-relu");
        convert(&model, &file, &["--quant", "q8", "--certificate", "none"]);
        file
    })
    .clone()
}

fn streamed(report: &Value) -> [bool; 3] {
    let s = &report["memory_split"]["dense_streamed"];
    ["attention", "head", "embedding"].map(|k| s[k].as_bool().unwrap())
}

/// At each budget the dense weights `expect` says stream, perplexity equals the resident model's,
/// and dense bytes are read where some stream.
fn streamed_perplexity_equals_resident(file: &Path, ids: &[u32], expect: &[(u64, [bool; 3])]) {
    let (resident, _) = ppl(file, PolicyChoice::Resident, None, ids);
    for &(budget, choice) in expect {
        let (p, report) = ppl(file, PolicyChoice::Leanstream, Some(budget), ids);
        eprintln!(
            "budget {budget}: {:?}, {p:.6} vs {resident:.6}, {} dense B/token",
            streamed(&report),
            report["dense_bytes_read_per_token"]
        );
        assert_eq!(streamed(&report), choice, "budget {budget}");
        assert!(
            (p / resident - 1.0).abs() < 1e-5,
            "budget {budget}: {p} vs {resident}"
        );
        assert_eq!(
            report["dense_bytes_read_per_token"].as_f64().unwrap() > 0.0,
            choice.contains(&true),
            "budget {budget}: dense bytes read where, and only where, some stream"
        );
    }
}

#[test]
fn streamed_dense_weights_give_the_resident_perplexity() {
    // Tied (the embedded model): attention first, then the embedding table as head and rows.
    let file = uncertified();
    let (new, old) = (
        streaming_minimum_memory(&file, CTX).unwrap(),
        minimum_memory(&file, CTX).unwrap(),
    );
    assert!(new < old, "streaming lowers the minimum: {new} vs {old}");
    let ids = heldout_ids(&session(&file, PolicyChoice::Resident, None).tokenizer, 200);
    streamed_perplexity_equals_resident(
        &file,
        &ids,
        &[
            (new, [true; 3]),
            // Halfway, a shorter prompt chunk (a prefill cost) keeps the embedding table resident
            // rather than reading it every token.
            ((new + old) / 2, [true, false, false]),
            (old - 1, [true, false, false]),
        ],
    );
    // Untied: the embedding streams wherever the cache cannot hold the FFN (a row a token for
    // its bytes as cache), above the dense-resident minimum too; below it attention streams, then
    // the head.
    let file = untied();
    let (new, old) = (
        streaming_minimum_memory(file, CTX).unwrap(),
        minimum_memory(file, CTX).unwrap(),
    );
    let ffn = LsbFile::open(file).unwrap().ffn.bundle_bytes();
    let choices: Vec<[bool; 3]> = (0..=8)
        .map(|i| {
            let s = session(
                file,
                PolicyChoice::Leanstream,
                Some(new + (old - new) * i / 8),
            );
            streamed(&s.report())
        })
        .collect();
    assert!(
        choices.contains(&[true, false, true]) && choices.iter().all(|c| c[2]),
        "below the dense weights the embedding always streams, attention alone beside it at \
         some budget: {choices:?}"
    );
    streamed_perplexity_equals_resident(
        file,
        &random_ids(5, 150, 4096),
        &[
            (new, [true; 3]),
            (old - 1, [true, false, true]),
            (old + ffn / 4, [false, false, true]),
            (old + 2 * ffn, [false, false, false]),
        ],
    );
}

fn run(file: &Path, extra: &[&str]) -> Output {
    Command::new(bin("leanstream"))
        .arg("run")
        .arg("--model")
        .arg(file)
        .args([
            "-p",
            "It was a fine morning, and Emma",
            "--temp",
            "0",
            "-n",
            "40",
        ])
        .args(["--ctx", &CTX.to_string(), "--json"])
        .args(extra)
        .output()
        .unwrap()
}

/// Below the old minimum the binary streams dense weights, generates the resident tokens and stays
/// within its budget + 5 % (the OS's peak RSS); below the new minimum it says what the minimum is.
#[test]
fn the_binary_streams_dense_weights_within_its_budget() {
    let file = uncertified();
    let resident = run(&file, &["--policy", "resident"]);
    assert!(resident.status.success());
    let want: Value = serde_json::from_slice(&resident.stdout).unwrap();
    let o = run(&file, &["--memory", "1MiB"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        err.contains("streaming attention, output head, embedding"),
        "{err}"
    );
    // The binary's own minimum (its process overhead differs from this test's); the old one is
    // higher by what streaming saves, which does not depend on the overhead.
    let new = stated_size(&err, "below the minimum of ") + (16 << 10);
    let saved = minimum_memory(&file, CTX).unwrap() - streaming_minimum_memory(&file, CTX).unwrap();
    let old = new + saved;
    for budget in [new, (new + old) / 2, old - (64 << 10)] {
        let o = run(&file, &["--memory", &budget.to_string(), "--flash", "ufs4"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        let rss = v["peak_rss_bytes"].as_u64().unwrap();
        eprintln!(
            "budget {budget}: {:?}, peak RSS {rss}, {} dense B/token, {} FFN B/token",
            streamed(&v),
            v["dense_bytes_read_per_token"],
            v["bytes_read_per_token"]
        );
        assert_eq!(v["text"], want["text"], "budget {budget}");
        assert!(streamed(&v)[0], "budget {budget}: attention streams");
        assert!(v["dense_bytes_read_per_token"].as_f64().unwrap() > 0.0);
        assert!(
            rss as f64 <= budget as f64 * 1.05,
            "budget {budget}: peak RSS {rss}"
        );
        assert!(v["memory_split"]["dense_buffers"].as_u64().unwrap() > 0);
    }
    // Just below the stated minimum: refused, with the same minimum.
    let o = run(&file, &["--memory", &(new - (64 << 10)).to_string()]);
    assert_eq!(o.status.code(), Some(1));
    let again = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        stated_size(&again, "below the minimum of "),
        new - (16 << 10),
        "{again}"
    );
}

/// Greedy tokens at the streaming minimum through a device that flips one bit at `at`.
fn generate_with_flip(file: &Path, at: u64) -> anyhow::Result<Vec<u32>> {
    let inner: Arc<dyn Device> = Arc::new(DirectDevice::open(file, 8).unwrap());
    let device = Arc::new(FaultyDevice::new(inner, vec![Fault::bit_flip(at, 3)]));
    let lsb = LsbFile::open(file).unwrap();
    let tokenizer = Tokenizer::from_bytes(&lsb.tokenizer_json).unwrap();
    let opts = StreamOptions {
        policy: Policy::Leanstream,
        sparsity: Sparsity::Certified,
        memory: Some(streaming_minimum_memory(file, CTX).unwrap()),
        flash: None,
        ctx: CTX,
        ctx_floor: None,
        kv: Default::default(),
        tokenizer_bytes: None,
        tuning: Tuning::default(),
    };
    let mut model = StreamingModel::open_on(file, lsb, device, &opts)?;
    let prompt = tokenizer.encode("It was a fine morning", true).unwrap();
    let gen = GenerateOptions {
        max_tokens: 4,
        ctx: CTX,
        sampler: SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        },
        eos_token_ids: Vec::new(),
    };
    Ok(generate(&mut model, &tokenizer, &prompt, &gen, |_| {})?.tokens)
}

/// A flipped bit in a streamed tensor stops the run at its checksum, naming the tensor: the
/// attention projections when their layer is read, the embedding table when it is checked at open.
#[test]
fn a_corrupted_streamed_tensor_is_caught() {
    let file = uncertified();
    let lsb = LsbFile::open(&file).unwrap();
    // The header is read once at open, never through the device: a flip there changes nothing.
    assert!(generate_with_flip(&file, 0).is_ok());
    for name in [
        "model.layers.2.self_attn.v_proj.weight",
        "model.embed_tokens.weight",
    ] {
        let t = lsb.dense.get(name).unwrap();
        let (offset, _) = lsb.dense_extent(t);
        let err = format!("{:#}", generate_with_flip(&file, offset + 100).unwrap_err());
        assert!(err.contains("checksum mismatch"), "{name}: {err}");
        assert!(err.contains(name), "{name}: {err}");
    }
}
