// The mat-vec's entry point (common.wgsl): one workgroup per row.

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
    let rb = row * p.row_bytes;
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
        if p.accumulate != 0u {
            out[row] += partial[0];
        } else {
            out[row] = partial[0];
        }
    }
}
