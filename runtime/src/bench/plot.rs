//! The bench's picture: tokens/s versus memory budget, one line per policy, the all-in-DRAM
//! references as dashed horizontal lines. Plain SVG, viewable in any browser.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};

use super::report::Run;

const W: f64 = 760.0;
const H: f64 = 460.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 210.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
pub(super) const COLOURS: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

/// Writes the plot to `path`.
pub fn write(path: &Path, runs: &[Run], model: &Path) -> Result<()> {
    let name = model.file_name().unwrap_or(model.as_os_str());
    write_svg(path, &render(runs, &name.to_string_lossy()))
}

/// Writes an SVG to `path` through a temporary name, so a failed write leaves no half file.
pub(super) fn write_svg(path: &Path, svg: &str) -> Result<()> {
    let tmp = path.with_extension("svg.tmp");
    std::fs::write(&tmp, svg).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}

/// An SVG of `w` × `h` on white, `title` centred above the plot area that starts `left` from the
/// left edge and ends `right` from the right.
pub(super) fn svg_start(w: f64, h: f64, left: f64, right: f64, title: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
        (w - right + left) / 2.0,
        escape(title)
    );
    s
}

fn render(runs: &[Run], title: &str) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    // A swept prior policy ("powerinfer2(hot=0.5)") is one line: its best setting per budget.
    let group = |r: &Run| r.label.split('(').next().unwrap_or_default().to_string();
    let mut labels: Vec<String> = Vec::new();
    for r in runs {
        if !labels.contains(&group(r)) {
            labels.push(group(r));
        }
    }
    let budgeted = || {
        runs.iter()
            .filter_map(|r| Some((r.memory_budget_bytes?, r)))
    };
    let (mut x0, mut x1) = budgeted().fold((f64::MAX, 0.0f64), |(lo, hi), (b, _)| {
        (lo.min(b as f64 / MIB), hi.max(b as f64 / MIB))
    });
    if x0 > x1 {
        (x0, x1) = (0.0, 1.0);
    }
    let pad = ((x1 - x0) * 0.05).max(0.5);
    let (x0, x1) = (x0 - pad, x1 + pad);
    let y1 = nice_ceiling(runs.iter().map(|r| r.tokens_per_s).fold(1.0, f64::max) * 1.05);
    let px = |x: f64| LEFT + (x - x0) / (x1 - x0) * (W - LEFT - RIGHT);
    let py = |y: f64| H - BOTTOM - y / y1 * (H - TOP - BOTTOM);
    let mut s = svg_start(
        W,
        H,
        LEFT,
        RIGHT,
        &format!("tokens/s versus memory budget: {title}"),
    );
    // Axes and grid.
    for i in 0..=5 {
        let y = y1 * i as f64 / 5.0;
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" x2="{0}" y1="{1:.1}" y2="{1:.1}" stroke="#ddd"/><text x="{2}" y="{3:.1}" text-anchor="end">{4}</text>"##,
            W - RIGHT,
            py(y),
            LEFT - 6.0,
            py(y) + 4.0,
            trim(y)
        );
        let x = x0 + (x1 - x0) * i as f64 / 5.0;
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" x2="{0:.1}" y1="{1}" y2="{2}" stroke="#ddd"/><text x="{0:.1}" y="{3}" text-anchor="middle">{4}</text>"##,
            px(x),
            TOP,
            H - BOTTOM,
            H - BOTTOM + 18.0,
            trim(x)
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">memory budget (MiB)</text>"#,
        (W - RIGHT + LEFT) / 2.0,
        H - 18.0
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{0}" text-anchor="middle" transform="rotate(-90 18 {0})">tokens/s</text>"#,
        (H - BOTTOM + TOP) / 2.0
    );
    for (i, label) in labels.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let mut points: Vec<(f64, f64)> = Vec::new();
        for (b, r) in budgeted().filter(|(_, r)| group(r) == *label) {
            let x = b as f64 / MIB;
            match points.iter_mut().find(|p| p.0 == x) {
                Some(p) => p.1 = p.1.max(r.tokens_per_s),
                None => points.push((x, r.tokens_per_s)),
            }
        }
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        if points.is_empty() {
            // A reference without a budget: a dashed line across.
            if let Some(r) = runs.iter().find(|r| group(r) == *label) {
                let _ = writeln!(
                    s,
                    r#"<line x1="{LEFT}" x2="{0}" y1="{1:.1}" y2="{1:.1}" stroke="{colour}" stroke-dasharray="6 4"/>"#,
                    W - RIGHT,
                    py(r.tokens_per_s)
                );
            }
        } else {
            let path: Vec<String> = points
                .iter()
                .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
                path.join(" ")
            );
            for &(x, y) in &points {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}"/>"#,
                    px(x),
                    py(y)
                );
            }
        }
        let ly = TOP + 10.0 + 18.0 * i as f64;
        let lx = W - RIGHT + 15.0;
        let dash = if points.is_empty() {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" x2="{}" y1="{ly}" y2="{ly}" stroke="{colour}" stroke-width="2"{dash}/><text x="{}" y="{}">{}</text>"#,
            lx + 22.0,
            lx + 28.0,
            ly + 4.0,
            escape(label)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// The smallest 1, 2 or 5 × 10^k at or above `v`.
pub(super) fn nice_ceiling(v: f64) -> f64 {
    let mag = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|&c| c >= v)
        .unwrap_or(10.0 * mag)
}

pub(super) fn trim(v: f64) -> String {
    if v >= 100.0 || v.fract().abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::nice_ceiling;

    #[test]
    fn rounds_axis_tops_up_to_1_2_5() {
        assert_eq!(nice_ceiling(7.3), 10.0);
        assert_eq!(nice_ceiling(130.0), 200.0);
        assert_eq!(nice_ceiling(0.42), 0.5);
        assert_eq!(nice_ceiling(2.0), 2.0);
    }
}
