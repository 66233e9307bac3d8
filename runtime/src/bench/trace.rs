//! `--trace`: a per-token timeline of every run's device reads and decode steps in the Chrome
//! trace format (opens in Perfetto or chrome://tracing), one process per run, one thread per
//! device slot.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::{json, Value};

use crate::storage::ReadSpan;

/// One run's events; times are microseconds from `t0`, the start of its measured decode.
pub fn run_events(t0: Instant, steps: &[(Instant, Instant)], reads: &[ReadSpan]) -> Vec<Value> {
    let us = |t: Instant| t.saturating_duration_since(t0).as_secs_f64() * 1e6;
    let mut events: Vec<Value> = steps
        .iter()
        .enumerate()
        .map(|(i, &(start, end))| {
            json!({"name": format!("token {i}"), "cat": "decode", "ph": "X", "tid": 0,
                   "ts": us(start), "dur": us(end) - us(start)})
        })
        .collect();
    events.extend(reads.iter().map(|r| {
        json!({"name": format!("read {} KiB", r.len / 1024), "cat": "read", "ph": "X",
               "tid": 1 + r.slot, "ts": us(r.start), "dur": us(r.end) - us(r.start),
               "args": {"offset": r.offset, "bytes": r.len, "merged_reads": r.parts}})
    }));
    events
}

/// Writes the runs' events as one trace: `runs` holds each run's name and events.
pub fn write(path: &Path, runs: Vec<(String, Vec<Value>)>) -> Result<()> {
    let mut all = Vec::new();
    for (pid, (name, events)) in runs.into_iter().enumerate() {
        all.push(json!({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}));
        all.push(json!({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}));
        let slots = events
            .iter()
            .filter_map(|e| e["tid"].as_u64())
            .max()
            .unwrap_or(0);
        for tid in 0..=slots {
            let thread = if tid == 0 {
                "decode".to_string()
            } else {
                format!("flash slot {}", tid - 1)
            };
            all.push(
                json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                            "args": {"name": thread}}),
            );
        }
        for mut e in events {
            e["pid"] = pid.into();
            all.push(e);
        }
    }
    let text = serde_json::to_vec(&json!({"traceEvents": all, "displayTimeUnit": "ms"}))?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}
