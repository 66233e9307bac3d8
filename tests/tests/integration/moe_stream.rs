//! A converted mixture of experts with its experts streamed from flash under `--memory` computes
//! exactly what `--policy resident` computes: every position's logits and the greedy tokens are
//! bit-identical at three budgets (the stated minimum, where the embedding, attention and head
//! stream too; halfway; and nearly every expert resident);
//! a budget below the minimum is refused, naming it. The figures (hit rate, look-ahead recall,
//! experts read per token) move the way the budget says they should.

use std::path::{Path, PathBuf};

use leanstream::model::kv_cache::KvType;
use leanstream::streaming::experts::minimum_memory;
use leanstream::text::session::{PolicyChoice, Session, SessionOptions};
use leanstream_tests::converted::{convert, exact_options};
use leanstream_tests::fresh_dir;
use leanstream_tests::tiny::{random_ids, write_tiny_model, TinySpec};

const CTX: usize = 64;
const GREEDY: usize = 16;

fn options(file: &Path, policy: PolicyChoice, memory: Option<u64>) -> SessionOptions {
    exact_options(file, policy, memory, CTX)
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

/// The tiny Qwen3-MoE of `seed` converted into folder `name`, and 40 token ids.
fn tiny(seed: u64, name: &str) -> (TinySpec, PathBuf, Vec<u32>) {
    let spec = TinySpec {
        seed,
        ..TinySpec::qwen3_moe()
    };
    let file = converted(&spec, name);
    let ids = random_ids(spec.seed + 3, 40, spec.vocab);
    (spec, file, ids)
}

/// The size of an expert slot and the number of experts, from the split without a budget.
fn slot_and_experts(file: &Path) -> (u64, u64) {
    let all = Session::open(&options(file, PolicyChoice::Leanstream, None)).unwrap();
    let split = all.report()["expert_split"].clone();
    (
        split["expert_bytes"].as_u64().unwrap(),
        split["experts"].as_u64().unwrap(),
    )
}

#[test]
fn streamed_experts_give_residents_bits_at_three_budgets() {
    let (spec, file, ids) = tiny(71, "moe-stream");
    let moe = spec.moe.clone().unwrap();
    let prompt = &ids[..8];
    let mut resident = Session::open(&options(&file, PolicyChoice::Resident, None)).unwrap();
    let want = outputs(&mut resident, &ids, prompt);

    let minimum = minimum_memory(&file, CTX, KvType::F32).unwrap();
    let below = Session::open(&options(&file, PolicyChoice::Leanstream, Some(minimum - 1)));
    let msg = format!("{:#}", below.err().expect("below the minimum is refused"));
    let named = leanstream::platform::memory_size::format_size(minimum);
    assert!(
        msg.contains("mixture of experts") && msg.contains(&format!("use --memory {named}")),
        "{msg}"
    );

    // The split without a budget gives the size of a slot and the number of experts.
    let (slot, experts) = slot_and_experts(&file);
    let mixture_layers = (0..spec.layers)
        .filter(|&l| moe.is_moe_layer(spec.arch, l))
        .count() as u64;
    assert_eq!(experts, mixture_layers * moe.experts as u64);

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
    let (spec, file, _) = tiny(72, "moe-stream-depth");
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

/// Decodes `ids` one token per call (as the expert trace is recorded); every step's logits.
fn decode_each(s: &mut Session, ids: &[u32]) -> Vec<f32> {
    let m = s.model();
    let mut cache = m.new_cache(CTX);
    let mut all = Vec::new();
    for &t in ids {
        all.extend(m.forward(&[t], &mut cache, false).unwrap());
    }
    all
}

/// The expert oracle (`bench`'s `expert-oracle`: each token's true experts read where leanstream
/// reads the next router's guesses, Belady retention) computes resident's bits, guesses every
/// expert right, and with room to keep experts reads fewer than leanstream does.
#[test]
fn the_expert_oracle_guesses_every_expert_and_reads_no_more_than_leanstream() {
    let (spec, file, ids) = tiny(73, "moe-stream-oracle");
    let moe = spec.moe.clone().unwrap();
    let trace =
        leanstream::streaming::experts::ExpertTrace::record(&file, &ids, CTX, KvType::F32).unwrap();
    assert_eq!(trace.chosen.len(), ids.len());
    assert!(
        trace.chosen[0][1].len() == moe.top_k,
        "{:?}",
        trace.chosen[0]
    );
    let mut resident = Session::open(&options(&file, PolicyChoice::Resident, None)).unwrap();
    let want = decode_each(&mut resident, &ids);
    let minimum = minimum_memory(&file, CTX, KvType::F32).unwrap();
    let (slot, experts) = slot_and_experts(&file);
    let budget = minimum + experts / 2 * slot;
    let mut read = Vec::new();
    for oracle in [false, true] {
        let mut o = options(&file, PolicyChoice::Leanstream, Some(budget));
        if oracle {
            o.tuning.expert_oracle = Some(std::sync::Arc::new(trace.clone()));
        }
        let mut s = Session::open(&o).unwrap();
        s.reset_metrics();
        assert!(
            decode_each(&mut s, &ids) == want,
            "oracle {oracle}: logits differ"
        );
        let r = s.report();
        if oracle {
            assert_eq!(r["expert_lookahead_recall"].as_f64(), Some(1.0), "{r}");
            assert_eq!(r["expert_lookahead_precision"].as_f64(), Some(1.0), "{r}");
        }
        read.push(r["experts_read_per_token"].as_f64().unwrap());
    }
    assert!(
        read[1] <= read[0],
        "oracle reads {} > leanstream {}",
        read[1],
        read[0]
    );
}

/// `leanstream bench` on a mixture runs its three rows at each budget and reports the expert
/// figures: the oracle guesses every expert, the ablation none, and nothing reads less than the
/// oracle where experts can stay.
#[test]
fn bench_runs_leanstream_its_ablation_and_the_expert_oracle_on_a_mixture() {
    let (_, file, _) = tiny(74, "moe-stream-bench");
    let out = std::process::Command::new(leanstream_tests::cli::bin("leanstream"))
        .args(["bench", "--model"])
        .arg(&file)
        .args(["--memory", "min,ffn:50%", "--tokens", "8", "--ctx", "64"])
        .args(["--flash", "none", "--threads", "1", "--json"])
        .output()
        .unwrap();
    let v = leanstream_tests::cli::json_output(&out);
    let runs = v["runs"].as_array().unwrap();
    let labels: Vec<&str> = runs.iter().map(|r| r["label"].as_str().unwrap()).collect();
    assert_eq!(
        labels,
        [
            "leanstream",
            "leanstream-no-lookahead",
            "expert-oracle",
            "leanstream",
            "leanstream-no-lookahead",
            "expert-oracle"
        ]
    );
    let f = |i: usize, k: &str| runs[i]["details"][k].as_f64().unwrap();
    for b in [0, 3] {
        assert!(runs[b]["error"].is_null(), "{}", runs[b]);
        assert_eq!(f(b + 1, "expert_lookahead_recall"), 0.0);
        assert_eq!(f(b + 2, "expert_lookahead_recall"), 1.0);
        assert!(f(b, "experts_read_per_token") > 0.0);
    }
    assert!(f(5, "experts_read_per_token") <= f(3, "experts_read_per_token"));
    assert!(f(5, "experts_read_per_token") <= f(4, "experts_read_per_token"));
}
