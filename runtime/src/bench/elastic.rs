//! `bench --elastic`: one `leanstream` run whose budget steps through the given values while it
//! decodes the shared token sequence (`--step-tokens` tokens at each), as a phone's OS takes memory
//! back and gives it again. Every token's time, the process's resident set (from the OS) and the
//! budget in force are recorded; the result is a table, JSON and a plot of RSS and tokens/s over
//! time. The run is exact when each step's most likely token is the sequence's (`resident`'s
//! greedy continuation).

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use serde::{Deserialize, Serialize};

use super::plot::{nice_ceiling, svg_start, trim, write_svg, COLOURS};
use crate::model::kv_cache::KvCache;
use crate::platform::memory::current_rss_bytes;
use crate::platform::memory_size::format_size;
use crate::text::sampler::argmax;
use crate::text::session::Session;

/// One decoded token.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Point {
    /// Seconds from the first measured token's start to this token's end.
    pub t_s: f64,
    /// This token's decode time, budget change included.
    pub step_ms: f64,
    /// The process's resident set right after the token (from the OS).
    pub rss_bytes: u64,
    pub budget_bytes: u64,
}

/// The worker's part: decodes `sequence` after the warm-up steps, taking `budgets[i]` before
/// its `step_tokens` tokens. Returns every token's point and whether every step's most likely
/// token was the sequence's next one.
pub fn decode(
    session: &mut Session,
    cache: &mut KvCache,
    logits: &mut Vec<f32>,
    sequence: &[u32],
    warmup: usize,
    budgets: &[u64],
    step_tokens: usize,
) -> Result<(Vec<Point>, bool)> {
    let mut points = Vec::with_capacity(sequence.len() - warmup);
    let mut exact = true;
    let t0 = Instant::now();
    for (i, w) in sequence[warmup..].windows(2).enumerate() {
        let budget = budgets[(i / step_tokens).min(budgets.len() - 1)];
        let start = Instant::now();
        if i % step_tokens == 0 {
            session.set_memory_budget(budget)?;
        }
        session
            .model()
            .forward_into(&[w[0]], cache, false, logits)?;
        let end = Instant::now();
        exact &= argmax(logits) == w[1];
        points.push(Point {
            t_s: (end - t0).as_secs_f64(),
            step_ms: (end - start).as_secs_f64() * 1e3,
            rss_bytes: current_rss_bytes().unwrap_or(0),
            budget_bytes: budget,
        });
    }
    Ok((points, exact))
}

/// Tokens/s over a window of this many tokens.
const RATE_WINDOW: usize = 8;

/// Each token's rate: tokens over the time of the `RATE_WINDOW` tokens ending with it.
fn rates(points: &[Point]) -> Vec<f64> {
    (0..points.len())
        .map(|i| {
            let from = i.saturating_sub(RATE_WINDOW - 1);
            let ms: f64 = points[from..=i].iter().map(|p| p.step_ms).sum();
            (i + 1 - from) as f64 / (ms / 1e3).max(1e-9)
        })
        .collect()
}

/// Per budget step: the budget, tokens/s over the step, the largest RSS seen in it, and the
/// first token's time (which includes taking the budget).
pub fn print_table(points: &[Point], step_tokens: usize) {
    println!(
        "{:>12} {:>8} {:>14} {:>16}",
        "budget", "tok/s", "max RSS", "first token ms"
    );
    for step in points.chunks(step_tokens) {
        let ms: f64 = step.iter().map(|p| p.step_ms).sum();
        let rss = step.iter().map(|p| p.rss_bytes).max().unwrap_or(0);
        println!(
            "{:>12} {:>8.1} {:>14} {:>16.2}",
            format_size(step[0].budget_bytes),
            step.len() as f64 / (ms / 1e3).max(1e-9),
            format_size(rss),
            step[0].step_ms
        );
    }
}

/// Each budget change the run took (`budget_changes` of its report): the time from the request to
/// the memory returned, the resident set right after and which dense weights stream.
pub fn print_changes(changes: &serde_json::Value) {
    let Some(changes) = changes.as_array() else {
        return;
    };
    println!(
        "{:>12} {:>12} {:>10} {:>12}  dense weights streaming",
        "from", "to", "ms", "RSS after"
    );
    let size = |v: &serde_json::Value| v.as_u64().map_or("-".into(), format_size);
    for c in changes {
        let d = &c["dense_streamed"];
        let parts: Vec<&str> = ["attention", "head", "embedding"]
            .into_iter()
            .filter(|p| d[*p] == true)
            .collect();
        println!(
            "{:>12} {:>12} {:>10.2} {:>12}  {}",
            size(&c["from"]),
            size(&c["to"]),
            c["micros"].as_f64().unwrap_or(0.0) / 1e3,
            size(&c["rss_after"]),
            if parts.is_empty() {
                "none".to_string()
            } else {
                parts.join(", ")
            }
        );
    }
}

const W: f64 = 760.0;
const H: f64 = 520.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 40.0;
/// The two panels: RSS and budget above, tokens/s below.
const PANEL: f64 = 190.0;
const GAP: f64 = 60.0;

