//! Every kernel of every instruction set this CPU runs, against scalar f64 references built from the
//! format's scalar decoder, on fresh random inputs (the seed is in every failure message).

use leanstream_format::ffn::ClusterLayout;
use leanstream_format::quant::{dequantize_row, quantize_row, QuantType, BLOCK_LEN};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::bundles::{ffn_bundles, ffn_cluster, BundleLayout};
use super::qmatrix::GEMM_MIN_TOKENS;
use super::rows::{pick, FORCE_ENV};
use super::{Matrix, Operand, Q8Vec, QMatrix, RowKernels, RowStream, Weight};
use crate::source::config::Activation;
use crate::streaming::skip_rule::{Skip, SkipRule};

fn rng() -> (u64, StdRng) {
    let seed = rand::random();
    (seed, StdRng::seed_from_u64(seed))
}

fn random(n: usize, scale: f32, rng: &mut StdRng) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// Lengths that are not multiples of any SIMD width, for the float types; whole blocks (odd and
/// even counts, below and above the unrolled steps) for the block types (fewer of the K-quants'
/// 256-value blocks).
fn lengths(qtype: QuantType) -> Vec<usize> {
    if qtype.is_k_quant() {
        [1, 2, 3, 5, 9, 17]
            .iter()
            .map(|b| b * qtype.block_len())
            .collect()
    } else if qtype.is_block() {
        [1, 2, 3, 4, 5, 7, 8, 9, 33, 129]
            .iter()
            .map(|b| b * BLOCK_LEN)
            .collect()
    } else {
        vec![
            1, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 100, 257, 1000, 4101,
        ]
    }
}

/// A random row encoded as `qtype`, and its decoded values in f64.
fn encoded_row(qtype: QuantType, n: usize, rng: &mut StdRng) -> (Vec<u8>, Vec<f64>) {
    let row = random(n, 1.0, rng);
    let bytes = quantize_row(qtype, &row).unwrap();
    let mut decoded = vec![0.0f32; n];
    dequantize_row(qtype, &bytes, &mut decoded).unwrap();
    (bytes, decoded.iter().map(|v| *v as f64).collect())
}

/// The input vector as the kernels of `qtype` see it (q8-rounded for block types).
fn seen(x: &Operand, qtype: QuantType) -> Vec<f64> {
    if qtype.is_block() {
        let q = x.q8();
        (0..q.len()).map(|i| q.value(i) as f64).collect()
    } else {
        x.x.iter().map(|v| *v as f64).collect()
    }
}

fn dot64(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn abs_dot64(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x * y).abs()).sum()
}

/// f32 accumulation error allowed relative to `Σ|w·x|`.
const REL: f64 = 1e-5;

#[test]
fn q8_quantization_is_within_half_a_step() {
    let (seed, mut rng) = rng();
    let mut x = random(8 * BLOCK_LEN, 3.0, &mut rng);
    x[..BLOCK_LEN].fill(0.0);
    x[BLOCK_LEN] = 1e-30;
    let q = Q8Vec::quantize(&x);
    for (i, v) in x.iter().enumerate() {
        let d = q.scales[i / BLOCK_LEN] as f64;
        let err = (*v as f64 - q.value(i) as f64).abs();
        assert!(err <= d / 2.0 * (1.0 + 1e-6), "seed {seed}: element {i}");
        assert!(
            q.quants[i] != i8::MIN,
            "seed {seed}: -128 breaks the sign trick"
        );
    }
    for b in 0..8 {
        let sum: i32 = q.quants[b * BLOCK_LEN..(b + 1) * BLOCK_LEN]
            .iter()
            .map(|v| *v as i32)
            .sum();
        assert_eq!(q.sums[b], q.scales[b] * sum as f32);
    }
}

#[test]
fn row_dots_match_f64() {
    let (seed, mut rng) = rng();
    for k in RowKernels::available() {
        for qtype in QuantType::ALL {
            let mut max_err = 0.0f64;
            for n in lengths(qtype) {
                let (bytes, w) = encoded_row(qtype, n, &mut rng);
                let xs = random(n, 2.0, &mut rng);
                let x = Operand::new(&xs, qtype);
                let got = k.dot(qtype, &bytes, &x) as f64;
                let want = dot64(&w, &seen(&x, qtype));
                let tol = REL * abs_dot64(&w, &seen(&x, qtype)) + 1e-30;
                max_err = max_err.max((got - want).abs() / abs_dot64(&w, &seen(&x, qtype)));
                assert!(
                    (got - want).abs() <= tol,
                    "seed {seed}: {} {qtype} n={n}: {got} vs {want}",
                    k.isa
                );
                // Against the unquantized input: the q8 rounding adds at most d_x/2 per element.
                let exact = dot64(&w, &xs.iter().map(|v| *v as f64).collect::<Vec<_>>());
                let q8_bound: f64 = if qtype.is_block() {
                    w.iter()
                        .enumerate()
                        .map(|(i, wi)| wi.abs() * x.q8().scales[i / BLOCK_LEN] as f64 / 2.0)
                        .sum()
                } else {
                    0.0
                };
                assert!(
                    (got - exact).abs() <= q8_bound * 1.001 + tol,
                    "seed {seed}: {} {qtype} n={n}: {got} vs exact {exact}",
                    k.isa
                );
            }
            report("dot", k.isa, qtype, max_err);
        }
    }
}

/// Prints a kernel's largest error against the f64 reference, relative to the sum of the
/// magnitudes it added up (what `REL` bounds); `scripts/test-aarch64.sh` collects these lines.
fn report(kernel: &str, isa: &str, qtype: impl std::fmt::Display, max_err: f64) {
    eprintln!("max-error {kernel} {isa} {qtype} {max_err:.3e}");
}

