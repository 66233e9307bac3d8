//! The quality of a sparse policy against a reference in one pass (`leanstream perplexity
//! --reference`): a policy against itself differs in nothing, certified ReLU sparsity is exact
//! against dense, and predicted sparsity costs something measurable.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use leanstream::streaming::Sparsity;
use leanstream::text::perplexity::{compare, perplexity};
use leanstream::text::session::{PolicyChoice, Session, SessionOptions};
use leanstream_tests::converted::{bin, convert, workspace};

const WINDOW: usize = 64;

/// The embedded ReLU model converted with f32 bundles (so resident arithmetic is dense's).
fn converted() -> &'static Path {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let dir = leanstream_tests::scratch_dir("leanstream-quality");
        let out = dir.join("austen-f32.lsb");
        convert(
            &workspace().join("models/austen-relu"),
            &out,
            &["--quant", "f32"],
        );
        out
    })
}

fn session(policy: PolicyChoice, sparsity: Sparsity) -> Session {
    Session::open(
        &SessionOptions::new(converted(), Some(policy))
            .sparsity(sparsity)
            .ctx(WINDOW),
    )
    .unwrap()
}

fn ids(s: &Session) -> Vec<u32> {
    let text = std::fs::read_to_string(workspace().join("data/heldout-head.txt")).unwrap();
    let mut ids = s.tokenizer.encode(&text, false).unwrap();
    ids.truncate(4 * WINDOW);
    ids
}

#[test]
fn a_policy_against_itself_agrees_completely() {
    let mut a = session(PolicyChoice::Resident, Sparsity::Certified);
    let mut b = session(PolicyChoice::Resident, Sparsity::Certified);
    let ids = ids(&a);
    let c = compare(a.model(), b.model(), &ids, WINDOW, false).unwrap();
    assert_eq!(c.tokens, 4 * (WINDOW - 1));
    assert_eq!(c.kl, 0.0);
    assert_eq!(c.top1_agreement, 1.0);
    assert_eq!(c.perplexity, c.reference_perplexity);
    // The same figure `perplexity` gives alone.
    let alone = perplexity(b.model(), &ids, WINDOW, false).unwrap();
    assert!((alone.perplexity / c.perplexity - 1.0).abs() < 1e-12);
}

#[test]
fn certified_relu_sparsity_matches_dense_and_predicted_does_not() {
    let mut dense = session(PolicyChoice::Dense, Sparsity::Certified);
    let ids = ids(&dense);
    let mut certified = session(PolicyChoice::Leanstream, Sparsity::Certified);
    let c = compare(certified.model(), dense.model(), &ids, WINDOW, false).unwrap();
    eprintln!("certified vs dense: {c:?}");
    assert!(c.kl <= 1e-6, "KL {}", c.kl);
    assert_eq!(c.top1_agreement, 1.0);
    assert!((c.perplexity / c.reference_perplexity - 1.0).abs() < 1e-5);
    // Predicted sparsity skips some active neurons: a real, bounded cost.
    let mut predicted = session(PolicyChoice::Leanstream, Sparsity::Predicted);
    let p = compare(predicted.model(), dense.model(), &ids, WINDOW, false).unwrap();
    eprintln!("predicted vs dense: {p:?}");
    assert!(p.kl > 0.01 && p.kl.is_finite(), "KL {}", p.kl);
    assert!(p.top1_agreement < 0.99 && p.top1_agreement > 0.0);
    assert!(p.perplexity > c.perplexity);
    assert_eq!(p.reference_perplexity, c.reference_perplexity);
}

#[test]
fn perplexity_command_reports_the_reference() {
    // About 500 tokens: the text is ASCII, so any byte is a character boundary.
    let text = std::fs::read(workspace().join("data/heldout-head.txt")).unwrap();
    let file = converted().with_file_name("excerpt.txt");
    std::fs::write(&file, &text[..2048]).unwrap();
    let out = Command::new(bin("leanstream"))
        .args(["perplexity", "--model"])
        .arg(converted())
        .args(["--file"])
        .arg(&file)
        .args([
            "--ctx",
            "64",
            "--sparsity",
            "predicted",
            "--reference",
            "dense",
        ])
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["reference"], "dense");
    assert_eq!(v["policy"], "leanstream");
    let (ppl, reference) = (
        v["perplexity"].as_f64().unwrap(),
        v["reference_perplexity"].as_f64().unwrap(),
    );
    assert!(ppl > reference, "{ppl} vs {reference}");
    let kl = v["kl"].as_f64().unwrap();
    assert!(kl > 0.01 && kl.is_finite(), "{kl}");
    let agree = v["top1_agreement"].as_f64().unwrap();
    assert!(agree > 0.0 && agree < 0.99, "{agree}");
    assert!(v["active_fraction"].as_f64().unwrap() > 0.0);
    assert!(v["predictor_recall"].as_f64().unwrap() > 0.3);
}
