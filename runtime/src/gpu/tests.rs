//! The GPU mat-vec against the CPU kernels, for every encoding. These tests need an adapter: on a
//! machine without a GPU, Mesa's lavapipe (`mesa-vulkan-drivers`) is one.

use std::path::Path;
use std::sync::OnceLock;

use leanstream_format::quant::{QuantType, BLOCK_LEN};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::kernels::{Matrix, Q8Vec, Weight};
use crate::model::{Attention, DenseWeights, LanguageModel, Projections};

fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        let gpu = Gpu::new().unwrap_or_else(|e| {
            panic!("the gpu tests need a Vulkan adapter (lavapipe: mesa-vulkan-drivers): {e:#}")
        });
        eprintln!("GPU: {}", gpu.describe());
        gpu
    })
}

/// A `rows × cols` matrix of values in ±1, each row scaled by a factor from 2⁻⁴ to 2⁴ (and some
/// exact zeros), so that rows differ in magnitude and blocks in scale.
fn random_matrix(rng: &mut StdRng, rows: usize, cols: usize) -> Matrix {
    let mut data = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let scale = 2f32.powi(rng.random_range(-4..=4));
        data.extend((0..cols).map(|_| {
            if rng.random_range(0..16) == 0 {
                0.0
            } else {
                scale * rng.random_range(-1.0f32..1.0)
            }
        }));
    }
    Matrix::new(rows, cols, data)
}

fn random_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()
}

/// [`tolerance`]'s magnitude `A` of row `r` of `w` against `x`.
fn magnitude(w: &Weight, r: usize, x: &[f32]) -> f64 {
    let mut row = vec![0.0; w.cols()];
    w.row_f32(r, &mut row);
    if !w.qtype().is_block() {
        return row.iter().zip(x).map(|(a, b)| (a * b).abs() as f64).sum();
    }
    let q8 = Q8Vec::quantize(x);
    row.chunks_exact(BLOCK_LEN)
        .enumerate()
        .map(|(g, vals)| {
            let m = vals.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
            (g * BLOCK_LEN..(g + 1) * BLOCK_LEN)
                .map(|i| 4.0 * m * q8.value(i).abs() as f64)
                .sum::<f64>()
        })
        .sum()
}

/// Uploads `w`, runs one mat-vec on each side and checks every row within [`tolerance`]; returns
/// the largest difference as a share of its row's tolerance.
fn check(w: &Weight, x: &[f32]) -> f64 {
    let m = gpu().upload(w).unwrap();
    assert_eq!(m.bytes, w.bytes(), "the weights go up as stored");
    let mut gpu_out = vec![f32::NAN; w.rows()];
    gpu().matvec(&m, x, &mut gpu_out).unwrap();
    let mut cpu_out = vec![0.0; w.rows()];
    w.matmul_t(x, 1, &mut cpu_out);
    let mut worst = 0.0f64;
    for r in 0..w.rows() {
        let (g, c) = (gpu_out[r] as f64, cpu_out[r] as f64);
        let tol = tolerance(w.qtype(), w.cols(), magnitude(w, r, x));
        let diff = (g - c).abs();
        assert!(
            diff <= tol,
            "{} {}×{} row {r}: GPU {g} CPU {c}, difference {diff:e} over the tolerance {tol:e}",
            w.qtype(),
            w.rows(),
            w.cols()
        );
        worst = worst.max(diff / tol.max(f64::MIN_POSITIVE));
    }
    // Not a vacuous pass: the rows hold real, non-zero results.
    assert!(cpu_out.iter().filter(|v| v.abs() > 1e-3).count() > w.rows() / 2);
    worst
}

#[test]
fn every_encoding_matches_the_cpu_kernels() {
    let mut rng = StdRng::seed_from_u64(39);
    // 512 columns: two K-quant super-blocks, 16 blocks of 32; 300 rows: several workgroups' worth
    // of rows, not a multiple of anything.
    let f32m = Weight::F32(random_matrix(&mut rng, 300, 512));
    let x = random_vec(&mut rng, 512);
    for qtype in QuantType::ALL {
        let w = f32m.quantize(qtype).unwrap();
        let worst = check(&w, &x);
        eprintln!("{qtype}: largest difference {worst:.3} of the tolerance");
    }
}

