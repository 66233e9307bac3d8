//! `leanstream-prep convert | inspect | verify` on tiny random models and the embedded model:
//! round trips, quantization error, corruption detection and atomic output.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use leanstream::source;
use leanstream::source::safetensors_dir::SafetensorsDir;
use leanstream::text::perplexity::perplexity;
use leanstream_format::ffn::Part;
use leanstream_format::quant::{dequantize_row, max_abs_error, QuantType};
use leanstream_format::LsbFile;
use leanstream_tests::tiny::{random_ids, write_tiny_model, Act, TinySpec, WeightDtype};

fn scratch() -> PathBuf {
    leanstream_tests::scratch_dir("leanstream-prep-tests")
}

fn prep(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_leanstream-prep"))
        .args(args)
        .output()
        .expect("leanstream-prep runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Writes a tiny model and converts it; returns (model dir, converted file).
fn converted(name: &str, spec: &TinySpec, quant: &str) -> (PathBuf, PathBuf) {
    let dir = leanstream_tests::fresh_dir(&scratch(), name);
    write_tiny_model(&dir, spec).unwrap();
    let out = scratch().join(format!("{name}-{quant}.lsb"));
    let o = prep(&[
        "convert",
        dir.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--quant",
        quant,
        "--calib-tokens",
        "2048",
        "--epochs",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "convert {name}: {}", stderr(&o));
    (dir, out)
}

fn models() -> Vec<(&'static str, TinySpec)> {
    vec![
        (
            "llama-relu-f32",
            TinySpec {
                act: Act::Relu,
                tied: true,
                ..TinySpec::llama()
            },
        ),
        (
            "llama-silu-f16-untied",
            TinySpec {
                dtype: WeightDtype::F16,
                ..TinySpec::llama()
            },
        ),
        (
            "qwen3-bf16-sharded",
            TinySpec {
                dtype: WeightDtype::BF16,
                shards: 3,
                ..TinySpec::qwen3()
            },
        ),
    ]
}

fn ppl(path: &Path, ids: &[u32]) -> f64 {
    let m = source::open(path).unwrap();
    perplexity(&m.model, ids, 48, false).unwrap().perplexity
}

#[test]
fn f32_conversion_keeps_perplexity_and_q8_stays_close() {
    for (name, spec) in models() {
        let ids = random_ids(7, 150, spec.vocab);
        let (dir, f32_file) = converted(name, &spec, "f32");
        let (_, q8_file) = converted(name, &spec, "q8");
        let (source, exact, q8) = (ppl(&dir, &ids), ppl(&f32_file, &ids), ppl(&q8_file, &ids));
        eprintln!("{name}: source {source:.4}, f32 file {exact:.4}, q8 file {q8:.4}");
        assert!(
            (exact / source - 1.0).abs() < 2e-4,
            "{name}: f32 {exact} vs {source}"
        );
        assert!(
            (q8 / source - 1.0).abs() < 0.02,
            "{name}: q8 {q8} vs {source}"
        );
        assert!(q8 != source, "{name}: q8 must actually quantize");
    }
}

/// Every stored weight decodes to its source value within the encoding's error bound.
#[test]
fn dequantized_weights_equal_the_source_within_the_bound() {
    let (name, spec) = models().remove(1);
    for quant in ["q4", "q8", "bf16"] {
        let (dir, file) = converted(name, &spec, quant);
        let f = LsbFile::open(&file).unwrap();
        let src = SafetensorsDir::open(&dir).unwrap();
        let mut fh = std::fs::File::open(&file).unwrap();
        let check = |q: QuantType, bytes: &[u8], want: &[f32], what: &str| {
            let mut got = vec![0.0; want.len()];
            dequantize_row(q, bytes, &mut got).unwrap();
            // Block types: the encoding's own per-block bound; floats: half an ulp of bf16 at most.
            let bound: Vec<f32> = if q.is_block() {
                let mut per_block = vec![0.0; want.len() / q.block_len()];
                max_abs_error(q, bytes, &mut per_block).unwrap();
                (0..want.len())
                    .map(|i| per_block[i / q.block_len()])
                    .collect()
            } else {
                want.iter().map(|w| w.abs() * 2f32.powi(-8)).collect()
            };
            for i in 0..want.len() {
                assert!(
                    (got[i] - want[i]).abs() <= bound[i] * 1.0001 + 1e-12,
                    "{what}[{i}]: {} vs {}",
                    got[i],
                    want[i]
                );
            }
        };
        for t in &f.dense.tensors {
            let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
            let want = src.tensor_f32(&t.name, &shape).unwrap();
            let bytes = f.read_dense(&mut fh, t).unwrap();
            let rb = bytes.len() / t.rows();
            for r in 0..t.rows() {
                check(
                    t.qtype,
                    &bytes[r * rb..(r + 1) * rb],
                    &want[r * t.cols()..(r + 1) * t.cols()],
                    &t.name,
                );
            }
        }
        let (h, n) = (spec.hidden, spec.intermediate);
        assert_eq!(
            f.meta.sparsity_rule.as_deref(),
            Some("gate_up"),
            "SiLU's default"
        );
        for (l, layer) in f.ffn.layers.iter().enumerate() {
            let p = format!("model.layers.{l}.mlp");
            let gate = src
                .tensor_f32(&format!("{p}.gate_proj.weight"), &[n, h])
                .unwrap();
            let down = src
                .tensor_f32(&format!("{p}.down_proj.weight"), &[h, n])
                .unwrap();
            for ci in 0..layer.clusters.len() {
                let (off, size) = f.cluster_extent(l, ci);
                let bytes =
                    leanstream_format::container::read_at(&mut fh, &file, off, size).unwrap();
                let c = layer.clusters[ci];
                for k in 0..c.count as usize {
                    let orig = layer.perm[c.first as usize + k] as usize;
                    let row = |part| layer.row(&bytes, ci, k, part);
                    check(
                        layer.qtypes.gate,
                        row(Part::Gate),
                        &gate[orig * h..(orig + 1) * h],
                        "gate",
                    );
                    // The gate_up rule stores each down column normalised (its norm moves to the
                    // up row), computed as the converter does.
                    let mut column: Vec<f32> = (0..h).map(|r| down[r * n + orig]).collect();
                    let norm = column.iter().map(|&v| (v as f64).powi(2)).sum::<f64>();
                    let norm = norm.sqrt() as f32;
                    column.iter_mut().for_each(|v| *v /= norm);
                    check(layer.qtypes.down, row(Part::Down), &column, "down");
                }
            }
        }
    }
}

fn embedded() -> &'static PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/austen-relu");
        let out = scratch().join("austen-q8.lsb");
        let o = prep(&[
            "convert",
            model.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--calib-tokens",
            "4096",
            "--json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        // ReLU sparsity is exact: the sparse model is the dense model.
        let q = &summary["quality"];
        assert_eq!(q["reference_perplexity"], q["perplexity"]);
        out
    })
}

#[test]
fn embedded_model_profile_is_realistic_and_predictors_beat_frequency() {
    let o = prep(&["inspect", embedded().to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for key in [
        "format_version",
        "architecture",
        "quant",
        "dense_bytes",
        "ffn_bytes",
        "sketch_bytes",
        "predictor_bytes",
        "cluster_bytes",
    ] {
        assert!(!v[key].is_null(), "{key} missing");
    }
    // The two floors at ctx 512: `min_memory_bytes` is the least `--memory` a run accepts (dense
    // weights streamed), `min_memory_dense_resident_bytes` the least with every one resident. Both
    // count the start-up RSS of the process that states them (inspect's, not this test's), which
    // can differ by a MiB of rounding: their difference is the same in both processes.
    let ctx = 512;
    let least = v["min_memory_bytes"].as_u64().unwrap();
    let resident = v["min_memory_dense_resident_bytes"].as_u64().unwrap();
    let own_least = leanstream::streaming::streaming_minimum_memory(embedded(), ctx).unwrap();
    let own_resident = leanstream::streaming::minimum_memory(embedded(), ctx).unwrap();
    assert!(least < resident, "{least} !< {resident}");
    assert_eq!(resident - least, own_resident - own_least);
    // inspect starts fresh; this process's start-up is counted when its first test asks, by then
    // with the other tests of this binary running beside it: inspect's floor is not above ours.
    assert!(least <= own_least + (2 << 20), "{least} vs {own_least}");
    // The text rendering states both, from a process of its own: the same difference.
    let text = prep(&["inspect", embedded().to_str().unwrap()]);
    let text = String::from_utf8_lossy(&text.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("  min_memory_bytes "))
        .unwrap_or_else(|| panic!("no min_memory_bytes line in\n{text}"));
    let numbers: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .filter(|&n| n > 1 << 20)
        .collect();
    assert_eq!(numbers.len(), 2, "{line}");
    assert_eq!(numbers[1] - numbers[0], resident - least, "{line}");
    assert!(
        line.contains("(the least --memory a run accepts at ctx 512; ")
            && line.ends_with(" with every dense weight resident)"),
        "{line}"
    );
    let open = |memory: u64| {
        use leanstream::text::session::{PolicyChoice, Session, SessionOptions};
        Session::open(&SessionOptions {
            model: embedded().clone(),
            policy: Some(PolicyChoice::Leanstream),
            memory: Some(memory),
            flash: leanstream::storage::FlashProfile::from_flash_arg("none").unwrap(),
            sparsity: leanstream::streaming::Sparsity::Certified,
            ctx: Some(ctx),
            default_ctx: ctx,
            kv: Default::default(),
            tuning: Default::default(),
            gpu: Default::default(),
        })
        .map(|_| ())
    };
    open(own_least).unwrap();
    let refused = open(own_least - (1 << 20)).unwrap_err().to_string();
    assert!(refused.contains("below the minimum of"), "{refused}");
    // The model card's sparsity per layer: 0.704, 0.926, 0.896, 0.817 (on other text).
    let want = [0.704, 0.926, 0.896, 0.817];
    let layers = v["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 4);
    for (l, (layer, w)) in layers.iter().zip(want).enumerate() {
        let f = |k: &str| layer[k].as_f64().unwrap();
        assert!(
            (f("sparsity") - w).abs() < 0.05,
            "layer {l} sparsity {}",
            f("sparsity")
        );
        assert!(
            f("predictor_recall") > f("static_recall"),
            "layer {l}: own predictor does not beat frequency"
        );
        assert!(
            f("lookahead_recall") > f("static_recall"),
            "layer {l}: look-ahead does not beat frequency"
        );
        assert!(
            f("cluster_fill") >= f("cluster_fill_unordered"),
            "layer {l}: placement made clusters worse"
        );
    }
}

#[test]
fn verify_detects_every_flipped_byte_and_truncation() {
    let good = std::fs::read(embedded()).unwrap();
    assert!(prep(&["verify", embedded().to_str().unwrap()])
        .status
        .success());
    let bad = scratch().join("flipped.lsb");
    let len = good.len();
    // Offsets in the header, every section, and pseudo-random places.
    let f = LsbFile::open(embedded()).unwrap();
    let mut offsets: Vec<usize> = vec![0, 9, 17, 40, 4095];
    for s in &f.header.sections {
        offsets.extend([
            s.offset as usize,
            (s.offset + s.stored_size - 1) as usize,
            (s.offset + s.length / 2) as usize,
        ]);
    }
    offsets.extend((0..40).map(|i| (i * 7919 * 4099) % len));
    for off in offsets {
        let mut bytes = good.clone();
        bytes[off] ^= 0x20;
        std::fs::write(&bad, &bytes).unwrap();
        let o = prep(&["verify", bad.to_str().unwrap()]);
        assert_eq!(
            o.status.code(),
            Some(1),
            "flip at {off} not detected: {}",
            stderr(&o)
        );
        assert!(stderr(&o).contains("flipped.lsb"), "{}", stderr(&o));
    }
    for cut in [0, 100, 4096, len / 3, len - 4096, len - 1] {
        std::fs::write(&bad, &good[..cut]).unwrap();
        let o = prep(&["verify", bad.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1), "truncation at {cut} not detected");
    }
}

#[test]
fn runtime_refuses_a_corrupted_bundle() {
    let f = LsbFile::open(embedded()).unwrap();
    let (off, _) = f.cluster_extent(2, 1);
    let mut bytes = std::fs::read(embedded()).unwrap();
    bytes[off as usize + 10] ^= 1;
    let bad = scratch().join("bad-bundle.lsb");
    std::fs::write(&bad, &bytes).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_leanstream-prep"))
        .arg("verify")
        .arg(&bad)
        .output()
        .unwrap();
    assert!(stderr(&o).contains("layer 2 cluster 1"), "{}", stderr(&o));
    let err = source::open(&bad)
        .err()
        .expect("a corrupted bundle must not load");
    assert!(format!("{err:#}").contains("checksum"), "{err:#}");
}

#[test]
fn failed_conversions_leave_no_output() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/austen-relu");
    let m = model.to_str().unwrap();
    let dir = leanstream_tests::fresh_dir(&scratch(), "atomic");
    let out = dir.join("out.lsb");
    std::fs::write(&out, b"the user's file").unwrap();
    // Calibration text that does not exist: the error names it, the old output is untouched.
    let o = prep(&[
        "convert",
        m,
        "-o",
        out.to_str().unwrap(),
        "--calib",
        "/nonexistent/calib.txt",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("/nonexistent/calib.txt"),
        "{}",
        stderr(&o)
    );
    assert_eq!(std::fs::read(&out).unwrap(), b"the user's file");
    let missing = dir.join("no/such/dir/out.lsb");
    let o = prep(&[
        "convert",
        m,
        "-o",
        missing.to_str().unwrap(),
        "--calib-tokens",
        "1024",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers.len(), 1, "temporary files left: {leftovers:?}");
    let o = prep(&["convert", m, "-o", "/tmp/x.lsb", "--quant", "q3"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "an unknown --quant is a usage error"
    );
}

/// A hub id resolves through the standard cache layout (`$HF_HOME/hub/models--owner--name`) with
/// `HF_HUB_OFFLINE=1`, without network.
#[test]
fn hub_ids_resolve_from_the_offline_cache() {
    let home = leanstream_tests::fresh_dir(&scratch(), "hf-home");
    let repo = home.join("hub/models--test-org--austen");
    let snapshot = repo.join("snapshots/0123456789abcdef");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123456789abcdef").unwrap();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/austen-relu");
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(model.join(f), snapshot.join(f)).unwrap();
    }
    let out = scratch().join("from-hub.lsb");
    let run = |id: &str| {
        Command::new(env!("CARGO_BIN_EXE_leanstream-prep"))
            .args([
                "convert",
                id,
                "-o",
                out.to_str().unwrap(),
                "--calib-tokens",
                "1024",
                "--epochs",
                "1",
                "--json",
            ])
            .env("HF_HOME", &home)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap()
    };
    let o = run("test-org/austen");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(LsbFile::open(&out).is_ok());
    let o = run("test-org/absent");
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("HF_HUB_OFFLINE"), "{}", stderr(&o));
}

/// `--sparsity auto` on a SwiGLU model: the largest measured fraction within 2 % of the dense
/// held-out perplexity, the next step above it over, said on stderr, and the file's own held-out
/// check of the chosen thresholds gives the very cost the search measured.
#[test]
fn auto_sparsity_picks_the_largest_fraction_within_two_percent() {
    let (name, spec) = models().remove(1);
    let dir = leanstream_tests::fresh_dir(&scratch(), "auto");
    write_tiny_model(&dir, &spec).unwrap();
    let out = scratch().join(format!("{name}-auto.lsb"));
    let o = prep(&[
        "convert",
        dir.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--calib-tokens",
        "2048",
        "--epochs",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("--sparsity auto: target:"),
        "{}",
        stderr(&o)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let auto = &v["sparsity_auto"];
    let (f, cost) = (
        auto["fraction"].as_f64().unwrap(),
        auto["cost"].as_f64().unwrap(),
    );
    assert!(cost <= 0.02, "{auto}");
    let tried: Vec<(f64, f64)> = auto["tried"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t[0].as_f64().unwrap(), t[1].as_f64().unwrap()))
        .collect();
    // Every fraction tried above the choice costs more than 2 %, and the one just above is tried.
    assert!(
        tried.iter().all(|&(g, c)| g <= f + 1e-6 || c > 0.02),
        "{auto}"
    );
    if f < 0.8 - 1e-6 {
        assert!(
            tried.iter().any(|&(g, _)| (g - f - 0.05).abs() < 1e-6),
            "{auto}"
        );
    }
    let q = &v["quality"];
    let own = q["perplexity"].as_f64().unwrap() / q["reference_perplexity"].as_f64().unwrap() - 1.0;
    assert_eq!(own, cost, "the file's thresholds are the ones measured");
    let file = LsbFile::open(&out).unwrap();
    assert_eq!(
        file.meta.sparsity_target.map(f64::from),
        Some(f as f32 as f64)
    );
    assert_eq!(file.meta.sparsity_rule.as_deref(), Some("gate_up"));
    // A SwiGLU model without --calib is calibrated on the varied default text.
    assert!(
        file.meta.provenance["calib_text"]
            .as_str()
            .unwrap()
            .starts_with("default: varied"),
        "{}",
        file.meta.provenance
    );
    // The rule, each layer's threshold and its sparsity measured on the held-out windows are in
    // META and in `inspect` (--json and text) alike.
    let o = prep(&["inspect", out.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["sparsity_rule"], "gate_up");
    assert_eq!(
        j["sparsity_target"].as_f64().map(|t| t as f32),
        Some(f as f32)
    );
    let layers = j["layers"].as_array().unwrap();
    assert_eq!(layers.len(), file.meta.layers.len());
    for (l, m) in layers.iter().zip(&file.meta.layers) {
        let (t, sp) = (l["threshold"].as_f64(), l["sparsity"].as_f64());
        assert_eq!(t.map(|t| t as f32), Some(m.threshold), "{l}");
        assert_eq!(sp.map(|s| s as f32), Some(m.sparsity), "{l}");
        assert!(m.threshold > 0.0 && m.sparsity > 0.0, "{l}");
    }
    let o = prep(&["inspect", out.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains(&format!(
            "sparsity threshold (target fraction {f:.2})  rule gate_up (a neuron is skipped when \
             |act(gate·x)·(up·x)| <= its layer's threshold)"
        )),
        "{text}"
    );
    for (i, m) in file.meta.layers.iter().enumerate() {
        let row = format!("{i:>5}  {:>9.4}  {:>8.3}", m.threshold, m.sparsity);
        assert!(text.contains(&row), "layer {i} ({row}) missing:\n{text}");
    }
}

#[test]
fn a_converted_folder_stops_at_the_same_tokens_as_a_run_of_the_folder() {
    // config.json ends generations at 0; generation_config.json adds 7 (as chat models list their
    // end-of-turn token there), once more 0 and a repeat.
    let spec = TinySpec {
        act: Act::Relu,
        ..TinySpec::llama()
    };
    let (dir, _) = converted("eos-plain", &spec, "f32");
    let plain = LsbFile::open(&scratch().join("eos-plain-f32.lsb")).unwrap();
    assert_eq!(plain.meta.model.eos_token_ids, vec![0]);
    assert_eq!(source::open(&dir).unwrap().eos_token_ids, vec![0]);

    let dir = leanstream_tests::fresh_dir(&scratch(), "eos-generation-config");
    write_tiny_model(&dir, &spec).unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"bos_token_id": 1, "eos_token_id": [7, 0, 7]}"#,
    )
    .unwrap();
    let out = scratch().join("eos-generation-config.lsb");
    let o = prep(&[
        "convert",
        dir.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--quant",
        "f32",
        "--calib-tokens",
        "2048",
        "--epochs",
        "2",
    ]);
    assert!(o.status.success(), "convert: {}", stderr(&o));
    let dense = source::open(&dir).unwrap().eos_token_ids;
    assert_eq!(dense, vec![0, 7]);
    assert_eq!(LsbFile::open(&out).unwrap().meta.model.eos_token_ids, dense);
    assert_eq!(source::open(&out).unwrap().eos_token_ids, dense);
}
