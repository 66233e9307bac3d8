//! GPU mat-vec against the CPU kernels, per encoding (docs/gpu.md):
//!
//! ```text
//! cargo run --release -p leanstream --features gpu --example gpu_matvec [-- ROWSxCOLS ...]
//! ```
//!
//! For each shape (default: SmolLM2's output head 49152×576 and a 7B model's square projection
//! 4096×4096) and encoding, prints the median over repeats of: the CPU kernels' mat-vec (the
//! engine's kernels, rayon's threads); a GPU mat-vec call as the engine makes it (the input
//! written, one dispatch, the result read back); and one dispatch alone (20 dispatches in one
//! submission, less one, over 19). Bytes per second count the encoded weights read once. The
//! K-quants run where the columns are a multiple of 256.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use leanstream::gpu::Gpu;
use leanstream::kernels::{Matrix, Weight};
use leanstream_format::quant::QuantType;

const REPEATS: usize = 9;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

fn main() -> Result<()> {
    let shapes: Vec<(usize, usize)> = match std::env::args().skip(1).collect::<Vec<_>>() {
        a if a.is_empty() => vec![(49152, 576), (4096, 4096)],
        a => a
            .iter()
            .map(|s| {
                let (r, c) = s.split_once('x').context("a shape is ROWSxCOLS")?;
                Ok((r.parse()?, c.parse()?))
            })
            .collect::<Result<_>>()?,
    };
    let gpu = Gpu::new()?;
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    println!("GPU: {}", gpu.describe());
    println!("CPU: {cpu}, {} rayon threads", rayon::current_num_threads());
    println!(
        "{:<12} {:<6} {:>9} {:>10} {:>8} {:>10} {:>8} {:>11} {:>8}",
        "shape", "type", "MiB", "cpu µs", "GB/s", "gpu call", "GB/s", "gpu kernel", "GB/s"
    );
    for (rows, cols) in shapes {
        if cols % 32 != 0 {
            bail!("{cols} columns: the bench wants a multiple of 32 (the block encodings)");
        }
        // A deterministic pseudo-random matrix (a multiplicative hash), values in ±1.
        let data = (0..rows * cols)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 8) as f32 / (1 << 23) as f32 - 1.0)
            .collect();
        let f32m = Weight::F32(Matrix::new(rows, cols, data));
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        for qtype in [
            QuantType::F32,
            QuantType::F16,
            QuantType::Q8_0,
            QuantType::Q4_0,
            QuantType::Q4_1,
            QuantType::Q4_K,
            QuantType::Q6_K,
        ] {
            if cols % qtype.block_len() != 0 {
                continue; // the K-quants need a multiple of 256 columns
            }
            let w = f32m.quantize(qtype)?;
            let mut out = vec![0.0; rows];
            let cpu_t = median(
                (0..REPEATS)
                    .map(|_| {
                        let t = Instant::now();
                        w.matmul_t(&x, 1, &mut out);
                        t.elapsed()
                    })
                    .collect(),
            );
            let m = match gpu.upload(&w) {
                Ok(m) => m,
                Err(e) => {
                    println!("{rows}x{cols} {qtype}: {e:#}");
                    continue;
                }
            };
            gpu.matvec(&m, &x, &mut out)?; // the pipeline's first run
            let call = median(
                (0..REPEATS)
                    .map(|_| {
                        let t = Instant::now();
                        gpu.matvec(&m, &x, &mut out).map(|_| t.elapsed())
                    })
                    .collect::<Result<_>>()?,
            );
            let one = median(
                (0..REPEATS)
                    .map(|_| gpu.matvec_repeated(&m, &x, &mut out, 1))
                    .collect::<Result<_>>()?,
            );
            let twenty = median(
                (0..REPEATS)
                    .map(|_| gpu.matvec_repeated(&m, &x, &mut out, 20))
                    .collect::<Result<_>>()?,
            );
            let kernel = twenty.saturating_sub(one) / 19;
            let b = w.bytes();
            println!(
                "{:<12} {:<6} {:>9.1} {:>10.0} {:>8.2} {:>10.0} {:>8.2} {:>11.0} {:>8.2}",
                format!("{rows}x{cols}"),
                qtype.name(),
                b as f64 / (1 << 20) as f64,
                cpu_t.as_secs_f64() * 1e6,
                gbps(b, cpu_t),
                call.as_secs_f64() * 1e6,
                gbps(b, call),
                kernel.as_secs_f64() * 1e6,
                gbps(b, kernel),
            );
        }
    }
    Ok(())
}
