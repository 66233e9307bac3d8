// Causal softmax attention of one token's query heads over this layer's cache, one workgroup a
// head (the CPU's `KvCache::attend` on an f32 cache): scores `scale · q·k` of positions `lo..len`
// (`lo` > 0 under a sliding window), their softmax (less the largest score, `exp`, divided by the
// sum), and the weighted sum of the values, added position by position. The 64 invocations take
// every 64th position for the scores and every 64th dimension for the sum; the maximum and the
// sum of the exponentials are taken in a fixed tree.

struct Params {
    heads: u32,
    // Query heads per key/value head.
    group: u32,
    hd: u32,
    capacity: u32,
    scale: u32,
    // The sliding window (0: none).
    window: u32,
    pad0: u32,
    pad1: u32,
}

struct Step {
    pos: u32,
    len: u32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> kc: array<f32>;
@group(0) @binding(2) var<storage, read> vc: array<f32>;
@group(0) @binding(3) var<storage, read_write> scores: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<uniform> step: Step;
@group(0) @binding(6) var<uniform> p: Params;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let h = wid.x;
    let len = step.len;
    var lo = 0u;
    if p.window != 0u && len > p.window {
        lo = len - p.window;
    }
    let qb = h * p.hd;
    let kb = (h / p.group) * p.capacity * p.hd;
    let sb = h * p.capacity;
    let scale = bitcast<f32>(p.scale);

    var m = -3.4028235e38;
    for (var t = lo + lid; t < len; t += WG) {
        var s = 0.0;
        let kr = kb + t * p.hd;
        for (var d = 0u; d < p.hd; d++) {
            s += q[qb + d] * kc[kr + d];
        }
        s = s * scale;
        scores[sb + t] = s;
        m = max(m, s);
    }
    partial[lid] = m;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            partial[lid] = max(partial[lid], partial[lid + s]);
        }
        workgroupBarrier();
    }
    let top = partial[0];
    workgroupBarrier();

    var sum = 0.0;
    for (var t = lo + lid; t < len; t += WG) {
        let e = exp(scores[sb + t] - top);
        scores[sb + t] = e;
        sum += e;
    }
    partial[lid] = sum;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            partial[lid] += partial[lid + s];
        }
        workgroupBarrier();
    }
    let total = partial[0];
    // Every invocation's exponentials, written to `scores`, visible to all.
    storageBarrier();

    for (var d = lid; d < p.hd; d += WG) {
        var acc = 0.0;
        for (var t = lo; t < len; t++) {
            acc += (scores[sb + t] / total) * vc[kb + t * p.hd + d];
        }
        out[qb + d] = acc;
    }
}
