//! The real SmolLM2-135M-Instruct from its Q4_1 GGUF (`scripts/fetch-smollm2.sh` puts it in the
//! cache; CI runs that first): a greedy answer, perplexity against llama.cpp on the same weights,
//! tokenizer ids equal to llama.cpp's, and errors for a damaged file.

use std::path::PathBuf;
use std::process::{Command, Output};

use leanstream::source::gguf::GgufFile;
use leanstream::tokenizer::gguf as gguf_tokenizer;

use crate::support;

use support::{fixture, prep, smollm2};

fn leanstream(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .args(args)
        .output()
        .expect("the leanstream binary runs")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}

#[test]
fn greedy_answer_names_paris() {
    let model = smollm2();
    let v = json(&leanstream(&[
        "run",
        "--model",
        model.to_str().unwrap(),
        "-p",
        "The capital of France is",
        "--temp",
        "0",
        "-n",
        "8",
        "--json",
    ]));
    let text = v["text"].as_str().unwrap();
    assert!(text.contains("Paris"), "{text:?}");
    assert_eq!(v["prompt_tokens"], 5);
}

/// A chat answer ends with the template's end-of-turn token; `--ignore-eos` generates all `-n`
/// tokens past it (what the llama.cpp comparison scripts time), the same tokens up to there.
/// Where the greedy answer ends hangs on the last bits of the logits (between a few and 70 tokens
/// with the kernels of the hosts seen so far), so the test finds the end first and then asks for
/// a few tokens past it, with the host's fastest kernels (the `portable` ones take a minute here).
#[test]
fn ignore_eos_generates_every_token() {
    let model = smollm2();
    let answer = |n: u64, extra: &[&str]| {
        let n = n.to_string();
        let args = [
            "run",
            "--model",
            model.to_str().unwrap(),
            "--chat",
            "-p",
            "What is the capital of France? Answer in one word.",
            "--temp",
            "0",
            "-n",
            &n,
            "--json",
        ];
        let v = json(&leanstream(&[&args[..], extra].concat()));
        let tokens: Vec<u64> = v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect();
        (v["generated_tokens"].as_u64().unwrap(), tokens)
    };
    let limit = 256;
    let (stopped, first) = answer(limit, &[]);
    assert!(
        stopped < limit,
        "the answer did not end within {limit} tokens"
    );
    let (all, every) = answer(stopped + 8, &["--ignore-eos"]);
    assert_eq!(all, stopped + 8);
    assert_eq!(first[..], every[..first.len()]);
}

/// Perplexity over the first windows of `data/heldout-head.txt` (what llama.cpp scored: see
/// `tests/fixtures/smollm2-perplexity.json` and the script named there), with the KV cache in f32
/// as llama.cpp's was; the default f16 cache stays within 0.5 % of it.
#[test]
fn perplexity_matches_llama_cpp_on_the_same_weights() {
    let reference: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixture("smollm2-perplexity.json")).expect("fixture"),
    )
    .unwrap();
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data/heldout-head.txt"),
    )
    .unwrap();
    let bytes = reference["text_bytes"].as_u64().unwrap() as usize;
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("smollm2-heldout-part.txt");
    std::fs::write(&file, &text[..bytes]).unwrap();
    let model = smollm2();
    let ppl = |kv: &str| {
        let v = json(&leanstream(&[
            "perplexity",
            "--model",
            model.to_str().unwrap(),
            "--file",
            file.to_str().unwrap(),
            "--ctx",
            "512",
            "--kv",
            kv,
            "--json",
        ]));
        assert_eq!(v["tokens"], reference["tokens"]);
        v["perplexity"].as_f64().unwrap()
    };
    // llama.cpp's figures are with an f32 KV cache. The text is scored in prompt chunks, whose
    // mat-mats multiply the file's 4-bit weights by activations quantized to q8 per block of 32,
    // as decoding does and as llama.cpp does for the file as shipped: that figure is the reference
    // (measured +0.07 %: the q8 scales are f32 here, f16 in ggml's q8_1), and the weights
    // dequantized to f32 stay within 0.6 % (measured +0.48 %; llama.cpp's q4_1 file +0.41 %).
    let f32_ppl = ppl("f32");
    let expected = reference["llama_cpp_q4_1"]["perplexity"].as_f64().unwrap();
    let f32_weights = reference["llama_cpp_f32"]["perplexity"].as_f64().unwrap();
    assert!(f32_ppl < 60.0, "perplexity {f32_ppl}");
    assert!(
        (f32_ppl / expected - 1.0).abs() < 1e-3,
        "perplexity {f32_ppl}, llama.cpp on the same q4_1 file {expected}"
    );
    assert!(
        (f32_ppl / f32_weights - 1.0).abs() < 6e-3,
        "perplexity {f32_ppl}, llama.cpp on the weights dequantized to f32 {f32_weights}"
    );
    // The default f16 cache (measured: -0.0003 %; q8_0, -0.007 %, is checked on the embedded
    // model by kv_cache.rs).
    let f16_ppl = ppl("f16");
    eprintln!("KV cache f32 {f32_ppl:.5}, f16 {f16_ppl:.5}");
    assert!((f16_ppl / f32_ppl - 1.0).abs() <= 0.005, "f16 {f16_ppl}");
    assert_ne!(f16_ppl, f32_ppl);
}

