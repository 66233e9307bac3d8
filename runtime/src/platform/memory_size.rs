//! Memory sizes as users write them: `512MiB`, `1.5GiB`, `300MB` (10^6 bytes), or plain bytes.

use anyhow::{bail, Result};

/// Parses a size; binary units (`KiB`, `MiB`, `GiB`, `TiB`) are powers of 1024, decimal ones
/// (`KB`, `MB`, `GB`, `TB`) powers of 1000. Case-insensitive; fractions allowed.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = match num.parse() {
        Ok(v) if num.chars().next().is_some_and(|c| c.is_ascii_digit()) => v,
        _ => bail!("{s:?} is not a size: write e.g. 512MiB, 1.5GiB, 300MB or a number of bytes"),
    };
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" | "k" => 1e3,
        "mb" | "m" => 1e6,
        "gb" | "g" => 1e9,
        "tb" | "t" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0f64.powi(4),
        other => bail!("unknown size unit {other:?} in {s:?}: use B, KB, MB, GB, KiB, MiB or GiB"),
    };
    let bytes = value * mult;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        bail!("{s:?} is too large");
    }
    Ok(bytes.round() as u64)
}

/// A `--memory` value: a positive size (for clap's `value_parser`).
pub fn parse_budget(s: &str) -> std::result::Result<u64, String> {
    match parse_size(s) {
        Ok(0) => Err("the budget must be positive".into()),
        Ok(v) => Ok(v),
        Err(e) => Err(e.to_string()),
    }
}

/// A size for people: `1.50 GiB`, `12.3 MiB`, `512 B`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.2} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("300MB").unwrap(), 300_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("2 gib").unwrap(), 2 << 30);
        for bad in ["", "MiB", "-5MiB", "1.2.3GB", "12 parsecs", "0x10"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn formats() {
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(3 << 29), "1.50 GiB");
    }
}
