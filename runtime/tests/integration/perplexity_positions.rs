//! `perplexity_from` scores the positions `llama-perplexity` scores: from position N of each
//! whole window, the short last window left out; checked against the same sums taken by hand.

use std::path::PathBuf;

use leanstream::source;
use leanstream::text::perplexity::{log_softmax, perplexity, perplexity_from};

#[test]
fn scoring_from_a_position_takes_those_positions_of_whole_windows() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let loaded = source::open(&root.join("models/austen-relu")).unwrap();
    let text = std::fs::read_to_string(root.join("data/heldout-head.txt")).unwrap();
    let mut ids = loaded.tokenizer.encode(&text, false).unwrap();
    // Three whole windows of 64 and a short one of 10 tokens.
    ids.truncate(3 * 64 + 10);
    let model = loaded.model;

    // By hand: each whole window from an empty cache, predictions at positions 40..=62.
    let vocab = model.config().vocab_size;
    let (mut nll, mut count) = (0.0f64, 0usize);
    for w in ids.chunks(64).filter(|w| w.len() == 64) {
        let mut cache = model.new_cache(64);
        let logits = model.forward(w, &mut cache, true).unwrap();
        for pos in 40..63 {
            nll -= log_softmax(&logits[pos * vocab..(pos + 1) * vocab])[w[pos + 1] as usize];
            count += 1;
        }
    }
    let got = perplexity_from(&model, &ids, 64, 40, false).unwrap();
    assert_eq!(got.tokens, 3 * 23);
    assert_eq!(count, got.tokens);
    let want = nll / count as f64;
    assert!(
        (got.mean_nll - want).abs() < 1e-9,
        "{} against {want} by hand",
        got.mean_nll
    );

    // From position 0 it is the plain perplexity: every window, the short one too.
    let all = perplexity_from(&model, &ids, 64, 0, false).unwrap();
    assert_eq!(all.tokens, 3 * 63 + 9);
    assert_eq!(
        all.mean_nll,
        perplexity(&model, &ids, 64, false).unwrap().mean_nll
    );
    assert_ne!(all.mean_nll, got.mean_nll);

    // Positions past the window's end are refused with the position to use.
    let err = perplexity_from(&model, &ids, 64, 63, false).unwrap_err();
    assert!(err.to_string().contains("below 63"), "{err}");
    let err = perplexity_from(&model, &ids[..50], 64, 10, false).unwrap_err();
    assert!(err.to_string().contains("50 tokens"), "{err}");
}