#[test]
fn tokenizer_ids_equal_llama_cpps() {
    let fixture: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("smollm2-tokenizer.json")).expect("fixture"))
            .unwrap();
    let file = GgufFile::open(&smollm2()).unwrap();
    let tok = gguf_tokenizer::from_gguf(&file).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let expected: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let ids = tok.tokenizer.encode(text, true).unwrap();
        assert_eq!(ids, expected, "{text:?}");
        if !text.contains("<|") {
            assert_eq!(tok.tokenizer.decode(&ids).unwrap(), text);
        }
    }
    // <|endoftext|> and <|im_end|> end a generation.
    assert_eq!(tok.eos_token_ids, [0, 2]);
}

#[test]
fn damaged_files_are_clear_errors() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let bytes = std::fs::read(smollm2()).unwrap();
    let cases = [
        (
            "truncated.gguf",
            &bytes[..4 << 20],
            "past the end of the file",
        ),
        ("header.gguf", &bytes[..100_000], "not a readable GGUF file"),
        ("text.gguf", &b"not a model"[..], "not a GGUF file"),
    ];
    for (name, content, message) in cases {
        let path = dir.join(name);
        std::fs::write(&path, content).unwrap();
        let out = leanstream(&["run", "--model", path.to_str().unwrap(), "-p", "x"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert!(stderr.contains(path.to_str().unwrap()), "{name}: {stderr}");
        assert!(stderr.contains(message), "{name}: {stderr}");
    }
}

/// The real model through the whole product: convert the GGUF (q8, threshold sparsity, a few
/// thousand calibration tokens), then run it with a quarter of the FFN affordable on an emulated
/// UFS 4.0 device; certified streaming answers exactly as the resident model does.
#[test]
fn converted_smollm2_streams_under_a_budget() {
    let out = std::env::temp_dir().join(format!("smollm2-{}.lsb", std::process::id()));
    let o = Command::new(prep())
        .arg("convert")
        .arg(smollm2())
        .arg("-o")
        .arg(&out)
        .args([
            "--quant",
            "q8",
            "--sparsity",
            "threshold:0.5",
            "--calib-tokens",
            "2048",
            "--epochs",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let run = |extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_leanstream"))
            .arg("run")
            .arg("--model")
            .arg(&out)
            .args([
                "-p",
                "The capital of France is",
                "--temp",
                "0",
                "-n",
                "8",
                "--ctx",
                "256",
                "--json",
            ])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        (
            o.status.success(),
            serde_json::from_slice::<serde_json::Value>(&o.stdout).ok(),
            err,
        )
    };
    let meta = leanstream_format::LsbFile::open(&out).unwrap().meta;
    let gguf = gguf_tokenizer::from_gguf(&GgufFile::open(&smollm2()).unwrap()).unwrap();
    assert!(meta.chat_template.is_some());
    assert_eq!(
        meta.chat_template, gguf.chat_template,
        "convert carries the chat template"
    );
    let (ok, resident, err) = run(&["--policy", "resident"]);
    assert!(ok, "{err}");
    let resident = resident.unwrap();
    assert!(
        resident["text"].as_str().unwrap().contains("Paris"),
        "{}",
        resident["text"]
    );
    let (_, _, err) = run(&["--memory", "1MiB"]);
    let min = err
        .split("below the minimum of ")
        .nth(1)
        .and_then(|r| r.split(" for").next())
        .expect(&err);
    // The stated minimum is rounded to 0.01 MiB.
    let min =
        leanstream::platform::memory_size::parse_size(&min.replace(' ', "")).unwrap() + (16 << 10);
    // At the minimum every dense weight streams as well as every bundle; the process's peak,
    // opening the file included, stays within it.
    let (ok, v, err) = run(&["--memory", &min.to_string(), "--flash", "ufs4"]);
    assert!(ok, "{err}");
    let v = v.unwrap();
    assert_eq!(v["text"], resident["text"]);
    let streamed = &v["memory_split"]["dense_streamed"];
    assert_eq!(
        streamed,
        &serde_json::json!({"attention": true, "head": true, "embedding": true})
    );
    let rss = v["peak_rss_bytes"].as_u64().unwrap();
    eprintln!("SmolLM2 at the minimum ({min} B): peak RSS {rss}");
    assert!(rss <= min, "peak RSS {rss} over the minimum budget {min}");
    let ffn = resident["memory_split"]["ffn_total"].as_u64().unwrap();
    let budget = min + ffn / 4;
    let (ok, v, err) = run(&["--memory", &budget.to_string(), "--flash", "ufs4"]);
    assert!(ok, "{err}");
    let v = v.unwrap();
    assert_eq!(v["text"], resident["text"]);
    let rss = v["peak_rss_bytes"].as_u64().unwrap();
    eprintln!(
        "SmolLM2 at minimum + 25 % FFN ({budget} B): {} tok/s, {} B/token, hit rate {}, peak RSS {rss}",
        v["tokens_per_s"], v["bytes_read_per_token"], v["cache_hit_rate"]
    );
    assert!(
        rss as f64 <= budget as f64 * 1.05,
        "peak RSS {rss} over budget {budget}"
    );
    std::fs::remove_file(&out).unwrap();
}
