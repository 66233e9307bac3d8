//! Scaling an encoded row by a power of two without decoding it: every unit's scale fields (the
//! f16 `d`, and the offset `m` or `dmin` where the type has one) are multiplied by `2^k`, the codes
//! stay. Every decoded value is then exactly `2^k` times what it was (FORMAT.md §10: the decoders
//! multiply and subtract in binary32, where a power of two factors out of every rounding), so a
//! converter can rescale a neuron's up row, as the `gate_up` rule asks, and keep its stored
//! quantization.

use half::{bf16, f16};

use crate::quant::{row_bytes, QuantError, QuantType};

/// Byte offsets of the f16 scale fields within one unit of `qtype` (none for the float types,
/// whose every value is scaled).
fn scale_fields(qtype: QuantType) -> &'static [usize] {
    match qtype {
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q5_0 => &[0],
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
        // `ql[128] qh[64] sc[16]`, then `d`.
        QuantType::Q6_K => &[208],
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => &[],
    }
}

/// `row` (`n` values of `qtype`) with every value multiplied by `2^k`, in place; `None` (and the
/// row unchanged) where a field would leave its type's normal range, so that the product is not
/// exact: then the caller encodes the scaled values afresh.
pub fn scale_row_pow2(qtype: QuantType, row: &mut [u8], n: usize, k: i32) -> Option<()> {
    if row_bytes(qtype, n) != Ok(row.len()) || !(-60..=60).contains(&k) {
        return None;
    }
    let factor = 2f32.powi(k);
    let unit = qtype.block_bytes();
    let mut out = row.to_vec();
    match qtype {
        QuantType::F32 => {
            for v in out.chunks_exact_mut(4) {
                let x = f32::from_le_bytes(v.try_into().expect("4 bytes"));
                let y = x * factor;
                (y.is_finite() && (x == 0.0 || y.is_normal()) && y / factor == x).then_some(())?;
                v.copy_from_slice(&y.to_le_bytes());
            }
        }
        QuantType::BF16 => {
            for v in out.chunks_exact_mut(2) {
                let x = bf16::from_le_bytes([v[0], v[1]]).to_f32();
                let y = bf16::from_f32(x * factor);
                (y.to_f32() == x * factor && (x == 0.0 || y.is_normal())).then_some(())?;
                v.copy_from_slice(&y.to_le_bytes());
            }
        }
        _ => {
            let fields: &[usize] = if qtype == QuantType::F16 {
                &[0]
            } else {
                scale_fields(qtype)
            };
            let step = if qtype == QuantType::F16 { 2 } else { unit };
            for u in out.chunks_exact_mut(step) {
                for &at in fields {
                    let x = f16::from_le_bytes([u[at], u[at + 1]]).to_f32();
                    let y = f16::from_f32(x * factor);
                    // f16 subnormals are normal in the decoder's binary32: only exactness counts.
                    (y.to_f32() == x * factor).then_some(())?;
                    u[at..at + 2].copy_from_slice(&y.to_le_bytes());
                }
            }
        }
    }
    row.copy_from_slice(&out);
    Some(())
}

/// The power of two nearest `v` (> 0) in log scale: `2^round(log2 v)`, as its exponent.
pub fn nearest_pow2_exponent(v: f32) -> Result<i32, QuantError> {
    if !(v.is_finite() && v > 0.0) {
        return Err(QuantError::NotFinite { index: 0 });
    }
    Ok(v.log2().round() as i32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_row, quantize_row};

    #[test]
    fn every_value_scales_exactly() {
        let n = 512;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * if i % 64 < 8 { 3.0 } else { 0.1 })
            .collect();
        for q in QuantType::ALL {
            let row = quantize_row(q, &x).unwrap();
            let mut before = vec![0.0; n];
            dequantize_row(q, &row, &mut before).unwrap();
            // A float row's smallest values would leave f16's normal range scaled down.
            let ks: &[i32] = if q.is_block() {
                &[-3, -1, 1, 2, 5]
            } else {
                &[1, 2, 5]
            };
            for &k in ks {
                let mut scaled = row.clone();
                scale_row_pow2(q, &mut scaled, n, k).unwrap_or_else(|| panic!("{q} by 2^{k}"));
                let mut after = vec![0.0; n];
                dequantize_row(q, &scaled, &mut after).unwrap();
                let factor = 2f32.powi(k);
                for (i, (a, b)) in after.iter().zip(&before).enumerate() {
                    assert_eq!(a.to_bits(), (b * factor).to_bits(), "{q} 2^{k} value {i}");
                }
                if q.is_block() {
                    // Only the scale fields change: most of the row's bytes are its codes.
                    let same = scaled.iter().zip(&row).filter(|(a, b)| a == b).count();
                    assert!(same * 10 > row.len() * 8, "{q}: {same} of {}", row.len());
                }
            }
        }
    }

    #[test]
    fn a_scale_out_of_range_is_refused() {
        let row = quantize_row(QuantType::Q8_0, &[1000.0; 32]).unwrap();
        let mut r = row.clone();
        // d = 1000/127 and 2^14·d > 65504, the largest f16.
        assert_eq!(scale_row_pow2(QuantType::Q8_0, &mut r, 32, 14), None);
        assert_eq!(r, row, "left as it was");
        assert_eq!(scale_row_pow2(QuantType::Q8_0, &mut r, 64, 1), None);
        assert_eq!(nearest_pow2_exponent(3.0), Ok(2));
        assert_eq!(nearest_pow2_exponent(0.7), Ok(-1));
        assert!(nearest_pow2_exponent(0.0).is_err());
    }
}
