//! `leanstream demo` on the embedded model: converts it once with the `leanstream-prep` beside the
//! binary (cached by checksum), streams it under minimum + 25 % of the FFN on the UFS 4.0 model,
//! gives exactly the text the dense model gives, and reports how much less memory that took and
//! what mmap does in the same budget.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn demo(cache: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .arg("demo")
        .args(args)
        .env("LEANSTREAM_CACHE", cache)
        .output()
        .expect("the leanstream binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn demo_converts_once_and_streams_the_dense_text() {
    // The demo converts with the leanstream-prep beside it: it must be built.
    super::support::prep();
    let cache = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("demo-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);

    let out = demo(&cache, &["-n", "48", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["converted_now"], true);
    assert_eq!(v["identical_text"], true, "{v:#}");
    assert_eq!(v["leanstream"]["text"], v["dense"]["text"]);
    assert_eq!(v["leanstream"]["generated_tokens"], 48);
    let (budget, minimum, ffn) = (
        v["memory_budget_bytes"].as_u64().unwrap(),
        v["minimum_memory_bytes"].as_u64().unwrap(),
        v["ffn_bytes"].as_u64().unwrap(),
    );
    assert_eq!(budget, minimum + ffn / 4, "most of the FFN stays on flash");
    assert!(v["memory_split"]["neuron_cache"].as_u64().unwrap() <= ffn / 4 + 1);
    let lean = &v["leanstream"];
    assert!(
        lean["bytes_read_per_token"].as_f64().unwrap() > 0.0,
        "{lean}"
    );
    let hit = lean["cache_hit_rate"].as_f64().unwrap();
    assert!(hit > 0.0 && hit < 1.0, "{lean}");
    assert!(lean["predictor_recall"].as_f64().unwrap() > 0.3, "{lean}");
    assert!(v["dense"]["tokens_per_s"].as_f64().unwrap() > 0.0);
    // The memory story: both peaks measured, each in its own process, and their ratio.
    let (peak, dense_peak) = (
        v["peak_rss_bytes"].as_u64().unwrap(),
        v["dense"]["peak_rss_bytes"].as_u64().unwrap(),
    );
    assert!(peak <= budget, "{v:#}");
    let ratio = v["dram_ratio"].as_f64().unwrap();
    assert!(
        (ratio - dense_peak as f64 / peak as f64).abs() < 1e-9,
        "{v:#}"
    );
    // mmap in a cgroup of the same budget ran (and says how fast), or says why it could not.
    let mmap = &v["mmap"];
    assert!(
        mmap["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0)
            || mmap["failed"].is_string()
            || mmap["skipped"].as_str().is_some_and(|s| !s.is_empty()),
        "{mmap}"
    );
    // The embedded model's file fits its budget whole: the summary must say so (below).
    let file_bytes = v["file_bytes"].as_u64().unwrap();
    assert_eq!(
        file_bytes,
        std::fs::metadata(v["converted_file"].as_str().unwrap())
            .unwrap()
            .len()
    );
    assert!(file_bytes <= budget, "{file_bytes} > {budget}");
    let files: Vec<_> = std::fs::read_dir(&cache).unwrap().collect();
    assert_eq!(files.len(), 1, "one converted file in the cache: {files:?}");

    // Again: the cached file is used, and the human summary says the texts agree.
    let out = demo(&cache, &["-n", "48"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("converting"), "{stderr}");
    assert!(stdout.starts_with("memory: "), "{stdout}");
    assert!(
        stdout.contains("It was a fine morning, and Emma"),
        "{stdout}"
    );
    for line in [
        "read per token",
        "cache hit rate",
        "predictor recall",
        "tok/s streaming",
        "less than the model needs in DRAM (dense, every weight resident: ",
        "  mmap ",
        "file fits in this",
    ] {
        assert!(stdout.contains(line), "{line:?} missing from {stdout}");
    }
    assert!(stdout.contains("\n  identical text: true\n"), "{stdout}");
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn demo_without_leanstream_prep_says_how_to_build_it() {
    // A copy of the binary alone in a folder, with nothing on PATH.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("demo-alone");
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("leanstream");
    std::fs::copy(env!("CARGO_BIN_EXE_leanstream"), &exe).unwrap();
    let out = Command::new(&exe)
        .arg("demo")
        .env("PATH", "")
        .env("LEANSTREAM_CACHE", dir.join("cache"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("leanstream-prep"), "{err}");
    assert!(err.contains("cargo build --release"), "{err}");
}
