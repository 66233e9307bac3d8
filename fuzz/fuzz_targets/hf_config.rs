//! A Hugging Face `config.json`: parsed and validated, or refused with an error — never a panic.
//!
//! The body lives in `fuzz/bodies/hf_config.rs`, which the normal test suite also runs over the seed
//! corpus (tests/tests/integration/fuzz_corpus.rs).
#![no_main]

#[path = "../bodies/hf_config.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    body::run(data);
});
