//! The tokenizer in a GGUF file's metadata: rebuilt and used on a little text, or an error —
//! never a panic.

use leanstream::source::gguf::GgufFile;

/// Runs the target on `data`; whether the tokenizer was rebuilt.
pub fn run(data: &[u8]) -> bool {
    let path = std::env::temp_dir().join(format!("leanstream-fuzz-tok-{}", std::process::id()));
    std::fs::write(&path, data).expect("the temporary directory is writable");
    let file = GgufFile::open(&path);
    let _ = std::fs::remove_file(&path);
    let Ok(file) = file else {
        return false;
    };
    let Ok(t) = leanstream::tokenizer::gguf::from_gguf(&file) else {
        return false;
    };
    if let Ok(ids) = t.tokenizer.encode("Hello <|im_start|> wörld 12 !", true) {
        let _ = t.tokenizer.decode(&ids);
    }
    true
}
