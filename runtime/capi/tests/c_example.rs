//! The C API as an app uses it: `examples/generate.c` compiled with the system C compiler
//! against the checked-in header, linked to the shared and to the static library, run on the
//! embedded model. Its greedy text equals `leanstream run`'s; a bad path gives an error code and
//! a message naming the path. The header declares exactly the functions the library exports.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `target/<profile>`, where cargo put the libraries and the `leanstream` binary.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// A file cargo built: `cargo build` puts the libraries in `target/<profile>`, while
/// `cargo test` leaves them in `target/<profile>/deps` (only root units are copied up).
fn built(name: &str) -> PathBuf {
    let dir = target_dir();
    [dir.join("deps").join(name), dir.join(name)]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "{name} is missing from {}: run the tests with `cargo test --workspace`",
                dir.display()
            )
        })
}

fn scratch() -> PathBuf {
    let d = std::env::temp_dir().join(format!("leanstream-capi-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Compiles the example; `link` are the linker arguments naming the library.
fn compile(out: &Path, link: &[&str]) {
    let o = Command::new("cc")
        .arg(crate_dir().join("examples/generate.c"))
        .arg("-std=c99")
        .arg("-Wall")
        .arg("-Werror")
        .arg("-I")
        .arg(crate_dir().join("include"))
        .arg("-o")
        .arg(out)
        .args(link)
        .output()
        .expect("the system C compiler `cc` runs");
    assert!(
        o.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn text(o: &Output) -> String {
    assert!(
        o.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

const PROMPT: &str = "It is a truth universally acknowledged";

#[test]
fn the_c_example_writes_runs_text_and_reports_a_bad_path() {
    let shared_lib = built("libleanstream_c.so");
    let model = crate_dir().join("../../models/austen-relu");
    let run = Command::new(built("leanstream"))
        .arg("run")
        .arg("--model")
        .arg(&model)
        .args(["-p", PROMPT, "--temp", "0", "-n", "24"])
        .output()
        .unwrap();
    let expected = text(&run);
    assert!(expected.trim().len() > 20, "run wrote {expected:?}");

    let dir = scratch();
    let shared = dir.join("generate");
    let lib_dir = shared_lib.parent().unwrap();
    compile(
        &shared,
        &[
            "-L",
            lib_dir.to_str().unwrap(),
            "-lleanstream_c",
            &format!("-Wl,-rpath,{}", lib_dir.display()),
        ],
    );
    let static_exe = dir.join("generate-static");
    let archive = built("libleanstream_c.a");
    compile(
        &static_exe,
        &[archive.to_str().unwrap(), "-lpthread", "-ldl", "-lm"],
    );
    for exe in [&shared, &static_exe] {
        let o = Command::new(exe)
            // The rpath names the fresh library; cargo's LD_LIBRARY_PATH would put a stale one
            // left in target/release by an earlier build before it.
            .env_remove("LD_LIBRARY_PATH")
            .arg(&model)
            .args([PROMPT, "24"])
            .output()
            .unwrap();
        // ls_generate's text, then the token-level loop's: both `run`'s.
        assert_eq!(
            text(&o),
            format!("{expected}{expected}"),
            "{}",
            exe.display()
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("24 generated"), "{err}");
    }

    // A two-turn chat (SmolLM2 has a chat template): the first reply is `run --chat`'s.
    let smollm2 = std::env::var_os("LEANSTREAM_SMOLLM2")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/leanstream/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        smollm2.is_file(),
        "SmolLM2 is not at {}: run scripts/fetch-smollm2.sh",
        smollm2.display()
    );
    const QUESTION: &str = "What is the capital of France?";
    let run = Command::new(built("leanstream"))
        .arg("run")
        .arg("--model")
        .arg(&smollm2)
        .args(["--chat", "-p", QUESTION, "--temp", "0", "-n", "12"])
        .output()
        .unwrap();
    let first = text(&run);
    let o = Command::new(&shared)
        .env_remove("LD_LIBRARY_PATH")
        .arg("--chat")
        .arg(&smollm2)
        .args([QUESTION, "And of Italy?", "12"])
        .output()
        .unwrap();
    let replies = text(&o);
    let lines: Vec<&str> = replies.lines().collect();
    assert_eq!(lines.len(), 2, "{replies:?}");
    assert_eq!(format!("{}\n", lines[0]), first);
    assert!(!lines[1].trim().is_empty(), "{replies:?}");

    let missing = dir.join("no-such-model.lsb");
    let o = Command::new(&shared)
        .env_remove("LD_LIBRARY_PATH")
        .arg(&missing)
        .arg(PROMPT)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.starts_with("error 2: "), "{err}");
    assert!(err.contains("no-such-model.lsb"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The exported function names of `src`: `pub [unsafe] extern "C" fn NAME`.
fn exported(src: &str) -> Vec<String> {
    let mut names: Vec<String> = src
        .lines()
        .filter(|l| l.starts_with("pub "))
        .filter_map(|l| l.split("extern \"C\" fn ").nth(1))
        .filter(|rest| !rest.starts_with('('))
        .map(|rest| rest.split('(').next().unwrap().trim().to_string())
        .collect();
    names.sort();
    names
}

/// Every `ls_NAME(` in C text.
fn called(c: &str) -> Vec<String> {
    let ident = |ch: char| ch.is_ascii_alphanumeric() || ch == '_';
    let mut names: Vec<String> = c
        .match_indices("ls_")
        .filter(|(at, _)| !c[..*at].ends_with(ident))
        .filter_map(|(at, _)| {
            let rest = &c[at..];
            let end = rest.find(|ch: char| !ident(ch))?;
            rest[end..]
                .starts_with('(')
                .then(|| rest[..end].to_string())
        })
        .collect();
    names.sort();
    names
}

#[test]
fn the_header_declares_every_exported_function() {
    let src = std::fs::read_to_string(crate_dir().join("src/lib.rs")).unwrap();
    let header = std::fs::read_to_string(crate_dir().join("include/leanstream.h")).unwrap();
    let names = exported(&src);
    assert_eq!(names.len(), 21, "{names:?}");
    let mut declared = called(&header);
    declared.dedup();
    assert_eq!(
        declared, names,
        "the header is stale: run scripts/capi-header.sh"
    );
}
