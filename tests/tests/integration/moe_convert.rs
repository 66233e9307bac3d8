//! Mixtures of experts (format 1.5's experts, in a 1.6 file) converted and run from the file.
//! `convert` of the tiny Qwen3-MoE (a dense layer among its mixtures) and Mixtral (a sliding
//! window) directories writes every expert as neuron bundles in clusters and the routing profile,
//! which `inspect` shows; `--policy resident` and `dense` on an f32 file give logits bit-identical
//! to the directory's (whose agreement with the f64 reference `engine_vs_reference` checks), `run`
//! the same greedy tokens and `perplexity` the reference's within 2e-4; a q8 file stays near; its
//! experts streamed (`--memory`, `--policy leanstream`) give the same greedy tokens (`moe_stream`
//! checks the bits at three budgets); a policy experts do not have is refused, naming the mixture.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use leanstream::model::Model;
use leanstream::text::session::{PolicyChoice, Session};
use leanstream_format::quant::QuantType;
use leanstream_format::LsbFile;
use leanstream_tests::cli::{assert_clean_failure, bin, stderr};
use leanstream_tests::converted::{convert, exact_options};
use leanstream_tests::fresh_dir;
use leanstream_tests::reference::ReferenceModel;
use leanstream_tests::tiny::{random_ids, write_tiny_model, TinySpec};

const PROMPT: &str = "It was a fine morning, and the whole party";
const TEXT: &str = "It is a truth universally acknowledged, that a single man in possession of a \
    good fortune, must be in want of a wife. However little known the feelings or views of such a \
    man may be on his first entering a neighbourhood, this truth is so well fixed in the minds of \
    the surrounding families, that he is considered the rightful property of some one or other of \
    their daughters.";

/// The tiny model `spec` in a fresh directory, and its conversion with `flags`.
fn converted(name: &str, spec: &TinySpec, flags: &[&str]) -> (PathBuf, PathBuf) {
    let dir = fresh_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), name);
    write_tiny_model(&dir, spec).unwrap();
    let file = dir.join("model.lsb");
    convert(&dir, &file, flags);
    (dir, file)
}

fn leanstream(args: &[&str], model: &Path) -> Output {
    Command::new(bin("leanstream"))
        .args(args)
        .arg("--model")
        .arg(model)
        .args(["--kv", "f32", "--json"])
        .output()
        .unwrap()
}

fn json(what: &str, o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "{what}: {}", stderr(o));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Every position's logits of `ids`, from the file opened with `policy`.
fn file_logits(file: &Path, policy: PolicyChoice, ids: &[u32]) -> Vec<f32> {
    let mut s = Session::open(&exact_options(file, policy, None, 64)).unwrap();
    let m = s.model();
    let mut cache = m.new_cache(ids.len());
    m.forward(ids, &mut cache, true).unwrap()
}

