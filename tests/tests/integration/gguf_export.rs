//! `leanstream-prep gguf` writes a converted file's weights as a GGUF file (what llama.cpp is
//! measured on beside LeanStream). From f32 bundles every tensor read back through the runtime's
//! GGUF reader (which undoes llama.cpp's query/key order) equals the Hugging Face tensor bit for bit
//! and the metadata gives back the model's configuration; from q8 bundles (down re-encoded along its
//! rows; the default rule also rescales each neuron's up row and down column) the GGUF model's
//! perplexity stays within 1 % of the converted file's dense run; a ReLU model is refused, since
//! llama.cpp's graph would gate it with SiLU.

use std::path::{Path, PathBuf};
use std::process::Command;

use leanstream::source::gguf::GgufFile;
use leanstream_format::LsbFile;
use leanstream_tests::cli::assert_clean_failure;
use leanstream_tests::converted::{bin, convert, scratch, workspace};
use leanstream_tests::tiny::{write_tiny_model, Act, TinySpec};
use safetensors::SafeTensors;
use serde_json::Value;

/// A tiny model written to `name` and converted with `extra` arguments.
fn converted(name: &str, spec: &TinySpec, extra: &[&str]) -> (PathBuf, PathBuf) {
    let dir = scratch().join(name);
    write_tiny_model(&dir, spec).unwrap();
    let lsb = scratch().join(format!("{name}.lsb"));
    convert(&dir, &lsb, extra);
    (dir, lsb)
}

/// Runs `leanstream-prep gguf SRC -o OUT --json`.
fn export(src: &Path, out: &Path) -> std::process::Output {
    Command::new(bin("leanstream-prep"))
        .args(["gguf"])
        .arg(src)
        .arg("-o")
        .arg(out)
        .arg("--json")
        .output()
        .unwrap()
}

fn exported(src: &Path) -> PathBuf {
    let out = src.with_extension("gguf");
    let o = export(src, &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let summary: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(summary["architecture"], "llama");
    out
}

#[test]
fn f32_bundles_give_back_every_hugging_face_tensor() {
    // The |act(g)| rule: `target:F`'s rule would rescale each neuron's up row by its down column's
    // norm (and the column by its inverse), the same FFN in other bits.
    let (dir, lsb) = converted(
        "export-f32",
        &TinySpec::llama(),
        &["--quant", "f32", "--sparsity", "threshold:0.5"],
    );
    let gguf = GgufFile::open(&exported(&lsb)).unwrap();

    let mut expected = LsbFile::open(&lsb).unwrap().meta.model;
    expected.eos_token_ids.truncate(1); // GGUF holds one end-of-text token
    assert_eq!(gguf.config().unwrap(), expected);

    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut checked = 0;
    for (name, view) in st.tensors() {
        let want: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let got = gguf.tensor_f32(&name, view.shape()).unwrap();
        assert!(
            got.iter()
                .map(|v| v.to_bits())
                .eq(want.iter().map(|v| v.to_bits())),
            "{name} differs"
        );
        checked += 1;
    }
    // Embedding, final norm, head, and per layer 2 norms + 4 attention + 3 FFN matrices.
    assert_eq!(checked, 3 + 2 * 9);
}

/// `leanstream perplexity` of data/heldout-head.txt with `extra` arguments.
fn perplexity(model: &Path, extra: &[&str]) -> f64 {
    let o = Command::new(bin("leanstream"))
        .arg("perplexity")
        .arg("--model")
        .arg(model)
        .arg("--file")
        .arg(workspace().join("data/heldout-head.txt"))
        .args(["--ctx", "128", "--json"])
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    v["perplexity"].as_f64().unwrap()
}

#[test]
fn q8_bundles_keep_the_models_perplexity() {
    let (_, lsb) = converted("export-q8", &TinySpec::llama(), &["--quant", "q8"]);
    let gguf = exported(&lsb);
    let dense = perplexity(&lsb, &["--policy", "dense"]);
    let from_gguf = perplexity(&gguf, &[]);
    let rel = (from_gguf / dense - 1.0).abs();
    assert!(
        rel < 0.01,
        "GGUF {from_gguf} vs converted file {dense}: {rel:.2e} apart"
    );
}

/// `convert` without `--quant` keeps a GGUF file's encodings: Q4_0 tensors stay q4_0 (not q8,
/// twice the bytes) but for the down columns, which it encodes afresh at no lower precision (q8_0
/// at this width); Q8_0 ones give a q8_0 file; a Hugging Face folder of floats gives q8_0.
#[test]
fn converting_a_gguf_keeps_its_width_by_default() {
    for (quant, stored, ffn) in [("q4", "q4_0", "mixed"), ("q8", "q8_0", "q8_0")] {
        let name = format!("export-width-{quant}");
        let (dir, lsb) = converted(&name, &TinySpec::llama(), &["--quant", quant]);
        if quant == "q8" {
            let from_folder = scratch().join(format!("{name}-folder.lsb"));
            convert(&dir, &from_folder, &[]);
            assert_eq!(LsbFile::open(&from_folder).unwrap().meta.ffn_quant, "q8_0");
        }
        let gguf = exported(&lsb);
        let again = scratch().join(format!("{name}-again.lsb"));
        convert(&gguf, &again, &[]);
        let f = LsbFile::open(&again).unwrap();
        assert_eq!(
            (f.meta.ffn_quant.as_str(), f.meta.dense_quant.as_str()),
            (ffn, stored)
        );
        for l in &f.ffn.layers {
            let parts = [l.qtypes.gate, l.qtypes.up, l.qtypes.down].map(|q| q.name());
            assert_eq!(parts, [stored, stored, "q8_0"]);
        }
    }
}

#[test]
fn a_relu_model_is_refused() {
    let spec = TinySpec {
        act: Act::Relu,
        ..TinySpec::llama()
    };
    let (_, lsb) = converted("export-relu", &spec, &["--quant", "q8"]);
    let out = scratch().join("export-relu.gguf");
    let o = export(&lsb, &out);
    assert_clean_failure(
        "exporting a ReLU model",
        &o,
        1,
        &["gates its FFN with Relu", "SiLU"],
    );
    assert!(!out.exists());
}