/// Every kernel set this CPU runs computes the portable set's bits for every encoding: `dot`,
/// `dots` (several rows at once) and `axpy`, on random and zero inputs of every length. (The
/// activation is quantized to q8 before each mat-vec, so a last-bit difference anywhere, the
/// attention's float dot products included, can move a whole quantization step: the Q6_K
/// fixture's perplexity once differed by 1.5e-4 between the AVX-512 and portable sets.)
#[test]
fn every_set_is_portable_bit_for_bit() {
    let (seed, mut rng) = rng();
    let sets: Vec<RowKernels> = RowKernels::available()
        .into_iter()
        .filter(|k| k.isa != "portable")
        .collect();
    #[cfg(target_arch = "aarch64")]
    assert!(!sets.is_empty(), "no NEON kernel set on aarch64");
    let portable = *RowKernels::available().last().unwrap();
    assert_eq!(portable.isa, "portable");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for k in sets {
        for qtype in QuantType::ALL {
            for n in lengths(qtype) {
                for zeros in [false, true] {
                    let (bytes, _) = encoded_row(qtype, n, &mut rng);
                    let mut xs = random(n, 2.0, &mut rng);
                    if zeros {
                        xs.fill(0.0);
                    }
                    let x = Operand::new(&xs, qtype);
                    let (got, want) = (k.dot(qtype, &bytes, &x), portable.dot(qtype, &bytes, &x));
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "seed {seed}: {} {qtype} n={n} zeros={zeros}: {got} vs {want}",
                        k.isa
                    );
                    let rows: Vec<Vec<u8>> =
                        (0..5).map(|_| encoded_row(qtype, n, &mut rng).0).collect();
                    let views: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
                    for at_once in 1..=super::rows::DOT_ROWS {
                        let mut got = vec![f32::NAN; 5];
                        let mut want = vec![f32::NAN; 5];
                        k.dots_by(qtype, &views, &x, &mut got, at_once);
                        portable.dots_by(qtype, &views, &x, &mut want, at_once);
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "seed {seed}: {} {qtype} n={n} zeros={zeros}: {at_once} rows at once",
                            k.isa
                        );
                    }
                    // One row against 1 to 10 inputs (the kernels take up to four or eight at
                    // once).
                    if qtype.is_block() {
                        let inputs: Vec<Vec<f32>> = (0..super::WIDE_INPUTS + 2)
                            .map(|_| random(n, 2.0, &mut rng))
                            .collect();
                        let ops: Vec<Operand> =
                            inputs.iter().map(|v| Operand::new(v, qtype)).collect();
                        for m in 1..=ops.len() {
                            let refs: Vec<&Operand> = ops[..m].iter().collect();
                            let mut got = vec![f32::NAN; m];
                            k.dot_inputs(qtype, &bytes, &refs, &mut got);
                            if m <= super::INPUTS {
                                let mut packed = vec![f32::NAN; m];
                                match super::Packed::new(qtype, &refs) {
                                    Some(p) => k.dot_packed(qtype, &bytes, &refs, &p, &mut packed),
                                    None => packed.copy_from_slice(&got),
                                }
                                assert_eq!(
                                    bits(&packed),
                                    bits(&got),
                                    "seed {seed}: {} {qtype} n={n}: {m} inputs packed",
                                    k.isa
                                );
                            }
                            let want: Vec<f32> = refs
                                .iter()
                                .map(|x| portable.dot(qtype, &bytes, x))
                                .collect();
                            assert_eq!(
                                bits(&got),
                                bits(&want),
                                "seed {seed}: {} {qtype} n={n}: {m} inputs at once",
                                k.isa
                            );
                        }
                    }
                    let a = rng.random_range(-2.0f32..2.0);
                    let (mut got, mut want) = (xs.clone(), xs.clone());
                    k.axpy(qtype, a, &bytes, &mut got);
                    portable.axpy(qtype, a, &bytes, &mut want);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "seed {seed}: {} {qtype} n={n}",
                        k.isa
                    );
                }
            }
        }
    }
}

/// The float kernels over rows laid one after another (a KV cache's keys and values): every set's
/// `dots_next` is the portable `dot` of each row and its `axpy_next` the portable `axpy` row after
/// row, bit for bit, for row counts around the four taken at once and lengths around the widths.
#[test]
fn float_rows_next_are_portable_bit_for_bit() {
    let (seed, mut rng) = rng();
    let portable = *RowKernels::available().last().unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for k in RowKernels::available() {
        for qtype in [QuantType::F32, QuantType::F16] {
            for n in lengths(qtype) {
                let rb = leanstream_format::quant::row_bytes(qtype, n).unwrap();
                for count in [0, 1, 3, 4, 5, 8, 11] {
                    let rows: Vec<u8> = (0..count)
                        .flat_map(|_| encoded_row(qtype, n, &mut rng).0)
                        .collect();
                    let x = random(n, 2.0, &mut rng);
                    let mut got = vec![f32::NAN; count];
                    k.dots_next(qtype, &rows, rb, &x, &mut got);
                    let want: Vec<f32> = rows
                        .chunks_exact(rb)
                        .map(|r| portable.dot(qtype, r, &Operand::new(&x, qtype)))
                        .collect();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "seed {seed}: {} {qtype} n={n}: dots of {count} rows",
                        k.isa
                    );
                    let a = random(count, 1.5, &mut rng);
                    let start = random(n, 1.0, &mut rng);
                    let mut got = start.clone();
                    k.axpy_next(qtype, &a, &rows, rb, &mut got);
                    let mut want = start;
                    for (&a, r) in a.iter().zip(rows.chunks_exact(rb)) {
                        portable.axpy(qtype, a, r, &mut want);
                    }
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "seed {seed}: {} {qtype} n={n}: axpy of {count} rows",
                        k.isa
                    );
                }
            }
        }
    }
}

#[test]
fn axpy_matches_f64_and_decoding_is_exact() {
    let (seed, mut rng) = rng();
    for k in RowKernels::available() {
        for qtype in QuantType::ALL {
            let mut max_err = 0.0f64;
            for n in lengths(qtype) {
                let (bytes, w) = encoded_row(qtype, n, &mut rng);
                let a = rng.random_range(-2.0f32..2.0);
                let out0 = random(n, 1.0, &mut rng);
                let mut out = out0.clone();
                k.axpy(qtype, a, &bytes, &mut out);
                // Q4_1 adds `a·m` and `a·d·q` separately: allow for their magnitudes.
                let wmax = w.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                for i in 0..n {
                    let want = out0[i] as f64 + a as f64 * w[i];
                    let scale = out0[i].abs() as f64 + (a as f64).abs() * wmax;
                    let tol = 1e-6 * scale + 1e-30;
                    max_err = max_err.max((out[i] as f64 - want).abs() / scale);
                    assert!(
                        (out[i] as f64 - want).abs() <= tol,
                        "seed {seed}: {} {qtype} n={n} element {i}: {} vs {want}",
                        k.isa,
                        out[i]
                    );
                }
                let mut decoded = vec![f32::NAN; n];
                k.dequantize(qtype, &bytes, &mut decoded);
                let want: Vec<f32> = w.iter().map(|v| *v as f32).collect();
                assert_eq!(decoded, want, "seed {seed}: {} {qtype} n={n}", k.isa);
            }
            report("axpy", k.isa, qtype, max_err);
        }
    }
}

/// Several rows added at once give the bits of adding them one after another, for every kernel
/// set, encoding, row count and length (so the sparse FFN's result does not depend on how its
/// active neurons are batched).
#[test]
fn axpy_rows_is_axpy_row_after_row_bit_for_bit() {
    let (seed, mut rng) = rng();
    for k in RowKernels::available() {
        for qtype in QuantType::ALL {
            for n in lengths(qtype) {
                for count in [1, 2, 3, 8, 9] {
                    let rows: Vec<Vec<u8>> = (0..count)
                        .map(|_| encoded_row(qtype, n, &mut rng).0)
                        .collect();
                    let views: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
                    let a = random(count, 2.0, &mut rng);
                    let out0 = random(n, 1.0, &mut rng);
                    let mut want = out0.clone();
                    for (a, row) in a.iter().zip(&views) {
                        k.axpy(qtype, *a, row, &mut want);
                    }
                    let mut got = out0;
                    k.axpy_rows(qtype, &a, &views, &mut got);
                    assert_eq!(
                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "seed {seed}: {} {qtype} n={n} rows={count}",
                        k.isa
                    );
                }
            }
        }
    }
}