/// The routing profile `inspect --json` shows: per mixture layer, the expert frequencies sum to
/// top-k and the recalls are fractions. Returns (look-ahead recall, token reuse) per layer.
fn routing_profile(file: &Path, spec: &TinySpec) -> Vec<(f64, f64)> {
    let o = Command::new(bin("leanstream-prep"))
        .args(["inspect", "--json"])
        .arg(file)
        .output()
        .unwrap();
    let v = json("inspect", &o);
    let moe = spec.moe.as_ref().unwrap();
    // Experts need 1.5; the converter's split clusters make it 1.6.
    assert_eq!(v["format_version"], "1.6");
    assert_eq!(v["cluster_layout"], "split");
    assert_eq!(v["experts"]["num_experts"], moe.experts);
    assert_eq!(v["experts"]["experts_per_token"], moe.top_k);
    let mut profile = Vec::new();
    for (l, layer) in v["layers"].as_array().unwrap().iter().enumerate() {
        let r = &layer["routing"];
        if !moe.is_moe_layer(spec.arch, l) {
            assert!(r.is_null(), "layer {l} is dense");
            assert_eq!(layer["experts"], 0);
            continue;
        }
        assert_eq!(layer["experts"], moe.experts, "layer {l}");
        let freq: Vec<f64> = serde_json::from_value(r["expert_freq"].clone()).unwrap();
        assert_eq!(freq.len(), moe.experts);
        let sum: f64 = freq.iter().sum();
        assert!((sum - moe.top_k as f64).abs() < 1e-3, "layer {l}: {freq:?}");
        let (ahead, reuse) = (
            r["lookahead_recall"].as_f64().unwrap(),
            r["token_reuse"].as_f64().unwrap(),
        );
        assert!((0.0..=1.0).contains(&ahead) && (0.0..=1.0).contains(&reuse));
        // Co-selection with the next mixture layer, except on the last one.
        let partners: Vec<u32> =
            serde_json::from_value(r["next_partners"].clone()).unwrap_or_default();
        let shares: Vec<f64> =
            serde_json::from_value(r["next_partner_share"].clone()).unwrap_or_default();
        let last = (l + 1..spec.layers).all(|n| !moe.is_moe_layer(spec.arch, n));
        if last {
            assert!(partners.is_empty() && shares.is_empty(), "layer {l}");
        } else {
            assert_eq!((partners.len(), shares.len()), (moe.experts, moe.experts));
            assert!(partners.iter().all(|&p| (p as usize) < moe.experts));
            // A partner is chosen by at least an even share of the tokens (top-k of E).
            let floor = moe.top_k as f64 / moe.experts as f64;
            for (&share, &f) in shares.iter().zip(&freq) {
                assert!(
                    f == 0.0 || (floor - 1e-6..=1.0).contains(&share),
                    "layer {l}: {shares:?}"
                );
            }
        }
        profile.push((ahead, reuse));
    }
    profile
}

fn check(name: &str, spec: &TinySpec) {
    let (dir, file) = converted(name, spec, &["--quant", "f32"]);
    let f = LsbFile::open(&file).unwrap();
    assert_eq!(f.header.version_minor, 6);
    let moe = spec.moe.as_ref().unwrap();
    for (l, experts) in f.experts.layers.iter().enumerate() {
        let want = if moe.is_moe_layer(spec.arch, l) {
            moe.experts
        } else {
            0
        };
        assert_eq!(experts.len(), want, "{name}: layer {l}'s experts");
    }
    let o = Command::new(bin("leanstream-prep"))
        .arg("verify")
        .arg(&file)
        .output()
        .unwrap();
    assert!(o.status.success(), "verify: {}", stderr(&o));
    let profile = routing_profile(&file, spec);
    eprintln!(
        "{name}: routing profile (look-ahead recall, token reuse) per mixture layer: {profile:?}"
    );

    // In process: both policies on the f32 file are the directory's model, bit for bit.
    let ids = random_ids(spec.seed + 7, 40, spec.vocab);
    let from_dir = Model::load(&dir).unwrap();
    let mut cache = from_dir.new_cache(ids.len());
    let want = from_dir.forward(&ids, &mut cache, true).unwrap();
    for policy in [PolicyChoice::Resident, PolicyChoice::Dense] {
        assert_eq!(
            file_logits(&file, policy, &ids),
            want,
            "{name}: {policy:?} on the file against the directory"
        );
    }

    // Through the command line: the same greedy tokens, and the reference's perplexity.
    let n = "12";
    let run = [
        "run",
        "-p",
        PROMPT,
        "-n",
        n,
        "--temp",
        "0",
        "--repeat-penalty",
        "1",
    ];
    let tokens = |o: &Output| -> Vec<u32> {
        serde_json::from_value(json("run", o)["tokens"].clone()).unwrap()
    };
    let from_dir = tokens(&leanstream(&run, &dir));
    assert_eq!(
        from_dir.len(),
        12,
        "{name}: pick another seed (an early end of text)"
    );
    for policy in ["resident", "dense"] {
        let mut args = run.to_vec();
        args.extend(["--policy", policy]);
        assert_eq!(
            tokens(&leanstream(&args, &file)),
            from_dir,
            "{name}: run --policy {policy}"
        );
    }
    // Without --policy a mixture's file runs resident.
    assert_eq!(tokens(&leanstream(&run, &file)), from_dir, "{name}: run");
    let text = dir.join("text.txt");
    std::fs::write(&text, TEXT).unwrap();
    let o = leanstream(
        &[
            "perplexity",
            "--file",
            text.to_str().unwrap(),
            "--ctx",
            "32",
            "--policy",
            "resident",
        ],
        &file,
    );
    let ppl = json("perplexity", &o)["perplexity"].as_f64().unwrap();
    let tokenizer = leanstream::tokenizer::Tokenizer::from_dir(&dir).unwrap();
    let ids = tokenizer.encode(TEXT, false).unwrap();
    let (ref_ppl, _) = ReferenceModel::load(&dir)
        .unwrap()
        .perplexity(&ids, 32)
        .unwrap();
    let rel = (ppl - ref_ppl).abs() / ref_ppl;
    eprintln!(
        "{name}: perplexity from the file {ppl:.6}, f64 reference {ref_ppl:.6} (rel {rel:.3e})"
    );
    assert!(
        rel < 2e-4,
        "{name}: perplexity {ppl} vs reference {ref_ppl}"
    );

    // Its experts streamed (under a budget, or asked by policy): the same greedy tokens, with the
    // expert figures in the report; a policy experts do not have is refused, naming the mixture.
    for extra in [&["--memory", "1GiB"][..], &["--policy", "leanstream"]] {
        let mut args = run.to_vec();
        args.extend(extra);
        let o = leanstream(&args, &file);
        assert_eq!(tokens(&o), from_dir, "{name}: run {extra:?}");
        let v = json("run", &o);
        assert!(v["expert_hit_rate"].is_f64(), "{name}: {v}");
    }
    let mut args = run.to_vec();
    args.extend(["--policy", "mmap"]);
    let o = leanstream(&args, &file);
    assert_clean_failure(
        "a mixture under mmap",
        &o,
        1,
        &["mixture of experts", "--policy leanstream"],
    );
}

