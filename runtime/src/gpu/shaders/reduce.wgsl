// Adds the down update's runs (down.wgsl) to the residual stream, in order: `x[j] += partial[s·h
// + j]` for s = 0, 1, …

struct Params {
    h: u32,
    slices: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
    pad3: u32,
    pad4: u32,
    pad5: u32,
}

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> partial: array<f32>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let j = gid.x;
    if j >= p.h {
        return;
    }
    var v = x[j];
    for (var s = 0u; s < p.slices; s++) {
        v += partial[s * p.h + j];
    }
    x[j] = v;
}
