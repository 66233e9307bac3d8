//! `leanstream bench` on a mixture of experts: leanstream (the next layer's router guesses its
//! experts), its ablation without look-ahead (each expert read when its layer routes), and the
//! expert oracle (each token's true experts read where leanstream reads guesses, Belady
//! retention: the limit with the same slots), each at every budget in a process of its own, all
//! decoding the resident run's greedy continuation of the prompt.

use std::path::Path;

use anyhow::{Context, Result};
use indicatif::ProgressBar;

use super::job::{Task, Variant};
use super::{tempdir, BenchArgs, Run, Runner};
use crate::platform::memory_size::{format_size, parse_size};
use crate::streaming::experts::{split_at_depth, ExpertTrace};
use crate::text::session::PolicyChoice;

/// The policies a mixture runs in the bench, in table order.
const POLICIES: [&str; 3] = ["leanstream", "leanstream-no-lookahead", "expert-oracle"];

fn variant(name: &str) -> Option<Variant> {
    let mut v = Variant::new(PolicyChoice::Leanstream);
    v.label = name.to_string();
    match name {
        "leanstream" => {}
        "leanstream-no-lookahead" => v.lookahead = false,
        "expert-oracle" => v.expert_oracle = true,
        _ => return None,
    }
    Some(v)
}

fn variants(names: &[String]) -> Result<Vec<Variant>> {
    let names: Vec<&str> = if names.iter().any(|n| n == "all") {
        POLICIES.to_vec()
    } else {
        names.iter().map(String::as_str).collect()
    };
    names
        .iter()
        .map(|n| {
            variant(n).with_context(|| {
                format!(
                    "policy {n:?} is not run on a mixture of experts: choose from {}",
                    POLICIES.join(", ")
                )
            })
        })
        .collect()
}

/// Budgets as bytes with their labels, smallest first: sizes, `min` (the planner's minimum) or
/// `ffn:P%` (every dense weight resident, the `2k` slots of one layer's reads and guesses, and P%
/// of all experts).
fn budgets(model: &Path, ctx: usize, specs: &[String]) -> Result<Vec<(u64, String)>> {
    let file = leanstream_format::LsbFile::open(model)?;
    let layers = file.meta.model.num_layers;
    let k = file
        .meta
        .model
        .moe
        .as_ref()
        .map_or(0, |m| m.experts_per_token);
    drop(file);
    let split = split_at_depth(model, ctx, Default::default(), layers, None)?;
    let mut out = Vec::new();
    for spec in specs.iter().map(|s| s.trim()) {
        let b = if spec == "min" {
            split.minimum
        } else if let Some(pct) = spec.strip_prefix("ffn:") {
            let p = super::ffn_percent(spec, pct)?;
            let slots = 2 * k as u64 + (split.experts as f64 * p / 100.0).round() as u64;
            split.fixed + slots * split.expert_bytes
        } else {
            parse_size(spec).with_context(|| format!("--memory {spec}"))?
        };
        out.push((b, format!("{spec} ({})", format_size(b))));
    }
    out.sort_by_key(|b| b.0);
    out.dedup_by_key(|b| b.0);
    Ok(out)
}

pub(super) fn run(args: &BenchArgs, prompt: Vec<u32>) -> Result<()> {
    let budgets = budgets(&args.model, args.ctx, &args.memory)?;
    let variants = variants(&args.policy)?;
    let repeat = args.repeat as usize;
    let bar = ProgressBar::new((1 + budgets.len() * variants.len() * repeat) as u64);
    let work = tempdir(&args.model)?;
    let runner = Runner {
        args,
        prompt: prompt.clone(),
        work: work.path.clone(),
        bar: &bar,
        moe: true,
    };
    bar.set_message("resident: the token sequence");
    let warmup = args.warmup;
    let sequence = runner.resident_sequence(warmup + args.tokens as usize)?;
    bar.set_message("resident: the experts of every token");
    let all: Vec<u32> = prompt.iter().chain(&sequence).copied().collect();
    let trace = ExpertTrace::record(&args.model, &all, args.ctx, Default::default())?;
    let path = runner.expert_trace_path();
    std::fs::write(&path, serde_json::to_vec(&trace)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    let mut outcomes = vec![Vec::new(); budgets.len() * variants.len()];
    for r in 0..repeat {
        for (b, (budget, label)) in budgets.iter().enumerate() {
            for (i, v) in variants.iter().enumerate() {
                bar.set_message(format!("{} at {label} (run {})", v.label, r + 1));
                let task = Task::Decode {
                    sequence: sequence.clone(),
                    warmup,
                    record: None,
                    reference: None,
                };
                outcomes[b * variants.len() + i].push(runner.execute(v, Some(*budget), task)?);
            }
        }
    }
    let mut runs = Vec::new();
    for (b, (budget, _)) in budgets.iter().enumerate() {
        for (i, v) in variants.iter().enumerate() {
            let all = std::mem::take(&mut outcomes[b * variants.len() + i]);
            runs.push(super::median_run(v, *budget, all));
        }
    }
    bar.finish_and_clear();
    if args.json {
        let obj = serde_json::json!({ "runs": runs });
        println!("{}", serde_json::to_string_pretty(&obj)?);
    } else {
        print_table(&runs, &budgets);
    }
    Ok(())
}

fn print_table(runs: &[Run], budgets: &[(u64, String)]) {
    println!(
        "{:<26} {:<26} {:>9} {:>8} {:>8} {:>10} {:>11} {:>9}",
        "policy", "budget", "tok/s", "hit", "recall", "experts/t", "MB read/t", "peak MiB"
    );
    let f = |r: &Run, k: &str| r.details.get(k).and_then(|v| v.as_f64());
    for (budget, label) in budgets {
        for r in runs
            .iter()
            .filter(|r| r.memory_budget_bytes == Some(*budget))
        {
            if let Some(e) = &r.error {
                println!("{:<26} {:<26} {e}", r.label, label);
                continue;
            }
            let cell = |v: Option<f64>, digits: usize| {
                v.map_or("-".to_string(), |v| format!("{v:.digits$}"))
            };
            println!(
                "{:<26} {:<26} {:>9.2} {:>8} {:>8} {:>10} {:>11.3} {:>9}",
                r.label,
                label,
                r.tokens_per_s,
                cell(f(r, "expert_hit_rate"), 3),
                cell(f(r, "expert_lookahead_recall"), 3),
                cell(f(r, "experts_read_per_token"), 2),
                r.bytes_read_per_token / 1e6,
                r.peak_rss_bytes
                    .map_or("-".to_string(), |b| format!("{:.1}", b as f64 / 1048576.0)),
            );
        }
    }
}