/// Several rows' `dots` give the bits of each row's own `dot`, for every kernel set (the
/// portable reference included), encoding and length, any row count (odd counts split into fours
/// and a remainder), and zero inputs (the sign of a zero sum); and a mat-vec of an odd number of
/// rows, which takes its rows four at a time, is each row's `dot`.
#[test]
fn dots_are_dot_row_by_row_bit_for_bit() {
    let (seed, mut rng) = rng();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for k in RowKernels::available() {
        for qtype in QuantType::ALL {
            for n in lengths(qtype) {
                for (count, zeros) in [
                    (1, false),
                    (2, false),
                    (3, true),
                    (4, false),
                    (5, false),
                    (7, false),
                    (9, true),
                    (13, false),
                ] {
                    let rows: Vec<Vec<u8>> = (0..count)
                        .map(|_| encoded_row(qtype, n, &mut rng).0)
                        .collect();
                    let views: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
                    let mut xs = random(n, 2.0, &mut rng);
                    if zeros {
                        xs.fill(0.0);
                    }
                    let x = Operand::new(&xs, qtype);
                    let want: Vec<f32> = views.iter().map(|r| k.dot(qtype, r, &x)).collect();
                    // The set's own choice of rows at once, and every other.
                    for at_once in [0, 1, 2, 3, 4] {
                        let mut got = vec![f32::NAN; count];
                        if at_once == 0 {
                            k.dots(qtype, &views, &x, &mut got);
                        } else {
                            k.dots_by(qtype, &views, &x, &mut got, at_once);
                        }
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "seed {seed}: {} {qtype} n={n} rows={count} at once {at_once}: \
                             {got:?} vs {want:?}",
                            k.isa
                        );
                    }
                    let data: Vec<u8> = rows.concat();
                    let mut mv = vec![f32::NAN; count];
                    super::matvec_rows(&k, qtype, &data, &x, &mut mv);
                    assert_eq!(
                        bits(&mv),
                        bits(&want),
                        "seed {seed}: {} {qtype} n={n} mat-vec of {count} rows",
                        k.isa
                    );
                }
            }
        }
    }
}

/// Row groups ([`super::groups`]) give each row's `dot` bit for bit, through every kernel set and
/// the portable reference, for both 4-bit types, every length, several groups, and zero inputs;
/// a row comes back from its group unchanged.
#[test]
fn row_groups_are_dot_row_by_row_bit_for_bit() {
    use super::groups::{group_rows, groups_dot, ungroup_row, GROUP_ROWS};
    let (seed, mut rng) = rng();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for qtype in [QuantType::Q4_0, QuantType::Q4_1, QuantType::Q8_0] {
        for n in lengths(qtype) {
            for (groups, zeros) in [(1, false), (2, true), (3, false)] {
                let count = groups * GROUP_ROWS;
                let rows: Vec<Vec<u8>> = (0..count)
                    .map(|_| encoded_row(qtype, n, &mut rng).0)
                    .collect();
                let plain = rows.concat();
                let row = plain.len() / count;
                let mut grouped = vec![0u8; plain.len()];
                group_rows(qtype, &plain, row, &mut grouped);
                let mut back = vec![0u8; row];
                for (i, want) in rows.iter().enumerate() {
                    let g = &grouped[(i / GROUP_ROWS) * GROUP_ROWS * row..][..GROUP_ROWS * row];
                    ungroup_row(qtype, g, i % GROUP_ROWS, &mut back);
                    assert_eq!(&back, want, "{qtype} n={n}: row {i} of its group");
                }
                let mut xs = random(n, 2.0, &mut rng);
                if zeros {
                    xs.fill(0.0);
                }
                let x = Operand::new(&xs, qtype);
                let dot = match qtype {
                    QuantType::Q4_0 => super::portable::dot_q4_0,
                    QuantType::Q4_1 => super::portable::dot_q4_1,
                    _ => super::portable::dot_q8_0,
                };
                let want: Vec<f32> = rows.iter().map(|r| dot(r, x.q8())).collect();
                let mut got = vec![f32::NAN; count];
                groups_dot(qtype, &grouped, x.q8(), &mut got);
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "seed {seed}: portable {qtype} n={n}"
                );
                for k in RowKernels::available() {
                    let mut got = vec![f32::NAN; count];
                    k.groups_dot(qtype, &grouped, &x, &mut got);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "seed {seed}: {} {qtype} n={n} groups={groups}: {got:?} vs {want:?}",
                        k.isa
                    );
                }
            }
        }
    }
}

