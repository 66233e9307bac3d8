// Mat-vec `out[r] = row r · x` over a weight matrix in one of the file format's encodings
// (FORMAT.md §10), read as stored: the rows end to end in `w`, byte for byte. One workgroup per row;
// its 64 invocations take the row's units (a value, a block of 32, or a super-block of 256) in
// turn, each summing its own in order, and add their sums in a fixed tree. No subgroup operations,
// so that every Vulkan or Metal device runs it, Mesa's lavapipe (a CPU) included.
//
// The host appends bytes.wgsl, an entry point (matvec.wgsl: every row; gather.wgsl: the rows a
// list names) and the encoding's `unit_dot(row_byte_offset, unit)` to this text.
//
// `xin` holds the input: for the float encodings its f32 values; for the block encodings its q8
// form (the CPU kernels' `Q8Vec`): the quants, four to a word, then one f32 scale per 32 values
// from word `p.scales`, then one f32 `scale · Σ quants` per 32 values from word `p.sums`.
//
// With `p.accumulate` the row's result is added to `out[row]` (the decode step's residual adds:
// one f32 addition, as the CPU's `x += proj`).
//
// The listed-row entries (gather.wgsl, mapped.wgsl) find row `i` with `row_at`: rows lie in slots
// of `p.slot_neurons` rows, `p.slot_stride` bytes apart (a streamed FFN's GPU neuron pool); a
// matrix of rows end to end is one slot (`slot_neurons` 2³² − 1, `slot_stride` 0).

struct Params {
    rows: u32,
    units: u32,
    row_bytes: u32,
    scales: u32,
    sums: u32,
    // 1: add the result to `out` (the residual stream) instead of writing it.
    accumulate: u32,
    slot_neurons: u32,
    slot_stride: u32,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> xin: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

// The first byte of row `i`.
fn row_at(i: u32) -> u32 {
    return (i / p.slot_neurons) * p.slot_stride + (i % p.slot_neurons) * p.row_bytes;
}

fn xf(i: u32) -> f32 {
    return bitcast<f32>(xin[i]);
}

// Scale and scaled sum of the input's q8 block `b`.
fn xd(b: u32) -> f32 {
    return bitcast<f32>(xin[p.scales + b]);
}

fn xs(b: u32) -> f32 {
    return bitcast<f32>(xin[p.sums + b]);
}

// The dot product of the row whose bytes start at `rb` with the input, computed by the whole
// workgroup (`lid` its invocation): each invocation sums its units in order, then the 64 sums
// are added in a fixed tree. Every invocation gets the result; call it in uniform control flow.
fn row_dot(rb: u32, lid: u32) -> f32 {
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
    return partial[0];
}

// Byte `k` of `v`, signed or unsigned.
fn sbyte(v: u32, k: u32) -> i32 {
    return bitcast<i32>(v << (24u - 8u * k)) >> 24u;
}

fn ubyte(v: u32, k: u32) -> i32 {
    return i32((v >> (8u * k)) & 0xffu);
}

// Σ of the products of four signed (`dot_ss`) or unsigned (`dot_us`) bytes with four signed ones.
fn dot_ss(a: u32, b: u32) -> i32 {
    return sbyte(a, 0u) * sbyte(b, 0u) + sbyte(a, 1u) * sbyte(b, 1u) + sbyte(a, 2u) * sbyte(b, 2u)
        + sbyte(a, 3u) * sbyte(b, 3u);
}

fn dot_us(a: u32, b: u32) -> i32 {
    return ubyte(a, 0u) * sbyte(b, 0u) + ubyte(a, 1u) * sbyte(b, 1u) + ubyte(a, 2u) * sbyte(b, 2u)
        + ubyte(a, 3u) * sbyte(b, 3u);
}

// Bits 0..3 of `bits` moved to bit 4 of bytes 0..3 (the fifth bit of four 5-bit codes).
fn spread4(bits: u32) -> u32 {
    return ((bits & 1u) << 4u) | ((bits & 2u) << 11u) | ((bits & 4u) << 18u) | ((bits & 8u) << 25u);
}

// `Σ q·q_x` of a 32-value block of 4-bit codes (the 16 bytes at `nib`: element j in the low nibble
// of byte j, j+16 in its high one) against the input's q8 block `b`; with `five`, bit j of `qh` is
// bit 4 of element j (q5_0, q5_1).
fn isum_q45(nib: u32, qh: u32, five: bool, b: u32) -> i32 {
    var isum = 0;
    for (var i = 0u; i < 4u; i++) {
        let v = ld32(nib + 4u * i);
        var lo = v & 0x0f0f0f0fu;
        var hi = (v >> 4u) & 0x0f0f0f0fu;
        if five {
            lo |= spread4(qh >> (4u * i));
            hi |= spread4(qh >> (16u + 4u * i));
        }
        isum += dot_us(lo, xin[8u * b + i]) + dot_us(hi, xin[8u * b + 4u + i]);
    }
    return isum;
}
