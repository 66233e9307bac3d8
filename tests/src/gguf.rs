//! What the tests need to write llama.cpp-style GGUF files of the tiny models: the tokenizer
//! metadata of a `tokenizer.json`, and llama.cpp's order of query/key rows.

use std::path::Path;

use candle_core::quantized::gguf_file::Value;

/// `tokenizer.ggml.*` for a byte-level BPE `tokenizer.json` with GPT-2's pre-tokenizer.
pub fn tokenizer_metadata(path: &Path) -> Vec<(String, Value)> {
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let vocab = json["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    for (text, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = text.clone();
    }
    let special: Vec<u64> = json["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect();
    let types = (0..tokens.len() as u64)
        .map(|id| Value::I32(if special.contains(&id) { 3 } else { 1 }))
        .collect();
    let merges = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Value::String(s.clone()),
            pair => Value::String(format!(
                "{} {}",
                pair[0].as_str().unwrap(),
                pair[1].as_str().unwrap()
            )),
        })
        .collect();
    vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("gpt-2".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
    ]
}

/// llama.cpp's converter order for query/key rows: within each head, row `2i + j` holds Hugging
/// Face row `j * head_dim / 2 + i`.
pub fn converter_permute(values: &[f32], heads: usize, cols: usize) -> Vec<f32> {
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
