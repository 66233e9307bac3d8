//! Weight encodings of the file format: how a row of `n` values is stored as bytes.
//!
//! A row is a sequence of little-endian *units*: one value for the float types, one block of
//! [`BLOCK_LEN`] values for the block types. The block layouts are byte-for-byte ggml/GGUF's
//! `Q8_0`, `Q4_0` and `Q4_1`, so tensors of a GGUF file are used as stored, and this format's `q8`
//! and `q4` (block scale, group 32, f16 scales) are `Q8_0` and `Q4_0`:
//!
//! | type | unit | bytes | decoded value |
//! |---|---|---|---|
//! | `F32` | 1 value | 4 | IEEE binary32 |
//! | `F16` | 1 value | 2 | IEEE binary16 |
//! | `BF16` | 1 value | 2 | the upper half of a binary32 |
//! | `Q8_0` | 32 values | 34 | f16 `d`, then 32 × i8 `q`: `x = d·q` |
//! | `Q4_0` | 32 values | 18 | f16 `d`, then 16 bytes whose low nibbles are elements 0..15 and high nibbles 16..31: `x = d·(q − 8)` |
//! | `Q4_1` | 32 values | 20 | f16 `d`, f16 `m`, then 16 bytes of nibbles as in `Q4_0`: `x = d·q + m` |
//!
//! This module is the scalar reference: prep quantizes with it and the runtime's fast kernels are
//! tested against it. Its quantizers round a block's scale *up* to f16 (and `Q4_1`'s minimum
//! *down*) so that no code is ever clipped by the scale's rounding; that is what makes the bounds of
//! [`max_abs_error`] hold exactly, which certified skipping relies on.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::quant_k;

/// Values per block of the block types.
pub const BLOCK_LEN: usize = 32;

/// How a tensor's values are encoded. The discriminants are the on-disk values.
#[repr(u32)]
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantType {
    F32 = 0,
    F16 = 1,
    BF16 = 2,
    Q8_0 = 3,
    Q4_0 = 4,
    Q4_1 = 5,
    Q5_0 = 6,
    Q5_1 = 7,
    Q4_K = 8,
    Q5_K = 9,
    Q6_K = 10,
}

/// Values per super-block of the K-quant types (`Q4_K`, `Q5_K`, `Q6_K`), ggml's `QK_K`.
pub const K_BLOCK_LEN: usize = 256;

/// The first format minor version whose files may hold the encodings `Q5_0` and after (FORMAT.md
/// §12); a file that uses none of them keeps its older minor version.
pub const K_QUANT_SINCE_MINOR: u16 = 7;

/// Why a row cannot be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuantError {
    /// An on-disk type value that names no encoding.
    UnknownType(u32),
    /// A type name that names no encoding.
    UnknownName(String),
    /// A block type's row length must be a whole number of blocks: the format pads nothing.
    Length { qtype: QuantType, n: usize },
    /// A row so long its encoded size does not fit in memory's address space (damaged input).
    TooLong { qtype: QuantType, n: usize },
    /// The encoded bytes do not hold the expected number of values.
    ByteLength {
        qtype: QuantType,
        n: usize,
        bytes: usize,
    },
    /// NaN or infinity in the input.
    NotFinite { index: usize },
    /// A value (or a block's scale) beyond what the encoding's f16 fields can hold.
    OutOfRange { index: usize },
}

impl fmt::Display for QuantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QuantError::UnknownType(v) => write!(f, "unknown quantization type value {v}"),
            QuantError::UnknownName(s) => write!(
                f,
                "unknown quantization {s:?}: expected f32, f16, bf16, q8 (q8_0), q4 (q4_0), q4_1, q5_0, \
                 q5_1, q4_k, q5_k or q6_k"
            ),
            QuantError::Length { qtype, n } => write!(
                f,
                "{qtype} needs rows of a multiple of {} values, got {n}",
                qtype.block_len()
            ),
            QuantError::TooLong { qtype, n } => {
                write!(f, "a row of {n} values of {qtype} is impossibly large")
            }
            QuantError::ByteLength { qtype, n, bytes } => {
                write!(f, "{bytes} bytes do not hold {n} values of {qtype}")
            }
            QuantError::NotFinite { index } => write!(f, "value {index} is not finite"),
            QuantError::OutOfRange { index } => {
                write!(
                    f,
                    "value {index} is too large for the encoding's f16 fields"
                )
            }
        }
    }
}

