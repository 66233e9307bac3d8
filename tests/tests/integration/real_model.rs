//! The engine and the reference on the real trained `models/austen-relu` (bf16, ReLU, GQA, tied,
//! transformers-v5 config) with real text, and against the perplexity HF transformers reported
//! in the model's README. Random tiny models cannot show realistic activation statistics.

use std::path::PathBuf;

use leanstream::model::Model;
use leanstream::tokenizer::Tokenizer;
use leanstream_tests::reference::{Breakage, ReferenceModel};
use leanstream_tests::tiny::models_dir;
use leanstream_tests::{max_rel_diff, rows_f64, LOGIT_TOL};

/// From models/austen-relu/README.md: HF transformers (f32), windows of 512, no special tokens.
const HF_PPL_HEAD: f64 = 55.370;
const HF_TOKENS_HEAD: usize = 16952;
const WINDOW: usize = 512;

fn model_dir() -> PathBuf {
    models_dir().join("austen-relu")
}

fn heldout_head_ids() -> Vec<u32> {
    let text = std::fs::read_to_string(models_dir().join("../data/heldout-head.txt")).unwrap();
    Tokenizer::from_dir(&model_dir())
        .unwrap()
        .encode(&text, false)
        .unwrap()
}

#[test]
fn austen_relu_logits_match_reference() {
    let ids = &heldout_head_ids()[..96];
    let reference = ReferenceModel::load(&model_dir()).unwrap();
    let want = reference.logits(ids, Breakage::None).unwrap();
    let model = Model::load(&model_dir()).unwrap();
    let vocab = model.config().vocab_size;

    let mut cache = model.new_cache(ids.len());
    let got = rows_f64(&model.forward(ids, &mut cache, true).unwrap(), vocab);
    let rel_chunk = max_rel_diff(&want, &got);

    let mut cache = model.new_cache(ids.len());
    let got: Vec<Vec<f64>> = ids
        .iter()
        .map(|&id| {
            let l = model.forward(&[id], &mut cache, false).unwrap();
            l.iter().map(|&v| v as f64).collect()
        })
        .collect();
    let rel_decode = max_rel_diff(&want, &got);
    eprintln!("austen-relu: max rel diff chunked {rel_chunk:.3e}, decode {rel_decode:.3e}");
    assert!(
        rel_chunk < LOGIT_TOL,
        "chunked logits differ: {rel_chunk:.3e}"
    );
    assert!(
        rel_decode < LOGIT_TOL,
        "decode logits differ: {rel_decode:.3e}"
    );
}

#[test]
fn austen_relu_perplexity_matches_reference() {
    // Two full windows (crossing the engine's prompt chunking) and a short third one.
    let ids = &heldout_head_ids()[..2 * WINDOW + 40];
    let (ref_ppl, ref_n) = ReferenceModel::load(&model_dir())
        .unwrap()
        .perplexity(ids, WINDOW)
        .unwrap();
    let model = Model::load(&model_dir()).unwrap();
    let eng = leanstream::text::perplexity::perplexity(&model, ids, WINDOW, false).unwrap();
    let rel = (eng.perplexity - ref_ppl).abs() / ref_ppl;
    eprintln!(
        "austen-relu first {} tokens: perplexity engine {:.4} reference {ref_ppl:.4} (rel {rel:.3e})",
        ids.len(),
        eng.perplexity
    );
    assert_eq!(eng.tokens, ref_n);
    assert!(rel < 2e-4, "perplexity differs: {rel:.3e}");
}

#[test]
fn austen_relu_heldout_head_perplexity_matches_hf() {
    let ids = heldout_head_ids();
    let model = Model::load(&model_dir()).unwrap();
    let eng = leanstream::text::perplexity::perplexity(&model, &ids, WINDOW, false).unwrap();
    let rel = (eng.perplexity - HF_PPL_HEAD).abs() / HF_PPL_HEAD;
    eprintln!(
        "austen-relu heldout-head: engine perplexity {:.4} over {} tokens; HF {HF_PPL_HEAD} over {HF_TOKENS_HEAD} (rel {rel:.3e})",
        eng.perplexity, eng.tokens
    );
    assert_eq!(eng.tokens, HF_TOKENS_HEAD, "scored tokens differ from HF");
    // The README rounds to 3 decimals (1e-5 relative); the rest is f32 noise.
    assert!(
        rel < 2e-4,
        "engine perplexity {} vs HF {HF_PPL_HEAD}",
        eng.perplexity
    );
}

/// Slow (f64 over ~17k tokens): run with `--ignored` to check the reference against HF itself.
#[test]
#[ignore]
fn reference_heldout_head_perplexity_matches_hf() {
    let ids = heldout_head_ids();
    let (ppl, n) = ReferenceModel::load(&model_dir())
        .unwrap()
        .perplexity(&ids, WINDOW)
        .unwrap();
    let rel = (ppl - HF_PPL_HEAD).abs() / HF_PPL_HEAD;
    eprintln!(
        "austen-relu heldout-head: reference perplexity {ppl:.4} over {n} tokens (rel {rel:.3e})"
    );
    assert_eq!(n, HF_TOKENS_HEAD);
    assert!(rel < 2e-4, "reference perplexity {ppl} vs HF {HF_PPL_HEAD}");
}
