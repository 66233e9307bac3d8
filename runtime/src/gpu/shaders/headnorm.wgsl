// Qwen3's RMSNorm of each query and key head, in place before the rotary embedding (the CPU's
// `rms_norm_in_place` per head, runtime/src/model/attention.rs): one workgroup a head, the query
// heads first (weights `wq`), then the key heads (weights `wk`). Sums as in norm.wgsl.

struct Params {
    hd: u32,
    eps: u32,
    heads: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
    pad3: u32,
    pad4: u32,
}

@group(0) @binding(0) var<storage, read_write> q: array<f32>;
@group(0) @binding(1) var<storage, read_write> k: array<f32>;
@group(0) @binding(2) var<storage, read> wq: array<f32>;
@group(0) @binding(3) var<storage, read> wk: array<f32>;
@group(0) @binding(4) var<uniform> p: Params;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

fn value(is_q: bool, i: u32) -> f32 {
    if is_q {
        return q[i];
    }
    return k[i];
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let is_q = wid.x < p.heads;
    let base = select(wid.x - p.heads, wid.x, is_q) * p.hd;
    var acc = 0.0;
    for (var i = lid; i < p.hd; i += WG) {
        let v = value(is_q, base + i);
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
    let inv = 1.0 / sqrt(partial[0] / f32(p.hd) + bitcast<f32>(p.eps));
    for (var i = lid; i < p.hd; i += WG) {
        if is_q {
            q[base + i] = q[base + i] * inv * wq[i];
        } else {
            k[base + i] = k[base + i] * inv * wk[i];
        }
    }
}
