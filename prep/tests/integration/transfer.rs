//! From workstation to device on the embedded model: `leanstream-prep pack` → `leanstream unpack`
//! round trips byte for byte; damaged archives are refused and leave nothing behind; `verify` of
//! both binaries agrees; `push` works and fails clearly with stand-in `adb`, `scp` and `ssh`
//! scripts on PATH whose "device" is a folder of this machine.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use leanstream_format::archive::{write_archive, Manifest, PackOptions, ARCHIVE_VERSION};
use leanstream_format::LsbFile;

fn scratch() -> PathBuf {
    leanstream_tests::scratch_dir("leanstream-transfer")
}

/// The `leanstream` binary, built next to `leanstream-prep` by `cargo test --workspace` (or
/// `cargo build --release -p leanstream`).
fn leanstream_bin() -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_leanstream-prep")).with_file_name("leanstream");
    assert!(
        p.exists(),
        "{} is missing: run the tests with `cargo test --workspace`",
        p.display()
    );
    p
}

fn run(bin: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(bin)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("the binary runs")
}

fn prep(args: &[&str]) -> Output {
    run(Path::new(env!("CARGO_BIN_EXE_leanstream-prep")), args, &[])
}

fn leanstream(args: &[&str]) -> Output {
    run(&leanstream_bin(), args, &[])
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", stderr(o));
    serde_json::from_slice(&o.stdout).expect("stdout is one JSON object")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The embedded model, converted once for this test binary.
fn embedded() -> &'static PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/austen-relu");
        let out = scratch().join("austen.lsb");
        let o = prep(&[
            "convert",
            s(&model),
            "-o",
            s(&out),
            "--calib-tokens",
            "2048",
            "--epochs",
            "1",
            "--json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        out
    })
}

/// The embedded model's archive, packed once.
fn archive() -> &'static PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let out = scratch().join("austen.lsb.zst");
        let v = json(&prep(&[
            "pack",
            s(embedded()),
            "-o",
            s(&out),
            "--threads",
            "2",
            "--json",
        ]));
        let len = std::fs::metadata(embedded()).unwrap().len();
        assert_eq!(v["bytes"], len);
        assert_eq!(v["archive_bytes"], std::fs::metadata(&out).unwrap().len());
        assert_eq!(v["name"], "austen.lsb");
        // The packed file's own version (the converter's split clusters make it 1.6).
        let header = leanstream_format::LsbFile::open(embedded()).unwrap().header;
        let version = format!(
            "LeanStream {}.{}",
            header.version_major, header.version_minor
        );
        assert_eq!(v["format"], version.as_str());
        // q8 weights and f32 predictors still compress (the zero padding and the scales do).
        let ratio = v["ratio"].as_f64().unwrap();
        assert!(ratio > 1.05 && ratio < 10.0, "ratio {ratio}");
        out
    })
}