impl std::error::Error for QuantError {}

impl QuantType {
    pub const ALL: [QuantType; 11] = [
        QuantType::F32,
        QuantType::F16,
        QuantType::BF16,
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q4_K,
        QuantType::Q5_K,
        QuantType::Q6_K,
    ];

    /// The format minor version a file needs to hold this encoding.
    pub fn since_minor(self) -> u16 {
        if (self as u32) >= QuantType::Q5_0 as u32 {
            K_QUANT_SINCE_MINOR
        } else {
            1
        }
    }

    /// The K-quant types, whose blocks are [`K_BLOCK_LEN`] values.
    pub fn is_k_quant(self) -> bool {
        matches!(self, QuantType::Q4_K | QuantType::Q5_K | QuantType::Q6_K)
    }

    /// The type stored on disk as `value`.
    pub fn from_u32(value: u32) -> Result<Self, QuantError> {
        Self::ALL
            .into_iter()
            .find(|t| *t as u32 == value)
            .ok_or(QuantError::UnknownType(value))
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantType::F32 => "f32",
            QuantType::F16 => "f16",
            QuantType::BF16 => "bf16",
            QuantType::Q8_0 => "q8_0",
            QuantType::Q4_0 => "q4_0",
            QuantType::Q4_1 => "q4_1",
            QuantType::Q5_0 => "q5_0",
            QuantType::Q5_1 => "q5_1",
            QuantType::Q4_K => "q4_k",
            QuantType::Q5_K => "q5_k",
            QuantType::Q6_K => "q6_k",
        }
    }

    /// Values per unit: 1 for the float types, [`BLOCK_LEN`] for the block types, [`K_BLOCK_LEN`]
    /// for the K-quants.
    pub fn block_len(self) -> usize {
        if self.is_k_quant() {
            K_BLOCK_LEN
        } else if self.is_block() {
            BLOCK_LEN
        } else {
            1
        }
    }

    /// Bytes per unit.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::F32 => 4,
            QuantType::F16 | QuantType::BF16 => 2,
            QuantType::Q8_0 => 2 + BLOCK_LEN,
            QuantType::Q4_0 => 2 + BLOCK_LEN / 2,
            QuantType::Q4_1 => 4 + BLOCK_LEN / 2,
            QuantType::Q5_0 => 2 + 4 + BLOCK_LEN / 2,
            QuantType::Q5_1 => 4 + 4 + BLOCK_LEN / 2,
            QuantType::Q4_K => 4 + 12 + K_BLOCK_LEN / 2,
            QuantType::Q5_K => 4 + 12 + K_BLOCK_LEN / 8 + K_BLOCK_LEN / 2,
            QuantType::Q6_K => K_BLOCK_LEN / 2 + K_BLOCK_LEN / 4 + K_BLOCK_LEN / 16 + 2,
        }
    }

    /// Every type but the float ones: blocks of values with shared scales, whose dot products the
    /// kernels take against the input quantized to q8.
    pub fn is_block(self) -> bool {
        !matches!(self, QuantType::F32 | QuantType::F16 | QuantType::BF16)
    }

    /// The `ggml_type` value GGUF files use for this encoding.
    pub fn ggml_type(self) -> u32 {
        match self {
            QuantType::F32 => 0,
            QuantType::F16 => 1,
            QuantType::Q4_0 => 2,
            QuantType::Q4_1 => 3,
            QuantType::Q8_0 => 8,
            QuantType::Q5_0 => 6,
            QuantType::Q5_1 => 7,
            QuantType::Q4_K => 12,
            QuantType::Q5_K => 13,
            QuantType::Q6_K => 14,
            QuantType::BF16 => 30,
        }
    }

    /// The encoding of a GGUF tensor of `ggml_type` value `id`, if it is one of ours.
    pub fn from_ggml_type(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.ggml_type() == id)
    }
}

