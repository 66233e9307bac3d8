//! A tiny random model written as a GGUF file the way llama.cpp's converter writes one (names,
//! metadata, and for `llama` the query/key rows reordered for llama.cpp's rope) loads to the same
//! configuration and the same logits as from its Hugging Face tensors, for `llama` and `qwen3`.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;
use leanstream::model::Model;
use leanstream::source::config::{Activation, Architecture, ModelConfig};
use leanstream::source::gguf::{gguf_name, GgufFile};
use rand::{Rng, SeedableRng};

fn config(architecture: Architecture) -> ModelConfig {
    let qwen3 = architecture == Architecture::Qwen3;
    ModelConfig {
        architecture,
        activation: Activation::Silu,
        hidden_size: 64,
        intermediate_size: 96,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        // Qwen3's head size is not hidden / heads; GGUF says so in `attention.key_length`.
        head_dim: if qwen3 { 32 } else { 16 },
        vocab_size: 50,
        max_position_embeddings: 256,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: None,
        rope_freq_factors: None,
        no_rope_layers: Vec::new(),
        sliding_window: None,
        tie_word_embeddings: qwen3,
        qk_norm: qwen3,
        qkv_bias: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        moe: None,
        block: Default::default(),
    }
}

/// Hugging Face name → (shape, values), random.
fn hf_tensors(c: &ModelConfig) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let (h, hd, i) = (c.hidden_size, c.head_dim, c.intermediate_size);
    let mut shapes = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![c.vocab_size, h],
    )];
    shapes.push(("model.norm.weight".into(), vec![h]));
    if !c.tie_word_embeddings {
        shapes.push(("lm_head.weight".into(), vec![c.vocab_size, h]));
    }
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}");
        shapes.extend([
            (format!("{p}.input_layernorm.weight"), vec![h]),
            (
                format!("{p}.self_attn.q_proj.weight"),
                vec![c.num_heads * hd, h],
            ),
            (
                format!("{p}.self_attn.k_proj.weight"),
                vec![c.num_kv_heads * hd, h],
            ),
            (
                format!("{p}.self_attn.v_proj.weight"),
                vec![c.num_kv_heads * hd, h],
            ),
            (
                format!("{p}.self_attn.o_proj.weight"),
                vec![h, c.num_heads * hd],
            ),
            (format!("{p}.post_attention_layernorm.weight"), vec![h]),
            (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
            (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
            (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
        ]);
        if c.qk_norm {
            shapes.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
            shapes.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    shapes
        .into_iter()
        .map(|(name, shape)| {
            let n = shape.iter().product();
            let values = if shape.len() == 1 {
                (0..n).map(|_| rng.random_range(0.5..1.5)).collect()
            } else {
                (0..n).map(|_| rng.random_range(-0.3..0.3)).collect()
            };
            (name, (shape, values))
        })
        .collect()
}

/// llama.cpp's converter order for query/key rows: within each head, row `2i + j` holds Hugging
/// Face row `j * head_dim / 2 + i`.
fn converter_permute(values: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let head_dim = values.len() / cols / heads;
    let mut out = vec![0.0; values.len()];
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..head_dim / 2 {
                let src = h * head_dim + j * head_dim / 2 + i;
                let dst = h * head_dim + 2 * i + j;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&values[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn write_gguf(c: &ModelConfig, tensors: &HashMap<String, (Vec<usize>, Vec<f32>)>) -> PathBuf {
    write_gguf_as(c, tensors, "", |_| GgmlDType::F32)
}

/// [`write_gguf`] with each tensor quantized by candle (ggml's quantizers) to `dtype(name)`,
/// under a file name with `tag`.
fn write_gguf_as(
    c: &ModelConfig,
    tensors: &HashMap<String, (Vec<usize>, Vec<f32>)>,
    tag: &str,
    dtype: impl Fn(&str) -> GgmlDType,
) -> PathBuf {
    let arch = match c.architecture {
        Architecture::Qwen3 => "qwen3",
        _ => "llama",
    };
    let key = |k: &str| format!("{arch}.{k}");
    let metadata = [
        (
            "general.architecture".to_string(),
            Value::String(arch.into()),
        ),
        (key("embedding_length"), Value::U32(c.hidden_size as u32)),
        (
            key("feed_forward_length"),
            Value::U32(c.intermediate_size as u32),
        ),
        (key("block_count"), Value::U32(c.num_layers as u32)),
        (key("attention.head_count"), Value::U32(c.num_heads as u32)),
        (
            key("attention.head_count_kv"),
            Value::U32(c.num_kv_heads as u32),
        ),
        (key("attention.key_length"), Value::U32(c.head_dim as u32)),
        (key("attention.value_length"), Value::U32(c.head_dim as u32)),
        (key("rope.dimension_count"), Value::U32(c.head_dim as u32)),
        (
            key("context_length"),
            Value::U32(c.max_position_embeddings as u32),
        ),
        (
            key("attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_norm_eps),
        ),
        (key("rope.freq_base"), Value::F32(c.rope_theta)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
    ];
    let mut qtensors = Vec::new();
    for (name, (shape, values)) in tensors {
        let heads = match name.rsplit('.').nth(1) {
            Some("q_proj") => c.num_heads,
            Some("k_proj") => c.num_kv_heads,
            _ => 0,
        };
        let values = if heads > 0 && arch == "llama" {
            converter_permute(values, heads, shape[1])
        } else {
            values.clone()
        };
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let storage = QStorage::from_data(bytes.into(), &Device::Cpu, GgmlDType::F32).unwrap();
        let mut q = QTensor::new(storage, shape.as_slice()).unwrap();
        let want = if shape.len() == 2 {
            dtype(name)
        } else {
            GgmlDType::F32
        };
        if want != GgmlDType::F32 {
            let t = q.dequantize(&Device::Cpu).unwrap();
            q = QTensor::quantize(&t, want).unwrap();
        }
        qtensors.push((gguf_name(name).unwrap(), q));
    }
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("tiny-{arch}{tag}.gguf"));
    let mut file = std::fs::File::create(&path).unwrap();
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let qtensors: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut file, &metadata, &qtensors).unwrap();
    path
}

fn logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache(16);
    model.forward(tokens, &mut cache, true).unwrap()
}

#[test]
fn gguf_loads_like_the_hugging_face_tensors() {
    for architecture in [Architecture::Llama, Architecture::Qwen3] {
        let c = config(architecture);
        let tensors = hf_tensors(&c);
        let gguf = GgufFile::open(&write_gguf(&c, &tensors)).unwrap();
        assert_eq!(gguf.config().unwrap(), c);
        let from_gguf = gguf.load_model().unwrap();
        let from_hf = Model::from_hf_tensors(c.clone(), |name, shape| {
            let (s, v) = &tensors[name];
            assert_eq!(s, shape, "{name}");
            Ok(v.clone())
        })
        .unwrap();
        let tokens = [3, 17, 5, 42, 8, 8, 1];
        assert_eq!(
            logits(&from_gguf, &tokens),
            logits(&from_hf, &tokens),
            "{architecture:?}"
        );
    }
}

/// A model whose matrices are K-quants (the mix of a Q4_K_M file, plus Q5_K, Q5_0 and Q5_1) keeps
/// them encoded and gives the logits of the same file with every matrix decoded to f32 at load,
/// within the error of quantizing the activations to q8 (blocks of 32, 8 bits): measured 3.2 % of
/// the logits' largest magnitude at worst over these tokens (this random model's logits are small;
/// the same model in Q4_0, whose kernels quantize the activations the same way, differs by 4.9 %);
/// the test allows 4 %.
#[test]
fn k_quant_gguf_stays_encoded_and_matches_its_f32_decoding() {
    use leanstream::kernels::{Matrix, Weight};
    use leanstream_format::quant::QuantType;
    let c = ModelConfig {
        hidden_size: 256,
        intermediate_size: 512,
        head_dim: 64,
        ..config(Architecture::Llama)
    };
    let tensors = hf_tensors(&c);
    let dtype = |name: &str| match name.rsplit('.').nth(1).unwrap() {
        "q_proj" | "gate_proj" | "embed_tokens" => GgmlDType::Q4K,
        "k_proj" => GgmlDType::Q5_1,
        "v_proj" | "down_proj" | "lm_head" => GgmlDType::Q6K,
        "o_proj" => GgmlDType::Q5K,
        _ => GgmlDType::Q5_0,
    };
    let gguf = GgufFile::open(&write_gguf_as(&c, &tensors, "-kquant", dtype)).unwrap();
    for (name, rows, cols, want) in [
        ("model.embed_tokens.weight", 50, 256, QuantType::Q4_K),
        (
            "model.layers.0.self_attn.q_proj.weight",
            256,
            256,
            QuantType::Q4_K,
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            128,
            256,
            QuantType::Q5_1,
        ),
        (
            "model.layers.0.self_attn.o_proj.weight",
            256,
            256,
            QuantType::Q5_K,
        ),
        (
            "model.layers.1.mlp.up_proj.weight",
            512,
            256,
            QuantType::Q5_0,
        ),
        (
            "model.layers.1.mlp.down_proj.weight",
            256,
            512,
            QuantType::Q6_K,
        ),
    ] {
        let w = gguf.weight(name, rows, cols).unwrap();
        assert!(matches!(w, Weight::Encoded(_)), "{name}");
        assert_eq!(w.qtype(), want, "{name}");
        // Stored as in the file: the encoding's bytes, no f32 copy.
        assert_eq!(
            w.bytes(),
            rows * cols / want.block_len() * want.block_bytes(),
            "{name}"
        );
        // Rows (the q/k ones put back in Hugging Face order) decode as the f32 expansion does.
        let dense = gguf.tensor_f32(name, &[rows, cols]).unwrap();
        let mut row = vec![0.0; cols];
        for r in [0, rows / 2 + 1, rows - 1] {
            w.row_f32(r, &mut row);
            assert_eq!(row, dense[r * cols..(r + 1) * cols], "{name} row {r}");
        }
    }
    let encoded = gguf.load_model().unwrap();
    let decoded = Model::from_hf_weights(
        c.clone(),
        |name, shape| gguf.tensor_f32(name, shape),
        |name, rows, cols| {
            Ok(Weight::F32(Matrix::new(
                rows,
                cols,
                gguf.tensor_f32(name, &[rows, cols])?,
            )))
        },
    )
    .unwrap();
    let tokens = [3, 17, 5, 42, 8, 8, 1];
    // One token at a time: the decode path (mat-vec on q8 inputs), as in generation.
    let (mut ce, mut cd) = (encoded.new_cache(16), decoded.new_cache(16));
    let mut worst = 0.0f32;
    for t in tokens {
        let a = encoded.forward(&[t], &mut ce, true).unwrap();
        let b = decoded.forward(&[t], &mut cd, true).unwrap();
        let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        worst = worst.max(diff / scale);
    }
    eprintln!("k-quant logits: largest difference {worst:.4} of the largest logit");
    assert!(worst > 0.0, "the encoded path ran the f32 kernels");
    assert!(
        worst <= 0.04,
        "largest difference {worst} of the largest logit"
    );
}
