//! The GPU mat-vec against the CPU kernels, for every encoding. These tests need an adapter: on a
//! machine without a GPU, Mesa's lavapipe (`mesa-vulkan-drivers`) is one.

use std::path::Path;
use std::sync::{Arc, OnceLock};

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
    tiny_model_with(arch, extra, seed, |_, _| {})
}

/// [`tiny_model`] with `edit(name, values)` applied to each tensor as it is made.
fn tiny_model_with(
    arch: &str,
    extra: serde_json::Value,
    seed: u64,
    edit: impl FnMut(&str, &mut Vec<f32>),
) -> crate::model::Model {
    let edit = std::cell::RefCell::new(edit);
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
        let mut values = (0..n)
            .map(|_| center + spread * rng.random_range(-1.0f32..1.0))
            .collect();
        (edit.borrow_mut())(name, &mut values);
        Ok(values)
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
fn compare_steps(cpu: &crate::model::Model, on_gpu: &mut dyn LanguageModel, prompt: &[u32]) -> f32 {
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
    assert!(on_gpu.runs_layers(), "{}", on_gpu.describe());
    let worst = compare_steps(&cpu, &mut on_gpu, &[12, 345, 6, 789, 10]);
    eprintln!("austen-relu f32: largest difference {worst:e} of the largest logit");
}

#[test]
fn the_budget_is_a_size_named_in_its_errors() {
    assert_eq!(budget_from(None).unwrap(), None);
    assert_eq!(budget_from(Some(" ")).unwrap(), None);
    assert_eq!(budget_from(Some("512MiB")).unwrap(), Some(512 << 20));
    assert_eq!(budget_from(Some("2G")).unwrap(), Some(2_000_000_000));
    for bad in ["0", "lots", "-1G"] {
        let e = budget_from(Some(bad)).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("LEANSTREAM_GPU_MEMORY={bad}: ")),
            "{e}"
        );
    }
}

/// A budget decides what goes to the GPU: the whole step with its KV cache, the step without
/// room for the cache (the model goes on on the CPU at the first token), the head alone, or
/// nothing; every buffer is charged, so the budget the step reports is the least that takes it.
#[test]
fn the_gpu_memory_budget_decides_what_goes_there() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/austen-relu");
    let cpu = crate::source::open(&path).unwrap().model;
    let open = |budget: u64| {
        let gpu = Gpu::new().unwrap().with_budget(Some(budget));
        GpuModel::upload_on(Arc::new(gpu), &cpu)
    };
    let (_, placement) = GpuModel::upload_on(Arc::new(Gpu::new().unwrap()), &cpu).unwrap();
    let Placement::Layers(layers) = placement else {
        panic!("the embedded model's step runs on the GPU")
    };
    let step = layers.bytes() as u64;
    let c = cpu.config();
    let ctx = 32;
    let kv = 2 * c.num_layers * 4 * c.num_kv_heads * ctx * c.head_dim + 4 * c.num_heads * ctx;
    let prompt = [12u32, 345, 6];
    let run = |budget: u64| {
        let (gpu, placement) = open(budget).unwrap();
        let mut model = GpuModel::new(crate::source::open(&path).unwrap().model, gpu, placement);
        let (mut cache, mut logits) = (model.new_cache(ctx), Vec::new());
        model
            .forward_into(&prompt, &mut cache, false, &mut logits)
            .unwrap();
        (model.runs_layers(), model.describe(), logits)
    };
    let mut cpu_logits = Vec::new();
    let mut cache = cpu.new_cache(ctx);
    (&cpu)
        .forward_into(&prompt, &mut cache, false, &mut cpu_logits)
        .unwrap();
    // Room for the step and its cache: everything on the GPU.
    let (layers_run, line, logits) = run(step + kv as u64);
    assert!(layers_run, "{line}");
    assert!(relative_difference(&logits, &cpu_logits) <= STEP_TOLERANCE);
    // The step fits, its cache does not: the first token goes on on the CPU, the same logits.
    let (layers_run, line, logits) = run(step + kv as u64 - 1);
    assert!(!layers_run, "{line}");
    assert_eq!(logits, cpu_logits, "the CPU's own logits");
    // One byte short of the step: the head alone, saying why.
    let (_, placement) = open(step - 1).unwrap();
    let Placement::Head(_, why) = placement else {
        panic!("a budget below the step keeps the layers on the CPU")
    };
    assert!(why.contains("that --gpu-memory allows"), "{why}");
    // Below the head: an error, the model stays on the CPU.
    let e = format!("{:#}", open(1 << 10).err().expect("nothing fits 1 KiB"));
    assert!(e.contains("that --gpu-memory allows"), "{e}");
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
        assert!(on_gpu.runs_layers(), "{}", on_gpu.describe());
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

