//! The shipped trained mixture of experts, `models/qwen3-moe-austen` (a Qwen3-MoE trained here on
//! the project's public-domain text, see its README), converted to q8: with its experts streamed
//! from flash under `--memory` it computes exactly what `--policy resident` computes — every
//! position's logits of a held-out window (one prompt chunk), the same window fed one token at a
//! time, and a greedy continuation — at three budgets; and its next-router look-ahead (layer
//! l+1's router on the residual after layer l's attention) finds, whatever the budget, at least
//! 80 % of the experts each of layers 1, 2 and 3 chose on that window (see `RECALL`).

use std::path::{Path, PathBuf};

use leanstream::model::kv_cache::KvType;
use leanstream::streaming::experts::minimum_memory;
use leanstream::text::session::{PolicyChoice, Session};
use leanstream::tokenizer::Tokenizer;
use leanstream_tests::converted::{argmax, convert, exact_options, heldout_ids, workspace};
use leanstream_tests::fresh_dir;

const CTX: usize = 256;
/// Held-out tokens fed one at a time (the window the look-ahead is judged on).
const WINDOW: usize = 160;
const GREEDY: usize = 16;
/// The least look-ahead recall asserted for layers 1, 2 and 3 on the window: the target of
/// 0.8 or more on every layer, a margin below the measured 0.861, 0.926 and 0.966 (over all of
/// heldout-head.txt: 0.896, 0.948, 0.963). Layer 1, predicted from the residual after layer 0's
/// attention, had 0.656 here when the look-ahead read the residual entering layer 0 (the token's
/// embedding alone) and the model was trained for that.
const RECALL: [f64; 3] = [0.8, 0.85, 0.9];

fn model_dir() -> PathBuf {
    workspace().join("models/qwen3-moe-austen")
}

/// What a session computes: the window's logits as one prompt, then fed one token at a time, then
/// the greedy continuation of its first 8 tokens.
#[derive(PartialEq)]
struct Outputs {
    prompt: Vec<f32>,
    decoded: Vec<f32>,
    greedy: Vec<u32>,
}

fn outputs(s: &mut Session, ids: &[u32]) -> Outputs {
    let m = s.model();
    let mut cache = m.new_cache(CTX);
    let prompt = m.forward(ids, &mut cache, true).unwrap();
    let mut cache = m.new_cache(CTX);
    let mut decoded = Vec::new();
    for &t in ids {
        decoded.extend(m.forward(&[t], &mut cache, false).unwrap());
    }
    let mut cache = m.new_cache(CTX);
    let mut last = m.forward(&ids[..8], &mut cache, false).unwrap();
    let mut greedy = Vec::new();
    for _ in 0..GREEDY {
        let t = argmax(&last);
        greedy.push(t);
        last = m.forward(&[t], &mut cache, false).unwrap();
    }
    Outputs {
        prompt,
        decoded,
        greedy,
    }
}

#[test]
fn the_trained_mixture_streams_exactly_and_its_lookahead_finds_its_experts() {
    let dir = model_dir();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let layers = config["num_hidden_layers"].as_u64().unwrap() as usize;
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let ids = heldout_ids(&tokenizer, WINDOW);
    assert_eq!(ids.len(), WINDOW);

    let scratch = fresh_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "moe-trained");
    let file = scratch.join("qwen3-moe-austen.lsb");
    convert(&dir, &file, &["--quant", "q8"]);

    let mut resident =
        Session::open(&exact_options(&file, PolicyChoice::Resident, None, CTX)).unwrap();
    let want = outputs(&mut resident, &ids);
    drop(resident);

    let minimum = minimum_memory(&file, CTX, KvType::F32).unwrap();
    let all = Session::open(&exact_options(&file, PolicyChoice::Leanstream, None, CTX)).unwrap();
    let split = all.report()["expert_split"].clone();
    let slot = split["expert_bytes"].as_u64().unwrap();
    let experts = split["experts"].as_u64().unwrap();
    assert_eq!(
        experts,
        layers as u64 * config["num_experts"].as_u64().unwrap()
    );
    drop(all);

    let mut recalls: Vec<Vec<serde_json::Value>> = Vec::new();
    let mut reads = Vec::new();
    for (what, budget) in [
        ("minimum", minimum),
        ("halfway", minimum + experts / 2 * slot),
        ("nearly all resident", minimum + (experts - 2) * slot),
    ] {
        let mut s = Session::open(&exact_options(
            &file,
            PolicyChoice::Leanstream,
            Some(budget),
            CTX,
        ))
        .unwrap();
        let got = outputs(&mut s, &ids);
        assert!(
            got.prompt == want.prompt,
            "{what}: prompt logits differ from resident"
        );
        assert!(
            got.decoded == want.decoded,
            "{what}: decoded logits differ from resident"
        );
        assert_eq!(
            got.greedy, want.greedy,
            "{what}: greedy tokens differ from resident"
        );
        let r = s.report();
        eprintln!(
            "{what} ({budget} B): look-ahead recall {} by layer {}, precision {}, hit rate {}, \
             experts read per token {}",
            r["expert_lookahead_recall"],
            r["expert_lookahead_recall_by_layer"],
            r["expert_lookahead_precision"],
            r["expert_hit_rate"],
            r["experts_read_per_token"],
        );
        recalls.push(
            r["expert_lookahead_recall_by_layer"]
                .as_array()
                .unwrap()
                .clone(),
        );
        reads.push(r["experts_read_per_token"].as_f64().unwrap());
    }
    // The look-ahead is the routers' and the residual's, not the cache's: the same at every budget.
    assert!(recalls.iter().all(|r| *r == recalls[0]), "{recalls:?}");
    let by_layer = &recalls[0];
    assert_eq!(by_layer.len(), layers);
    // Layer 0 has nothing before it to predict from; every later layer is judged.
    assert!(by_layer[0].is_null(), "{by_layer:?}");
    for (l, r) in by_layer.iter().enumerate().skip(1) {
        let r = r
            .as_f64()
            .unwrap_or_else(|| panic!("layer {l} not judged: {by_layer:?}"));
        let least = RECALL[l - 1];
        assert!(
            r >= least,
            "layer {l}: look-ahead recall {r} < {least} ({by_layer:?})"
        );
    }
    // More memory keeps more experts: fewer are read per token.
    assert!(reads[2] < reads[0], "{reads:?}");
}
