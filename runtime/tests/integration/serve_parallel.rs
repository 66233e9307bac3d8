//! `leanstream serve --parallel`: requests served at once decode their tokens together, and each
//! reply is bit for bit what it is alone — on the embedded model, and on it converted and
//! streaming under a budget (where a step reads each cluster once for every slot). The batched
//! forward pass itself gives every row the logits of decoding it alone, rows at different
//! positions; a budget too small for every slot's KV cache serves fewer, saying so; and eight
//! concurrent clients all get their solo text (latency and throughput printed), on the embedded
//! model and on the real SmolLM2 streaming at half its file.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use leanstream::model::LanguageModel;
use leanstream::text::session::{PolicyChoice, Session, SessionOptions};
use serde_json::{json, Value};

use super::serve::{agent, embedded_model, run_text, Server};

const PROMPTS: [&str; 8] = [
    "It is a truth universally acknowledged",
    "Mr. Darcy said",
    "The morning was",
    "Elizabeth walked",
    "She could not",
    "In vain I have struggled",
    "My dear Mr. Bennet",
    "Lady Catherine",
];

/// The embedded model converted (q8, small clusters), once per test process.
fn converted() -> PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        convert(
            &embedded_model(),
            "parallel",
            &[
                "--quant",
                "q8",
                "--calib-tokens",
                "2048",
                "--epochs",
                "2",
                "--cluster-kib",
                "8",
            ],
        )
    })
    .clone()
}

