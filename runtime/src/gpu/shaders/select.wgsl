// A bundle FFN's skip rule over every neuron of a layer (runtime/src/streaming/skip_rule.rs, the
// CPU's `gate_pass`): from the gate values `g` (and under `gate_up` the up values `u`), each
// neuron's activation `a = act(g)` and score (`|a|` under `gate`, `|coef(a, u)|` under
// `gate_up`), written to `scores[layer·n + i]`; the neurons whose score exceeds the threshold
// listed in stored order: `idx[k]` the neuron, `vals[k]` its `a` (under `gate`: the gather
// kernel turns it into the coefficient once it has the up row's value) or its coefficient (under
// `gate_up`), and their count, with 1 and 1, at `ind[3·layer]`: the next dispatches' workgroups.
//
// One workgroup of 256 invocations: each takes a run of consecutive neurons, counts its active
// ones, and writes them from the offset the runs before it leave.
//
// A streamed layer (`p.mapped`, mapped.wgsl) has its neurons in the GPU's neuron pool: neuron `i`
// is listed as its pool row `map[i]`, and a neuron the CPU did not ask for (`map[i]` is
// `SKIPPED`) is never active (its score is written as 0; the host knows it was not computed).

struct Params {
    n: u32,
    // 0 SiLU, 1 ReLU, 2 GELU (tanh), 3 FATReLU, 4 dReLU (act.wgsl's).
    kind: u32,
    fat: u32,
    // 0 `gate`, 1 `gate_up`.
    rule: u32,
    threshold: u32,
    layer: u32,
    mapped: u32,
    pad1: u32,
}

@group(0) @binding(0) var<storage, read> gate: array<f32>;
@group(0) @binding(1) var<storage, read> up: array<f32>;
@group(0) @binding(2) var<storage, read_write> idx: array<u32>;
@group(0) @binding(3) var<storage, read_write> vals: array<f32>;
@group(0) @binding(4) var<storage, read_write> scores: array<f32>;
@group(0) @binding(5) var<storage, read_write> ind: array<u32>;
@group(0) @binding(6) var<storage, read> map: array<u32>;
@group(0) @binding(7) var<uniform> p: Params;

const SKIPPED: u32 = 0xffffffffu;

const WG: u32 = 256u;
var<workgroup> counts: array<u32, WG>;

fn act(g: f32) -> f32 {
    switch p.kind {
        case 0u: {
            return g / (1.0 + exp(-g));
        }
        case 2u: {
            // sqrt(2/π)
            let k = 0.7978846;
            return 0.5 * g * (1.0 + tanh(k * (g + 0.044715 * g * g * g)));
        }
        case 3u: {
            return select(0.0, g, g >= bitcast<f32>(p.fat));
        }
        default: {
            return max(g, 0.0);
        }
    }
}

// The value listed for neuron `i`: its activation under `gate`, its coefficient under `gate_up`.
fn value(i: u32) -> f32 {
    let a = act(gate[i]);
    if p.rule == 0u {
        return a;
    }
    var c = a * up[i];
    if p.kind == 4u {
        c = max(c, 0.0);
    }
    return c;
}

// Whether neuron `i` was computed.
fn computed(i: u32) -> bool {
    return p.mapped == 0u || map[i] != SKIPPED;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32) {
    let chunk = (p.n + WG - 1u) / WG;
    let lo = min(lid * chunk, p.n);
    let hi = min(lo + chunk, p.n);
    let threshold = bitcast<f32>(p.threshold);
    let base = p.layer * p.n;
    var m = 0u;
    for (var i = lo; i < hi; i++) {
        if !computed(i) {
            scores[base + i] = 0.0;
            continue;
        }
        let s = abs(value(i));
        scores[base + i] = s;
        if s > threshold {
            m++;
        }
    }
    counts[lid] = m;
    workgroupBarrier();
    var at = 0u;
    for (var t = 0u; t < lid; t++) {
        at += counts[t];
    }
    // The decisions are the scores written above, so the second pass lists what the first counted.
    for (var i = lo; i < hi; i++) {
        if computed(i) && scores[base + i] > threshold {
            var row = i;
            if p.mapped != 0u {
                row = map[i];
            }
            idx[at] = row;
            vals[at] = value(i);
            at++;
        }
    }
    if lid == WG - 1u {
        ind[3u * p.layer] = at;
        ind[3u * p.layer + 1u] = 1u;
        ind[3u * p.layer + 2u] = 1u;
    }
}
