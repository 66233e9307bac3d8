//! Every streaming policy side by side on one converted file, one token sequence and one budget:
//! `cargo run --release -p leanstream --example policy_table -- FILE.lsb [FFN_SHARE] [TOKENS]
//! [FLAG=VALUE...]`. The sequence is a prompt plus `resident`'s greedy continuation, fed one token
//! per call to every policy (so the oracle's trace holds for all of them); the budget is the
//! planner's minimum plus FFN_SHARE (default 0.25) of the FFN bundles, on the emulated UFS 4.0.
//! Extra `hot=F` / `window=K` arguments set powerinfer2's hot fraction and llm-in-flash's window.
//! (`leanstream bench` is the product's harness; this prints the policies' raw figures.)

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use leanstream::storage::FlashProfile;
use leanstream::streaming::neuron_cache::Retention;
use leanstream::streaming::{minimum_memory, ActiveTrace, Tuning};
use leanstream::text::generate::{generate, GenerateOptions};
use leanstream::text::sampler::SamplerConfig;
use leanstream::text::session::{PolicyChoice, Session, SessionOptions};

const CTX: usize = 256;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let file = PathBuf::from(
        args.first()
            .context("usage: policy_table FILE.lsb [FFN_SHARE] [TOKENS] [hot=F] [window=K]")?,
    );
    let share: f64 = args.get(1).map_or(Ok(0.25), |s| s.parse())?;
    let n: usize = args.get(2).map_or(Ok(100), |s| s.parse())?;
    let flag = |name: &str| {
        args.iter()
            .find_map(|a| a.strip_prefix(&format!("{name}=")).map(str::to_owned))
    };
    let base = Tuning {
        hot_fraction: flag("hot").map(|v| v.parse()).transpose()?,
        window: flag("window").map(|v| v.parse()).transpose()?,
        ..Tuning::default()
    };
    let open = |policy, memory: Option<u64>, tuning: Tuning| {
        let flash = if memory.is_some() {
            FlashProfile::from_flash_arg("ufs4")?
        } else {
            None
        };
        Session::open(
            &SessionOptions::new(&file, Some(policy))
                .memory(memory)
                .flash(flash)
                .ctx(CTX)
                .tuning(tuning),
        )
    };
    let mut resident = open(PolicyChoice::Resident, None, Tuning::default())?;
    let prompt = resident
        .tokenizer
        .encode("It was a fine morning, and Emma", true)?;
    let opts = GenerateOptions {
        max_tokens: n,
        ctx: CTX,
        sampler: SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        },
        eos_token_ids: vec![],
    };
    let tokenizer = resident.tokenizer.clone();
    let mut seq = prompt.clone();
    seq.extend(generate(resident.model(), &tokenizer, &prompt, &opts, |_| {})?.tokens);
    let trace = Arc::new(ActiveTrace::record(&file, &seq, CTX)?);
    let ffn = leanstream_format::LsbFile::open(&file)?.ffn.bundle_bytes();
    let budget = minimum_memory(&file, CTX)? + (share * ffn as f64) as u64;
    println!(
        "{} tokens, budget {budget} B (minimum + {:.0} % of the {ffn} B FFN), ufs4",
        seq.len(),
        100.0 * share
    );
    println!("| policy | tok/s | KiB read / token | reads / token | cache hit rate | active hit rate | read amplification | own recall | late reads |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let variant = |f: fn(&mut Tuning)| {
        let mut t = base.clone();
        f(&mut t);
        t
    };
    let runs: Vec<(&str, PolicyChoice, Tuning)> = vec![
        ("powerinfer2", PolicyChoice::PowerInfer2, base.clone()),
        ("llm-in-flash", PolicyChoice::LlmInFlash, base.clone()),
        ("leanstream", PolicyChoice::Leanstream, base.clone()),
        (
            "leanstream --no-lookahead",
            PolicyChoice::Leanstream,
            variant(|t| t.lookahead = false),
        ),
        (
            "leanstream --no-refine",
            PolicyChoice::Leanstream,
            variant(|t| t.refine = false),
        ),
        (
            "leanstream --no-cancel",
            PolicyChoice::Leanstream,
            variant(|t| t.cancel = false),
        ),
        (
            "leanstream --retain lru",
            PolicyChoice::Leanstream,
            variant(|t| t.retention = Retention::Lru),
        ),
        ("oracle", PolicyChoice::Oracle, base.clone()),
    ];
    for (name, policy, tuning) in runs {
        let tuning = Tuning {
            oracle: Some(trace.clone()),
            ..tuning
        };
        let mut s = open(policy, Some(budget), tuning)?;
        let model = s.model();
        let mut cache = model.new_cache(CTX);
        let start = Instant::now();
        for &t in &seq {
            model.forward(&[t], &mut cache, false)?;
        }
        let tok_s = seq.len() as f64 / start.elapsed().as_secs_f64();
        let r = s.report();
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {name} | {tok_s:.0} | {:.0} | {:.1} | {:.3} | {:.3} | {:.2} | {:.3} | {} |",
            f("bytes_read_per_token") / 1024.0,
            f("reads_per_token"),
            f("cache_hit_rate"),
            f("active_hit_rate"),
            f("read_amplification"),
            f("predictor_recall"),
            r["late_reads"]
        );
    }
    Ok(())
}