/// Names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn pack_unpack_round_trip_is_byte_identical() {
    let dir = leanstream_tests::fresh_dir(&scratch(), "round-trip");
    let out = dir.join("restored.lsb");
    let v = json(&leanstream(&[
        "unpack",
        s(archive()),
        "-o",
        s(&out),
        "--json",
    ]));
    assert_eq!(v["name"], "austen.lsb");
    assert!(std::fs::read(&out).unwrap() == std::fs::read(embedded()).unwrap());
    assert!(v["peak_rss_bytes"].as_u64().unwrap() > 0);

    // An existing output is kept unless --force.
    std::fs::write(&out, b"the user's file").unwrap();
    let o = leanstream(&["unpack", s(archive()), "-o", s(&out)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("already exists") && stderr(&o).contains("--force"));
    assert_eq!(std::fs::read(&out).unwrap(), b"the user's file");
    json(&leanstream(&[
        "unpack",
        s(archive()),
        "-o",
        s(&out),
        "--force",
        "--json",
    ]));
    assert!(std::fs::read(&out).unwrap() == std::fs::read(embedded()).unwrap());

    // Without -o, or with a folder, the manifest's name is used.
    let copy = dir.join("copy.zst");
    std::fs::copy(archive(), &copy).unwrap();
    let o = leanstream(&["unpack", s(&copy)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let sub = leanstream_tests::fresh_dir(&dir, "sub");
    json(&leanstream(&["unpack", s(&copy), "-o", s(&sub), "--json"]));
    for f in [dir.join("austen.lsb"), sub.join("austen.lsb")] {
        assert!(std::fs::read(&f).unwrap() == std::fs::read(embedded()).unwrap());
    }
    assert_eq!(
        listing(&dir),
        ["austen.lsb", "copy.zst", "restored.lsb", "sub"]
    );
}

/// Unpacks `bad` into a fresh folder: refused, the error names the archive, nothing is left.
fn assert_refused(bad: &Path, what: &str) -> String {
    let dir = leanstream_tests::fresh_dir(&scratch(), "refused");
    let out = dir.join("out.lsb");
    let o = leanstream(&["unpack", s(bad), "-o", s(&out)]);
    assert_eq!(o.status.code(), Some(1), "{what}: {}", stderr(&o));
    assert!(stderr(&o).contains(s(bad)), "{what}: {}", stderr(&o));
    assert!(listing(&dir).is_empty(), "{what}: left {:?}", listing(&dir));
    stderr(&o)
}

#[test]
fn corrupted_or_truncated_archives_are_refused_and_leave_nothing() {
    let good = std::fs::read(archive()).unwrap();
    let bad = scratch().join("bad.lsb.zst");
    let len = good.len();
    for off in [0, 5, 20, 60, len / 3, len / 2, len - 30, len - 9, len - 1] {
        let mut bytes = good.clone();
        bytes[off] ^= 0x10;
        std::fs::write(&bad, &bytes).unwrap();
        assert_refused(&bad, &format!("flip at {off}"));
    }
    for cut in [0, 7, 100, len / 2, len - 16, len - 1] {
        std::fs::write(&bad, &good[..cut]).unwrap();
        let err = assert_refused(&bad, &format!("cut at {cut}"));
        assert!(
            err.contains("truncated") || err.contains("not a LeanStream archive"),
            "cut at {cut}: {err}"
        );
    }
    // Intact archive framing around a damaged LeanStream file: unpack's `verify` refuses it.
    let mut lsb = std::fs::read(embedded()).unwrap();
    let f = LsbFile::open(embedded()).unwrap();
    let (off, _) = f.cluster_extent(1, 2);
    lsb[off as usize + 7] ^= 1;
    let manifest = Manifest {
        archive_version: ARCHIVE_VERSION,
        format: "LeanStream 1.0".into(),
        name: "austen.lsb".into(),
        size: lsb.len() as u64,
    };
    let mut packed = Vec::new();
    let opts = PackOptions {
        level: 3,
        threads: 1,
    };
    let p = Path::new("memory");
    write_archive(
        (&mut &lsb[..], p),
        (&mut packed, p),
        &manifest,
        &opts,
        |_, _| {},
    )
    .unwrap();
    std::fs::write(&bad, &packed).unwrap();
    let err = assert_refused(&bad, "damaged content");
    assert!(
        err.contains("fails verification") && err.contains("layer 1 cluster 2"),
        "{err}"
    );
    // Not an archive at all.
    let err = assert_refused(embedded(), "an .lsb file");
    assert!(err.contains("not a LeanStream archive"), "{err}");
}

#[test]
fn pack_refuses_what_is_not_a_leanstream_file() {
    let not = scratch().join("notes.txt");
    std::fs::write(&not, b"hello").unwrap();
    let out = scratch().join("notes.zst");
    let o = prep(&["pack", s(&not), "-o", s(&out)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("notes.txt") && stderr(&o).contains("not a LeanStream file"));
    assert!(!out.exists());
    let o = prep(&["pack", s(embedded()), "--level", "22"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

#[test]
fn verify_of_both_binaries_agrees() {
    let good = std::fs::read(embedded()).unwrap();
    let f = LsbFile::open(embedded()).unwrap();
    let dense = f.dense_extent(&f.dense.tensors[3]).0 as usize;
    let cluster = f.cluster_extent(3, 0).0 as usize;
    let meta = f.header.sections[2].offset as usize;
    let dir = leanstream_tests::fresh_dir(&scratch(), "verify");
    let mut cases = vec![("good.lsb", good.clone())];
    for (name, off) in [
        ("header.lsb", 30),
        ("dense.lsb", dense + 5),
        ("cluster.lsb", cluster + 100),
        ("meta.lsb", meta + 1),
        ("padding.lsb", good.len() - 1),
    ] {
        let mut b = good.clone();
        b[off] ^= 0x40;
        cases.push((name, b));
    }
    cases.push(("short.lsb", good[..good.len() - 4096].to_vec()));
    for (name, bytes) in cases {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let a = prep(&["verify", s(&path), "--json"]);
        let b = leanstream(&["verify", s(&path), "--json"]);
        assert_eq!(a.status.code(), b.status.code(), "{name}");
        assert_eq!(
            a.status.code(),
            Some(if name == "good.lsb" { 0 } else { 1 })
        );
        let (va, vb): (serde_json::Value, serde_json::Value) = (
            serde_json::from_slice(&a.stdout).unwrap(),
            serde_json::from_slice(&b.stdout).unwrap(),
        );
        assert_eq!(va["ok"], vb["ok"], "{name}");
        assert_eq!(va["error"], vb["error"], "{name}");
        assert_eq!(va["bytes"], vb["bytes"], "{name}");
        if name != "good.lsb" {
            assert!(stderr(&b).contains(name), "{}", stderr(&b));
        }
    }
    let err = stderr(&leanstream(&["verify", s(&dir.join("cluster.lsb"))]));
    assert!(err.contains("layer 3 cluster 0"), "{err}");
}

/// Stand-ins for the transfer tools in a fresh `bin` folder; with `with_leanstream` the
/// "device" has the real `leanstream` on its PATH. `FAKE_FULL=1` makes copies fail as on a full
/// device; each tool logs its arguments to `$FAKE_LOG`.
fn stand_ins(name: &str, with_leanstream: bool) -> PathBuf {
    let bin = leanstream_tests::fresh_dir(&scratch(), name);
    let scripts = [
        (
            "adb",
            r#"echo "adb $*" >> "$FAKE_LOG"
if [ "$1" = "-s" ]; then shift 2; fi
cmd=$1; shift
case "$cmd" in
push)
  if [ -n "$FAKE_FULL" ]; then
    echo "adb: error: failed to copy '$1' to '$2': remote write failed: No space left on device" >&2
    exit 1
  fi
  cp "$1" "$2" && echo "$1: 1 file pushed, 0 skipped." ;;
shell) exec sh -c "$*" ;;
*) echo "adb stand-in: no command $cmd" >&2; exit 1 ;;
esac"#,
        ),
        (
            "scp",
            r#"echo "scp $*" >> "$FAKE_LOG"
if [ -n "$FAKE_FULL" ]; then echo "scp: ${2#*:}: No space left on device" >&2; exit 1; fi
exec cp "$1" "${2#*:}""#,
        ),
        (
            "ssh",
            r#"echo "ssh $*" >> "$FAKE_LOG"
shift
exec sh -c "$*""#,
        ),
    ];
    for (tool, body) in scripts {
        let path = bin.join(tool);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    if with_leanstream {
        std::os::unix::fs::symlink(leanstream_bin(), bin.join("leanstream")).unwrap();
    }
    bin
}

/// `leanstream-prep push` with PATH = `bin` then the system folders.
fn push(bin: &Path, args: &[&str], extra_env: &[(&str, &str)]) -> (Output, String) {
    let log = bin.join("log");
    let path = format!("{}:/usr/bin:/bin", bin.display());
    let mut env = vec![("PATH", path.as_str()), ("FAKE_LOG", s(&log))];
    env.extend_from_slice(extra_env);
    let mut all = vec!["push"];
    all.extend_from_slice(args);
    let o = run(Path::new(env!("CARGO_BIN_EXE_leanstream-prep")), &all, &env);
    (o, std::fs::read_to_string(&log).unwrap_or_default())
}

#[test]
fn push_with_adb_and_ssh_arrives_identical_and_is_checked_on_the_device() {
    let bin = stand_ins("bin-ok", true);
    let original = std::fs::read(embedded()).unwrap();
    let model_dir = leanstream_tests::fresh_dir(&scratch(), "push-src");
    let model = model_dir.join("austen.lsb");
    std::fs::copy(embedded(), &model).unwrap();

    let device = leanstream_tests::fresh_dir(&scratch(), "adb-device");
    let (o, log) = push(
        &bin,
        &[s(&model), "--adb", "SERIAL42", "--remote-dir", s(&device)],
        &[],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::read(device.join("austen.lsb")).unwrap() == original);
    assert!(log.contains("adb -s SERIAL42 push"), "{log}");
    assert!(
        log.contains("adb -s SERIAL42 shell 'leanstream' verify"),
        "{log}"
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("every checksum matches"));

    let device = leanstream_tests::fresh_dir(&scratch(), "ssh-device");
    let target = format!("board:{}", device.display());
    let (o, log) = push(&bin, &[s(&model), "--ssh", &target, "--pack"], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::read(device.join("austen.lsb")).unwrap() == original);
    // The archive is gone on both sides once unpacked.
    assert_eq!(listing(&device), ["austen.lsb"]);
    assert_eq!(listing(&model_dir), ["austen.lsb"]);
    assert!(
        log.contains(&format!("scp {}", model_dir.display())),
        "{log}"
    );
    assert!(log.contains("ssh board 'leanstream' unpack"), "{log}");
}

#[test]
fn push_errors_are_clear() {
    let model = embedded();
    let device = leanstream_tests::fresh_dir(&scratch(), "err-device");
    let dev = s(&device);

    // The tool is not on PATH.
    let empty = leanstream_tests::fresh_dir(&scratch(), "bin-empty");
    for target in [vec!["--adb"], vec!["--ssh", "board:x"]] {
        let mut args = vec![s(model)];
        args.extend(target);
        let o = run(
            Path::new(env!("CARGO_BIN_EXE_leanstream-prep")),
            &[&["push"][..], &args[..]].concat(),
            &[("PATH", s(&empty))],
        );
        assert_eq!(o.status.code(), Some(1));
        let err = stderr(&o);
        assert!(err.contains("is not on PATH: install"), "{err}");
    }

    // A full device.
    let bin = stand_ins("bin-full", true);
    for target in [vec!["--adb"], vec!["--ssh", "board"]] {
        let mut args = vec![s(model), "--remote-dir", dev];
        args.extend(target);
        let (o, _) = push(&bin, &args, &[("FAKE_FULL", "1")]);
        assert_eq!(o.status.code(), Some(1));
        let err = stderr(&o);
        assert!(err.contains("the device is full"), "{err}");
        assert!(err.contains("No space left on device"), "{err}");
    }
    assert!(listing(&device).is_empty());

    // No leanstream on the device: a plain push lands with a warning, a packed one cannot be
    // unpacked (an error); both say what to install.
    let bin = stand_ins("bin-bare", false);
    let (o, _) = push(&bin, &[s(model), "--adb", "--remote-dir", dev], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("not installed on"), "{}", stderr(&o));
    assert!(std::fs::read(device.join("austen.lsb")).unwrap() == std::fs::read(model).unwrap());
    let (o, _) = push(
        &bin,
        &[s(model), "--adb", "--remote-dir", dev, "--pack"],
        &[],
    );
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("cannot be unpacked") && err.contains("build `leanstream` for the device"),
        "{err}"
    );

    // A damaged bundle (not read when the file is opened) is refused by the device-side check.
    let mut bytes = std::fs::read(model).unwrap();
    let (off, _) = LsbFile::open(model).unwrap().cluster_extent(2, 1);
    bytes[off as usize + 10] ^= 1;
    let damaged = scratch().join("damaged.lsb");
    std::fs::write(&damaged, bytes).unwrap();
    let bin = stand_ins("bin-check", true);
    let (o, _) = push(&bin, &[s(&damaged), "--adb", "--remote-dir", dev], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("verifying on the device failed") && err.contains("layer 2 cluster 1"),
        "{err}"
    );
}
