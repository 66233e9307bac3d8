//! The policies side by side on one file, one token sequence and one budget: every exact policy
//! computes what `resident` computes; the predicted ones run and measure their recall against the
//! recorded truth; nothing reads less or hits more than the oracle.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use leanstream::streaming::{minimum_memory, ActiveTrace, Tuning};
use leanstream::text::generate::{generate, GenerateOptions};
use leanstream::text::sampler::SamplerConfig;
use leanstream::text::session::{PolicyChoice, Session, SessionOptions};
use leanstream_tests::converted::{bin, embedded, heldout_ids, ufs4};
use serde_json::Value;

const CTX: usize = 64;

fn open(file: &Path, policy: PolicyChoice, memory: Option<u64>, tuning: Tuning) -> Session {
    try_open(file, policy, memory, tuning).unwrap()
}

/// `mmap` reads the real disk; every other streaming policy the emulated UFS 4.0.
fn try_open(
    file: &Path,
    policy: PolicyChoice,
    memory: Option<u64>,
    tuning: Tuning,
) -> anyhow::Result<Session> {
    let emulated = memory.is_some() && policy != PolicyChoice::Mmap;
    Session::open(
        &SessionOptions::new(file, Some(policy))
            .memory(memory)
            .flash(if emulated { ufs4() } else { None })
            .ctx(CTX)
            .tuning(tuning),
    )
}

fn traced(trace: &Arc<ActiveTrace>) -> Tuning {
    Tuning {
        oracle: Some(trace.clone()),
        ..Tuning::default()
    }
}

/// Mean negative log-likelihood of `ids` through the decode path (one token per call), in
/// windows of `CTX` each from an empty cache — the order `ActiveTrace::record` uses.
fn decode_nll(s: &mut Session, ids: &[u32]) -> anyhow::Result<f64> {
    let model = s.model();
    let mut cache = model.new_cache(CTX);
    let (mut nll, mut n) = (0.0f64, 0);
    for w in ids.chunks(CTX) {
        cache.clear();
        for j in 0..w.len() {
            let logits = model.forward(&w[j..j + 1], &mut cache, false)?;
            if j + 1 < w.len() {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
                nll -= logits[w[j + 1] as usize] as f64 - max - sum.ln();
                n += 1;
            }
        }
    }
    Ok(nll / n as f64)
}

/// Greedy continuation of `prompt`: every token the model saw, and the generated ones.
fn greedy(s: &mut Session, prompt: &[u32], n: usize) -> anyhow::Result<Vec<u32>> {
    let opts = GenerateOptions {
        max_tokens: n,
        ctx: CTX,
        sampler: SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        },
        eos_token_ids: vec![],
    };
    let tokenizer = s.tokenizer.clone();
    Ok(generate(s.model(), &tokenizer, prompt, &opts, |_| {})?.tokens)
}

struct Setup {
    file: std::path::PathBuf,
    ids: Vec<u32>,
    prompt: Vec<u32>,
    /// The held-out ids' trace, and the greedy sequence's (prompt + generated but the last).
    ids_trace: Arc<ActiveTrace>,
    greedy_trace: Arc<ActiveTrace>,
    nll: f64,
    tokens: Vec<u32>,
    min: u64,
    ffn: u64,
}

fn setup() -> Setup {
    let file = embedded("q8");
    let mut resident = open(&file, PolicyChoice::Resident, None, Tuning::default());
    let ids = heldout_ids(&resident.tokenizer, 2 * CTX);
    let prompt = resident
        .tokenizer
        .encode("It was a fine morning, and Emma", true)
        .unwrap();
    let nll = decode_nll(&mut resident, &ids).unwrap();
    let tokens = greedy(&mut resident, &prompt, 20).unwrap();
    let mut seen = prompt.clone();
    seen.extend(&tokens[..tokens.len() - 1]);
    Setup {
        ids_trace: Arc::new(ActiveTrace::record(&file, &ids, CTX).unwrap()),
        greedy_trace: Arc::new(ActiveTrace::record(&file, &seen, CTX).unwrap()),
        min: minimum_memory(&file, CTX).unwrap(),
        ffn: leanstream_format::LsbFile::open(&file)
            .unwrap()
            .ffn
            .bundle_bytes(),
        file,
        ids,
        prompt,
        nll,
        tokens,
    }
}

