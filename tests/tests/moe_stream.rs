//! A converted mixture of experts with its experts streamed from flash under `--memory` computes
//! exactly what `--policy resident` computes: every position's logits and the greedy tokens are
//! bit-identical at three budgets (the stated minimum, where the embedding, attention and head
//! stream too; halfway; and nearly every expert resident);
//! a budget below the minimum is refused, naming it. The figures (hit rate, look-ahead recall,
//! experts read per token) move the way the budget says they should.

use std::path::{Path, PathBuf};

use leanstream::kv_cache::KvType;
use leanstream::session::{PolicyChoice, Session, SessionOptions};
use leanstream::streaming::experts::minimum_memory;
use leanstream::streaming::Sparsity;
use leanstream_tests::converted::convert;
use leanstream_tests::fresh_dir;
use leanstream_tests::tiny::{random_ids, write_tiny_model, TinySpec};

const CTX: usize = 64;
const GREEDY: usize = 16;

fn options(file: &Path, policy: PolicyChoice, memory: Option<u64>) -> SessionOptions {
    SessionOptions {
        model: file.to_path_buf(),
        policy: Some(policy),
        memory,
        flash: None,
        sparsity: Sparsity::Exact,
        ctx: Some(CTX),
        default_ctx: CTX,
        kv: KvType::F32,
        tuning: Default::default(),
    }
}

fn argmax(row: &[f32]) -> u32 {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
        .unwrap() as u32
}

/// Every position's logits of `ids`, then the greedy continuation of `prompt` one token at a
/// time; and the session's report.
fn outputs(s: &mut Session, ids: &[u32], prompt: &[u32]) -> (Vec<f32>, Vec<u32>) {
    let m = s.model();
    let mut cache = m.new_cache(CTX);
    let logits = m.forward(ids, &mut cache, true).unwrap();
    let mut cache = m.new_cache(CTX);
    let mut last = m.forward(prompt, &mut cache, false).unwrap();
    let mut tokens = Vec::new();
    for _ in 0..GREEDY {
        let t = argmax(&last);
        tokens.push(t);
        last = m.forward(&[t], &mut cache, false).unwrap();
    }
    (logits, tokens)
}

/// Converted into its own folder `name` (tests run in parallel).
fn converted(spec: &TinySpec, name: &str) -> PathBuf {
    let dir = fresh_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), name);
    write_tiny_model(&dir, spec).unwrap();
    let file = dir.join("model.lsb");
    convert(&dir, &file, &["--quant", "q8"]);
    file
}

#[test]
fn streamed_experts_give_residents_bits_at_three_budgets() {
    let spec = TinySpec {
        seed: 71,
        ..TinySpec::qwen3_moe()
    };
    let moe = spec.moe.clone().unwrap();
    let file = converted(&spec, "moe-stream");
    let ids = random_ids(spec.seed + 3, 40, spec.vocab);
    let prompt = &ids[..8];
    let mut resident = Session::open(&options(&file, PolicyChoice::Resident, None)).unwrap();
    let want = outputs(&mut resident, &ids, prompt);

    let minimum = minimum_memory(&file, CTX, KvType::F32).unwrap();
    let below = Session::open(&options(&file, PolicyChoice::Leanstream, Some(minimum - 1)));
    let msg = format!("{:#}", below.err().expect("below the minimum is refused"));
    let named = leanstream::memory_size::format_size(minimum);
    assert!(
        msg.contains("mixture of experts") && msg.contains(&format!("use --memory {named}")),
        "{msg}"
    );

    // The split without a budget gives the size of a slot and the number of experts.
    let all = Session::open(&options(&file, PolicyChoice::Leanstream, None)).unwrap();
    let split = all.report()["expert_split"].clone();
    let slot = split["expert_bytes"].as_u64().unwrap();
    let experts = split["experts"].as_u64().unwrap();
    let mixture_layers = (0..spec.layers)
        .filter(|&l| moe.is_moe_layer(spec.arch, l))
        .count() as u64;
    assert_eq!(experts, mixture_layers * moe.experts as u64);
    drop(all);

    let mut rates = Vec::new();
    for (what, budget) in [
        ("minimum", minimum),
        ("halfway", minimum + experts / 2 * slot),
        ("nearly all resident", minimum + (experts - 2) * slot),
    ] {
        let mut s = Session::open(&options(&file, PolicyChoice::Leanstream, Some(budget))).unwrap();
        let got = outputs(&mut s, &ids, prompt);
        assert!(got.0 == want.0, "{what}: logits differ from resident");
        assert_eq!(got.1, want.1, "{what}: greedy tokens differ from resident");
        let r = s.report();
        eprintln!(
            "{what} ({budget} B): hit rate {}, look-ahead recall {} (by layer {}), precision {}, \
             experts read per token {}, bytes read per token {}",
            r["expert_hit_rate"],
            r["expert_lookahead_recall"],
            r["expert_lookahead_recall_by_layer"],
            r["expert_lookahead_precision"],
            r["experts_read_per_token"],
            r["bytes_read_per_token"]
        );
        let read = r["experts_read_per_token"].as_f64().unwrap();
        let hit = r["expert_hit_rate"].as_f64().unwrap();
        let recall = r["expert_lookahead_recall"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&hit) && (0.0..=1.0).contains(&recall));
        // The first mixture layer (1) is predicted from the dense layer 0's residual.
        let by_layer = r["expert_lookahead_recall_by_layer"].as_array().unwrap();
        assert!(
            by_layer[0].is_null() && by_layer[1].is_f64(),
            "{by_layer:?}"
        );
        // The minimum streams every dense weight (read on every token); the larger budgets keep
        // them resident.
        let streamed = &r["expert_split"]["dense_streamed"];
        let dense_read = r["dense_bytes_read_per_token"].as_f64().unwrap();
        if what == "minimum" {
            assert!(
                [
                    streamed["embedding"].as_bool(),
                    streamed["head"].as_bool(),
                    streamed["attention"].as_bool()
                ] == [Some(true); 3],
                "{streamed}"
            );
            assert!(dense_read > 0.0, "{dense_read}");
        } else {
            assert_eq!(r["expert_split"]["dense_buffers"], 0, "{what}");
            assert_eq!(dense_read, 0.0, "{what}");
        }
        rates.push((read, hit));
    }
    // At the minimum, experts stream on most tokens; nearly all resident, few are read.
    assert!(rates[0].0 > 0.5, "{rates:?}");
    assert!(rates[2].1 > rates[0].1, "{rates:?}");
    assert!(rates[2].0 < rates[0].0, "{rates:?}");
}

/// The planner's minimum for the shape at another depth (layers repeated: how the full-depth
/// figure of a `synth --layers` file is stated) is the file's own at its depth, and grows by the
/// same bytes with every copy of the layers (their norms, routers, KV cache and experts' share).
#[test]
fn the_minimum_at_depth_is_the_files_at_its_own_and_linear_beyond() {
    let spec = TinySpec {
        seed: 72,
        ..TinySpec::qwen3_moe()
    };
    let file = converted(&spec, "moe-stream-depth");
    let at = |depth| {
        leanstream::streaming::experts::minimum_memory_at_depth(&file, CTX, KvType::F16, depth)
            .unwrap()
    };
    let l = spec.layers;
    assert_eq!(at(l), minimum_memory(&file, CTX, KvType::F16).unwrap());
    let step = at(2 * l) - at(l);
    assert!(step > 0);
    assert_eq!(at(3 * l) - at(2 * l), step);
    // A shallower depth needs less, never more.
    assert!(at(1) < at(l));
}