/// The gate pass, which takes its candidates' gate (and up) rows several at a time, gives the
/// scores, active neurons and coefficients of one `dot` per row, neuron after neuron, under both
/// rules, with candidates left out and odd counts; so does the pass over a layer held in runs
/// (every neuron a candidate), which reads them as a mat-vec does.
#[test]
fn gate_pass_is_one_dot_per_row_bit_for_bit() {
    use super::bundles::{
        gate_pass, gate_pass_groups, gate_pass_runs, ClusterRows, GroupedRuns, RUN_PASS,
    };
    use super::groups::{group_rows, groupable, GROUP_ROWS};
    let (seed, mut rng) = rng();
    let mut layouts: Vec<BundleLayout> = [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::F16,
    ]
    .map(|q| BundleLayout::new(q, 96, ClusterLayout::Split).unwrap())
    .into();
    layouts.extend(mixed_layouts());
    let bits = |v: &[f32]| v.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
    for k in RowKernels::available() {
        for &layout in &layouts {
            let (qtype, hidden) = (layout.qtypes, layout.hidden);
            for n in [1, 2, 3, 5, 8, 11, 37, RUN_PASS] {
                let (buf, _) = random_bundles(&layout, n, &mut rng);
                let bb = layout.bundle_bytes();
                let rb = layout.row_bytes();
                let bundle = |i: usize| &buf[i * bb..(i + 1) * bb];
                // The cluster in either layout gives the same.
                let cluster = if n % 2 == 0 {
                    ClusterLayout::Split
                } else {
                    ClusterLayout::Interleaved
                };
                let layout = layout.with_cluster(cluster);
                let stored = cluster.arrange(&buf, rb);
                let rows = ClusterRows::new(&layout, &stored, n).unwrap();
                // The same neurons as a layer's runs, after a neuron of another cluster.
                let (mut runs, _) = random_bundles(&layout, 1, &mut rng);
                runs.extend_from_slice(&buf);
                let runs = ClusterLayout::Split.arrange(&runs, rb);
                let start = [
                    rb[0],
                    (n + 1) * rb[0] + rb[1],
                    (n + 1) * (rb[0] + rb[1]) + rb[2],
                ];
                let in_runs = ClusterRows::in_runs(&layout, &runs, start, n).unwrap();
                // Gate and up runs in row groups: `pre` random neurons, these, then as many as
                // make whole groups.
                let pre = rng.random_range(0..GROUP_ROWS);
                let total = (pre + n).div_ceil(GROUP_ROWS) * GROUP_ROWS;
                let grouped = (groupable(qtype.gate) && groupable(qtype.up)).then(|| {
                    let (other, _) = random_bundles(&layout, total - n, &mut rng);
                    let mut all = other[..pre * bb].to_vec();
                    all.extend_from_slice(&buf);
                    all.extend_from_slice(&other[pre * bb..]);
                    let runs = ClusterLayout::Split.arrange(&all, rb);
                    [(0, qtype.gate, 0), (1, qtype.up, total * rb[0])].map(|(p, q, at)| {
                        let plain = &runs[at..at + total * rb[p]];
                        let mut g = vec![0u8; plain.len()];
                        group_rows(q, plain, rb[p], &mut g);
                        g
                    })
                });
                let xs = random(hidden, 1.0, &mut rng);
                let x = Operand::new(&xs, layout.operand_type());
                let skipped = rng.random_range(0..3usize);
                let candidate = |i: usize| skipped == 0 || i % 3 != skipped;
                for skip in three_rules() {
                    let Skip {
                        act,
                        rule,
                        threshold,
                    } = skip;
                    // One `dot` per row, neuron after neuron.
                    let want = |candidate: &dyn Fn(usize) -> bool| {
                        let mut scores = vec![-1.0f32; n];
                        let (mut active, mut coef) = (Vec::new(), Vec::new());
                        for (i, score) in scores.iter_mut().enumerate() {
                            if !candidate(i) {
                                continue;
                            }
                            let b = bundle(i);
                            let a = act.apply(k.dot(qtype.gate, &b[..rb[0]], &x));
                            let u = || a * k.dot(qtype.up, &b[rb[0]..rb[0] + rb[1]], &x);
                            let c = match rule {
                                SkipRule::Gate => {
                                    *score = a.abs();
                                    (*score > threshold).then(u)
                                }
                                SkipRule::GateUp => {
                                    let c = u();
                                    *score = c.abs();
                                    (*score > threshold).then_some(c)
                                }
                            };
                            if let Some(c) = c {
                                active.push(i as u32);
                                coef.push(c);
                            }
                        }
                        (bits(&scores), active, bits(&coef))
                    };
                    let what = format!(
                        "seed {seed}: {} {qtype} n={n} {cluster:?} {act:?} {rule:?}",
                        k.isa
                    );
                    let mut scores = vec![-1.0f32; n];
                    let (mut active, mut coef) = (vec![0u32; n], vec![0.0f32; n]);
                    let m = gate_pass(
                        &k,
                        &layout,
                        &x,
                        &rows,
                        None,
                        candidate,
                        skip,
                        &mut scores,
                        &mut active,
                        &mut coef,
                    );
                    let got = |m: usize, scores: &[f32], active: &[u32], coef: &[f32]| {
                        (bits(scores), active[..m].to_vec(), bits(&coef[..m]))
                    };
                    assert_eq!(got(m, &scores, &active, &coef), want(&candidate), "{what}");

                    scores.fill(-1.0);
                    let m = gate_pass_runs(
                        &k,
                        &layout,
                        &x,
                        &in_runs,
                        skip,
                        &mut scores,
                        &mut active,
                        &mut coef,
                    );
                    let all = want(&|_| true);
                    assert_eq!(got(m, &scores, &active, &coef), all, "{what}, in runs");

                    // The same neurons in runs laid out in row groups, from a neuron inside a
                    // group (`pre` neurons of other clusters before them).
                    if let Some(grouped) = &grouped {
                        scores.fill(-1.0);
                        let runs = GroupedRuns {
                            gate: &grouped[0],
                            up: &grouped[1],
                        };
                        let m = gate_pass_groups(
                            &k,
                            &layout,
                            &x,
                            runs,
                            pre,
                            &rows,
                            candidate,
                            skip,
                            &mut scores,
                            &mut active,
                            &mut coef,
                        );
                        let what = format!("{what}, in row groups after {pre}");
                        assert_eq!(got(m, &scores, &active, &coef), want(&candidate), "{what}");
                    }
                }
            }
        }
    }
}

/// Clusters are one row group at least where the width would leave fewer neurons and the gate
/// and up rows have a grouped layout; otherwise as many bundles as fill the target.
#[test]
fn clusters_hold_a_row_group_where_it_fits() {
    use super::grouped_cluster::cluster_neurons;
    use leanstream_format::ffn::PartTypes;
    use QuantType::*;
    let q = |t: QuantType| PartTypes::uniform(t);
    // The 7B width: 4,096 values a row.
    assert_eq!(cluster_neurons(32, 3 * 2304, 11008, q(Q4_0)), 8);
    assert_eq!(cluster_neurons(32, 3 * 2560, 11008, q(Q4_1)), 8);
    // No grouped layout for K-quant rows; q8 bundles are too big for a group in 64 KiB.
    assert_eq!(cluster_neurons(32, 3 * 2304, 11008, q(Q4_K)), 4);
    assert_eq!(cluster_neurons(32, 3 * 4352, 11008, q(Q8_0)), 2);
    // SmolLM2's q4_1 bundles fill 32 KiB with 30 neurons; a layer bounds the count.
    assert_eq!(cluster_neurons(32, 1080, 1536, q(Q4_1)), 30);
    assert_eq!(cluster_neurons(32, 3 * 2304, 6, q(Q4_0)), 6);
}

