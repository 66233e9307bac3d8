//! A batched decoding step (several sequences' tokens in one forward pass, as a server's slots
//! decode) allocates nothing once warm: with every bundle resident nothing at all (now and then one
//! allocation on this thread, as the single-token test also sees at times); streaming under a
//! budget, under two allocations per submitted read (the read queue's bookkeeping, as a single
//! token's); and on the dense path (a GGUF file's blocks as stored, or float weights, through
//! `Model::forward_batch`: what `serve --parallel` runs without `--memory`) nothing either. Every row's logits are bitwise those of decoding its sequence alone. A test binary of
//! its own: the worker pool's queues that a batched step fills are shared, and would move where the
//! single-token test sees their blocks grow.

#[path = "common/counting.rs"]
mod counting;

use std::path::Path;

use leanstream::text::session::{PolicyChoice, Session};
use leanstream_tests::converted::{embedded, heldout_ids};

use counting::{budgets, check_streamed, counted, open, Counts, COUNTED, CTX, WARM_UP};

/// Rows decoded together in a batched step (a server's slots).
const ROWS: usize = 4;

/// Decodes `ROWS` sequences together with [`LanguageModel::forward_batch`], each after a prompt of
/// its own length (so the rows sit at different positions), counting from the `WARM_UP`th step;
/// `logits` are the last step's rows.
///
/// [`LanguageModel::forward_batch`]: leanstream::model::LanguageModel::forward_batch
fn decode_batched(mut s: Session, ids: &[u32]) -> Counts {
    let mut caches: Vec<_> = (0..ROWS).map(|_| s.model().new_cache(CTX)).collect();
    let mut logits = Vec::new();
    for (i, cache) in caches.iter_mut().enumerate() {
        s.model()
            .forward_into(&ids[..1 + i], cache, false, &mut logits)
            .unwrap();
    }
    let mut tokens = [0u32; ROWS];
    counted(&mut s, ids.len() - ROWS, |s, step, logits| {
        for (i, t) in tokens.iter_mut().enumerate() {
            *t = ids[1 + i + step];
        }
        let mut refs: [_; ROWS] = {
            let mut it = caches.iter_mut();
            std::array::from_fn(|_| it.next().unwrap())
        };
        s.model().forward_batch(&tokens, &mut refs, logits).unwrap();
    })
}

/// Asserts that the batched steps of `run` (`what`, all in memory) allocated nothing of their own
/// and mapped no read buffer: now and then one allocation on this thread, as the single-token
/// test also sees at times (the worker pool's job queue, shared with the other test of this
/// binary, growing by a block of 63 jobs as a step hands it work), in at most a quarter of the
/// steps.
fn check_resident(what: &str, run: &Counts) {
    let steps = run.per_token.len();
    assert!(
        run.per_token.iter().all(|&(a, m)| a <= 1 && m == 0)
            && run.per_token.iter().filter(|&&(a, _)| a > 0).count() <= steps / 4,
        "{what} allocates in batched steps: {:?}",
        run.per_token
    );
}

/// Each row of the last batched step, decoded alone by `s` (its prompt, then its tokens).
fn rows_alone(mut s: Session, ids: &[u32]) -> Vec<f32> {
    let mut out = Vec::new();
    let steps = ids.len() - ROWS;
    for i in 0..ROWS {
        let mut cache = s.model().new_cache(CTX);
        let mut logits = Vec::new();
        s.model()
            .forward_into(&ids[..1 + i], &mut cache, false, &mut logits)
            .unwrap();
        for &tok in &ids[1 + i..1 + i + steps] {
            s.model()
                .forward_into(&[tok], &mut cache, false, &mut logits)
                .unwrap();
        }
        out.extend_from_slice(&logits);
    }
    out
}

#[test]
fn a_batched_step_allocates_nothing_once_warm() {
    let file = embedded("q8");
    let session = open(&file, PolicyChoice::Resident, None);
    let ids = heldout_ids(&session.tokenizer, ROWS + WARM_UP + COUNTED);
    let alone = rows_alone(session, &ids);
    let resident = decode_batched(open(&file, PolicyChoice::Resident, None), &ids);
    println!(
        "resident, {ROWS} rows a step: (allocations, read buffers made) per step {:?}",
        resident.per_token
    );
    assert!(
        resident.logits == alone,
        "a batched step's rows equal decoding each alone"
    );
    check_resident("resident", &resident);
    for m in budgets(&file) {
        let run = decode_batched(open(&file, PolicyChoice::Leanstream, Some(m)), &ids);
        check_streamed(
            &format!("leanstream at {m} bytes, {ROWS} rows a step"),
            &run,
            &alone,
        );
    }
}

/// The dense files: a GGUF file's blocks as stored (every row's projections and FFN together on
/// the integer kernels) and float weights (the rows decoded one after another).
const DENSE: [&str; 4] = [
    "llama-k.q4_k_m.gguf",
    "llama-k.q6_k.gguf",
    "llama-k.q8_0.gguf",
    "llama3.f32.gguf",
];

#[test]
fn a_dense_batched_step_allocates_nothing_once_warm() {
    for name in DENSE {
        let file = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/arch")
            .join(name);
        let mut session = open(&file, PolicyChoice::Dense, None);
        let vocab = session.model().config().vocab_size;
        let ids = leanstream_tests::tiny::random_ids(5, ROWS + WARM_UP + COUNTED, vocab);
        let alone = rows_alone(session, &ids);
        let dense = decode_batched(open(&file, PolicyChoice::Dense, None), &ids);
        println!(
            "{name}, {ROWS} rows a step: (allocations, read buffers made) per step {:?}",
            dense.per_token
        );
        assert_eq!(dense.logits.len(), ROWS * vocab);
        assert!(
            dense.logits == alone,
            "{name}: a dense batched step's rows equal decoding each alone"
        );
        check_resident(name, &dense);
    }
}
