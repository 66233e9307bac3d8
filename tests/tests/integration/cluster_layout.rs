//! Files of format 1.5, whose clusters hold each neuron's bundle `[gate | up | down]` back to
//! back, keep working beside 1.6's split clusters `[gate rows | up rows | down columns]`: the
//! embedded model's and a tiny mixture's 1.6 conversions rewritten in the 1.5 layout (what a 1.5
//! converter wrote for the same weights) give bitwise the same logits and greedy tokens under
//! every policy that reads the bundles: resident, dense (as stored), streaming under a budget,
//! and a mixture's experts streamed. `leanstream-prep upgrade` turns the 1.5 file back into its
//! 1.6 conversion byte for byte.

use std::path::{Path, PathBuf};
use std::process::Command;

use leanstream::model::kv_cache::KvType;
use leanstream::text::session::{PolicyChoice, Session};
use leanstream_format::container::SectionKind;
use leanstream_format::ffn::ClusterLayout;
use leanstream_format::{verify, LsbFile};
use leanstream_tests::converted::{
    argmax, bin, convert, embedded, exact_options, heldout_ids, scratch, to_interleaved,
};
use leanstream_tests::fresh_dir;
use leanstream_tests::tiny::{random_ids, write_tiny_model, TinySpec};

const CTX: usize = 64;

/// Every position's logits of `ids` (one forward), then 12 greedy tokens after `ids[..8]`.
fn outputs(s: &mut Session, ids: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let m = s.model();
    let mut cache = m.new_cache(CTX);
    let logits = m.forward(ids, &mut cache, true).unwrap();
    let mut cache = m.new_cache(CTX);
    let mut last = m.forward(&ids[..8], &mut cache, false).unwrap();
    let mut tokens = Vec::new();
    for _ in 0..12 {
        let t = argmax(&last);
        tokens.push(t);
        last = m.forward(&[t], &mut cache, false).unwrap();
    }
    (logits.iter().map(|v| v.to_bits()).collect(), tokens)
}

/// `new` rewritten as 1.5 beside it; both checked and their layouts as their versions say.
fn old_of(new: &Path, name: &str) -> PathBuf {
    let old = scratch().join(name);
    to_interleaved(new, &old);
    let (n, o) = (LsbFile::open(new).unwrap(), LsbFile::open(&old).unwrap());
    // Split clusters are 1.6; a calibrated dense file's INPUT_BASIS makes it 1.10.
    let basis = n.header.section(SectionKind::InputBasis).is_some();
    assert_eq!(basis, n.experts.layers.is_empty(), "INPUT_BASIS iff dense");
    assert_eq!(n.header.version_minor, if basis { 10 } else { 6 });
    assert_eq!(n.cluster_layout(), ClusterLayout::Split);
    // Interleaved clusters are 1.5, unless the file holds INPUT_BASIS (1.10).
    assert_eq!(o.header.version_minor, if basis { 10 } else { 5 });
    assert_eq!(o.cluster_layout(), ClusterLayout::Interleaved);
    // The split clusters are in a section kind of their own, so that a reader before 1.6, which
    // needs FFN_DATA, refuses the file instead of reading split clusters as interleaved.
    let kinds = |f: &LsbFile, a: SectionKind, b: SectionKind| {
        (f.header.section(a).is_some(), f.header.section(b).is_some())
    };
    assert_eq!(
        kinds(&n, SectionKind::FfnData, SectionKind::FfnDataSplit),
        (false, true)
    );
    assert_eq!(
        kinds(&o, SectionKind::FfnData, SectionKind::FfnDataSplit),
        (true, false)
    );
    if n.header.section(SectionKind::ExpertIndex).is_some() {
        let experts = (SectionKind::ExpertData, SectionKind::ExpertDataSplit);
        assert_eq!(kinds(&n, experts.0, experts.1), (false, true));
        assert_eq!(kinds(&o, experts.0, experts.1), (true, false));
    }
    assert!(o
        .ffn
        .layers
        .iter()
        .all(|l| l.layout == ClusterLayout::Interleaved));
    assert_eq!(verify(&old, |_, _| {}).unwrap(), o.header.file_size);
    let upgraded = scratch().join(format!("{name}.upgraded"));
    let (ok, err) = upgrade(&old, &upgraded);
    assert!(ok, "{err}");
    assert!(
        std::fs::read(&upgraded).unwrap() == std::fs::read(new).unwrap(),
        "the upgraded 1.5 file is the 1.6 conversion"
    );
    // A file that is 1.6 already is refused, saying so.
    let (ok, err) = upgrade(new, &upgraded);
    assert!(!ok && err.contains("already"), "{err}");
    old
}

/// `leanstream-prep upgrade src -o dst`: whether it succeeded, and its stderr.
fn upgrade(src: &Path, dst: &Path) -> (bool, String) {
    let o = Command::new(bin("leanstream-prep"))
        .arg("upgrade")
        .arg(src)
        .arg("-o")
        .arg(dst)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

fn same(new: &Path, old: &Path, policy: PolicyChoice, memory: Option<u64>, ids: &[u32]) {
    let run = |file: &Path| {
        let mut s = Session::open(&exact_options(file, policy, memory, CTX)).unwrap();
        outputs(&mut s, ids)
    };
    let (want, got) = (run(new), run(old));
    assert!(want.0 == got.0, "{policy:?} {memory:?}: 1.5 logits differ");
    assert_eq!(
        want.1, got.1,
        "{policy:?} {memory:?}: 1.5 greedy tokens differ"
    );
}

#[test]
fn a_1_5_file_computes_what_its_1_6_conversion_computes() {
    let new = embedded("q8");
    let old = old_of(&new, "austen-q8-1.5.lsb");
    let tokenizer = Session::open(&exact_options(&new, PolicyChoice::Resident, None, CTX))
        .unwrap()
        .tokenizer
        .clone();
    let ids = heldout_ids(&tokenizer, 40);
    let f = LsbFile::open(&new).unwrap();
    let budget =
        leanstream::streaming::minimum_memory(&new, CTX).unwrap() + f.ffn.bundle_bytes() / 4;
    for (policy, memory) in [
        (PolicyChoice::Resident, None),
        (PolicyChoice::Dense, None),
        (PolicyChoice::Leanstream, Some(budget)),
        (PolicyChoice::LlmInFlash, Some(budget)),
    ] {
        same(&new, &old, policy, memory, &ids);
    }
}

#[test]
fn a_1_5_mixture_computes_what_its_1_6_conversion_computes() {
    let spec = TinySpec {
        seed: 73,
        ..TinySpec::qwen3_moe()
    };
    let dir = fresh_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "layout-moe");
    write_tiny_model(&dir, &spec).unwrap();
    let new = dir.join("model.lsb");
    convert(&dir, &new, &["--quant", "q8"]);
    let old = old_of(&new, "moe-1.5.lsb");
    assert!(LsbFile::open(&old)
        .unwrap()
        .experts
        .layers
        .iter()
        .flatten()
        .all(|x| x.layout == ClusterLayout::Interleaved));
    let ids = random_ids(spec.seed + 3, 40, spec.vocab);
    let minimum = leanstream::streaming::experts::minimum_memory(&new, CTX, KvType::F32).unwrap();
    for (policy, memory) in [
        (PolicyChoice::Resident, None),
        (PolicyChoice::Leanstream, Some(minimum)),
    ] {
        same(&new, &old, policy, memory, &ids);
    }
}
