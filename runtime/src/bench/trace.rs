//! `--trace`: a per-token timeline of every run's device reads and decode steps in the Chrome
//! trace format (opens in Perfetto or chrome://tracing), one process per run, one thread per
//! device slot; with the decode step on the GPU (`LEANSTREAM_GPU=1`), one thread for the GPU's
//! submissions and one for the host's work between them.

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

/// The thread of the GPU's spans, and of the host's between them.
const GPU_TID: u64 = 10_000;
const HOST_TID: u64 = 10_001;

/// A run's spans of its decode step on the GPU, as [`run_events`] times them.
#[cfg(feature = "gpu")]
pub fn gpu_events(t0: Instant, spans: &[crate::gpu::GpuSpan]) -> Vec<Value> {
    use crate::gpu::SpanKind;
    let us = |t: Instant| t.saturating_duration_since(t0).as_secs_f64() * 1e6;
    spans
        .iter()
        .filter(|s| s.end > t0)
        .map(|s| {
            let (what, tid) = match s.what {
                SpanKind::Attention => ("attention", GPU_TID),
                SpanKind::Ffn => ("FFN from the pool", GPU_TID),
                SpanKind::Step => ("step", GPU_TID),
                SpanKind::Host => ("host", HOST_TID),
            };
            let name = match s.layer {
                Some(l) => format!("{what} {l}"),
                None => what.to_string(),
            };
            json!({"name": name, "cat": "gpu", "ph": "X", "tid": tid,
                   "ts": us(s.start), "dur": us(s.end) - us(s.start)})
        })
        .collect()
}

/// Writes the runs' events as one trace: `runs` holds each run's name and events.
pub fn write(path: &Path, runs: Vec<(String, Vec<Value>)>) -> Result<()> {
    let mut all = Vec::new();
    for (pid, (name, events)) in runs.into_iter().enumerate() {
        all.push(json!({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}));
        all.push(json!({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}));
        let mut tids: Vec<u64> = events.iter().filter_map(|e| e["tid"].as_u64()).collect();
        tids.push(0);
        tids.sort_unstable();
        tids.dedup();
        for tid in tids {
            let thread = match tid {
                0 => "decode".to_string(),
                GPU_TID => "GPU".to_string(),
                HOST_TID => "host between GPU submissions".to_string(),
                _ => format!("flash slot {}", tid - 1),
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
