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
    let rb = row_at(idx[k]);
    let total = row_dot(rb, lid);
    if lid == 0u {
        var c = out[k] * total;
        if p.accumulate != 0u {
            c = max(c, 0.0);
        }
        out[k] = c;
    }
}
