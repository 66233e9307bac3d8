//! Convert → run under a memory budget, end to end: certified streaming computes exactly what the
//! resident model computes, at every budget, and the process stays within its budget.

use std::path::Path;
use std::process::{Command, Output};

use leanstream::model::kv_cache::KvCache;
use leanstream::model::LanguageModel;
use leanstream::text::perplexity::perplexity;
use leanstream::text::session::{PolicyChoice, Session, SessionOptions};
use leanstream_format::quant::QuantType;
use leanstream_tests::converted::{bin, convert, embedded, heldout_ids, scratch, ufs4};
use leanstream_tests::tiny::{write_tiny_model, TinySpec};

fn session(file: &Path, policy: PolicyChoice, memory: Option<u64>) -> Session {
    Session::open(
        &SessionOptions::new(file, Some(policy))
            .memory(memory)
            .flash(memory.and(ufs4()))
            .ctx(128),
    )
    .unwrap()
}

fn text_ids(s: &Session, n: usize) -> Vec<u32> {
    heldout_ids(&s.tokenizer, n)
}

/// Budgets from the minimum (everything streams) to everything resident.
fn budgets(file: &Path) -> Vec<u64> {
    let f = leanstream_format::LsbFile::open(file).unwrap();
    let min = leanstream::streaming::minimum_memory(file, 128).unwrap();
    let ffn = f.ffn.bundle_bytes();
    vec![
        min,
        min + ffn / 10,
        min + ffn / 4,
        min + ffn / 2,
        min + 2 * ffn,
    ]
}

fn ppl(file: &Path, policy: PolicyChoice, memory: Option<u64>, ids: &[u32]) -> f64 {
    let mut s = session(file, policy, memory);
    perplexity(s.model(), ids, 64, false).unwrap().perplexity
}

#[test]
fn certified_streaming_equals_resident_at_every_budget() {
    let file = embedded("q8");
    let ids = text_ids(&session(&file, PolicyChoice::Resident, None), 300);
    let resident = ppl(&file, PolicyChoice::Resident, None, &ids);
    for b in budgets(&file) {
        let streamed = ppl(&file, PolicyChoice::Leanstream, Some(b), &ids);
        eprintln!("budget {b}: certified {streamed:.6}, resident {resident:.6}");
        assert!(
            (streamed / resident - 1.0).abs() < 1e-5,
            "budget {b}: {streamed} vs {resident}"
        );
    }
}

/// The logits of `ids` decoded one token at a time after `cache`.
fn decode_steps(
    model: &mut (dyn LanguageModel + Send),
    ids: &[u32],
    cache: &mut KvCache,
) -> Vec<f32> {
    ids.iter()
        .flat_map(|&t| model.forward(&[t], cache, true).unwrap())
        .collect()
}

/// The resident policy holds each layer whole, its bundles as three runs (gate rows, up rows,
/// down columns) computed a reduction group at a time; certified streaming at the minimum budget
/// computes cluster after cluster as reads land. Decoding is bitwise the same, on one thread and
/// on three, and across a budget that shrinks under a cache that held every layer in runs.
#[test]
fn layers_in_runs_decode_as_streamed_clusters_do() {
    let file = embedded("q8");
    let ids = text_ids(&session(&file, PolicyChoice::Resident, None), 32);
    runs_decode_as_streamed_clusters(&file, &ids);
}

/// The same with `Q4_0` and `Q4_1` gate and up rows, whose runs lie in row groups of eight
/// neurons where the kernels have them (x86-64), under both skip rules: `gate` (the active
/// neurons' up rows, a group at a time) and `gate_up` (every up row); so do the clusters a
/// smaller cache keeps in row groups.
#[test]
fn layers_in_row_groups_decode_as_streamed_clusters_do() {
    let spec = TinySpec {
        hidden: 128,
        intermediate: 1024,
        heads: 8,
        kv_heads: 4,
        ..TinySpec::llama()
    };
    for (name, quant, sparsity) in [
        ("tiny-runs-q4_0-gate", "q4_0", "threshold:0.5"),
        ("tiny-runs-q4_1-gate-up", "q4_1", "target:0.5"),
    ] {
        let dir = scratch().join(name);
        write_tiny_model(&dir, &spec).unwrap();
        let file = scratch().join(format!("{name}.lsb"));
        convert(&dir, &file, &["--quant", quant, "--sparsity", sparsity]);
        let ids: Vec<u32> = (0..24u32)
            .map(|i| (i * 7919 + 3) % spec.vocab as u32)
            .collect();
        runs_decode_as_streamed_clusters(&file, &ids);
    }
}

