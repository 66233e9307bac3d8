//! A converted LeanStream file: opened (header, every index section decoded and cross-checked), its
//! embedded tokenizer parsed and every checksum verified, or an error — never a panic.
//!
//! The first input byte chooses whether the header's checksums are recomputed over the rest before
//! it is read: random bytes rarely match a checksum, so this is how the fuzzer reaches the section
//! decoders behind them.
//!
//! The body lives in `fuzz/bodies/lsb_file.rs`, which the normal test suite also runs over the seed
//! corpus (tests/tests/integration/fuzz_corpus.rs).
#![no_main]

#[path = "../bodies/lsb_file.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    body::run(data);
});
