// The FFN's coefficients in place of the gate values: `gate = coef(act(gate), up)` (the CPU's
// `Activation::apply` and `coef`, format-spec/src/model_config.rs), one invocation a neuron.

struct Params {
    n: u32,
    // 0 SiLU, 1 ReLU, 2 GELU (tanh), 3 FATReLU, 4 dReLU.
    kind: u32,
    threshold: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
    pad3: u32,
    pad4: u32,
}

@group(0) @binding(0) var<storage, read_write> gate: array<f32>;
@group(0) @binding(1) var<storage, read> up: array<f32>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i >= p.n {
        return;
    }
    let g = gate[i];
    var a: f32;
    switch p.kind {
        case 0u: {
            a = g / (1.0 + exp(-g));
        }
        case 2u: {
            // sqrt(2/π)
            let k = 0.7978846;
            a = 0.5 * g * (1.0 + tanh(k * (g + 0.044715 * g * g * g)));
        }
        case 3u: {
            a = select(0.0, g, g >= bitcast<f32>(p.threshold));
        }
        default: {
            a = max(g, 0.0);
        }
    }
    var c = a * up[i];
    if p.kind == 4u {
        c = max(c, 0.0);
    }
    gate[i] = c;
}
