//! `leanstream unpack ARCHIVE [-o FILE]`: restores a file packed by `leanstream-prep pack`,
//! streaming it to disk, checking the whole-file checksum and then every checksum of the file
//! (the `verify` check) before renaming it into place.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use leanstream_format::archive::{unpack, Stage};

use super::progress::{bytes_bar, mb_per_s};
use crate::platform::memory::peak_rss_bytes;

/// Arguments of `leanstream unpack`.
#[derive(Args, Debug)]
pub struct UnpackArgs {
    /// An archive made by `leanstream-prep pack` (`*.lsb.zst`).
    pub archive: PathBuf,
    /// Output file, or a folder to unpack into (default: the packed file's name, next to the
    /// archive).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Replace an existing output file.
    #[arg(long)]
    pub force: bool,
    /// Print one JSON object on stdout instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: UnpackArgs) -> Result<()> {
    let start = Instant::now();
    let bar = bytes_bar(!args.json, 0, "unpack");
    let mut unpacked_at = None;
    let report = unpack(
        &args.archive,
        args.output.as_deref(),
        args.force,
        |stage, done, total| {
            if stage == Stage::Verify && unpacked_at.is_none() {
                unpacked_at = Some(start.elapsed().as_secs_f64());
                bar.set_prefix("verify");
                bar.reset();
            }
            bar.set_length(total);
            bar.set_position(done);
        },
    );
    bar.finish_and_clear();
    let report = report.context("unpack failed")?;
    let seconds = start.elapsed().as_secs_f64();
    let size = report.manifest.size;
    let unpack_s = unpacked_at.unwrap_or(seconds);
    if args.json {
        let v = serde_json::json!({
            "archive": args.archive,
            "output": report.output,
            "name": report.manifest.name,
            "format": report.manifest.format,
            "bytes": size,
            "unpack_seconds": unpack_s,
            "verify_seconds": seconds - unpack_s,
            "unpack_mb_per_s": mb_per_s(size, unpack_s),
            "peak_rss_bytes": peak_rss_bytes(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "unpacked {} ({}, {size} bytes) at {:.0} MB/s, verified every checksum in {:.1} s",
            report.output.display(),
            report.manifest.format,
            mb_per_s(size, unpack_s),
            seconds - unpack_s
        );
    }
    Ok(())
}
