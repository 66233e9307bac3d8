//! The first steps of a new user: `run`, `chat` and `perplexity` given a GGUF file and a budget
//! convert it once (cached) and stream it; `--no-convert` and a device without `leanstream-prep`
//! refuse with the commands that fix it; a missing path is reported as one, at once, by both
//! tools, without a network attempt; a hub id that cannot be had is one line naming the cache and
//! how to fill it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;
use leanstream::source::gguf::gguf_name;
use leanstream::streaming::memory_split;
use leanstream_tests::cli::{bin, embedded_model, stderr};
use leanstream_tests::converted::{scratch, workspace};
use leanstream_tests::gguf::{converter_permute, tokenizer_metadata};

/// An address reserved for documentation (RFC 5737): nothing answers there, so a connection
/// attempt hangs until it times out, which the tests' time limits would catch.
const UNREACHABLE: &str = "http://192.0.2.1:9";

/// A budget above the twin's minimum (about 25 MiB at ctx 256, most of it the process itself).
const BUDGET: &str = "40MiB";

/// The embedded model written as a llama.cpp GGUF file (f32 tensors, query/key rows in llama.cpp's
/// order, its byte-level BPE tokenizer in the metadata), once per test process. GGUF `llama` has
/// no activation key, so the twin computes SiLU where the original computes ReLU: the same
/// shapes, a different (dense) model, which is all the conversion path needs.
fn gguf_twin() -> &'static Path {
    static TWIN: OnceLock<PathBuf> = OnceLock::new();
    TWIN.get_or_init(|| {
        let dir = embedded_model();
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        let n = |k: &str| config[k].as_u64().unwrap() as u32;
        let (heads, kv_heads) = (n("num_attention_heads"), n("num_key_value_heads"));
        let arch = |k: &str| format!("llama.{k}");
        let mut metadata = vec![
            (
                "general.architecture".to_string(),
                Value::String("llama".into()),
            ),
            (arch("embedding_length"), Value::U32(n("hidden_size"))),
            (
                arch("feed_forward_length"),
                Value::U32(n("intermediate_size")),
            ),
            (arch("block_count"), Value::U32(n("num_hidden_layers"))),
            (arch("attention.head_count"), Value::U32(heads)),
            (arch("attention.head_count_kv"), Value::U32(kv_heads)),
            (arch("attention.key_length"), Value::U32(n("head_dim"))),
            (arch("rope.dimension_count"), Value::U32(n("head_dim"))),
            (
                arch("context_length"),
                Value::U32(n("max_position_embeddings")),
            ),
            (
                arch("attention.layer_norm_rms_epsilon"),
                Value::F32(config["rms_norm_eps"].as_f64().unwrap() as f32),
            ),
            (
                arch("rope.freq_base"),
                Value::F32(config["rope_theta"].as_f64().unwrap() as f32),
            ),
            (
                "tokenizer.ggml.eos_token_id".into(),
                Value::U32(n("eos_token_id")),
            ),
        ];
        metadata.extend(tokenizer_metadata(&dir.join("tokenizer.json")));

        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors = Vec::new();
        // In name order: `tensors()` follows a hash map's, which would give each test process a
        // different twin (and conversion-cache key).
        let mut views = st.tensors();
        views.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, view) in views {
            assert_eq!(view.dtype(), safetensors::Dtype::BF16, "{name}");
            let shape = view.shape().to_vec();
            let mut values: Vec<f32> = view
                .data()
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect();
            let rows_per_head = match name.rsplit('.').nth(1) {
                Some("q_proj") => Some(heads),
                Some("k_proj") => Some(kv_heads),
                _ => None,
            };
            if let Some(h) = rows_per_head {
                values = converter_permute(&values, h as usize, shape[1]);
            }
            let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            let storage = QStorage::from_data(data.into(), &Device::Cpu, GgmlDType::F32).unwrap();
            let q = QTensor::new(storage, shape.as_slice()).unwrap();
            tensors.push((gguf_name(&name).unwrap(), q));
        }
        let path = scratch().join("austen-twin.gguf");
        let mut file = std::fs::File::create(&path).unwrap();
        let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut file, &metadata, &tensors).unwrap();
        path
    })
}