#[test]
fn long_rows_and_odd_float_lengths() {
    let mut rng = StdRng::seed_from_u64(7);
    // 4096 columns: 64 invocations take 64 values (or two blocks) each.
    let m = Weight::F32(random_matrix(&mut rng, 40, 4096));
    let x = random_vec(&mut rng, 4096);
    for qtype in [
        QuantType::Q4_0,
        QuantType::Q4_K,
        QuantType::Q6_K,
        QuantType::F16,
    ] {
        check(&m.quantize(qtype).unwrap(), &x);
    }
    // Float rows of any length: 75 f16 values are 150 bytes, so rows start at 2-byte alignment.
    let m = Weight::F32(random_matrix(&mut rng, 33, 75));
    let x = random_vec(&mut rng, 75);
    for qtype in [QuantType::F32, QuantType::F16, QuantType::BF16] {
        check(&m.quantize(qtype).unwrap(), &x);
    }
}

#[test]
fn small_integers_are_exact() {
    // Integer weights and inputs: every product and partial sum is exact in f32, so the GPU's
    // results are these numbers, whatever its order of addition.
    let w = Weight::F32(Matrix::new(
        3,
        4,
        vec![1.0, 2.0, 3.0, 4.0, -1.0, 0.0, 5.0, 2.0, 0.0, 0.0, 0.0, 0.0],
    ));
    let x = [4.0, 5.0, 6.0, -1.0];
    let m = gpu().upload(&w).unwrap();
    let mut out = [f32::NAN; 3];
    gpu().matvec(&m, &x, &mut out).unwrap();
    assert_eq!(out, [28.0, 24.0, 0.0]);
    // The same through f16 (a row of the values 0..31, exact in f16, against ones).
    let w = Weight::F32(Matrix::new(1, 32, (0..32).map(|v| v as f32).collect()))
        .quantize(QuantType::F16)
        .unwrap();
    let m = gpu().upload(&w).unwrap();
    let mut out = [f32::NAN];
    gpu().matvec(&m, &[1.0; 32], &mut out).unwrap();
    assert_eq!(out, [496.0]);
}

#[test]
fn more_rows_than_one_dispatch_dimension() {
    // Beyond 65 535 workgroups in x (the usual limit), rows continue in y.
    let mut rng = StdRng::seed_from_u64(3);
    let rows = 65_600;
    let w = Weight::F32(random_matrix(&mut rng, rows, 32))
        .quantize(QuantType::Q4_0)
        .unwrap();
    let x = random_vec(&mut rng, 32);
    check(&w, &x);
}

#[test]
fn repeated_dispatches_give_the_same_result() {
    let mut rng = StdRng::seed_from_u64(11);
    let w = Weight::F32(random_matrix(&mut rng, 64, 256))
        .quantize(QuantType::Q4_1)
        .unwrap();
    let x = random_vec(&mut rng, 256);
    let m = gpu().upload(&w).unwrap();
    let (mut once, mut many) = (vec![0.0; 64], vec![0.0; 64]);
    gpu().matvec(&m, &x, &mut once).unwrap();
    gpu().matvec_repeated(&m, &x, &mut many, 5).unwrap();
    assert_eq!(once, many);
}

#[test]
fn wrong_lengths_are_errors() {
    let w = Weight::F32(Matrix::new(2, 32, vec![1.0; 64]));
    let m = gpu().upload(&w).unwrap();
    let err = gpu()
        .matvec(&m, &[1.0; 31], &mut [0.0; 2])
        .unwrap_err()
        .to_string();
    assert_eq!(err, "a 2×32 mat-vec got 31 inputs and 2 outputs");
}

#[test]
fn no_adapter_is_an_error_that_says_so() {
    // GL is not built in: no backend, no adapter.
    let err = match Gpu::with_backends(wgpu::Backends::GL) {
        Ok(gpu) => panic!("found {}", gpu.describe()),
        Err(e) => e.to_string(),
    };
    assert!(
        err.starts_with("no GPU adapter (Vulkan or Metal) found"),
        "{err}"
    );
}

/// The CPU's dense weights, keeping what the head was given.
struct Recorder<'a> {
    p: &'a Projections,
    xn: Vec<f32>,
}

impl DenseWeights for Recorder<'_> {
    fn embed(&mut self, tokens: &[u32], out: &mut [f32]) -> anyhow::Result<()> {
        let mut p = self.p;
        p.embed(tokens, out)
    }

    fn attention(&mut self, l: usize) -> anyhow::Result<&Attention> {
        Ok(&self.p.attention[l])
    }

    fn head(&mut self, xn: &[f32], rows: usize, logits: &mut [f32]) -> anyhow::Result<()> {
        self.xn = xn.to_vec();
        let mut p = self.p;
        p.head(xn, rows, logits)
    }
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
}

