//! A Hugging Face `config.json`: parsed and validated, or refused with an error — never a panic.

/// Runs the target on `data`; whether the config was accepted.
pub fn run(data: &[u8]) -> bool {
    std::str::from_utf8(data)
        .is_ok_and(|text| leanstream::source::config::from_hf_json(text).is_ok())
}
