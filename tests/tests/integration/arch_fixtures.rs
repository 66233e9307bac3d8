//! The architecture fixtures (tests/fixtures/arch, made by scripts/make-arch-fixtures.py): tiny
//! random models saved by transformers, their GGUF versions from llama.cpp's converter, and
//! transformers' per-token log-probabilities of a fixed token sequence. The engine must score the
//! same sequence to the same perplexity from the Hugging Face folder, from the GGUF file and, for
//! the dense models, converted and streaming.

use std::path::{Path, PathBuf};

use leanstream::model::kv_cache::KvType;
use leanstream::model::{LanguageModel, Model};
use leanstream::source::gguf::GgufFile;
use leanstream::streaming::{Sparsity, Tuning};
use leanstream::text::session::{PolicyChoice, Session, SessionOptions};
use leanstream_tests::converted::{convert, scratch};
use serde_json::Value;

/// Relative perplexity difference allowed against transformers (f32 weights, f32 KV cache).
const PPL_TOL: f64 = 2e-4;
/// Largest difference of one token's log-probability (nats).
const LOGP_TOL: f64 = 2e-3;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/arch")
}

struct Reference {
    ids: Vec<u32>,
    log_probs: Vec<f64>,
    perplexity: f64,
}

fn reference(name: &str) -> Reference {
    let path = fixtures().join(name).join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let ids = v["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let log_probs = v["log_probs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    Reference {
        ids,
        log_probs,
        perplexity: v["perplexity"].as_f64().unwrap(),
    }
}

/// Each next token's log-probability under `model`, the whole sequence in one forward pass.
fn log_probs(mut model: impl LanguageModel, ids: &[u32]) -> Vec<f64> {
    let mut cache = model.new_cache(ids.len());
    let logits = model.forward(ids, &mut cache, true).unwrap();
    let vocab = model.config().vocab_size;
    logits
        .chunks_exact(vocab)
        .zip(&ids[1..])
        .map(|(row, &next)| leanstream::text::perplexity::log_softmax(row)[next as usize])
        .collect()
}

/// Checks `got` against transformers' reference for fixture `name`; returns the perplexity.
fn check(name: &str, what: &str, got: &[f64], r: &Reference) -> f64 {
    assert_eq!(got.len(), r.log_probs.len());
    let worst = got
        .iter()
        .zip(&r.log_probs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    let ppl = (-got.iter().sum::<f64>() / got.len() as f64).exp();
    let rel = (ppl - r.perplexity).abs() / r.perplexity;
    eprintln!(
        "{name} {what}: perplexity {ppl:.6} vs transformers {:.6} (rel {rel:.2e}), worst token \
         log-prob diff {worst:.2e}",
        r.perplexity
    );
    assert!(rel < PPL_TOL, "{name} {what}: perplexity off by {rel:.2e}");
    assert!(
        worst < LOGP_TOL,
        "{name} {what}: a log-prob off by {worst:.2e}"
    );
    ppl
}

fn hf_and_gguf(name: &str) {
    let r = reference(name);
    let dir = fixtures().join(name);
    let hf = Model::load(&dir).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    check(name, "HF folder", &log_probs(&hf, &r.ids), &r);
    let gguf = GgufFile::open(&fixtures().join(format!("{name}.f32.gguf")))
        .and_then(|g| g.load_model())
        .unwrap_or_else(|e| panic!("{name} GGUF: {e:#}"));
    assert_eq!(gguf.config().architecture, hf.config().architecture);
    check(name, "GGUF f32", &log_probs(&gguf, &r.ids), &r);
}

#[test]
fn llama3_rope_scaling_from_hf_and_gguf_rope_freqs() {
    hf_and_gguf("llama3");
    let g = GgufFile::open(&fixtures().join("llama3.f32.gguf")).unwrap();
    let factors = g.config().unwrap().rope_freq_factors.unwrap();
    // The fixture's frequencies fall on all three sides of the llama3 band.
    assert_eq!(factors.first(), Some(&1.0));
    assert_eq!(factors.last(), Some(&8.0));
    assert!(factors.iter().any(|&f| f > 1.0 && f < 8.0), "{factors:?}");
    // Without the factors the same weights score measurably differently: the test sees them.
    let mut plain = g.config().unwrap();
    plain.rope_freq_factors = None;
    let m = Model::from_hf_tensors(plain, |n, s| g.tensor_f32(n, s)).unwrap();
    let r = reference("llama3");
    let got = log_probs(&m, &r.ids);
    let worst = got
        .iter()
        .zip(&r.log_probs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(
        worst > 10.0 * LOGP_TOL,
        "unscaled rope is as close: {worst:.2e}"
    );
}

#[test]
fn qwen2_qkv_bias_from_hf_and_gguf() {
    hf_and_gguf("qwen2");
}

#[test]
fn qwen3_moe_transformers5_config_from_hf_and_gguf() {
    hf_and_gguf("qwen3moe");
}

/// Converted to f32 (f32 KV cache): loaded whole, and run by the streaming engine (`--policy dense`: every
/// neuron computed from the stored bundles; `leanstream` with sparsity off under the emulated
/// flash), each against transformers.
fn converted_matches(name: &str) {
    let r = reference(name);
    let lsb = scratch().join(format!("arch-{name}.lsb"));
    convert(&fixtures().join(name), &lsb, &["--quant", "f32"]);
    let file = leanstream_format::LsbFile::open(&lsb).unwrap();
    let model = leanstream::source::lsb_dense::load(&file)
        .unwrap_or_else(|e| panic!("{name} converted: {e:#}"));
    check(name, "converted f32", &log_probs(&model, &r.ids), &r);
    let mut per_policy = Vec::new();
    for policy in [PolicyChoice::Dense, PolicyChoice::Leanstream] {
        let mut s = Session::open(&SessionOptions {
            model: lsb.clone(),
            policy: Some(policy),
            memory: None,
            flash: None,
            sparsity: Sparsity::Dense,
            ctx: Some(r.ids.len()),
            default_ctx: r.ids.len(),
            kv: KvType::F32,
            tuning: Tuning::default(),
            gpu: Default::default(),
        })
        .unwrap_or_else(|e| panic!("{name} {policy:?}: {e:#}"));
        let got = log_probs(s.model(), &r.ids);
        check(name, &format!("streaming {policy:?}"), &got, &r);
        per_policy.push(got);
    }
    assert_eq!(
        per_policy[0], per_policy[1],
        "{name}: streaming differs from dense"
    );
}

#[test]
fn llama3_converted() {
    converted_matches("llama3");
}

#[test]
fn qwen2_converted() {
    converted_matches("qwen2");
}

#[test]
fn smollm3_nope_layers_from_hf_and_gguf() {
    hf_and_gguf("smollm3");
    let dir = fixtures().join("smollm3");
    let mut c = leanstream::source::config::from_hf_dir(&dir).unwrap();
    assert_eq!(c.no_rope_layers, vec![3]);
    // With rope in every layer the same weights score differently: the test sees the NoPE layer.
    c.no_rope_layers.clear();
    let tensors = leanstream::source::safetensors_dir::SafetensorsDir::open(&dir).unwrap();
    let m = Model::from_hf_tensors(c, |n, s| tensors.tensor_f32(n, s)).unwrap();
    let r = reference("smollm3");
    let worst = log_probs(&m, &r.ids)
        .iter()
        .zip(&r.log_probs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(
        worst > 10.0 * LOGP_TOL,
        "rope everywhere is as close: {worst:.2e}"
    );
}

#[test]
fn smollm3_converted() {
    converted_matches("smollm3");
}

/// The largest per-token log-probability difference of `model` from fixture `name`'s reference.
fn worst_against(model: &Model, name: &str) -> f64 {
    let r = reference(name);
    log_probs(model, &r.ids)
        .iter()
        .zip(&r.log_probs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
}

/// The fixture's Hugging Face model with its configuration changed by `change`.
fn hf_with(name: &str, change: impl FnOnce(&mut leanstream::source::config::ModelConfig)) -> Model {
    let dir = fixtures().join(name);
    let mut c = leanstream::source::config::from_hf_dir(&dir).unwrap();
    change(&mut c);
    let tensors = leanstream::source::safetensors_dir::SafetensorsDir::open(&dir).unwrap();
    let cc = c.clone();
    Model::from_hf_tensors(c, |n, s| {
        leanstream::source::hf_tensors::tensor(&tensors, &cc, n, s)
    })
    .unwrap()
}

#[test]
fn gemma2_softcaps_and_alternating_windows_from_hf_and_gguf() {
    hf_and_gguf("gemma2");
    let c = leanstream::source::config::from_hf_dir(&fixtures().join("gemma2")).unwrap();
    assert_eq!(
        c.activation,
        leanstream::source::config::Activation::GeluTanh
    );
    // Layer 0 slides over 16 positions of the 48 scored, layer 1 sees them all.
    assert_eq!((c.window(0), c.window(1)), (Some(16), None));
    assert!(reference("gemma2").ids.len() > 16);
    assert_eq!(c.block.attn_logit_softcap, Some(3.0));
    assert_eq!(c.block.final_logit_softcap, Some(5.0));
    // Each of them changes the result measurably: the test sees the window and both caps.
    for (what, change) in [
        (
            "no window",
            Box::new(|c: &mut _| set(c, |c| c.sliding_window = None)) as Box<dyn Fn(&mut _)>,
        ),
        (
            "no attention cap",
            Box::new(|c: &mut _| set(c, |c| c.block.attn_logit_softcap = None)),
        ),
        (
            "no final cap",
            Box::new(|c: &mut _| set(c, |c| c.block.final_logit_softcap = None)),
        ),
    ] {
        let worst = worst_against(&hf_with("gemma2", change), "gemma2");
        assert!(worst > 10.0 * LOGP_TOL, "{what} is as close: {worst:.2e}");
    }
    let g = GgufFile::open(&fixtures().join("gemma2.f32.gguf")).unwrap();
    assert_eq!(g.config().unwrap().block, c.block);
}

fn set(
    c: &mut leanstream::source::config::ModelConfig,
    f: impl Fn(&mut leanstream::source::config::ModelConfig),
) {
    f(c)
}

#[test]
fn gemma3_local_and_global_rope_from_hf_and_gguf() {
    hf_and_gguf("gemma3");
    let c = leanstream::source::config::from_hf_dir(&fixtures().join("gemma3")).unwrap();
    assert!(c.qk_norm);
    assert_eq!(c.block.full_attention_layers, vec![5]);
    assert_eq!((c.rope_theta, c.block.rope_local_theta), (1e6, Some(1e4)));
    // With the global base in every layer the same weights score differently.
    let worst = worst_against(
        &hf_with("gemma3", |c| c.block.rope_local_theta = None),
        "gemma3",
    );
    assert!(
        worst > 10.0 * LOGP_TOL,
        "one rope base is as close: {worst:.2e}"
    );
    let g = GgufFile::open(&fixtures().join("gemma3.f32.gguf")).unwrap();
    let gc = g.config().unwrap();
    assert_eq!((gc.sliding_window, &gc.block), (c.sliding_window, &c.block));
}

#[test]
fn phi3_fused_projections_and_longrope_from_hf_and_gguf() {
    hf_and_gguf("phi3");
    let c = leanstream::source::config::from_hf_dir(&fixtures().join("phi3")).unwrap();
    let l = c.block.longrope.as_ref().unwrap();
    // 48 scored positions exceed the original 32: the long factors apply, as in transformers.
    assert_eq!(l.original_max_position_embeddings, 32);
    assert!(reference("phi3").ids.len() > 32);
    assert!((l.attention_factor - (1.0f32 + 8f32.ln() / 32f32.ln()).sqrt()).abs() < 1e-6);
    let worst = worst_against(&hf_with("phi3", |c| c.block.longrope = None), "phi3");
    assert!(
        worst > 10.0 * LOGP_TOL,
        "plain rope is as close: {worst:.2e}"
    );
    let g = GgufFile::open(&fixtures().join("phi3.f32.gguf")).unwrap();
    assert_eq!(g.config().unwrap().block.longrope.as_ref(), Some(l));
}

#[test]
fn gemma2_converted() {
    converted_matches("gemma2");
}

/// `ids`' log-probabilities from converted file `lsb` run by `policy` (under `memory` on the
/// emulated flash when given), and the session's report.
fn session_log_probs(
    lsb: &Path,
    policy: PolicyChoice,
    memory: Option<u64>,
    ids: &[u32],
) -> (Vec<f64>, Value) {
    let mut s = Session::open(
        &SessionOptions::new(lsb, Some(policy))
            .memory(memory)
            .flash(memory.and(leanstream_tests::converted::ufs4()))
            .ctx(ids.len()),
    )
    .unwrap_or_else(|e| panic!("{} {policy:?}: {e:#}", lsb.display()));
    (log_probs(s.model(), ids), s.report())
}

/// Gemma 2's GeGLU converted under both sparsity rules, `target:0.5` (`|gelu(g)·u|`, no
/// certificate) and `threshold:0.05` (`|gelu(g)|`, with a gate sketch; at this size the planner
/// finds it saves nothing and leaves it out): the rule skips neurons (resident differs from dense),
/// and streaming under the minimum budget and a middle one gives the resident policy's
/// log-probabilities bit for bit.
#[test]
fn gemma2_geglu_sparsity_streams_equal_to_resident() {
    let r = reference("gemma2");
    for (tag, sparsity, rule) in [
        ("target", "target:0.5", Some("gate_up")),
        ("threshold", "threshold:0.05", None),
    ] {
        let lsb = scratch().join(format!("arch-gemma2-{tag}.lsb"));
        let certificate = if rule.is_none() { "q8" } else { "none" };
        convert(
            &fixtures().join("gemma2"),
            &lsb,
            &[
                "--quant",
                "f32",
                "--sparsity",
                sparsity,
                "--certificate",
                certificate,
            ],
        );
        let f = leanstream_format::LsbFile::open(&lsb).unwrap();
        assert_eq!(f.meta.sparsity_rule.as_deref(), rule);
        // The gate rule's file carries the certificate (a sketch of every layer's gates).
        assert_eq!(
            f.sketch.layers.iter().all(|l| l.neurons > 0),
            rule.is_none()
        );
        let ctx = r.ids.len();
        let run = |policy, memory: Option<u64>| {
            let (got, report) = session_log_probs(&lsb, policy, memory, &r.ids);
            let certified = report["memory_split"]["certified_layers"]
                .as_array()
                .map_or(0, Vec::len);
            (got, certified)
        };
        let (resident, _) = run(PolicyChoice::Resident, None);
        assert_ne!(
            resident,
            run(PolicyChoice::Dense, None).0,
            "{tag}: nothing skipped"
        );
        let min = leanstream::streaming::minimum_memory(&lsb, ctx).unwrap();
        let ffn = leanstream_format::LsbFile::open(&lsb)
            .unwrap()
            .ffn
            .bundle_bytes();
        for budget in [min, min + ffn / 2] {
            let (streamed, certified) = run(PolicyChoice::Leanstream, Some(budget));
            eprintln!("gemma2 {tag}: budget {budget}, {certified} layers certified");
            assert_eq!(streamed, resident, "{tag}: budget {budget}");
        }
    }
}

/// The fixture GGUF `src` rewritten at `out` with each tensor named by `rename` and the metadata
/// `extra` added.
fn rewrite_gguf(
    src: &str,
    out: &Path,
    rename: impl Fn(&str) -> String,
    extra: Vec<(String, candle_core::quantized::gguf_file::Value)>,
) {
    use candle_core::quantized::gguf_file;
    let mut reader = std::fs::File::open(fixtures().join(src)).unwrap();
    let content = gguf_file::Content::read(&mut reader).unwrap();
    let tensors: Vec<(String, candle_core::quantized::QTensor)> = content
        .tensor_infos
        .keys()
        .map(|n| {
            let t = content
                .tensor(&mut reader, n, &candle_core::Device::Cpu)
                .unwrap();
            (rename(n), t)
        })
        .collect();
    let mut metadata: Vec<(String, gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    metadata.extend(extra);
    let meta: Vec<(&str, &gguf_file::Value)> =
        metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tens: Vec<(&str, &candle_core::quantized::QTensor)> =
        tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let mut file = std::fs::File::create(out).unwrap();
    gguf_file::write(&mut file, &meta, &tens).unwrap();
}

/// The gemma3 fixture's GGUF rewritten with `gemma3.attention.sliding_window_pattern` set to
/// `pattern`, at `out`.
fn gemma3_gguf_with_pattern(pattern: candle_core::quantized::gguf_file::Value, out: &Path) {
    rewrite_gguf(
        "gemma3.f32.gguf",
        out,
        str::to_string,
        vec![("gemma3.attention.sliding_window_pattern".into(), pattern)],
    );
}

/// llama.cpp's per-layer pattern (one flag per layer, true = sliding) is read as written, and one
/// of the wrong length is refused with an error naming the file and the key.
#[test]
fn gemma3_gguf_sliding_window_pattern_is_read_and_checked() {
    use candle_core::quantized::gguf_file::Value;
    let flags = |n: usize| Value::Array((0..n).map(|l| Value::Bool(l != 2)).collect());
    let ok = scratch().join("arch-gemma3-pattern.gguf");
    gemma3_gguf_with_pattern(flags(6), &ok);
    let c = GgufFile::open(&ok).unwrap().config().unwrap();
    assert_eq!(c.block.full_attention_layers, vec![2]);
    let bad = scratch().join("arch-gemma3-bad-pattern.gguf");
    gemma3_gguf_with_pattern(flags(4), &bad);
    let err = format!(
        "{:#}",
        GgufFile::open(&bad).and_then(|g| g.config()).unwrap_err()
    );
    assert!(
        err.contains("arch-gemma3-bad-pattern.gguf")
            && err.contains("sliding_window_pattern has 4 entries for 6 layers"),
        "{err}"
    );
}

/// ProSparse's ReLU-fied Llama (`SparseLlamaForCausalLM`, `fatrelu` at the fixture's threshold
/// 0.25): its Hugging Face folder scores as transformers with the checkpoint's FATReLU, and plain
/// ReLU in its place scores measurably differently, so the test sees the threshold.
#[test]
fn prosparse_fatrelu_from_hf() {
    use leanstream::source::config::Activation;
    let r = reference("prosparse");
    let hf = Model::load(&fixtures().join("prosparse")).unwrap();
    assert_eq!(
        hf.config().activation,
        Activation::FatRelu { threshold: 0.25 }
    );
    check("prosparse", "HF folder", &log_probs(&hf, &r.ids), &r);
    let worst = worst_against(
        &hf_with("prosparse", |c| c.activation = Activation::Relu),
        "prosparse",
    );
    assert!(worst > 10.0 * LOGP_TOL, "ReLU is as close: {worst:.2e}");
}

/// Bamboo / TurboSparse-Mistral (`BambooForCausalLM`; GGUF architecture `bamboo`): dReLU from the
/// folder and from the GGUF file scores as transformers with the checkpoint's `relu(gate)·
/// relu(up)`, and ReLU on the gate alone scores measurably differently.
#[test]
fn bamboo_drelu_from_hf_and_gguf() {
    use leanstream::source::config::Activation;
    hf_and_gguf("bamboo");
    let g = GgufFile::open(&fixtures().join("bamboo.f32.gguf")).unwrap();
    assert_eq!(g.config().unwrap().activation, Activation::DRelu);
    let c = leanstream::source::config::from_hf_dir(&fixtures().join("bamboo")).unwrap();
    assert_eq!(c.activation, Activation::DRelu);
    let worst = worst_against(
        &hf_with("bamboo", |c| c.activation = Activation::Relu),
        "bamboo",
    );
    assert!(
        worst > 10.0 * LOGP_TOL,
        "ReLU on the gate alone is as close: {worst:.2e}"
    );
}

/// TurboSparse-Mixtral (`TurboSparseMixtralForCausalLM`): Mixtral's mixture whose experts are
/// dReLU. From the folder it scores as transformers with the experts' `relu(gate)·relu(up)` (ReLU
/// on the gate alone scores measurably differently). Converted with q8 experts, which run where
/// they lie, each expert computes only the neurons dReLU leaves non-zero (the share is reported,
/// about a quarter; that the skip is exact is `relu_family_experts_skip_exactly_the_zeroed_
/// neurons`), and streaming at the minimum budget gives resident's log-probabilities bit for bit.
#[test]
fn turbosparse_mixtral_drelu_experts_skip_exactly() {
    use leanstream::source::config::Activation;
    let name = "turbosparse-mixtral";
    let r = reference(name);
    let hf = Model::load(&fixtures().join(name)).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    assert_eq!(hf.config().activation, Activation::DRelu);
    assert!(hf.config().moe.is_some());
    check(name, "HF folder", &log_probs(&hf, &r.ids), &r);
    let worst = worst_against(&hf_with(name, |c| c.activation = Activation::Relu), name);
    assert!(
        worst > 10.0 * LOGP_TOL,
        "ReLU on the gate alone is as close: {worst:.2e}"
    );

    let lsb = scratch().join("arch-turbosparse-mixtral-q8.lsb");
    convert(&fixtures().join(name), &lsb, &["--quant", "q8"]);
    let file = leanstream_format::LsbFile::open(&lsb).unwrap();
    assert_eq!(file.meta.model.activation, Activation::DRelu);
    let (resident, report) = session_log_probs(&lsb, PolicyChoice::Resident, None, &r.ids);
    let computed = report["expert_neuron_fraction"].as_f64().unwrap();
    eprintln!("{name}: share of expert neurons computed {computed:.3}");
    assert!(computed > 0.1 && computed < 0.4, "computed {computed}");
    // q8 experts (and the routing they move) stay near transformers' scores.
    let ppl = (-resident.iter().sum::<f64>() / resident.len() as f64).exp();
    assert!(
        (ppl / r.perplexity - 1.0).abs() < 0.05,
        "q8 perplexity {ppl}"
    );
    // The minimum at f32 KV is at least the session's (f16 KV by default).
    let min =
        leanstream::streaming::experts::minimum_memory(&lsb, r.ids.len(), KvType::F32).unwrap();
    let (streamed, report) = session_log_probs(&lsb, PolicyChoice::Leanstream, Some(min), &r.ids);
    assert!(report["experts_read_per_token"].as_f64().unwrap() > 0.0);
    assert_eq!(streamed, resident);
}

/// The sparsity-native fixtures converted under `--sparsity auto`, which is ReLU's exact rule for
/// FATReLU and dReLU (threshold 0, with a certificate): the resident policy skips neurons (its
/// active fraction is below 1) and still scores as transformers, and streaming under the minimum
/// budget and a middle one gives its log-probabilities bit for bit.
#[test]
fn sparsity_native_models_skip_exactly_and_stream_equal_to_resident() {
    for name in ["prosparse", "bamboo"] {
        let r = reference(name);
        let lsb = scratch().join(format!("arch-{name}-relu.lsb"));
        convert(
            &fixtures().join(name),
            &lsb,
            &["--quant", "f32", "--certificate", "q8"],
        );
        let f = leanstream_format::LsbFile::open(&lsb).unwrap();
        assert_eq!(f.meta.sparsity_mode, "relu", "{name}");
        assert!(f.meta.layers.iter().all(|l| l.threshold == 0.0), "{name}");
        // FATReLU and dReLU are 1.9; a calibrated file's INPUT_BASIS makes it 1.10.
        assert_eq!(f.meta.model.minor_version(), 9, "{name}");
        assert_eq!(f.header.version_minor, 10, "{name}");
        let ctx = r.ids.len();
        let run = |policy, memory: Option<u64>| {
            let (got, report) = session_log_probs(&lsb, policy, memory, &r.ids);
            (got, report["active_fraction"].as_f64().unwrap())
        };
        let (resident, active) = run(PolicyChoice::Resident, None);
        eprintln!("{name}: resident active fraction {active:.3}");
        assert!(active > 0.05 && active < 0.8, "{name}: active {active}");
        check(name, "resident, exact skipping", &resident, &r);
        let min = leanstream::streaming::minimum_memory(&lsb, ctx).unwrap();
        let ffn = f.ffn.bundle_bytes();
        for budget in [min, min + ffn / 2] {
            let (streamed, active_streamed) = run(PolicyChoice::Leanstream, Some(budget));
            assert_eq!(streamed, resident, "{name}: budget {budget}");
            assert_eq!(active_streamed, active, "{name}: budget {budget}");
        }
    }
}

/// What is not read is refused with an error naming the file and the value: an unknown
/// `hidden_act` in a folder's config.json, and PowerInfer's transposed `ffn_down_t` in a GGUF file
/// (the bamboo fixture's with its down projections so renamed).
#[test]
fn unsupported_activation_and_powerinfer_layout_are_refused_by_name() {
    let dir = leanstream_tests::fresh_dir(&scratch(), "arch-prosparse-unknown-act");
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixtures().join("prosparse").join(f), dir.join(f)).unwrap();
    }
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let config = config.replace("\"fatrelu\"", "\"shifted_relu\"");
    std::fs::write(dir.join("config.json"), config).unwrap();
    let err = format!("{:#}", Model::load(&dir).err().expect("refused"));
    assert!(
        err.contains("arch-prosparse-unknown-act/config.json")
            && err.contains("unsupported hidden_act \"shifted_relu\""),
        "{err}"
    );

    let out = scratch().join("arch-bamboo-down-t.gguf");
    rewrite_gguf(
        "bamboo.f32.gguf",
        &out,
        |n| n.replace("ffn_down.", "ffn_down_t."),
        Vec::new(),
    );
    let err = format!(
        "{:#}",
        GgufFile::open(&out).and_then(|g| g.config()).unwrap_err()
    );
    assert!(
        err.contains("arch-bamboo-down-t.gguf") && err.contains("ffn_down_t"),
        "{err}"
    );
}
