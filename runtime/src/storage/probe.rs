//! `leanstream probe-flash DIR`: measures the device under DIR with direct I/O — 4 KiB latency,
//! 4 KiB IOPS by queue depth, bandwidth by read size — on a temporary file, and writes the
//! [`FlashProfile`] that `--flash FILE.toml` emulates.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use leanstream_format::atomic::{exists_error, AtomicFile};
use rand::{Rng, RngCore, SeedableRng};

use crate::storage::{AlignedBuf, Device, DirectDevice, FlashProfile};

/// Arguments of `leanstream probe-flash`.
#[derive(Args, Debug)]
pub struct ProbeArgs {
    /// A directory on the device to measure; a temporary file is written there and deleted after.
    pub dir: PathBuf,
    /// Write the measured profile to this TOML file (default: print it).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Replace the --out file if it exists.
    #[arg(long)]
    pub force: bool,
    /// Total measuring time in seconds, shared by the seven runs.
    #[arg(long, default_value_t = 8.0)]
    pub seconds: f64,
    /// Size of the temporary file in MiB: random reads land anywhere in it.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(4..))]
    pub size_mib: u64,
}

/// Queue depths of the 4 KiB runs.
const IOPS_DEPTHS: [usize; 4] = [1, 4, 16, 32];
/// Read sizes of the bandwidth runs, and their queue depth (enough to saturate UFS and NVMe).
const BANDWIDTH_SIZES: [usize; 3] = [64 << 10, 512 << 10, 1 << 20];
const BANDWIDTH_DEPTH: usize = 8;

/// One run's outcome.
struct Measured {
    reads: u64,
    elapsed: Duration,
    /// Per-read latencies in µs, sorted (kept for queue depth 1 only).
    latencies_us: Vec<f64>,
}

impl Measured {
    fn per_second(&self) -> f64 {
        self.reads as f64 / self.elapsed.as_secs_f64()
    }

    fn latency_percentile(&self, p: f64) -> f64 {
        let v = &self.latencies_us;
        v[((v.len() - 1) as f64 * p).round() as usize]
    }
}

/// Runs the probe and writes or prints the profile.
pub fn run(args: ProbeArgs) -> Result<()> {
    if !(args.seconds.is_finite() && args.seconds > 0.0) {
        bail!("--seconds must be a positive number");
    }
    if let Some(out) = args.out.as_ref().filter(|o| o.exists() && !args.force) {
        return Err(exists_error(out).into());
    }
    let size = args.size_mib << 20;
    let file = TempFile::create(&args.dir, size)?;
    let device = DirectDevice::open(&file.path, *IOPS_DEPTHS.iter().max().unwrap())?;
    let per_run = Duration::from_secs_f64(args.seconds / 7.0).max(Duration::from_millis(100));
    let mut report = format!(
        "# leanstream probe-flash {} ({} MiB file, {:.2} s per run, O_DIRECT)\n",
        args.dir.display(),
        args.size_mib,
        per_run.as_secs_f64()
    );

    let mut iops = Vec::new();
    let mut latency_us = 0.0;
    for qd in IOPS_DEPTHS {
        let m = measure(&device, size, 4096, qd, per_run)?;
        if qd == 1 {
            latency_us = m.latency_percentile(0.5);
            report += &format!(
                "# 4 KiB QD1 latency: p50 {:.1} µs, p99 {:.1} µs\n",
                latency_us,
                m.latency_percentile(0.99)
            );
        }
        report += &format!(
            "# 4 KiB QD{qd}: {:.0} IOPS ({:.0} MB/s)\n",
            m.per_second(),
            m.per_second() * 4096.0 / 1e6
        );
        iops.push((qd, m.per_second()));
    }
    let mut bandwidth_512k = 0.0;
    for len in BANDWIDTH_SIZES {
        let m = measure(&device, size, len, BANDWIDTH_DEPTH, per_run)?;
        let mb_s = m.per_second() * len as f64 / 1e6;
        if len == 512 << 10 {
            bandwidth_512k = mb_s;
        }
        report += &format!("# {} KiB QD{BANDWIDTH_DEPTH}: {mb_s:.0} MB/s\n", len >> 10);
    }
    drop(file);

    let best = iops.iter().map(|&(_, v)| v).fold(0.0, f64::max);
    // The shallowest queue that gets (nearly) the best IOPS is the depth the device uses.
    let queue_depth = iops
        .iter()
        .find(|&&(_, v)| v >= 0.95 * best)
        .map_or(1, |&(qd, _)| qd);
    let profile = FlashProfile {
        name: format!("probed {}", args.dir.display()),
        latency_us: (latency_us * 10.0).round() / 10.0,
        iops_4k: best.round(),
        bandwidth_mb_s: bandwidth_512k.round(),
        queue_depth,
    };
    profile.validate()?;
    let text = format!("{report}{}", profile.to_toml());
    match &args.out {
        Some(out) => {
            // Written under a temporary name and renamed (an existing file was refused above).
            let mut file = AtomicFile::create(out)?;
            file.file()
                .write_all(text.as_bytes())
                .with_context(|| format!("cannot write {}", out.display()))?;
            file.commit(args.force)?;
            eprint!("{report}");
            eprintln!("profile written to {}", out.display());
        }
        None => print!("{text}"),
    }
    Ok(())
}