fn runs_decode_as_streamed_clusters(file: &Path, ids: &[u32]) {
    let half = ids.len() / 2;
    let decode = |s: &mut Session| -> Vec<f32> {
        let mut cache = s.model().new_cache(128);
        decode_steps(s.model(), ids, &mut cache)
    };
    let min = leanstream::streaming::minimum_memory(file, 128).unwrap();
    let streamed = decode(&mut session(file, PolicyChoice::Leanstream, Some(min)));
    // The default policy whose cache holds the whole file keeps its layers in runs too; a smaller
    // budget then takes clusters out of them: those layers give their runs up, their clusters
    // still cached read again (checked) into entries of their own.
    let mut shrunk = session(file, PolicyChoice::Leanstream, None);
    let mut cache = shrunk.model().new_cache(128);
    let mut logits = decode_steps(shrunk.model(), &ids[..half], &mut cache);
    let split = leanstream::streaming::memory_split(file, 128).unwrap();
    shrunk.set_memory_budget(min + split.ffn_total / 2).unwrap();
    logits.extend(decode_steps(shrunk.model(), &ids[half..], &mut cache));
    let name = file.display();
    assert!(
        logits == streamed,
        "{name}: decoding across the smaller budget differs"
    );
    let report = shrunk.report();
    assert!(
        report["bytes_read_per_token"].as_f64().unwrap() > 0.0,
        "{name}: the evicted clusters are read: {report}"
    );
    // A cache holding half the bundles lays the clusters it keeps out in row groups where the
    // kernels have them (x86-64): computed from there, the same bits as read from the file.
    let mut half = session(
        file,
        PolicyChoice::Leanstream,
        Some(min + split.ffn_total / 2),
    );
    assert!(
        decode(&mut half) == streamed,
        "{name}: clusters kept in row groups differ from clusters as read"
    );
    let report = half.report();
    let grouping = leanstream::kernels::RowKernels::best().has_groups(QuantType::Q4_0);
    let fraction = report["grouped_hit_fraction"].as_f64().unwrap();
    assert_eq!(
        fraction > 0.0,
        grouping,
        "{name}: the kept clusters' gates ran in row groups: {report}"
    );
    // A cache that leaves out a little of the file holds the layers it can whole, as runs, and
    // keeps or reads the rest cluster by cluster: the same bits. (The first of these budgets at
    // which some layers but not all are whole: how much the minimum already caches depends on
    // the file.)
    let layers = leanstream_format::LsbFile::open(file)
        .unwrap()
        .ffn
        .layers
        .len();
    let partly = [2, 3, 4, 5, 6, 7].into_iter().find_map(|eighths| {
        let mut s = session(
            file,
            PolicyChoice::Leanstream,
            Some(min + split.ffn_total * eighths / 8),
        );
        let got = decode(&mut s);
        let report = s.report();
        let whole = report["whole_layers"].as_u64().unwrap() as usize;
        let read = report["bytes_read_per_token"].as_f64().unwrap();
        ((1..layers).contains(&whole) && read > 0.0).then_some((got, eighths))
    });
    let (got, eighths) =
        partly.unwrap_or_else(|| panic!("{name}: no budget held some of {layers} layers whole"));
    assert!(
        got == streamed,
        "{name}: layers held whole beside streamed ones differ ({eighths}/8 of the bundles)"
    );
    for threads in [1, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let resident = pool.install(|| decode(&mut session(file, PolicyChoice::Resident, None)));
        assert!(
            resident == streamed,
            "{name}, {threads} threads: the resident layers in runs differ from streamed clusters"
        );
    }
}

