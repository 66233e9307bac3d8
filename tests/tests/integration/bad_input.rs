//! The bad-input catalogue: every way a user, a transfer or a disk can hand the two tools a broken
//! model or a bad argument ends in exit code 1 (runtime error) or 2 (usage error) with a message
//! that names the file and what is wrong — never a panic, never a wrong answer.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use leanstream_format::container::{checksum, SectionKind, PAGE};
use leanstream_format::LsbFile;
use leanstream_tests::cli::{assert_clean_failure, bin, embedded_model, stderr};
use rand::{RngCore, SeedableRng};

fn scratch() -> PathBuf {
    leanstream_tests::scratch_dir("leanstream-bad-input")
}

/// The embedded model, converted once (shared with the other tests, which only read it too).
fn converted() -> &'static Path {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(leanstream_tests::converted::embedded_default)
}

/// `leanstream run` on `model`: three greedy tokens.
fn run(model: &Path, extra: &[&str]) -> Output {
    Command::new(bin("leanstream"))
        .arg("run")
        .arg("--model")
        .arg(model)
        .args(["-p", "It was a fine morning", "-n", "3", "--temp", "0"])
        .args(["--ctx", "64", "--json"])
        .args(extra)
        .output()
        .unwrap()
}

fn prep<S: AsRef<OsStr>>(args: &[S]) -> Output {
    Command::new(bin("leanstream-prep"))
        .args(args)
        .output()
        .unwrap()
}

fn convert(model: &Path, out: &Path) -> Output {
    prep(&[
        OsStr::new("convert"),
        model.as_os_str(),
        OsStr::new("-o"),
        out.as_os_str(),
        OsStr::new("--calib-tokens"),
        OsStr::new("1024"),
        OsStr::new("--epochs"),
        OsStr::new("1"),
    ])
}

/// The text of a clean greedy run.
fn clean_text() -> &'static str {
    static TEXT: OnceLock<String> = OnceLock::new();
    TEXT.get_or_init(|| {
        let o = run(converted(), &[]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["text"].as_str().unwrap().to_string()
    })
}

/// Every tool that reads a model file fails cleanly on `file`, naming it.
fn every_reader_refuses(file: &Path, needles: &[&str]) {
    let name = file.file_name().unwrap().to_str().unwrap();
    let needles: Vec<&str> = [name].into_iter().chain(needles.iter().copied()).collect();
    let what = |tool: &str| format!("{tool} {name}");
    assert_clean_failure(&what("run"), &run(file, &[]), 1, &needles);
    for tool in ["verify", "inspect"] {
        let o = prep(&[OsStr::new(tool), file.as_os_str()]);
        assert_clean_failure(&what(tool), &o, 1, &needles);
    }
}

