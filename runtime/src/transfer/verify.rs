//! `verify FILE`: every checksum of a LeanStream file, through the format crate's one
//! [`leanstream_format::verify`]; both `leanstream` and `leanstream-prep` run this command.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;

use super::progress::{bytes_bar, mb_per_s};

/// Arguments of `verify`.
#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// A converted LeanStream file.
    pub file: PathBuf,
    /// Print one JSON object on stdout (`ok`, `bytes`, `seconds`, or `error`).
    #[arg(long)]
    pub json: bool,
}

/// Checks the file; an error (exit status 1) names the file and the first bad extent.
pub fn run(args: VerifyArgs) -> Result<()> {
    let start = Instant::now();
    let size = std::fs::metadata(&args.file).map_or(0, |m| m.len());
    let bar = bytes_bar(!args.json, size, "verify");
    let result = leanstream_format::verify(&args.file, |done, _| bar.set_position(done));
    bar.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    let file = args.file.display().to_string();
    match &result {
        Ok(bytes) if args.json => println!(
            "{}",
            serde_json::json!({"file": file, "ok": true, "bytes": bytes, "seconds": seconds})
        ),
        Ok(bytes) => println!(
            "{file}: OK ({bytes} bytes, every checksum matches; {:.0} MB/s)",
            mb_per_s(*bytes, seconds)
        ),
        Err(e) if args.json => println!(
            "{}",
            serde_json::json!({"file": file, "ok": false, "error": e.to_string()})
        ),
        Err(_) => {}
    }
    result.context("verification failed")?;
    Ok(())
}
