// Each encoding's `unit_dot(rb, u)`: unit `u` of the row whose bytes start at `rb`, times the
// input. The host appends the one after the marker `//@name` to common.wgsl. The block encodings
// compute each unit's float terms as the CPU kernels do (runtime/src/kernels/portable.rs), in the
// same order: the integer sums are exact, so a unit's term differs from the CPU's by at most the
// rounding a fused multiply-add can change.

//@f32
fn unit_dot(rb: u32, u: u32) -> f32 {
    return bitcast<f32>(w[(rb >> 2u) + u]) * xf(u);
}

//@f16
fn unit_dot(rb: u32, u: u32) -> f32 {
    return f16_at(rb + 2u * u) * xf(u);
}

//@bf16
fn unit_dot(rb: u32, u: u32) -> f32 {
    return bitcast<f32>(ld16(rb + 2u * u) << 16u) * xf(u);
}

//@q8_0
// `f16 d`, `i8 q[32]`: `d·d_x·Σ q·q_x`.
fn unit_dot(rb: u32, b: u32) -> f32 {
    let off = rb + 34u * b;
    var isum = 0;
    for (var i = 0u; i < 8u; i++) {
        isum += dot_ss(ld32(off + 2u + 4u * i), xin[8u * b + i]);
    }
    return f16_at(off) * xd(b) * f32(isum);
}

//@q4_0
// `f16 d`, `u8 b[16]` (element j in the low nibble of byte j, j+16 in its high one):
// `d·(d_x·Σ q·q_x − 8·s_x)`.
fn unit_dot(rb: u32, b: u32) -> f32 {
    let off = rb + 18u * b;
    return f16_at(off) * (xd(b) * f32(isum_q45(off + 2u, 0u, false, b)) - 8.0 * xs(b));
}

//@q4_1
// `f16 d`, `f16 m`, `u8 b[16]`: `d·d_x·Σ q·q_x + m·s_x`.
fn unit_dot(rb: u32, b: u32) -> f32 {
    let off = rb + 20u * b;
    return f16_at(off) * xd(b) * f32(isum_q45(off + 4u, 0u, false, b)) + f16_at(off + 2u) * xs(b);
}

//@q5_0
// `f16 d`, `u32 qh` (bit j: bit 4 of element j), `u8 b[16]`: `d·(d_x·Σ q·q_x − 16·s_x)`.
fn unit_dot(rb: u32, b: u32) -> f32 {
    let off = rb + 22u * b;
    return f16_at(off) * (xd(b) * f32(isum_q45(off + 6u, ld32(off + 2u), true, b)) - 16.0 * xs(b));
}

//@q5_1
// `f16 d`, `f16 m`, `u32 qh`, `u8 b[16]`: `d·d_x·Σ q·q_x + m·s_x`.
fn unit_dot(rb: u32, b: u32) -> f32 {
    let off = rb + 24u * b;
    let isum = isum_q45(off + 8u, ld32(off + 4u), true, b);
    return f16_at(off) * xd(b) * f32(isum) + f16_at(off + 2u) * xs(b);
}

//@q4_k
// `f16 d`, `f16 dmin`, `u8 s[12]`, `u8 b[128]`; per 32-value sub-block j (q8 block 8·u + j):
// `(d·sc_j)·(d_x·Σ q·q_x) − (dmin·m_j)·s_x`, summed from 0 in order.
fn unit_dot(rb: u32, u: u32) -> f32 {
    return k45_dot(rb + 144u * u, u, false);
}

//@q5_k
// As q4_k, with `u8 qh[32]` before the nibbles: bit j of `qh[l]` is bit 4 of element l of
// sub-block j.
fn unit_dot(rb: u32, u: u32) -> f32 {
    return k45_dot(rb + 176u * u, u, true);
}

//@q6_k
// `u8 ql[128]`, `u8 qh[64]`, `i8 sc[16]`, `f16 d`; per q8 block j (two 16-value sub-blocks):
// `d·(d_x·Σ_k sc_k·Σ (q − 32)·q_x)`, summed from 0 in order.
fn unit_dot(rb: u32, u: u32) -> f32 {
    let off = rb + 210u * u;
    let d = f16_at(off + 208u);
    var sum = 0.0;
    for (var j = 0u; j < 8u; j++) {
        let h = j / 4u;
        let k = j % 4u;
        let ql = off + 64u * h + 32u * (k & 1u);
        let qh = off + 128u + 32u * h;
        let shift = select(4u, 0u, k < 2u);
        let xb = 8u * u + j;
        var part0 = 0;
        var part1 = 0;
        for (var i = 0u; i < 8u; i++) {
            let q = ((ld32(ql + 4u * i) >> shift) & 0x0f0f0f0fu)
                | (((ld32(qh + 4u * i) >> (2u * k)) & 0x03030303u) << 4u);
            let xw = xin[8u * xb + i];
            let t = dot_us(q, xw) - 32 * dot_us(0x01010101u, xw);
            if i < 4u {
                part0 += t;
            } else {
                part1 += t;
            }
        }
        let sc0 = bitcast<i32>(ld8(off + 192u + 2u * j) << 24u) >> 24u;
        let sc1 = bitcast<i32>(ld8(off + 193u + 2u * j) << 24u) >> 24u;
        sum += d * (xd(xb) * f32(sc0 * part0 + sc1 * part1));
    }
    return sum;
}

//@k45
// Shared by q4_k and q5_k (appended to both).
fn k45_dot(off: u32, u: u32, five: bool) -> f32 {
    let d = f16_at(off);
    let dmin = f16_at(off + 2u);
    let qs = select(off + 16u, off + 48u, five);
    var sum = 0.0;
    for (var j = 0u; j < 8u; j++) {
        var sc: u32;
        var m: u32;
        if j < 4u {
            sc = ld8(off + 4u + j) & 63u;
            m = ld8(off + 8u + j) & 63u;
        } else {
            sc = (ld8(off + 8u + j) & 15u) | ((ld8(off + j) >> 6u) << 4u);
            m = (ld8(off + 8u + j) >> 4u) | ((ld8(off + 4u + j) >> 6u) << 4u);
        }
        let g = qs + 32u * (j / 2u);
        let shift = 4u * (j % 2u);
        let xb = 8u * u + j;
        var isum = 0;
        for (var i = 0u; i < 8u; i++) {
            var q = (ld32(g + 4u * i) >> shift) & 0x0f0f0f0fu;
            if five {
                q |= ((ld32(off + 16u + 4u * i) >> j) & 0x01010101u) << 4u;
            }
            isum += dot_us(q, xin[8u * xb + i]);
        }
        sum += (d * f32(sc)) * (xd(xb) * f32(isum)) - (dmin * f32(m)) * xs(xb);
    }
    return sum;
}