/// Writes the plot to `path`.
pub fn write_plot(path: &Path, points: &[Point], title: &str) -> Result<()> {
    write_svg(path, &render(points, title))
}

fn render(points: &[Point], title: &str) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    let x1 = points.last().map_or(1.0, |p| p.t_s).max(1e-3);
    let px = |t: f64| LEFT + t / x1 * (W - LEFT - RIGHT);
    // A multiple of 4 (whole grid lines), not 1, 2 or 5 × 10^k: budgets differ by a few MiB, and a
    // ceiling twice their size would flatten the steps.
    let mib_top = (points
        .iter()
        .map(|p| p.rss_bytes.max(p.budget_bytes) as f64 / MIB)
        .fold(1.0, f64::max)
        * 1.05
        / 4.0)
        .ceil()
        * 4.0;
    let rates = rates(points);
    let rate_top = nice_ceiling(rates.iter().copied().fold(1.0, f64::max) * 1.05);
    let panel_y = |top: f64, v: f64, max: f64| top + PANEL - v / max * PANEL;
    let lower = TOP + PANEL + GAP;
    let mut s = svg_start(W, H, LEFT, RIGHT, title);
    for (top, max, label) in [(TOP, mib_top, "MiB"), (lower, rate_top, "tokens/s")] {
        for i in 0..=4 {
            let v = max * i as f64 / 4.0;
            let y = panel_y(top, v, max);
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT}" x2="{0}" y1="{y:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{1}" y="{2:.1}" text-anchor="end">{3}</text>"##,
                W - RIGHT,
                LEFT - 6.0,
                y + 4.0,
                trim(v)
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="18" y="{0}" text-anchor="middle" transform="rotate(-90 18 {0})">{label}</text>"#,
            top + PANEL / 2.0
        );
        for i in 0..=5 {
            let t = x1 * i as f64 / 5.0;
            let _ = writeln!(
                s,
                r##"<line x1="{0:.1}" x2="{0:.1}" y1="{top}" y2="{1}" stroke="#ddd"/><text x="{0:.1}" y="{2}" text-anchor="middle">{3}</text>"##,
                px(t),
                top + PANEL,
                top + PANEL + 16.0,
                trim(t)
            );
        }
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">seconds</text>"#,
        (W - RIGHT + LEFT) / 2.0,
        H - 8.0
    );
    let line = |s: &mut String, pts: Vec<(f64, f64)>, colour: &str, dash: &str| {
        let path: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>"#,
            path.join(" ")
        );
    };
    // The budget as steps: it changes at the start of a token.
    let mut budget = Vec::new();
    let mut prev_t = 0.0;
    for p in points {
        let y = panel_y(TOP, p.budget_bytes as f64 / MIB, mib_top);
        budget.push((px(prev_t), y));
        budget.push((px(p.t_s), y));
        prev_t = p.t_s;
    }
    line(&mut s, budget, COLOURS[1], r#" stroke-dasharray="6 4""#);
    let rss = points
        .iter()
        .map(|p| (px(p.t_s), panel_y(TOP, p.rss_bytes as f64 / MIB, mib_top)))
        .collect();
    line(&mut s, rss, COLOURS[0], "");
    let rate = points
        .iter()
        .zip(&rates)
        .map(|(p, &r)| (px(p.t_s), panel_y(lower, r, rate_top)))
        .collect();
    line(&mut s, rate, COLOURS[2], "");
    for (i, (label, colour, dash)) in [
        ("budget", COLOURS[1], r#" stroke-dasharray="6 4""#),
        ("resident set (RSS)", COLOURS[0], ""),
    ]
    .iter()
    .enumerate()
    {
        let (lx, ly) = (W - RIGHT - 190.0, TOP + 12.0 + 16.0 * i as f64);
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" x2="{}" y1="{ly}" y2="{ly}" stroke="{colour}" stroke-width="2"{dash}/><text x="{}" y="{}">{label}</text>"#,
            lx + 22.0,
            lx + 28.0,
            ly + 4.0
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="end">tokens/s over {RATE_WINDOW} tokens</text>"#,
        W - RIGHT - 4.0,
        lower + 14.0
    );
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(step_ms: f64) -> Point {
        Point {
            t_s: 0.0,
            step_ms,
            rss_bytes: 0,
            budget_bytes: 0,
        }
    }

    #[test]
    fn rates_average_over_the_window_ending_at_each_token() {
        let mut points = vec![point(10.0); RATE_WINDOW];
        points.push(point(90.0));
        let r = rates(&points);
        assert!((r[0] - 100.0).abs() < 1e-9);
        assert!((r[RATE_WINDOW - 1] - 100.0).abs() < 1e-9);
        // The last window: 7 tokens of 10 ms and one of 90 ms.
        let want = RATE_WINDOW as f64 / ((10.0 * (RATE_WINDOW - 1) as f64 + 90.0) / 1e3);
        assert!((r[RATE_WINDOW] - want).abs() < 1e-9, "{}", r[RATE_WINDOW]);
    }
}
