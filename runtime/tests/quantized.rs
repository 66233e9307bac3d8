//! The embedded model with its weights encoded as f16, bf16, q8 and q4: perplexity on held-out
//! text stays close to f32 (the model was trained in bf16, so bf16 is exact).

use std::path::PathBuf;

use leanstream::perplexity::perplexity;
use leanstream::source;
use leanstream_format::quant::QuantType;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn quantized_perplexity_is_close_to_f32() {
    let dir = workspace().join("models/austen-relu");
    let text = std::fs::read_to_string(workspace().join("data/heldout-head.txt")).unwrap();
    let loaded = source::open(&dir).unwrap();
    let ids = loaded.tokenizer.encode(&text, false).unwrap();
    let f32_ppl = perplexity(&loaded.model, &ids, 512, false)
        .unwrap()
        .perplexity;
    let f32_bytes = loaded.model.weight_bytes();
    // Block weights, embedding/head, allowed relative perplexity increase, size relative to f32.
    // Measured: +0.00 %, +0.07 %, +1.4 % (q4_0 with a q8 head; +4.1 % with a q4 head), +1.3 %.
    for (layers, head, allowed, size) in [
        (QuantType::BF16, QuantType::BF16, 1e-4, 0.51),
        (QuantType::Q8_0, QuantType::Q8_0, 0.01, 0.27),
        (QuantType::Q4_0, QuantType::Q8_0, 0.03, 0.17),
        (QuantType::Q4_1, QuantType::Q8_0, 0.03, 0.18),
    ] {
        let model = source::open(&dir)
            .unwrap()
            .model
            .quantize(layers, head)
            .unwrap();
        let ppl = perplexity(&model, &ids, 512, false).unwrap().perplexity;
        let increase = ppl / f32_ppl - 1.0;
        assert!(
            increase.abs() <= allowed,
            "{layers} (head {head}): perplexity {ppl:.4} vs f32 {f32_ppl:.4}"
        );
        let ratio = model.weight_bytes() as f64 / f32_bytes as f64;
        assert!(ratio <= size, "{layers}: {ratio:.3} of the f32 size");
    }
}