/// Logits of `ids` fed as one prompt chunk, or one token at a time; and the bytes read.
fn prefill(file: &Path, memory: Option<u64>, ids: &[u32], chunked: bool) -> (Vec<f32>, u64) {
    let mut s = session(file, PolicyChoice::Leanstream, memory);
    let read_before = s.io().map_or(0, |io| io.stats().bytes_read);
    let model = s.model();
    let mut cache = model.new_cache(128);
    let logits = if chunked {
        model.forward(ids, &mut cache, true).unwrap()
    } else {
        decode_steps(model, ids, &mut cache)
    };
    (logits, s.io().unwrap().stats().bytes_read - read_before)
}

#[test]
fn a_prompt_chunk_reads_each_cluster_once_and_computes_what_decoding_does() {
    let file = embedded("q8");
    let ids = text_ids(&session(&file, PolicyChoice::Resident, None), 48);
    let min = leanstream::streaming::minimum_memory(&file, 128).unwrap();
    let (chunk, chunk_bytes) = prefill(&file, Some(min), &ids, true);
    let (steps, step_bytes) = prefill(&file, Some(min), &ids, false);
    let (resident, _) = prefill(&file, None, &ids, true);
    let vocab = chunk.len() / ids.len();
    let argmax = |row: &[f32]| leanstream::text::sampler::argmax(row);
    let mut agree = 0;
    for (i, ((c, d), r)) in chunk
        .chunks(vocab)
        .zip(steps.chunks(vocab))
        .zip(resident.chunks(vocab))
        .enumerate()
    {
        // The chunk's FFN rows are bitwise the resident policy's.
        assert_eq!(
            c, r,
            "position {i}: chunked streaming differs from resident"
        );
        agree += (argmax(c) == argmax(d)) as usize;
    }
    // Attention and the head over a chunk round differently from one row at a time (up to 0.1
    // apart in these logits, for the resident policy alike), so only the choices are compared.
    assert!(
        agree * 10 >= ids.len() * 9,
        "{agree} of {} agree",
        ids.len()
    );
    // Nothing is cached at the minimum: decoding reads most clusters for every token, the chunk
    // reads each needed cluster once.
    let ffn = leanstream_format::LsbFile::open(&file)
        .unwrap()
        .ffn
        .bundle_bytes();
    eprintln!("chunk {chunk_bytes} B, token by token {step_bytes} B, FFN {ffn} B");
    assert!(chunk_bytes <= ffn, "{chunk_bytes} > {ffn}");
    assert!(
        step_bytes > 10 * chunk_bytes,
        "{step_bytes} vs {chunk_bytes}"
    );
}

#[test]
fn certified_streaming_of_an_f32_file_equals_dense() {
    let file = embedded("f32");
    let ids = text_ids(&session(&file, PolicyChoice::Dense, None), 300);
    let dense = ppl(&file, PolicyChoice::Dense, None, &ids);
    for b in budgets(&file).into_iter().step_by(2) {
        let streamed = ppl(&file, PolicyChoice::Leanstream, Some(b), &ids);
        eprintln!("budget {b}: certified {streamed:.6}, dense {dense:.6}");
        assert!(
            (streamed / dense - 1.0).abs() < 1e-5,
            "budget {b}: {streamed} vs {dense}"
        );
    }
}