#[test]
fn the_dense_path_with_its_head_on_the_gpu() {
    // The embedded model (tied head: its bf16 embedding, held as f32).
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/austen-relu");
    let cpu = crate::source::open(&path).unwrap().model;
    let p = cpu.projections().unwrap();
    let (gpu, head) = GpuModel::head_for(&cpu).unwrap();
    let mut on_gpu = GpuModel::new(
        crate::source::open(&path).unwrap().model,
        gpu,
        Placement::Head(Box::new(head), "a test".into()),
    );
    assert!(
        on_gpu.describe().starts_with("the output head ("),
        "{}",
        on_gpu.describe()
    );

    let prompt = [12u32, 345, 6, 789, 10];
    let (mut cpu_cache, mut gpu_cache) = (cpu.new_cache(32), on_gpu.new_cache(32));
    let mut rec = Recorder { p, xn: Vec::new() };
    let (mut cpu_logits, mut gpu_logits) = (Vec::new(), Vec::new());
    let mut cpu_tokens = Vec::new();
    let mut gpu_tokens = Vec::new();
    let (mut next_cpu, mut next_gpu) = (prompt.to_vec(), prompt.to_vec());
    for _ in 0..6 {
        cpu.forward_with(
            &next_cpu,
            &mut cpu_cache,
            false,
            None,
            Some(&mut rec),
            &mut cpu_logits,
        )
        .unwrap();
        on_gpu
            .forward_into(&next_gpu, &mut gpu_cache, false, &mut gpu_logits)
            .unwrap();
        // Everything before the head ran on the CPU, the same on both sides: the logits differ
        // only by the head's mat-vec, within its tolerance against the head's input.
        let head = p.lm_head.as_ref().unwrap_or(&p.embed);
        assert_eq!(gpu_logits.len(), head.rows());
        for (r, (g, c)) in gpu_logits.iter().zip(&cpu_logits).enumerate() {
            let tol = tolerance(head.qtype(), head.cols(), magnitude(head, r, &rec.xn));
            assert!(
                ((g - c).abs() as f64) <= tol,
                "logit {r}: GPU {g} CPU {c}, tolerance {tol:e}"
            );
        }
        cpu_tokens.push(argmax(&cpu_logits));
        gpu_tokens.push(argmax(&gpu_logits));
        next_cpu = vec![*cpu_tokens.last().unwrap()];
        next_gpu = vec![*gpu_tokens.last().unwrap()];
    }
    assert_eq!(gpu_tokens, cpu_tokens);
}

#[test]
fn q8_on_the_gpu_is_the_cpus_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(5);
    // Blocks whose scales run from 1e-30 to 1e30, so the exactly rounded divisions see every kind
    // of significand and exponent.
    let mut x: Vec<f32> = (0..2048)
        .flat_map(|_| {
            let scale = 10f32.powi(rng.random_range(-30..=30));
            let v: Vec<f32> = (0..BLOCK_LEN)
                .map(|_| scale * rng.random_range(-1.0f32..1.0))
                .collect();
            v
        })
        .collect();
    // A block of zeros; one whose scale is 1, so that x.5 rounds to the even neighbour; one
    // value throughout.
    x[..32].fill(0.0);
    for (i, v) in x[32..64].iter_mut().enumerate() {
        *v = if i == 0 { 127.0 } else { i as f32 - 16.5 };
    }
    x[64..96].fill(-3.0);
    let on_gpu = layers::quantize_on(gpu(), &x).unwrap();
    let mut on_cpu = Vec::new();
    pack_input(QuantType::Q8_0, &x, &mut on_cpu);
    assert_eq!(on_gpu.len(), on_cpu.len());
    if let Some(i) = on_gpu.iter().zip(&on_cpu).position(|(g, c)| g != c) {
        panic!(
            "word {i} of {}: GPU {:#010x}, CPU {:#010x}",
            on_cpu.len(),
            on_gpu[i],
            on_cpu[i]
        );
    }
}

