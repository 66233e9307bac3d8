//! A GGUF file: header, model configuration and every tensor the model would load, or an error —
//! never a panic or an allocation the file's size cannot justify.
#![no_main]

use leanstream::source::gguf::GgufFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("leanstream-fuzz-gguf-{}", std::process::id()));
    std::fs::write(&path, data).expect("the temporary directory is writable");
    let Ok(file) = GgufFile::open(&path) else {
        return;
    };
    if let Ok(config) = file.config() {
        // Small models only: the point is the reader, not the size of the weights.
        let size = (config.intermediate_size.max(config.vocab_size))
            .saturating_mul(config.hidden_size)
            .saturating_mul(config.num_layers);
        if size <= 1 << 20 {
            let _ = file.load_model();
        }
    }
});
