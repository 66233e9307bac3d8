//! Converted test files and the workspace's binaries, shared by the end-to-end streaming tests.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The workspace's binaries, built by `cargo test --workspace` next to the test's directory.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().unwrap().parent().unwrap().join(name);
    assert!(
        p.exists(),
        "{} is missing: run the tests with `cargo test --workspace`",
        p.display()
    );
    p
}

/// This test process's scratch directory.
pub fn scratch() -> PathBuf {
    crate::scratch_dir("leanstream-streaming")
}

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Converts `model` to `out` with small, fast settings (8 KiB clusters unless `extra` names a
/// size) plus `extra`.
pub fn convert(model: &Path, out: &Path, extra: &[&str]) {
    let sized = extra.contains(&"--cluster-kib");
    let o = Command::new(bin("leanstream-prep"))
        .arg("convert")
        .arg(model)
        .arg("-o")
        .arg(out)
        .args(["--calib-tokens", "2048", "--epochs", "2", "--json"])
        .args(if sized {
            &[][..]
        } else {
            &["--cluster-kib", "8"][..]
        })
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `spec` written as a tiny Hugging Face model in the scratch folder `name` and converted (as
/// [`convert`] does, plus `extra`) to `name.lsb` beside it.
pub fn convert_tiny(name: &str, spec: &crate::tiny::TinySpec, extra: &[&str]) -> PathBuf {
    let dir = crate::fresh_dir(&scratch(), name);
    crate::tiny::write_tiny_model(&dir, spec).unwrap();
    let file = scratch().join(format!("{name}.lsb"));
    convert(&dir, &file, extra);
    file
}

/// The embedded ReLU model converted to `q8` or `f32`, once per test process.
pub fn embedded(quant: &str) -> PathBuf {
    static Q8: OnceLock<PathBuf> = OnceLock::new();
    static F32: OnceLock<PathBuf> = OnceLock::new();
    let cell = if quant == "q8" { &Q8 } else { &F32 };
    cell.get_or_init(|| {
        let out = scratch().join(format!("austen-{quant}.lsb"));
        convert(
            &workspace().join("models/austen-relu"),
            &out,
            &["--quant", quant],
        );
        out
    })
    .clone()
}

/// The embedded ReLU model converted as [`convert`] does with no further flags (leanstream-prep's
/// default encoding), once per test process. Tests only read it; one that evicts it from the page
/// cache or charges its pages to a memory group converts its own copy.
pub fn embedded_default() -> PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let out = scratch().join("austen-default.lsb");
        convert(&workspace().join("models/austen-relu"), &out, &[]);
        out
    })
    .clone()
}

/// Token ids of the held-out text, the first `n`.
pub fn heldout_ids(tokenizer: &leanstream::tokenizer::Tokenizer, n: usize) -> Vec<u32> {
    let text = std::fs::read_to_string(workspace().join("data/heldout-head.txt")).unwrap();
    let mut ids = tokenizer.encode(&text, false).unwrap();
    ids.truncate(n);
    ids
}

/// Copies `src` to `dst` with every certificate row negated but its error bound kept (checksums
/// recomputed): a bound far too tight for its rows (where the sketch is the bundle's own encoding
/// it equals the gates, so the true bound is zero and scaling it cannot make it too tight), which
/// must make certified output differ from `resident`.
pub fn negate_certificate_rows(src: &Path, dst: &Path) {
    use leanstream_format::container::{checksum, page_align, Header, SectionKind};
    use leanstream_format::quant::QuantType;
    let mut sketch = leanstream_format::LsbFile::open(src)
        .unwrap()
        .read_sketch()
        .unwrap();
    for l in &mut sketch.layers {
        // A Q8_0 or Q4_0 block is an f16 scale (little-endian: the sign is bit 7 of byte 1) and
        // 32 codes (Q4_0: centred on 8, so negating the scale negates every value).
        let block = match l.qtype {
            QuantType::Q8_0 => 34,
            QuantType::Q4_0 => 18,
            q => panic!("cannot negate a {q:?} sketch"),
        };
        for block in l.rows.chunks_mut(block) {
            block[1] ^= 0x80;
        }
    }
    let mut bytes = std::fs::read(src).unwrap();
    let mut header = Header::decode(&bytes[..4096], bytes.len() as u64).unwrap();
    let entry = header
        .sections
        .iter_mut()
        .find(|s| s.kind == SectionKind::Sketch as u32)
        .unwrap();
    let encoded = sketch.encode();
    assert_eq!(encoded.len() as u64, entry.length, "same layout, same size");
    let start = entry.offset as usize;
    bytes[start..start + encoded.len()].copy_from_slice(&encoded);
    entry.checksum = checksum(&bytes[start..start + page_align(entry.length) as usize]);
    bytes[..4096].copy_from_slice(&header.encode());
    std::fs::write(dst, bytes).unwrap();
}

/// Session options for `file` computing exactly (`Sparsity::Exact`, an f32 KV cache) with `policy`
/// under `memory` at context `ctx`.
pub fn exact_options(
    file: &Path,
    policy: leanstream::text::session::PolicyChoice,
    memory: Option<u64>,
    ctx: usize,
) -> leanstream::text::session::SessionOptions {
    leanstream::text::session::SessionOptions::new(file, Some(policy))
        .memory(memory)
        .sparsity(leanstream::streaming::Sparsity::Exact)
        .ctx(ctx)
        .kv(leanstream::model::kv_cache::KvType::F32)
}

/// The index of `row`'s largest value (ties: the lowest index), as a token id.
pub fn argmax(row: &[f32]) -> u32 {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
        .expect("a non-empty row") as u32
}

/// Options of a session on `model` with `policy` under `memory` at context `ctx`: certified
/// sparsity on the emulated `ufs4` flash, the default KV cache and tuning.
pub fn session_options(
    model: &Path,
    policy: leanstream::text::session::PolicyChoice,
    memory: Option<u64>,
    ctx: usize,
) -> leanstream::text::session::SessionOptions {
    leanstream::text::session::SessionOptions::new(model, Some(policy))
        .memory(memory)
        .flash(ufs4())
        .ctx(ctx)
}

/// The emulated UFS 4.0 phone flash (`--flash ufs4`).
pub fn ufs4() -> Option<leanstream::storage::FlashProfile> {
    leanstream::storage::FlashProfile::from_flash_arg("ufs4").unwrap()
}

/// Copies `src` (format 1.6, clusters split `[gate rows | up rows | down columns]`) to `dst` as a
/// 1.5 file, what a converter before 1.6 wrote for the same weights: every cluster extent of
/// FFN_DATA and EXPERT_DATA rearranged to `[gate | up | down]` per neuron, the checksums that
/// cover them recomputed, the header's minor version 5 ([`leanstream_format::relayout`], which
/// refuses a file that is interleaved already).
pub fn to_interleaved(src: &Path, dst: &Path) {
    use leanstream_format::ffn::ClusterLayout;
    let interleaved = leanstream_format::relayout::relayout(src, dst, ClusterLayout::Interleaved);
    interleaved.unwrap_or_else(|e| panic!("{e}"));
}