/// `model` converted by `leanstream-prep convert` with `args`, into a file named after `name` and
/// this process.
fn convert(model: &Path, name: &str, args: &[&str]) -> PathBuf {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{name}-{}.lsb", std::process::id()));
    let o = Command::new(super::support::prep())
        .arg("convert")
        .arg(model)
        .arg("-o")
        .arg(&out)
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

/// A greedy completion's text and how long it took.
fn complete(url: &str, prompt: &str, n: usize) -> (String, Duration) {
    let started = Instant::now();
    let body = completion(url, prompt, n);
    let text = body["choices"][0]["text"].as_str().unwrap().to_string();
    (text, started.elapsed())
}

/// A greedy completion's reply.
fn completion(url: &str, prompt: &str, n: usize) -> Value {
    let mut r = agent()
        .post(url)
        .header("Content-Type", "application/json")
        .send(json!({ "prompt": prompt, "max_tokens": n, "temperature": 0 }).to_string())
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let body: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
    assert_eq!(body["usage"]["completion_tokens"], n, "{body}");
    body
}

/// Every prompt alone, one after another, then all at once: the same texts.
fn concurrent_replies_equal_solo(server: &Server, prompts: &[&str], n: usize) -> Vec<Duration> {
    let url = server.url("/v1/completions");
    let solo: Vec<String> = prompts.iter().map(|p| complete(&url, p, n).0).collect();
    // Some tokens must be decoded together: more tokens than steps. How many steps coincide
    // depends on how the clients' requests interleave with the rest of the machine's load, so a
    // round that happened to run one slot at a time (seen once in a loaded full suite) is tried
    // again; the replies are checked in every round.
    let mut rounds = Vec::new();
    for _ in 0..3 {
        let steps = server.metric("leanstream_batch_steps");
        let tokens = server.metric("leanstream_batched_tokens");
        let together: Vec<(String, Duration)> = std::thread::scope(|s| {
            let handles: Vec<_> = prompts
                .iter()
                .map(|p| {
                    let url = url.clone();
                    s.spawn(move || complete(&url, p, n))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for ((prompt, alone), (at_once, _)) in prompts.iter().zip(&solo).zip(&together) {
            assert_eq!(alone, at_once, "{prompt:?}: alone vs served with others");
        }
        let (steps, tokens) = (
            server.metric("leanstream_batch_steps") - steps,
            server.metric("leanstream_batched_tokens") - tokens,
        );
        rounds.push((tokens, steps));
        if tokens > steps {
            return together.into_iter().map(|t| t.1).collect();
        }
    }
    panic!("not batched in any round: (tokens, steps) {rounds:?}");
}

#[test]
fn parallel_slots_reply_as_each_request_would_alone() {
    let server = Server::start(&embedded_model(), &["--parallel", "4"]);
    assert_eq!(server.metric("leanstream_parallel_slots"), 4.0);
    concurrent_replies_equal_solo(&server, &PROMPTS[..4], 24);
    let (text, _) = complete(&server.url("/v1/completions"), PROMPTS[0], 16);
    assert_eq!(text, run_text(PROMPTS[0], 16));
}

#[test]
fn parallel_slots_stream_under_a_budget_as_each_request_would_alone() {
    // Each slot's KV cache (1 MiB at --ctx 512) is counted in the budget: 30 MiB holds four
    // beside the process's start-up (13 to 18 MiB) and the streaming buffers.
    let file = converted();
    let server = Server::start(
        &file,
        &["--parallel", "4", "--memory", "30MiB", "--ctx", "512"],
    );
    assert_eq!(server.metric("leanstream_parallel_slots"), 4.0);
    assert!(server.metric("leanstream_kv_slots_reserved_bytes") >= 3.0 * (1 << 20) as f64);
    concurrent_replies_equal_solo(&server, &PROMPTS[..4], 24);
    drop(server);
    // A budget without room for 64 caches (2 MiB each at --ctx 1024) serves fewer, and says so.
    let server = Server::start(
        &file,
        &["--parallel", "64", "--memory", "30MiB", "--ctx", "1024"],
    );
    let slots = server.metric("leanstream_parallel_slots");
    assert!((1.0..16.0).contains(&slots), "{slots} slots");
    assert!(
        server
            .startup
            .iter()
            .any(|l| l.contains("--memory holds the KV caches of") && l.contains("not 64")),
        "{:?}",
        server.startup
    );
}

#[test]
fn a_batched_step_gives_each_row_its_decoded_logits() {
    let file = converted();
    // No budget: this test process's start-up RSS (counted in a budget) depends on the tests
    // beside it; the engine's chunk path is the same, its clusters read once for all rows.
    let opts = SessionOptions::new(&file, Some(PolicyChoice::Leanstream)).ctx(256);
    let mut session = Session::open(&opts).unwrap();
    let ids = |text: &str| session.tokenizer.encode(text, true).unwrap();
    let prompts: Vec<Vec<u32>> = PROMPTS[..3].iter().map(|p| ids(p)).collect();
    let model = session.model();
    // Three sequences at different positions, each decoded alone then in one batch.
    let mut alone = Vec::new();
    let mut caches = Vec::new();
    let mut next = Vec::new();
    for p in &prompts {
        let mut cache = model.new_cache(256);
        let mut logits = model.forward(p, &mut cache, false).unwrap();
        let tok = argmax(&logits);
        let mut solo = model.new_cache(256);
        solo.restore(&cache.save()).unwrap();
        model
            .forward_into(&[tok], &mut solo, false, &mut logits)
            .unwrap();
        alone.push(logits);
        caches.push(cache);
        next.push(tok);
    }
    let positions: Vec<usize> = caches.iter().map(|c| c.len()).collect();
    assert!(positions.windows(2).any(|w| w[0] != w[1]), "{positions:?}");
    let mut refs: Vec<_> = caches.iter_mut().collect();
    let mut batched = Vec::new();
    model.forward_batch(&next, &mut refs, &mut batched).unwrap();
    let vocab = model.config().vocab_size;
    for (i, row) in batched.chunks_exact(vocab).enumerate() {
        assert!(
            row.iter()
                .zip(&alone[i])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "row {i} (position {}) differs from decoding it alone",
            positions[i]
        );
    }
}

fn argmax(x: &[f32]) -> u32 {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b }) as u32
}

/// The load test: eight clients at once on eight slots, every reply its solo greedy text and none
/// lost; prints p50/p99 latency and the aggregate throughput (a figure, not a bound: the
/// machine's load varies; `scripts/load-test.sh` measures 1 slot against 8).
#[test]
fn eight_concurrent_clients_each_get_their_solo_text() {
    let server = Server::start(&embedded_model(), &["--parallel", "8", "--queue", "8"]);
    eight_clients("the embedded model", &server, &PROMPTS, 32);
}

/// SmolLM2's prompts for the load test: ones its greedy replies do not end early (every reply is
/// checked for its full length).
const SMOLLM2_PROMPTS: [&str; 8] = [
    "It is a truth universally acknowledged",
    "The history of the Roman empire",
    "The old lighthouse keeper",
    "Explain how a steam engine works.",
    "The recipe for bread begins",
    "Once upon a time, in a small village",
    "The theory of relativity says",
    "In the early twentieth century, the city",
];

/// The real SmolLM2 converted without calibration (`--layout-only`: its bundles streamed exactly),
/// at a budget of half its file: eight clients each get their solo greedy text.
#[test]
fn eight_clients_on_smollm2_at_half_its_file_each_get_their_solo_text() {
    let file = convert(
        &super::support::smollm2(),
        "parallel-smollm2",
        &["--layout-only"],
    );
    let half = (std::fs::metadata(&file).unwrap().len() / 2).to_string();
    // Eight slots' KV caches are counted in the budget: q8_0 caches of 128 positions fit.
    let server = Server::start(
        &file,
        &[
            "--parallel",
            "8",
            "--queue",
            "8",
            "--memory",
            &half,
            "--ctx",
            "128",
            "--kv",
            "q8_0",
        ],
    );
    assert_eq!(server.metric("leanstream_parallel_slots"), 8.0);
    eight_clients("SmolLM2 at half its file", &server, &SMOLLM2_PROMPTS, 16);
    drop(server);
    std::fs::remove_file(&file).unwrap();
}

/// Eight clients at once on `server`, each reply its solo text (none lost); prints p50/p99
/// latency and the aggregate tokens per second.
fn eight_clients(what: &str, server: &Server, prompts: &[&str], tokens: usize) {
    let started = Instant::now();
    let mut latencies = concurrent_replies_equal_solo(server, prompts, tokens);
    let wall = latencies.iter().max().copied().unwrap_or_default();
    latencies.sort();
    assert_eq!(latencies.len(), prompts.len(), "a reply was lost");
    let p99 = latencies[(latencies.len() * 99 / 100).min(latencies.len() - 1)];
    println!(
        "{what}: {} clients x {tokens} tokens on 8 slots: p50 {:.0} ms, p99 {:.0} ms, {:.1} tok/s \
         aggregate",
        prompts.len(),
        latencies[latencies.len() / 2].as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        (prompts.len() * tokens) as f64 / wall.as_secs_f64()
    );
    assert!(started.elapsed() < Duration::from_secs(120));
}

/// A request that begins like an earlier one is served with the cache that holds it, whichever
/// slot takes it: four prompts fill four caches, then each comes back longer and computes only
/// what follows its own prefix — every time, though any idle slot may take any request.
#[test]
fn a_request_is_served_with_the_cache_that_holds_its_prefix() {
    let server = Server::start(&embedded_model(), &["--parallel", "4"]);
    let url = server.url("/v1/completions");
    let prompts = [
        "It is a truth universally acknowledged",
        "In vain I have struggled",
        "My dear Mr. Bennet, said his lady",
        "The morning was fine and the walk",
    ];
    let first: Vec<u64> = prompts
        .iter()
        .map(|p| {
            completion(&url, p, 4)["usage"]["prompt_tokens"]
                .as_u64()
                .unwrap()
        })
        .collect();
    for _ in 0..2 {
        for (p, &n) in prompts.iter().zip(&first) {
            assert!(n >= 4, "{p:?}: {n} tokens, too few to count as a prefix");
            let longer = format!("{p} and then");
            let reply = completion(&url, &longer, 4);
            let cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            assert!(
                cached >= n - 1,
                "{longer:?} reused {cached} tokens, its prefix {p:?} is {n}"
            );
            // The next round asks for the short prompt's continuation again: each cache still
            // holds its own prompt's prefix.
        }
    }
}