/// Runs `exe args` with `env` set, returning its output and how long it took.
fn timed(exe: &Path, args: &[&str], env: &HashMap<&str, String>) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new(exe).args(args).envs(env).output().unwrap();
    (out, start.elapsed())
}

fn first_line(o: &Output) -> String {
    stderr(o).lines().next().unwrap_or_default().to_string()
}

fn cache_files(cache: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(cache)
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default()
}

#[test]
fn a_gguf_with_a_budget_is_converted_once_then_streamed() {
    let twin = gguf_twin().to_str().unwrap();
    let cache = scratch().join("conversion-cache");
    let _ = std::fs::remove_dir_all(&cache);
    let env = HashMap::from([("LEANSTREAM_CACHE", cache.display().to_string())]);
    let run = |model: &str, budget: &str, extra: &[&str]| {
        let mut args = vec!["run", "--model", model, "--memory", budget, "--ctx", "256"];
        args.extend([
            "-p",
            "It was a fine morning",
            "-n",
            "8",
            "--temp",
            "0",
            "--json",
        ]);
        args.extend(extra);
        timed(&bin("leanstream"), &args, &env).0
    };
    let json = |o: &Output| -> serde_json::Value {
        assert!(o.status.success(), "{}", stderr(o));
        serde_json::from_slice(&o.stdout).unwrap()
    };

    let first = run(twin, BUDGET, &[]);
    let v = json(&first);
    assert!(
        stderr(&first).starts_with("converting "),
        "{}",
        stderr(&first)
    );
    assert_eq!(v["policy"], "leanstream", "{v:#}");
    assert_eq!(v["memory_budget_bytes"], 40 << 20);
    assert_eq!(v["generated_tokens"], 8);
    let cached = cache_files(&cache);
    assert_eq!(
        cached.len(),
        1,
        "one converted file in the cache: {cached:?}"
    );
    let verify = Command::new(bin("leanstream"))
        .arg("verify")
        .arg(&cached[0])
        .output()
        .unwrap();
    assert!(verify.status.success(), "{}", stderr(&verify));

    // Again, with half the FFN on flash: no conversion, reads from flash within the budget, and
    // the text of the cached file named directly. The run plans `ffn:50%` itself: planned here,
    // the budget would count this test process's start-up RSS (larger, and varying with the
    // tests running beside it), which once left the run room for the whole FFN.
    let again = run(twin, "ffn:50%", &[]);
    let w = json(&again);
    assert!(!stderr(&again).contains("converting"), "{}", stderr(&again));
    let half = w["memory_budget_bytes"].as_u64().unwrap();
    // The split planned here, with the run's own start-up in place of this process's.
    let split = memory_split(&cached[0], 256).unwrap();
    let overhead = w["memory_split"]["overhead"].as_u64().unwrap();
    assert_eq!(
        half,
        split.budget_for_ffn_share(0.5) - split.overhead + overhead,
        "{w:#}"
    );
    assert!(
        w["memory_split"]["neuron_cache"].as_u64().unwrap() < split.ffn_total,
        "{w:#}"
    );
    assert!(w["bytes_read_per_token"].as_f64().unwrap() > 0.0, "{w:#}");
    let peak = w["peak_rss_bytes"].as_u64().unwrap();
    assert!(peak <= half, "peak RSS {peak} above the budget {half}");
    let direct = json(&run(cached[0].to_str().unwrap(), "ffn:50%", &[]));
    assert_eq!(direct["memory_budget_bytes"], half);
    assert_eq!(w["text"], direct["text"]);

    // perplexity takes the same path, from the cache (over the text's first 2000 bytes: what is
    // checked is where the model comes from, not the figure).
    let heldout = scratch().join("heldout-prefix.txt");
    let text = std::fs::read(workspace().join("data/heldout-head.txt")).unwrap();
    std::fs::write(&heldout, &text[..2000]).unwrap();
    let (ppl, _) = timed(
        &bin("leanstream"),
        &[
            "perplexity",
            "--model",
            twin,
            "--memory",
            "ffn:50%",
            "--ctx",
            "64",
            "--file",
            heldout.to_str().unwrap(),
        ],
        &env,
    );
    assert!(ppl.status.success(), "{}", stderr(&ppl));
    assert!(!stderr(&ppl).contains("converting"), "{}", stderr(&ppl));
    assert!(String::from_utf8_lossy(&ppl.stdout).starts_with("perplexity "));

    // --no-convert refuses, naming the command that converts.
    let refused = run(twin, BUDGET, &["--no-convert"]);
    assert_eq!(refused.status.code(), Some(1), "{}", stderr(&refused));
    assert_eq!(
        first_line(&refused),
        format!(
            "error: {twin} is not a converted file and --no-convert forbids converting it here: \
             run `leanstream-prep convert {twin} -o model.lsb` and pass --model model.lsb, or drop \
             --memory, --flash and --policy to run it dense"
        )
    );
}

