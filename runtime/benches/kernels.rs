//! Kernel throughput against the machine's read bandwidth.
//!
//! `cargo bench -p leanstream --bench kernels` measures, on matrices larger than the last-level
//! cache (4096 × 11008, the shape of a 7B model's FFN, cycled through copies so that every pass
//! reads from DRAM):
//! - `read`: summing a buffer as large as the working set — the bandwidth the others are held to;
//! - `matvec/<isa>/<type>/t<threads>`: batch-1 mat-vec of every encoding and instruction set;
//! - `matvec_hot/<isa>/<type>`: the same on a matrix that stays in L2 (the compute ceiling);
//! - `bundles/<type>`: the sparse FFN over neuron bundles with 10 % of the neurons active;
//! - `matmul/<type>`: a 64-token prompt chunk (mat-mat), in multiply-adds per second.
//!
//! It ends with a table of GB/s and the fraction of the read bandwidth. A filter argument works as
//! for any criterion bench (`cargo bench -p leanstream --bench kernels -- matvec/avx512`).

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput};
use leanstream::config::Activation;
use leanstream::kernels::bundles::{ffn_bundles, BundleLayout};
use leanstream::kernels::{Matrix, Operand, QMatrix, RowKernels};
use leanstream_format::quant::QuantType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const ROWS: usize = 11008;
const COLS: usize = 4096;
/// Bytes cycled through per benchmark: far above any cache of this machine.
const WORKING_SET: usize = 1 << 30;