impl fmt::Display for QuantType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses a type name; `q8` and `q4` are the short names of `q8_0` and `q4_0`.
impl FromStr for QuantType {
    type Err = QuantError;

    fn from_str(s: &str) -> Result<Self, QuantError> {
        let lower = s.to_ascii_lowercase();
        let name = match lower.as_str() {
            "q8" => "q8_0",
            "q4" => "q4_0",
            other => other,
        };
        Self::ALL
            .into_iter()
            .find(|t| t.name() == name)
            .ok_or_else(|| QuantError::UnknownName(s.to_string()))
    }
}

/// Bytes of a row of `n` values.
pub fn row_bytes(qtype: QuantType, n: usize) -> Result<usize, QuantError> {
    if !n.is_multiple_of(qtype.block_len()) {
        return Err(QuantError::Length { qtype, n });
    }
    (n / qtype.block_len())
        .checked_mul(qtype.block_bytes())
        .ok_or(QuantError::TooLong { qtype, n })
}

/// Encodes a row. Fails on a length that is not a whole number of blocks, on NaN or infinity, and
/// on values whose scale or f16 value would overflow.
pub fn quantize_row(qtype: QuantType, x: &[f32]) -> Result<Vec<u8>, QuantError> {
    let mut out = Vec::with_capacity(row_bytes(qtype, x.len())?);
    if let Some(index) = x.iter().position(|v| !v.is_finite()) {
        return Err(QuantError::NotFinite { index });
    }
    match qtype {
        QuantType::F32 => x.iter().for_each(|v| out.extend(v.to_le_bytes())),
        QuantType::F16 => {
            for (index, v) in x.iter().enumerate() {
                let h = f16::from_f32(*v);
                if h.is_infinite() {
                    return Err(QuantError::OutOfRange { index });
                }
                out.extend(h.to_le_bytes());
            }
        }
        QuantType::BF16 => x
            .iter()
            .for_each(|v| out.extend(bf16::from_f32(*v).to_le_bytes())),
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1 => {
            for (b, block) in x.chunks_exact(BLOCK_LEN).enumerate() {
                let encoded = match qtype {
                    QuantType::Q8_0 => quantize_q8_0(block),
                    QuantType::Q4_0 => quantize_q4_0(block),
                    _ => quantize_q4_1(block),
                };
                out.extend(encoded.ok_or(QuantError::OutOfRange {
                    index: b * BLOCK_LEN,
                })?);
            }
        }
        _ => {
            let len = qtype.block_len();
            for (b, block) in x.chunks_exact(len).enumerate() {
                out.extend(
                    quant_k::quantize_block(qtype, block)
                        .ok_or(QuantError::OutOfRange { index: b * len })?,
                );
            }
        }
    }
    Ok(out)
}

/// Decodes a row of `out.len()` values from `bytes`.
pub fn dequantize_row(qtype: QuantType, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    check_bytes(qtype, bytes, out.len())?;
    let units = bytes.chunks_exact(qtype.block_bytes());
    match qtype {
        QuantType::F32 => units
            .zip(out.iter_mut())
            .for_each(|(u, o)| *o = f32::from_le_bytes([u[0], u[1], u[2], u[3]])),
        QuantType::F16 => units
            .zip(out.iter_mut())
            .for_each(|(u, o)| *o = f16::from_le_bytes([u[0], u[1]]).to_f32()),
        QuantType::BF16 => units
            .zip(out.iter_mut())
            .for_each(|(u, o)| *o = bf16::from_le_bytes([u[0], u[1]]).to_f32()),
        QuantType::Q8_0 => {
            for (u, o) in units.zip(out.chunks_exact_mut(BLOCK_LEN)) {
                let d = f16_at(u, 0);
                for (v, q) in o.iter_mut().zip(&u[2..]) {
                    *v = d * (*q as i8) as f32;
                }
            }
        }
        QuantType::Q4_0 | QuantType::Q4_1 => {
            let has_min = qtype == QuantType::Q4_1;
            for (u, o) in units.zip(out.chunks_exact_mut(BLOCK_LEN)) {
                let d = f16_at(u, 0);
                let (m, offset, nibbles) = if has_min {
                    (f16_at(u, 2), 0, &u[4..])
                } else {
                    (0.0, 8, &u[2..])
                };
                let half = BLOCK_LEN / 2;
                for (j, byte) in nibbles.iter().enumerate() {
                    o[j] = d * ((byte & 0x0f) as i32 - offset) as f32 + m;
                    o[j + half] = d * ((byte >> 4) as i32 - offset) as f32 + m;
                }
            }
        }
        _ => {
            for (u, o) in units.zip(out.chunks_exact_mut(qtype.block_len())) {
                quant_k::dequantize_block(qtype, u, o);
            }
        }
    }
    Ok(())
}