/// A model on the CPU with its decode step on the GPU from bundles ([`GpuBundles`]): the CPU
/// model's norms, attention and head, `bundles` its FFN.
struct OnGpuBundles<'a> {
    model: &'a crate::model::Model,
    gpu: GpuBundles,
}

impl LanguageModel for OnGpuBundles<'_> {
    fn config(&self) -> &crate::source::config::ModelConfig {
        self.model.config()
    }

    fn new_cache(&self, ctx: usize) -> crate::model::kv_cache::KvCache {
        self.model.new_cache(ctx)
    }

    fn forward_into(
        &mut self,
        tokens: &[u32],
        cache: &mut crate::model::kv_cache::KvCache,
        all_logits: bool,
        logits: &mut Vec<f32>,
    ) -> anyhow::Result<()> {
        let embed = &self.model.projections().unwrap().embed;
        let embed = |t: u32, row: &mut [f32]| {
            embed.rows_f32(&[t], row);
            Ok(())
        };
        assert!(self.gpu.forward(
            self.model,
            embed,
            tokens,
            cache,
            all_logits,
            logits,
            super::Host::None
        )?);
        Ok(())
    }
}

fn f32_weight_bytes(w: &Weight) -> Vec<u8> {
    match w {
        Weight::F32(m) => f32_bytes(&m.data).to_vec(),
        Weight::Encoded(_) => panic!("an f32 weight"),
    }
}

/// The bundle FFN's kernels against the CPU's dense FFN, with the down columns in every encoding:
/// a small random model (2 layers, hidden 256, 256 neurons) whose down matrix holds exactly the
/// values its columns decode to, and as bundles its f32 gate and up rows and those encoded
/// columns. Under ReLU with threshold 0 the skipped neurons are those whose activation is 0 (the
/// rest the GPU computes from its list); under SiLU with threshold −∞ every neuron is listed, by
/// both rules. Each step within the step tolerance of the CPU, the same greedy tokens.
#[test]
fn the_bundle_ffn_with_every_down_encoding() {
    use crate::streaming::skip_rule::{Skip, SkipRule};
    use leanstream_format::ffn::PartTypes;
    use leanstream_format::quant::{dequantize_row, quantize_row};
    for (seed, down) in QuantType::ALL.into_iter().enumerate() {
        let cases = [
            ("relu", SkipRule::Gate, 0.0f32),
            ("silu", SkipRule::GateUp, f32::NEG_INFINITY),
            ("silu", SkipRule::Gate, f32::NEG_INFINITY),
        ];
        // Every encoding under ReLU; SiLU's two rules on two of them.
        let take = if matches!(down, QuantType::Q8_0 | QuantType::Q4_K) {
            3
        } else {
            1
        };
        for (act, rule, threshold) in cases.into_iter().take(take) {
            let mut columns: Vec<Vec<u8>> = Vec::new();
            let cpu = tiny_model_with(
                "LlamaForCausalLM",
                serde_json::json!({ "hidden_act": act }),
                100 + seed as u64,
                |name, values| {
                    if !name.ends_with("down_proj.weight") {
                        return;
                    }
                    // [hidden][neuron]: each neuron's column encoded, and decoded in place.
                    let (h, n) = (256, values.len() / 256);
                    let mut bytes = Vec::new();
                    let mut col = vec![0.0f32; h];
                    for i in 0..n {
                        (0..h).for_each(|r| col[r] = values[r * n + i]);
                        let row = quantize_row(down, &col).unwrap();
                        dequantize_row(down, &row, &mut col).unwrap();
                        (0..h).for_each(|r| values[r * n + i] = col[r]);
                        bytes.extend_from_slice(&row);
                    }
                    columns.push(bytes);
                },
            );
            let p = cpu.projections().unwrap();
            let head = p.lm_head.as_ref().unwrap_or(&p.embed);
            let gpu = GpuBundles::upload(Gpu::new().unwrap(), &cpu, &p.attention, head, |l| {
                let Some(crate::model::FfnWeights::Dense(ffn)) = &cpu.blocks()[l].ffn else {
                    unreachable!("a dense model");
                };
                Ok(BundleParts {
                    qtypes: PartTypes {
                        gate: QuantType::F32,
                        up: QuantType::F32,
                        down,
                    },
                    neurons: 256,
                    hidden: 256,
                    parts: [
                        f32_weight_bytes(&ffn.gate),
                        f32_weight_bytes(&ffn.up),
                        columns[l].clone(),
                    ],
                    skip: Skip {
                        act: cpu.config().activation,
                        rule,
                        threshold,
                    },
                })
            })
            .unwrap();
            let mut on_gpu = OnGpuBundles { model: &cpu, gpu };
            let worst = compare_steps(&cpu, &mut on_gpu, &[12, 145, 6, 89, 10]);
            let active = on_gpu.gpu.layers().active().to_vec();
            assert_eq!(active.len(), 2);
            if threshold == 0.0 {
                // ReLU skips some neurons and keeps others.
                assert!(active.iter().all(|&a| 0 < a && a < 256), "{active:?}");
            } else {
                assert_eq!(active, [256, 256]);
            }
            eprintln!(
                "down {down}, {act} {rule:?}: largest difference {worst:e} of the largest logit, \
                 active {active:?} of 256"
            );
        }
    }
}

