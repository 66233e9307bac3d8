//! Without `--ctx`, a `--memory` too small for the default context shrinks the context (not below
//! 256 tokens) and says so; an explicit `--ctx` is never shrunk; a refused budget names the
//! `--kv`/`--ctx` that fit it.

use std::path::Path;
use std::process::{Command, Output};

use leanstream_tests::cli::{bin, stderr};
use leanstream_tests::converted::embedded_default;

fn run(file: &Path, extra: &[&str]) -> Output {
    Command::new(bin("leanstream"))
        .arg("run")
        .arg("--model")
        .arg(file)
        .args(["-p", "It was a fine morning", "-n", "4", "--temp", "0"])
        .args(["--flash", "ufs4", "--json"])
        .args(extra)
        .output()
        .unwrap()
}

/// The minimum the binary states when it refuses 1 MiB at `ctx`.
fn minimum(file: &Path, ctx: &str) -> u64 {
    let err = stderr(&run(file, &["--memory", "1MiB", "--ctx", ctx]));
    let size = err
        .split("below the minimum of ")
        .nth(1)
        .and_then(|r| r.split(" for").next())
        .unwrap_or_else(|| panic!("no minimum in {err}"));
    // Stated to 0.01 MiB.
    leanstream::platform::memory_size::parse_size(&size.replace(' ', "")).unwrap() + (16 << 10)
}

#[test]
fn a_budget_too_small_for_the_default_context_shrinks_it() {
    let dir = leanstream_tests::fresh_dir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("context-fit-{}", std::process::id()),
    );
    let file = embedded_default();
    // `run` defaults to 2048 tokens; the embedded model holds 1024.
    let (full, floor) = (minimum(&file, "1024"), minimum(&file, "256"));
    assert!(full > floor + (1 << 20), "{full} vs {floor}");
    let between = ((floor + full) / 2).to_string();
    let o = run(&file, &["--memory", &between]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ctx = v["ctx"].as_u64().unwrap();
    assert!(
        ctx > 256 && ctx < 1024 && ctx.is_multiple_of(64),
        "ctx {ctx}"
    );
    let note = format!("holds a context of {ctx} tokens, not the default 1024: using --ctx {ctx}");
    assert!(stderr(&o).contains(&note), "{}", stderr(&o));
    // Asked for explicitly, the context is kept and the budget refused.
    let o = run(&file, &["--memory", &between, "--ctx", "1024"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("at ctx 1024"), "{}", stderr(&o));
    // Below the floor's minimum: refused with that minimum.
    let o = run(&file, &["--memory", &(floor - (64 << 10)).to_string()]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("at ctx 256"), "{err}");
    // The refusal names flags that fit, and they do.
    let flags = err
        .split("or run with ")
        .nth(1)
        .unwrap_or_else(|| panic!("no fix named in {err}"));
    let flags: Vec<&str> = flags.split_whitespace().collect();
    // A leaner KV cache frees more than the 64 KiB missing; with it the context can be longer
    // than the floor.
    assert!(flags.ends_with(&["--kv", "q8_0"]), "{err}");
    let mut args = vec!["--memory".to_string(), (floor - (64 << 10)).to_string()];
    args.extend(flags.iter().map(|f| f.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = run(&file, &args);
    assert!(o.status.success(), "{}", stderr(&o));
    if let ["--ctx", ctx, ..] = flags[..] {
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["ctx"].to_string(), ctx, "{}", stderr(&o));
        assert!(ctx.parse::<u64>().unwrap() > 256, "{err}");
    }
    // Enough for the default: unchanged, no note.
    let o = run(&file, &["--memory", &full.to_string()]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["ctx"], 1024, "{}", stderr(&o));
    assert!(!stderr(&o).contains("holds a context"));
    std::fs::remove_dir_all(&dir).unwrap();
}