/// Worst-case `|x − x̂|` of each unit of an encoded row (one bound per block for the block types,
/// one per value for the float types), for rows written by [`quantize_row`]:
/// - `F32`: 0; `F16`: `max(|x̂|·2⁻¹¹, 2⁻²⁵)`; `BF16`: `max(|x̂|·2⁻⁸, 2⁻¹³⁴)` (half an ulp);
/// - `Q8_0` and `Q4_1`: `|d|/2` (round to nearest, no code clipped);
/// - `Q4_0`: `|d|`: the block's extreme maps to −8, so values of the other sign near the extreme
///   clip at +7 (the ggml convention, which buys one more level than a symmetric scale).
///
/// Other quantizers (llama.cpp's) round the scale to nearest, so their blocks can exceed these
/// bounds by a few percent.
pub fn max_abs_error(qtype: QuantType, bytes: &[u8], bounds: &mut [f32]) -> Result<(), QuantError> {
    check_bytes(qtype, bytes, bounds.len() * qtype.block_len())?;
    let units = bytes
        .chunks_exact(qtype.block_bytes())
        .zip(bounds.iter_mut());
    match qtype {
        QuantType::F32 => bounds.fill(0.0),
        QuantType::F16 => units.for_each(|(u, b)| {
            *b = (f16::from_le_bytes([u[0], u[1]]).to_f32().abs() * 2f32.powi(-11))
                .max(2f32.powi(-25))
        }),
        QuantType::BF16 => units.for_each(|(u, b)| {
            *b = (bf16::from_le_bytes([u[0], u[1]]).to_f32().abs() * 2f32.powi(-8))
                .max(2f32.powi(-134))
        }),
        QuantType::Q8_0 | QuantType::Q4_1 => units.for_each(|(u, b)| *b = f16_at(u, 0).abs() / 2.0),
        QuantType::Q4_0 => units.for_each(|(u, b)| *b = f16_at(u, 0).abs()),
        _ => units.for_each(|(u, b)| *b = quant_k::block_bound(qtype, u)),
    }
    Ok(())
}

fn check_bytes(qtype: QuantType, bytes: &[u8], n: usize) -> Result<(), QuantError> {
    if row_bytes(qtype, n)? != bytes.len() {
        return Err(QuantError::ByteLength {
            qtype,
            n,
            bytes: bytes.len(),
        });
    }
    Ok(())
}

pub(crate) fn f16_at(unit: &[u8], offset: usize) -> f32 {
    f16::from_le_bytes([unit[offset], unit[offset + 1]]).to_f32()
}

/// The f16 nearest to `v` on the side `up` (≥ v) or down (≤ v); `None` if that overflows.
pub(crate) fn f16_rounded(v: f64, up: bool) -> Option<f16> {
    let mut h = f16::from_f64(v);
    let wrong_side = |h: f16| if up { h.to_f64() < v } else { h.to_f64() > v };
    if wrong_side(h) {
        // One step along the number line; f16 bit patterns are sign-magnitude.
        let towards_larger_magnitude = (h.to_f64() >= 0.0) == up;
        let bits = h.to_bits();
        h = if h.to_f64() == 0.0 {
            f16::from_bits(if up { 0x0001 } else { 0x8001 })
        } else if towards_larger_magnitude {
            f16::from_bits(bits + 1)
        } else {
            f16::from_bits(bits - 1)
        };
    }
    (!h.is_infinite()).then_some(h)
}

