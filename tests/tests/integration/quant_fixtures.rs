//! llama.cpp's own quantizations of tiny models of five architectures (hidden 256, FFN 512, 4 heads
//! of 64): made by scripts/make-arch-fixtures.py with `llama-quantize` as
//! `FAMILY.{q8_0,q4_k_m,q6_k}.gguf` (Llama 3 with rope scaling, Qwen2 with q/k/v biases, SmolLM3
//! with NoPE layers, Gemma 2 with GeGLU and soft-capping, Phi-3 with fused projections and
//! LongRoPE), each dequantized back to F32 by `llama-quantize` and recorded in `FAMILY.quant.json`
//! as a digest of every tensor. The engine must decode every tensor to llama.cpp's bits, run each
//! file's stored blocks (Q8_0, Q4_K, Q6_K) to the perplexity of its F32 dequantization, and
//! `convert` must keep the Q4_K gate and up rows as stored, with streaming computing the bits of
//! `resident`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::quantized::gguf_file::Content;
use leanstream::model::{LanguageModel, Model};
use leanstream::source::gguf::{quant_type, GgufFile};
use leanstream::text::session::{PolicyChoice, Session};
use leanstream_format::ffn::Part;
use leanstream_format::quant::{dequantize_row, QuantType};
use leanstream_format::LsbFile;
use leanstream_tests::converted::{bin, convert, exact_options, scratch};
use serde_json::Value;

/// Relative perplexity difference allowed between a file's stored blocks (run with the input
/// quantized to q8, as llama.cpp does) and its F32 dequantization.
const PPL_TOL: f64 = 2e-3;
const CTX: usize = 64;
/// The quantized families, each a `.quant.json` record and three files.
const FAMILIES: [&str; 5] = ["llama-k", "qwen2-k", "smollm3-k", "gemma2-k", "phi3-k"];
const TYPES: [&str; 3] = ["q8_0", "q4_k_m", "q6_k"];

/// Every quantized fixture: its family and file name.
fn files() -> Vec<(&'static str, String)> {
    FAMILIES
        .iter()
        .flat_map(|&f| TYPES.iter().map(move |t| (f, format!("{f}.{t}.gguf"))))
        .collect()
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/arch")
        .join(name)
}