/// `qd` threads read `len` bytes at random aligned offsets of the first `size` bytes for `time`.
fn measure(
    device: &DirectDevice,
    size: u64,
    len: usize,
    qd: usize,
    time: Duration,
) -> Result<Measured> {
    let slots = (size - len as u64) / AlignedBuf::ALIGN as u64 + 1;
    let deadline = Instant::now() + time;
    let start = Instant::now();
    let outcomes: Vec<std::io::Result<(u64, Vec<f64>)>> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..qd)
            .map(|t| {
                s.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(t as u64 + 1);
                    let mut buf = AlignedBuf::new(len);
                    let mut latencies = Vec::new();
                    let mut reads = 0;
                    while Instant::now() < deadline {
                        let offset = rng.random_range(0..slots) * AlignedBuf::ALIGN as u64;
                        let t0 = Instant::now();
                        device.read_at(offset, &mut buf)?;
                        if qd == 1 {
                            latencies.push(t0.elapsed().as_secs_f64() * 1e6);
                        }
                        reads += 1;
                    }
                    Ok((reads, latencies))
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("probe thread panicked"))
            .collect()
    });
    let elapsed = start.elapsed();
    let mut m = Measured {
        reads: 0,
        elapsed,
        latencies_us: Vec::new(),
    };
    for outcome in outcomes {
        let (reads, latencies) = outcome.with_context(|| format!("probing {}", device.name()))?;
        m.reads += reads;
        m.latencies_us.extend(latencies);
    }
    if m.reads == 0 {
        bail!("no read finished within {:.2} s", time.as_secs_f64());
    }
    m.latencies_us.sort_by(f64::total_cmp);
    Ok(m)
}

/// The probe's data file, filled with random bytes (so that no layer can skip or compress it),
/// deleted when dropped.
struct TempFile {
    path: PathBuf,
}

impl TempFile {
    fn create(dir: &Path, size: u64) -> Result<Self> {
        if !dir.is_dir() {
            bail!("{} is not a directory", dir.display());
        }
        let path = dir.join(format!(".leanstream-probe-{}.tmp", std::process::id()));
        let mut file = open_for_direct_write(&path)
            .with_context(|| format!("cannot create {} for direct writes", path.display()))?;
        let temp = Self { path };
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
        let mut chunk = AlignedBuf::new(1 << 20);
        let mut written = 0;
        while written < size {
            let n = (size - written).min(chunk.len() as u64) as usize;
            rng.fill_bytes(&mut chunk[..n]);
            file.write_all(&chunk[..n])
                .with_context(|| format!("cannot write {}", temp.path.display()))?;
            written += n as u64;
        }
        file.sync_all()
            .with_context(|| format!("cannot sync {}", temp.path.display()))?;
        Ok(temp)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(target_os = "linux")]
fn open_for_direct_write(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

#[cfg(not(target_os = "linux"))]
fn open_for_direct_write(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().write(true).create_new(true).open(path)
}