pub(crate) fn max_by_magnitude(block: &[f32]) -> f32 {
    block
        .iter()
        .copied()
        .fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m })
}

/// `d = amax/127` rounded up, `q = round(x/d)` ∈ [−127, 127].
fn quantize_q8_0(block: &[f32]) -> Option<Vec<u8>> {
    let amax = max_by_magnitude(block).abs() as f64;
    let d = f16_rounded(amax / 127.0, true)?;
    let df = d.to_f64();
    let mut out = d.to_le_bytes().to_vec();
    for v in block {
        let q = if df == 0.0 {
            0.0
        } else {
            (*v as f64 / df).round()
        };
        out.push(q.clamp(-127.0, 127.0) as i8 as u8);
    }
    Some(out)
}

/// `d = max/−half` (max: the value of largest magnitude, with its sign) with `|d|` rounded up, so
/// the extreme is `q = 0`; `q = round(x/d) + half` clipped to [0, 2·half − 1]. Q4_0 (`half` 8) and
/// Q5_0 (16) scale their blocks so. `None` if `d` overflows f16.
pub(crate) fn symmetric_codes(block: &[f32], half: f64) -> Option<(f16, Vec<u8>)> {
    let max = max_by_magnitude(block) as f64;
    let magnitude = f16_rounded(max.abs() / half, true)?.to_f64();
    let d = f16::from_f64(if max > 0.0 { -magnitude } else { magnitude });
    let df = d.to_f64();
    let codes = block
        .iter()
        .map(|v| {
            let q = if df == 0.0 {
                0.0
            } else {
                (*v as f64 / df).round()
            };
            (q + half).clamp(0.0, 2.0 * half - 1.0) as u8
        })
        .collect();
    Some((d, codes))
}

/// `m = min` rounded down, `d = (max − m)/levels` rounded up, `q = round((x − m)/d)` ∈
/// [0, levels]: `(d, m, codes)`. Q4_1 (`levels` 15) and Q5_1 (31) scale their blocks so. `None`
/// if `d` or `m` overflows f16.
pub(crate) fn offset_codes(block: &[f32], levels: f64) -> Option<(f16, f16, Vec<u8>)> {
    let min = block.iter().copied().fold(f32::INFINITY, f32::min) as f64;
    let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let m = f16_rounded(min, false)?;
    let mf = m.to_f64();
    let d = f16_rounded((max - mf) / levels, true)?;
    let df = d.to_f64();
    let codes = block
        .iter()
        .map(|v| {
            let q = if df == 0.0 {
                0.0
            } else {
                ((*v as f64 - mf) / df).round()
            };
            q.clamp(0.0, levels) as u8
        })
        .collect();
    Some((d, m, codes))
}

fn quantize_q4_0(block: &[f32]) -> Option<Vec<u8>> {
    let (d, codes) = symmetric_codes(block, 8.0)?;
    let mut out = d.to_le_bytes().to_vec();
    out.extend(pack_nibbles(&codes));
    Some(out)
}

fn quantize_q4_1(block: &[f32]) -> Option<Vec<u8>> {
    let (d, m, codes) = offset_codes(block, 15.0)?;
    let mut out = d.to_le_bytes().to_vec();
    out.extend(m.to_le_bytes());
    out.extend(pack_nibbles(&codes));
    Some(out)
}