/// A small random model of `arch` (Hugging Face's `config.json` keys in `extra` added), SwiGLU
/// unless `extra` says otherwise: 2 layers, hidden 256, 4 query heads and 2 KV heads of 64, FFN
/// 256, vocabulary 256 (256 columns: the K-quants' super-block). As tests/src/tiny.rs's models, its weights are far from a trained
/// model's: norm weights random, attention peaked, logits spread over a few units, so that a
/// wrong rope or a missing norm moves the logits far beyond the tolerance.
fn tiny_model(arch: &str, extra: serde_json::Value, seed: u64) -> crate::model::Model {
    let mut cfg = serde_json::json!({
        "architectures": [arch],
        "hidden_act": "silu",
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "max_position_embeddings": 64,
    });
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    let config = crate::source::config::from_hf_json(&cfg.to_string()).unwrap();
    let rng = std::cell::RefCell::new(StdRng::seed_from_u64(seed));
    crate::model::Model::from_hf_tensors(config, |name, shape| {
        let mut rng = rng.borrow_mut();
        let n: usize = shape.iter().product();
        let cols = *shape.last().unwrap() as f32;
        let (center, spread) = if name.ends_with("norm.weight") {
            (1.0, 0.5)
        } else if name.ends_with("bias") {
            (0.0, 0.5)
        } else if name.contains("embed_tokens") {
            (0.0, 1.0)
        } else if name.contains("q_proj") || name.contains("k_proj") {
            (0.0, 4.0 / cols.sqrt())
        } else if name.contains("lm_head") {
            (0.0, 6.0 / cols.sqrt())
        } else {
            (0.0, 2.0 / cols.sqrt())
        };
        Ok((0..n)
            .map(|_| center + spread * rng.random_range(-1.0f32..1.0))
            .collect())
    })
    .unwrap()
}

/// The largest difference between two logit rows over the largest magnitude of the CPU's.
fn relative_difference(gpu: &[f32], cpu: &[f32]) -> f32 {
    let top = cpu.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let diff = gpu
        .iter()
        .zip(cpu)
        .fold(0.0f32, |m, (g, c)| m.max((g - c).abs()));
    diff / top
}

/// How far one step's logits on the GPU may lie from the CPU's, relative to the largest CPU logit:
/// an empirical bound (docs/gpu.md, "Tolerance"), about 40 times the largest difference seen on
/// lavapipe, and below what the CPU itself changes with an f16 KV cache (which
/// [`compare_steps`] checks, so that an error of that size would fail).
const STEP_TOLERANCE: f32 = 1e-4;

/// Runs `prompt` and six greedy tokens through the CPU (`cpu`, f32 KV cache) and the GPU
/// (`on_gpu`, its whole step there): the same tokens, and each step's logits within
/// [`STEP_TOLERANCE`]; then every logit of the prompt, and the GPU's KV cache following the
/// caller's — cut back, and replaced by one the CPU filled. Also checks that the tolerance is
/// tighter than the change an f16 KV cache makes on the CPU. Returns the largest relative
/// difference seen.
fn compare_steps(cpu: &crate::model::Model, on_gpu: &mut GpuModel, prompt: &[u32]) -> f32 {
    assert!(on_gpu.runs_layers(), "{}", on_gpu.describe());
    let mut cpu_model = cpu;
    let (mut cpu_cache, mut gpu_cache) = (cpu.new_cache(32), on_gpu.new_cache(32));
    let (mut cpu_logits, mut gpu_logits) = (Vec::new(), Vec::new());
    let mut worst = 0.0f32;
    let mut check = |what: &str, gpu: &[f32], cpu: &[f32]| {
        assert_eq!(gpu.len(), cpu.len());
        let d = relative_difference(gpu, cpu);
        assert!(
            d <= STEP_TOLERANCE,
            "{what}: the GPU's logits differ from the CPU's by {d:e} of the largest"
        );
        assert_eq!(argmax(gpu), argmax(cpu), "{what}: another token");
        worst = worst.max(d);
    };
    let mut next = prompt.to_vec();
    let mut f16_cache =
        crate::model::kv_cache::KvCache::new(cpu.config(), 32, crate::model::kv_cache::KvType::F16);
    let mut f16_logits = Vec::new();
    let mut f16_worst = 0.0f32;
    for step in 0..6 {
        cpu_model
            .forward_into(&next, &mut cpu_cache, false, &mut cpu_logits)
            .unwrap();
        cpu_model
            .forward_into(&next, &mut f16_cache, false, &mut f16_logits)
            .unwrap();
        f16_worst = f16_worst.max(relative_difference(&f16_logits, &cpu_logits));
        on_gpu
            .forward_into(&next, &mut gpu_cache, false, &mut gpu_logits)
            .unwrap();
        check(&format!("step {step}"), &gpu_logits, &cpu_logits);
        next = vec![argmax(&cpu_logits)];
    }
    // Every logit of a prompt, as scoring asks for them.
    cpu_cache.clear();
    gpu_cache.clear();
    cpu_model
        .forward_into(prompt, &mut cpu_cache, true, &mut cpu_logits)
        .unwrap();
    on_gpu
        .forward_into(prompt, &mut gpu_cache, true, &mut gpu_logits)
        .unwrap();
    check("all logits", &gpu_logits, &cpu_logits);
    // A conversation cut back to 3 positions goes on from there.
    cpu_cache.truncate(3);
    gpu_cache.truncate(3);
    cpu_model
        .forward_into(&[7], &mut cpu_cache, false, &mut cpu_logits)
        .unwrap();
    on_gpu
        .forward_into(&[7], &mut gpu_cache, false, &mut gpu_logits)
        .unwrap();
    check("after a cut", &gpu_logits, &cpu_logits);
    // A cache the GPU has not seen (filled by the CPU) is uploaded before the step.
    let mut other = cpu.new_cache(32);
    cpu_model
        .forward_into(&prompt[1..], &mut other, false, &mut cpu_logits)
        .unwrap();
    let mut copy = cpu.new_cache(32);
    copy.restore(&other.save()).unwrap();
    cpu_model
        .forward_into(&[9], &mut other, false, &mut cpu_logits)
        .unwrap();
    on_gpu
        .forward_into(&[9], &mut copy, false, &mut gpu_logits)
        .unwrap();
    check("another cache", &gpu_logits, &cpu_logits);
    // Not a tolerance any error passes: rounding the KV cache to f16 fails it.
    assert!(
        f16_worst > STEP_TOLERANCE,
        "an f16 KV cache changes the CPU's logits by {f16_worst:e} only"
    );
    worst
}

