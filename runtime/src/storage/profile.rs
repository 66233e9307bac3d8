//! Flash device profiles: the four numbers the flash model needs, built in for the devices the
//! project targets (sources in `PROFILES.md` beside this file) or read from a TOML file that
//! `leanstream probe-flash` writes.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// What the flash model reproduces of a device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlashProfile {
    /// Shown in reports.
    pub name: String,
    /// Latency of one 4 KiB read with nothing else in flight (queue depth 1), in µs.
    pub latency_us: f64,
    /// Random 4 KiB reads per second at a high queue depth.
    pub iops_4k: f64,
    /// Throughput of large (≈ 512 KiB) random reads, in MB/s (10^6 bytes per second).
    pub bandwidth_mb_s: f64,
    /// Reads the device serves at once.
    pub queue_depth: usize,
}

/// Names accepted by [`FlashProfile::builtin`].
pub const BUILTIN_PROFILES: [&str; 3] = ["ufs4", "ufs31", "nvme"];

impl FlashProfile {
    /// UFS 4.0 as PowerInfer-2 (arXiv 2406.06282) measured it on a OnePlus 12: 3.5 GB/s random at
    /// 512 KiB; 450 MB/s–1 GB/s random at 4 KiB, the low end over a wide address range like a
    /// model file's (450 MB/s / 4 KiB ≈ 110 000 IOPS); one command queue of 32 slots (UFSHCI).
    /// The 60 µs QD1 latency is an estimate (no public measurement found; see PROFILES.md).
    pub fn ufs4() -> Self {
        Self::new("ufs4", 60.0, 110_000.0, 3_500.0, 32)
    }

    /// UFS 3.1 as Samsung specifies its 512 GB eUFS 3.1 (press release, March 2020): 2 100 MB/s
    /// sequential read, 100 000 random-read IOPS. Large random reads are taken at 1 840 MB/s, the
    /// sequential figure scaled by UFS 4.0's measured random-512 KiB / sequential ratio (3.5/4.0).
    /// The 80 µs QD1 latency is an estimate (see PROFILES.md).
    pub fn ufs31() -> Self {
        Self::new("ufs31", 80.0, 100_000.0, 1_840.0, 32)
    }

    /// A desktop PCIe 3.0 x4 NVMe SSD, Samsung 970 EVO Plus 1 TB (vendor specification): 3 500 MB/s
    /// sequential read, 4 KiB random read 19 000 IOPS at QD1 (so ≈ 53 µs per read) and 600 000
    /// IOPS at QD32.
    pub fn nvme() -> Self {
        Self::new("nvme", 53.0, 600_000.0, 3_500.0, 32)
    }

    fn new(name: &str, latency_us: f64, iops_4k: f64, bandwidth_mb_s: f64, qd: usize) -> Self {
        Self {
            name: name.to_string(),
            latency_us,
            iops_4k,
            bandwidth_mb_s,
            queue_depth: qd,
        }
    }

    /// The built-in profile called `name`, if there is one.
    pub fn builtin(name: &str) -> Option<Self> {
        match name {
            "ufs4" => Some(Self::ufs4()),
            "ufs31" => Some(Self::ufs31()),
            "nvme" => Some(Self::nvme()),
            _ => None,
        }
    }

    /// Resolves a `--flash` value: `none` (the real disk, no emulation), a built-in name, or a
    /// TOML profile file.
    pub fn from_flash_arg(arg: &str) -> Result<Option<Self>> {
        if arg == "none" {
            return Ok(None);
        }
        if let Some(p) = Self::builtin(arg) {
            return Ok(Some(p));
        }
        let path = Path::new(arg);
        if path.exists() || arg.ends_with(".toml") {
            return Self::load(path).map(Some);
        }
        bail!(
            "unknown --flash value {arg:?}: expected none, {}, or a profile .toml file",
            BUILTIN_PROFILES.join(", ")
        )
    }

    /// Reads a TOML profile file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read flash profile {}", path.display()))?;
        Self::from_toml(&text).with_context(|| format!("bad flash profile {}", path.display()))
    }

    /// Parses and checks a TOML profile.
    pub fn from_toml(text: &str) -> Result<Self> {
        let profile: Self = toml::from_str(text)?;
        profile.validate()?;
        Ok(profile)
    }

    /// The profile as TOML, loadable with [`FlashProfile::from_toml`].
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a profile always serialises")
    }

    /// Rejects numbers the model cannot run with.
    pub fn validate(&self) -> Result<()> {
        for (field, value) in [
            ("latency_us", self.latency_us),
            ("iops_4k", self.iops_4k),
            ("bandwidth_mb_s", self.bandwidth_mb_s),
        ] {
            if !(value.is_finite() && value > 0.0) {
                bail!("{field} must be a positive number, not {value}");
            }
        }
        if !(1..=1024).contains(&self.queue_depth) {
            bail!("queue_depth must be 1..=1024, not {}", self.queue_depth);
        }
        if self.name.is_empty() {
            bail!("name must not be empty");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_are_valid_and_round_trip_through_toml() {
        for name in BUILTIN_PROFILES {
            let p = FlashProfile::builtin(name).unwrap();
            p.validate().unwrap();
            assert_eq!(FlashProfile::from_toml(&p.to_toml()).unwrap(), p);
        }
    }

    #[test]
    fn toml_accepts_integers_and_rejects_nonsense() {
        let ok = "name = \"x\"\nlatency_us = 90\niops_4k = 5000\nbandwidth_mb_s = 800\nqueue_depth = 8\n";
        assert_eq!(FlashProfile::from_toml(ok).unwrap().latency_us, 90.0);
        let zero = ok.replace("iops_4k = 5000", "iops_4k = 0");
        let err = FlashProfile::from_toml(&zero).unwrap_err().to_string();
        assert!(err.contains("iops_4k"), "{err}");
        let typo = ok.replace("latency_us", "latency");
        assert!(FlashProfile::from_toml(&typo).is_err());
    }

    #[test]
    fn flash_arg() {
        assert_eq!(FlashProfile::from_flash_arg("none").unwrap(), None);
        assert_eq!(
            FlashProfile::from_flash_arg("ufs31").unwrap(),
            Some(FlashProfile::ufs31())
        );
        let err = FlashProfile::from_flash_arg("ufs5")
            .unwrap_err()
            .to_string();
        assert!(err.contains("ufs4, ufs31, nvme"), "{err}");
    }
}
