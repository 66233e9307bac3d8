//! The converter's memory: its OS-measured peak stays within the bound it states before any work,
//! and does not grow with depth (it holds one block's weights and one layer boundary's
//! calibration state, whatever the number of layers).

use std::path::Path;
use std::process::Command;

use leanstream_tests::converted::{bin, scratch};
use leanstream_tests::tiny::{write_tiny_model, TinySpec};

/// Converts `spec` and returns (measured peak RSS, stated estimate), in bytes.
fn convert(name: &str, spec: &TinySpec) -> (u64, u64) {
    let dir = leanstream_tests::fresh_dir(&scratch(), name);
    write_tiny_model(&dir, spec).unwrap();
    let out = scratch().join(format!("{name}.lsb"));
    let o = Command::new(bin("leanstream-prep"))
        .arg("convert")
        .arg(&dir)
        .arg("-o")
        .arg(&out)
        .args(["--calib-tokens", "1024", "--epochs", "1"])
        .args(["--sparsity", "target:0.5", "--quant", "q8", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v = leanstream_tests::cli::json_output(&o);
    let peak = v["peak_rss_bytes"].as_u64().expect("peak_rss_bytes");
    let stated = v["memory_estimate"]["total"].as_u64().expect("estimate");
    assert!(Path::new(&out).exists());
    (peak, stated)
}

#[test]
fn the_converters_peak_memory_is_within_its_estimate_and_does_not_grow_with_depth() {
    // Layers heavy next to the calibration state: one block is 9 MiB of attention and 27 MiB of
    // FFN in f32, so holding every block (or every mapped page of the source) would add a hundred
    // MiB from one layer to four.
    let spec = |layers| TinySpec {
        hidden: 768,
        intermediate: 3072,
        layers,
        heads: 12,
        kv_heads: 12,
        head_dim: 64,
        ..TinySpec::llama()
    };
    let (peak1, stated1) = convert("memory-1-layer", &spec(1));
    let (peak4, stated4) = convert("memory-4-layers", &spec(4));
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "1 layer: peak {:.1} MiB (stated {:.1}); 4 layers: peak {:.1} MiB (stated {:.1})",
        mib(peak1),
        mib(stated1),
        mib(peak4),
        mib(stated4)
    );
    assert!(peak1 <= stated1, "{peak1} > stated {stated1}");
    assert!(peak4 <= stated4, "{peak4} > stated {stated4}");
    // Three more blocks weigh 3 × 36 MiB in f32; allow less than half of one.
    let block = (4 * 768 * 768 + 3 * 768 * 3072) * 4;
    assert!(
        peak4 < peak1 + block / 2,
        "peak grew from {:.1} to {:.1} MiB with depth",
        mib(peak1),
        mib(peak4)
    );
    // The stated bound is a bound, not a guess far above: within 2x of what was measured.
    assert!(stated4 < 2 * peak4, "stated {stated4} vs measured {peak4}");
}
