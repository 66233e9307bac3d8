// A bundle FFN's down update: `Σ_k c_k · down_{idx[k]}` over the active neurons the select
// kernel listed (`idx`, their coefficients `vals`, their count `ind[3·layer]`), the down columns
// stored as rows of `h` values in one encoding in `w` (decoded by the appended `elem`,
// elems.wgsl), column `i` at byte `(i / slot_neurons)·slot_stride + (i % slot_neurons)·row_bytes`
// as common.wgsl's `row_at` finds it. The list is cut into `p.slices` consecutive runs; workgroup
// (x, s) sums run `s` in list order for 64 output values into `partial[s·h + j]`, and
// reduce.wgsl adds the runs to the residual stream in order.

struct Params {
    h: u32,
    row_bytes: u32,
    slices: u32,
    layer: u32,
    slot_neurons: u32,
    slot_stride: u32,
    pad2: u32,
    pad3: u32,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> idx: array<u32>;
@group(0) @binding(2) var<storage, read> vals: array<f32>;
@group(0) @binding(3) var<storage, read> ind: array<u32>;
@group(0) @binding(4) var<storage, read_write> partial: array<f32>;
@group(0) @binding(5) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let j = gid.x;
    if j >= p.h {
        return;
    }
    let s = wid.y;
    let count = ind[3u * p.layer];
    let lo = (s * count) / p.slices;
    let hi = ((s + 1u) * count) / p.slices;
    var acc = 0.0;
    for (var k = lo; k < hi; k++) {
        let i = idx[k];
        let rb = (i / p.slot_neurons) * p.slot_stride + (i % p.slot_neurons) * p.row_bytes;
        acc += vals[k] * elem(rb, j);
    }
    partial[s * p.h + j] = acc;
}