fn random(n: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Enough copies of `m` to fill the working set.
fn copies<T: Clone>(m: T, bytes: usize) -> Vec<T> {
    vec![m; WORKING_SET.div_ceil(bytes)]
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a thread pool")
}

fn bench_read(c: &mut Criterion) {
    let buf = vec![1.0f32; WORKING_SET / 4];
    let mut g = c.benchmark_group("read");
    g.throughput(Throughput::BytesDecimal(WORKING_SET as u64));
    g.bench_function("sum", |b| {
        b.iter(|| {
            let mut acc = [0.0f32; 32];
            for chunk in black_box(&buf).chunks_exact(32) {
                for (a, v) in acc.iter_mut().zip(chunk) {
                    *a += v;
                }
            }
            acc.iter().sum::<f32>()
        })
    });
    g.finish();
}

fn bench_matvec(c: &mut Criterion, f32_matrix: &Matrix, x: &[f32]) {
    let mut g = c.benchmark_group("matvec");
    let mut out = vec![0.0f32; ROWS];
    for qtype in QuantType::ALL {
        let m = QMatrix::quantize(f32_matrix, qtype).expect("a whole number of blocks");
        let bytes = m.bytes();
        let ms = copies(m, bytes);
        g.throughput(Throughput::BytesDecimal(bytes as u64));
        let operand = Operand::new(x, qtype);
        for k in RowKernels::available() {
            // Two threads only for the kernels the engine uses.
            let threads: &[usize] = if k.isa == RowKernels::best().isa {
                &[1, 2]
            } else {
                &[1]
            };
            for &t in threads {
                let pool = pool(t);
                let mut i = 0;
                g.bench_function(format!("{}/{qtype}/t{t}", k.isa), |b| {
                    b.iter(|| {
                        i = (i + 1) % ms.len();
                        pool.install(|| ms[i].matvec_with(&k, &operand, &mut out));
                    })
                });
            }
        }
    }
    g.finish();
}

/// The same kernels on a matrix that stays in L2: their compute ceiling.
fn bench_matvec_hot(c: &mut Criterion, x: &[f32]) {
    const HOT_ROWS: usize = 128;
    let mut rng = StdRng::seed_from_u64(4);
    let m = Matrix::new(HOT_ROWS, COLS, random(HOT_ROWS * COLS, &mut rng));
    let mut g = c.benchmark_group("matvec_hot");
    let mut out = vec![0.0f32; HOT_ROWS];
    let pool = pool(1);
    for qtype in QuantType::ALL {
        let q = QMatrix::quantize(&m, qtype).expect("a whole number of blocks");
        g.throughput(Throughput::BytesDecimal(q.bytes() as u64));
        let operand = Operand::new(x, qtype);
        for k in RowKernels::available() {
            g.bench_function(format!("{}/{qtype}", k.isa), |b| {
                b.iter(|| pool.install(|| q.matvec_with(&k, &operand, &mut out)))
            });
        }
    }
    g.finish();
}

fn bench_bundles(c: &mut Criterion, f32_matrix: &Matrix, x: &[f32]) {
    let mut g = c.benchmark_group("bundles");
    let mut rng = StdRng::seed_from_u64(2);
    for qtype in QuantType::ALL {
        let layout = BundleLayout::new(qtype, COLS).expect("a whole number of blocks");
        // Gate and up rows from the matrix, down columns random: [gate | up | down] per neuron.
        let m = QMatrix::quantize(f32_matrix, qtype).expect("a whole number of blocks");
        let down = QMatrix::quantize(&Matrix::new(1, COLS, random(COLS, &mut rng)), qtype)
            .expect("a whole number of blocks");
        let mut buf = Vec::with_capacity(ROWS * layout.bundle_bytes());
        for r in 0..ROWS {
            buf.extend_from_slice(m.row(r));
            buf.extend_from_slice(m.row((r + 1) % ROWS));
            buf.extend_from_slice(down.row(0));
        }
        let bytes = buf.len();
        let bufs = copies(buf, bytes);
        let operand = Operand::new(x, qtype);
        let views: Vec<Vec<&[u8]>> = bufs
            .iter()
            .map(|b| b.chunks_exact(layout.bundle_bytes()).collect())
            .collect();
        // A threshold that leaves 10 % of the neurons active (ReLU).
        let mut gates = vec![0.0f32; ROWS];
        let mut out = vec![0.0f32; COLS];
        let relu = Activation::Relu;
        ffn_bundles(
            &layout,
            &operand,
            &views[0],
            relu,
            f32::INFINITY,
            &mut out,
            &mut gates,
        )
        .expect("valid bundles");
        gates.sort_by(|a, b| b.total_cmp(a));
        let threshold = gates[ROWS / 10];
        // Bytes touched: every gate row, and up and down of the active tenth.
        let touched = ROWS * layout.row_bytes() + ROWS / 10 * 2 * layout.row_bytes();
        g.throughput(Throughput::BytesDecimal(touched as u64));
        let pool = pool(1);
        let mut i = 0;
        g.bench_function(format!("{qtype}"), |b| {
            b.iter(|| {
                i = (i + 1) % views.len();
                pool.install(|| {
                    ffn_bundles(
                        &layout, &operand, &views[i], relu, threshold, &mut out, &mut gates,
                    )
                })
            })
        });
    }
    g.finish();
}

fn bench_matmul(c: &mut Criterion) {
    const T: usize = 64;
    let (rows, cols) = (2048, 2048);
    let mut rng = StdRng::seed_from_u64(3);
    let m = Matrix::new(rows, cols, random(rows * cols, &mut rng));
    let x = random(T * cols, &mut rng);
    let mut out = vec![0.0f32; T * rows];
    let mut g = c.benchmark_group("matmul");
    g.throughput(Throughput::Elements((T * rows * cols) as u64));
    let pool = pool(1);
    g.bench_function("f32", |b| {
        b.iter(|| pool.install(|| leanstream::kernels::matmul_t(&m, &x, T, &mut out)))
    });
    for qtype in [QuantType::Q8_0, QuantType::Q4_0] {
        let q = QMatrix::quantize(&m, qtype).expect("a whole number of blocks");
        g.bench_function(format!("{qtype}"), |b| {
            b.iter(|| pool.install(|| q.matmul_t(&x, T, &mut out)))
        });
    }
    g.finish();
}

/// GB/s of every measured benchmark, from criterion's saved estimates, against `read/sum`.
fn summary() {
    // Where criterion saves: $CRITERION_HOME, else `criterion` in the target directory, which
    // holds this binary in `release/deps/`.
    let dir = match std::env::var_os("CRITERION_HOME") {
        Some(home) => std::path::PathBuf::from(home),
        None => match std::env::current_exe()
            .ok()
            .and_then(|exe| Some(exe.parent()?.parent()?.parent()?.join("criterion")))
        {
            Some(dir) => dir,
            None => return,
        },
    };
    let mut rows = Vec::new();
    collect(&dir, &mut rows);
    rows.sort_by(|a, b| a.0.cmp(&b.0));
    let read = rows
        .iter()
        .find(|(name, _)| name == "read/sum")
        .map(|(_, gbs)| *gbs);
    println!("\n{:<36} {:>8} {:>9}", "benchmark", "GB/s", "of read");
    for (name, gbs) in &rows {
        let share = read.map_or(String::new(), |r| format!("{:.0} %", 100.0 * gbs / r));
        println!("{name:<36} {gbs:>8.1} {share:>9}");
    }
}

/// Finds `<id>/new/{estimates,benchmark}.json` under `dir` and records bytes per second.
fn collect(dir: &std::path::Path, rows: &mut Vec<(String, f64)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.file_name().is_some_and(|n| n == "new") {
            let read = |f: &str| -> Option<serde_json::Value> {
                serde_json::from_str(&std::fs::read_to_string(p.join(f)).ok()?).ok()
            };
            let (Some(est), Some(meta)) = (read("estimates.json"), read("benchmark.json")) else {
                continue;
            };
            let ns = est["median"]["point_estimate"].as_f64();
            let bytes = meta["throughput"]["BytesDecimal"].as_f64();
            if let (Some(ns), Some(bytes)) = (ns, bytes) {
                let name = meta["full_id"].as_str().unwrap_or("?").to_string();
                rows.push((name, bytes / ns));
            }
        } else if p.is_dir() {
            collect(&p, rows);
        }
    }
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    let mut rng = StdRng::seed_from_u64(1);
    let m = Matrix::new(ROWS, COLS, random(ROWS * COLS, &mut rng));
    let x = random(COLS, &mut rng);
    bench_read(&mut c);
    bench_matvec(&mut c, &m, &x);
    bench_matvec_hot(&mut c, &x);
    bench_bundles(&mut c, &m, &x);
    bench_matmul(&mut c);
    c.final_summary();
    summary();
}