/// A SiLU model under the `gate` rule (`threshold:F`, skip when |silu(g)| <= t), with and without
/// its certificate (q8 bundles: the Q8_0 sketch is the exact gates): exact output equals `resident`
/// bit for bit at three budgets either way, the planner keeps the certificate at the minimum where
/// it saves reads, and the same certificate with its rows negated (bounds kept) is caught. Hidden
/// 512 makes a bundle 1632 bytes, so a 5 KiB cluster holds 3 neurons and at 80 % sparsity about
/// half of the clusters hold none the rule keeps (8 KiB would make clusters of 8, a row group,
/// of which few hold none).
#[test]
fn certified_threshold_model_equals_resident_with_and_without_its_certificate() {
    let dir = leanstream_tests::fresh_dir(&scratch(), "tiny-silu");
    let spec = TinySpec {
        hidden: 512,
        intermediate: 640,
        head_dim: 128,
        ..TinySpec::llama()
    };
    write_tiny_model(&dir, &spec).unwrap();
    let with = scratch().join("tiny-silu.lsb");
    let without = scratch().join("tiny-silu-no-certificate.lsb");
    let args = [
        "--quant",
        "q8",
        "--sparsity",
        "threshold:0.8",
        "--cluster-kib",
        "5",
    ];
    convert(&dir, &with, &[&args[..], &["--certificate", "q8"]].concat());
    convert(
        &dir,
        &without,
        &[&args[..], &["--certificate", "none"]].concat(),
    );
    let f = leanstream_format::LsbFile::open(&with).unwrap();
    assert_eq!(f.meta.sparsity_rule, None, "the gate rule");
    assert!(f.sketch.layers.iter().all(|l| l.neurons > 0));
    let ids = leanstream_tests::tiny::random_ids(3, 200, 4096);
    let resident = ppl(&with, PolicyChoice::Resident, None, &ids);
    assert_ne!(
        resident,
        ppl(&with, PolicyChoice::Dense, None, &ids),
        "the rule skips something"
    );
    let minimum = exact_with_and_without_certificate(&with, &without, &ids, resident);
    let bad = scratch().join("tiny-silu-tight.lsb");
    leanstream_tests::converted::negate_certificate_rows(&with, &bad);
    let tight = ppl(&bad, PolicyChoice::Leanstream, Some(minimum), &ids);
    assert_ne!(
        tight, resident,
        "a bound too tight for its rows skips neurons it cannot prove inactive, yet the output \
         matched"
    );
}

/// Perplexity of `ids` with `file` at each of the first three budgets, the FFN bytes read, and
/// the layers whose certificate the planner kept.
/// Per budget: the budget, perplexity, bytes read, layers certified and late reads.
fn at_three_budgets(file: &Path, ids: &[u32]) -> Vec<(u64, f64, u64, usize, u64)> {
    budgets(file)
        .into_iter()
        .take(3)
        .map(|b| {
            let mut s = session(file, PolicyChoice::Leanstream, Some(b));
            let p = perplexity(s.model(), ids, 64, false).unwrap().perplexity;
            let certified = s.report()["memory_split"]["certified_layers"]
                .as_array()
                .unwrap()
                .len();
            let late = s.report()["late_reads"].as_u64().unwrap();
            (b, p, s.io().unwrap().stats().bytes_read, certified, late)
        })
        .collect()
}

/// `with` (a certificate) and `without` (none; same weights): exact output equals `resident` bit
/// for bit at three budgets either way; the planner keeps the certificate at the minimum, where it
/// saves reads; without one every uncached cluster is needed, so leanstream reads them all ahead of
/// their layers and none is late. Returns `with`'s minimum.
fn exact_with_and_without_certificate(
    with: &Path,
    without: &Path,
    ids: &[u32],
    resident: f64,
) -> u64 {
    assert_eq!(ppl(without, PolicyChoice::Resident, None, ids), resident);
    let a = at_three_budgets(with, ids);
    let b = at_three_budgets(without, ids);
    for (&(ba, pa, ra, ca, _), &(bb, pb, rb, cb, late)) in a.iter().zip(&b) {
        eprintln!(
            "with: budget {ba} read {ra} B, {ca} layers certified; without: budget {bb} read {rb} B, {late} late reads"
        );
        assert_eq!(pa, resident, "budget {ba}: certified differs from resident");
        assert_eq!(
            pb, resident,
            "budget {bb}: uncertified differs from resident"
        );
        assert_eq!(cb, 0);
        assert_eq!(
            late, 0,
            "budget {bb}: reads of an uncertified layer were left late"
        );
    }
    assert!(a[0].3 > 0, "the certificate earns its bytes at the minimum");
    assert!(a[0].2 < b[0].2, "and saves reads: {} vs {}", a[0].2, b[0].2);
    a[0].0
}

