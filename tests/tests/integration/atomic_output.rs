//! A conversion killed at any moment (SIGKILL: no clean-up code runs) leaves no file under the
//! output name, and what it leaves under its temporary name is refused by every reader; the next
//! conversion succeeds.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use leanstream_tests::cli::{assert_clean_failure, bin, embedded_model};

/// A conversion long enough (~15 s on a quiet machine) that every kill moment below falls inside it.
fn start_convert(out: &Path) -> Child {
    Command::new(bin("leanstream-prep"))
        .arg("convert")
        .arg(embedded_model())
        .arg("-o")
        .arg(out)
        .args(["--calib-tokens", "16384", "--epochs", "8", "--json"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// The conversion's temporary files in `dir`.
fn temporaries(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().contains(".tmp-"))
        .collect()
}

/// When to kill: after a fixed delay, or as soon as the temporary file exists.
#[derive(Debug, Clone, Copy)]
enum Moment {
    After(Duration),
    TemporaryAppears,
}

#[test]
fn a_killed_conversion_leaves_nothing_that_is_trusted() {
    let dir = leanstream_tests::fresh_dir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("killed-{}", std::process::id()),
    );
    let out = dir.join("austen.lsb");
    let mut killed_mid_write = 0;
    for moment in [
        Moment::TemporaryAppears,
        Moment::After(Duration::from_millis(200)),
        Moment::After(Duration::from_secs(1)),
        Moment::After(Duration::from_secs(3)),
    ] {
        let mut child = start_convert(&out);
        let start = Instant::now();
        loop {
            let due = match moment {
                Moment::After(d) => start.elapsed() >= d,
                Moment::TemporaryAppears => !temporaries(&dir).is_empty(),
            };
            if due || child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let finished = child.try_wait().unwrap().is_some();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            !finished,
            "{moment:?}: the conversion finished before it could be killed"
        );
        assert!(
            !out.exists(),
            "{moment:?}: a killed conversion left {}",
            out.display()
        );
        for tmp in temporaries(&dir) {
            killed_mid_write += 1;
            let name = tmp.file_name().unwrap().to_string_lossy().into_owned();
            let verify = Command::new(bin("leanstream-prep"))
                .arg("verify")
                .arg(&tmp)
                .output()
                .unwrap();
            assert_clean_failure(&format!("verify {name}"), &verify, 1, &[&name]);
            let run = Command::new(bin("leanstream"))
                .args(["run", "-p", "x", "-n", "1", "--model"])
                .arg(&tmp)
                .output()
                .unwrap();
            assert_clean_failure(&format!("run {name}"), &run, 1, &[&name]);
        }
    }
    assert!(
        killed_mid_write > 0,
        "no kill landed while the file was being written"
    );
    // Nothing left behind blocks or misleads the next conversion, which clears the leftovers.
    let o = start_convert(&out).wait_with_output().unwrap();
    assert!(o.status.success());
    let verify = Command::new(bin("leanstream-prep"))
        .arg("verify")
        .arg(&out)
        .output()
        .unwrap();
    assert!(verify.status.success());
    assert!(temporaries(&dir).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}
