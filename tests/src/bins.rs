//! The workspace's binaries as the end-to-end tests drive them.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A workspace binary, built by `cargo test --workspace` beside the running test's directory.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().unwrap().parent().unwrap().join(name);
    assert!(
        p.exists(),
        "{} is missing: run the tests with `cargo test --workspace`",
        p.display()
    );
    p
}

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `leanstream-prep convert` with CI-sized calibration (2048 tokens, 2 epochs, 8 KiB clusters);
/// `extra` adds or overrides flags.
pub fn convert(model: &Path, out: &Path, extra: &[&str]) {
    let o = Command::new(bin("leanstream-prep"))
        .arg("convert")
        .arg(model)
        .arg("-o")
        .arg(out)
        .args([
            "--calib-tokens",
            "2048",
            "--epochs",
            "2",
            "--cluster-kib",
            "8",
            "--json",
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
