//! Tokenizes texts with a GGUF file's tokenizer: reads a JSON list of strings on stdin and prints
//! a JSON list of id lists (special tokens added as the file asks, as `leanstream run` does).
//! `scripts/check-gguf-tokenizer.py` compares the output with llama.cpp's tokenizer.

use std::path::PathBuf;

use anyhow::{Context, Result};
use leanstream::source::gguf::GgufFile;
use leanstream::tokenizer::gguf as gguf_tokenizer;

fn main() -> Result<()> {
    let path: PathBuf = std::env::args_os()
        .nth(1)
        .context("usage: gguf_tokenize FILE.gguf < texts.json")?
        .into();
    let tokenizer = gguf_tokenizer::from_gguf(&GgufFile::open(&path)?)?.tokenizer;
    let texts: Vec<String> =
        serde_json::from_reader(std::io::stdin().lock()).context("stdin is not a JSON list")?;
    let ids = texts
        .iter()
        .map(|text| tokenizer.encode(text, true))
        .collect::<Result<Vec<_>>>()?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}
