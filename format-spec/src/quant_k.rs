//! The 5-bit block types (`Q5_0`, `Q5_1`) and the K-quants (`Q4_K`, `Q5_K`, `Q6_K`): block layouts
//! byte for byte ggml's, decoded with ggml's float operations in ggml's order (so a GGUF tensor
//! decodes here to the bits llama.cpp decodes it to), and a reference quantizer whose rounding
//! direction of every scale keeps each value within the bound of [`block_bound`].
//!
//! | type | unit | bytes | layout and decoded value |
//! |---|---|---|---|
//! | `Q5_0` | 32 | 22 | f16 `d`, u32 `qh`, 16 bytes `qs`: `q = nibble | bit·16` (element `j < 16` in the low nibble of `qs[j]`, `j + 16` in its high nibble, bit `j` of `qh` the fifth bit of element `j`): `x = (q − 16)·d` |
//! | `Q5_1` | 32 | 24 | f16 `d`, f16 `m`, then `qh`, `qs` as in `Q5_0`: `x = q·d + m` |
//! | `Q4_K` | 256 | 144 | f16 `d`, f16 `dmin`, 12 bytes of eight 6-bit scales `sc` and mins `m`, 128 bytes `qs`: sub-block `j` (32 values) of the 64-value group `g = j/2` is the low (`j` even) or high (`j` odd) nibbles of `qs[32g..32g+32]`: `x = (d·sc_j)·q − dmin·m_j` |
//! | `Q5_K` | 256 | 176 | as `Q4_K` with 32 bytes `qh` before `qs`: bit `j` of `qh[l]` is the fifth bit of element `l` of sub-block `j` |
//! | `Q6_K` | 256 | 210 | 128 bytes `ql` (low 4 bits), 64 bytes `qh` (high 2 bits), 16 × i8 scales, f16 `d`: sixteen sub-blocks of 16, `x = (d·sc_j)·(q − 32)` |
//!
//! The 6-bit scales and mins of `Q4_K`/`Q5_K` (ggml's `get_scale_min_k4`): for `j < 4`,
//! `sc_j = s[j] & 63`, `m_j = s[j + 4] & 63`; for `j ≥ 4`, `sc_j = (s[j + 4] & 15) | (s[j − 4] >> 6) << 4`,
//! `m_j = (s[j + 4] >> 4) | (s[j] >> 6) << 4`.

use crate::quant::{
    f16_at, f16_rounded, offset_codes, symmetric_codes, QuantType, BLOCK_LEN, K_BLOCK_LEN,
};

/// `(sc_j, m_j)` of a `Q4_K`/`Q5_K` block's packed scales `s` (12 bytes).
#[inline(always)]
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

fn pack_scale_min_k4(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] |= sc[j] & 63;
            s[j + 4] |= m[j] & 63;
        } else {
            s[j + 4] |= (sc[j] & 15) | ((m[j] & 15) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (m[j] >> 4) << 6;
        }
    }
    s
}

/// Decodes one block of `qtype` (one of this module's types) into `o`.
pub fn dequantize_block(qtype: QuantType, u: &[u8], o: &mut [f32]) {
    match qtype {
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let d = f16_at(u, 0);
            let (m, at) = if qtype == QuantType::Q5_1 {
                (f16_at(u, 2), 4)
            } else {
                (0.0, 2)
            };
            let qh = u32::from_le_bytes([u[at], u[at + 1], u[at + 2], u[at + 3]]);
            let qs = &u[at + 4..at + 4 + BLOCK_LEN / 2];
            for (j, b) in qs.iter().enumerate() {
                let q0 = ((b & 0x0f) as u32 | ((qh >> j) & 1) << 4) as i32;
                let q1 = ((b >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4) as i32;
                if qtype == QuantType::Q5_0 {
                    o[j] = (q0 - 16) as f32 * d;
                    o[j + 16] = (q1 - 16) as f32 * d;
                } else {
                    o[j] = q0 as f32 * d + m;
                    o[j + 16] = q1 as f32 * d + m;
                }
            }
        }
        QuantType::Q4_K | QuantType::Q5_K => {
            let d = f16_at(u, 0);
            let dmin = f16_at(u, 2);
            let s = &u[4..16];
            let (qh, qs) = if qtype == QuantType::Q5_K {
                (Some(&u[16..48]), &u[48..176])
            } else {
                (None, &u[16..144])
            };
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, s);
                let d1 = d * sc as f32;
                let m1 = dmin * m as f32;
                let group = &qs[32 * (j / 2)..32 * (j / 2) + 32];
                for (l, b) in group.iter().enumerate() {
                    let mut q = if j % 2 == 0 { b & 0x0f } else { b >> 4 };
                    if let Some(qh) = qh {
                        q |= ((qh[l] >> j) & 1) << 4;
                    }
                    o[32 * j + l] = d1 * q as f32 - m1;
                }
            }
        }
        QuantType::Q6_K => {
            let d = f16_at(u, 208);
            for (j, o) in o.chunks_exact_mut(16).enumerate() {
                let sc = u[192 + j] as i8;
                let ds = d * sc as f32;
                for (i, o) in o.iter_mut().enumerate() {
                    *o = ds * (q6_code(u, 16 * j + i) - 32) as f32;
                }
            }
        }
        _ => unreachable!("{qtype} is not a 5-bit or K-quant type"),
    }
}

