//! `leanstream bench` end to end on the embedded model: every policy runs on the same tokens, the
//! exact policies agree with each other against the dense reference, the figures respond to the
//! budget, each run stays within its budget, and the plot and timeline are written.

use std::process::Command;

use leanstream_tests::converted::{bin, convert, workspace};
use serde_json::Value;

#[test]
fn bench_compares_policies_on_one_token_sequence() {
    let dir = leanstream_tests::scratch_dir("leanstream-bench-test");
    let model = dir.join("austen.lsb");
    convert(&workspace().join("models/austen-relu"), &model, &[]);
    let plot = dir.join("bench.svg");
    let trace = dir.join("trace.json");
    let out = Command::new(bin("leanstream"))
        .arg("bench")
        .arg("--model")
        .arg(&model)
        .args(["--memory", "ffn:10%,ffn:100%", "--policy", "all"])
        .args(["--tokens", "24", "--threads", "1", "--json", "--plot"])
        .arg(&plot)
        .arg("--trace")
        .arg(&trace)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let runs = v["runs"].as_array().unwrap();
    let find = |label: &str, pct: Option<u64>| -> &Value {
        runs.iter()
            .find(|r| {
                r["label"] == label
                    && match pct {
                        None => r["memory_budget_bytes"].is_null(),
                        Some(_) => !r["memory_budget_bytes"].is_null(),
                    }
            })
            .unwrap_or_else(|| panic!("no {label} run in {v}"))
    };
    let resident = find("resident", None);
    let num = |r: &Value, k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    // Certified streaming computes what resident computes: identical distance to dense.
    let budgeted: Vec<&Value> = runs.iter().filter(|r| r["label"] == "leanstream").collect();
    assert_eq!(budgeted.len(), 2, "one leanstream run per budget");
    for r in &budgeted {
        assert_eq!(r["kl_vs_dense"], resident["kl_vs_dense"], "{r}");
        assert_eq!(r["top1_vs_dense"], resident["top1_vs_dense"], "{r}");
        let budget = num(r, "memory_budget_bytes");
        assert!(
            num(r, "peak_rss_bytes") <= budget * 1.05,
            "peak RSS over budget: {r}"
        );
        assert!(num(r, "tokens_per_s") > 0.0);
    }
    // Dense against itself is not reported; the reference KL of resident is small (q8 rounding).
    assert!(num(resident, "kl_vs_dense") < 0.01, "{resident}");
    // A small cache streams, a full one barely reads.
    let (small, full) = (budgeted[0], budgeted[1]);
    assert!(num(small, "memory_budget_bytes") < num(full, "memory_budget_bytes"));
    assert!(
        num(small, "bytes_read_per_token") > 10.0 * num(full, "bytes_read_per_token").max(1.0),
        "{small}\n{full}"
    );
    assert!(num(small, "cache_hit_rate") < num(full, "cache_hit_rate"));
    // Predicted sparsity costs quality that the exact modes do not.
    let predicted = find("leanstream-predicted", Some(10));
    assert!(num(predicted, "kl_vs_dense") > num(resident, "kl_vs_dense"));
    // Ablations ran at both budgets.
    for label in ["leanstream-no-lookahead", "leanstream-lru"] {
        assert_eq!(runs.iter().filter(|r| r["label"] == label).count(), 2);
    }
    assert_eq!(v["summary"]["budgets"].as_array().unwrap().len(), 2);
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<polyline") && svg.contains(">leanstream<"));
    // The timeline holds every streaming run's reads and decode steps.
    let t: Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let count = |cat: &str| events.iter().filter(|e| e["cat"] == cat).count();
    assert!(
        count("read") > 0 && count("decode") >= 24,
        "{} events",
        events.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `bench --prompt N`: each policy prefills an N-token prompt and reports prefill and decode
/// rates and the time to the first token; a streaming policy under a budget reads what it needs.
#[test]
fn bench_prompt_measures_prefill_beside_decode() {
    let dir = leanstream_tests::scratch_dir("leanstream-bench-prompt-test");
    let model = dir.join("austen.lsb");
    convert(&workspace().join("models/austen-relu"), &model, &[]);
    let out = Command::new(bin("leanstream"))
        .arg("bench")
        .arg("--model")
        .arg(&model)
        .args([
            "--prompt",
            "100",
            "--tokens",
            "8",
            "--threads",
            "1",
            "--json",
        ])
        .args([
            "--policy",
            "resident,dense,leanstream",
            "--memory",
            "ffn:25%",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let runs = v["runs"].as_array().unwrap();
    let labels: Vec<&str> = runs.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(labels, ["resident", "dense", "leanstream"], "{v}");
    let num = |r: &Value, k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    for r in runs {
        assert!(r["error"].is_null(), "{r}");
        assert_eq!(num(r, "prompt_tokens"), 100.0, "{r}");
        assert_eq!(num(r, "tokens"), 8.0, "{r}");
        let (pp, ttft) = (num(r, "prompt_tokens_per_s"), num(r, "ttft_ms"));
        // The first token comes after the whole prompt: at least its prefill time.
        assert!(pp > 0.0 && ttft >= 100.0 / pp * 1e3 * 0.999, "{r}");
        assert!(num(r, "prompt_tokens_per_cpu_s") > 0.0, "{r}");
        assert!(num(r, "tokens_per_s") > 0.0, "{r}");
    }
    assert!(runs[0]["memory_budget_bytes"].is_null());
    let streamed = &runs[2];
    assert!(num(streamed, "memory_budget_bytes") > 0.0, "{streamed}");
    assert!(
        num(&streamed["details"], "bytes_read_per_token") > 0.0,
        "{streamed}"
    );
}
