//! The README and docs/ stay true to the repository: the README stays a page a user reads in two
//! minutes (at most 300 lines) and gives the test command CI runs; no page carries working notes
//! (the words of a work log) or a path on the machine it was written on; and every relative link
//! in them, anchors included, reaches a file and a heading that exist.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

const README_MAX_LINES: usize = 300;
/// The test command `.ci/run` runs, which the README must give as it is.
const TEST_COMMAND: &str = "cargo test --release --workspace";
/// Absolute paths of a particular machine.
const MACHINE_PATHS: [&str; 4] = ["/home/", "/root/", "/work/", "/tmp/"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// README.md and every docs/*.md.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    assert!(!docs.is_empty(), "no docs/*.md");
    pages.extend(docs);
    pages
}

/// What a page must not contain: the words of a work log, and machine paths. One message per
/// finding, naming the line.
fn forbidden(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let lower = line.to_lowercase();
        if lower.contains("session") {
            found.push(format!("line {}: the word \"session\": {line}", i + 1));
        }
        let words = lower.split(|c: char| !c.is_alphanumeric());
        if words.into_iter().any(|w| w == "issue") {
            found.push(format!("line {}: the word \"issue\": {line}", i + 1));
        }
        for p in MACHINE_PATHS {
            if line.contains(p) {
                found.push(format!("line {}: the machine path {p}: {line}", i + 1));
            }
        }
    }
    found
}

/// Lines outside fenced code blocks, with their 1-based numbers.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// GitHub's anchor for a heading's text: lower case, punctuation dropped (letters, digits, `-`
/// and `_` kept), spaces to hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor a markdown page has: its headings' slugs, a repeated one numbered as GitHub does.
fn anchors(text: &str) -> HashSet<String> {
    let mut seen = HashSet::new();
    for (_, line) in prose(text) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(line[hashes..].trim().trim_end_matches('#'));
        let mut s = base.clone();
        let mut n = 0;
        while !seen.insert(s.clone()) {
            n += 1;
            s = format!("{base}-{n}");
        }
    }
    seen
}

/// The targets of the page's markdown links (`[text](target)`, images too), outside code blocks,
/// with their line numbers.
fn link_targets(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose(text) {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("");
            out.push((n, target.to_string()));
            rest = &after[end..];
        }
    }
    out
}

/// Relative links of `page` (whose text is `text`) that reach no file, or no heading of it.
fn broken_links(page: &Path, text: &str) -> Vec<String> {
    let mut broken = Vec::new();
    for (n, target) in link_targets(text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (target.as_str(), None),
        };
        let file = if path.is_empty() {
            page.to_path_buf()
        } else {
            page.parent().unwrap().join(path)
        };
        if !file.exists() {
            broken.push(format!("line {n}: {target}: no such file"));
            continue;
        }
        if let Some(anchor) = anchor {
            let is_md = file.extension().is_some_and(|e| e == "md");
            let body = std::fs::read_to_string(&file).unwrap_or_default();
            if !is_md || !anchors(&body).contains(anchor) {
                broken.push(format!("line {n}: {target}: no heading #{anchor}"));
            }
        }
    }
    broken
}

#[test]
fn readme_and_docs_carry_no_work_log_words_or_machine_paths() {
    let mut all = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for f in forbidden(&text) {
            all.push(format!("{}: {f}", page.display()));
        }
    }
    assert!(all.is_empty(), "\n{}", all.join("\n"));
}

#[test]
fn readme_is_short_and_gives_the_ci_test_command() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move details to docs/"
    );
    assert!(
        readme.contains(TEST_COMMAND),
        "README.md lacks `{TEST_COMMAND}`"
    );
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    assert!(
        // As it is, or as a timed step (`step test cargo test ...`).
        ci.lines().any(|l| {
            let l = l.trim();
            l == TEST_COMMAND || l.strip_prefix("step test ") == Some(TEST_COMMAND)
        }),
        ".ci/run no longer runs `{TEST_COMMAND}`: make README.md and .ci/run agree"
    );
}

#[test]
fn every_relative_link_reaches_a_file_and_heading() {
    let mut all = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for b in broken_links(&page, &text) {
            all.push(format!("{}: {b}", page.display()));
        }
    }
    assert!(all.is_empty(), "\n{}", all.join("\n"));
}

/// The checks themselves find what they are for.
#[test]
fn the_checks_catch_what_they_look_for() {
    assert_eq!(
        slug("Measured: Qwen3-30B-A3B-shaped, against `llama.cpp` ×2"),
        "measured-qwen3-30b-a3b-shaped-against-llamacpp-2"
    );
    let page = "# A\n\n## A\n\n```\n# not a heading\n```\n";
    let a = anchors(page);
    assert!(a.contains("a") && a.contains("a-1") && !a.contains("not-a-heading"));

    assert_eq!(forbidden("In session 7 we").len(), 1);
    assert_eq!(forbidden("The issue's aim").len(), 1);
    assert_eq!(forbidden("reads are issued at once").len(), 0);
    assert_eq!(forbidden("see /tmp/x and /work/y").len(), 2);

    let here = root().join("README.md");
    let text = "[ok](docs/results.md#headline-figures) [gone](docs/nothing.md) \
                [bad](docs/results.md#no-such-heading) [web](https://example.com)\n\
                ```\n[in code](nowhere.md)\n```\n";
    let broken = broken_links(&here, text);
    assert_eq!(broken.len(), 2, "{broken:?}");
    assert!(
        broken[0].contains("docs/nothing.md: no such file"),
        "{broken:?}"
    );
    assert!(
        broken[1].contains("no heading #no-such-heading"),
        "{broken:?}"
    );
}
