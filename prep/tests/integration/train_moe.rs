//! `leanstream-prep train-moe` (how `models/qwen3-moe-austen` was made): a few steps of a tiny
//! shape write a Qwen3-MoE directory that the runtime opens and runs, with its validation figures
//! in `training.json`; bad arguments and a missing text are refused, naming them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use leanstream::model::kv_cache::KvType;
use leanstream::streaming::Sparsity;
use leanstream::text::session::{PolicyChoice, Session, SessionOptions};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `train-moe` from the workspace root (where its default paths point).
fn train(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_leanstream-prep"))
        .current_dir(workspace())
        .arg("train-moe")
        .args(args)
        .output()
        .unwrap()
}

const TINY: &[&str] = &[
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--head-dim",
    "16",
    "--experts",
    "4",
    "--expert-intermediate",
    "32",
    "--seq",
    "32",
    "--batch",
    "2",
    "--steps",
    "4",
    "--warmup",
    "2",
    "--eval-every",
    "4",
    "--eval-windows",
    "2",
    "--lookahead-weight",
    "1",
];

#[test]
fn a_tiny_run_writes_a_mixture_the_runtime_runs() {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("train-moe-tiny");
    let _ = std::fs::remove_dir_all(&out);
    let o = train(&[TINY, &["-o", out.to_str().unwrap()]].concat());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");

    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "qwen3_moe");
    assert_eq!(config["num_experts"], 4);
    assert_eq!(config["num_experts_per_tok"], 2);
    assert_eq!(config["moe_intermediate_size"], 32);
    assert_eq!(config["vocab_size"], 4096);

    let log: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("training.json")).unwrap()).unwrap();
    let eval = &log["evals"][0]["eval"];
    let ppl = eval["perplexity"].as_f64().unwrap();
    // Four steps from a random start: still near the vocabulary's 4096, but a number.
    assert!(ppl.is_finite() && ppl > 1.0, "{eval}");
    let recall = eval["lookahead_recall"].as_array().unwrap();
    assert!(recall[0].is_null() && (0.0..=1.0).contains(&recall[1].as_f64().unwrap()));

    let mut s = Session::open(
        &SessionOptions::new(&out, Some(PolicyChoice::Dense))
            .sparsity(Sparsity::Exact)
            .ctx(32)
            .kv(KvType::F32),
    )
    .unwrap();
    let m = s.model();
    let mut cache = m.new_cache(32);
    let logits = m.forward(&[10, 20, 30], &mut cache, true).unwrap();
    assert_eq!(logits.len(), 3 * 4096);
    assert!(logits.iter().all(|v| v.is_finite()));
}

#[test]
fn bad_arguments_and_a_missing_text_are_refused_by_name() {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("train-moe-refused");
    let out = out.to_str().unwrap();
    for (args, says) in [
        (vec!["--experts", "4", "--top-k", "5"], "--top-k (5)"),
        (vec!["--heads", "3", "--kv-heads", "2"], "--heads (3)"),
        (vec!["--text", "no/such/text.txt"], "no/such/text.txt"),
        (
            vec!["--lookahead-layer-weights", "0,0"],
            "--lookahead-layer-weights",
        ),
    ] {
        let o = train(&[args.as_slice(), &["-o", out, "--steps", "1"]].concat());
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} was accepted");
        assert!(
            stderr.contains(says) && !stderr.contains("panicked"),
            "{args:?}: {stderr}"
        );
    }
}