/// The 6-bit code (0..63) of element `e` of a `Q6_K` block (ggml's layout: halves of 128 values;
/// in each, element `l + 32k` has its low 4 bits in `ql[64h + l + 32(k & 1)]` (low nibble for
/// `k < 2`) and its high 2 bits at bit `2k` of `qh[32h + l]`).
#[inline(always)]
pub fn q6_code(u: &[u8], e: usize) -> i32 {
    let (h, r) = (e / 128, e % 128);
    let (k, l) = (r / 32, r % 32);
    let ql = u[64 * h + l + 32 * (k & 1)];
    let low = if k < 2 { ql & 0x0f } else { ql >> 4 };
    let high = (u[128 + 32 * h + l] >> (2 * k)) & 3;
    (low | (high << 4)) as i32
}

/// Worst-case `|x − x̂|` of a block written by [`quantize_block`]: half the step of its coarsest
/// sub-block for the types with a minimum (round to nearest, no code clipped), the whole step for
/// `Q5_0` (its extreme maps to −16 and values of the other sign near it clip at +15, as in `Q4_0`).
pub fn block_bound(qtype: QuantType, u: &[u8]) -> f32 {
    match qtype {
        QuantType::Q5_0 => f16_at(u, 0).abs(),
        QuantType::Q5_1 => f16_at(u, 0).abs() / 2.0,
        QuantType::Q4_K | QuantType::Q5_K => {
            let d = f16_at(u, 0);
            (0..8)
                .map(|j| d * scale_min_k4(j, &u[4..16]).0 as f32)
                .fold(0.0f32, f32::max)
                / 2.0
        }
        QuantType::Q6_K => {
            let d = f16_at(u, 208);
            u[192..208]
                .iter()
                .map(|s| (d * *s as i8 as f32).abs())
                .fold(0.0f32, f32::max)
                / 2.0
        }
        _ => unreachable!("{qtype} is not a 5-bit or K-quant type"),
    }
}

fn code(v: f64, step: f64, max: f64) -> u8 {
    if step == 0.0 {
        0
    } else {
        (v / step).round().clamp(0.0, max) as u8
    }
}

