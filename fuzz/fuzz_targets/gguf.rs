//! A GGUF file: header, model configuration and every tensor the model would load, or an error —
//! never a panic or an allocation the file's size cannot justify.
//!
//! The body lives in `fuzz/bodies/gguf.rs`, which the normal test suite also runs over the seed
//! corpus (tests/tests/integration/fuzz_corpus.rs).
#![no_main]

#[path = "../bodies/gguf.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    body::run(data);
});