/// The `gate_up` rule of `--sparsity target:F`: calibrated to the target on held-out windows, no
/// certificate (a gate sketch cannot prove it), and exact mode — every uncached cluster read, the
/// exact scores deciding — equals `resident` bit for bit at three budgets.
#[test]
fn gate_up_rule_hits_its_target_and_streams_exactly_without_a_certificate() {
    let dir = leanstream_tests::fresh_dir(&scratch(), "tiny-silu-gate-up");
    write_tiny_model(&dir, &TinySpec::llama()).unwrap();
    let file = scratch().join("tiny-silu-gate-up.lsb");
    convert(&dir, &file, &["--quant", "q8", "--sparsity", "target:0.5"]);
    let f = leanstream_format::LsbFile::open(&file).unwrap();
    assert_eq!(f.meta.sparsity_rule.as_deref(), Some("gate_up"));
    // Empty SKETCH layers need 1.3; the converter's split clusters make it 1.6, its INPUT_BASIS
    // 1.10.
    assert_eq!(
        f.cluster_layout(),
        leanstream_format::ffn::ClusterLayout::Split
    );
    assert_eq!(f.header.version_minor, 10);
    assert!(f.sketch.layers.iter().all(|l| l.neurons == 0));
    let held_out: f32 =
        f.meta.layers.iter().map(|l| l.sparsity).sum::<f32>() / f.meta.layers.len() as f32;
    assert!(
        (held_out - 0.5).abs() <= 0.03,
        "held-out sparsity {held_out} for target 0.5"
    );
    let ids = leanstream_tests::tiny::random_ids(3, 200, 4096);
    let resident = ppl(&file, PolicyChoice::Resident, None, &ids);
    let dense = ppl(&file, PolicyChoice::Dense, None, &ids);
    assert_ne!(resident, dense, "the rule skips something");
    for (b, streamed, _, certified, late) in at_three_budgets(&file, &ids) {
        assert_eq!(certified, 0);
        assert_eq!(
            late, 0,
            "budget {b}: reads of an uncertified layer were left late"
        );
        assert_eq!(
            streamed, resident,
            "budget {b}: exact differs from resident"
        );
    }
}

/// ReLU (`gate` rule) with and without its certificate: exact at three budgets either way; at the
/// minimum the planner keeps the certificate, and it saves reads. Without one every uncached
/// cluster is needed, so leanstream reads them all ahead of their layers: none is late.
#[test]
fn relu_streams_exactly_with_and_without_the_certificate() {
    let with = embedded("q8");
    let without = scratch().join("austen-q8-no-certificate.lsb");
    convert(
        &leanstream_tests::converted::workspace().join("models/austen-relu"),
        &without,
        &["--quant", "q8", "--certificate", "none"],
    );
    let ids = text_ids(&session(&with, PolicyChoice::Resident, None), 200);
    let resident = ppl(&with, PolicyChoice::Resident, None, &ids);
    exact_with_and_without_certificate(&with, &without, &ids, resident);
}

/// A certificate whose error bounds are too tight for its rows (rows negated, bounds kept) "proves"
/// active neurons inactive: the run differs from `resident`, and this test fails if that ever goes
/// unnoticed.
#[test]
fn a_certificate_made_too_tight_is_caught() {
    let good = embedded("q8");
    let bad = scratch().join("austen-q8-tight.lsb");
    leanstream_tests::converted::negate_certificate_rows(&good, &bad);
    let ids = text_ids(&session(&good, PolicyChoice::Resident, None), 200);
    let resident = ppl(&good, PolicyChoice::Resident, None, &ids);
    let min = leanstream::streaming::minimum_memory(&bad, 128).unwrap();
    assert_eq!(
        ppl(&good, PolicyChoice::Leanstream, Some(min), &ids),
        resident
    );
    let tight = ppl(&bad, PolicyChoice::Leanstream, Some(min), &ids);
    assert_ne!(
        tight, resident,
        "a bound too tight for its rows skips neurons it cannot prove inactive, yet the output matched"
    );
}

