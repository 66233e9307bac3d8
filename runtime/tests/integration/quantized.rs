//! The embedded model with its weights encoded as f16, bf16, q8 and q4: perplexity on held-out
//! text stays close to f32 (the model was trained in bf16, so bf16 is exact).

use std::path::PathBuf;

use leanstream::source;
use leanstream::text::perplexity::perplexity;
use leanstream_format::quant::QuantType;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn quantized_perplexity_is_close_to_f32() {
    let dir = workspace().join("models/austen-relu");
    let text = std::fs::read_to_string(workspace().join("data/heldout-head.txt")).unwrap();
    let loaded = source::open(&dir).unwrap();
    let mut ids = loaded.tokenizer.encode(&text, false).unwrap();
    // Eight windows of 512 of the text's 16 953 tokens, at a quarter of the time.
    ids.truncate(8 * 512);
    let f32_ppl = perplexity(&loaded.model, &ids, 512, false)
        .unwrap()
        .perplexity;
    let f32_bytes = loaded.model.weight_bytes();
    // Block weights, embedding/head, allowed relative perplexity increase, size relative to f32.
    // Measured over these windows: +0.000 %, +0.011 %, +1.83 %, +1.90 % (over the whole text:
    // +0.00 %, +0.07 %, +1.4 % (q4_0 with a q8 head; +4.1 % with a q4 head), +1.3 %).
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
        eprintln!(
            "{layers} (head {head}): perplexity {ppl:.4} vs f32 {f32_ppl:.4} ({:+.3} %)",
            100.0 * increase
        );
        assert!(
            increase.abs() <= allowed,
            "{layers} (head {head}): perplexity {ppl:.4} vs f32 {f32_ppl:.4}"
        );
        let ratio = model.weight_bytes() as f64 / f32_bytes as f64;
        assert!(ratio <= size, "{layers}: {ratio:.3} of the f32 size");
    }
}

/// Our decoders and kernels read GGUF blocks as llama.cpp writes them: every type the kernels
/// keep encoded, from the fixture `tests/fixtures/quant-types.gguf` (random blocks written by
/// llama.cpp's `gguf` package; its values checked against that package by `gguf_quant_types.rs`).
#[test]
fn gguf_blocks_decode_like_llama_cpp() {
    use leanstream::kernels::{Operand, Weight};
    use leanstream::source::gguf::GgufFile;

    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant-types.gguf");
    let file = GgufFile::open(&path).unwrap();
    for (name, rows, qtype) in [
        ("lm_head.weight", 2, QuantType::F16),
        ("model.layers.0.self_attn.v_proj.weight", 2, QuantType::BF16),
        ("model.layers.0.self_attn.o_proj.weight", 2, QuantType::Q4_0),
        ("model.layers.0.mlp.gate_proj.weight", 2, QuantType::Q4_1),
        ("model.layers.1.self_attn.v_proj.weight", 2, QuantType::Q8_0),
        ("model.layers.0.self_attn.q_proj.weight", 8, QuantType::Q8_0),
    ] {
        let reference = file.tensor_f32(name, &[rows, 256]).unwrap();
        let Weight::Encoded(q) = file.weight(name, rows, 256).unwrap() else {
            panic!("{name} was not kept encoded");
        };
        assert_eq!(q.qtype, qtype, "{name}");
        let mut row = vec![0.0f32; 256];
        for r in 0..rows {
            q.dequantize_row(r, &mut row);
            assert_eq!(row, reference[r * 256..(r + 1) * 256], "{name} row {r}");
        }
        // The fused kernel on the stored blocks against the decoded values (q8 input for blocks).
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let op = Operand::new(&x, qtype);
        let mut out = vec![0.0f32; rows];
        q.matvec(&op, &mut out);
        for r in 0..rows {
            let want: f64 = (0..256)
                .map(|i| {
                    let xi = if qtype.is_block() {
                        op.q8().value(i)
                    } else {
                        x[i]
                    };
                    reference[r * 256 + i] as f64 * xi as f64
                })
                .sum();
            assert!(
                (out[r] as f64 - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{name} row {r}: {} vs {want}",
                out[r]
            );
        }
    }
}