/// `source` converted by `leanstream-prep` (beside the test binary's folder, as the workspace
/// builds it) as the end-to-end tests convert (tests/src/converted.rs: 2048 calibration tokens,
/// 2 epochs, 8 KiB clusters), with `extra`, into a file of the temporary folder named after `name`
/// and this process (each test removes its file).
fn converted(name: &str, source: &Path, extra: &[&str]) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let prep = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("leanstream-prep");
    assert!(
        prep.exists(),
        "{} is missing: build it first (cargo test --release --workspace --no-run; \
         scripts/test-gpu.sh does)",
        prep.display()
    );
    let out = std::env::temp_dir().join(format!("leanstream-gpu-{}-{name}", std::process::id()));
    let o = std::process::Command::new(&prep)
        .arg("convert")
        .arg(source)
        .arg("-o")
        .arg(&out)
        .args([
            "--calib-tokens",
            "2048",
            "--epochs",
            "2",
            "--cluster-kib",
            "8",
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

/// `path` opened with `policy` and `sparsity`, no budget, a KV cache of `kv`.
fn open_converted(
    path: &Path,
    policy: crate::streaming::Policy,
    sparsity: crate::streaming::Sparsity,
    kv: crate::model::kv_cache::KvType,
) -> crate::streaming::StreamingModel {
    open_within(path, policy, sparsity, kv, None)
}

/// [`open_converted`] within `memory` bytes.
fn open_within(
    path: &Path,
    policy: crate::streaming::Policy,
    sparsity: crate::streaming::Sparsity,
    kv: crate::model::kv_cache::KvType,
    memory: Option<u64>,
) -> crate::streaming::StreamingModel {
    use crate::streaming::{StreamOptions, Tuning};
    let opts = StreamOptions {
        policy,
        sparsity,
        memory,
        flash: None,
        ctx: 32,
        ctx_floor: None,
        kv,
        tokenizer_bytes: None,
        tuning: Tuning::default(),
    };
    let file = leanstream_format::LsbFile::open(path).unwrap();
    crate::streaming::StreamingModel::open(path, file, &opts).unwrap()
}

/// How near a neuron's score may lie to its layer's threshold, relative to the layer's largest
/// score at that token, for the GPU and the CPU to decide it differently: their FFN inputs differ
/// by the step's rounding, so a score at the threshold up to that may fall on either side.
const TIE: f32 = 1e-4;

/// The converted file at `path` with `policy` (`resident` or `dense`) on the GPU against the
/// CPU's (both with an f32 KV cache), one token at a time: `prompt`, then six greedy tokens. Each
/// step's logits within [`STEP_TOLERANCE`] and the same greedy token; each layer's active neurons
/// (the GPU's: its scores above the layer's threshold) the CPU's, except neurons whose score lies
/// within [`TIE`] of the threshold, and as many as the GPU counted (`dense`: every neuron; its
/// CPU records the scores' decisions all the same); then every logit of the prompt at once.
/// Checks that an f16 KV cache on the CPU would fail the tolerance and that the rule skips
/// neurons (so that equal sets are not a vacuous pass). Returns the largest relative difference,
/// the neurons decided differently at a tie, and the active share.
fn compare_converted(
    path: &Path,
    policy: crate::streaming::Policy,
    prompt: &[u32],
) -> (f32, usize, f64) {
    use crate::model::kv_cache::KvType;
    use crate::streaming::{Policy, Sparsity};
    let meta = leanstream_format::LsbFile::open(path).unwrap().meta;
    let (layers, n) = (meta.model.num_layers, meta.model.intermediate_size);
    let thresholds: Vec<f32> = meta.layers.iter().map(|l| l.threshold).collect();
    let dense = policy == Policy::Dense;
    let sparsity = if dense {
        Sparsity::Dense
    } else {
        Sparsity::Exact
    };
    let open = |kv| open_converted(path, policy, sparsity, kv);
    let (mut cpu, mut f16, mut on_gpu) = (open(KvType::F32), open(KvType::F16), open(KvType::F32));
    let line = on_gpu.use_gpu(None, false).unwrap();
    assert!(line.contains("bundles"), "{line}");
    on_gpu.gpu().unwrap().layers().record_scores(true);
    cpu.record_active();
    let (mut cc, mut fc, mut gc) = (cpu.new_cache(32), f16.new_cache(32), on_gpu.new_cache(32));
    let (mut cl, mut fl, mut gl) = (Vec::new(), Vec::new(), Vec::new());
    let (mut worst, mut f16_worst) = (0.0f32, 0.0f32);
    // Per token: the GPU's active set of each layer, and its scores.
    let mut gpu_sets: Vec<(Vec<Vec<u32>>, Vec<f32>)> = Vec::new();
    let mut token = prompt[0];
    for step in 0..prompt.len() + 6 {
        cpu.forward_into(&[token], &mut cc, false, &mut cl).unwrap();
        f16.forward_into(&[token], &mut fc, false, &mut fl).unwrap();
        on_gpu
            .forward_into(&[token], &mut gc, false, &mut gl)
            .unwrap();
        let d = relative_difference(&gl, &cl);
        assert!(
            d <= STEP_TOLERANCE,
            "step {step}: the GPU's logits differ from the CPU's by {d:e} of the largest"
        );
        assert_eq!(argmax(&gl), argmax(&cl), "step {step}: another token");
        worst = worst.max(d);
        f16_worst = f16_worst.max(relative_difference(&fl, &cl));
        let g = on_gpu.gpu().unwrap().layers();
        let (active, scores) = (g.active().to_vec(), g.scores().to_vec());
        assert_eq!((active.len(), scores.len()), (layers, layers * n));
        let sets: Vec<Vec<u32>> = (0..layers)
            .map(|l| {
                let s = &scores[l * n..(l + 1) * n];
                (0..n as u32)
                    .filter(|&p| s[p as usize] > thresholds[l])
                    .collect()
            })
            .collect();
        for l in 0..layers {
            let want = if dense { n } else { sets[l].len() };
            assert_eq!(active[l] as usize, want, "step {step} layer {l}");
        }
        gpu_sets.push((sets, scores));
        token = match prompt.get(step + 1) {
            Some(&t) => t,
            None => argmax(&cl),
        };
    }
    let recorded = cpu.recorded_active();
    assert_eq!(recorded.len(), gpu_sets.len() * layers);
    let (mut ties, mut active, mut partial) = (0, 0usize, 0);
    for (t, (sets, scores)) in gpu_sets.iter().enumerate() {
        for l in 0..layers {
            let (cpu_set, gpu_set) = (&recorded[t * layers + l], &sets[l]);
            let s = &scores[l * n..(l + 1) * n];
            let top = s.iter().fold(0.0f32, |m, v| m.max(*v));
            for p in 0..n as u32 {
                if cpu_set.binary_search(&p).is_ok() != gpu_set.binary_search(&p).is_ok() {
                    let score = s[p as usize];
                    assert!(
                        (score - thresholds[l]).abs() <= TIE * top,
                        "token {t} layer {l} neuron {p}: the GPU and the CPU decide differently \
                         with score {score} against the threshold {} (largest {top})",
                        thresholds[l]
                    );
                    ties += 1;
                }
            }
            active += cpu_set.len();
            partial += usize::from(!cpu_set.is_empty() && cpu_set.len() < n);
        }
    }
    assert!(partial > 0, "the skip rule skipped nothing (or everything)");
    // Every logit of the prompt at once (the CPU's prompt path, the GPU a token at a time).
    cc.clear();
    gc.clear();
    cpu.forward_into(prompt, &mut cc, true, &mut cl).unwrap();
    on_gpu.forward_into(prompt, &mut gc, true, &mut gl).unwrap();
    let d = relative_difference(&gl, &cl);
    assert!(d <= STEP_TOLERANCE, "the prompt's logits: {d:e}");
    worst = worst.max(d);
    assert!(
        f16_worst > STEP_TOLERANCE,
        "an f16 KV cache changes the CPU's logits by {f16_worst:e} only"
    );
    let share = active as f64 / (gpu_sets.len() * layers * n) as f64;
    (worst, ties, share)
}

#[test]
fn resident_on_the_gpu_converted_embedded_model() {
    use crate::model::kv_cache::KvType;
    use crate::streaming::{Policy, Sparsity};
    // The embedded ReLU Llama converted to q8 bundles: the `gate` rule, threshold 0.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let path = converted(
        "austen-q8.lsb",
        &root.join("models/austen-relu"),
        &["--quant", "q8"],
    );
    for policy in [Policy::Resident, Policy::Dense] {
        let (worst, ties, share) = compare_converted(&path, policy, &[12, 345, 6, 789, 10]);
        eprintln!(
            "austen-relu q8 bundles, {policy:?}: largest difference {worst:e} of the largest \
             logit; {ties} neurons decided differently at a tie; {share:.3} of the neurons active"
        );
    }
    // Refine sparsity streams its FFN into the neuron pool, or keeps it on the CPU when asked.
    for ffn_on_cpu in [false, true] {
        let mut m = open_converted(
            &path,
            Policy::Resident,
            Sparsity::Refine { keep_permille: 500 },
            KvType::F32,
        );
        let line = m.use_gpu(None, ffn_on_cpu).unwrap();
        let want = if ffn_on_cpu {
            "FFN on the CPU"
        } else {
            "neuron pool"
        };
        assert!(line.contains(want), "{line}");
    }
    // Streamed dense weights keep the model on the CPU, saying why.
    let least = crate::streaming::streaming_minimum_memory(&path, 32).unwrap();
    let mut m = open_within(
        &path,
        Policy::Leanstream,
        Sparsity::Certified,
        KvType::default(),
        Some(least),
    );
    let e = format!("{:#}", m.use_gpu(None, false).unwrap_err());
    assert!(e.contains("dense weights stream from flash"), "{e}");
    assert!(m.gpu().is_none());
    std::fs::remove_file(path).unwrap();
}

/// `prompt`, then six greedy tokens (the CPU's), one at a time through `cpu`, `streamed` and
/// `reference` (f32 KV caches): at each step the streamed logits are bit for bit the reference's
/// (`what` names it), within [`STEP_TOLERANCE`] of the CPU's, with the same greedy token. Returns
/// the largest relative difference from the CPU and the steps.
fn decode_against(
    cpu: &mut crate::streaming::StreamingModel,
    streamed: &mut crate::streaming::StreamingModel,
    reference: &mut crate::streaming::StreamingModel,
    prompt: &[u32],
    what: &str,
) -> (f32, usize) {
    let (mut cc, mut sc, mut rc) = (
        cpu.new_cache(32),
        streamed.new_cache(32),
        reference.new_cache(32),
    );
    let (mut cl, mut sl, mut rl) = (Vec::new(), Vec::new(), Vec::new());
    let mut worst = 0.0f32;
    let mut token = prompt[0];
    let steps = prompt.len() + 6;
    for step in 0..steps {
        cpu.forward_into(&[token], &mut cc, false, &mut cl).unwrap();
        streamed
            .forward_into(&[token], &mut sc, false, &mut sl)
            .unwrap();
        reference
            .forward_into(&[token], &mut rc, false, &mut rl)
            .unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&sl) == bits(&rl),
            "step {step}: streamed and {what} differ"
        );
        let d = relative_difference(&sl, &cl);
        assert!(
            d <= STEP_TOLERANCE,
            "step {step}: the logits differ from the CPU's by {d:e} of the largest"
        );
        assert_eq!(argmax(&sl), argmax(&cl), "step {step}: another token");
        worst = worst.max(d);
        token = match prompt.get(step + 1) {
            Some(&t) => t,
            None => argmax(&cl),
        };
    }
    (worst, steps)
}