#[test]
fn every_exact_policy_equals_resident() {
    let s = setup();
    let ablation = |f: fn(&mut Tuning)| {
        let mut t = Tuning::default();
        f(&mut t);
        t
    };
    for budget in [s.min + s.ffn / 10, s.min + s.ffn / 4] {
        let runs: Vec<(&str, PolicyChoice, Tuning, Tuning)> = vec![
            (
                "leanstream",
                PolicyChoice::Leanstream,
                Tuning::default(),
                Tuning::default(),
            ),
            (
                "leanstream --always-lookahead",
                PolicyChoice::Leanstream,
                ablation(|t| t.always_lookahead = true),
                ablation(|t| t.always_lookahead = true),
            ),
            (
                "leanstream --no-refine",
                PolicyChoice::Leanstream,
                ablation(|t| t.refine = false),
                ablation(|t| t.refine = false),
            ),
            (
                "leanstream --no-cancel",
                PolicyChoice::Leanstream,
                ablation(|t| t.cancel = false),
                ablation(|t| t.cancel = false),
            ),
            (
                "oracle",
                PolicyChoice::Oracle,
                traced(&s.ids_trace),
                traced(&s.greedy_trace),
            ),
            (
                "oracle-exact",
                PolicyChoice::Oracle,
                Tuning {
                    oracle_exact_compute: true,
                    ..traced(&s.ids_trace)
                },
                Tuning {
                    oracle_exact_compute: true,
                    ..traced(&s.greedy_trace)
                },
            ),
            (
                "mmap",
                PolicyChoice::Mmap,
                Tuning::default(),
                Tuning::default(),
            ),
        ];
        for (name, policy, for_ids, for_greedy) in runs {
            let nll =
                decode_nll(&mut open(&s.file, policy, Some(budget), for_ids), &s.ids).unwrap();
            eprintln!(
                "budget {budget}: {name} nll {nll:.8}, resident {:.8}",
                s.nll
            );
            assert!(
                (nll / s.nll - 1.0).abs() < 1e-5,
                "{name} at {budget}: {nll} vs {}",
                s.nll
            );
            let mut session = open(&s.file, policy, Some(budget), for_greedy);
            let tokens = greedy(&mut session, &s.prompt, 20).unwrap();
            assert_eq!(tokens, s.tokens, "{name} at {budget}");
        }
    }
}

/// Runs `policy` over the held-out ids with their trace (the truth for every policy's metrics).
fn measured(s: &Setup, policy: PolicyChoice, budget: u64, tuning: Tuning) -> (f64, Value) {
    let mut session = open(
        &s.file,
        policy,
        Some(budget),
        Tuning {
            oracle: Some(s.ids_trace.clone()),
            ..tuning
        },
    );
    let nll = decode_nll(&mut session, &s.ids).unwrap();
    (nll, session.report())
}

#[test]
fn predicted_policies_run_and_report_recall() {
    let s = setup();
    let budget = s.min + s.ffn / 4;
    for policy in [PolicyChoice::PowerInfer2, PolicyChoice::LlmInFlash] {
        let (nll, r) = measured(&s, policy, budget, Tuning::default());
        let recall = r["predictor_recall"].as_f64().unwrap();
        eprintln!(
            "{}: perplexity {:.3} (resident {:.3}), recall {recall:.3}, precision {:.3}, {} B/token",
            r["policy"],
            nll.exp(),
            s.nll.exp(),
            r["predictor_precision"],
            r["bytes_read_per_token"]
        );
        // Measured against the trace (the exact model's active sets): the predictor misses
        // active neurons, and the skipped ones cost quality.
        assert!(recall > 0.3 && recall < 1.0, "{policy:?}: recall {recall}");
        assert!(
            nll.is_finite() && nll > s.nll,
            "{policy:?}: {nll} vs {}",
            s.nll
        );
        assert!(r["bytes_read_per_token"].as_f64().unwrap() > 0.0);
    }
}

