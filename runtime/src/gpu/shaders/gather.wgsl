// The mat-vec over the rows a list names (common.wgsl), for the up rows of a bundle FFN's active
// neurons: workgroup `k` computes row `idx[k]`'s dot product `u` and turns `out[k]`, the neuron's
// activation `a`, into its coefficient `a·u` (with `p.accumulate` set, dReLU's `max(a·u, 0)`).
// The host dispatches exactly as many workgroups as the list holds (an indirect dispatch whose
// count the select kernel wrote), so every `k` is in the list.

@group(0) @binding(4) var<storage, read> idx: array<u32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let k = wid.x;
    let rb = idx[k] * p.row_bytes;
    var acc = 0.0;
    for (var u = lid; u < p.units; u += WG) {
        acc += unit_dot(rb, u);
    }
    partial[lid] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            partial[lid] += partial[lid + s];
        }
        workgroupBarrier();
    }
    if lid == 0u {
        var c = out[k] * partial[0];
        if p.accumulate != 0u {
            c = max(c, 0.0);
        }
        out[k] = c;
    }
}
