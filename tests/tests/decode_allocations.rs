//! The decode loop does not allocate: after a few tokens of warm-up, decoding a token through
//! `forward_into` makes no heap allocation on the decoding thread with every bundle resident
//! (model, engine, kernels, neuron cache); streaming under a budget where the dense weights stream
//! and FFN clusters are read, cached and evicted every token, what remains is the read queue's own
//! bookkeeping — B-tree nodes of its pending set (by priority and position, for merging), under
//! two allocations per submitted read. The same holds for a mixture of experts (the trained tiny
//! Qwen3-MoE): routing, the look-ahead after each attention and the experts run where they lie,
//! with every expert resident and with experts read and evicted every token. Counted by a global
//! allocator that counts the calls of the thread that asks (on an emulated device that thread also
//! issues the reads), and the read buffers the process maps (those bypass the allocator; printed,
//! not asserted, while streaming: at the minimum the dense weights' stream maps some).

#[path = "common/counting.rs"]
mod counting;

use leanstream::model::kv_cache::KvType;
use leanstream::streaming::experts;
use leanstream::text::session::{PolicyChoice, Session};
use leanstream::tokenizer::Tokenizer;
use leanstream_tests::converted::{convert, embedded, exact_options, heldout_ids, workspace};
use leanstream_tests::scratch_dir;

use counting::{budgets, check_streamed, counted, open, Counts, COUNTED, CTX, WARM_UP};

/// Decodes `ids` one token at a time, counting from the `WARM_UP`th.
fn decode(mut s: Session, ids: &[u32]) -> Counts {
    let mut cache = s.model().new_cache(CTX);
    counted(&mut s, ids.len(), |s, i, logits| {
        s.model()
            .forward_into(&[ids[i]], &mut cache, false, logits)
            .unwrap();
    })
}

/// Asserts that `resident` decoded without allocating or mapping, and that each streamed run
/// gave its logits and stayed under two allocations per read.
fn check(resident: &Counts, streamed: &[(u64, Counts)]) {
    println!(
        "resident: (allocations, read buffers made) per token {:?}",
        resident.per_token
    );
    assert!(
        resident.per_token.iter().all(|&n| n == (0, 0)),
        "resident allocates while decoding: {:?}",
        resident.per_token
    );
    for (memory, run) in streamed {
        check_streamed(
            &format!("leanstream at {memory} bytes"),
            run,
            &resident.logits,
        );
    }
}

#[test]
fn decoding_a_token_allocates_nothing_once_warm() {
    let file = embedded("q8");
    let session = open(&file, PolicyChoice::Resident, None);
    let ids = heldout_ids(&session.tokenizer, WARM_UP + COUNTED);
    let resident = decode(session, &ids);
    let streamed: Vec<_> = budgets(&file)
        .into_iter()
        .map(|m| {
            (
                m,
                decode(open(&file, PolicyChoice::Leanstream, Some(m)), &ids),
            )
        })
        .collect();
    check(&resident, &streamed);
}

#[test]
fn decoding_a_token_of_a_streamed_mixture_allocates_nothing_once_warm() {
    let dir = workspace().join("models/qwen3-moe-austen");
    let ids = heldout_ids(&Tokenizer::from_dir(&dir).unwrap(), WARM_UP + COUNTED);
    let file = scratch_dir("moe-allocations").join("qwen3-moe-austen.lsb");
    convert(&dir, &file, &["--quant", "q8"]);
    let session =
        |policy, memory| Session::open(&exact_options(&file, policy, memory, CTX)).unwrap();
    let resident = decode(session(PolicyChoice::Resident, None), &ids);
    let minimum = experts::minimum_memory(&file, CTX, KvType::F32).unwrap();
    let slot = session(PolicyChoice::Leanstream, None).report()["expert_split"]["expert_bytes"]
        .as_u64()
        .unwrap();
    let streamed: Vec<_> = [minimum, minimum + 8 * slot]
        .into_iter()
        .map(|m| (m, decode(session(PolicyChoice::Leanstream, Some(m)), &ids)))
        .collect();
    check(&resident, &streamed);
}
