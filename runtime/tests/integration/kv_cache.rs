//! The KV cache's storage on the embedded model: f16 (the default) keeps perplexity on held-out
//! text within 0.5 % of f32, q8_0 within 1 %, each measurably different from f32 (the storage is
//! really in use).

use std::path::PathBuf;

use leanstream::model::kv_cache::KvType;
use leanstream::source;
use leanstream::text::perplexity::perplexity;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn f16_and_q8_0_caches_keep_perplexity_close_to_f32() {
    let dir = workspace().join("models/austen-relu");
    let text = std::fs::read_to_string(workspace().join("data/heldout-head.txt")).unwrap();
    let loaded = source::open(&dir).unwrap();
    let mut ids = loaded.tokenizer.encode(&text, false).unwrap();
    ids.truncate(4 * 512);
    let model = loaded.model;
    let f32_ppl = perplexity(&model, &ids, 512, false).unwrap().perplexity;
    let model = model.with_kv(KvType::F16);
    let f16_ppl = perplexity(&model, &ids, 512, false).unwrap().perplexity;
    let model = model.with_kv(KvType::Q8_0);
    let q8_ppl = perplexity(&model, &ids, 512, false).unwrap().perplexity;
    eprintln!(
        "perplexity with the KV cache in f32 {f32_ppl:.5}, f16 {f16_ppl:.5} ({:+.3} %), q8_0 \
         {q8_ppl:.5} ({:+.3} %)",
        100.0 * (f16_ppl / f32_ppl - 1.0),
        100.0 * (q8_ppl / f32_ppl - 1.0)
    );
    assert!((f16_ppl / f32_ppl - 1.0).abs() <= 0.005, "f16 {f16_ppl}");
    assert!((q8_ppl / f32_ppl - 1.0).abs() <= 0.01, "q8_0 {q8_ppl}");
    assert_ne!(f16_ppl, f32_ppl);
    assert_ne!(q8_ppl, f16_ppl);
}
