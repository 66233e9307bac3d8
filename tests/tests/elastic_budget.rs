//! An elastic budget: `leanstream run --memory-file F` while the test rewrites F several times
//! (down to the run's minimum and back up, and once below it). The run takes each new budget
//! between tokens, its resident set is below each new budget right after the change (measured
//! from the OS by the run itself), one below the minimum is refused and the old one kept, and its
//! greedy text equals `--policy resident`'s. `leanstream serve` takes `POST /v1/budget` the
//! same way, refusing one below the model's floor.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use leanstream_tests::cli::{bin, embedded_model, quick_convert, stderr};

const CTX: usize = 1024;

fn run(file: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(bin("leanstream"));
    c.arg("run")
        .arg("--model")
        .arg(file)
        .args(["-p", "It was a fine morning, and Emma", "--temp", "0"])
        .args(["-n", "700", "--ctx", &CTX.to_string(), "--json"])
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

#[test]
fn a_budget_changed_while_running_is_followed_and_the_text_stays_exact() {
    let (dir, file, low, ffn) = converted("elastic");
    let too_low = low - (3 << 20);
    let steps = [low + ffn, low, low + ffn / 3, too_low, low, low + ffn];

    let o = run(&file, &["--policy", "resident"]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let resident: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();

    let budget_file = dir.join("budget");
    std::fs::write(&budget_file, steps[0].to_string()).unwrap();
    let mut child = run(&file, &["--memory-file", budget_file.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Step through the budgets (and around again) until the run ends.
    let mut written = 0;
    while child.try_wait().unwrap().is_none() {
        std::thread::sleep(Duration::from_millis(250));
        written += 1;
        let budget = steps[written % steps.len()];
        // Temp name + rename: the run never reads a half-written file.
        let tmp = dir.join("budget.tmp");
        std::fs::write(&tmp, budget.to_string()).unwrap();
        std::fs::rename(&tmp, &budget_file).unwrap();
    }
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["text"], resident["text"], "{}", stderr(&o));
    let changes = v["budget_changes"].as_array().unwrap();
    assert!(
        changes.len() >= 2,
        "{} budgets written, {} taken: {changes:?}",
        written,
        changes.len()
    );
    let mut shrinks = 0;
    for c in changes {
        let (to, rss) = (c["to"].as_u64().unwrap(), c["rss_after"].as_u64().unwrap());
        assert!(steps.contains(&to) && to != too_low, "{c}");
        assert!(rss <= to, "resident set {rss} above the new budget: {c}");
        shrinks += (to < c["from"].as_u64().unwrap()) as usize;
    }
    assert!(shrinks >= 1, "{changes:?}");
    if written >= 4 {
        assert!(
            stderr(&o).contains("budget unchanged: --memory"),
            "{}",
            stderr(&o)
        );
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