/// A copy of the converted file, changed by `edit`, named `name`.
fn damaged(name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(converted()).unwrap();
    edit(&mut bytes);
    let path = scratch().join(name);
    std::fs::write(&path, &bytes).unwrap();
    path
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

#[test]
fn empty_and_random_files_are_refused() {
    let dir = scratch();
    let mut gguf_garbage = b"GGUF\x03\x00\x00\x00".to_vec();
    gguf_garbage.extend(random_bytes(4096, 2));
    let mut lsb_garbage = leanstream_format::container::MAGIC.to_vec();
    lsb_garbage.extend(random_bytes(3 * 4096, 3));
    // Found by fuzzing: candle's reader divided by a zero general.alignment.
    let mut zero_alignment = b"GGUF\x03\x00\x00\x00".to_vec();
    zero_alignment.extend(0u64.to_le_bytes());
    zero_alignment.extend(1u64.to_le_bytes());
    zero_alignment.extend(17u64.to_le_bytes());
    zero_alignment.extend(b"general.alignment");
    zero_alignment.extend(4u32.to_le_bytes());
    zero_alignment.extend(0u32.to_le_bytes());
    for (name, bytes) in [
        ("empty.lsb", Vec::new()),
        ("zero-alignment.gguf", zero_alignment),
        ("random.bin", random_bytes(65536, 1)),
        ("garbage.gguf", gguf_garbage),
        ("garbage.lsb", lsb_garbage),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        every_reader_refuses(&path, &[]);
        let o = convert(&path, &dir.join("never.lsb"));
        assert_clean_failure(&format!("convert {name}"), &o, 1, &[name]);
        assert!(!dir.join("never.lsb").exists());
    }
}

#[test]
fn truncated_files_are_refused_at_any_length() {
    let len = std::fs::metadata(converted()).unwrap().len() as usize;
    let page = PAGE as usize;
    for cut in [
        0,
        5,
        8,
        100,
        page - 1,
        page,
        page + 1,
        len / 3,
        len / 2,
        len - page,
        len - 1,
    ] {
        let path = damaged(&format!("cut-{cut}.lsb"), |b| b.truncate(cut));
        every_reader_refuses(&path, &[]);
        std::fs::remove_file(&path).unwrap();
    }
}

/// Places to damage: the header, the middle of every index section, a dense tensor and a bundle
/// of every layer.
fn damage_sites(f: &LsbFile) -> Vec<(String, u64)> {
    let mut sites = vec![("header".to_string(), 20)];
    for s in &f.header.sections {
        let kind = SectionKind::from_u32(s.kind).unwrap();
        if kind != SectionKind::DenseData && kind != f.cluster_layout().ffn_data() {
            sites.push((kind.name().to_lowercase(), s.offset + s.length / 2));
        }
    }
    let t = &f.dense.tensors[f.dense.tensors.len() / 2];
    sites.push((format!("tensor {}", t.name), f.dense_extent(t).0 + 1));
    for l in 0..f.ffn.layers.len() {
        let c = f.ffn.layers[l].clusters.len() / 2;
        sites.push((
            format!("layer {l} cluster {c}"),
            f.cluster_extent(l, c).0 + 7,
        ));
    }
    sites
}

/// Whatever is damaged, `verify` names it; the runtime either stops with an error naming the file
/// or — when the damage lies in a bundle this prompt never reads, or in the input directions only
/// refine sparsity reads — gives the clean run's text; refine sparsity stops at damaged directions.
fn damage_is_caught(name: &str, site: &str, path: &Path) {
    let o = prep(&[OsStr::new("verify"), path.as_os_str()]);
    assert_clean_failure(&format!("verify, {site}"), &o, 1, &[name]);
    let directions = site == "input_basis";
    if directions {
        let o = run(path, &["--policy", "resident", "--sparsity", "refine"]);
        assert_clean_failure(&format!("run --sparsity refine, {site}"), &o, 1, &[name]);
    }
    for policy in ["resident", "leanstream"] {
        let o = run(path, &["--policy", policy]);
        let what = format!("run --policy {policy}, {site}");
        if o.status.success() {
            assert!(
                (policy == "leanstream" && site.contains("cluster")) || directions,
                "{what}: damage went unnoticed"
            );
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(v["text"], clean_text(), "{what}: a different answer");
        } else {
            assert_clean_failure(&what, &o, 1, &[name]);
        }
    }
}

#[test]
fn flipped_bits_are_caught_everywhere() {
    let f = LsbFile::open(converted()).unwrap();
    for (i, (site, at)) in damage_sites(&f).into_iter().enumerate() {
        let name = format!("flip-{i}.lsb");
        let path = damaged(&name, |b| b[at as usize] ^= 0x04);
        damage_is_caught(&name, &site, &path);
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn zeroed_pages_are_caught_everywhere() {
    let f = LsbFile::open(converted()).unwrap();
    for (i, (site, at)) in damage_sites(&f).into_iter().enumerate() {
        let name = format!("zeroed-{i}.lsb");
        let start = (at / PAGE * PAGE) as usize;
        let path = damaged(&name, |b| {
            assert!(b[start..start + PAGE as usize].iter().any(|&x| x != 0));
            b[start..start + PAGE as usize].fill(0);
        });
        damage_is_caught(&name, &site, &path);
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn a_newer_format_version_is_refused_with_the_fix() {
    let path = damaged("v2.lsb", |b| {
        b[8..10].copy_from_slice(&2u16.to_le_bytes());
        b[10..12].copy_from_slice(&0u16.to_le_bytes());
        let sum = checksum(&b[..PAGE as usize - 8]);
        b[PAGE as usize - 8..PAGE as usize].copy_from_slice(&sum.to_le_bytes());
    });
    every_reader_refuses(&path, &["format version 2.0", "convert the model again"]);
    std::fs::remove_file(&path).unwrap();
}

/// A copy of the embedded model directory, changed by `edit`.
fn broken_dir(name: &str, edit: impl FnOnce(&Path)) -> PathBuf {
    let dir = leanstream_tests::fresh_dir(&scratch(), name);
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(embedded_model().join(f), dir.join(f)).unwrap();
    }
    edit(&dir);
    dir
}

fn edit_config(dir: &Path, key: &str, value: serde_json::Value) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    v[key] = value;
    std::fs::write(&path, v.to_string()).unwrap();
}

#[test]
fn broken_model_directories_are_refused_by_both_tools() {
    let weights = |d: &Path| d.join("model.safetensors");
    let cases: Vec<(&str, PathBuf, Vec<&str>)> = vec![
        (
            "no config.json",
            broken_dir("no-config", |d| {
                std::fs::remove_file(d.join("config.json")).unwrap()
            }),
            vec!["config.json"],
        ),
        (
            "unsupported architecture",
            broken_dir("gpt2", |d| {
                edit_config(d, "architectures", serde_json::json!(["GPT2LMHeadModel"]))
            }),
            vec!["config.json", "GPT2LMHeadModel"],
        ),
        (
            "config disagrees with the tensors",
            broken_dir("wrong-shape", |d| {
                edit_config(d, "intermediate_size", serde_json::json!(2048))
            }),
            vec!["model.safetensors", "shape"],
        ),
        (
            "truncated safetensors",
            broken_dir("truncated-weights", |d| {
                let bytes = std::fs::read(weights(d)).unwrap();
                std::fs::write(weights(d), &bytes[..bytes.len() / 2]).unwrap();
            }),
            vec!["model.safetensors"],
        ),
        (
            "mis-typed safetensors",
            broken_dir("mistyped-weights", |d| {
                let mut bytes = std::fs::read(weights(d)).unwrap();
                // Same size per element, a type no model uses; the header stays valid JSON.
                let at = bytes.windows(6).position(|w| w == b"\"BF16\"").unwrap();
                bytes[at..at + 6].copy_from_slice(b"\"I16\" ");
                std::fs::write(weights(d), bytes).unwrap();
            }),
            vec!["model.safetensors", "I16"],
        ),
        (
            "index naming a missing shard",
            broken_dir("missing-shard", |d| {
                std::fs::rename(weights(d), d.join("model-00001-of-00002.safetensors")).unwrap();
                let index = serde_json::json!({"weight_map": {
                    "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                    "model.norm.weight": "model-00002-of-00002.safetensors",
                }});
                std::fs::write(d.join("model.safetensors.index.json"), index.to_string()).unwrap();
            }),
            vec!["model-00002-of-00002.safetensors"],
        ),
        (
            "malformed tokenizer.json",
            broken_dir("bad-tokenizer", |d| {
                std::fs::write(d.join("tokenizer.json"), "{\"model\": [1, 2").unwrap()
            }),
            vec!["tokenizer.json"],
        ),
    ];
    let out = scratch().join("from-broken.lsb");
    for (what, dir, needles) in cases {
        assert_clean_failure(&format!("run: {what}"), &run(&dir, &[]), 1, &needles);
        let o = convert(&dir, &out);
        assert_clean_failure(&format!("convert: {what}"), &o, 1, &needles);
        assert!(!out.exists(), "convert: {what}: wrote an output");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn bad_arguments_are_usage_or_runtime_errors() {
    let file = converted();
    let model = embedded_model();
    let leanstream = |args: &[&OsStr]| Command::new(bin("leanstream")).args(args).output().unwrap();
    let run_with = |extra: &[&OsStr]| {
        let mut args = vec![
            OsStr::new("run"),
            OsStr::new("--model"),
            file.as_os_str(),
            OsStr::new("-n"),
            OsStr::new("2"),
        ];
        args.extend(extra);
        leanstream(&args)
    };
    let s = OsStr::new;
    let not_utf8 = OsStr::from_bytes(b"caf\xe9");
    assert_clean_failure(
        "non-UTF-8 prompt",
        &run_with(&[s("-p"), not_utf8]),
        2,
        &["UTF-8"],
    );
    assert_clean_failure(
        "empty prompt",
        &run_with(&[s("-p"), s("")]),
        1,
        &["prompt is empty"],
    );
    assert_clean_failure(
        "-n 0",
        &run_with(&[s("-p"), s("x"), s("-n"), s("0")]),
        2,
        &["-n"],
    );
    let o = run_with(&[s("-p"), s("x"), s("--ctx"), s("100000")]);
    assert_clean_failure("--ctx too large", &o, 1, &["--ctx 100000", "1024"]);
    let o = run_with(&[s("-p"), s("x"), s("--memory"), s("0")]);
    assert_clean_failure("--memory 0", &o, 2, &["--memory"]);
    let o = run_with(&[s("-p"), s("x"), s("--memory"), s("1MiB")]);
    assert_clean_failure("--memory 1MiB", &o, 1, &["below the minimum"]);

    let text = scratch().join("latin1.txt");
    std::fs::write(&text, b"caf\xe9 au lait").unwrap();
    let ppl = |file: &Path| {
        leanstream(&[
            s("perplexity"),
            s("--model"),
            model.as_os_str(),
            s("--file"),
            file.as_os_str(),
        ])
    };
    assert_clean_failure("non-UTF-8 text", &ppl(&text), 1, &["latin1.txt", "UTF-8"]);
    let empty = scratch().join("empty.txt");
    std::fs::write(&empty, b"").unwrap();
    assert_clean_failure("empty text", &ppl(&empty), 1, &["empty.txt"]);
}

/// Makes `dir` unwritable, even for root where the file system allows it (`chattr +i`); returns
/// false when neither works.
fn make_read_only(dir: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o555)).unwrap();
    if std::fs::write(dir.join("probe"), b"").is_err() {
        return true;
    }
    let _ = std::fs::remove_file(dir.join("probe"));
    let chattr = Command::new("chattr").arg("+i").arg(dir).output();
    chattr.is_ok_and(|o| o.status.success()) && std::fs::write(dir.join("probe"), b"").is_err()
}

#[test]
fn outputs_into_missing_or_read_only_folders_fail_cleanly() {
    let model = embedded_model();
    let missing = scratch().join("no/such/folder/out.lsb");
    let o = convert(&model, &missing);
    assert_clean_failure("missing folder", &o, 1, &["no/such/folder"]);

    let dir = leanstream_tests::fresh_dir(&scratch(), "read-only");
    if !make_read_only(&dir) {
        panic!("cannot make a read-only folder here (neither chmod nor chattr +i works)");
    }
    let out = dir.join("out.lsb");
    let o = convert(&model, &out);
    let _ = Command::new("chattr").arg("-i").arg(&dir).output();
    assert_clean_failure("read-only folder", &o, 1, &["read-only"]);
    assert!(!out.exists());
}

/// `leanstream-prep inspect F | head`, `leanstream run … | head`: a reader that closes the pipe
/// before the tool prints ends the tool quietly, by SIGPIPE as `cat` would, not with a panic.
#[test]
fn a_reader_that_leaves_early_ends_the_tools_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let file = converted();
    let mut runs = [
        Command::new(bin("leanstream-prep")),
        Command::new(bin("leanstream")),
    ];
    runs[0].arg("inspect").arg(file);
    runs[1].arg("run").arg("--model").arg(file);
    runs[1].args(["-p", "It was a fine morning", "-n", "3", "--temp", "0"]);
    for cmd in &mut runs {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let o = cmd.stdout(writer).output().unwrap();
        let what = format!("{cmd:?}");
        assert!(!stderr(&o).contains("panicked"), "{what}: {}", stderr(&o));
        let signal = o.status.signal();
        assert_eq!(signal, Some(libc::SIGPIPE), "{what}: {:?}", o.status);
    }
}
