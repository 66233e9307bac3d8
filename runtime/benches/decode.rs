//! Dense decode tokens/s of a model held as f32, bf16, q8 and q4, with 1 and 2 threads.
//!
//! `cargo bench -p leanstream --bench decode [-- MODEL [TOKENS]]`: MODEL (an absolute path: cargo
//! runs benches in `runtime/`) defaults to the embedded `models/austen-relu`; a GGUF file works
//! too (first as loaded, then re-encoded from its values). Runs are interleaved (every encoding
//! and thread count once per round, 5 rounds) so that load from other processes spreads over all
//! of them; the median is reported. Greedy decoding after a short prompt, from an empty cache each
//! round.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Result;
use leanstream::model::Model;
use leanstream::source;
use leanstream_format::quant::QuantType;

const ROUNDS: usize = 5;

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Tokens per second of `n` greedy decode steps after `prompt`.
fn decode_rate(model: &Model, prompt: &[u32], n: usize) -> Result<f64> {
    let mut cache = model.new_cache(prompt.len() + n + 1);
    let mut token = argmax(&model.forward(prompt, &mut cache, false)?);
    let start = Instant::now();
    for _ in 0..n {
        token = argmax(&model.forward(&[token], &mut cache, false)?);
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

fn main() -> Result<()> {
    // `cargo bench` passes `--bench` (`cargo test --all-targets` does not: nothing to do then);
    // positional arguments are the model and the token count.
    if !std::env::args().any(|a| a == "--bench") {
        return Ok(());
    }
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let path = args
        .first()
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("models/austen-relu"));
    let tokens: usize = args.get(1).map_or(Ok(128), |s| s.parse())?;
    let open = |p: &Path| source::open(p).map(|l| (l.model, l.tokenizer));
    let (stored, tokenizer) = open(&path)?;
    let prompt = tokenizer.encode("It was a fine morning, and Emma", true)?;
    let max = stored.config().max_position_embeddings;
    let n = tokens.min(max.saturating_sub(prompt.len() + 1));
    // The model as loaded, then re-encoded from its f32 values (4-bit types keep a q8 head).
    let mut models: Vec<(String, Model)> = vec![("as loaded".into(), stored)];
    for (layers, head) in [
        (QuantType::F32, QuantType::F32),
        (QuantType::BF16, QuantType::BF16),
        (QuantType::Q8_0, QuantType::Q8_0),
        (QuantType::Q4_0, QuantType::Q8_0),
        (QuantType::Q4_1, QuantType::Q8_0),
    ] {
        let model = source::open(&path)?.model.quantize(layers, head)?;
        models.push((layers.to_string(), model));
    }
    let pools: Vec<rayon::ThreadPool> = [1, 2]
        .iter()
        .map(|t| rayon::ThreadPoolBuilder::new().num_threads(*t).build())
        .collect::<Result<_, _>>()?;
    let mut rates = vec![vec![Vec::new(); pools.len()]; models.len()];
    for _ in 0..ROUNDS {
        for (m, (_, model)) in models.iter().enumerate() {
            for (p, pool) in pools.iter().enumerate() {
                rates[m][p].push(pool.install(|| decode_rate(model, &prompt, n))?);
            }
        }
    }
    println!(
        "{}: {n} tokens greedy, median of {ROUNDS} interleaved rounds",
        path.display()
    );
    println!(
        "{:<10} {:>10} {:>12} {:>12}",
        "weights", "MB", "1 thread", "2 threads"
    );
    for ((name, model), r) in models.iter().zip(&mut rates) {
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        println!(
            "{name:<10} {:>10.1} {:>8.1} tok/s {:>6.1} tok/s",
            model.weight_bytes() as f64 / 1e6,
            median(&mut r[0]),
            median(&mut r[1])
        );
    }
    Ok(())
}