#[test]
fn a_converted_qwen3_moe_runs_as_its_directory() {
    let spec = TinySpec {
        seed: 61,
        ..TinySpec::qwen3_moe()
    };
    check("moe-convert-qwen3", &spec);
}

#[test]
fn a_converted_mixtral_runs_as_its_directory() {
    let spec = TinySpec {
        seed: 62,
        layers: 2,
        ..TinySpec::mixtral()
    };
    check("moe-convert-mixtral", &spec);
}

/// Quantized files: the experts really are quantized (the logits move off the f32 model's), q8
/// less than q4, and the routers stay f32 whatever the quantization.
#[test]
fn quantized_mixtures_move_off_the_f32_model_q8_least() {
    let spec = TinySpec {
        seed: 63,
        layers: 2,
        ..TinySpec::mixtral()
    };
    let ids = random_ids(spec.seed + 7, 40, spec.vocab);
    let mut diffs = Vec::new();
    let mut exact = None;
    for (quant, qtype) in [("q8", QuantType::Q8_0), ("q4", QuantType::Q4_0)] {
        let (dir, file) = converted(&format!("moe-convert-{quant}"), &spec, &["--quant", quant]);
        let f = LsbFile::open(&file).unwrap();
        let router = f.dense.get("model.layers.0.mlp.gate.weight").unwrap();
        assert_eq!(router.qtype, QuantType::F32, "{quant}: the router");
        assert!(f
            .experts
            .layers
            .iter()
            .flatten()
            .all(|x| x.qtypes.single() == Some(qtype)));
        let exact = exact.get_or_insert_with(|| {
            let model = Model::load(&dir).unwrap();
            let mut cache = model.new_cache(ids.len());
            model.forward(&ids, &mut cache, true).unwrap()
        });
        let got = file_logits(&file, PolicyChoice::Resident, &ids);
        let diff = got
            .iter()
            .zip(exact.iter())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("{quant} mixture: max |logit - f32 logit| {diff:.3e}");
        diffs.push(diff);
    }
    assert!(diffs[0] > 0.0 && diffs[0] < diffs[1], "{diffs:?}");
}