#[test]
fn a_device_without_the_converter_is_told_how_to_convert_and_push() {
    // A copy of the runtime alone in a folder, with nothing on PATH, and an empty cache.
    let dir = scratch().join("runtime-alone");
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("leanstream");
    std::fs::copy(bin("leanstream"), &exe).unwrap();
    let twin = gguf_twin().to_str().unwrap();
    let env = HashMap::from([
        ("PATH", String::new()),
        ("LEANSTREAM_CACHE", dir.join("cache").display().to_string()),
    ]);
    let (o, _) = timed(
        &exe,
        &["run", "--model", twin, "--memory", BUDGET, "-p", "Hi"],
        &env,
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let line = first_line(&o);
    for needle in [
        &format!("error: {twin} must be converted, by leanstream-prep, which is neither beside"),
        &format!("on a workstation run `leanstream-prep convert {twin} -o model.lsb`"),
        "`leanstream-prep push model.lsb --adb` (or `--ssh HOST`)",
        "then pass --model model.lsb here",
    ] {
        assert!(line.contains(needle), "{needle:?} missing from {line}");
    }
}

#[test]
fn leanstream_prep_names_the_converter_before_the_one_beside_or_on_path() {
    // The runtime alone in a folder, nothing on PATH: only LEANSTREAM_PREP can name a converter.
    // A stand-in converter that states a version and fails to convert proves which one ran: the
    // refusal names the command that failed.
    let dir = scratch().join("runtime-with-explicit-prep");
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("leanstream");
    std::fs::copy(bin("leanstream"), &exe).unwrap();
    let fake = dir.join("stand-in-prep");
    std::fs::write(
        &fake,
        "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'leanstream-prep 0.0.1'; exit 0; fi\n\
         echo 'stand-in converter ran' >&2\nexit 3\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let twin = gguf_twin().to_str().unwrap();
    let mut env = HashMap::from([
        ("PATH", String::new()),
        ("LEANSTREAM_CACHE", dir.join("cache").display().to_string()),
        ("LEANSTREAM_PREP", fake.display().to_string()),
    ]);
    let args = ["run", "--model", twin, "--memory", BUDGET, "-p", "Hi"];
    let (o, _) = timed(&exe, &args, &env);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("stand-in converter ran"), "{err}");
    assert!(
        err.contains(&format!("`{} convert {twin} -o model.lsb`", fake.display())),
        "{err}"
    );

    // A LEANSTREAM_PREP that names no file is refused, naming it, not passed over silently.
    let missing = dir.join("no-such-prep");
    env.insert("LEANSTREAM_PREP", missing.display().to_string());
    let (o, _) = timed(&exe, &args, &env);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        first_line(&o).contains(&format!(
            "LEANSTREAM_PREP={} is not a file",
            missing.display()
        )),
        "{}",
        stderr(&o)
    );
}