/// A cluster the cache keeps in row groups computes bitwise what the stored cluster does, for
/// every kernel set with group kernels, with and without rows after the last group, over more
/// than one pass of groups, and gives its stored bytes back.
#[test]
fn a_grouped_cluster_gates_as_stored_bit_for_bit() {
    use super::bundles::{gate_pass, ClusterRows};
    use super::grouped_cluster::{
        gate_pass_grouped_cluster, group_cluster, groupable_cluster, ungroup_cluster_into,
    };
    use leanstream_format::ffn::PartTypes;
    let (seed, mut rng) = rng();
    let mut layouts: Vec<BundleLayout> = [QuantType::Q8_0, QuantType::Q4_0, QuantType::Q4_1]
        .map(|q| BundleLayout::new(q, 96, ClusterLayout::Split).unwrap())
        .into();
    // A converted GGUF's parts: q4 gate and up rows, q8 down columns.
    let parts = PartTypes {
        gate: QuantType::Q4_1,
        up: QuantType::Q4_1,
        down: QuantType::Q8_0,
    };
    layouts.push(BundleLayout::with_parts(parts, 64, ClusterLayout::Split).unwrap());
    let bits = |v: &[f32]| v.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
    let (mut tested, mut active) = (0, 0);
    for k in RowKernels::available() {
        for &layout in &layouts {
            // Not grouped: an interleaved cluster, fewer than eight neurons.
            let interleaved = layout.with_cluster(ClusterLayout::Interleaved);
            assert!(!groupable_cluster(&k, &interleaved, 64));
            assert!(!groupable_cluster(&k, &layout, 7));
            for n in [8, 11, 37, 64, 77, 150] {
                if !groupable_cluster(&k, &layout, n) {
                    continue;
                }
                let (buf, _) = random_bundles(&layout, n, &mut rng);
                let stored = ClusterLayout::Split.arrange(&buf, layout.row_bytes());
                let mut grouped = stored.clone();
                group_cluster(&layout, &mut grouped, n, &mut Vec::new());
                assert_ne!(grouped, stored, "seed {seed}: grouping moves the codes");
                let mut back = Vec::new();
                ungroup_cluster_into(&layout, &grouped, n, &mut back);
                assert_eq!(back, stored, "seed {seed}: ungrouped");
                let plain = ClusterRows::new(&layout, &stored, n).unwrap();
                let rows = ClusterRows::new(&layout, &grouped, n).unwrap();
                let xs = random(layout.hidden, 1.0, &mut rng);
                let x = Operand::new(&xs, layout.operand_type());
                let skipped = rng.random_range(0..3usize);
                let candidate = |i: usize| skipped == 0 || i % 3 != skipped;
                for skip in three_rules() {
                    let what = format!("seed {seed}: {} {} n={n} {skip:?}", k.isa, layout.qtypes);
                    let run = |in_groups: bool| {
                        let mut scores = vec![-1.0f32; n];
                        let (mut active, mut coef) = (vec![0u32; n], vec![0.0f32; n]);
                        let (s, a, c) = (&mut scores[..], &mut active[..], &mut coef[..]);
                        let m = if in_groups {
                            gate_pass_grouped_cluster(
                                &k, &layout, &x, &grouped, &rows, candidate, skip, s, a, c,
                            )
                        } else {
                            gate_pass(&k, &layout, &x, &plain, None, candidate, skip, s, a, c)
                        };
                        (bits(&scores), active[..m].to_vec(), bits(&coef[..m]))
                    };
                    let want = run(false);
                    assert_eq!(run(true), want, "{what}");
                    tested += 1;
                    active += want.1.len();
                }
            }
        }
    }
    // Where a kernel set has group kernels (x86-64's), clusters were tested.
    let grouping = RowKernels::available()
        .iter()
        .any(|k| k.has_groups(QuantType::Q4_0));
    assert_eq!(tested > 0, grouping, "seed {seed}");
    // The cases compared active lists, not only scores (a case may have none active).
    assert_eq!(active > 0, grouping, "seed {seed}");
}

#[test]
fn matvec_and_matmul_match_f64() {
    let (seed, mut rng) = rng();
    let mut max_err = std::collections::BTreeMap::<(&str, &str, String), f64>::new();
    // Rows, columns, tokens: the first crosses the parallel threshold for every type (≥ 1 MiB);
    // the last is long enough for the decode-to-f32 + gemm path.
    // The K-quants' rows are whole 256-value blocks: they take the first and the last two shapes.
    for (rows, cols, t) in [
        (8192, 256, 2),
        (5, 64, 3),
        (300, 288, GEMM_MIN_TOKENS + 3),
        (7, 512, GEMM_MIN_TOKENS + 1),
    ] {
        let m = Matrix::new(rows, cols, random(rows * cols, 1.0, &mut rng));
        for qtype in QuantType::ALL {
            if !cols.is_multiple_of(qtype.block_len()) {
                continue;
            }
            let q = QMatrix::quantize(&m, qtype).unwrap();
            let w: Vec<Vec<f64>> = (0..rows)
                .map(|r| {
                    let mut row = vec![0.0f32; cols];
                    dequantize_row(qtype, q.row(r), &mut row).unwrap();
                    row.iter().map(|v| *v as f64).collect()
                })
                .collect();
            let xs = random(t * cols, 1.0, &mut rng);
            let mut out = vec![0.0; t * rows];
            q.matmul_t(&xs, t, &mut out);
            for i in 0..t {
                let xi = &xs[i * cols..(i + 1) * cols];
                let op = Operand::new(xi, qtype);
                // Block types multiply the q8 input (decode's mat-vec, every input); float types
                // decode the weights to f32 for two or more inputs and multiply the input as it
                // is, a single input left over runs a mat-vec.
                let seen_x = if qtype.is_block() || (t % GEMM_MIN_TOKENS == 1 && i == t - 1) {
                    seen(&op, qtype)
                } else {
                    xi.iter().map(|v| *v as f64).collect()
                };
                let best = RowKernels::best().isa;
                for r in 0..rows {
                    let want = dot64(&w[r], &seen_x);
                    let tol = REL * abs_dot64(&w[r], &seen_x);
                    let e = max_err
                        .entry(("matmul", best, qtype.to_string()))
                        .or_default();
                    *e = e.max((out[i * rows + r] as f64 - want).abs() / abs_dot64(&w[r], &seen_x));
                    assert!(
                        (out[i * rows + r] as f64 - want).abs() <= tol,
                        "seed {seed}: {qtype} {rows}×{cols} t={t} matmul {i},{r}"
                    );
                }
                if i > 0 {
                    continue;
                }
                let xq = seen(&op, qtype);
                for k in RowKernels::available() {
                    let mut one = vec![0.0; rows];
                    q.matvec_with(&k, &op, &mut one);
                    for r in 0..rows {
                        let want = dot64(&w[r], &xq);
                        let tol = REL * abs_dot64(&w[r], &xq);
                        let e = max_err
                            .entry(("matvec", k.isa, qtype.to_string()))
                            .or_default();
                        *e = e.max((one[r] as f64 - want).abs() / abs_dot64(&w[r], &xq));
                        assert!(
                            (one[r] as f64 - want).abs() <= tol,
                            "seed {seed}: {} {qtype} {rows}×{cols} matvec row {r}",
                            k.isa
                        );
                    }
                }
            }
        }
    }
    for ((kernel, isa, qtype), e) in max_err {
        report(kernel, isa, qtype, e);
    }
}

#[test]
fn weight_quantize_keeps_f32_and_round_trips() {
    let (seed, mut rng) = rng();
    let m = Matrix::new(4, 64, random(256, 1.0, &mut rng));
    let w = Weight::F32(m.clone());
    assert!(matches!(
        w.quantize(QuantType::F32).unwrap(),
        Weight::F32(_)
    ));
    let q = w.quantize(QuantType::Q8_0).unwrap();
    assert_eq!((q.rows(), q.cols(), q.qtype()), (4, 64, QuantType::Q8_0));
    assert_eq!(q.bytes(), 4 * 2 * 34);
    let mut row = vec![0.0; 64];
    q.row_f32(2, &mut row);
    for (a, b) in row.iter().zip(m.row(2)) {
        assert!((a - b).abs() <= 1.0 / 127.0, "seed {seed}");
    }
}

/// Bundles `[gate | up | down]` for `n` neurons and their decoded parts in f64.
fn random_bundles(
    layout: &BundleLayout,
    n: usize,
    rng: &mut StdRng,
) -> (Vec<u8>, Vec<[Vec<f64>; 3]>) {
    let mut buf = Vec::with_capacity(n * layout.bundle_bytes());
    let mut parts = Vec::with_capacity(n);
    for _ in 0..n {
        let mut decoded: [Vec<f64>; 3] = Default::default();
        let q = layout.qtypes;
        for (d, qtype) in decoded.iter_mut().zip([q.gate, q.up, q.down]) {
            let (bytes, w) = encoded_row(qtype, layout.hidden, rng);
            buf.extend(bytes);
            *d = w;
        }
        parts.push(decoded);
    }
    (buf, parts)
}

