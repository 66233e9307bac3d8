// Each encoding's `elem(rb, j)`: value `j` of the row whose bytes start at `rb`, decoded as
// `dequantize_row` does (format-spec/src/quant.rs, quant_k.rs). The host appends the one after
// the marker `//@name` to down.wgsl.

//@f32
fn elem(rb: u32, j: u32) -> f32 {
    return bitcast<f32>(w[(rb >> 2u) + j]);
}

//@f16
fn elem(rb: u32, j: u32) -> f32 {
    return f16_at(rb + 2u * j);
}

//@bf16
fn elem(rb: u32, j: u32) -> f32 {
    return bitcast<f32>(ld16(rb + 2u * j) << 16u);
}

//@q8_0
fn elem(rb: u32, j: u32) -> f32 {
    let off = rb + 34u * (j / 32u);
    let q = bitcast<i32>(ld8(off + 2u + j % 32u) << 24u) >> 24u;
    return f16_at(off) * f32(q);
}

//@q4_0
fn elem(rb: u32, j: u32) -> f32 {
    let off = rb + 18u * (j / 32u);
    return f16_at(off) * f32(i32(nibble(off + 2u, j % 32u)) - 8);
}

//@q4_1
fn elem(rb: u32, j: u32) -> f32 {
    let off = rb + 20u * (j / 32u);
    return f16_at(off) * f32(nibble(off + 4u, j % 32u)) + f16_at(off + 2u);
}

//@q5_0
fn elem(rb: u32, j: u32) -> f32 {
    let off = rb + 22u * (j / 32u);
    let e = j % 32u;
    let q = nibble(off + 6u, e) | (((ld32(off + 2u) >> e) & 1u) << 4u);
    return f32(i32(q) - 16) * f16_at(off);
}

//@q5_1
fn elem(rb: u32, j: u32) -> f32 {
    let off = rb + 24u * (j / 32u);
    let e = j % 32u;
    let q = nibble(off + 8u, e) | (((ld32(off + 4u) >> e) & 1u) << 4u);
    return f32(q) * f16_at(off) + f16_at(off + 2u);
}

//@q4_k
fn elem(rb: u32, j: u32) -> f32 {
    return k45_elem(rb + 144u * (j / 256u), j % 256u, false);
}

//@q5_k
fn elem(rb: u32, j: u32) -> f32 {
    return k45_elem(rb + 176u * (j / 256u), j % 256u, true);
}

//@q6_k
// `u8 ql[128]`, `u8 qh[64]`, `i8 sc[16]`, `f16 d` (quant_k.rs `q6_code`).
fn elem(rb: u32, j: u32) -> f32 {
    let off = rb + 210u * (j / 256u);
    let e = j % 256u;
    let h = e / 128u;
    let k = (e % 128u) / 32u;
    let l = e % 32u;
    let ql = ld8(off + 64u * h + l + 32u * (k & 1u));
    let low = select(ql >> 4u, ql & 15u, k < 2u);
    let high = (ld8(off + 128u + 32u * h + l) >> (2u * k)) & 3u;
    let sc = bitcast<i32>(ld8(off + 192u + e / 16u) << 24u) >> 24u;
    let ds = f16_at(off + 208u) * f32(sc);
    return ds * f32(i32(low | (high << 4u)) - 32);
}

//@nibble
// Shared by q4_0 … q5_1: the 4-bit code of element `e` of a 32-value block whose 16 bytes start at
// `nib` (element e in the low nibble of byte e, e + 16 in the high one).
fn nibble(nib: u32, e: u32) -> u32 {
    let b = ld8(nib + e % 16u);
    return select(b >> 4u, b & 15u, e < 16u);
}

//@k45
// Shared by q4_k and q5_k: element `e` of the 256-value super-block at `off`.
fn k45_elem(off: u32, e: u32, five: bool) -> f32 {
    let j = e / 32u;
    let l = e % 32u;
    var sc: u32;
    var m: u32;
    if j < 4u {
        sc = ld8(off + 4u + j) & 63u;
        m = ld8(off + 8u + j) & 63u;
    } else {
        sc = (ld8(off + 8u + j) & 15u) | ((ld8(off + j) >> 6u) << 4u);
        m = (ld8(off + 8u + j) >> 4u) | ((ld8(off + 4u + j) >> 6u) << 4u);
    }
    let qs = select(off + 16u, off + 48u, five);
    let b = ld8(qs + 32u * (j / 2u) + l);
    var q = select(b >> 4u, b & 15u, j % 2u == 0u);
    if five {
        q |= ((ld8(off + 16u + l) >> j) & 1u) << 4u;
    }
    let d1 = f16_at(off) * f32(sc);
    let m1 = f16_at(off + 2u) * f32(m);
    return d1 * f32(q) - m1;
}
