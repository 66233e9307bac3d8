// An f32 vector's q8 form, as the CPU's `Q8Vec::quantize` makes it (runtime/src/kernels/operand.rs)
// and common.wgsl reads it: per block of 32 values `d = amax / 127`, `q = round(x / d)` (to
// nearest, ties to even, as `x · (1/d)`), the quants four to a word, then the scales `d` from word
// `p.scales`, then `d · Σ q` from word `p.sums`. One invocation per block.
//
// The two divisions are computed exactly rounded (`div_rn`, in integers), since a GPU's `/` may
// be off by 2.5 ulp: so the scales and quants are the CPU's bit for bit, given the same input.
// Differences: a block whose largest magnitude is below 127·2⁻¹²⁶ (about 1.5e-36; its scale
// would be subnormal) quantizes to zeros here; a GPU may flush subnormal inputs to zero; NaN and
// infinite inputs are not reproduced.

struct Params {
    blocks: u32,
    scales: u32,
    sums: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
    pad3: u32,
    pad4: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> q8: array<u32>;
@group(0) @binding(2) var<uniform> p: Params;

// 127·2⁻¹²⁶: the smallest largest magnitude whose scale is a normal number.
const MIN_AMAX: f32 = 0x1.fcp-120f;

// `a / b` rounded to nearest (ties to even), for positive normal `a` and `b` whose quotient is
// normal: the 24-bit significands divided by shifts and subtractions, one bit at a time.
fn div_rn(a: f32, b: f32) -> f32 {
    let ba = bitcast<u32>(a);
    let bb = bitcast<u32>(b);
    let ma = (ba & 0x7fffffu) | 0x800000u;
    let mb = (bb & 0x7fffffu) | 0x800000u;
    var e = i32(ba >> 23u) - i32(bb >> 23u) + 127;
    var r = ma;
    if r < mb {
        r = r << 1u;
        e -= 1;
    }
    // mb ≤ r < 2·mb: 25 quotient bits (24 and a rounding bit); r < 2·mb < 2²⁵ throughout.
    var quo = 0u;
    for (var i = 0u; i < 25u; i++) {
        quo = quo << 1u;
        if r >= mb {
            r -= mb;
            quo |= 1u;
        }
        r = r << 1u;
    }
    var m = quo >> 1u;
    if (quo & 1u) == 1u && (r != 0u || (m & 1u) == 1u) {
        m += 1u;
    }
    if m == 0x1000000u {
        m = m >> 1u;
        e += 1;
    }
    return bitcast<f32>((u32(e) << 23u) | (m & 0x7fffffu));
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let b = gid.x;
    if b >= p.blocks {
        return;
    }
    let base = 32u * b;
    var amax = 0.0;
    for (var i = 0u; i < 32u; i++) {
        amax = max(amax, abs(x[base + i]));
    }
    var d = 0.0;
    var inv = 0.0;
    if amax >= MIN_AMAX {
        d = div_rn(amax, 127.0);
        inv = div_rn(1.0, d);
    }
    var sum = 0;
    for (var w = 0u; w < 8u; w++) {
        var word = 0u;
        for (var k = 0u; k < 4u; k++) {
            let v = i32(clamp(round(x[base + 4u * w + k] * inv), -127.0, 127.0));
            sum += v;
            word |= (bitcast<u32>(v) & 0xffu) << (8u * k);
        }
        q8[8u * b + w] = word;
    }
    q8[p.scales + b] = bitcast<u32>(d);
    q8[p.sums + b] = bitcast<u32>(d * f32(sum));
}
