//! The engine against the f64 reference on tiny random models covering each supported variant:
//! one chunked prefill, token-by-token decode through the KV cache, uneven chunks continuing
//! from the cache, and windowed perplexity.

use std::path::{Path, PathBuf};

use leanstream::model::Model;
use leanstream_tests::reference::{Breakage, ReferenceModel};
use leanstream_tests::tiny::{
    random_ids, write_tiny_model, Act, Llama3RopeScaling, TinySpec, WeightDtype,
};
use leanstream_tests::{fresh_dir, max_rel_diff, rows_f64, LOGIT_TOL};

const PROMPT_LEN: usize = 72;
const PPL_WINDOW: usize = 32;
/// 3 full windows of 32 plus a short last window of 9.
const PPL_LEN: usize = 3 * PPL_WINDOW + 9;
const PPL_TOL: f64 = 2e-4;

fn model_dir(name: &str, spec: &TinySpec) -> PathBuf {
    let dir = fresh_dir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("engine-{name}"),
    );
    write_tiny_model(&dir, spec).expect("write tiny model");
    dir
}

fn llama3_scaling() -> Llama3RopeScaling {
    // Short original context: low, smooth and high frequency bands all occur in the prompt.
    Llama3RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64,
    }
}

/// Runs every engine-vs-reference comparison for one tiny model.
fn check_engine(name: &str, spec: &TinySpec) {
    let dir = model_dir(name, spec);
    let reference = ReferenceModel::load(&dir).unwrap();
    let model = Model::load(&dir).unwrap_or_else(|e| panic!("{name}: engine load failed: {e:#}"));
    let vocab = model.config().vocab_size;
    assert_eq!(vocab, spec.vocab, "{name}: vocab_size");

    let ids = random_ids(spec.seed + 500, PROMPT_LEN, spec.vocab);
    let want = reference.logits(&ids, Breakage::None).unwrap();

    // 1. One chunk, all logits.
    let mut cache = model.new_cache(PROMPT_LEN);
    let got = rows_f64(&model.forward(&ids, &mut cache, true).unwrap(), vocab);
    let rel_chunk = max_rel_diff(&want, &got);

    // 2. Token by token through the cache, last-position logits only.
    let mut cache = model.new_cache(PROMPT_LEN);
    let got: Vec<Vec<f64>> = ids
        .iter()
        .map(|&id| {
            let l = model.forward(&[id], &mut cache, false).unwrap();
            assert_eq!(l.len(), vocab, "{name}: decode returned {} logits", l.len());
            l.iter().map(|&v| v as f64).collect()
        })
        .collect();
    let rel_decode = max_rel_diff(&want, &got);

    // 3. Uneven chunks continuing from the cache (crosses the sliding window mid-chunk).
    let mut cache = model.new_cache(PROMPT_LEN + 8);
    let mut got = Vec::new();
    let mut start = 0;
    for len in [5, 17, 1, 30, PROMPT_LEN - 53] {
        let chunk = &ids[start..start + len];
        got.extend(rows_f64(
            &model.forward(chunk, &mut cache, true).unwrap(),
            vocab,
        ));
        start += len;
    }
    let rel_split = max_rel_diff(&want, &got);

    // 4. Windowed perplexity.
    let ppl_ids = random_ids(spec.seed + 900, PPL_LEN, spec.vocab);
    let (ref_ppl, ref_n) = reference.perplexity(&ppl_ids, PPL_WINDOW).unwrap();
    let eng =
        leanstream::text::perplexity::perplexity(&model, &ppl_ids, PPL_WINDOW, false).unwrap();
    let rel_ppl = (eng.perplexity - ref_ppl).abs() / ref_ppl;

    eprintln!(
        "{name}: max rel diff chunked {rel_chunk:.3e}, decode {rel_decode:.3e}, split {rel_split:.3e}; \
         perplexity engine {:.6} reference {ref_ppl:.6} (rel {rel_ppl:.3e}, {} tokens)",
        eng.perplexity, eng.tokens
    );
    assert!(
        rel_chunk < LOGIT_TOL,
        "{name}: chunked logits differ: {rel_chunk:.3e}"
    );
    assert!(
        rel_decode < LOGIT_TOL,
        "{name}: decode logits differ: {rel_decode:.3e}"
    );
    assert!(
        rel_split < LOGIT_TOL,
        "{name}: split-chunk logits differ: {rel_split:.3e}"
    );
    assert_eq!(eng.tokens, ref_n, "{name}: scored token count");
    assert!(
        rel_ppl < PPL_TOL,
        "{name}: perplexity differs: {rel_ppl:.3e}"
    );
}

#[test]
fn llama_relu_f32_tied() {
    let spec = TinySpec {
        act: Act::Relu,
        tied: true,
        kv_heads: 2,
        seed: 31,
        ..TinySpec::llama()
    };
    check_engine("llama-relu-f32-tied", &spec);
}

#[test]
fn llama_silu_f16_untied() {
    let spec = TinySpec {
        dtype: WeightDtype::F16,
        hidden: 128,
        intermediate: 256,
        heads: 8,
        kv_heads: 8,
        head_dim: 16,
        seed: 32,
        ..TinySpec::llama()
    };
    check_engine("llama-silu-f16-untied", &spec);
}

