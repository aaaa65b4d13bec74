//! Encoding and decoding of rows in every [`DType`].
//!
//! Decoding reproduces GGML's reference dequantization bit for bit (`q * d + m` as separate f32
//! multiply and add), so a quantized model gives the f32 weights every reference implementation sees.

use crate::DType;
use half::{bf16, f16};

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Decodes one block of a quantized type into 32 floats.
#[inline(always)]
pub fn dequantize_block(dtype: DType, block: &[u8], out: &mut [f32; 32]) {
    match dtype {
        DType::Q8_0 => {
            let d = f16_at(block, 0);
            for (o, &q) in out.iter_mut().zip(&block[2..34]) {
                *o = (q as i8) as f32 * d;
            }
        }
        DType::Q4_0 => {
            let d = f16_at(block, 0);
            let qs = &block[2..18];
            for j in 0..16 {
                out[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
                out[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        DType::Q4_1 => {
            let d = f16_at(block, 0);
            let m = f16_at(block, 2);
            let qs = &block[4..20];
            for j in 0..16 {
                out[j] = (qs[j] & 0x0f) as f32 * d + m;
                out[j + 16] = (qs[j] >> 4) as f32 * d + m;
            }
        }
        DType::F32 | DType::F16 | DType::BF16 => unreachable!("{dtype} is not a block format"),
    }
}

/// Decodes a row stored as `dtype` into `out`; `bytes` must hold exactly `out.len()` elements.
pub fn dequantize_row(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    debug_assert_eq!(dtype.row_bytes(out.len()), Some(bytes.len()));
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => {
            let mut tmp = [0f32; 32];
            for (o, block) in out
                .chunks_exact_mut(32)
                .zip(bytes.chunks_exact(dtype.block_bytes()))
            {
                dequantize_block(dtype, block, &mut tmp);
                o.copy_from_slice(&tmp);
            }
        }
    }
}

/// Encodes `values` as `dtype` the way GGML's reference quantizers do (round to nearest).
///
/// Used to write test models and converted files; `values.len()` must be a whole number of blocks.
pub fn quantize_row(dtype: DType, values: &[f32]) -> Vec<u8> {
    assert!(
        dtype.row_bytes(values.len()).is_some(),
        "row of {} is not a whole number of {dtype} blocks",
        values.len()
    );
    let mut out = Vec::with_capacity(dtype.row_bytes(values.len()).unwrap_or(0));
    match dtype {
        DType::F32 => values.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DType::F16 => values
            .iter()
            .for_each(|v| out.extend(f16::from_f32(*v).to_le_bytes())),
        DType::BF16 => values
            .iter()
            .for_each(|v| out.extend(bf16::from_f32(*v).to_le_bytes())),
        DType::Q8_0 => {
            for block in values.chunks_exact(32) {
                let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        DType::Q4_0 => {
            for block in values.chunks_exact(32) {
                // The value of largest magnitude maps to -8, as in GGML.
                let max = block
                    .iter()
                    .copied()
                    .fold(0f32, |a, v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                for j in 0..16 {
                    out.push(q(block[j]) | (q(block[j + 16]) << 4));
                }
            }
        }
        DType::Q4_1 => {
            for block in values.chunks_exact(32) {
                let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                for j in 0..16 {
                    out.push(q(block[j]) | (q(block[j + 16]) << 4));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn quantization_error_is_bounded(values in prop::collection::vec(-4.0f32..4.0, 64)) {
            for dtype in DType::ALL {
                let bytes = quantize_row(dtype, &values);
                prop_assert_eq!(bytes.len(), dtype.row_bytes(64).unwrap());
                let mut back = vec![0f32; 64];
                dequantize_row(dtype, &bytes, &mut back);
                for block in 0..2 {
                    let vals = &values[block * 32..block * 32 + 32];
                    let range = vals.iter().fold(0f32, |a, v| a.max(v.abs())) * 2.0;
                    // Half a quantization step (plus the f16 rounding of the scale).
                    let tol = match dtype {
                        DType::F32 => 0.0,
                        DType::F16 | DType::BF16 => range * 4e-3,
                        DType::Q8_0 => range / 254.0 * 0.51 + range * 1e-3,
                        DType::Q4_1 => range / 15.0 * 0.51 + range * 2e-3,
                        // Asymmetric: +amax is clamped to 7/8 of it, an error of one step.
                        DType::Q4_0 => range / 16.0 * 1.01 + range * 2e-3,
                    };
                    for (a, b) in vals.iter().zip(&back[block * 32..block * 32 + 32]) {
                        prop_assert!((a - b).abs() <= tol + 1e-6, "{dtype}: {a} vs {b} (tol {tol})");
                    }
                }
            }
        }
    }

    #[test]
    fn q4_1_decodes_like_ggml() {
        // d = 0.5, m = -1.0, nibbles 0..15 then 15..0.
        let mut block = Vec::new();
        block.extend(f16::from_f32(0.5).to_le_bytes());
        block.extend(f16::from_f32(-1.0).to_le_bytes());
        for j in 0..16u8 {
            block.push(j | ((15 - j) << 4));
        }
        let mut out = [0f32; 32];
        dequantize_block(DType::Q4_1, &block, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], j as f32 * 0.5 - 1.0);
            assert_eq!(out[j + 16], (15 - j) as f32 * 0.5 - 1.0);
        }
    }
}