/// The bench's invariant: on the same tokens at the same budget, no exact policy reads fewer bytes
/// than the oracle, and no policy finds more of the truly active clusters in memory when their
/// layer runs. (A predicted policy may read less: it skips active neurons, at a quality cost.)
#[test]
fn nothing_beats_the_oracle() {
    let s = setup();
    let budget = s.min + s.ffn / 4;
    let (_, oracle) = measured(&s, PolicyChoice::Oracle, budget, Tuning::default());
    let bytes = |r: &Value| r["bytes_read_per_token"].as_f64().unwrap();
    let hit = |r: &Value| r["active_hit_rate"].as_f64().unwrap();
    // It reads exactly the active clusters it did not hold.
    assert!(
        (oracle["read_amplification"].as_f64().unwrap() - 1.0).abs() < 1e-9,
        "{oracle}"
    );
    // Computing every gate of what it holds (`oracle-exact`) changes what it computes, not what
    // it reads: exactly the active clusters it did not hold.
    let (_, exact) = measured(
        &s,
        PolicyChoice::Oracle,
        budget,
        Tuning {
            oracle_exact_compute: true,
            ..Tuning::default()
        },
    );
    assert!(
        (exact["read_amplification"].as_f64().unwrap() - 1.0).abs() < 1e-9,
        "{exact}"
    );
    let variants: Vec<(PolicyChoice, Tuning)> = vec![
        (PolicyChoice::PowerInfer2, Tuning::default()),
        (PolicyChoice::LlmInFlash, Tuning::default()),
        (PolicyChoice::Leanstream, Tuning::default()),
        (
            PolicyChoice::Leanstream,
            Tuning {
                lookahead: false,
                ..Tuning::default()
            },
        ),
        (
            PolicyChoice::Leanstream,
            Tuning {
                always_lookahead: true,
                ..Tuning::default()
            },
        ),
        (
            PolicyChoice::Leanstream,
            Tuning {
                refine: false,
                ..Tuning::default()
            },
        ),
        (
            PolicyChoice::Leanstream,
            Tuning {
                cancel: false,
                ..Tuning::default()
            },
        ),
        (
            PolicyChoice::Leanstream,
            Tuning {
                retention: leanstream::streaming::neuron_cache::Retention::Lru,
                ..Tuning::default()
            },
        ),
    ];
    for (policy, tuning) in variants {
        let (_, r) = measured(&s, policy, budget, tuning.clone());
        eprintln!(
            "{policy:?} {:?}: {:.0} B/token, active hit rate {:.3}, amplification {:.2}; oracle {:.0}, {:.3}",
            (tuning.lookahead, tuning.refine, tuning.retention),
            bytes(&r),
            hit(&r),
            r["read_amplification"],
            bytes(&oracle),
            hit(&oracle)
        );
        if policy == PolicyChoice::Leanstream {
            assert!(bytes(&oracle) <= bytes(&r), "{policy:?} read less: {r}");
            let speculated = r["speculating_token_fraction"].as_f64().unwrap();
            if tuning.always_lookahead {
                assert!(speculated > 0.99, "{speculated}");
            } else if !tuning.lookahead {
                assert_eq!(speculated, 0.0);
            }
        }
        assert!(hit(&oracle) >= hit(&r), "{policy:?} hit more: {r}");
    }
}

#[test]
fn the_oracle_refuses_a_sequence_it_has_not_seen() {
    let s = setup();
    let mut other = s.ids.clone();
    other[5] = other[5].wrapping_add(1) % 1000;
    let mut session = open(&s.file, PolicyChoice::Oracle, None, traced(&s.ids_trace));
    let err = decode_nll(&mut session, &other).unwrap_err().to_string();
    assert!(err.contains("token 5 fed is id"), "{err}");
    let err = try_open(&s.file, PolicyChoice::Oracle, None, Tuning::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("recorded in advance"), "{err}");
}

#[test]
fn mmap_refuses_an_emulated_flash() {
    let file = embedded("q8");
    let o = Command::new(bin("leanstream"))
        .args([
            "run", "-p", "Emma", "-n", "2", "--policy", "mmap", "--flash", "ufs4", "--model",
        ])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("use --flash none"), "{err}");
}
