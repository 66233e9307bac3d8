// RMSNorm of a row of `n` values, one workgroup: `out = x / sqrt(mean(x²) + eps) · w` (the CPU's
// `rms_norm`, runtime/src/model/norm.rs, whose sum of squares is added in another order). The 64
// invocations each sum the squares of every 64th value; their sums are added in a fixed tree.

struct Params {
    n: u32,
    eps: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
    pad3: u32,
    pad4: u32,
    pad5: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let base = wid.x * p.n;
    var acc = 0.0;
    for (var i = lid; i < p.n; i += WG) {
        let v = x[base + i];
        acc += v * v;
    }
    partial[lid] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            partial[lid] += partial[lid + s];
        }
        workgroupBarrier();
    }
    let inv = 1.0 / sqrt(partial[0] / f32(p.n) + bitcast<f32>(p.eps));
    for (var i = lid; i < p.n; i += WG) {
        out[base + i] = x[base + i] * inv * w[i];
    }
}
