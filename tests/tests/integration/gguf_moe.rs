//! Mixtures of experts from GGUF: the tiny Qwen3-MoE and Mixtral models written as llama.cpp's
//! converter writes them (`qwen3moe`, and `llama` with `ffn_*_exps` stacks of experts or, as in
//! older Mixtral files, one tensor per expert; query/key rows permuted for llama.cpp's rope) load
//! to the same configuration and give bit-identical logits to the Hugging Face directory, whose
//! agreement with the f64 reference `engine_vs_reference` checks; the perplexity is checked
//! against the reference here too. Converted (format 1.5, f32), such a GGUF runs from the file
//! bit-identically to the GGUF itself.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Tensor};
use leanstream::model::Model;
use leanstream::source::config::ModelConfig;
use leanstream::source::gguf::{gguf_name, GgufFile};
use leanstream_format::LsbFile;
use leanstream_tests::converted::convert;
use leanstream_tests::fresh_dir;
use leanstream_tests::gguf::{converter_permute, tokenizer_metadata};
use leanstream_tests::reference::ReferenceModel;
use leanstream_tests::tiny::{random_ids, write_tiny_model, TinySpec};
use safetensors::SafeTensors;

fn hf_tensors(dir: &Path) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

/// One expert's matrix: its index in the stack, shape and values.
type Expert = (usize, Vec<usize>, Vec<f32>);

/// An expert's matrix (or stack of them) in `dtype`, quantized by candle as llama.cpp would.
fn expert_tensor(shape: &[usize], values: &[f32], dtype: GgmlDType) -> QTensor {
    if dtype == GgmlDType::F32 {
        return f32_tensor(shape, values);
    }
    let t = Tensor::from_slice(values, shape, &Device::Cpu).unwrap();
    QTensor::quantize(&t, dtype).unwrap()
}

fn f32_tensor(shape: &[usize], values: &[f32]) -> QTensor {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let storage = QStorage::from_data(bytes.into(), &Device::Cpu, GgmlDType::F32).unwrap();
    QTensor::new(storage, shape).unwrap()
}

/// How a GGUF file holds the experts' matrices.
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    /// Stacked into the layer's `ffn_*_exps` tensor in expert order (llama.cpp today).
    Stacked,
    /// One tensor per expert, `blk.{l}.ffn_gate.{e}.weight` (older Mixtral files).
    OnePerExpert,
}

/// The tiny model in `dir` as a GGUF file of architecture `arch`, its experts laid out as `layout`
/// and encoded as `experts` (everything else f32).
fn write_gguf(
    dir: &Path,
    c: &ModelConfig,
    arch: &str,
    layout: Layout,
    experts: GgmlDType,
) -> PathBuf {
    let m = c.moe.as_ref().unwrap();
    let key = |k: &str| format!("{arch}.{k}");
    let u32v = |n: usize| Value::U32(n as u32);
    let metadata = [
        (
            "general.architecture".to_string(),
            Value::String(arch.into()),
        ),
        (key("embedding_length"), u32v(c.hidden_size)),
        (key("feed_forward_length"), u32v(c.intermediate_size)),
        (
            key("expert_feed_forward_length"),
            u32v(m.expert_intermediate_size),
        ),
        (key("expert_count"), u32v(m.num_experts)),
        (key("expert_used_count"), u32v(m.experts_per_token)),
        (key("block_count"), u32v(c.num_layers)),
        (key("attention.head_count"), u32v(c.num_heads)),
        (key("attention.head_count_kv"), u32v(c.num_kv_heads)),
        (key("attention.key_length"), u32v(c.head_dim)),
        (key("attention.value_length"), u32v(c.head_dim)),
        (key("context_length"), u32v(c.max_position_embeddings)),
        (
            key("attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_norm_eps),
        ),
        (key("rope.freq_base"), Value::F32(c.rope_theta)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(0)),
    ]
    .into_iter()
    .chain(tokenizer_metadata(&dir.join("tokenizer.json")))
    .collect::<Vec<_>>();
    // GGUF name → (expert index or none, shape, values); stacks are assembled below.
    let mut plain = Vec::new();
    let mut stacks: HashMap<String, Vec<Expert>> = HashMap::new();
    for (name, (shape, values)) in hf_tensors(dir) {
        let heads = match name.rsplit('.').nth(1) {
            Some("q_proj") => c.num_heads,
            Some("k_proj") => c.num_kv_heads,
            _ => 0,
        };
        let values = if heads > 0 && arch == "llama" {
            converter_permute(&values, heads, shape[1])
        } else {
            values
        };
        let gguf = gguf_name(&name).unwrap_or_else(|| panic!("no GGUF name for {name}"));
        match name.split(".experts.").nth(1) {
            Some(rest) => {
                let e: usize = rest.split('.').next().unwrap().parse().unwrap();
                if layout == Layout::OnePerExpert {
                    let own = gguf.replace("_exps.weight", &format!(".{e}.weight"));
                    plain.push((own, expert_tensor(&shape, &values, experts)));
                } else {
                    stacks.entry(gguf).or_default().push((e, shape, values));
                }
            }
            None => plain.push((gguf, f32_tensor(&shape, &values))),
        }
    }
    for (gguf, mut stack) in stacks {
        stack.sort_by_key(|(e, _, _)| *e);
        assert_eq!(stack.len(), m.num_experts);
        let shape = [&[m.num_experts][..], &stack[0].1].concat();
        let values: Vec<f32> = stack.into_iter().flat_map(|(_, _, v)| v).collect();
        plain.push((gguf, expert_tensor(&shape, &values, experts)));
    }
    let path = dir.join(format!("tiny-{arch}-{experts:?}-{}.gguf", layout as u8));
    let mut file = std::fs::File::create(&path).unwrap();
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = plain.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut file, &metadata, &tensors).unwrap();
    path
}