/// The streaming policy with the dense half on the GPU and each layer's FFN on the CPU: streamed
/// within a budget that holds `share` of the FFN, one token at a time (`prompt`, then six greedy
/// tokens), its logits are bit for bit those of the same step with every bundle in memory (no
/// budget), and within [`STEP_TOLERANCE`] of the CPU's streamed at the same budget, with the
/// same greedy tokens (f32 KV caches); the streamed run reads bundles, and its neuron cache holds
/// the bytes of the attention weights the CPU gave up. A GPU budget that holds the step but not
/// its KV cache sends the model back to the CPU at the first token, the attention read again:
/// the CPU's logits bit for bit. Returns the largest relative difference from the CPU and the
/// bytes read per token.
fn compare_split(path: &Path, share: f64, prompt: &[u32]) -> (f32, f64) {
    use crate::model::kv_cache::KvType;
    use crate::streaming::{Policy, Sparsity};
    let budget = crate::streaming::memory_split_with(path, 32, KvType::F32)
        .unwrap()
        .budget_for_ffn_share(share);
    let open = |memory| {
        open_within(
            path,
            Policy::Leanstream,
            Sparsity::Certified,
            KvType::F32,
            memory,
        )
    };
    let (mut cpu, mut streamed, mut whole) = (open(Some(budget)), open(Some(budget)), open(None));
    for m in [&mut streamed, &mut whole] {
        let line = m.use_gpu(None, true).unwrap();
        assert!(line.contains("FFN on the CPU"), "{line}");
        assert!(line.contains("freed for the neuron cache"), "{line}");
    }
    // The dense weights planned resident, less the attention's.
    let attention = cpu.split.dense - streamed.split.dense;
    assert!(attention > 0, "the attention left the CPU's plan");
    let grown = streamed.split.neuron_cache - cpu.split.neuron_cache;
    assert!(
        grown >= attention.min(streamed.split.ffn_total - cpu.split.neuron_cache),
        "the cache grew by {grown} bytes for {attention} bytes of attention"
    );
    // The step fits the GPU's budget, its KV cache does not: the CPU from the first token.
    let step_bytes = streamed.gpu().unwrap().layers().bytes() as u64;
    let mut back = open(Some(budget));
    back.use_gpu(Some(step_bytes + 1024), true).unwrap();
    let (mut bc, mut bl, mut cc0, mut cl0) = (
        back.new_cache(32),
        Vec::new(),
        cpu.new_cache(32),
        Vec::new(),
    );
    back.forward_into(prompt, &mut bc, true, &mut bl).unwrap();
    assert!(
        back.gpu().is_none(),
        "the KV cache did not fit: back on the CPU"
    );
    assert_eq!(
        back.split.neuron_cache, cpu.split.neuron_cache,
        "the cache as planned without the GPU"
    );
    cpu.forward_into(prompt, &mut cc0, true, &mut cl0).unwrap();
    assert!(
        bl.iter().zip(&cl0).all(|(a, b)| a.to_bits() == b.to_bits()),
        "the CPU's logits"
    );
    let (worst, _) = decode_against(&mut cpu, &mut streamed, &mut whole, prompt, "in memory");
    assert!(streamed.gpu().is_some(), "the step stayed on the GPU");
    // A prompt at once: the same logits as token by token.
    let (mut cc, mut sc) = (cpu.new_cache(32), streamed.new_cache(32));
    let (mut cl, mut sl) = (Vec::new(), Vec::new());
    streamed
        .forward_into(prompt, &mut sc, true, &mut sl)
        .unwrap();
    cpu.forward_into(prompt, &mut cc, true, &mut cl).unwrap();
    let d = relative_difference(&sl, &cl);
    assert!(d <= STEP_TOLERANCE, "the prompt's logits: {d:e}");
    let read = streamed.summary().bytes_read_per_token;
    assert!(read > 0.0, "the streamed run read no bundles");
    (worst.max(d), read)
}