#[test]
fn the_decode_step_on_the_gpu_embedded_model() {
    // The embedded ReLU Llama, its weights f32 (stored bf16).
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/austen-relu");
    let cpu = crate::source::open(&path).unwrap().model;
    let (gpu, placement) = GpuModel::upload(&cpu).unwrap();
    let mut on_gpu = GpuModel::new(crate::source::open(&path).unwrap().model, gpu, placement);
    let worst = compare_steps(&cpu, &mut on_gpu, &[12, 345, 6, 789, 10]);
    eprintln!("austen-relu f32: largest difference {worst:e} of the largest logit");
}

#[test]
fn the_decode_step_on_the_gpu_small_swiglu_models() {
    let cases = [
        // Llama 3's rope scaling and a sliding window shorter than the sequence; q8_0 layers, a
        // q6_k head.
        (
            "LlamaForCausalLM",
            serde_json::json!({
                "sliding_window": 4,
                "rope_scaling": {
                    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16
                }
            }),
            QuantType::Q8_0,
            QuantType::Q6_K,
        ),
        // Qwen3's q/k norms; q4_k layers, an f16 head.
        (
            "Qwen3ForCausalLM",
            serde_json::json!({}),
            QuantType::Q4_K,
            QuantType::F16,
        ),
        // Qwen2's q/k/v biases; SmolLM3-style layers without rope are in the next case.
        (
            "Qwen2ForCausalLM",
            serde_json::json!({}),
            QuantType::Q5_1,
            QuantType::Q4_0,
        ),
        (
            "SmolLM3ForCausalLM",
            serde_json::json!({"no_rope_layers": [1, 0]}),
            QuantType::F32,
            QuantType::F32,
        ),
    ];
    for (seed, (arch, extra, layers, head)) in cases.into_iter().enumerate() {
        let make = || {
            tiny_model(arch, extra.clone(), seed as u64)
                .quantize(layers, head)
                .unwrap()
        };
        let cpu = make();
        let (gpu, placement) = GpuModel::upload(&cpu).unwrap();
        let mut on_gpu = GpuModel::new(make(), gpu, placement);
        let worst = compare_steps(&cpu, &mut on_gpu, &[12, 145, 6, 89, 10]);
        eprintln!("{arch} {layers}/{head}: largest difference {worst:e} of the largest logit");
    }
}

#[test]
fn unsupported_blocks_keep_the_layers_on_the_cpu() {
    let gemma = tiny_model(
        "Gemma2ForCausalLM",
        serde_json::json!({"hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": 64}),
        1,
    );
    let (gpu, placement) = GpuModel::upload(&gemma).unwrap();
    let on_gpu = GpuModel::new(gemma, gpu, placement);
    assert!(!on_gpu.runs_layers());
    let line = on_gpu.describe();
    assert!(
        line.starts_with("the output head (")
            && line.contains("the layers stay on the CPU: Gemma2"),
        "{line}"
    );
}