fn check(name: &str, spec: &TinySpec, arch: &str, layout: Layout) {
    let dir = fresh_dir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("gguf-{name}"),
    );
    write_tiny_model(&dir, spec).unwrap();
    let from_hf = Model::load(&dir).unwrap();
    let mut want = from_hf.config().clone();
    let gguf = GgufFile::open(&write_gguf(&dir, &want, arch, layout, GgmlDType::F32)).unwrap();
    let got = gguf.config().unwrap();
    // What GGUF does not carry: the token ids the test leaves out, and the Hugging Face family
    // (llama.cpp writes Mixtral as `llama`).
    want.bos_token_id = None;
    want.max_position_embeddings = got.max_position_embeddings;
    if arch == "llama" {
        want.architecture = got.architecture;
    }
    assert_eq!(got, want, "{name}: configuration from GGUF");
    let from_gguf = gguf.load_model().unwrap();

    let ids = random_ids(spec.seed + 40, 48, spec.vocab);
    let logits = |m: &Model| {
        let mut cache = m.new_cache(ids.len());
        m.forward(&ids, &mut cache, true).unwrap()
    };
    assert_eq!(
        logits(&from_gguf),
        logits(&from_hf),
        "{name}: GGUF vs HF logits"
    );

    let (ref_ppl, _) = ReferenceModel::load(&dir)
        .unwrap()
        .perplexity(&ids, 24)
        .unwrap();
    let ppl = leanstream::text::perplexity::perplexity(&from_gguf, &ids, 24, false)
        .unwrap()
        .perplexity;
    let rel = (ppl - ref_ppl).abs() / ref_ppl;
    eprintln!("{name}: GGUF perplexity {ppl:.6}, reference {ref_ppl:.6} (rel {rel:.3e})");
    assert!(rel < 2e-4, "{name}: perplexity differs: {rel:.3e}");
}

/// A two-layer Qwen3-MoE as llama.cpp's `qwen3moe` runs it: renormalised, no dense layers.
fn llamacpp_qwen3moe(seed: u64) -> TinySpec {
    let mut spec = TinySpec {
        seed,
        layers: 2,
        ..TinySpec::qwen3_moe()
    };
    let moe = spec.moe.as_mut().unwrap();
    moe.norm_topk_prob = true;
    moe.mlp_only_layers.clear();
    spec
}

#[test]
fn qwen3moe_gguf_matches_the_hugging_face_directory() {
    check(
        "qwen3moe",
        &llamacpp_qwen3moe(41),
        "qwen3moe",
        Layout::Stacked,
    );
}

