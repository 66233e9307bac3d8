//! The memory promise under real pressure: `leanstream run --flash none --memory B` inside a cgroup
//! v1 memory group limited to B + 5 % — where the kernel charges the process's memory and the page
//! cache it fills, and reclaims or kills at the limit — completes with the unconstrained run's
//! tokens. With `--memory auto` the run follows the group's limit as it is lowered under it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use leanstream::platform::cgroup::MemoryGroup;
use leanstream::storage::page_cache;
use leanstream_tests::cli::{bin, embedded_model, quick_convert, stated_size, stderr};

fn run_command(file: &Path, budget: u64) -> Command {
    let mut c = Command::new(bin("leanstream"));
    c.arg("run")
        .arg("--model")
        .arg(file)
        .args(["-p", "It was a fine morning, and Emma", "--temp", "0"])
        .args(["-n", "40", "--ctx", "128", "--flash", "none", "--json"])
        .args(["--memory", &budget.to_string()]);
    c
}

fn text(o: &Output, what: &str) -> String {
    assert!(o.status.success(), "{what}: {:?}: {}", o.status, stderr(o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["text"].as_str().unwrap().to_string()
}

/// The smallest budget the binary accepts for `file`, from its own refusal of 1 MiB.
fn minimum_budget(file: &Path) -> u64 {
    let o = run_command(file, 1 << 20).output().unwrap();
    stated_size(&stderr(&o), "below the minimum of ")
}

/// Creates the group, or says loudly why it cannot; `None` skips the test outside CI only (the CI
/// machine is documented to have the v1 memory controller).
fn memory_group(limit: u64) -> Option<MemoryGroup> {
    match MemoryGroup::create(limit) {
        Ok(g) => Some(g),
        Err(e) if std::env::var_os("CI").is_none() => {
            eprintln!("\n!!! NOT RUN: no writable cgroup v1 memory group here: {e}\n");
            None
        }
        Err(e) => panic!("CI is expected to provide a cgroup v1 memory group: {e}"),
    }
}

#[test]
fn streaming_keeps_its_tokens_inside_a_memory_cgroup_of_its_budget() {
    let dir = leanstream_tests::fresh_dir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("cgroup-{}", std::process::id()),
    );
    let file: PathBuf = dir.join("austen.lsb");
    quick_convert(&embedded_model(), &file, &[]);
    let min = minimum_budget(&file) + (1 << 20);
    let ffn = leanstream_format::LsbFile::open(&file)
        .unwrap()
        .ffn
        .bundle_bytes();
    let mut least_peak = u64::MAX;
    for budget in [min, min + ffn / 4] {
        let free = text(
            &run_command(&file, budget).output().unwrap(),
            "unconstrained",
        );
        let limit = budget + budget / 20;
        let Some(group) = memory_group(limit) else {
            return;
        };
        // The file's pages come from the disk again, charged to the group.
        page_cache::evict(&file).unwrap();
        let child = group
            .spawn(
                run_command(&file, budget)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped()),
            )
            .unwrap();
        let o = child.wait_with_output().unwrap();
        let (peak, hits, kills) = (
            group.peak_bytes().unwrap(),
            group.limit_hits().unwrap(),
            group.oom_kills().unwrap(),
        );
        eprintln!(
            "budget {budget} B, limit {limit} B: peak charge {peak} B ({:.1} % of the limit), \
             {hits} limit hits, {kills} OOM kills",
            100.0 * peak as f64 / limit as f64
        );
        assert_eq!(kills, 0, "budget {budget}: the kernel killed the run");
        assert_eq!(
            text(&o, &format!("budget {budget} in a cgroup of {limit}")),
            free,
            "budget {budget}: different tokens under the limit"
        );
        assert!(peak > 0 && peak <= limit, "peak charge {peak}");
        least_peak = least_peak.min(peak);
    }
    // The control: the limit bites. A group of a third of what the run was charged at most
    // cannot hold it (a third of the budget can: the run uses less than the planner reserves).
    if let Some(group) = memory_group(least_peak / 3) {
        let child = group
            .spawn(
                run_command(&file, min)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
            )
            .unwrap();
        let o = child.wait_with_output().unwrap();
        assert!(
            !o.status.success() && group.oom_kills().unwrap() > 0,
            "a run completed in a cgroup of a third of its peak charge: {:?}",
            o.status
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn memory_auto_follows_a_cgroup_limit_lowered_while_it_runs() {
    let dir = leanstream_tests::fresh_dir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("cgroup-auto-{}", std::process::id()),
    );
    let file: PathBuf = dir.join("austen.lsb");
    quick_convert(&embedded_model(), &file, &[]);
    let split = leanstream::streaming::memory_split(&file, 128).unwrap();
    let (low, ffn) = (split.fixed(), split.ffn_total);
    // `auto` keeps 4 MiB and 1/32 of the limit for the kernel: a limit with room for everything.
    let limit_for = |budget: u64| (budget + (4 << 20)) * 32 / 31 + (2 << 20);
    let command = |memory: &str| {
        let mut c = Command::new(bin("leanstream"));
        c.arg("run")
            .arg("--model")
            .arg(&file)
            .args(["-p", "It was a fine morning, and Emma", "--temp", "0"])
            .args(["-n", "600", "--ctx", "128", "--flash", "none", "--json"])
            .args(["--memory", memory]);
        c
    };
    let free = text(
        &command(&(low + ffn).to_string()).output().unwrap(),
        "unconstrained",
    );
    let Some(group) = memory_group(limit_for(low + ffn)) else {
        return;
    };
    let child = group
        .spawn(
            command("auto")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped()),
        )
        .unwrap();
    // Take memory back in steps, each a little above what the group holds (the kernel refuses a
    // limit it cannot reclaim down to, and kills a process that then allocates past it: 6 MiB
    // leaves the run the token or so it takes to follow), down to the run's floor.
    let floor = limit_for(low);
    let mut lowered = 0;
    let child = {
        let mut child = child;
        while child.try_wait().unwrap().is_none() {
            std::thread::sleep(std::time::Duration::from_millis(40));
            let usage = group.usage_bytes().unwrap();
            let next = (usage + (6 << 20)).max(floor);
            if next < limit_for(low + ffn) && group.set_limit(next).is_ok() {
                lowered += 1;
            }
        }
        child
    };
    let o = child.wait_with_output().unwrap();
    assert_eq!(group.oom_kills().unwrap(), 0, "the kernel killed the run");
    assert_eq!(text(&o, "--memory auto"), free, "different tokens");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let changes = v["budget_changes"].as_array().unwrap();
    eprintln!("{lowered} limits set; {changes:?}");
    assert!(lowered > 0, "the run ended before the limit was lowered");
    assert!(
        changes
            .iter()
            .any(|c| c["to"].as_u64() < c["from"].as_u64()),
        "the limit was lowered {lowered} times and the run never shrank: {changes:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The kernel's v1 pressure events reach `--memory auto`'s signals: a group of 16 MiB reading a
/// 64 MiB file must reclaim its page cache, which the kernel reports at least at the `low` level.
#[test]
fn v1_pressure_events_are_received() {
    use leanstream::platform::elastic::{Pressure, PressureSignals};
    let dir = leanstream_tests::fresh_dir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("cgroup-pressure-{}", std::process::id()),
    );
    let big = dir.join("big");
    // Written back before it is dropped from the page cache (dirty pages stay), so that the
    // group's read fills the cache anew and is charged for it.
    let mut f = std::fs::File::create(&big).unwrap();
    std::io::Write::write_all(&mut f, &vec![1u8; 64 << 20]).unwrap();
    f.sync_all().unwrap();
    drop(f);
    page_cache::evict(&big).unwrap();
    let Some(group) = memory_group(16 << 20) else {
        return;
    };
    let mut signals = PressureSignals::open(Some(group.path()), None);
    assert!(signals.has_events(), "no v1 events registered");
    assert_eq!(signals.event_level(), Pressure::None);
    let o = group
        .spawn(Command::new("cat").arg(&big).stdout(Stdio::null()))
        .unwrap()
        .wait()
        .unwrap();
    assert!(o.success());
    // The group was full: the rest of the file was read by reclaiming its cache.
    let peak = group.peak_bytes().unwrap();
    assert!(peak > 15 << 20, "the read never met the limit: peak {peak}");
    assert!(
        signals.event_level() >= Pressure::Moderate,
        "no pressure event while the group reclaimed"
    );
    drop(group);
    std::fs::remove_dir_all(&dir).unwrap();
}
