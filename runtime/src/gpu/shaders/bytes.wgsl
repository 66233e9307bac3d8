// Loads from the encoded weights `w` (a storage array of u32 words that the shader including
// this text declares): bytes, little-endian u16 and u32, f16 values.

// The byte of `w` at byte offset `off`.
fn ld8(off: u32) -> u32 {
    return (w[off >> 2u] >> ((off & 3u) * 8u)) & 0xffu;
}

// The little-endian u16 at an even byte offset.
fn ld16(off: u32) -> u32 {
    return (w[off >> 2u] >> ((off & 2u) * 8u)) & 0xffffu;
}

// The little-endian u32 at an even byte offset (block layouts keep 2-byte alignment only).
fn ld32(off: u32) -> u32 {
    let i = off >> 2u;
    if (off & 2u) == 0u {
        return w[i];
    }
    return (w[i] >> 16u) | (w[i + 1u] << 16u);
}

fn f16_at(off: u32) -> f32 {
    return unpack2x16float(ld16(off)).x;
}
