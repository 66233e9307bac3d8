//! A GGUF file: header, model configuration and every tensor the model would load, or an error —
//! never a panic or an allocation the file's size cannot justify.

use leanstream::source::gguf::GgufFile;

/// Runs the target on `data`; whether the file opened.
pub fn run(data: &[u8]) -> bool {
    let path = std::env::temp_dir().join(format!("leanstream-fuzz-gguf-{}", std::process::id()));
    std::fs::write(&path, data).expect("the temporary directory is writable");
    let file = GgufFile::open(&path);
    let _ = std::fs::remove_file(&path);
    let Ok(file) = file else {
        return false;
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
    true
}
