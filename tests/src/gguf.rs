//! What the tests need to write llama.cpp-style GGUF files of the tiny models: the tokenizer
//! metadata of a `tokenizer.json`, and llama.cpp's order of query/key rows.

use std::path::Path;

use candle_core::quantized::gguf_file::Value;

/// `tokenizer.ggml.*` for a byte-level BPE `tokenizer.json` with GPT-2's pre-tokenizer.
pub fn tokenizer_metadata(path: &Path) -> Vec<(String, Value)> {
    leanstream::tokenizer::gguf::metadata_of(&std::fs::read(path).unwrap(), None)
        .unwrap()
        .0
}

/// llama.cpp's converter order for query/key rows of `cols` f32 values (see
/// [`leanstream::source::gguf::permute_rope_rows`]).
pub fn converter_permute(values: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    leanstream::source::gguf::permute_rope_rows(&bytes, heads, cols * 4)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}
