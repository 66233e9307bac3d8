//! Kernel throughput against the machine's read bandwidth.
//!
//! `cargo bench -p leanstream --bench kernels` measures, on matrices larger than the last-level
//! cache (4096 × 11008, the shape of a 7B model's FFN, cycled through copies so that every pass
//! reads from DRAM):
//! - `read`: summing a buffer as large as the working set — the bandwidth the others are held to;
//! - `matvec/<isa>/<type>/t<threads>`: batch-1 mat-vec of every encoding and instruction set;
//! - `matvec_hot/<isa>/<type>`: the same on a matrix that stays in L2 (the compute ceiling);
//! - `dots/<isa>/<type>/<rows>x<cols>/{single,multi}`: a mat-vec that stays in L2 (SmolLM2's FFN
//!   shape, 1536 × 576, and 256 × 4096; the K-quants only the second) one row's `dot` at a time
//!   against
//!   [`RowKernels::dots_by`] four rows sharing the input's loads (the same bits);
//! - `bundles/<type>/{split,interleaved}`: the sparse FFN over neuron bundles with 10 % of the
//!   neurons active, in clusters of the converter's default size (32 KiB) stored in format 1.6's
//!   split layout `[gate rows | up rows | down columns]` or 1.5's `[gate | up | down]` per neuron;
//! - `down/<type>/{per_neuron,blocked}`: the down projection of a tenth of the neurons (1100
//!   columns of 4096), added one column at a time (`axpy`, the output read and written per
//!   neuron) against [`RowKernels::axpy_rows`] eight at a time (the output once per eight), the
//!   same bits; in bytes of columns per second (the columns, 1.7–5 MB, stay in the last-level
//!   cache after the first pass: this is the compute side of the down projection);
//! - `matmul/<type>`: a 64-token prompt chunk (mat-mat), in multiply-adds per second.
//!
//! The filter `ffn` instead prints one table: a whole SwiGLU FFN of SmolLM2's shape (30 layers of
//! 1536 × 576: 61 MB, more than a last-level cache) as a converted Q4_1 GGUF stores it — `q4_1`
//! gate and up rows, `q8_0` down columns, split 32 KiB clusters, the `gate_up` rule with 60 % of
//! the neurons active — through the bundle engine's [`ffn_cluster`], against the same layer as
//! three dense `q4_1` mat-vecs (gate, up, down), interleaved, fastest and median of 40 passes.
//! `LEANSTREAM_BENCH_ACTIVE=F` leaves the fraction F of the neurons active instead (0: none, so
//! the bundle pass reads only the gate and up rows); `LEANSTREAM_BENCH_CLUSTER_KIB` sets its
//! cluster size too.
//!
//! A filter argument works as for any criterion bench (`cargo bench -p leanstream --bench kernels --
//! matvec/avx512`). The filter `table` instead prints the GB/s table of the report: mat-vec of
//! every encoding and the bundle FFN over the same rows (10 % of the neurons active, counted in the
//! bytes it touches; clusters in both layouts) against the read bandwidth, measured interleaved.
//! `LEANSTREAM_BENCH_CLUSTER_KIB=N` sets the converter's target for the bundles' clusters
//! (default 32 KiB; the count as the converter makes it, `cluster_neurons`: 8 neurons of this
//! width for the 4-bit types, 2 to 4 for the others). Its last columns are the same mat-vec over
//! the matrix in row groups ([`QMatrix::in_groups`]), where the kernels have them, and the bundle
//! FFN over the clusters kept in row groups as the cache keeps them (against that mat-vec).
//! `LEANSTREAM_BENCH_TYPES=q4_0,q4_1` limits it to those encodings. `LEANSTREAM_KERNELS=avx2` runs
//! the engine's kernels (`best`) as on an AVX2-only CPU.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput};
use leanstream::kernels::bundles::{
    down_pass, ffn_cluster, ffn_rows, keep_positive, prefetch_head, BundleLayout, ClusterRows,
};
use leanstream::kernels::grouped_cluster::{
    cluster_neurons, gate_pass_grouped_cluster, group_cluster, groupable_cluster,
};
use leanstream::kernels::{Matrix, Operand, QMatrix, RowKernels};
use leanstream::source::config::Activation;
use leanstream::streaming::skip_rule::{Skip, SkipRule};
use leanstream_format::container::page_align;
use leanstream_format::ffn::{ClusterLayout, PartTypes};
use leanstream_format::quant::QuantType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const ROWS: usize = 11008;
const COLS: usize = 4096;
/// Bytes cycled through per benchmark: far above any cache of this machine.
const WORKING_SET: usize = 1 << 30;
/// The converter's default cluster size (`--cluster-kib 32`), in KiB; `LEANSTREAM_BENCH_CLUSTER_KIB`
/// sets another.
const CLUSTER_KIB: usize = 32;
/// Both cluster layouts: format 1.6's and 1.5's.
const LAYOUTS: [ClusterLayout; 2] = [ClusterLayout::Split, ClusterLayout::Interleaved];