/// Encodes one block of `qtype`; `None` if a scale overflows f16.
pub fn quantize_block(qtype: QuantType, x: &[f32]) -> Option<Vec<u8>> {
    match qtype {
        QuantType::Q5_0 => {
            let (d, codes) = symmetric_codes(x, 16.0)?;
            let mut out = d.to_le_bytes().to_vec();
            out.extend(pack_q5(&codes));
            Some(out)
        }
        QuantType::Q5_1 => {
            let (d, m, codes) = offset_codes(x, 31.0)?;
            let mut out = d.to_le_bytes().to_vec();
            out.extend(m.to_le_bytes());
            out.extend(pack_q5(&codes));
            Some(out)
        }
        QuantType::Q4_K | QuantType::Q5_K => {
            let levels = if qtype == QuantType::Q4_K { 15.0 } else { 31.0 };
            // Each sub-block's offset `dmin·m ≥ −min` (rounded up), then its step
            // `d·sc ≥ (max + dmin·m)/levels` (rounded up): no code is clipped.
            let sub: Vec<(f64, f64)> = x
                .chunks_exact(32)
                .map(|s| {
                    let min = s.iter().copied().fold(f32::INFINITY, f32::min).min(0.0) as f64;
                    let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max).max(0.0) as f64;
                    (-min, max)
                })
                .collect();
            let dmin = f16_rounded(sub.iter().map(|s| s.0).fold(0.0, f64::max) / 63.0, true)?;
            let dminf = dmin.to_f64();
            let mut m = [0u8; 8];
            let mut steps = [0f64; 8];
            for (j, (neg, max)) in sub.iter().enumerate() {
                m[j] = if dminf == 0.0 {
                    0
                } else {
                    (neg / dminf).ceil().min(63.0) as u8
                };
                steps[j] = (max + dminf * m[j] as f64) / levels;
            }
            let d = f16_rounded(steps.iter().copied().fold(0.0, f64::max) / 63.0, true)?;
            let df = d.to_f64();
            let mut sc = [0u8; 8];
            for j in 0..8 {
                sc[j] = if df == 0.0 {
                    0
                } else {
                    (steps[j] / df).ceil().min(63.0) as u8
                };
            }
            let mut out = d.to_le_bytes().to_vec();
            out.extend(dmin.to_le_bytes());
            out.extend(pack_scale_min_k4(&sc, &m));
            let mut codes = [0u8; K_BLOCK_LEN];
            for (j, s) in x.chunks_exact(32).enumerate() {
                let step = df * sc[j] as f64;
                let offset = dminf * m[j] as f64;
                for (c, v) in codes[32 * j..].iter_mut().zip(s) {
                    *c = code(*v as f64 + offset, step, levels);
                }
            }
            if qtype == QuantType::Q5_K {
                let mut qh = [0u8; 32];
                for (e, c) in codes.iter().enumerate() {
                    qh[e % 32] |= ((c >> 4) & 1) << (e / 32);
                }
                out.extend(qh);
            }
            let mut qs = [0u8; K_BLOCK_LEN / 2];
            for g in 0..4 {
                for l in 0..32 {
                    qs[32 * g + l] =
                        (codes[64 * g + l] & 0x0f) | ((codes[64 * g + 32 + l] & 0x0f) << 4);
                }
            }
            out.extend(qs);
            Some(out)
        }
        QuantType::Q6_K => {
            // Sub-block scale `amax/31` rounded up, so codes stay in −31..31 (never clipped).
            let scales: Vec<f64> = x
                .chunks_exact(16)
                .map(|s| s.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64 / 31.0)
                .collect();
            let d = f16_rounded(scales.iter().copied().fold(0.0, f64::max) / 127.0, true)?;
            let df = d.to_f64();
            let sc: Vec<i8> = scales
                .iter()
                .map(|s| {
                    if df == 0.0 {
                        0
                    } else {
                        (s / df).ceil().min(127.0) as i8
                    }
                })
                .collect();
            let mut out = vec![0u8; 210];
            for (e, v) in x.iter().enumerate() {
                let step = df * sc[e / 16] as f64;
                let q = if step == 0.0 {
                    0.0
                } else {
                    (*v as f64 / step).round().clamp(-32.0, 31.0)
                };
                let c = (q + 32.0) as u8;
                let (h, r) = (e / 128, e % 128);
                let (k, l) = (r / 32, r % 32);
                let ql = &mut out[64 * h + l + 32 * (k & 1)];
                *ql |= if k < 2 { c & 0x0f } else { (c & 0x0f) << 4 };
                out[128 + 32 * h + l] |= (c >> 4) << (2 * k);
            }
            for (o, s) in out[192..208].iter_mut().zip(&sc) {
                *o = *s as u8;
            }
            out[208..].copy_from_slice(&d.to_le_bytes());
            Some(out)
        }
        _ => unreachable!("{qtype} is not a 5-bit or K-quant type"),
    }
}

/// `Q5_0`/`Q5_1` bits: `qh` (bit `j` the fifth bit of element `j`), then the nibbles as `Q4_0`'s.
fn pack_q5(codes: &[u8]) -> Vec<u8> {
    let qh: u32 = codes
        .iter()
        .enumerate()
        .map(|(j, c)| (((c >> 4) & 1) as u32) << j)
        .sum();
    let mut out = qh.to_le_bytes().to_vec();
    out.extend((0..16).map(|j| (codes[j] & 0x0f) | ((codes[j + 16] & 0x0f) << 4)));
    out
}
