//! Running the workspace's binaries from tests, and judging how they fail.

use std::path::PathBuf;
use std::process::Output;

pub use crate::converted::{bin, convert as quick_convert, workspace};

/// The embedded tiny model.
pub fn embedded_model() -> PathBuf {
    workspace().join("models/austen-relu")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
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
