//! `leanstream-prep synth` of a mixture-of-experts shape (`tiny-moe`, Qwen3-MoE-shaped like
//! `qwen3-30b-a3b`) with routing planted from a converted mixture's profile, and `--gguf` in
//! llama.cpp's `qwen3moe` layout: the planted token reuse is reached on held-out text, the expert
//! frequencies sum to `k`; the GGUF gives back the file's configuration and every expert's gate
//! and up rows bit for bit (down, re-encoded along its rows, within one q8 step); the streamed
//! file computes what `--policy resident` computes, and the look-ahead can be switched off.

use std::path::Path;
use std::process::Command;

use leanstream::model::kv_cache::KvType;
use leanstream::source::gguf::GgufFile;
use leanstream::streaming::experts::minimum_memory;
use leanstream::text::session::{PolicyChoice, Session, SessionOptions};
use leanstream_format::LsbFile;
use leanstream_tests::converted::{bin, convert, exact_options};
use leanstream_tests::fresh_dir;
use leanstream_tests::tiny::{random_ids, write_tiny_model, TinySpec};

const REUSE: f64 = 0.5;

fn options(file: &Path, policy: PolicyChoice, memory: Option<u64>) -> SessionOptions {
    exact_options(file, policy, memory, 64)
}

#[test]
fn a_synthetic_mixture_plants_its_routing_and_exports_to_qwen3moe_gguf() {
    let dir = fresh_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "moe-synth");
    let src_dir = dir.join("src");
    write_tiny_model(&src_dir, &TinySpec::qwen3_moe()).unwrap();
    let profile = dir.join("profile.lsb");
    convert(&src_dir, &profile, &[]);

    let (lsb, gguf) = (dir.join("synth.lsb"), dir.join("synth.gguf"));
    let o = Command::new(bin("leanstream-prep"))
        .args(["synth", "--shape", "tiny-moe", "--quant", "q8", "--json"])
        .args(["--token-reuse", &REUSE.to_string(), "--cluster-kib", "8"])
        .arg("--profile-from")
        .arg(&profile)
        .arg("-o")
        .arg(&lsb)
        .arg("--gguf")
        .arg(&gguf)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(summary["gguf"]["architecture"], "qwen3moe");

    // The routing reached on the held-out rows.
    let file = LsbFile::open(&lsb).unwrap();
    let c = file.meta.model.clone();
    let moe = c.moe.clone().unwrap();
    assert_eq!((moe.num_experts, moe.experts_per_token), (16, 4));
    let reuse = summary["token_reuse"].as_f64().unwrap();
    assert!((reuse - REUSE).abs() < 0.15, "token reuse {reuse}");
    for (l, meta) in file.meta.layers.iter().enumerate() {
        let r = meta.routing.as_ref().unwrap();
        let sum: f32 = r.expert_freq.iter().sum();
        assert!(
            (sum - 4.0).abs() < 1e-3,
            "layer {l}: frequencies sum to {sum}"
        );
        assert!(
            (0.0..=1.0).contains(&r.lookahead_recall),
            "{}",
            r.lookahead_recall
        );
    }

    // The GGUF: the same configuration and the same experts.
    let g = GgufFile::open(&gguf).unwrap();
    let mut expected = c.clone();
    expected.eos_token_ids.truncate(1);
    assert_eq!(g.config().unwrap(), expected);
    let want = leanstream::source::lsb_dense::tensors(&file, true).unwrap();
    let (h, m) = (c.hidden_size, moe.expert_intermediate_size);
    for (l, e) in [(0, 0), (1, 7), (c.num_layers - 1, 15)] {
        for (part, shape) in [
            ("gate_proj", [m, h]),
            ("up_proj", [m, h]),
            ("down_proj", [h, m]),
        ] {
            let name = format!("model.layers.{l}.mlp.experts.{e}.{part}.weight");
            let got = g.tensor_f32(&name, &shape).unwrap();
            let (_, want) = &want[&name];
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            let worst = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            if part == "down_proj" {
                // Re-encoded along its rows: within one q8 step of the largest value.
                assert!(worst <= scale / 64.0, "{name}: off by {worst}");
            } else {
                assert_eq!(worst, 0.0, "{name} differs");
            }
        }
        let router = format!("model.layers.{l}.mlp.gate.weight");
        let got = g.tensor_f32(&router, &[16, h]).unwrap();
        assert!(got == want[&router].1, "{router} differs");
    }

    // Streamed at the minimum, with and without the look-ahead: resident's greedy tokens.
    let prompt = random_ids(5, 12, c.vocab_size);
    let greedy = |o: SessionOptions| -> Vec<u32> {
        let mut s = Session::open(&o).unwrap();
        let m = s.model();
        let mut cache = m.new_cache(64);
        let mut last = m.forward(&prompt, &mut cache, false).unwrap();
        let mut out = Vec::new();
        for _ in 0..8 {
            let t = (0..last.len())
                .max_by(|&a, &b| last[a].total_cmp(&last[b]).then(b.cmp(&a)))
                .unwrap() as u32;
            out.push(t);
            last = m.forward(&[t], &mut cache, false).unwrap();
        }
        out
    };
    let want = greedy(options(&lsb, PolicyChoice::Resident, None));
    let minimum = minimum_memory(&lsb, 64, KvType::F32).unwrap();
    let streamed = options(&lsb, PolicyChoice::Leanstream, Some(minimum));
    assert_eq!(greedy(streamed.clone()), want);
    let mut blind = streamed;
    blind.tuning.lookahead = false;
    assert_eq!(greedy(blind), want);
}
