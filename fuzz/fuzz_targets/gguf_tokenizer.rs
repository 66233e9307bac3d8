//! The tokenizer in a GGUF file's metadata: rebuilt and used on a little text, or an error —
//! never a panic.
#![no_main]

use leanstream::source::gguf::GgufFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("leanstream-fuzz-tok-{}", std::process::id()));
    std::fs::write(&path, data).expect("the temporary directory is writable");
    let Ok(file) = GgufFile::open(&path) else {
        return;
    };
    if let Ok(t) = leanstream::tokenizer::gguf::from_gguf(&file) {
        if let Ok(ids) = t.tokenizer.encode("Hello <|im_start|> wörld 12 !", true) {
            let _ = t.tokenizer.decode(&ids);
        }
    }
});
