//! The fuzz targets' bodies (fuzz/bodies/, shared with the cargo-fuzz targets in fuzz/) run over
//! their seed corpora and over mutations of each seed, on the stable toolchain: a smoke run of
//! every target in the normal suite. A panic fails the test; each target must also accept at least
//! one seed, so the corpus reaches past the first check of its reader. Long fuzzing runs stay with
//! `scripts/fuzz.sh` (cargo-fuzz).

use std::path::PathBuf;

use rand::{Rng, SeedableRng};

#[path = "../../../fuzz/bodies/gguf.rs"]
mod gguf;
#[path = "../../../fuzz/bodies/gguf_tokenizer.rs"]
mod gguf_tokenizer;
#[path = "../../../fuzz/bodies/hf_config.rs"]
mod hf_config;
#[path = "../../../fuzz/bodies/lsb_file.rs"]
mod lsb_file;

/// Mutated inputs tried per seed: bytes flipped, overwritten, inserted or cut off.
const MUTATIONS: usize = 48;

fn seeds(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = leanstream_tests::converted::workspace()
        .join("fuzz/corpus")
        .join(target);
    let mut seeds: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let path = e.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            (path, bytes)
        })
        .collect();
    seeds.sort();
    assert!(!seeds.is_empty(), "no seeds in {}", dir.display());
    seeds
}

/// `seed` changed in a few random places (the same ones on every run).
fn mutate(seed: &[u8], rng: &mut rand::rngs::StdRng) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..rng.random_range(1..=4) {
        if b.is_empty() {
            b.push(rng.random());
            continue;
        }
        let at = rng.random_range(0..b.len());
        match rng.random_range(0..4) {
            0 => b[at] ^= 1 << rng.random_range(0..8),
            1 => b[at] = [0x00, 0xff, 0x7f, 0x80][rng.random_range(0..4)],
            2 => b.insert(at, rng.random()),
            _ => b.truncate(at),
        }
    }
    b
}

/// Runs `body` over every seed of `target` and its mutations; returns how many seeds it accepted.
fn smoke(target: &str, body: fn(&[u8]) -> bool) -> usize {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let mut accepted = 0;
    for (path, seed) in seeds(target) {
        if body(&seed) {
            accepted += 1;
        } else {
            eprintln!("{target}: seed {} refused", path.display());
        }
        for _ in 0..MUTATIONS {
            body(&mutate(&seed, &mut rng));
        }
    }
    assert!(accepted > 0, "{target}: every seed was refused");
    accepted
}

#[test]
fn fuzz_target_lsb_file_survives_its_corpus() {
    smoke("lsb_file", lsb_file::run);
}

#[test]
fn fuzz_target_hf_config_survives_its_corpus() {
    // Every seed is a real model's config.json.
    assert_eq!(smoke("hf_config", hf_config::run), seeds("hf_config").len());
}

#[test]
fn fuzz_target_gguf_survives_its_corpus() {
    smoke("gguf", gguf::run);
}

#[test]
fn fuzz_target_gguf_tokenizer_survives_its_corpus() {
    smoke("gguf_tokenizer", gguf_tokenizer::run);
}

#[test]
fn a_converted_file_reads_the_same_from_memory_as_from_its_path() {
    let path = leanstream_tests::converted::embedded_default();
    let bytes = std::fs::read(&path).unwrap();
    let from_path = leanstream_format::LsbFile::open(&path).unwrap();
    let from_memory =
        leanstream_format::LsbFile::read(&mut std::io::Cursor::new(&bytes), &path).unwrap();
    assert_eq!(format!("{from_memory:?}"), format!("{from_path:?}"));
    let checked = leanstream_format::verify(&path, |_, _| {}).unwrap();
    assert_eq!(checked, bytes.len() as u64);
    let in_memory =
        leanstream_format::verify_reader(&mut std::io::Cursor::new(&bytes), &path, |_, _| {});
    assert_eq!(in_memory.unwrap(), checked);
    // A flipped byte in the FFN bundles is found in memory as on disk, naming the file.
    let mut damaged = bytes.clone();
    let (offset, _) = from_path.cluster_extent(0, 0);
    damaged[offset as usize] ^= 0x40;
    let e = leanstream_format::verify_reader(&mut std::io::Cursor::new(&damaged), &path, |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(path.to_str().unwrap()) && e.contains("layer 0 cluster 0"),
        "{e}"
    );
}
