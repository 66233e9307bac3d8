//! Nothing of the model lingers in the page cache after a `--flash none` run: memory the budget
//! does not see. Opening reads the index sections and resident tensors with buffered reads and
//! then drops them; every read after that is direct.
#![cfg(target_os = "linux")]

use std::path::Path;
use std::process::Command;

use leanstream::storage::page_cache;
use leanstream_tests::cli::{bin, embedded_model, quick_convert, stderr};

/// Pages of `file` in the page cache, as a share of its pages.
fn cached_share(file: &Path) -> f64 {
    let (cached, pages) = page_cache::resident_pages(file).unwrap();
    cached as f64 / pages as f64
}

#[test]
fn a_direct_run_leaves_at_most_five_percent_of_the_file_in_the_page_cache() {
    let dir = leanstream_tests::fresh_dir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("page-cache-{}", std::process::id()),
    );
    let file = dir.join("austen.lsb");
    quick_convert(&embedded_model(), &file, &[]);
    for extra in [
        &["--memory", "40MiB"][..],
        &[][..],
        &["--policy", "resident"][..],
    ] {
        // The control: a buffered read of the whole file leaves it cached, so the measure can
        // see what a run would leave.
        std::fs::read(&file).unwrap();
        assert!(cached_share(&file) > 0.9, "{}", cached_share(&file));
        page_cache::evict(&file).unwrap();
        let o = Command::new(bin("leanstream"))
            .arg("run")
            .arg("--model")
            .arg(&file)
            .args(["-p", "It was a fine morning", "-n", "8", "--temp", "0"])
            .args(["--flash", "none", "--json"])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
        let share = cached_share(&file);
        eprintln!(
            "{extra:?}: {:.1} % of the file in the page cache after the run",
            100.0 * share
        );
        assert!(share <= 0.05, "{extra:?}: {:.1} % cached", 100.0 * share);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