#[test]
fn streaming_with_the_attention_on_the_gpu() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let relu = converted(
        "austen-q8-split.lsb",
        &root.join("models/austen-relu"),
        &["--quant", "q8"],
    );
    let swiglu = converted(
        "llama-k-split.lsb",
        &root.join("tests/fixtures/arch/llama-k.q4_k_m.gguf"),
        &[],
    );
    for path in [relu, swiglu] {
        let (worst, read) = compare_split(&path, 0.3, &[12, 145, 6, 89, 10]);
        eprintln!(
            "{}: the FFN on the CPU, 30 % of it cached: largest difference {worst:e} of the \
             largest logit; {read:.0} bytes of bundles read per token",
            path.display()
        );
        std::fs::remove_file(path).unwrap();
    }
}

#[test]
fn resident_on_the_gpu_converted_swiglu_k_quants() {
    // A tiny Llama 3 (SiLU) in llama.cpp's Q4_K_M, converted keeping its q4_k gate and up rows
    // (down columns q6_k and q8_0): the `gate_up` rule with calibrated thresholds.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let path = converted(
        "llama-k-q4_k_m.lsb",
        &root.join("tests/fixtures/arch/llama-k.q4_k_m.gguf"),
        &[],
    );
    let meta = leanstream_format::LsbFile::open(&path).unwrap().meta;
    assert_eq!(meta.sparsity_rule.as_deref(), Some("gate_up"));
    let policy = crate::streaming::Policy::Resident;
    let (worst, ties, share) = compare_converted(&path, policy, &[12, 145, 6, 89, 10]);
    eprintln!(
        "llama-k q4_k_m bundles: largest difference {worst:e} of the largest logit; {ties} \
         neurons decided differently at a tie; {share:.3} of the neurons active"
    );
    std::fs::remove_file(path).unwrap();
}