/// Element `j` in the low nibble of byte `j`, element `j + 16` in its high nibble.
fn pack_nibbles(codes: &[u8]) -> Vec<u8> {
    let half = BLOCK_LEN / 2;
    (0..half)
        .map(|j| codes[j] | (codes[j + half] << 4))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by fuzzing the file reader: a damaged tensor shape asked for a row of nearly 2^64
    /// values, and the size computation overflowed (a panic in checked builds).
    #[test]
    fn an_impossibly_long_row_is_an_error_not_an_overflow() {
        for qtype in QuantType::ALL {
            let n = usize::MAX / qtype.block_len() * qtype.block_len();
            // Types of more than a byte per value cannot encode so many; 4-bit ones can.
            match row_bytes(qtype, n) {
                Err(QuantError::TooLong { .. }) if qtype.block_bytes() > qtype.block_len() => {}
                Ok(bytes) if qtype.block_bytes() < qtype.block_len() => assert!(bytes < n),
                other => panic!("{qtype}: {other:?}"),
            }
        }
        assert_eq!(row_bytes(QuantType::Q8_0, 64).unwrap(), 68);
    }

    /// A small deterministic generator (this crate has no dependencies): xorshift64*.
    struct Rng(u64);

    impl Rng {
        fn next_f32(&mut self) -> f32 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let bits = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
            bits as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    fn seed() -> u64 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos() as u64;
        (nanos << 1) | 1
    }

    /// Rows that exercise the corners: random at several scales, constant, zero, one outlier,
    /// subnormal-scale blocks, all positive and all negative.
    fn test_rows(rng: &mut Rng) -> Vec<Vec<f32>> {
        let n = 2 * K_BLOCK_LEN;
        let mut rows = Vec::new();
        for scale in [1.0f32, 1e-3, 1e-6, 300.0] {
            rows.push((0..n).map(|_| rng.next_f32() * scale).collect());
            rows.push(
                (0..n)
                    .map(|_| rng.next_f32().abs() * scale + scale)
                    .collect(),
            );
            rows.push((0..n).map(|_| -rng.next_f32().abs() * scale).collect());
        }
        rows.push(vec![0.0; n]);
        rows.push(vec![0.7; n]);
        rows.push(vec![-1e-7; n]);
        let mut outlier: Vec<f32> = (0..n).map(|_| rng.next_f32() * 0.01).collect();
        outlier[5] = 40.0;
        outlier[40] = -40.0;
        rows.push(outlier);
        rows
    }

    #[test]
    fn round_trip_stays_within_the_bound() {
        let seed = seed();
        let mut rng = Rng(seed);
        for row in test_rows(&mut rng) {
            for qtype in QuantType::ALL {
                let bytes = quantize_row(qtype, &row).unwrap();
                assert_eq!(bytes.len(), row_bytes(qtype, row.len()).unwrap());
                let mut back = vec![0.0; row.len()];
                dequantize_row(qtype, &bytes, &mut back).unwrap();
                let mut bounds = vec![0.0; row.len() / qtype.block_len()];
                max_abs_error(qtype, &bytes, &mut bounds).unwrap();
                for (i, (x, y)) in row.iter().zip(&back).enumerate() {
                    let bound = bounds[i / qtype.block_len()] as f64;
                    let err = (*x as f64 - *y as f64).abs();
                    // Q4_1 adds `m` in f32: allow that one rounding.
                    let slack = (*y as f64).abs() * 2f64.powi(-24);
                    assert!(
                        err <= bound + slack,
                        "seed {seed}: {qtype} element {i}: {x} -> {y}, error {err} > bound {bound}"
                    );
                }
            }
        }
    }

    #[test]
    fn bounds_are_not_loose() {
        // On random data the worst error of a block type comes close to its bound.
        let seed = seed();
        let mut rng = Rng(seed);
        let row: Vec<f32> = (0..64 * BLOCK_LEN).map(|_| rng.next_f32()).collect();
        for qtype in [
            QuantType::Q8_0,
            QuantType::Q4_1,
            QuantType::Q5_1,
            QuantType::Q4_K,
            QuantType::Q5_K,
            QuantType::Q6_K,
        ] {
            let bytes = quantize_row(qtype, &row).unwrap();
            let mut back = vec![0.0; row.len()];
            dequantize_row(qtype, &bytes, &mut back).unwrap();
            let mut bounds = vec![0.0; row.len() / qtype.block_len()];
            max_abs_error(qtype, &bytes, &mut bounds).unwrap();
            let worst = row
                .iter()
                .zip(&back)
                .enumerate()
                .map(|(i, (x, y))| (x - y).abs() / bounds[i / qtype.block_len()])
                .fold(0.0f32, f32::max);
            assert!(
                worst > 0.9,
                "seed {seed}: {qtype} worst error/bound {worst}"
            );
        }
    }

    #[test]
    fn q8_0_known_bytes() {
        // d = 0.25 is exact in f16 (0x3400), so llama.cpp writes the same bytes.
        let codes: Vec<i8> = (0..32)
            .map(|i| if i == 0 { -127 } else { i * 4 - 1 })
            .collect();
        let x: Vec<f32> = codes.iter().map(|q| 0.25 * *q as f32).collect();
        let mut want = vec![0x00, 0x34];
        want.extend(codes.iter().map(|q| *q as u8));
        assert_eq!(quantize_row(QuantType::Q8_0, &x).unwrap(), want);
    }

    #[test]
    fn q4_0_known_bytes() {
        // The extreme −4 sets d = −4/−8 = 0.5 (0x3800) and code 0; x = 0.5·(q − 8).
        let codes: Vec<u8> = (0..32).map(|i| ((i * 7 + i / 16 * 5) % 16) as u8).collect();
        let x: Vec<f32> = codes.iter().map(|q| 0.5 * (*q as f32 - 8.0)).collect();
        let mut want = vec![0x00, 0x38];
        want.extend((0..16).map(|j| codes[j] | (codes[j + 16] << 4)));
        assert_eq!(quantize_row(QuantType::Q4_0, &x).unwrap(), want);
        assert_eq!(
            want[2], 0x50,
            "element 0 low nibble, element 16 high nibble"
        );
    }

    #[test]
    fn q4_1_known_bytes() {
        // min −1 (0xBC00), max 14 → d = 1 (0x3C00); x = q − 1.
        let codes: Vec<u8> = (0..32).map(|i| (i * 5 % 16) as u8).collect();
        let x: Vec<f32> = codes.iter().map(|q| *q as f32 - 1.0).collect();
        let mut want = vec![0x00, 0x3c, 0x00, 0xbc];
        want.extend((0..16).map(|j| codes[j] | (codes[j + 16] << 4)));
        assert_eq!(quantize_row(QuantType::Q4_1, &x).unwrap(), want);
    }

    #[test]
    fn float_known_bytes() {
        let x = [1.0f32, -2.5];
        assert_eq!(
            quantize_row(QuantType::F32, &x).unwrap(),
            [0, 0, 0x80, 0x3f, 0, 0, 0x20, 0xc0]
        );
        assert_eq!(
            quantize_row(QuantType::F16, &x).unwrap(),
            [0x00, 0x3c, 0x00, 0xc1]
        );
        assert_eq!(
            quantize_row(QuantType::BF16, &x).unwrap(),
            [0x80, 0x3f, 0x20, 0xc0]
        );
    }

    #[test]
    fn errors_name_the_problem() {
        assert_eq!(
            row_bytes(QuantType::Q4_0, 33),
            Err(QuantError::Length {
                qtype: QuantType::Q4_0,
                n: 33
            })
        );
        assert_eq!(row_bytes(QuantType::F16, 33), Ok(66));
        assert_eq!(row_bytes(QuantType::Q4_1, 64), Ok(40));
        assert!(quantize_row(QuantType::Q8_0, &[1.0; 31]).is_err());
        let mut x = vec![0.0f32; 32];
        x[3] = f32::NAN;
        assert_eq!(
            quantize_row(QuantType::Q8_0, &x),
            Err(QuantError::NotFinite { index: 3 })
        );
        assert_eq!(
            quantize_row(QuantType::F16, &[1e6]),
            Err(QuantError::OutOfRange { index: 0 })
        );
        assert!(quantize_row(QuantType::Q8_0, &[1e8; 32]).is_err());
        let mut out = [0.0; 32];
        assert!(dequantize_row(QuantType::Q8_0, &[0; 33], &mut out).is_err());
        assert_eq!(QuantType::from_u32(11), Err(QuantError::UnknownType(11)));
        assert!(QuantError::UnknownName("q3".into())
            .to_string()
            .contains("q8"));
    }

    #[test]
    fn new_encodings_need_minor_7_and_old_ones_do_not() {
        for t in QuantType::ALL {
            let new = t as u32 >= 6;
            assert_eq!(t.since_minor(), if new { 7 } else { 1 }, "{t}");
        }
        let k = QuantType::Q4_K;
        assert_eq!((k.block_len(), k.block_bytes()), (256, 144));
        assert_eq!(row_bytes(QuantType::Q5_K, 512), Ok(352));
        assert_eq!(row_bytes(QuantType::Q6_K, 256), Ok(210));
        assert_eq!(row_bytes(QuantType::Q5_0, 64), Ok(44));
        assert_eq!(row_bytes(QuantType::Q5_1, 32), Ok(24));
        assert!(row_bytes(QuantType::Q4_K, 288).is_err());
    }

    /// Each code of a K-quant or 5-bit block lands where ggml reads it: a block whose codes are
    /// set one at a time decodes to exactly that element.
    #[test]
    fn k_quant_codes_are_where_ggml_reads_them() {
        for qtype in [
            QuantType::Q5_0,
            QuantType::Q5_1,
            QuantType::Q4_K,
            QuantType::Q5_K,
            QuantType::Q6_K,
        ] {
            let n = qtype.block_len();
            for e in [0, 1, 15, 16, 17, 31, n / 2 + 3, n - 1] {
                // A block with one large element: all others decode to (near) zero, and that one
                // to its value; a misplaced code would move it.
                let mut x = vec![0.0f32; n];
                x[e] = 5.0;
                let bytes = quantize_row(qtype, &x).unwrap();
                let mut back = vec![0.0; n];
                dequantize_row(qtype, &bytes, &mut back).unwrap();
                let mut bound = [0.0];
                max_abs_error(qtype, &bytes, &mut bound).unwrap();
                for (i, y) in back.iter().enumerate() {
                    let want = if i == e { 5.0 } else { 0.0 };
                    assert!(
                        (y - want).abs() <= bound[0] + 1e-6,
                        "{qtype}: element {i} of a block with {e} set decodes to {y}"
                    );
                }
                assert!(back[e] > 4.0, "{qtype}: element {e} decodes to {}", back[e]);
            }
        }
    }

    /// A hand-built `Q4_K` block (ggml's layout): d = 1, dmin = 0.5, sub-block 5 with sc = 37
    /// (split between the high bits of s[1] and the low nibble of s[9]) and m = 21.
    #[test]
    fn q4_k_known_bytes() {
        let mut u = vec![0u8; 144];
        u[0..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        u[2..4].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        // sc_5 = (s[9] & 15) | (s[1] >> 6) << 4 = 5 | 2 << 4 = 37;
        // m_5 = (s[9] >> 4) | (s[5] >> 6) << 4 = 5 | 1 << 4 = 21.
        u[4 + 1] = 2 << 6;
        u[4 + 5] = 1 << 6;
        u[4 + 9] = 0x55;
        // Sub-block 5: high nibbles of b[64..96]; element 3 of it has code 7.
        u[16 + 64 + 3] = 7 << 4;
        let mut out = vec![0.0; 256];
        dequantize_row(QuantType::Q4_K, &u, &mut out).unwrap();
        assert_eq!(out[5 * 32 + 3], 37.0 * 7.0 - 0.5 * 21.0);
        assert_eq!(out[5 * 32 + 4], -10.5);
        assert_eq!(out[0], 0.0);
    }

    #[test]
    fn names_values_and_ggml_ids() {
        for (i, t) in QuantType::ALL.into_iter().enumerate() {
            assert_eq!(t as u32, i as u32);
            assert_eq!(QuantType::from_u32(i as u32), Ok(t));
            assert_eq!(t.name().parse::<QuantType>(), Ok(t));
            assert_eq!(QuantType::from_ggml_type(t.ggml_type()), Some(t));
        }
        assert_eq!("q8".parse(), Ok(QuantType::Q8_0));
        assert_eq!("Q4".parse(), Ok(QuantType::Q4_0));
        assert_eq!(QuantType::from_ggml_type(8), Some(QuantType::Q8_0));
    }
}
