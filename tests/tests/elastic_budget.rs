//! An elastic budget: `leanstream run --memory-file F` while the test rewrites F several times
//! (down past the dense weights, so that they stream, to the run's minimum and back up, and once
//! below it). The run takes each new budget between tokens, its resident set is below each new
//! budget right after the change (measured from the OS by the run itself), the dense weights
//! stream below their resident need and are resident again above it, one below the minimum is
//! refused and the old one kept, and its greedy text equals `--policy resident`'s. `leanstream serve` takes `POST /v1/budget` the
//! same way, refusing one below the model's floor.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use leanstream_tests::cli::{bin, embedded_model, quick_convert, stated_size, stderr};

const CTX: usize = 1024;

fn run(file: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(bin("leanstream"));
    c.arg("run")
        .arg("--model")
        .arg(file)
        .args(["-p", "It was a fine morning, and Emma", "--temp", "0"])
        .args(["-n", "900", "--ctx", &CTX.to_string(), "--json"])
        .args(extra);
    c
}

/// The embedded model converted in a folder of its own; the least budget a run with its dense
/// weights resident takes (plus 1 MiB), and the FFN's bytes.
fn converted(name: &str) -> (PathBuf, PathBuf, u64, u64) {
    let dir = leanstream_tests::fresh_dir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("{name}-{}", std::process::id()),
    );
    let file = dir.join("austen.lsb");
    quick_convert(&embedded_model(), &file, &[]);
    let split = leanstream::streaming::memory_split(&file, CTX).unwrap();
    (dir, file, split.fixed() + (1 << 20), split.ffn_total)
}

/// Writes `budget` to `path` through a temp name: the run never reads a half-written file.
fn write_budget(path: &Path, budget: u64) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, budget.to_string()).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Whether process `pid` runs its budget watch thread.
fn watching(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|t| {
        std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "budget-watch")
    })
}