fn random(n: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Enough copies of `m` to fill the working set.
fn copies<T: Clone>(m: T, bytes: usize) -> Vec<T> {
    vec![m; WORKING_SET.div_ceil(bytes)]
}

/// The bundles' cluster size in KiB: `LEANSTREAM_BENCH_CLUSTER_KIB`, else [`CLUSTER_KIB`].
fn cluster_kib() -> usize {
    std::env::var("LEANSTREAM_BENCH_CLUSTER_KIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CLUSTER_KIB)
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
    g.bench_function("sum", |b| b.iter(|| sum(black_box(&buf))));
    g.finish();
}

/// Every encoding, or those `LEANSTREAM_BENCH_TYPES` lists (`q4_0,q4_1`).
fn bench_types() -> impl Iterator<Item = QuantType> {
    let only = std::env::var("LEANSTREAM_BENCH_TYPES").ok();
    QuantType::ALL.into_iter().filter(move |t| {
        only.as_ref()
            .is_none_or(|o| o.split(',').any(|o| o == t.name()))
    })
}

fn bench_matvec(c: &mut Criterion, f32_matrix: &Matrix, x: &[f32]) {
    let mut g = c.benchmark_group("matvec");
    let mut out = vec![0.0f32; ROWS];
    for qtype in bench_types() {
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

/// One row's `dot` at a time against four rows' `dots`, on matrices that stay in L2.
fn bench_dots(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(5);
    let mut g = c.benchmark_group("dots");
    for (rows, cols) in [(1536, 576), (256, 4096)] {
        let m = Matrix::new(rows, cols, random(rows * cols, &mut rng));
        let x = random(cols, &mut rng);
        let mut out = vec![0.0f32; rows];
        for qtype in QuantType::ALL.into_iter().filter(|t| t.is_block()) {
            // The K-quants' 256-value blocks do not fill SmolLM2's 576-wide rows (a GGUF stores
            // those as Q5_0 or Q8_0).
            if !cols.is_multiple_of(qtype.block_len()) {
                continue;
            }
            let q = QMatrix::quantize(&m, qtype).expect("a whole number of blocks");
            g.throughput(Throughput::BytesDecimal(q.bytes() as u64));
            let operand = Operand::new(&x, qtype);
            let views: Vec<&[u8]> = (0..rows).map(|r| q.row(r)).collect();
            for k in RowKernels::available() {
                let name = format!("{}/{qtype}/{rows}x{cols}", k.isa);
                g.bench_function(format!("{name}/single"), |b| {
                    b.iter(|| {
                        for (o, row) in out.iter_mut().zip(&views) {
                            *o = k.dot(qtype, row, &operand);
                        }
                    })
                });
                let single = out.clone();
                g.bench_function(format!("{name}/multi"), |b| {
                    b.iter(|| k.dots_by(qtype, &views, &operand, &mut out, 4))
                });
                let same = single
                    .iter()
                    .zip(&out)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{name}: dots differ from dot");
            }
        }
    }
    g.finish();
}

fn bench_bundles(c: &mut Criterion, f32_matrix: &Matrix, x: &[f32]) {
    let mut g = c.benchmark_group("bundles");
    let mut rng = StdRng::seed_from_u64(2);
    for qtype in QuantType::ALL {
        let m = QMatrix::quantize(f32_matrix, qtype).expect("a whole number of blocks");
        let bundles = Bundles::new(&m, qtype, x, &mut rng);
        let operand = Operand::new(x, qtype);
        let mut scores = vec![0.0f32; ROWS];
        let mut out = vec![0.0f32; COLS];
        g.throughput(Throughput::BytesDecimal(bundles.touched as u64));
        let pool = pool(1);
        for (li, layout) in LAYOUTS.iter().enumerate() {
            let mut i = 0;
            g.bench_function(format!("{qtype}/{}", name(*layout)), |b| {
                b.iter(|| {
                    i = (i + 1) % bundles.bufs[li].len();
                    pool.install(|| bundles.run(li, i, &operand, &mut out, &mut scores))
                })
            });
        }
    }
    g.finish();
}

fn name(layout: ClusterLayout) -> &'static str {
    match layout {
        ClusterLayout::Split => "split",
        ClusterLayout::Interleaved => "interleaved",
    }
}

/// A 7B-shaped layer's neuron bundles, gate and up rows from a matrix and down columns random,
/// in page-aligned clusters of the converter's default size as a file stores them, in each of
/// [`LAYOUTS`], copied to fill the working set; and the ReLU skip rule that leaves 10 % of the
/// neurons active.
struct Bundles {
    layout: BundleLayout,
    /// Per layout, the copies of the layer.
    bufs: [Vec<Vec<u8>>; 2],
    /// The split copies with each cluster's gate and up rows in row groups, as the cache keeps
    /// them ([`group_cluster`]); empty where the kernels do not group these clusters.
    grouped: Vec<Vec<u8>>,
    /// Each cluster's offset in a copy and its neurons.
    clusters: Vec<(usize, usize)>,
    skip: Skip,
    /// Bytes a pass touches: every gate row, and up and down of the active tenth.
    touched: usize,
}

impl Bundles {
    fn new(m: &QMatrix, qtype: QuantType, x: &[f32], rng: &mut StdRng) -> Self {
        let layout =
            BundleLayout::new(qtype, COLS, ClusterLayout::Split).expect("a whole number of blocks");
        let down = QMatrix::quantize(&Matrix::new(1, COLS, random(COLS, rng)), qtype)
            .expect("a whole number of blocks");
        let (rb, bb) = (layout.row_bytes(), layout.bundle_bytes());
        let per_cluster = cluster_neurons(cluster_kib() as u32, bb, ROWS, layout.qtypes);
        let mut bundles = Vec::with_capacity(ROWS * bb);
        for r in 0..ROWS {
            bundles.extend_from_slice(m.row(r));
            bundles.extend_from_slice(m.row((r + 1) % ROWS));
            bundles.extend_from_slice(down.row(0));
        }
        let mut clusters = Vec::new();
        let bufs = LAYOUTS.map(|cluster| {
            let buf;
            (buf, clusters) = in_clusters(&bundles, rb, per_cluster, cluster);
            let bytes = buf.len();
            copies(buf, bytes)
        });
        let relu = Skip {
            act: Activation::Relu,
            rule: SkipRule::Gate,
            threshold: f32::INFINITY,
        };
        let grouped = if groupable_cluster(RowKernels::best(), &layout, per_cluster) {
            let mut buf = bufs[0][0].clone();
            for &(at, count) in &clusters {
                group_cluster(&layout, &mut buf[at..], count, &mut Vec::new());
            }
            let bytes = buf.len();
            copies(buf, bytes)
        } else {
            Vec::new()
        };
        let mut this = Self {
            layout,
            bufs,
            grouped,
            clusters,
            skip: relu,
            touched: ROWS * rb[0] + ROWS / 10 * (rb[1] + rb[2]),
        };
        // The scores are relu(gate): the tenth largest decides.
        let mut scores = vec![0.0f32; ROWS];
        this.run(
            0,
            0,
            &Operand::new(x, qtype),
            &mut vec![0.0f32; COLS],
            &mut scores,
        );
        scores.sort_by(|a, b| b.total_cmp(a));
        this.skip.threshold = scores[ROWS / 10];
        this
    }

    /// The FFN over copy `copy` of the layer in layout `LAYOUTS[which]`, cluster after cluster.
    fn run(&self, which: usize, copy: usize, x: &Operand, out: &mut [f32], scores: &mut [f32]) {
        let layout = self.layout.with_cluster(LAYOUTS[which]);
        run_clusters(
            &layout,
            &self.clusters,
            &self.bufs[which][copy],
            x,
            self.skip,
            out,
            scores,
        );
    }
}

impl Bundles {
    /// [`Bundles::run`] over copy `copy` of the clusters kept in row groups: each cluster's
    /// gates eight neurons per vector operation, then its active neurons' down columns.
    fn run_grouped(&self, copy: usize, x: &Operand, out: &mut [f32], scores: &mut [f32]) {
        let (k, layout, buf) = (RowKernels::best(), &self.layout, &self.grouped[copy]);
        let (mut active, mut coef) = (vec![0u32; ROWS], vec![0.0f32; ROWS]);
        let mut first = 0;
        for &(at, count) in &self.clusters {
            let rows = ClusterRows::new(layout, &buf[at..], count).expect("valid clusters");
            let (scores, active, coef) = (
                &mut scores[first..first + count],
                &mut active[..count],
                &mut coef[..count],
            );
            let m = gate_pass_grouped_cluster(
                k,
                layout,
                x,
                &buf[at..],
                &rows,
                |_| true,
                self.skip,
                scores,
                active,
                coef,
            );
            let m = keep_positive(self.skip.act, &mut active[..m], &mut coef[..m]);
            down_pass(k, layout, &rows, &active[..m], &coef[..m], out);
            first += count;
        }
    }
}

/// `bundles` (`[gate | up | down]` each, parts of `rb` bytes) stored as a file stores them:
/// clusters of `per_cluster` neurons in layout `cluster`, each padded to whole pages. Returns the
/// bytes and each cluster's offset in them and neuron count.
fn in_clusters(
    bundles: &[u8],
    rb: [usize; 3],
    per_cluster: usize,
    cluster: ClusterLayout,
) -> (Vec<u8>, Vec<(usize, usize)>) {
    let bb: usize = rb.iter().sum();
    let (mut buf, mut clusters) = (Vec::new(), Vec::new());
    for chunk in bundles.chunks(per_cluster * bb) {
        clusters.push((buf.len(), chunk.len() / bb));
        buf.extend(cluster.arrange(chunk, rb));
        buf.resize(page_align(buf.len() as u64) as usize, 0);
    }
    (buf, clusters)
}

/// The FFN over the clusters of one layer ([`in_clusters`]) in `buf`, cluster after cluster, as
/// the engine computes them: the next cluster's first rows asked for while one is computed.
fn run_clusters(
    layout: &BundleLayout,
    clusters: &[(usize, usize)],
    buf: &[u8],
    x: &Operand,
    skip: Skip,
    out: &mut [f32],
    scores: &mut [f32],
) {
    let mut first = 0;
    for (j, &(at, count)) in clusters.iter().enumerate() {
        if let Some(&(at, count)) = clusters.get(j + 1) {
            if let Ok(rows) = ClusterRows::new(layout, &buf[at..], count) {
                prefetch_head(&rows, skip);
            }
        }
        let scores = &mut scores[first..first + count];
        ffn_cluster(layout, x, &buf[at..], skip, out, scores).expect("valid clusters");
        first += count;
    }
}

/// [`run_clusters`] over a layer held in runs (every gate row, then every up row, then every down
/// column: the layer's bundles arranged as one split cluster): the same clusters, computed in the
/// same order, their rows in the layer's runs.
#[allow(clippy::too_many_arguments)]
fn run_in_runs(
    layout: &BundleLayout,
    clusters: &[(usize, usize)],
    buf: &[u8],
    start: [usize; 3],
    x: &Operand,
    skip: Skip,
    out: &mut [f32],
    scores: &mut [f32],
) {
    let rb = layout.row_bytes();
    let rows = |first: usize, count: usize| {
        let at = std::array::from_fn(|p| start[p] + first * rb[p]);
        ClusterRows::in_runs(layout, buf, at, count).expect("runs within the layer")
    };
    let mut first = 0;
    for (j, &(_, count)) in clusters.iter().enumerate() {
        if let Some(&(_, next)) = clusters.get(j + 1) {
            prefetch_head(&rows(first + count, next), skip);
        }
        let scores = &mut scores[first..first + count];
        ffn_rows(layout, x, rows(first, count), skip, out, scores).expect("valid clusters");
        first += count;
    }
}

/// The down projection of a tenth of a 7B layer's neurons: per neuron against blocked.
fn bench_down(c: &mut Criterion, f32_matrix: &Matrix) {
    const ACTIVE: usize = ROWS / 10;
    const BLOCK: usize = 8;
    let mut g = c.benchmark_group("down");
    let k = RowKernels::best();
    let coef: Vec<f32> = (0..ACTIVE).map(|i| 1.0 / (1 + i) as f32).collect();
    for qtype in [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::F16,
    ] {
        // A tenth of the rows, spread over the matrix as active neurons are.
        let m = QMatrix::quantize(f32_matrix, qtype).expect("a whole number of blocks");
        let rows: Vec<&[u8]> = (0..ACTIVE).map(|i| m.row(i * 10)).collect();
        g.throughput(Throughput::BytesDecimal((ACTIVE * m.row(0).len()) as u64));
        let (mut one, mut blocked) = (vec![0.0f32; COLS], vec![0.0f32; COLS]);
        let per_neuron = |out: &mut [f32]| {
            for (&a, r) in coef.iter().zip(&rows) {
                k.axpy(qtype, a, r, out);
            }
        };
        let in_blocks = |out: &mut [f32]| {
            for (a, r) in coef.chunks(BLOCK).zip(rows.chunks(BLOCK)) {
                k.axpy_rows(qtype, a, r, out);
            }
        };
        // Once from zero each: the same bits.
        per_neuron(&mut one);
        in_blocks(&mut blocked);
        assert_eq!(
            one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            blocked.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{qtype}: blocked and per-neuron down projections differ"
        );
        g.bench_function(format!("{qtype}/per_neuron"), |b| {
            b.iter(|| per_neuron(&mut one))
        });
        g.bench_function(format!("{qtype}/blocked"), |b| {
            b.iter(|| in_blocks(&mut blocked))
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

/// The GB/s table: for each encoding, mat-vec passes (best kernels, 1 and 2 threads) alternate
/// with reads of equally large slices of a plain buffer, so that both see the same load from other
/// processes (this machine is shared); each figure is the fastest of its calls.
fn bandwidth_table(f32_matrix: &Matrix, x: &[f32]) {
    const ROUNDS: usize = 3;
    let buf = vec![1.0f32; WORKING_SET / 4];
    let pools = [pool(1), pool(2)];
    let mut out = vec![0.0f32; ROWS];
    println!(
        "\nmat-vec {ROWS}×{COLS} from DRAM, kernels {}, fastest call of {ROUNDS} interleaved passes",
        RowKernels::best().isa
    );
    println!(
        "{:<6} {:>8} {:>10} {:>18} {:>18} {:>48} {:>22} {:>28} {:>38}",
        "type",
        "MB",
        "read GB/s",
        "1 thread GB/s",
        "2 threads GB/s",
        "bundles 1.6 split, 1 thread GB/s",
        "bundles 1.5 GB/s",
        "row groups, 1 thread GB/s",
        "bundles in row groups, 1 thread GB/s"
    );
    let mut rng = StdRng::seed_from_u64(2);
    for qtype in bench_types() {
        let m = QMatrix::quantize(f32_matrix, qtype).expect("a whole number of blocks");
        let bytes = m.bytes();
        let ms = copies(m, bytes);
        let operand = Operand::new(x, qtype);
        let bundles = Bundles::new(&ms[0], qtype, x, &mut rng);
        let (mut scores, mut ffn_out) = (vec![0.0f32; ROWS], vec![0.0f32; COLS]);
        // The same rows in groups of eight, where the type has that layout.
        let grouped = ms[0].clone().in_groups();
        let grouped = if grouped.is_grouped() {
            copies(grouped, bytes)
        } else {
            Vec::new()
        };
        // Fastest seconds per call: read, 1 thread, 2 threads, bundles split (1.6), a read of
        // their touched bytes, bundles interleaved (1.5), row groups, bundles in row groups.
        let mut best = [f64::MAX; 8];
        let mut timed = |slot: usize, f: &mut dyn FnMut()| {
            let start = std::time::Instant::now();
            f();
            best[slot] = best[slot].min(start.elapsed().as_secs_f64());
        };
        for _ in 0..ROUNDS {
            for slice in buf.chunks_exact(bytes / 4) {
                timed(0, &mut || {
                    black_box(sum(black_box(slice)));
                });
            }
            for (p, pool) in pools.iter().enumerate() {
                for m in &ms {
                    timed(1 + p, &mut || pool.install(|| m.matvec(&operand, &mut out)));
                }
            }
            for (which, slot) in [(0, 3), (1, 5)] {
                for copy in 0..bundles.bufs[which].len() {
                    timed(slot, &mut || {
                        pools[0].install(|| {
                            bundles.run(which, copy, &operand, &mut ffn_out, &mut scores)
                        })
                    });
                }
            }
            for slice in buf.chunks_exact(bundles.touched / 4) {
                timed(4, &mut || {
                    black_box(sum(black_box(slice)));
                });
            }
            for g in &grouped {
                timed(6, &mut || pools[0].install(|| g.matvec(&operand, &mut out)));
            }
            for copy in 0..bundles.grouped.len() {
                timed(7, &mut || {
                    pools[0]
                        .install(|| bundles.run_grouped(copy, &operand, &mut ffn_out, &mut scores))
                });
            }
        }
        let gbs = |s: f64| bytes as f64 / s / 1e9;
        let read = gbs(best[0]);
        let touched = |s: f64| bundles.touched as f64 / s / 1e9;
        println!(
            "{:<6} {:>8.1} {:>10.1} {:>11.1} ({:>3.0} %) {:>11.1} ({:>3.0} %) {:>8.1} ({:>3.0} % of mat-vec, {:>3.0} % of read) {:>8.1} ({:>3.0} % of mat-vec) {:>14} {:>30}",
            qtype.name(),
            bytes as f64 / 1e6,
            read,
            gbs(best[1]),
            100.0 * gbs(best[1]) / read,
            gbs(best[2]),
            100.0 * gbs(best[2]) / read,
            touched(best[3]),
            100.0 * touched(best[3]) / gbs(best[1]),
            100.0 * touched(best[3]) / touched(best[4]),
            touched(best[5]),
            100.0 * touched(best[5]) / gbs(best[1]),
            if grouped.is_empty() {
                "-".to_string()
            } else {
                format!("{:.1} ({:.0} %)", gbs(best[6]), 100.0 * gbs(best[6]) / read)
            },
            if bundles.grouped.is_empty() {
                "-".to_string()
            } else {
                // Against the mat-vec in row groups where there is one.
                let dense = if grouped.is_empty() { best[1] } else { best[6] };
                format!(
                    "{:.1} ({:.0} % of mat-vec)",
                    touched(best[7]),
                    100.0 * touched(best[7]) / gbs(dense)
                )
            },
        );
    }
}

/// The `ffn` table (see the module's documentation): the bundle pass of a SmolLM2-shaped FFN
/// against its dense mat-vecs.
fn ffn_table() {
    const H: usize = 576;
    const N: usize = 1536;
    const LAYERS: usize = 30;
    const PASSES: usize = 40;
    let active = std::env::var("LEANSTREAM_BENCH_ACTIVE")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|f| (0.0..=1.0).contains(f))
        .unwrap_or(0.6);
    let mut rng = StdRng::seed_from_u64(3);
    let parts = PartTypes {
        gate: QuantType::Q4_1,
        up: QuantType::Q4_1,
        down: QuantType::Q8_0,
    };
    let layout = BundleLayout::with_parts(parts, H, ClusterLayout::Split).expect("whole blocks");
    let (rb, bb) = (layout.row_bytes(), layout.bundle_bytes());
    let per_cluster = (cluster_kib() * 1024 / bb).clamp(1, N);
    let matrix = |rows, cols, q, rng: &mut StdRng| {
        QMatrix::quantize(&Matrix::new(rows, cols, random(rows * cols, rng)), q)
            .expect("whole blocks")
    };
    let (mut layers, mut dense, mut clusters) = (Vec::new(), Vec::new(), Vec::new());
    let mut runs = Vec::new();
    let run_start = [0, N * rb[0], N * (rb[0] + rb[1])];
    for _ in 0..LAYERS {
        let (gate, up) = (
            matrix(N, H, QuantType::Q4_1, &mut rng),
            matrix(N, H, QuantType::Q4_1, &mut rng),
        );
        let columns = matrix(N, H, QuantType::Q8_0, &mut rng);
        let mut bundles = Vec::with_capacity(N * bb);
        for r in 0..N {
            for part in [gate.row(r), up.row(r), columns.row(r)] {
                bundles.extend_from_slice(part);
            }
        }
        let buf;
        (buf, clusters) = in_clusters(&bundles, rb, per_cluster, ClusterLayout::Split);
        layers.push(buf);
        runs.push(ClusterLayout::Split.arrange(&bundles, rb));
        dense.push([gate, up, matrix(H, N, QuantType::Q4_1, &mut rng)]);
    }
    let x = random(H, &mut rng);
    let operand = Operand::new(&x, layout.operand_type());
    let mut skip = Skip {
        act: Activation::Silu,
        rule: SkipRule::GateUp,
        threshold: 0.0,
    };
    let (mut out, mut scores) = (vec![0.0f32; H], vec![0.0f32; N]);
    let pass = |skip: Skip, buf: &[u8], out: &mut [f32], scores: &mut [f32]| {
        run_clusters(&layout, &clusters, buf, &operand, skip, out, scores)
    };
    // The threshold that leaves `active` of the first layer's neurons active.
    pass(skip, &layers[0], &mut out, &mut scores);
    let mut sorted = scores.clone();
    sorted.sort_by(f32::total_cmp);
    skip.threshold = match ((1.0 - active) * N as f64) as usize {
        i if i < N => sorted[i],
        _ => f32::INFINITY,
    };
    let (mut g, mut u, mut d) = (vec![0.0f32; N], vec![0.0f32; N], vec![0.0f32; H]);
    let dense_x = Operand::new(&x, QuantType::Q4_1);
    // The engine's reduction groups: a layer held in runs is computed a group at a time.
    let groups = vec![(0, N / 16); 16];
    let runs_pass = |spans: &[(usize, usize)], out: &mut [f32], scores: &mut [f32]| {
        for buf in &runs {
            run_in_runs(&layout, spans, buf, run_start, &operand, skip, out, scores);
        }
    };
    let (mut bundle_s, mut runs_s, mut group_s, mut dense_s) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut out_runs, mut scores_runs) = (vec![0.0f32; H], vec![0.0f32; N]);
    let time = |f: &mut dyn FnMut()| {
        let start = std::time::Instant::now();
        f();
        start.elapsed().as_secs_f64()
    };
    for _ in 0..PASSES {
        bundle_s.push(time(&mut || {
            for buf in &layers {
                pass(skip, buf, &mut out, &mut scores);
            }
        }));
        runs_s.push(time(&mut || {
            runs_pass(&clusters, &mut out_runs, &mut scores_runs)
        }));
        group_s.push(time(&mut || {
            runs_pass(&groups, &mut out_runs, &mut scores_runs)
        }));
        dense_s.push(time(&mut || {
            for [gate, up, down] in &dense {
                gate.matvec(&dense_x, &mut g);
                up.matvec(&dense_x, &mut u);
                for (g, u) in g.iter_mut().zip(&u) {
                    *g = *g / (1.0 + (-*g).exp()) * u;
                }
                down.matvec(&Operand::new(&g, QuantType::Q4_1), &mut d);
            }
        }));
        black_box((&out, &d));
    }
    // The same sums in the same order, wherever the rows lie and however many a pass takes.
    out.fill(0.0);
    pass(skip, &layers[0], &mut out, &mut scores);
    for spans in [&clusters, &groups] {
        out_runs.fill(0.0);
        run_in_runs(
            &layout,
            spans,
            &runs[0],
            run_start,
            &operand,
            skip,
            &mut out_runs,
            &mut scores_runs,
        );
        assert_eq!(out, out_runs, "clusters and runs give the same bits");
    }
    for v in [&mut bundle_s, &mut runs_s, &mut group_s, &mut dense_s] {
        v.sort_by(f64::total_cmp);
    }
    let touched = LAYERS as f64 * N as f64 * (rb[0] + rb[1]) as f64
        + LAYERS as f64 * N as f64 * active * rb[2] as f64;
    let dense_bytes = LAYERS * dense[0].iter().map(QMatrix::bytes).sum::<usize>();
    println!(
        "\nSmolLM2-shaped FFN, {LAYERS} layers, kernels {}, {PASSES} interleaved passes, 1 thread",
        RowKernels::best().isa
    );
    println!(
        "{:<40} {:>10} {:>10} {:>10} {:>14}",
        "", "MB read", "fastest ms", "median ms", "GB/s (fastest)"
    );
    let bundles = format!(
        "bundles ({} KiB split, {:.0} % active)",
        cluster_kib(),
        100.0 * active
    );
    for (name, bytes, s) in [
        (bundles.as_str(), touched, &bundle_s),
        ("the same, layer in three runs", touched, &runs_s),
        ("runs, a 16th of the layer per pass", touched, &group_s),
        ("dense q4_1 mat-vecs", dense_bytes as f64, &dense_s),
    ] {
        println!(
            "{name:<40} {:>10.1} {:>10.3} {:>10.3} {:>14.1}",
            bytes / 1e6,
            s[0] * 1e3,
            s[PASSES / 2] * 1e3,
            bytes / s[0] / 1e9
        );
    }
    println!(
        "bundles / dense, time of the fastest pass: {:.2} (clusters), {:.2} (runs), {:.2} (runs by 16ths)",
        bundle_s[0] / dense_s[0],
        runs_s[0] / dense_s[0],
        group_s[0] / dense_s[0]
    );
}

fn sum(v: &[f32]) -> f32 {
    let mut acc = [0.0f32; 32];
    for chunk in v.chunks_exact(32) {
        for (a, x) in acc.iter_mut().zip(chunk) {
            *a += x;
        }
    }
    acc.iter().sum()
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` does not, and should not spend a
    // minute building gigabytes of matrices.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    if std::env::args().any(|a| a == "ffn") {
        return ffn_table();
    }
    let mut rng = StdRng::seed_from_u64(1);
    let m = Matrix::new(ROWS, COLS, random(ROWS * COLS, &mut rng));
    let x = random(COLS, &mut rng);
    if std::env::args().any(|a| a == "table") {
        return bandwidth_table(&m, &x);
    }
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    bench_read(&mut c);
    bench_matvec(&mut c, &m, &x);
    bench_matvec_hot(&mut c, &x);
    bench_dots(&mut c);
    bench_bundles(&mut c, &m, &x);
    bench_down(&mut c, &m);
    bench_matmul(&mut c);
    c.final_summary();
}
