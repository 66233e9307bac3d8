//! Refilling the neuron cache after the budget grows (runtime/src/streaming/refill.rs): a run
//! starts under a budget whose cache holds a part of the FFN, then gets room for all of it. The
//! profile's hottest clusters are read into the new room in the background, so that after a
//! while every cluster a token needs is in memory when its layer runs — without refilling, a
//! cluster first needed later misses then (measured on this sequence with the refill switched
//! off: 11 late reads, an active hit rate of 0.9997, in the 160 tokens checked). Before the growth nothing is refilled, and the text equals `resident`'s
//! throughout. Tokens are counted, never timed: the refill only needs enough of them.

use std::path::Path;

use leanstream::model::kv_cache::KvCache;
use leanstream::text::sampler::argmax;
use leanstream::text::session::{PolicyChoice, Session};
use leanstream_tests::converted::{embedded_default, session_options};

const CTX: usize = 512;
/// Tokens under the low budget, then tokens for the refill to land, then tokens checked.
const BEFORE: usize = 40;
const SETTLE: usize = 100;
const CHECKED: usize = 160;

fn session(file: &Path, policy: PolicyChoice, memory: Option<u64>) -> Session {
    // Reads straight from the file (no emulated flash): the refill lands in fewer tokens.
    Session::open(&session_options(file, policy, memory, CTX).flash(None)).unwrap()
}

/// Feeds `tokens` one at a time (as decoding does); the most likely next token after each.
fn feed(s: &mut Session, cache: &mut KvCache, tokens: &[u32]) -> Vec<u32> {
    let mut logits = Vec::new();
    tokens
        .iter()
        .map(|&t| {
            s.model()
                .forward_into(&[t], cache, false, &mut logits)
                .unwrap();
            argmax(&logits)
        })
        .collect()
}

#[test]
fn after_the_budget_grows_the_hottest_clusters_are_read_in_before_tokens_miss_them() {
    let file = embedded_default();
    let split = leanstream::streaming::memory_split(&file, CTX).unwrap();
    // Low: the dense weights resident and a cache of about 1 MiB (of the FFN's 3.2 MiB); high:
    // room for the whole FFN besides.
    let low = split.fixed() + (1 << 20);
    let high = low + split.ffn_total;

    // The resident greedy sequence: the prompt and what follows it.
    let mut resident = session(&file, PolicyChoice::Resident, None);
    let prompt = resident
        .tokenizer
        .encode("It was a fine morning, and Emma", false)
        .unwrap();
    let mut kv = resident.model().new_cache(CTX);
    let mut seq = prompt.clone();
    let mut next = *feed(&mut resident, &mut kv, &prompt).last().unwrap();
    while seq.len() < prompt.len() + BEFORE + SETTLE + CHECKED {
        seq.push(next);
        next = feed(&mut resident, &mut kv, &[next])[0];
    }
    seq.push(next);

    let mut s = session(&file, PolicyChoice::Leanstream, Some(low));
    let v = s.report();
    let cache_low = v["memory_split"]["neuron_cache"].as_u64().unwrap();
    assert!(
        cache_low < split.ffn_total / 2,
        "the low budget caches {cache_low} of {} FFN bytes",
        split.ffn_total
    );
    let mut kv = s.model().new_cache(CTX);
    let mut at = prompt.len() + BEFORE;
    let mut out = feed(&mut s, &mut kv, &seq[..at]);
    let v = s.report();
    assert_eq!(v["refill_reads"], 0, "refilled before growing: {v}");
    assert!(v["late_reads"].as_u64().unwrap() > 0, "{v}");

    s.set_memory_budget(high).unwrap();
    let v = s.report();
    let cache_high = v["memory_split"]["neuron_cache"].as_u64().unwrap();
    assert!(cache_high >= split.ffn_total, "{v}");
    s.reset_metrics();
    out.extend(feed(&mut s, &mut kv, &seq[at..at + SETTLE]));
    at += SETTLE;
    let settle = s.report();
    // Refill reads were issued.
    let refills = settle["refill_reads"].as_u64().unwrap();
    assert!(refills > 0, "no refill after growing: {settle}");

    // They landed: every cluster a token needed was in memory when its layer ran.
    s.reset_metrics();
    out.extend(feed(&mut s, &mut kv, &seq[at..at + CHECKED]));
    at += CHECKED;
    let v = s.report();
    assert_eq!(v["refill_reads"], 0, "refilling after {SETTLE} tokens: {v}");
    assert_eq!(v["late_reads"], 0, "{v}");
    assert_eq!(v["active_hit_rate"], 1.0, "{v}");
    assert_eq!(v["cache_hit_rate"], 1.0, "{v}");

    // The text equals resident's throughout: before, across and after the growth.
    let from = prompt.len() - 1;
    assert_eq!(out[from..], seq[from + 1..=at]);
    assert_eq!(v["budget_changes"].as_array().unwrap().len(), 1, "{v}");
}
