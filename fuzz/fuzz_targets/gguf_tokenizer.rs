//! The tokenizer in a GGUF file's metadata: rebuilt and used on a little text, or an error —
//! never a panic.
//!
//! The body lives in `fuzz/bodies/gguf_tokenizer.rs`, which the normal test suite also runs over the seed
//! corpus (tests/tests/integration/fuzz_corpus.rs).
#![no_main]

#[path = "../bodies/gguf_tokenizer.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    body::run(data);
});