#[test]
fn mixtral_as_llama_gguf_matches_the_hugging_face_directory() {
    // GGUF carries no sliding window: the Mixtral written here has none (as Mixtral-8x7B).
    let spec = TinySpec {
        seed: 42,
        sliding_window: None,
        ..TinySpec::mixtral()
    };
    check("mixtral", &spec, "llama", Layout::Stacked);
}

#[test]
fn mixtral_with_a_tensor_per_expert_as_older_gguf_files_hold_it() {
    let spec = TinySpec {
        seed: 43,
        layers: 2,
        sliding_window: None,
        ..TinySpec::mixtral()
    };
    check("mixtral-split", &spec, "llama", Layout::OnePerExpert);
}

/// Quantized stacks (Q8_0, Q4_0: blocks of 32 along each row) are cut into experts at the same
/// rows as when every expert is its own tensor: both files give bit-identical logits, which differ
/// from the f32 directory's (the experts really are quantized), Q8_0's less than Q4_0's.
#[test]
fn quantized_expert_stacks_cut_like_one_tensor_per_expert() {
    let spec = TinySpec {
        seed: 44,
        layers: 2,
        sliding_window: None,
        ..TinySpec::mixtral()
    };
    let dir = fresh_dir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "gguf-quantized-experts",
    );
    write_tiny_model(&dir, &spec).unwrap();
    let from_hf = Model::load(&dir).unwrap();
    let c = from_hf.config().clone();
    let ids = random_ids(spec.seed + 40, 32, spec.vocab);
    let logits = |m: &Model| {
        let mut cache = m.new_cache(ids.len());
        m.forward(&ids, &mut cache, true).unwrap()
    };
    let exact = logits(&from_hf);
    let mut diffs = Vec::new();
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
        let load = |layout| {
            let path = write_gguf(&dir, &c, "llama", layout, dtype);
            GgufFile::open(&path).unwrap().load_model().unwrap()
        };
        let stacked = logits(&load(Layout::Stacked));
        assert_eq!(
            stacked,
            logits(&load(Layout::OnePerExpert)),
            "{dtype:?}: stacked vs one tensor per expert"
        );
        let diff = stacked
            .iter()
            .zip(&exact)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("{dtype:?} experts: max |logit - f32 logit| {diff:.3e}");
        diffs.push(diff);
    }
    assert!(diffs[0] > 0.0 && diffs[0] < diffs[1], "{diffs:?}");
}

/// A GGUF mixture converted to format 1.5 (f32) runs from the file bit-identically to the GGUF
/// itself — as `qwen3moe` and as Mixtral's `llama` (query/key rows permuted back) — with every
/// mixture layer's routing profile measured.
#[test]
fn a_converted_gguf_mixture_runs_as_the_gguf() {
    let qwen = llamacpp_qwen3moe(45);
    let mixtral = TinySpec {
        seed: 46,
        layers: 2,
        sliding_window: None,
        ..TinySpec::mixtral()
    };
    for (spec, arch) in [(qwen, "qwen3moe"), (mixtral, "llama")] {
        let dir = fresh_dir(
            Path::new(env!("CARGO_TARGET_TMPDIR")),
            &format!("gguf-convert-{arch}"),
        );
        write_tiny_model(&dir, &spec).unwrap();
        let c = Model::load(&dir).unwrap().config().clone();
        let gguf = write_gguf(&dir, &c, arch, Layout::Stacked, GgmlDType::F32);
        let file = dir.join("from-gguf.lsb");
        convert(&gguf, &file, &["--quant", "f32"]);
        let from_gguf = GgufFile::open(&gguf).unwrap().load_model().unwrap();
        let from_file = leanstream::source::open(&file).unwrap().model;
        let ids = random_ids(spec.seed + 40, 32, spec.vocab);
        let logits = |m: &Model| {
            let mut cache = m.new_cache(ids.len());
            m.forward(&ids, &mut cache, true).unwrap()
        };
        assert_eq!(
            logits(&from_file),
            logits(&from_gguf),
            "{arch}: file vs GGUF"
        );
        let f = LsbFile::open(&file).unwrap();
        assert!(
            f.meta.layers.iter().all(|l| l.routing.is_some()),
            "{arch}: every layer is a mixture with a routing profile"
        );
    }
}
