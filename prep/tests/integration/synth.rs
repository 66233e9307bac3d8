//! `leanstream-prep synth`: a small synthetic file planted from the embedded model's converted
//! file verifies, agrees with its source's activity statistics within 10 %, and streams under a
//! budget with the activity it was planted with.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use leanstream::storage::FlashProfile;
use leanstream::text::perplexity::perplexity;
use leanstream::text::session::{PolicyChoice, Session, SessionOptions};
use serde_json::Value;

fn prep(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_leanstream-prep"))
        .args(args)
        .output()
        .expect("leanstream-prep runs")
}

fn ok(o: Output) -> Value {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap_or(Value::Null)
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn synthetic_file_carries_the_sources_statistics_and_streams() {
    let dir = leanstream_tests::scratch_dir("leanstream-synth");
    let (src, syn) = (dir.join("austen.lsb"), dir.join("synth.lsb"));
    let (src_s, syn_s) = (src.to_str().unwrap(), syn.to_str().unwrap());
    let model = workspace().join("models/austen-relu");
    ok(prep(&[
        "convert",
        model.to_str().unwrap(),
        "-o",
        src_s,
        "--calib-tokens",
        "2560",
        "--epochs",
        "2",
        "--json",
    ]));
    let summary = ok(prep(&[
        "synth",
        "--shape",
        "tiny",
        "--layers",
        "2",
        "--quant",
        "q4",
        "--profile-from",
        src_s,
        "-o",
        syn_s,
        "--calib-tokens",
        "2560",
        "--json",
    ]));
    assert!(prep(&["verify", syn_s]).status.success());

    // inspect shows the synthetic statistics next to the source's, within 10 %.
    let v = ok(prep(&["inspect", syn_s, "--json"]));
    let cmp = &v["comparison"];
    assert_eq!(cmp, &summary["comparison"]);
    for l in cmp["layers"].as_array().unwrap() {
        for (name, s) in l["stats"].as_object().unwrap() {
            let rel = s["rel_diff"].as_f64().unwrap();
            assert!(rel <= 0.10, "layer {}: {name} {s}", l["layer"]);
        }
    }
    assert_eq!(v["layers_count"], 2);
    assert_eq!(v["intermediate_size"], 1024);
    assert_eq!(v["quant"], "q4_0");
    // A converted file has the statistics but no comparison.
    let s = ok(prep(&["inspect", src_s, "--json"]));
    assert!(s["comparison"].is_null());
    assert!(s["layers"][0]["token_overlap"].as_f64().unwrap() > 0.0);

    // Streamed under a budget, the runtime sees the planted activity.
    let min = leanstream::streaming::minimum_memory(&syn, 256).unwrap();
    let f = leanstream_format::LsbFile::open(&syn).unwrap();
    let budget = min + f.ffn.bundle_bytes() / 4;
    let mut session = Session::open(
        &SessionOptions::new(&syn, Some(PolicyChoice::Leanstream))
            .memory(Some(budget))
            .flash(FlashProfile::from_flash_arg("ufs4").unwrap())
            .ctx(256),
    )
    .unwrap();
    let text = std::fs::read_to_string(workspace().join("data/heldout-head.txt")).unwrap();
    let mut ids = session.tokenizer.encode(&text, false).unwrap();
    ids.truncate(256);
    perplexity(session.model(), &ids, 256, false).unwrap();
    let r = session.report();
    let planted: f64 = f
        .meta
        .layers
        .iter()
        .map(|l| 1.0 - l.sparsity as f64)
        .sum::<f64>()
        / 2.0;
    let seen = r["active_fraction"].as_f64().unwrap();
    eprintln!("run: {r}");
    assert!(
        (seen / planted - 1.0).abs() < 0.15,
        "active fraction {seen} in the run, {planted} planted"
    );
    assert!(r["cache_hit_rate"].as_f64().unwrap() > 0.0);
    assert!(r["predictor_recall"].as_f64().unwrap() > 0.5);
    std::fs::remove_dir_all(&dir).ok();
}
