//! `GET /metrics`: the runtime's figures (bytes read per token, cache hit rate, peak RSS, the
//! budget and its split...) and the server's counters, in Prometheus' text format so the usual
//! scrapers read them. The worker refreshes the runtime's part after each request; the HTTP thread
//! answers from that copy and never waits for a generation.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde_json::Value;

/// Counters shared by the HTTP thread and the worker.
#[derive(Default)]
pub struct ServerMetrics {
    pub requests: AtomicU64,
    pub rejected_queue_full: AtomicU64,
    pub bad_requests: AtomicU64,
    pub client_disconnects: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub reused_prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    /// The runtime's report (`run --json`'s figures) as of the last finished request.
    pub runtime: Mutex<Value>,
}

impl ServerMetrics {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// The text for `GET /metrics`; `waiting` is the queue's length now.
    pub fn render(&self, waiting: usize) -> String {
        let mut out = String::new();
        let counters = [
            ("requests_total", &self.requests),
            ("rejected_queue_full_total", &self.rejected_queue_full),
            ("bad_requests_total", &self.bad_requests),
            ("client_disconnects_total", &self.client_disconnects),
            ("prompt_tokens_total", &self.prompt_tokens),
            ("reused_prompt_tokens_total", &self.reused_prompt_tokens),
            ("completion_tokens_total", &self.completion_tokens),
        ];
        for (name, c) in counters {
            let _ = writeln!(out, "# TYPE leanstream_{name} counter");
            let _ = writeln!(out, "leanstream_{name} {}", c.load(Ordering::Relaxed));
        }
        let _ = writeln!(out, "leanstream_queue_waiting {waiting}");
        let runtime = self.runtime.lock().unwrap_or_else(|e| e.into_inner());
        gauges(&mut out, "leanstream", &runtime);
        out
    }
}

/// One gauge per number in `v`, nested objects' keys joined with `_`; text values become labels
/// of an info gauge (`leanstream_info{policy="leanstream"} 1`).
fn gauges(out: &mut String, prefix: &str, v: &Value) {
    let Value::Object(map) = v else { return };
    let mut labels = Vec::new();
    for (key, value) in map {
        let name = format!("{prefix}_{key}");
        match value {
            Value::Number(n) => {
                let _ = writeln!(out, "{name} {n}");
            }
            Value::Bool(b) => {
                let _ = writeln!(out, "{name} {}", u8::from(*b));
            }
            Value::String(s) => labels.push(format!("{key}=\"{}\"", s.replace(['"', '\\'], "_"))),
            Value::Object(_) => gauges(out, &name, value),
            Value::Array(_) | Value::Null => {}
        }
    }
    if !labels.is_empty() {
        let _ = writeln!(out, "{prefix}_info{{{}}} 1", labels.join(","));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_nest_and_text_becomes_labels() {
        let m = ServerMetrics::default();
        ServerMetrics::add(&m.requests, 3);
        *m.runtime.lock().unwrap() = serde_json::json!({
            "policy": "leanstream",
            "cache_hit_rate": 0.5,
            "memory_split": {"kv_bytes": 10},
            "exact": true,
        });
        let text = m.render(2);
        for line in [
            "leanstream_requests_total 3",
            "leanstream_queue_waiting 2",
            "leanstream_cache_hit_rate 0.5",
            "leanstream_memory_split_kv_bytes 10",
            "leanstream_exact 1",
            "leanstream_info{policy=\"leanstream\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from:\n{text}"
            );
        }
    }
}
