//! Proves the 1e-4 logit comparison is sensitive: each deliberate mistake in the reference
//! moves the logits of the tiny models by more than 100x the tolerance.

use std::path::Path;

use leanstream_tests::reference::{Breakage, ReferenceModel};
use leanstream_tests::tiny::{random_ids, write_tiny_model, Act, Llama3RopeScaling, TinySpec};
use leanstream_tests::{fresh_dir, max_rel_diff, LOGIT_TOL};

const PROMPT_LEN: usize = 64;

fn llama_gqa_relu() -> TinySpec {
    TinySpec {
        act: Act::Relu,
        kv_heads: 2,
        tied: true,
        seed: 21,
        ..TinySpec::llama()
    }
}

fn llama_silu() -> TinySpec {
    TinySpec {
        kv_heads: 2,
        seed: 22,
        ..TinySpec::llama()
    }
}

fn qwen3() -> TinySpec {
    TinySpec {
        seed: 23,
        ..TinySpec::qwen3()
    }
}

fn mistral() -> TinySpec {
    TinySpec {
        seed: 24,
        ..TinySpec::mistral()
    }
}

fn llama3_scaled() -> TinySpec {
    TinySpec {
        seed: 25,
        rope_theta_in_rope_parameters: true,
        llama3_rope_scaling: Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        }),
        ..TinySpec::llama()
    }
}

/// Asserts `brk` changes the logits of the model `spec` by > 100x the tolerance.
fn assert_sensitive(name: &str, spec: &TinySpec, brk: Breakage) {
    let dir = fresh_dir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("breakage-{name}-{brk:?}"),
    );
    write_tiny_model(&dir, spec).unwrap();
    let m = ReferenceModel::load(&dir).unwrap();
    let ids = random_ids(spec.seed + 1000, PROMPT_LEN, spec.vocab);
    let good = m.logits(&ids, Breakage::None).unwrap();
    let bad = m.logits(&ids, brk).unwrap();
    let rel = max_rel_diff(&good, &bad);
    eprintln!("{name} {brk:?}: max rel change {rel:.3e}");
    assert!(
        rel > 100.0 * LOGIT_TOL,
        "{name} {brk:?} only moves logits by {rel:.3e}"
    );
}

#[test]
fn no_rope_is_detected() {
    assert_sensitive("llama-relu", &llama_gqa_relu(), Breakage::NoRope);
    assert_sensitive("qwen3", &qwen3(), Breakage::NoRope);
}

#[test]
fn interleaved_rope_is_detected() {
    assert_sensitive("llama-silu", &llama_silu(), Breakage::InterleavedRope);
    assert_sensitive("qwen3", &qwen3(), Breakage::InterleavedRope);
}

#[test]
fn norms_all_ones_is_detected() {
    assert_sensitive("llama-relu", &llama_gqa_relu(), Breakage::NormsAllOnes);
    assert_sensitive("llama-silu", &llama_silu(), Breakage::NormsAllOnes);
    assert_sensitive("qwen3", &qwen3(), Breakage::NormsAllOnes);
}

#[test]
fn no_qk_norm_is_detected() {
    assert_sensitive("qwen3", &qwen3(), Breakage::NoQkNorm);
}

#[test]
fn swap_gate_up_is_detected() {
    assert_sensitive("llama-relu", &llama_gqa_relu(), Breakage::SwapGateUp);
    assert_sensitive("llama-silu", &llama_silu(), Breakage::SwapGateUp);
}

#[test]
fn wrong_gqa_mapping_is_detected() {
    assert_sensitive("llama-relu", &llama_gqa_relu(), Breakage::WrongGqaMapping);
    assert_sensitive("qwen3", &qwen3(), Breakage::WrongGqaMapping);
    assert_sensitive("mistral", &mistral(), Breakage::WrongGqaMapping);
}

#[test]
fn ignored_rope_scaling_is_detected() {
    assert_sensitive("llama3-scaled", &llama3_scaled(), Breakage::NoRopeScaling);
}

#[test]
fn ignored_sliding_window_is_detected() {
    assert_sensitive("mistral", &mistral(), Breakage::NoSlidingWindow);
}

#[test]
fn breakage_none_is_a_no_op() {
    let spec = llama_silu();
    let dir = fresh_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "breakage-none");
    write_tiny_model(&dir, &spec).unwrap();
    let m = ReferenceModel::load(&dir).unwrap();
    let ids = random_ids(7, PROMPT_LEN, spec.vocab);
    let a = m.logits(&ids, Breakage::None).unwrap();
    let b = m.logits(&ids, Breakage::None).unwrap();
    assert_eq!(max_rel_diff(&a, &b), 0.0);
}