#[test]
fn bundle_ffn_matches_f64() {
    let (seed, mut rng) = rng();
    for qtype in QuantType::ALL {
        let hidden = if qtype.is_k_quant() {
            512
        } else if qtype.is_block() {
            288
        } else {
            100
        };
        // 1200 neurons of 288 (and 700 of 512) cross the parallel threshold.
        let n = if qtype.is_k_quant() {
            700
        } else if qtype.is_block() {
            1200
        } else {
            90
        };
        let layout = BundleLayout::new(qtype, hidden, ClusterLayout::Split).unwrap();
        let (buf, parts) = random_bundles(&layout, n, &mut rng);
        // Every other bundle, read in place from the one buffer.
        let chosen: Vec<usize> = (0..n).step_by(2).collect();
        let bundles: Vec<&[u8]> = chosen
            .iter()
            .map(|&i| &buf[i * layout.bundle_bytes()..(i + 1) * layout.bundle_bytes()])
            .collect();
        let xs = random(hidden, 1.0, &mut rng);
        let x = Operand::new(&xs, qtype);
        let xq = seen(&x, qtype);
        for (act, rule, threshold) in [
            (Activation::Relu, SkipRule::Gate, 0.0),
            (Activation::Silu, SkipRule::Gate, 0.5),
            (Activation::Silu, SkipRule::Gate, 0.0),
            (Activation::Silu, SkipRule::GateUp, 0.5),
        ] {
            let skip = Skip {
                act,
                rule,
                threshold,
            };
            let out0 = random(hidden, 1.0, &mut rng);
            let mut out = out0.clone();
            let mut scores = vec![0.0; bundles.len()];
            let computed = ffn_bundles(&layout, &x, &bundles, skip, &mut out, &mut scores).unwrap();
            let mut want: Vec<f64> = out0.iter().map(|v| *v as f64).collect();
            let mut scale = vec![0.0f64; hidden];
            let mut active = 0;
            for (&i, &s) in chosen.iter().zip(&scores) {
                let [gate, up, down] = &parts[i];
                let g64 = dot64(gate, &xq);
                let u64_ = dot64(up, &xq);
                let a64 = act.apply(g64 as f32) as f64;
                let want_s = match rule {
                    SkipRule::Gate => a64.abs(),
                    SkipRule::GateUp => (a64 * u64_).abs(),
                };
                let tol = 3.0 * REL * abs_dot64(gate, &xq) * (1.0 + abs_dot64(up, &xq));
                assert!(
                    (s as f64 - want_s).abs() <= tol,
                    "seed {seed}: {qtype} {rule:?} score of neuron {i}: {s} vs {want_s}"
                );
                // The skip decision follows the kernel's own score.
                if s > threshold {
                    active += 1;
                    for j in 0..hidden {
                        want[j] += a64 * u64_ * down[j];
                        scale[j] += (a64.abs() + 1.0) * (abs_dot64(up, &xq) * down[j]).abs();
                    }
                }
            }
            assert_eq!(computed, active, "seed {seed}: {qtype} {act:?} {rule:?}");
            let all = act == Activation::Silu && threshold == 0.0;
            assert!(active > 0, "seed {seed}: {qtype}");
            assert_eq!(all, active == bundles.len(), "seed {seed}: {qtype}");
            let mut max_err = 0.0f64;
            for j in 0..hidden {
                let tol = REL * (scale[j] + out0[j].abs() as f64) + 1e-6;
                max_err = max_err
                    .max((out[j] as f64 - want[j]).abs() / (scale[j] + out0[j].abs() as f64));
                assert!(
                    (out[j] as f64 - want[j]).abs() <= tol,
                    "seed {seed}: {qtype} {act:?} {rule:?} output {j}: {} vs {}",
                    out[j],
                    want[j]
                );
            }
            report(
                &format!("bundle-ffn-{act:?}-{threshold}"),
                RowKernels::best().isa,
                qtype,
                max_err,
            );
        }
    }
}

#[test]
fn relu_skipping_is_exact() {
    // With ReLU and threshold 0 the sparse FFN equals the dense one over all neurons.
    let (seed, mut rng) = rng();
    let layout = BundleLayout::new(QuantType::Q4_0, 64, ClusterLayout::Split).unwrap();
    let (buf, _) = random_bundles(&layout, 40, &mut rng);
    let bundles: Vec<&[u8]> = buf.chunks_exact(layout.bundle_bytes()).collect();
    let xs = random(64, 1.0, &mut rng);
    let x = Operand::new(&xs, layout.operand_type());
    let mut sparse = vec![0.0; 64];
    let mut scores = vec![0.0; 40];
    let relu = Skip {
        act: Activation::Relu,
        rule: SkipRule::Gate,
        threshold: 0.0,
    };
    let computed = ffn_bundles(&layout, &x, &bundles, relu, &mut sparse, &mut scores).unwrap();
    let mut dense = vec![0.0; 64];
    let k = RowKernels::best();
    for b in &bundles {
        let rb = layout.row_bytes()[0];
        let q = layout.qtypes.gate;
        let a = Activation::Relu.apply(k.dot(q, &b[..rb], &x));
        let u = k.dot(q, &b[rb..2 * rb], &x);
        k.axpy(q, a * u, &b[2 * rb..], &mut dense);
    }
    assert!(computed < 40, "seed {seed}");
    assert_eq!(sparse, dense, "seed {seed}");
}

#[test]
fn bundle_errors_name_the_problem() {
    let layout = BundleLayout::new(QuantType::Q8_0, 64, ClusterLayout::Split).unwrap();
    assert!(BundleLayout::new(QuantType::Q8_0, 65, ClusterLayout::Split).is_err());
    let xs = vec![0.0; 64];
    let x = Operand::new(&xs, QuantType::Q8_0);
    let short = vec![0u8; layout.bundle_bytes() - 1];
    let mut out = vec![0.0; 64];
    let relu = Skip {
        act: Activation::Relu,
        rule: SkipRule::Gate,
        threshold: 0.0,
    };
    let err = ffn_bundles(&layout, &x, &[&short], relu, &mut out, &mut [0.0]).unwrap_err();
    assert!(err.to_string().contains("bundle 0"), "{err}");
    let err = ffn_cluster(&layout, &x, &short, relu, &mut out, &mut [0.0]).unwrap_err();
    assert!(
        err.to_string().contains("needs 204 bytes, it has 203"),
        "{err}"
    );
}

/// Bundles whose parts have encodings of their own (format 1.8), as a converted GGUF keeps them:
/// K-quant gate and up rows with q8_0 or q6_k down columns, two gate/up encodings side by side,
/// float gates beside block up rows.
fn mixed_layouts() -> Vec<BundleLayout> {
    use leanstream_format::ffn::PartTypes;
    use QuantType::*;
    [
        (Q4_K, Q4_K, Q8_0),
        (Q5_K, Q5_K, Q6_K),
        (Q6_K, Q6_K, Q8_0),
        (Q5_0, Q4_K, Q8_0),
        (Q4_1, Q5_1, Q6_K),
        (F16, Q4_K, Q8_0),
    ]
    .map(|(gate, up, down)| {
        let parts = PartTypes { gate, up, down };
        BundleLayout::with_parts(parts, 256, ClusterLayout::Split).unwrap()
    })
    .into()
}