#[test]
fn qwen3_gqa_qk_norm_bf16_three_shards() {
    let spec = TinySpec {
        dtype: WeightDtype::BF16,
        shards: 3,
        seed: 33,
        ..TinySpec::qwen3()
    };
    assert_ne!(spec.head_dim, spec.hidden / spec.heads);
    check_engine("qwen3-bf16-sharded", &spec);
}

#[test]
fn mistral_silu_f32_sliding_window() {
    let spec = TinySpec {
        sliding_window: Some(24),
        seed: 34,
        ..TinySpec::mistral()
    };
    assert!(spec.sliding_window.unwrap() < PROMPT_LEN && spec.sliding_window.unwrap() < PPL_WINDOW);
    check_engine("mistral-sliding-window", &spec);
}

#[test]
fn llama3_rope_scaling_in_rope_parameters() {
    // Transformers v5 layout: theta and the llama3 fields inside `rope_parameters`.
    let spec = TinySpec {
        rope_theta: 50_000.0,
        rope_theta_in_rope_parameters: true,
        llama3_rope_scaling: Some(llama3_scaling()),
        kv_heads: 2,
        seed: 35,
        ..TinySpec::llama()
    };
    check_engine("llama3-rope-parameters", &spec);
}

#[test]
fn llama3_rope_scaling_top_level() {
    // Transformers v4 layout: top-level `rope_theta` plus `rope_scaling`.
    let spec = TinySpec {
        rope_theta: 50_000.0,
        llama3_rope_scaling: Some(llama3_scaling()),
        seed: 36,
        ..TinySpec::llama()
    };
    check_engine("llama3-rope-scaling", &spec);
}

#[test]
fn theta_only_in_rope_parameters() {
    // v5 layout without scaling: a theta far from the 10000 default must still be honoured.
    let spec = TinySpec {
        rope_theta: 500.0,
        rope_theta_in_rope_parameters: true,
        seed: 37,
        ..TinySpec::llama()
    };
    check_engine("theta-rope-parameters", &spec);
}

/// Greedy decoding: the engine's tokens through its KV cache against the reference's argmax over
/// the whole sequence recomputed at every step. First, that the mixture is a real test: several
/// experts per token, and routing uneven (the busiest expert of each sparse layer chosen at least
/// twice as often as the idlest) yet reaching every expert.
fn check_greedy(name: &str, spec: &TinySpec) {
    let dir = model_dir(&format!("{name}-greedy"), spec);
    let reference = ReferenceModel::load(&dir).unwrap();
    let moe = spec.moe.as_ref().unwrap();
    assert!(moe.top_k > 1);
    let ids = random_ids(spec.seed + 800, PROMPT_LEN, spec.vocab);
    let (_, routing) = reference.logits_and_routing(&ids, Breakage::None).unwrap();
    for (l, counts) in routing.iter().enumerate().filter(|(_, c)| !c.is_empty()) {
        eprintln!("{name}: layer {l} expert counts {counts:?}");
        assert_eq!(counts.iter().sum::<usize>(), PROMPT_LEN * moe.top_k);
        let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(
            *min > 0 && *max >= 2 * min,
            "{name}: layer {l} routing {counts:?}"
        );
    }
    let model = Model::load(&dir).unwrap();
    let argmax = |row: &[f64]| {
        (0..row.len())
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap() as u32
    };
    let prompt = random_ids(spec.seed + 700, 12, spec.vocab);
    let steps = 20;
    let mut cache = model.new_cache(prompt.len() + steps);
    let mut logits = model.forward(&prompt, &mut cache, false).unwrap();
    let mut seq = prompt.clone();
    let mut engine = Vec::new();
    for _ in 0..steps {
        let row: Vec<f64> = logits.iter().map(|&v| v as f64).collect();
        let tok = argmax(&row);
        engine.push(tok);
        seq.push(tok);
        logits = model.forward(&[tok], &mut cache, false).unwrap();
    }
    let mut seq = prompt;
    let mut want = Vec::new();
    for _ in 0..steps {
        let tok = argmax(
            reference
                .logits(&seq, Breakage::None)
                .unwrap()
                .last()
                .unwrap(),
        );
        want.push(tok);
        seq.push(tok);
    }
    assert_eq!(engine, want, "{name}: greedy tokens differ");
}

#[test]
fn qwen3_moe_top2_mlp_only_layer() {
    let spec = TinySpec {
        seed: 31,
        ..TinySpec::qwen3_moe()
    };
    check_engine("qwen3-moe", &spec);
    check_greedy("qwen3-moe", &spec);
}

#[test]
fn qwen3_moe_top3_renormalised_sparse_step_bf16_sharded() {
    let mut spec = TinySpec {
        seed: 32,
        layers: 4,
        dtype: WeightDtype::BF16,
        shards: 3,
        ..TinySpec::qwen3_moe()
    };
    let moe = spec.moe.as_mut().unwrap();
    (moe.top_k, moe.norm_topk_prob, moe.decoder_sparse_step) = (3, true, 2);
    check_engine("qwen3-moe-step", &spec);
}

#[test]
fn mixtral_top2_sliding_window() {
    let spec = TinySpec {
        seed: 33,
        ..TinySpec::mixtral()
    };
    check_engine("mixtral", &spec);
    check_greedy("mixtral", &spec);
}