fn record(family: &str) -> Value {
    let text = std::fs::read_to_string(fixture(&format!("{family}.quant.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn token_ids() -> Vec<u32> {
    let r = record("llama-k");
    let ids = r["token_ids"].as_array().unwrap();
    ids.iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// `Σ bits(x_i)·(2i + 1) mod 2⁶⁴`, the script's digest of a tensor's f32 values in file order.
fn digest(values: &[f32]) -> u64 {
    values.iter().enumerate().fold(0u64, |h, (i, v)| {
        h.wrapping_add((v.to_bits() as u64).wrapping_mul(2 * i as u64 + 1))
    })
}

/// Every tensor of GGUF file `path` in file order (rows as llama.cpp stores them), decoded by the
/// file format's reference decoder: name, GGML type name and values.
fn decoded_tensors(path: &Path) -> Vec<(String, QuantType, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let content = Content::read(&mut std::io::Cursor::new(&bytes)).unwrap();
    let mut out = Vec::new();
    for (name, info) in &content.tensor_infos {
        let q = quant_type(info.ggml_dtype).unwrap_or_else(|| panic!("{name}: a type we lack"));
        let dims = info.shape.dims();
        let cols = *dims.last().unwrap();
        let count: usize = dims.iter().product();
        let row = leanstream_format::quant::row_bytes(q, cols).unwrap();
        let start = (content.tensor_data_offset + info.offset) as usize;
        let data = &bytes[start..start + count / cols * row];
        let mut values = vec![0.0f32; count];
        for (r, out) in data.chunks_exact(row).zip(values.chunks_exact_mut(cols)) {
            dequantize_row(q, r, out).unwrap();
        }
        out.push((name.clone(), q, values));
    }
    out
}

#[test]
fn every_tensor_decodes_to_llama_cpps_bits() {
    for (family, file) in files() {
        let file = file.as_str();
        let r = record(family);
        let want = &r["files"][file];
        let tensors = decoded_tensors(&fixture(file));
        assert_eq!(
            tensors.len(),
            want["types"].as_object().unwrap().len(),
            "{file}"
        );
        let mut seen = BTreeMap::new();
        for (name, q, values) in &tensors {
            let ggml = q.name().to_uppercase();
            assert_eq!(want["types"][name], ggml.as_str(), "{file}: {name}'s type");
            let d = want["dequantized_f32"][name].as_str().unwrap();
            assert_eq!(
                digest(values).to_string(),
                d,
                "{file}: {name} ({ggml}) decodes otherwise than llama-quantize's F32"
            );
            *seen.entry(ggml).or_insert(0) += 1;
        }
        eprintln!("{file}: {seen:?}");
        // The K-quants are really there: llama-quantize falls back for rows it cannot hold, and
        // each of these files has every matrix in the file's types (norms stay F32).
        let k = |t: &str| seen.get(t).copied().unwrap_or(0);
        let matrices = tensors.len() - k("F32");
        assert!(matrices >= 9, "{file}: {seen:?}");
        if file.ends_with("q4_k_m.gguf") {
            assert!(
                k("Q4_K") >= matrices / 2 && k("Q6_K") >= 2,
                "{file}: {seen:?}"
            );
            assert_eq!(k("Q4_K") + k("Q6_K"), matrices, "{file}: {seen:?}");
        } else if file.ends_with("q6_k.gguf") {
            assert_eq!(k("Q6_K"), matrices, "{file}: {seen:?}");
        } else {
            assert_eq!(k("Q8_0"), matrices, "{file}: {seen:?}");
        }
    }
}

/// The perplexity of `model` over the sequences `seqs` together, decoding one token at a time:
/// every weight's mat-vec runs its row kernels on the stored blocks (a prompt's mat-mat decodes
/// tiles to f32 instead).
fn perplexity(mut model: impl LanguageModel, seqs: &[Vec<u32>]) -> f64 {
    let (mut nll, mut n) = (0.0, 0);
    for ids in seqs {
        let mut cache = model.new_cache(ids.len());
        for (i, &next) in ids[1..].iter().enumerate() {
            let logits = model.forward(&ids[i..i + 1], &mut cache, false).unwrap();
            nll -= leanstream::text::perplexity::log_softmax(&logits)[next as usize];
        }
        n += ids.len() - 1;
    }
    (nll / n as f64).exp()
}

/// The model of `g` with every weight decoded to f32 by the file format's decoder: the file's
/// F32 dequantization ([`every_tensor_decodes_to_llama_cpps_bits`] checks it is llama.cpp's).
fn dequantized(g: &GgufFile) -> Model {
    Model::from_hf_tensors(g.config().unwrap(), |name, shape| {
        Ok(dequantized_matrix(g, name, shape))
    })
    .unwrap()
}

/// Tensor `name` of `g` decoded to f32 (Hugging Face row order).
fn dequantized_matrix(g: &GgufFile, name: &str, shape: &[usize]) -> Vec<f32> {
    let raw = g.raw_tensor(name, shape).unwrap();
    let q = quant_type(raw.dtype).unwrap();
    let cols = *shape.last().unwrap();
    let mut v = vec![0.0f32; shape.iter().product()];
    let row = raw.data.len() / (v.len() / cols);
    for (r, out) in raw.data.chunks_exact(row).zip(v.chunks_exact_mut(cols)) {
        dequantize_row(q, r, out).unwrap();
    }
    v
}

#[test]
fn stored_blocks_score_as_their_f32_dequantization() {
    // 4 sequences of 200 tokens: the q8 rounding of the input moves each logit by up to some
    // 2e-2 either way on these random models (more on Gemma 2's, whose embedding is scaled by
    // 16), which 48 tokens average to within 2e-3 of the perplexity only narrowly. (Over 205k
    // tokens of prose, Gemma 2's Q8_0 file scores 2.3e-5 from its F32 dequantization here, and
    // 1.3e-3 with llama.cpp's `llama-perplexity -c 128 --chunks 8`.)
    let seqs: Vec<Vec<u32>> = (11..15)
        .map(|seed| leanstream_tests::tiny::random_ids(seed, 200, 4096))
        .collect();
    for (_, file) in files() {
        let g = GgufFile::open(&fixture(&file)).unwrap();
        let stored = perplexity(g.load_model().unwrap(), &seqs);
        let f32 = perplexity(dequantized(&g), &seqs);
        let rel = (stored - f32).abs() / f32;
        eprintln!("{file}: perplexity {stored:.4} stored, {f32:.4} F32 (rel {rel:.3e})");
        assert!(rel < PPL_TOL, "{file}: {stored} vs {f32}");
        assert!(rel > 0.0, "{file}: the stored blocks ran as f32");
    }
}

/// Several sequences decoded together straight from each GGUF file (`forward_batch`, as `serve
/// --parallel` steps its slots) give every row the bits of decoding that sequence alone: the
/// stored blocks take the batch's rows together on the integer kernels.
#[test]
fn a_batch_from_every_file_gives_each_row_its_own_bits() {
    let ids = leanstream_tests::tiny::random_ids(5, 40, 4096);
    let (rows, steps) = (3, 12);
    for (_, file) in files() {
        let mut model = GgufFile::open(&fixture(&file))
            .and_then(|g| g.load_model())
            .unwrap();
        assert!(model.batches_bitwise(), "{file}");
        let vocab = model.config().vocab_size;
        // Row i: a prompt of 1 + 2i tokens, then `steps` tokens one at a time.
        let start = |i: usize| 1 + 2 * i;
        let mut alone = Vec::new();
        for i in 0..rows {
            let mut cache = model.new_cache(CTX);
            let mut logits = Vec::new();
            model
                .forward_into(&ids[..start(i)], &mut cache, false, &mut logits)
                .unwrap();
            for &t in &ids[start(i)..start(i) + steps] {
                model
                    .forward_into(&[t], &mut cache, false, &mut logits)
                    .unwrap();
            }
            alone.push(logits);
        }
        // A wider batch first: the model keeps its scratch for the widest batch so far.
        let mut logits = Vec::new();
        let mut wide: Vec<_> = (0..rows + 2).map(|_| model.new_cache(CTX)).collect();
        let mut refs: Vec<_> = wide.iter_mut().collect();
        model
            .forward_batch(&ids[..rows + 2], &mut refs, &mut logits)
            .unwrap();
        let mut caches: Vec<_> = (0..rows).map(|_| model.new_cache(CTX)).collect();
        for (i, cache) in caches.iter_mut().enumerate() {
            model
                .forward_into(&ids[..start(i)], cache, false, &mut logits)
                .unwrap();
        }
        for step in 0..steps {
            let tokens: Vec<u32> = (0..rows).map(|i| ids[start(i) + step]).collect();
            let mut refs: Vec<_> = caches.iter_mut().collect();
            model
                .forward_batch(&tokens, &mut refs, &mut logits)
                .unwrap();
        }
        for (i, want) in alone.iter().enumerate() {
            let got = &logits[i * vocab..(i + 1) * vocab];
            assert!(
                got.iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{file}: row {i} of the batch differs from decoding it alone"
            );
        }
    }
}

/// `leanstream-prep inspect --json FILE`.
fn inspect(file: &Path) -> Value {
    let o = Command::new(bin("leanstream-prep"))
        .arg("inspect")
        .arg(file)
        .arg("--json")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Logits of every position of `ids` and 8 greedy tokens after its first 8, as bits.
fn outputs(file: &Path, policy: PolicyChoice, memory: Option<u64>, ids: &[u32]) -> Vec<u32> {
    let mut s = Session::open(&exact_options(file, policy, memory, CTX)).unwrap();
    let m = s.model();
    let mut cache = m.new_cache(CTX);
    let mut bits: Vec<u32> = m
        .forward(ids, &mut cache, true)
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    let mut cache = m.new_cache(CTX);
    let mut last = m.forward(&ids[..8], &mut cache, false).unwrap();
    for _ in 0..8 {
        let t = leanstream_tests::converted::argmax(&last);
        bits.push(t);
        last = m.forward(&[t], &mut cache, false).unwrap();
    }
    bits
}

/// `leanstream` streaming the bundles under a budget (at the least the file accepts, and with a
/// quarter of its bundles cached) computes the bits of `resident` (every bundle in memory).
fn streaming_is_resident(file: &Path, ids: &[u32]) {
    let want = outputs(file, PolicyChoice::Resident, None, ids);
    let f = LsbFile::open(file).unwrap();
    let least = leanstream::streaming::minimum_memory(file, CTX).unwrap();
    for memory in [least, least + f.ffn.bundle_bytes() / 4] {
        let got = outputs(file, PolicyChoice::Leanstream, Some(memory), ids);
        assert!(
            got == want,
            "leanstream at {memory} bytes: not the bits of resident"
        );
    }
}

#[test]
fn convert_keeps_q4_k_rows_and_streams_as_resident() {
    let gguf = fixture("llama-k.q4_k_m.gguf");
    let lsb = scratch().join("llama-k-q4_k_m.lsb");
    convert(&gguf, &lsb, &[]);
    let v = inspect(&lsb);
    // Per-part encodings are 1.8; the calibrated file's INPUT_BASIS makes it 1.10.
    assert_eq!(LsbFile::open(&lsb).unwrap().ffn.minor_version(), 8);
    assert_eq!(v["format_version"], "1.10");
    assert_eq!(
        (v["quant"].as_str(), v["dense_quant"].as_str()),
        (Some("mixed"), Some("mixed"))
    );
    // Layer 0's down projection is Q4_K in the GGUF, layer 1's Q6_K (llama-quantize gives some
    // layers more bits): their columns become q6_k and q8_0.
    for (l, down) in [(0, "q6_k"), (1, "q8_0")] {
        let e = &v["layers"][l]["encoding"];
        assert_eq!(
            (e["gate"].as_str(), e["up"].as_str()),
            (Some("q4_k"), Some("q4_k"))
        );
        assert_eq!(e["down"], down, "layer {l}");
    }
    let dense: BTreeMap<&str, &str> = v["dense_encodings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["name"].as_str().unwrap(), t["encoding"].as_str().unwrap()))
        .collect();
    assert_eq!(dense["model.embed_tokens.weight"], "q6_k");
    assert_eq!(dense["model.layers.0.self_attn.q_proj.weight"], "q4_k");
    assert_eq!(dense["model.norm.weight"], "f32");

    // Byte for byte: each gate row is the GGUF's; each up row decodes to the GGUF's times a power
    // of two (the gate_up rule's rescaling, made in the scale fields), its codes as stored.
    let f = LsbFile::open(&lsb).unwrap();
    let g = GgufFile::open(&gguf).unwrap();
    let (h, n) = (256, 512);
    let mut reader = std::fs::File::open(&lsb).unwrap();
    for (l, layer) in f.ffn.layers.iter().enumerate() {
        let p = format!("model.layers.{l}.mlp");
        let gate = g
            .raw_tensor(&format!("{p}.gate_proj.weight"), &[n, h])
            .unwrap();
        let up = g
            .raw_tensor(&format!("{p}.up_proj.weight"), &[n, h])
            .unwrap();
        let [rb, ub, _] = layer.row_bytes();
        let down = dequantized_matrix(&g, &format!("{p}.down_proj.weight"), &[h, n]);
        let (mut worst, mut sq, mut src_sq) = (0.0f64, 0.0f64, 0.0f64);
        for (ci, c) in layer.clusters.iter().enumerate() {
            let (off, size) = f.cluster_extent(l, ci);
            let bytes =
                leanstream_format::container::read_at(&mut reader, &lsb, off, size).unwrap();
            for k in 0..c.count as usize {
                let i = layer.perm[c.first as usize + k] as usize;
                let row = |part| layer.row(&bytes, ci, k, part);
                assert_eq!(row(Part::Gate), &gate.data[i * rb..(i + 1) * rb], "{l} {i}");
                let ours = row(Part::Up);
                let theirs = &up.data[i * ub..(i + 1) * ub];
                // Q4_K: d and dmin (4 bytes) then scales and codes (140 bytes) per 256 values.
                for (a, b) in ours.chunks_exact(144).zip(theirs.chunks_exact(144)) {
                    assert_eq!(a[4..], b[4..], "layer {l} neuron {i}: up codes");
                }
                let (mut x, mut y) = (vec![0.0f32; h], vec![0.0f32; h]);
                dequantize_row(QuantType::Q4_K, ours, &mut x).unwrap();
                dequantize_row(QuantType::Q4_K, theirs, &mut y).unwrap();
                let j = y.iter().position(|v| *v != 0.0).unwrap();
                let scale = x[j] / y[j];
                assert_eq!(
                    scale,
                    2f32.powi(scale.log2().round() as i32),
                    "a power of two"
                );
                assert!(x.iter().zip(&y).all(|(a, b)| *a == b * scale), "{l} {i}");
                // The down column, encoded afresh and divided by the same power of two.
                let mut col = vec![0.0f32; h];
                dequantize_row(layer.qtypes.down, row(Part::Down), &mut col).unwrap();
                for (r, c) in col.iter().enumerate() {
                    let (got, want) = ((c * scale) as f64, down[r * n + i] as f64);
                    worst = worst.max((got - want).abs());
                    (sq, src_sq) = (sq + (got - want).powi(2), src_sq + want.powi(2));
                }
            }
        }
        // Against the source's dequantized values, relative to their RMS: q6_k columns of a Q4_K
        // matrix, q8_0 of a Q6_K one.
        let rms = (src_sq / (h * n) as f64).sqrt();
        let (max_rel, rms_rel) = (worst / rms, (sq / src_sq).sqrt());
        eprintln!(
            "layer {l}: down columns {} from the GGUF's {:?}: max error {max_rel:.3e}, RMS error \
             {rms_rel:.3e} of the matrix's RMS",
            layer.qtypes.down,
            g.raw_tensor(&format!("{p}.down_proj.weight"), &[h, n])
                .unwrap()
                .dtype
        );
        let bound = if layer.qtypes.down == QuantType::Q6_K {
            0.03
        } else {
            0.01
        };
        assert!(rms_rel > 0.0 && rms_rel < bound, "layer {l}: {rms_rel}");
    }
    streaming_is_resident(&lsb, &token_ids());
}

/// The other families' Q4_K_M files convert with their gate and up rows kept as Q4_K (the down
/// columns at no fewer bits than the source's Q4_K or Q6_K), and stream with `resident`'s bits.
#[test]
fn every_family_converts_keeping_q4_k_rows() {
    for family in &FAMILIES[1..] {
        let lsb = scratch().join(format!("{family}-q4_k_m.lsb"));
        convert(&fixture(&format!("{family}.q4_k_m.gguf")), &lsb, &[]);
        let v = inspect(&lsb);
        for (l, layer) in v["layers"].as_array().unwrap().iter().enumerate() {
            let e = &layer["encoding"];
            assert_eq!(
                (e["gate"].as_str(), e["up"].as_str()),
                (Some("q4_k"), Some("q4_k")),
                "{family} layer {l}"
            );
            let down = e["down"].as_str().unwrap();
            assert!(
                ["q6_k", "q8_0"].contains(&down),
                "{family} layer {l}: {down}"
            );
        }
        streaming_is_resident(&lsb, &token_ids());
    }
}

#[test]
fn forced_k_quants_write_1_7_and_narrow_rows_are_refused() {
    // One encoding for everything: a 1.7 file, which this reader reads as before.
    let lsb = scratch().join("llama-k-forced-q4_k.lsb");
    convert(&fixture("llama-k.q4_k_m.gguf"), &lsb, &["--quant", "q4_k"]);
    let f = LsbFile::open(&lsb).unwrap();
    // The K-quants are 1.7; the calibrated file's INPUT_BASIS makes it 1.10.
    assert_eq!(f.ffn.minor_version(), 7);
    assert_eq!(f.header.version_minor, 10);
    for l in &f.ffn.layers {
        assert_eq!(l.qtypes.single(), Some(QuantType::Q4_K));
    }
    streaming_is_resident(&lsb, &token_ids());

    // A model 64 wide cannot be held in 256-value blocks: the error says so and what to use.
    let o = Command::new(bin("leanstream-prep"))
        .arg("convert")
        .arg(fixture("llama3"))
        .args(["-o", "/nonexistent/never.lsb", "--quant", "q5_k"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("--quant q5_k cannot encode this model")
            && err.contains("hidden_size = 64 is no multiple of 256")
            && err.contains("use q8"),
        "{err}"
    );
}

/// `leanstream perplexity` on each fixture, with the f16 and the f32 KV cache, gives the same bits
/// (the JSON's mean negative log-likelihood, printed exactly) under every kernel set this CPU runs:
/// the K-quant, `Q8_0` and float kernels, the attention's among them, compute the portable bits.
/// (The Q6_K file's perplexity once differed by 1.5e-4 between the AVX-512 and portable sets.)
#[test]
fn every_kernel_set_scores_the_fixtures_bit_for_bit() {
    let text = scratch().join("llama-k-kernel-sets.txt");
    let words = "the quick brown fox jumps over the lazy dog while seven wizards quietly box \
                 and judge a sphinx of black quartz; ";
    std::fs::write(&text, words.repeat(4)).unwrap();
    let sets: Vec<&str> = leanstream::kernels::RowKernels::available()
        .iter()
        .map(|k| k.isa)
        .collect();
    for (_, file) in files() {
        for kv in ["f16", "f32"] {
            let nll: Vec<(String, String)> = sets
                .iter()
                .map(|set| {
                    let o = Command::new(bin("leanstream"))
                        .env("LEANSTREAM_KERNELS", set)
                        .args(["perplexity", "--threads", "1", "--kv", kv, "--json"])
                        .arg("--model")
                        .arg(fixture(&file))
                        .arg("--file")
                        .arg(&text)
                        .output()
                        .unwrap();
                    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
                    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
                    assert_eq!(v["kernels"], *set);
                    assert!(v["tokens"].as_u64().unwrap() > 100, "{v}");
                    (set.to_string(), v["mean_nll"].to_string())
                })
                .collect();
            eprintln!("{file} --kv {kv}: {nll:?}");
            assert!(
                nll.iter().all(|(_, v)| *v == nll[0].1),
                "{file} --kv {kv}: {nll:?}"
            );
        }
    }
}