#[test]
fn resident_on_the_gpu_converted_relu_family() {
    // ProSparse's FATReLU (threshold 0.25) and Bamboo's dReLU (ReLU on the up value too, its
    // coefficient `max(a·u, 0)` made by the listed up rows' kernel): q8 bundles, the `gate` rule.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for name in ["prosparse", "bamboo"] {
        let source = root.join("tests/fixtures/arch").join(name);
        let path = converted(&format!("{name}.lsb"), &source, &[]);
        let policy = crate::streaming::Policy::Resident;
        let (worst, ties, share) = compare_converted(&path, policy, &[12, 145, 6, 89, 10]);
        eprintln!(
            "{name} bundles: largest difference {worst:e} of the largest logit; {ties} neurons \
             decided differently at a tie; {share:.3} of the neurons active"
        );
        std::fs::remove_file(path).unwrap();
    }
}

/// The streaming policy with its FFN on the GPU from the neuron pool: streamed within a budget
/// that holds `share` of the FFN, one token at a time (`prompt`, then six greedy tokens), its
/// logits are bit for bit those of the GPU's resident step (every bundle uploaded once), and
/// within [`STEP_TOLERANCE`] of the CPU's streamed at the same budget with the same greedy
/// tokens (f32 KV caches). The pool holds fewer clusters than the model (where the neuron cache
/// holds them all, a `--gpu-memory` makes it smaller), so clusters are given up and uploaded
/// again; the engine's reads are the CPU's. A GPU budget that cannot hold the
/// pool keeps the FFN on the CPU, saying why. Returns the largest relative difference from the
/// CPU, the bytes read per token and the clusters uploaded per token.
fn compare_pooled(path: &Path, share: f64, prompt: &[u32]) -> (f32, f64, f64) {
    use crate::model::kv_cache::KvType;
    use crate::streaming::{Policy, Sparsity};
    let budget = crate::streaming::memory_split_with(path, 32, KvType::F32)
        .unwrap()
        .budget_for_ffn_share(share);
    let open = |policy, memory| open_within(path, policy, Sparsity::Certified, KvType::F32, memory);
    let mut cpu = open(Policy::Leanstream, Some(budget));
    let mut streamed = open(Policy::Leanstream, Some(budget));
    let line = streamed.use_gpu(None, false).unwrap();
    assert!(line.contains("neuron pool of"), "{line}");
    assert!(line.contains("freed for the neuron cache"), "{line}");
    let mut resident = open_converted(path, Policy::Resident, Sparsity::Exact, KvType::F32);
    let line = resident.use_gpu(None, false).unwrap();
    assert!(line.contains("from the file's bundles"), "{line}");
    let file = leanstream_format::LsbFile::open(path).unwrap();
    let clusters: usize = file.ffn.layers.iter().map(|l| l.clusters.len()).sum();
    let (_, mut slots) = streamed.gpu().unwrap().pool_uploads().unwrap();
    if slots >= clusters {
        // A GPU budget that takes part of the pool away.
        let g = streamed.gpu().unwrap().layers();
        let (total, pool) = (g.bytes() as u64, g.pool_bytes());
        for part in [0.8, 0.6, 0.4] {
            let mut smaller = open(Policy::Leanstream, Some(budget));
            let gpu_memory = total - pool + (pool as f64 * part) as u64;
            let line = smaller.use_gpu(Some(gpu_memory), false).unwrap();
            if line.contains("neuron pool of") {
                (_, slots) = smaller.gpu().unwrap().pool_uploads().unwrap();
                streamed = smaller;
                break;
            }
        }
    }
    assert!(
        slots < clusters,
        "a pool of {slots} clusters holds the whole model ({clusters})"
    );
    streamed.gpu().unwrap().layers().record_spans();
    let what = "resident on the GPU";
    let (worst, steps) = decode_against(&mut cpu, &mut streamed, &mut resident, prompt, what);
    assert!(streamed.gpu().is_some(), "the step stayed on the GPU");
    // The timeline: per token, each layer's attention, the host's work, the FFN from the pool
    // and the host's again, then the head, one after the other.
    let spans = streamed.gpu().unwrap().layers().take_spans();
    let layers = file.ffn.layers.len();
    assert_eq!(spans.len(), steps * (4 * layers + 1));
    use super::SpanKind::{Attention, Ffn, Host, Step};
    for (i, s) in spans.iter().enumerate() {
        let (k, l) = (i % (4 * layers + 1), (i % (4 * layers + 1)) / 4);
        let want = match (k == 4 * layers, k % 4) {
            (true, _) => (None, Step),
            (_, 0) => (Some(l as u32), Attention),
            (_, 2) => (Some(l as u32), Ffn),
            _ => (Some(l as u32), Host),
        };
        assert_eq!((s.layer, s.what), want, "span {i}");
        assert!(s.start <= s.end, "span {i}");
        if i > 0 {
            assert!(
                spans[i - 1].end <= s.start,
                "span {i} overlaps the one before"
            );
        }
    }
    let (uploads, _) = streamed.gpu().unwrap().pool_uploads().unwrap();
    let summary = streamed.gpu_summary().unwrap();
    assert_eq!(summary["ffn"], "pool");
    assert_eq!(summary["pool_slots"], slots);
    assert_eq!(summary["pool_uploads"], uploads);
    assert!(
        uploads as usize > slots,
        "{uploads} uploads into {slots} slots: nothing was given up"
    );
    let (read, cpu_read) = (
        streamed.summary().bytes_read_per_token,
        cpu.summary().bytes_read_per_token,
    );
    assert!(read > 0.0, "the streamed run read no bundles");
    // A GPU budget that holds the step without a pool: the FFN on the CPU, saying why.
    let step_bytes = {
        let mut split = open(Policy::Leanstream, Some(budget));
        split.use_gpu(None, true).unwrap();
        split.gpu().unwrap().layers().bytes() as u64
    };
    let mut small = open(Policy::Leanstream, Some(budget));
    let line = small.use_gpu(Some(step_bytes + 4096), false).unwrap();
    assert!(line.contains("FFN on the CPU"), "{line}");
    assert!(line.contains("no neuron pool on the GPU"), "{line}");
    eprintln!("bytes read per token: {read:.0} with the pool, {cpu_read:.0} on the CPU");
    (worst, read, uploads as f64 / steps as f64)
}

#[test]
fn streaming_into_the_gpu_neuron_pool() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let relu = converted(
        "austen-q8-pool.lsb",
        &root.join("models/austen-relu"),
        &["--quant", "q8"],
    );
    let swiglu = converted(
        "llama-k-pool.lsb",
        &root.join("tests/fixtures/arch/llama-k.q4_k_m.gguf"),
        &[],
    );
    // The prompts of the resident tests above: on the embedded model the prompt of the split
    // test moves a q8 quant of the GPU's by one step at its fourth token (1.2e-3 of the largest
    // logit from the CPU's, the GPU's resident step alike).
    for (path, prompt) in [
        (relu, [12, 345, 6, 789, 10]),
        (swiglu, [12, 145, 6, 89, 10]),
    ] {
        let (worst, read, uploads) = compare_pooled(&path, 0.3, &prompt);
        eprintln!(
            "{}: the FFN on the GPU from the pool, 30 % of it cached: largest difference {worst:e} \
             of the largest logit; {read:.0} bytes of bundles read and {uploads:.1} clusters \
             uploaded per token",
            path.display()
        );
        std::fs::remove_file(path).unwrap();
    }
}