/// Mixed-encoding bundles give bitwise each part's own row kernel: `dot` of the gate and up rows
/// in their encodings, `axpy` of the down column in its own, neuron after neuron.
#[test]
fn mixed_encodings_are_each_parts_own_kernel() {
    let (seed, mut rng) = rng();
    // `ffn_bundles` runs the fastest kernels; `gate_pass_is_one_dot_per_row_bit_for_bit` covers
    // every set.
    let k = RowKernels::best();
    {
        for layout in mixed_layouts() {
            let (q, h, n) = (layout.qtypes, layout.hidden, 70);
            let (buf, _) = random_bundles(&layout, n, &mut rng);
            let bundles: Vec<&[u8]> = buf.chunks_exact(layout.bundle_bytes()).collect();
            let xs = random(h, 1.0, &mut rng);
            let x = Operand::new(&xs, layout.operand_type());
            let silu = Skip {
                act: Activation::Silu,
                rule: SkipRule::GateUp,
                threshold: 0.05,
            };
            let (mut out, mut scores) = (vec![0.0f32; h], vec![0.0f32; n]);
            let computed = ffn_bundles(&layout, &x, &bundles, silu, &mut out, &mut scores);
            let [g, u, _] = layout.row_bytes();
            let mut want = vec![0.0f32; h];
            let mut active = 0;
            for b in &bundles {
                let a = Activation::Silu.apply(k.dot(q.gate, &b[..g], &x));
                let c = a * k.dot(q.up, &b[g..g + u], &x);
                if c.abs() > silu.threshold {
                    k.axpy(q.down, c, &b[g + u..], &mut want);
                    active += 1;
                }
            }
            let what = format!("seed {seed}: {} {q}", k.isa);
            assert_eq!(computed.unwrap(), active, "{what}");
            assert!(active > 0 && active < n, "{what}: {active} active");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&want), "{what}");
        }
    }
}

/// SiLU under `gate` (0.2), ReLU exact (0), SiLU under `gate_up` (0.1).
fn three_rules() -> [Skip; 3] {
    [
        (Activation::Silu, SkipRule::Gate, 0.2),
        (Activation::Relu, SkipRule::Gate, 0.0),
        (Activation::Silu, SkipRule::GateUp, 0.1),
    ]
    .map(|(act, rule, threshold)| Skip {
        act,
        rule,
        threshold,
    })
}

/// A cluster stored split (format 1.6) or interleaved (1.5) gives bitwise what its bundles give
/// one by one, under every rule, with clusters longer than a gate batch.
#[test]
fn cluster_layouts_give_the_bits_of_the_bundles() {
    let (seed, mut rng) = rng();
    let mut layouts: Vec<BundleLayout> = [QuantType::Q8_0, QuantType::Q4_1, QuantType::F16]
        .map(|q| BundleLayout::new(q, 64, ClusterLayout::Split).unwrap())
        .into();
    layouts.extend(mixed_layouts());
    for layout in layouts {
        let (qtype, hidden) = (layout.qtypes, layout.hidden);
        for n in [1, 7, 130] {
            let (buf, _) = random_bundles(&layout, n, &mut rng);
            let bundles: Vec<&[u8]> = buf.chunks_exact(layout.bundle_bytes()).collect();
            let xs = random(hidden, 1.0, &mut rng);
            let x = Operand::new(&xs, layout.operand_type());
            for skip in three_rules() {
                let (act, rule) = (skip.act, skip.rule);
                let (mut want, mut want_scores) = (vec![0.0f32; hidden], vec![0.0f32; n]);
                let m = ffn_bundles(&layout, &x, &bundles, skip, &mut want, &mut want_scores);
                for cluster in [ClusterLayout::Split, ClusterLayout::Interleaved] {
                    let layout = layout.with_cluster(cluster);
                    // Padding after the rows, as an extent has.
                    let mut stored = cluster.arrange(&buf, layout.row_bytes());
                    stored.resize(stored.len() + 100, 0xAB);
                    let (mut out, mut scores) = (vec![0.0f32; hidden], vec![0.0f32; n]);
                    let got = ffn_cluster(&layout, &x, &stored, skip, &mut out, &mut scores);
                    let what = format!("seed {seed}: {qtype} n={n} {cluster:?} {act:?} {rule:?}");
                    assert_eq!(got.unwrap(), *m.as_ref().unwrap(), "{what}");
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&out), bits(&want), "{what}");
                    assert_eq!(bits(&scores), bits(&want_scores), "{what}");
                }
            }
        }
    }
}

/// A matrix streamed in row blocks (its tiles for `gemm` cut across blocks) gives exactly the
/// whole matrix's result, for mat-vecs and for the mat-mat of a prompt chunk.
#[test]
fn row_stream_in_blocks_equals_matmul_bit_for_bit() {
    let (seed, mut rng) = rng();
    let (rows, cols) = (2500, 256);
    let m = Matrix::new(rows, cols, random(rows * cols, 1.0, &mut rng));
    for qtype in [QuantType::Q8_0, QuantType::F16, QuantType::Q4_1] {
        let q = QMatrix::quantize(&m, qtype).unwrap();
        let rb = q.row(0).len();
        for t in [1, 5, GEMM_MIN_TOKENS + 4, 3 * GEMM_MIN_TOKENS] {
            let xs = random(t * cols, 1.0, &mut rng);
            let mut want = vec![0.0; t * rows];
            q.matmul_t(&xs, t, &mut want);
            let mut got = vec![f32::NAN; t * rows];
            let mut stream = RowStream::new(qtype, rows, cols, rb, &xs, t);
            let mut r0 = 0;
            for block in [700, 1, 900, 899] {
                stream.push(&q.encoded()[r0 * rb..(r0 + block) * rb], &mut got);
                r0 += block;
            }
            assert_eq!(r0, rows);
            assert!(
                want.iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "seed {seed}: {qtype} t={t}"
            );
        }
    }
}