/// The certificate a q4 file's `auto` writes — its own Q4_0 gate rows, the exact gates (a lossy
/// code with error bounds proves too little to earn its bytes: `convert --certificate-study`) —
/// on the embedded ReLU model: exact output equals `resident` bit for bit at three budgets, the
/// planner keeps it at the minimum, and the same certificate with its rows negated (bounds kept)
/// is caught.
#[test]
fn a_q4_file_streams_exactly_with_its_own_gates_as_certificate_and_a_too_tight_one_is_caught() {
    let model = leanstream_tests::converted::workspace().join("models/austen-relu");
    let file = scratch().join("austen-q4.lsb");
    convert(&model, &file, &["--quant", "q4"]);
    let f = leanstream_format::LsbFile::open(&file).unwrap();
    assert!(f.sketch.layers.iter().any(|l| l.neurons > 0));
    assert!(f
        .sketch
        .layers
        .iter()
        .all(|l| l.neurons == 0 || l.qtype == QuantType::Q4_0));
    let ids = text_ids(&session(&file, PolicyChoice::Resident, None), 200);
    let resident = ppl(&file, PolicyChoice::Resident, None, &ids);
    let runs = at_three_budgets(&file, &ids);
    for &(b, streamed, read, certified, _) in &runs {
        eprintln!("budget {b}: read {read} B, {certified} layers certified");
        assert_eq!(
            streamed, resident,
            "budget {b}: exact differs from resident"
        );
    }
    assert!(
        runs[0].3 > 0,
        "the planner keeps the certificate at the minimum"
    );
    // The certificate is optional: the stated floor keeps none, and a run there (where the
    // certificate does not fit beside every dense weight) reads every uncached cluster instead.
    let floor = leanstream::streaming::streaming_minimum_memory(&file, 128).unwrap();
    let mut s = session(&file, PolicyChoice::Leanstream, Some(floor));
    let at_floor = perplexity(s.model(), &ids, 64, false).unwrap().perplexity;
    let certified = s.report()["memory_split"]["certified_layers"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(certified, 0, "at the floor the certificate gives way");
    assert_eq!(
        at_floor, resident,
        "at the floor: exact differs from resident"
    );
    let bad = scratch().join("austen-q4-tight.lsb");
    leanstream_tests::converted::negate_certificate_rows(&file, &bad);
    let tight = ppl(&bad, PolicyChoice::Leanstream, Some(runs[0].0), &ids);
    assert_ne!(
        tight, resident,
        "a bound too tight for its rows skips neurons it cannot prove inactive, yet the output \
         matched"
    );
}

/// The minimum a refused run states (rounded to 0.01 MiB), from its stderr.
fn stated_minimum(stderr: &[u8]) -> u64 {
    let err = String::from_utf8_lossy(stderr);
    let min = err
        .split("below the minimum of ")
        .nth(1)
        .and_then(|r| r.split(" for").next())
        .unwrap_or_else(|| panic!("no minimum stated: {err}"));
    leanstream::platform::memory_size::parse_size(&min.replace(' ', "")).unwrap()
}

fn run(file: &Path, extra: &[&str]) -> Output {
    Command::new(bin("leanstream"))
        .arg("run")
        .arg("--model")
        .arg(file)
        .args([
            "-p",
            "It was a fine morning, and Emma",
            "--temp",
            "0",
            "-n",
            "40",
            "--ctx",
            "128",
            "--json",
        ])
        .args(extra)
        .output()
        .unwrap()
}

/// Greedy tokens are identical, and the OS-measured peak RSS stays within the budget + 5 %.
#[test]
fn the_binary_keeps_its_budget_and_its_tokens() {
    let file = embedded("q8");
    let resident = run(&file, &["--policy", "resident"]);
    assert!(
        resident.status.success(),
        "{}",
        String::from_utf8_lossy(&resident.stderr)
    );
    let want: serde_json::Value = serde_json::from_slice(&resident.stdout).unwrap();
    // Resident means resident: no reads after start-up, every cluster a hit.
    assert_eq!(want["bytes_read_per_token"], 0.0);
    assert_eq!(want["cache_hit_rate"], 1.0);
    // The binary's own minimum (its process overhead differs from this test's).
    let min = stated_minimum(&run(&file, &["--memory", "1MiB"]).stderr) + (1 << 20);
    let ffn = leanstream_format::LsbFile::open(&file)
        .unwrap()
        .ffn
        .bundle_bytes();
    let mut first_bytes: Option<f64> = None;
    let (mut last_bytes, mut last_hit) = (0.0, 0.0);
    // Everything resident, with room for the binary's own overhead.
    let all = leanstream::streaming::memory_split(&file, 128)
        .unwrap()
        .budget_for_ffn_share(1.5);
    for b in [
        min,
        min + ffn / 10,
        min + ffn / 4,
        min + ffn / 2,
        all.max(min + 2 * ffn),
    ] {
        let o = run(&file, &["--memory", &b.to_string(), "--flash", "ufs4"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["text"], want["text"], "budget {b}");
        let rss = v["peak_rss_bytes"].as_u64().unwrap();
        eprintln!(
            "budget {b}: peak RSS {rss}, {} B/token, hit rate {}",
            v["bytes_read_per_token"], v["cache_hit_rate"]
        );
        assert!(rss as f64 <= b as f64 * 1.05, "budget {b}: peak RSS {rss}");
        for key in [
            "memory_split",
            "bytes_read_per_token",
            "cache_hit_rate",
            "lookahead_recall",
            "predictor_recall",
        ] {
            assert!(!v[key].is_null(), "{key}");
        }
        last_hit = v["cache_hit_rate"].as_f64().unwrap();
        last_bytes = v["bytes_read_per_token"].as_f64().unwrap();
        first_bytes.get_or_insert(last_bytes);
    }
    assert!(
        last_hit > 0.95,
        "with the whole FFN affordable almost everything hits: {last_hit}"
    );
    let first_bytes = first_bytes.unwrap();
    assert!(
        first_bytes > 5.0 * last_bytes,
        "the tightest budget read {first_bytes} B/token, the loosest {last_bytes}"
    );
}

#[test]
fn a_budget_below_the_minimum_says_the_minimum() {
    let file = embedded("q8");
    let o = run(&file, &["--memory", "1MiB"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("below the minimum of"), "{err}");
    let o = run(&file, &["--memory", "0"]);
    assert_eq!(o.status.code(), Some(2), "a zero budget is a usage error");
    for bad in ["ffn:150%", "ffn:50", "ffn:half"] {
        let o = run(&file, &["--memory", bad]);
        assert_eq!(o.status.code(), Some(2), "{bad}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("write ffn:P% with P between 0 and 100"),
            "{err}"
        );
    }
}

/// A prompt of several chunks under budgets whose cache holds part of the FFN, speculating on
/// every token: a cluster resident when a chunk's layer is refined can be evicted by a read
/// offered to the cache before its turn (the engine then reads it again; it used to panic).
/// Every run gives `resident`'s text.
#[test]
fn a_long_prompt_with_a_partly_cached_ffn_equals_resident() {
    let file = embedded("q8");
    let split = leanstream::streaming::memory_split(&file, 1024).unwrap();
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/heldout-head.txt"),
    )
    .unwrap();
    let prompt: String = text.chars().take(2000).collect();
    let command = |extra: &[String]| {
        Command::new(bin("leanstream"))
            .arg("run")
            .arg("--model")
            .arg(&file)
            .args(["-p", &prompt, "-n", "2", "--temp", "0", "--ctx", "1024"])
            .args(["--flash", "ufs4", "--always-lookahead", "--json"])
            .args(extra)
            .output()
            .unwrap()
    };
    let run = |extra: &[String]| {
        let o = command(extra);
        assert!(
            o.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(v["prompt_tokens"].as_u64().unwrap() > 256, "one chunk only");
        let chunk = v["memory_split"]["prompt_chunk"].as_u64();
        (v["text"].as_str().unwrap().to_string(), chunk)
    };
    let (resident, _) = run(&["--policy".into(), "resident".into()]);
    for k in 1..=6 {
        let budget = split.fixed() + split.ffn_total * k / 16;
        let (text, chunk) = run(&["--memory".into(), budget.to_string()]);
        assert_eq!(chunk, Some(256), "budget {budget}");
        assert_eq!(text, resident, "budget {budget}");
    }
    // Near the floor the scratch holds shorter prompt chunks (the gemm blocks then split the
    // prompt as one 256-token chunk does, so the bits are the same).
    // The binary's own floor: the process overhead it measures differs from this test's, and
    // between runs.
    let floor = stated_minimum(&command(&["--memory".into(), "1MiB".into()]).stderr) + (16 << 10);
    let (text, chunk) = run(&["--memory".into(), floor.to_string()]);
    assert!(
        chunk.unwrap() < 256,
        "budget {floor}: {chunk:?}-token chunks"
    );
    assert_eq!(text, resident, "budget {floor}");
}

/// The KV cache's planned bytes that no position has reached hold clusters until the sequence
/// gets there: a run at `--ctx 1024` lends the neuron cache all of them but the pages of its
/// written positions, counted 64 at a time; the lent bytes shrink by the pages of the next 64 as
/// the sequence crosses them; each run gives `resident`'s tokens within its budget.
#[test]
fn the_kv_cache_lends_the_positions_it_has_not_reached_to_the_neuron_cache() {
    let file = embedded("q8");
    let config = leanstream_format::LsbFile::open(&file)
        .unwrap()
        .meta
        .model
        .clone();
    let ctx = 1024;
    let kv = leanstream::model::kv_cache::KvType::F16;
    let min = stated_minimum(&run(&file, &["--memory", "1MiB"]).stderr) + (1 << 20);
    let split = leanstream::streaming::memory_split(&file, ctx).unwrap();
    let budget = min + split.ffn_total / 4 + (split.kv_cache - split.kv_cache * 128 / ctx as u64);
    let go = |n: &str, policy: &[&str]| {
        let o = Command::new(bin("leanstream"))
            .arg("run")
            .arg("--model")
            .arg(&file)
            .args(["-p", "It was a fine morning, and Emma", "--temp", "0"])
            .args(["-n", n, "--ignore-eos", "--ctx", "1024", "--json"])
            .args(["--flash", "ufs4"])
            .args(policy)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let memory = budget.to_string();
    let mut lent_before = u64::MAX;
    for n in ["40", "100"] {
        let want = go(n, &["--policy", "resident"]);
        assert_eq!(want["kv_lent_bytes"], 0, "resident holds every cluster");
        let v = go(n, &["--memory", &memory]);
        assert_eq!(v["text"], want["text"], "-n {n}");
        // The last token generated is not fed back: the cache holds the others.
        let positions =
            v["prompt_tokens"].as_u64().unwrap() + v["generated_tokens"].as_u64().unwrap() - 1;
        let s = &v["memory_split"];
        let (planned, cache, ffn) = (
            s["kv_cache"].as_u64().unwrap(),
            s["neuron_cache"].as_u64().unwrap(),
            s["ffn_total"].as_u64().unwrap(),
        );
        assert!(cache < ffn, "the budget streams: {s}");
        let reached = KvCache::reserved_for(&config, ctx, kv, positions as usize);
        let lent = v["kv_lent_bytes"].as_u64().unwrap();
        assert_eq!(lent, (planned - reached).min(ffn - cache), "-n {n}: {s}");
        assert!(lent > 0 && lent < lent_before, "-n {n}: lent {lent}");
        lent_before = lent;
        let rss = v["peak_rss_bytes"].as_u64().unwrap();
        assert!(
            rss as f64 <= budget as f64 * 1.05,
            "peak RSS {rss} over {budget}"
        );
    }
}
