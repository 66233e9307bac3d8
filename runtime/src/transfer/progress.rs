//! A progress bar over bytes, on stderr; hidden when asked or when stderr is not a terminal.

use indicatif::{ProgressBar, ProgressStyle};

/// A bar for `total` bytes labelled `what` (change the label with `set_prefix`).
pub fn bytes_bar(show: bool, total: u64, what: &str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix:>8} {bar:40} {bytes}/{total_bytes}  {bytes_per_sec}  (eta {eta})",
        )
        .expect("valid template"),
    );
    bar.set_prefix(what.to_string());
    bar
}

/// Megabytes (10⁶ bytes) per second, the unit transfer tools report.
pub fn mb_per_s(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / 1e6 / seconds.max(1e-9)
}