/// A matrix in row groups ([`QMatrix::in_groups`]) computes what its plain rows do, bit for bit,
/// with every kernel set: mat-vecs (rows not a multiple of eight, so a plain tail), prompt chunks
/// (taken out of the groups a slice at a time), row decoding and its stored bytes.
#[test]
fn a_grouped_matrix_equals_its_plain_rows_bit_for_bit() {
    let (seed, mut rng) = rng();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (rows, cols) in [(8, 64), (301, 96), (610, 256)] {
        let m = Matrix::new(rows, cols, random(rows * cols, 1.0, &mut rng));
        for qtype in [QuantType::Q4_0, QuantType::Q4_1, QuantType::Q8_0] {
            let plain = QMatrix::quantize(&m, qtype).unwrap();
            for k in RowKernels::available() {
                let grouped = plain.clone().in_groups_for(&k);
                assert_eq!(grouped.is_grouped(), k.has_groups(qtype), "{}", k.isa);
                assert_eq!(grouped.encoded(), plain.encoded(), "{} {qtype}", k.isa);
                let mut row = vec![0.0f32; cols];
                let mut want_row = vec![0.0f32; cols];
                for r in [0, 7, rows / 2, rows - 1] {
                    grouped.dequantize_row(r, &mut row);
                    plain.dequantize_row(r, &mut want_row);
                    assert_eq!(bits(&row), bits(&want_row), "{} {qtype} row {r}", k.isa);
                }
                let xs = random(cols, 1.0, &mut rng);
                let x = Operand::new(&xs, qtype);
                let (mut want, mut got) = (vec![0.0; rows], vec![f32::NAN; rows]);
                plain.matvec_with(&k, &x, &mut want);
                grouped.matvec_with(&k, &x, &mut got);
                let what = format!("seed {seed}: {} {qtype} {rows}×{cols}", k.isa);
                assert_eq!(bits(&got), bits(&want), "{what} mat-vec");
                for t in [1, 3, GEMM_MIN_TOKENS + 1] {
                    let xs = random(t * cols, 1.0, &mut rng);
                    let (mut want, mut got) = (vec![0.0; t * rows], vec![f32::NAN; t * rows]);
                    plain.matmul_t(&xs, t, &mut want);
                    grouped.matmul_t(&xs, t, &mut got);
                    assert_eq!(bits(&got), bits(&want), "{what} t={t}");
                }
            }
        }
    }
}

/// A token's result depends on its place in the input, not on the input's length: a 45-token
/// prompt in chunks of 16 (two gemm blocks, then one 13-input gemm) gives the bits of one call,
/// so a budget that shortens prompt chunks to a multiple of the block keeps prefill exact.
#[test]
fn a_prompt_in_chunks_of_whole_gemm_blocks_equals_one_chunk_bit_for_bit() {
    let (seed, mut rng) = rng();
    let (rows, cols, t) = (300, 288, 2 * GEMM_MIN_TOKENS + 13);
    let m = Matrix::new(rows, cols, random(rows * cols, 1.0, &mut rng));
    for qtype in [QuantType::Q8_0, QuantType::Q4_1, QuantType::F32] {
        let q = QMatrix::quantize(&m, qtype).unwrap();
        let xs = random(t * cols, 1.0, &mut rng);
        let mut whole = vec![0.0; t * rows];
        q.matmul_t(&xs, t, &mut whole);
        for chunk in [GEMM_MIN_TOKENS, 2 * GEMM_MIN_TOKENS] {
            let mut parts = Vec::with_capacity(t * rows);
            for x in xs.chunks(chunk * cols) {
                let mut out = vec![0.0; x.len() / cols * rows];
                q.matmul_t(x, x.len() / cols, &mut out);
                parts.extend(out);
            }
            assert!(
                whole
                    .iter()
                    .zip(&parts)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "seed {seed}: {qtype} in chunks of {chunk}"
            );
        }
    }
}

#[test]
fn forcing_a_kernel_set_picks_it_or_names_the_choices() {
    let sets = RowKernels::available();
    for k in &sets {
        assert_eq!(pick(Some(k.isa), &sets).unwrap().isa, k.isa);
    }
    assert_eq!(pick(None, &sets).unwrap().isa, sets[0].isa);
    assert_eq!(pick(Some(""), &sets).unwrap().isa, sets[0].isa);
    let Err(err) = pick(Some("sve9"), &sets) else {
        panic!("an unknown kernel set was accepted");
    };
    assert!(
        err.contains("LEANSTREAM_KERNELS=sve9") && err.contains("portable"),
        "{err}"
    );
}

/// The kernels every mat-vec, mat-mat and bundle FFN use are the forced ones when
/// `LEANSTREAM_KERNELS` is set (the aarch64 script runs this file once per NEON path), else the
/// fastest.
#[test]
fn best_follows_the_environment() {
    let want = match std::env::var(FORCE_ENV) {
        Ok(name) if !name.is_empty() => name,
        _ => RowKernels::available()[0].isa.to_string(),
    };
    assert_eq!(RowKernels::best().isa, want);
}

#[test]
fn an_operand_in_a_reused_q8_buffer_equals_a_fresh_quantization() {
    let (seed, mut rng) = rng();
    let long = random(9 * BLOCK_LEN, 4.0, &mut rng);
    let short = random(3 * BLOCK_LEN, 1.0, &mut rng);
    let fresh = Q8Vec::quantize(&short);
    let same = |v: &Q8Vec| {
        assert_eq!(v.quants, fresh.quants, "seed {seed}");
        assert_eq!(v.scales, fresh.scales, "seed {seed}");
        assert_eq!(v.sums, fresh.sums, "seed {seed}");
    };
    let mut v = Q8Vec::quantize(&long);
    v.quantize_into(&short);
    same(&v);
    // The thread's spare buffers: a longer operand dropped, then a shorter one made in its buffer.
    drop(Operand::new(&long, QuantType::Q4_0));
    same(Operand::new(&short, QuantType::Q8_0).q8());
}

/// The 5-bit types and the K-quants give the portable kernels' bits in every kernel set (their
/// integer sums are exact and their float terms run in the portable order), for every length,
/// random and zero inputs, `dot`, `dots` and `axpy`.
#[test]
fn new_block_types_are_portable_bit_for_bit() {
    let (seed, mut rng) = rng();
    let portable = *RowKernels::available().last().unwrap();
    assert_eq!(portable.isa, "portable");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for k in RowKernels::available() {
        for qtype in QuantType::ALL.into_iter().filter(|t| t.since_minor() > 1) {
            for n in lengths(qtype) {
                for zeros in [false, true] {
                    let rows: Vec<Vec<u8>> =
                        (0..5).map(|_| encoded_row(qtype, n, &mut rng).0).collect();
                    let views: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
                    let mut xs = random(n, 2.0, &mut rng);
                    if zeros {
                        xs.fill(0.0);
                    }
                    let x = Operand::new(&xs, qtype);
                    let mut got = vec![f32::NAN; 5];
                    let mut want = vec![f32::NAN; 5];
                    k.dots(qtype, &views, &x, &mut got);
                    portable.dots(qtype, &views, &x, &mut want);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "seed {seed}: {} {qtype} n={n} zeros={zeros}",
                        k.isa
                    );
                    assert_eq!(
                        k.dot(qtype, views[0], &x).to_bits(),
                        want[0].to_bits(),
                        "seed {seed}: {} {qtype} n={n} zeros={zeros}",
                        k.isa
                    );
                    let a = rng.random_range(-2.0f32..2.0);
                    let (mut got, mut want) = (xs.clone(), xs.clone());
                    k.axpy(qtype, a, views[1], &mut got);
                    portable.axpy(qtype, a, views[1], &mut want);
                    assert_eq!(bits(&got), bits(&want), "seed {seed}: {} {qtype}", k.isa);
                }
            }
        }
    }
}
