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

/// The JSON a successful run printed; panics with its stderr when it failed.
pub fn json_output(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", stderr(o));
    serde_json::from_slice(&o.stdout).expect("one JSON object on stdout")
}

/// The size a message states right after `prefix` (a refusal's "below the minimum of 16.71 MiB
/// for ..."); panics naming the prefix when there is none.
pub fn stated_size(text: &str, prefix: &str) -> u64 {
    let size = text
        .split(prefix)
        .nth(1)
        .and_then(|r| r.split(" for").next())
        .unwrap_or_else(|| panic!("no {prefix:?} in {text}"));
    leanstream::platform::memory_size::parse_size(&size.replace(' ', "")).unwrap()
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
