// The mat-vec over a streamed layer's neurons (common.wgsl): workgroup `row` computes the dot
// product of neuron `row` (a stored position) from its row in the GPU's neuron pool, row
// `map[row]` (`row_at`), into `out[row]`; a neuron the CPU did not ask for (`map[row]` is
// `SKIPPED`: its cluster not needed, or it is no candidate) is left as it was, and select.wgsl
// passes it over.

@group(0) @binding(4) var<storage, read> map: array<u32>;

const SKIPPED: u32 = 0xffffffffu;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.x + wid.y * nwg.x;
    if row >= p.rows {
        return;
    }
    let m = map[row];
    if m == SKIPPED {
        return;
    }
    let rb = row_at(m);
    let total = row_dot(rb, lid);
    if lid == 0u {
        out[row] = total;
    }
}
