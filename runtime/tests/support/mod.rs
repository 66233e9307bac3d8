//! What several test binaries share: where the real SmolLM2 and the fixtures are.

// Each test binary uses part of it.
#![allow(dead_code)]

use std::path::PathBuf;

pub const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$LEANSTREAM_SMOLLM2`, else the file in `$LEANSTREAM_CACHE` or `~/.cache/leanstream`.
pub fn smollm2() -> PathBuf {
    let path = match std::env::var_os("LEANSTREAM_SMOLLM2") {
        Some(p) => PathBuf::from(p),
        None => std::env::var_os("LEANSTREAM_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                    .join(".cache/leanstream")
            })
            .join(GGUF_NAME),
    };
    assert!(
        path.is_file(),
        "SmolLM2 is not at {}: run scripts/fetch-smollm2.sh first (it downloads {GGUF_NAME} into \
         the cache), or point LEANSTREAM_SMOLLM2 at the file",
        path.display()
    );
    path
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The `leanstream-prep` binary built beside `leanstream` (`cargo test --workspace` builds both).
pub fn prep() -> PathBuf {
    let prep =
        std::path::Path::new(env!("CARGO_BIN_EXE_leanstream")).with_file_name("leanstream-prep");
    assert!(
        prep.exists(),
        "{} is missing: run the tests with `cargo test --workspace`",
        prep.display()
    );
    prep
}
