//! Running the workspace's binaries from tests, and judging how they fail.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A workspace binary, built by `cargo test --workspace` (or `cargo build`) next to the running
/// test's directory.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its path");
    let p = exe
        .parent()
        .and_then(Path::parent)
        .expect("tests run from target/<profile>/deps")
        .join(name);
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

/// The embedded tiny model.
pub fn embedded_model() -> PathBuf {
    workspace().join("models/austen-relu")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Converts `model` to `out` with a small calibration (seconds, not minutes); panics on failure.
pub fn quick_convert(model: &Path, out: &Path, extra: &[&str]) {
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
        .expect("leanstream-prep runs");
    assert!(o.status.success(), "convert failed: {}", stderr(&o));
}

/// Asserts that a command failed cleanly: exit code `code`, no panic, and a message on stderr
/// containing every one of `needles` (the file it is about, what is wrong).
pub fn assert_clean_failure(what: &str, o: &Output, code: i32, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(code),
        "{what}: exit status; stderr: {err}"
    );
    assert!(!err.contains("panicked"), "{what}: panicked: {err}");
    for n in needles {
        assert!(err.contains(n), "{what}: stderr lacks {n:?}: {err}");
    }
}
