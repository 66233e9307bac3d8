//! Dequantization of every GGML type the GGUF reader accepts, against llama.cpp's Python `gguf`
//! package: `tests/fixtures/quant-types.gguf` (written by `scripts/make-gguf-quant-fixture.py`)
//! holds random blocks of each type and, as `expected.<name>`, their values as `gguf` decodes them
//! in Hugging Face row order.

use std::path::PathBuf;

use candle_core::quantized::gguf_file::Content;
use candle_core::Device;
use leanstream::kernels::Weight;
use leanstream::source::gguf::{gguf_name, GgufFile};

#[test]
fn every_type_dequantizes_like_llama_cpp() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant-types.gguf");
    let file = GgufFile::open(&path).unwrap();
    let mut reader = std::fs::File::open(&path).unwrap();
    let content = Content::read(&mut reader).unwrap();
    // Hugging Face name, rows (256 columns each) and the type stored under it.
    let tensors = [
        ("model.embed_tokens.weight", 2, "F32"),
        ("lm_head.weight", 2, "F16"),
        ("model.layers.0.self_attn.v_proj.weight", 2, "BF16"),
        ("model.layers.0.self_attn.o_proj.weight", 2, "Q4_0"),
        ("model.layers.0.mlp.gate_proj.weight", 2, "Q4_1"),
        ("model.layers.0.mlp.up_proj.weight", 2, "Q5_0"),
        ("model.layers.0.mlp.down_proj.weight", 2, "Q5_1"),
        ("model.layers.1.self_attn.v_proj.weight", 2, "Q8_0"),
        ("model.layers.1.self_attn.o_proj.weight", 2, "Q4K"),
        ("model.layers.1.mlp.gate_proj.weight", 2, "Q5K"),
        ("model.layers.1.mlp.up_proj.weight", 2, "Q6K"),
        // Stored in llama.cpp's rope row order (2 heads of 4 rows), read back in HF order.
        ("model.layers.0.self_attn.q_proj.weight", 8, "Q8_0"),
    ];
    for (name, rows, dtype) in tensors {
        let raw = file.raw_tensor(name, &[rows, 256]).unwrap();
        assert_eq!(format!("{:?}", raw.dtype), dtype, "{name}");
        let ours = file.tensor_f32(name, &[rows, 256]).unwrap();
        let expected_name = format!("expected.{}", gguf_name(name).unwrap());
        let expected = content
            .tensor(&mut reader, &expected_name, &Device::Cpu)
            .and_then(|q| q.dequantize(&Device::Cpu))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .unwrap();
        assert_eq!(ours.len(), expected.len(), "{name}");
        assert!(expected.iter().any(|&v| v != 0.0), "{name}");
        for (i, (a, b)) in ours.iter().zip(&expected).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                "{name} ({dtype}) value {i}: {a} vs {b}"
            );
        }
        // Every matrix type but F32 stays encoded; its rows decode to the same values.
        let w = file.weight(name, rows, 256).unwrap();
        assert_eq!(matches!(w, Weight::Encoded(_)), dtype != "F32", "{name}");
        let mut row = vec![0.0; 256];
        for r in 0..rows {
            w.row_f32(r, &mut row);
            for (i, (a, b)) in row.iter().zip(&expected[r * 256..]).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                    "{name} ({dtype}) kept encoded, row {r} value {i}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn wrong_shapes_and_names_are_errors() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant-types.gguf");
    let file = GgufFile::open(&path).unwrap();
    let err = file
        .tensor_f32("model.layers.0.mlp.up_proj.weight", &[4, 256])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("blk.0.ffn_up.weight") && err.contains("shape"),
        "{err}"
    );
    let err = file
        .tensor_f32("model.layers.0.self_attn.k_proj.weight", &[2, 256])
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing tensor blk.0.attn_k.weight"), "{err}");
    // The fixture has no model metadata: loading it as a model names the first missing key.
    let err = format!("{:#}", file.config().unwrap_err());
    assert!(err.contains("llama.embedding_length"), "{err}");
}
