//! `leanstream-prep pack FILE [-o FILE.zst]`: compresses a converted file into one checksummed
//! archive (FORMAT.md §14) with multi-threaded zstd, in bounded memory, for `push` or any copy;
//! `leanstream unpack` restores and verifies it on the device.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use leanstream::platform::memory::peak_rss_bytes;
use leanstream::transfer::progress::{bytes_bar, mb_per_s};
use leanstream_format::archive::{pack, PackOptions, MAX_LEVEL};
use serde::Serialize;

/// Arguments of `leanstream-prep pack`.
#[derive(Args, Debug)]
pub struct PackArgs {
    /// A converted LeanStream file.
    pub file: PathBuf,
    /// The archive to write (default: FILE.zst).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    #[command(flatten)]
    pub compression: Compression,
    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// How hard and on how many threads to compress (shared with `push --pack`).
#[derive(Args, Debug, Clone, Copy)]
pub struct Compression {
    /// zstd level, 1 to 19: higher packs smaller and slower.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(i32).range(1..=MAX_LEVEL as i64))]
    pub level: i32,
    /// Compression threads (default: all cores).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub threads: Option<u32>,
}

/// What `pack` did.
#[derive(Debug, Serialize)]
pub struct PackSummary {
    pub archive: PathBuf,
    pub name: String,
    pub format: String,
    pub bytes: u64,
    pub archive_bytes: u64,
    /// `bytes / archive_bytes`.
    pub ratio: f64,
    pub seconds: f64,
    /// Input megabytes (10⁶ bytes) packed per second.
    pub mb_per_s: f64,
    pub level: i32,
    pub threads: u32,
    /// XXH3 of the file, as the archive's trailer records it.
    pub checksum: String,
    pub peak_rss_bytes: Option<u64>,
}

pub fn run(args: PackArgs) -> Result<()> {
    let output = args.output.clone().unwrap_or_else(|| {
        let mut name = args.file.clone().into_os_string();
        name.push(".zst");
        PathBuf::from(name)
    });
    let s = pack_file(&args.file, &output, args.compression, !args.json)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        println!(
            "packed {} into {}: {:.1} MiB -> {:.1} MiB (ratio {:.3}) in {:.1} s, {:.0} MB/s \
             (level {}, {} threads)",
            args.file.display(),
            s.archive.display(),
            s.bytes as f64 / (1 << 20) as f64,
            s.archive_bytes as f64 / (1 << 20) as f64,
            s.ratio,
            s.seconds,
            s.mb_per_s,
            s.level,
            s.threads
        );
    }
    Ok(())
}

/// Packs `file` into `output`, with a progress bar when `progress`.
pub fn pack_file(
    file: &Path,
    output: &Path,
    compression: Compression,
    progress: bool,
) -> Result<PackSummary> {
    let threads = compression
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u32));
    let opts = PackOptions {
        level: compression.level,
        threads,
    };
    let start = Instant::now();
    let bar = bytes_bar(progress, 0, "pack");
    let report = pack(file, output, &opts, |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    let report = report.context("pack failed")?;
    let seconds = start.elapsed().as_secs_f64();
    let m = report.manifest;
    Ok(PackSummary {
        archive: output.to_path_buf(),
        ratio: m.size as f64 / report.archive_bytes as f64,
        mb_per_s: mb_per_s(m.size, seconds),
        name: m.name,
        format: m.format,
        bytes: m.size,
        archive_bytes: report.archive_bytes,
        seconds,
        level: opts.level,
        threads,
        checksum: format!("{:016x}", report.checksum),
        peak_rss_bytes: peak_rss_bytes(),
    })
}