#[test]
fn missing_paths_are_reported_at_once_by_both_tools_without_the_network() {
    let empty_cache = scratch().join("empty-hf-home");
    std::fs::create_dir_all(&empty_cache).unwrap();
    let env = HashMap::from([
        ("HF_ENDPOINT", UNREACHABLE.to_string()),
        ("HTTPS_PROXY", UNREACHABLE.to_string()),
        ("HTTP_PROXY", UNREACHABLE.to_string()),
        ("ALL_PROXY", UNREACHABLE.to_string()),
        ("HF_HOME", empty_cache.display().to_string()),
    ]);
    let out = scratch().join("never-written.lsb");
    let out = out.to_str().unwrap();
    for missing in [
        "./nonexistent-dir",
        "/nonexistent",
        "../nonexistent/model",
        "~/nonexistent-leanstream-model",
        "nonexistent.gguf",
        "models/nonexistent", // `models` is a folder of the checkout, where this runs
    ] {
        let expected = format!("error: no such file or directory: {missing}");
        let runs = [
            (bin("leanstream-prep"), vec!["convert", missing, "-o", out]),
            (
                bin("leanstream"),
                vec!["run", "--model", missing, "-p", "Hi"],
            ),
            (
                bin("leanstream"),
                vec!["run", "--model", missing, "--memory", BUDGET, "-p", "Hi"],
            ),
        ];
        for (exe, args) in runs {
            let start = Instant::now();
            let o = Command::new(&exe)
                .args(&args)
                .envs(&env)
                .current_dir(workspace())
                .output()
                .unwrap();
            let took = start.elapsed();
            assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
            assert_eq!(stderr(&o).trim_end(), expected, "{args:?}");
            assert!(took < Duration::from_secs(5), "{args:?} took {took:?}");
        }
        assert!(!Path::new(out).exists());
    }
}

#[test]
fn a_hub_id_that_cannot_be_had_is_one_line_naming_the_cache_and_the_fix() {
    let hf_home = scratch().join("empty-hf-home-2");
    std::fs::create_dir_all(&hf_home).unwrap();
    let id = "leanstream-tests/absent-model";
    let out = scratch().join("never-written-2.lsb");
    let cache = hf_home.join("hub");
    let fill = format!(
        "on a connected machine, `leanstream-prep convert {id} -o model.lsb` converts it (copy \
         model.lsb here), or `huggingface-cli download {id}` fills that machine's cache (copy it \
         here and point HF_HOME at it)"
    );

    // Offline, not in the cache.
    let offline = HashMap::from([
        ("HF_HUB_OFFLINE", "1".to_string()),
        ("HF_HOME", hf_home.display().to_string()),
        ("HF_ENDPOINT", UNREACHABLE.to_string()),
    ]);
    let args = ["convert", id, "-o", out.to_str().unwrap()];
    let (o, took) = timed(&bin("leanstream-prep"), &args, &offline);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(
        stderr(&o).trim_end(),
        format!(
            "error: {id} is not in the local Hugging Face cache {} (config.json is missing; the \
             folder is HF_HOME/hub) and HF_HUB_OFFLINE=1 forbids downloading: {fill}",
            cache.display()
        )
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");

    // The runtime hands a hub id to the converter, whose message comes first.
    let mut runtime_env = offline.clone();
    runtime_env.insert(
        "LEANSTREAM_CACHE",
        scratch().join("cache-2").display().to_string(),
    );
    let (o, _) = timed(
        &bin("leanstream"),
        &["run", "--model", id, "--memory", BUDGET, "-p", "Hi"],
        &runtime_env,
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.starts_with("converting leanstream-tests/absent-model with "),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "\nerror: {id} is not in the local Hugging Face cache"
        )),
        "{err}"
    );

    // Online, the hub unreachable (a closed port answers at once): the cause once, on one line.
    let online = HashMap::from([
        ("HF_HOME", hf_home.display().to_string()),
        ("HF_ENDPOINT", "http://127.0.0.1:9".to_string()),
    ]);
    let (o, _) = timed(&bin("leanstream-prep"), &args, &online);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with(&format!(
            "error: cannot fetch config.json of {id} from the Hugging Face hub at http://127.0.0.1:9 ("
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "and it is not in the local cache {}",
            cache.display()
        )),
        "{err}"
    );
    assert_eq!(err.matches("refused").count(), 1, "{err}");
    assert!(err.trim_end().ends_with(&fill), "{err}");
    assert!(!out.exists());
}
