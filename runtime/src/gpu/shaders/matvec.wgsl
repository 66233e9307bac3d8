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
    let total = row_dot(rb, lid);
    if lid == 0u {
        if p.accumulate != 0u {
            out[row] += total;
        } else {
            out[row] = total;
        }
    }
}