#[test]
fn a_budget_changed_while_running_is_followed_and_the_text_stays_exact() {
    let (dir, file, low, ffn) = converted("elastic");
    // What streaming every dense weight the planner may stream saves (the same for any process
    // overhead and any set of certificates).
    let saves = leanstream::streaming::minimum_memory(&file, CTX).unwrap()
        - leanstream::streaming::running_minimum_memory(&file, CTX).unwrap();

    let o = run(&file, &["--policy", "resident"]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let resident: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();

    let budget_file = dir.join("budget");
    // It starts with an empty neuron cache, and on one thread: the tokens before the floor is
    // known are slow enough that the 900 last for several budgets on a fast machine too (with the
    // whole FFN cached from the start, 489 of 700 tokens had gone by then under load).
    std::fs::write(&budget_file, low.to_string()).unwrap();
    let watched = [
        "--memory-file",
        budget_file.to_str().unwrap(),
        "--threads",
        "1",
    ];
    let mut child = run(&file, &watched)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let reader = {
        let (log, mut err) = (std::sync::Arc::clone(&log), child.stderr.take().unwrap());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = std::io::Read::read(&mut err, &mut buf) {
                log.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
    };
    // Stdout is read as it comes: the run's JSON (one entry per budget change) can outgrow the
    // pipe's buffer, and a child blocked on a full pipe never ends.
    let stdout = {
        let mut out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut out, &mut bytes).map(|_| bytes)
        })
    };
    // The run's own floor (its process overhead and the certificates it kept differ from this
    // test's): what it states when refusing 1 MiB, written once it has read the first budget (it
    // starts its watch thread after that read).
    while !watching(child.id()) {
        assert!(child.try_wait().unwrap().is_none(), "the run ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    write_budget(&budget_file, 1 << 20);
    let prefix = "below the minimum of ";
    let floor = loop {
        std::thread::sleep(Duration::from_millis(20));
        let text = log.lock().unwrap().clone();
        if text.contains(prefix) {
            break stated_size(&text, prefix);
        }
        assert!(child.try_wait().unwrap().is_none(), "the run ended: {text}");
    };
    let dense_resident = floor + saves;
    let low = low.max(dense_resident + (1 << 20));
    let too_low = floor - (512 << 10);
    let steps = [
        low + ffn,
        low,
        // Some dense weights stream, then all of them.
        floor + saves / 2,
        floor + (64 << 10),
        low + ffn / 3,
        too_low,
        floor + saves / 2,
        low + ffn,
    ];
    // Step through the budgets (and around again) until the run ends.
    let mut written = 0;
    while child.try_wait().unwrap().is_none() {
        write_budget(&budget_file, steps[written % steps.len()]);
        written += 1;
        // Two and a half of the run's 20 ms polls: each budget is seen, and the run goes through
        // the steps more than once.
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = child.wait().unwrap();
    let stdout = stdout.join().unwrap().unwrap();
    reader.join().unwrap();
    let log = log.lock().unwrap().clone();
    assert!(status.success(), "{log}");
    let v: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    assert_eq!(v["text"], resident["text"], "{log}");
    let changes = v["budget_changes"].as_array().unwrap();
    assert!(
        changes.len() >= 4,
        "{written} budgets written, {} taken: {changes:?}",
        changes.len()
    );
    let mut shrinks = 0;
    let any_dense_streams = |c: &serde_json::Value| {
        let d = &c["dense_streamed"];
        ["attention", "head", "embedding"]
            .iter()
            .any(|part| d[part] == true)
    };
    for c in changes {
        let (to, rss) = (c["to"].as_u64().unwrap(), c["rss_after"].as_u64().unwrap());
        assert!(steps.contains(&to) && to != too_low, "{c}");
        assert!(rss <= to, "resident set {rss} above the new budget: {c}");
        shrinks += (to < c["from"].as_u64().unwrap()) as usize;
        // Below the dense weights' need some stream; with room for them, none does.
        assert_eq!(any_dense_streams(c), to < dense_resident, "{c}");
    }
    assert!(shrinks >= 1, "{changes:?}");
    // The dense weights went to streaming and came back while the run went on.
    let streamed_at = changes.iter().position(any_dense_streams);
    assert!(
        streamed_at.is_some_and(|i| changes[i..].iter().any(|c| !any_dense_streams(c))),
        "{changes:?}"
    );
    if written >= 6 {
        assert!(log.contains("budget unchanged: --memory"), "{log}");
    }
    assert_eq!(v["memory_budget_bytes"], changes.last().unwrap()["to"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A `/metrics` gauge.
fn metric(agent: &ureq::Agent, url: &str, name: &str) -> f64 {
    let text = agent
        .get(&format!("{url}/metrics"))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} missing from {text}"))
        .parse()
        .unwrap()
}

#[test]
fn serve_takes_a_budget_posted_to_it() {
    let (dir, file, low, ffn) = converted("elastic-serve");
    let mut child = Command::new(bin("leanstream"))
        .arg("serve")
        .arg("--model")
        .arg(&file)
        .args(["--port", "0", "--temp", "0", "--ctx", &CTX.to_string()])
        .args(["--memory", &(low + ffn).to_string()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut log = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let url = loop {
        line.clear();
        assert!(
            std::io::BufRead::read_line(&mut log, &mut line).unwrap() > 0,
            "serve ended"
        );
        if let Some(at) = line.find("http://") {
            break line[at..].split("/v1").next().unwrap().to_string();
        }
    };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into();
    let post = |body: serde_json::Value| {
        let mut r = agent
            .post(&format!("{url}/v1/budget"))
            .send_json(&body)
            .unwrap();
        let status = r.status().as_u16();
        (
            status,
            r.body_mut().read_json::<serde_json::Value>().unwrap(),
        )
    };
    // Below the floor, or not a size: refused, naming the field.
    let (status, body) = post(serde_json::json!({ "memory": low - (3 << 20) }));
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "memory", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("below the"),
        "{body}"
    );
    let (status, body) = post(serde_json::json!({ "memory": "lots" }));
    assert_eq!(
        (status, &body["error"]["param"]),
        (400, &"memory".into()),
        "{body}"
    );
    // Taken by the idle server at once: the budget and the resident set follow.
    let (status, body) = post(serde_json::json!({ "memory": low.to_string() }));
    assert_eq!(
        (status, body["memory_budget_bytes"].as_u64()),
        (200, Some(low)),
        "{body}"
    );
    let taken = (0..200).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        metric(&agent, &url, "leanstream_memory_budget_bytes") == low as f64
    });
    assert!(taken, "the budget was not taken");
    assert!(metric(&agent, &url, "leanstream_rss_bytes") <= low as f64);
    assert_eq!(metric(&agent, &url, "leanstream_budget_changes_total"), 1.0);
    let _ = child.kill();
    let _ = child.wait();
    std::fs::remove_dir_all(&dir).unwrap();
}
