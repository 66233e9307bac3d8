//! A first run that does not wait for calibration: `convert --layout-only` writes the weights at
//! once (original neuron order, thresholds 0, no certificate, predictors naming every neuron), and
//! such a file streams exactly — the same greedy tokens as `resident` and `dense`. `calibrate`
//! then upgrades it in place into, byte for byte, the file a direct `convert` writes, which still
//! streams exactly. `run --memory` on an unconverted model converts layout-only; the converter
//! keeps to `--memory` or refuses up front.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use leanstream_format::LsbFile;
use leanstream_tests::cli::{assert_clean_failure, bin, embedded_model, json_output, stderr};
use leanstream_tests::converted::scratch;
use leanstream_tests::tiny::{write_tiny_model, TinySpec};

/// Calibration settings small enough for a test, the same for every conversion compared here.
const CALIB: [&str; 4] = ["--calib-tokens", "1024", "--epochs", "1"];

fn prep(args: &[&str], files: &[&Path]) -> Output {
    let mut c = Command::new(bin("leanstream-prep"));
    c.args(&args[..1]);
    c.args(files);
    c.args(&args[1..]);
    c.output().unwrap()
}

/// The greedy tokens of `run` on `model` with `flags`.
fn tokens(model: &Path, flags: &[&str]) -> Vec<u64> {
    let o = Command::new(bin("leanstream"))
        .arg("run")
        .arg("--model")
        .arg(model)
        .args([
            "-p",
            "It was a fine morning, and Emma",
            "-n",
            "24",
            "--json",
        ])
        .args(flags)
        .output()
        .unwrap();
    let v = json_output(&o);
    v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// Greedy tokens streamed under a small budget equal `resident`'s and, where `dense` (no neuron
/// skipped by the file's sparsity: a layout-only file's), the dense model's.
fn exact_everywhere(file: &Path, dense: bool) {
    let streamed = tokens(file, &["--memory", "ffn:25%", "--flash", "ufs4"]);
    assert_eq!(streamed.len(), 24);
    let resident = tokens(file, &["--policy", "resident"]);
    assert_eq!(streamed, resident, "{file:?}");
    if dense {
        assert_eq!(streamed, tokens(file, &["--policy", "dense"]), "{file:?}");
    }
}

/// Layout-only, then calibrated in place, against a direct conversion of `model` (with `extra`).
fn layout_then_calibrate(name: &str, model: &Path, extra: &[&str]) {
    let dir = scratch();
    let (layout, direct) = (
        dir.join(format!("{name}-layout.lsb")),
        dir.join(format!("{name}-direct.lsb")),
    );
    let mut args = vec!["convert", "-o", layout.to_str().unwrap(), "--layout-only"];
    args.extend(extra);
    let o = prep(&args, &[model]);
    assert!(o.status.success(), "{}", stderr(&o));
    let f = LsbFile::open(&layout).unwrap();
    assert!(f.meta.layout_only);
    assert_eq!(f.header.version_minor, 8);
    for (l, layer) in f.ffn.layers.iter().enumerate() {
        assert!(
            layer.perm.iter().enumerate().all(|(p, &i)| p == i as usize),
            "layer {l}: natural order"
        );
        assert_eq!(f.meta.layers[l].threshold, 0.0);
    }
    exact_everywhere(&layout, true);
    let o = prep(&["inspect"], &[&layout]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("layout only: not calibrated"));

    // Calibrated in place; plain progress lines on stderr (not a terminal), one per phase.
    let mut args = vec!["calibrate"];
    args.extend(CALIB);
    let o = prep(&args, &[&layout]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("calibrate: "), "{}", stderr(&o));
    let f = LsbFile::open(&layout).unwrap();
    assert!(!f.meta.layout_only);
    // 1.8 only for per-part encodings (a GGUF file's kept rows), never for `layout_only`.
    let per_part = f.ffn.minor_version() >= 8;
    let features = f.meta.minor_version().max(f.dense.minor_version());
    assert!(per_part || features < 8, "{features}");
    // A calibrated file holds INPUT_BASIS (1.10).
    assert_eq!(f.header.version_minor, 10);
    assert!(
        f.ffn
            .layers
            .iter()
            .any(|l| l.perm.iter().enumerate().any(|(p, &i)| p != i as usize)),
        "a learned order"
    );
    exact_everywhere(&layout, false);

    let mut args = vec!["convert", "-o", direct.to_str().unwrap(), "--json"];
    args.extend(CALIB);
    args.extend(extra);
    let v = json_output(&prep(&args, &[model]));
    assert!(v["seconds"]["layout"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["seconds"]["profile"].as_f64().unwrap() > 0.0, "{v}");
    assert!(
        std::fs::read(&layout).unwrap() == std::fs::read(&direct).unwrap(),
        "calibrated in place differs from the direct conversion"
    );
}

#[test]
fn a_layout_only_relu_model_streams_exactly_and_calibrates_into_what_convert_writes() {
    layout_then_calibrate("layout-relu", &embedded_model(), &[]);
}

#[test]
fn a_layout_only_silu_model_streams_exactly_and_calibrates_into_what_convert_writes() {
    // SiLU: the gate_up rule, whose up rows and down columns the layout pass rescales.
    let dir = leanstream_tests::fresh_dir(&scratch(), "layout-silu-model");
    write_tiny_model(&dir, &TinySpec::llama()).unwrap();
    layout_then_calibrate("layout-silu", &dir, &["--sparsity", "target:0.5"]);
}

#[test]
fn a_layout_only_k_quant_gguf_keeps_its_rows_and_calibrates_into_what_convert_writes() {
    // `--quant auto`: gate and up rows as stored (Q4_K/Q6_K), up rows rescaled by powers of two
    // under the gate_up rule, down columns encoded afresh; calibrate moves them unchanged.
    let gguf = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/arch/llama-k.q4_k_m.gguf");
    layout_then_calibrate("layout-gguf", &gguf, &["--sparsity", "target:0.5"]);
}

/// `run --memory` on a model folder converts it layout-only into the cache and streams it with
/// the tokens `resident` gives on the cached file.
#[test]
fn a_first_run_converts_layout_only() {
    let cache = leanstream_tests::fresh_dir(&scratch(), "layout-first-cache");
    let o = Command::new(bin("leanstream"))
        .env("LEANSTREAM_CACHE", &cache)
        .env("LEANSTREAM_PREP", bin("leanstream-prep"))
        .arg("run")
        .arg("--model")
        .arg(embedded_model())
        .args(["--memory", "40MiB", "-n", "24", "--json"])
        .args(["-p", "It was a fine morning, and Emma"])
        .output()
        .unwrap();
    let v = json_output(&o);
    assert!(
        stderr(&o).contains("leanstream-prep calibrate"),
        "{}",
        stderr(&o)
    );
    let cached: Vec<PathBuf> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "lsb"))
        .collect();
    assert_eq!(cached.len(), 1, "{cached:?}");
    assert!(LsbFile::open(&cached[0]).unwrap().meta.layout_only);
    let streamed: Vec<u64> = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(streamed, tokens(&cached[0], &["--policy", "resident"]));
}

/// `--memory B`: the default calibration shrinks to fit and the process stays within the larger
/// of B and its stated floor; a conversion that cannot is refused before any work, naming what
/// it needs and the command for a larger machine.
#[test]
fn the_converter_keeps_to_its_memory_or_refuses_up_front() {
    let out = scratch().join("layout-budget.lsb");
    let out = out.to_str().unwrap();
    let budget = ["convert", "-o", out, "--memory", "1MB"];
    let refused = prep(
        &[&budget[..], &["--calib-tokens", "16384"]].concat(),
        &[&embedded_model()],
    );
    assert_clean_failure(
        "calibration tokens beyond the budget",
        &refused,
        1,
        &[
            "converting needs about",
            "leanstream-prep convert",
            "--calib-tokens",
        ],
    );
    assert!(!Path::new(out).exists(), "nothing written");
    let v = json_output(&prep(
        &[&budget[..], &["--json"]].concat(),
        &[&embedded_model()],
    ));
    // The embedded model's default is 16384 tokens; 1 MB asks for the fewest.
    assert_eq!(v["calib_tokens"].as_u64().unwrap(), 2048, "{v}");
    let (peak, floor) = (
        v["peak_rss_bytes"].as_u64().unwrap(),
        v["memory_estimate"]["total"].as_u64().unwrap(),
    );
    assert!(peak <= floor, "peak {peak} > stated floor {floor}");
}

/// `--sparsity auto` on a SwiGLU model: its bisection measures 4 or 5 fractions, the file's
/// exact-mode quality is the one the search measured at the fraction it chose, and converting
/// on one thread and on two writes the same bytes.
#[test]
fn an_auto_conversion_is_the_same_on_one_thread_and_two() {
    let dir = leanstream_tests::fresh_dir(&scratch(), "auto-threads-model");
    write_tiny_model(&dir, &TinySpec::llama()).unwrap();
    let convert = |threads: &str, name: &str| {
        let out = scratch().join(name);
        let o = Command::new(bin("leanstream-prep"))
            .env("RAYON_NUM_THREADS", threads)
            .arg("convert")
            .arg(&dir)
            .args(["-o", out.to_str().unwrap(), "--json"])
            .args(CALIB)
            .output()
            .unwrap();
        (json_output(&o), std::fs::read(&out).unwrap())
    };
    let (v, one) = convert("1", "auto-1-thread.lsb");
    let (_, two) = convert("2", "auto-2-threads.lsb");
    assert!(one == two, "1 and 2 threads wrote different files");
    let auto = &v["sparsity_auto"];
    let tried = auto["tried"].as_array().unwrap();
    assert!((4..=5).contains(&tried.len()), "{auto}");
    let fraction = auto["fraction"].as_f64().unwrap();
    let cost = auto["cost"].as_f64().unwrap();
    assert!(cost <= auto["max_cost"].as_f64().unwrap(), "{auto}");
    let q = &v["quality"];
    let measured = q["perplexity"].as_f64().unwrap() / q["reference_perplexity"].as_f64().unwrap();
    if fraction > 0.0 {
        assert_eq!(measured - 1.0, cost, "{v}");
        assert!(
            tried.iter().any(|t| t[0].as_f64() == Some(fraction)),
            "{auto}"
        );
    }
    let p = &v["predicted_quality"];
    assert_eq!(p["reference_perplexity"], q["reference_perplexity"], "{v}");
    assert!(p["perplexity"].as_f64().unwrap() > 1.0, "{v}");
}
