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
        DType::Q5_0 | DType::Q5_1 => {
            let d = f16_at(block, 0);
            let (m, at) = match dtype {
                DType::Q5_1 => (Some(f16_at(block, 2)), 4),
                _ => (None, 2),
            };
            let qh = u32::from_le_bytes(block[at..at + 4].try_into().unwrap());
            let qs = &block[at + 4..at + 20];
            for j in 0..16 {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                let q0 = (qs[j] as u32 & 0x0f) | h0;
                let q1 = (qs[j] as u32 >> 4) | h1;
                match m {
                    Some(m) => {
                        out[j] = q0 as f32 * d + m;
                        out[j + 16] = q1 as f32 * d + m;
                    }
                    None => {
                        out[j] = (q0 as i32 - 16) as f32 * d;
                        out[j + 16] = (q1 as i32 - 16) as f32 * d;
                    }
                }
            }
        }
        _ => unreachable!("{dtype} is not a format of 32-element blocks"),
    }
}

/// Scale and minimum `j` (of 8) of a Q4_K / Q5_K super-block's 12 packed 6-bit bytes.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Decodes one 256-element super-block of a K-quant type, with the arithmetic of llama.cpp's
/// reference `dequantize_row_q*_K` (each scale times `d` in f32 first, then times the value,
/// then the minimum's product subtracted), so the values are bit for bit the reference's.
#[inline(always)]
pub fn dequantize_superblock(dtype: DType, b: &[u8], y: &mut [f32; 256]) {
    match dtype {
        DType::Q2_K => {
            let (scales, q, d, min) = (&b[0..16], &b[16..80], f16_at(b, 80), f16_at(b, 82));
            let mut at = 0;
            let mut is = 0;
            for n in 0..2 {
                let q = &q[n * 32..];
                for shift in [0, 2, 4, 6] {
                    for half in 0..2 {
                        let sc = scales[is];
                        is += 1;
                        let (dl, ml) = (d * (sc & 0x0f) as f32, min * (sc >> 4) as f32);
                        for l in 0..16 {
                            y[at] = dl * ((q[l + 16 * half] >> shift) & 3) as f32 - ml;
                            at += 1;
                        }
                    }
                }
            }
        }
        DType::Q3_K => {
            let (hm, q, packed, d) = (&b[0..32], &b[32..96], &b[96..108], f16_at(b, 108));
            // 16 6-bit scales: low 4 bits from bytes 0-7, high 2 bits from bytes 8-11.
            let word = |i: usize| u32::from_le_bytes(packed[i * 4..i * 4 + 4].try_into().unwrap());
            let (a0, a1, tmp) = (word(0), word(1), word(2));
            let (k1, k2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
            let aux = [
                (a0 & k2) | ((tmp & k1) << 4),
                (a1 & k2) | (((tmp >> 2) & k1) << 4),
                ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4),
                ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4),
            ];
            let scale = |i: usize| (aux[i / 4] >> (8 * (i % 4))) as u8 as i8;
            let (mut at, mut is, mut m) = (0, 0, 1u8);
            for n in 0..2 {
                let q = &q[n * 32..];
                for shift in [0, 2, 4, 6] {
                    for half in 0..2 {
                        let dl = d * (scale(is) as i32 - 32) as f32;
                        is += 1;
                        for l in 0..16 {
                            let k = l + 16 * half;
                            let low = ((q[k] >> shift) & 3) as i32;
                            let high = if hm[k] & m != 0 { 0 } else { 4 };
                            y[at] = dl * (low - high) as f32;
                            at += 1;
                        }
                    }
                    m <<= 1;
                }
            }
        }
        DType::Q4_K | DType::Q5_K => {
            let (d, min, scales) = (f16_at(b, 0), f16_at(b, 2), &b[4..16]);
            let (qh, ql) = match dtype {
                DType::Q5_K => (Some(&b[16..48]), &b[48..176]),
                _ => (None, &b[16..144]),
            };
            let (mut u1, mut u2) = (1u8, 2u8);
            for (j, ql) in ql.chunks_exact(32).enumerate() {
                let (sc, m) = scale_min_k4(2 * j, scales);
                let (d1, m1) = (d * sc as f32, min * m as f32);
                let (sc, m) = scale_min_k4(2 * j + 1, scales);
                let (d2, m2) = (d * sc as f32, min * m as f32);
                let high = |l: usize, u: u8| match qh {
                    Some(qh) if qh[l] & u != 0 => 16,
                    _ => 0,
                };
                for l in 0..32 {
                    y[64 * j + l] = d1 * ((ql[l] & 0x0f) + high(l, u1)) as f32 - m1;
                    y[64 * j + 32 + l] = d2 * ((ql[l] >> 4) + high(l, u2)) as f32 - m2;
                }
                u1 <<= 2;
                u2 <<= 2;
            }
        }
        DType::Q6_K => {
            let (ql, qh, sc, d) = (&b[0..128], &b[128..192], &b[192..208], f16_at(b, 208));
            for n in 0..2 {
                let (ql, qh, sc, y) = (
                    &ql[64 * n..],
                    &qh[32 * n..],
                    &sc[8 * n..],
                    &mut y[128 * n..],
                );
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
        _ => unreachable!("{dtype} is not a K-quant"),
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
        _ if dtype.block_len() == 256 => {
            for (o, block) in out
                .chunks_exact_mut(256)
                .zip(bytes.chunks_exact(dtype.block_bytes()))
            {
                let o: &mut [f32; 256] = o.try_into().expect("chunks of 256");
                dequantize_superblock(dtype, block, o);
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
/// Used to write test models and converted files; `values.len()` must be a whole number of blocks
/// and `dtype` one of [`DType::WRITABLE`].
pub fn quantize_row(dtype: DType, values: &[f32]) -> Vec<u8> {
    assert!(
        dtype.row_bytes(values.len()).is_some(),
        "row of {} is not a whole number of {dtype} blocks",
        values.len()
    );
    assert!(
        DType::WRITABLE.contains(&dtype),
        "{dtype} is read from files, not written"
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
        _ => unreachable!("checked above"),
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
            for dtype in DType::WRITABLE {
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
                        _ => unreachable!("not writable"),
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

/// Random blocks of `dtype` (one of the types read from files only): random bytes, with every f16
/// scale set to a small finite value as quantizers write them. For tests of the decoding paths.
pub fn random_blocks(dtype: DType, blocks: usize, mut byte: impl FnMut() -> u8) -> Vec<u8> {
    let scales: &[usize] = match dtype {
        DType::Q5_0 => &[0],
        DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        _ => &[],
    };
    let mut out = Vec::with_capacity(blocks * dtype.block_bytes());
    for _ in 0..blocks {
        let start = out.len();
        out.extend((0..dtype.block_bytes()).map(|_| byte()));
        for &at in scales {
            let v = (byte() as f32 - 127.5) / 127.5 * 0.02;
            out[start + at..start + at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
    }
    out
}

#[cfg(test)]
mod golden {
    use super::*;

    #[derive(serde::Deserialize)]
    struct Golden {
        types: std::collections::BTreeMap<String, Blocks>,
    }

    #[derive(serde::Deserialize)]
    struct Blocks {
        blocks: Vec<String>,
        values: Vec<u32>,
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// Random blocks of every 5-bit and K-quant type, decoded by the `gguf` Python package's
    /// reference dequantizers (`scripts/kquant_golden.py`): equal bit for bit.
    #[test]
    fn kquants_dequantize_like_gguf_py() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/golden/kquants.json"
        );
        let golden: Golden = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let mut seen = Vec::new();
        for (name, g) in &golden.types {
            let dtype: DType = name.parse().unwrap();
            let bytes: Vec<u8> = g.blocks.iter().flat_map(|b| hex(b)).collect();
            let n = g.blocks.len() * dtype.block_len();
            assert_eq!(g.values.len(), n, "{name}");
            let mut out = vec![f32::NAN; n];
            dequantize_row(dtype, &bytes, &mut out);
            for (i, (got, want)) in out.iter().zip(&g.values).enumerate() {
                assert!(
                    got.to_bits() == *want || (got.is_nan() && f32::from_bits(*want).is_nan()),
                    "{name} element {i}: {got} vs gguf-py's {}",
                    f32::from_bits(*want)
                );
            }
            seen.push(dtype);
        }
        for dtype in DType::ALL.iter().filter(|d| !DType::WRITABLE.contains(d)) {
            assert!(seen.contains(dtype), "{dtype} has no golden blocks");
        }
    }
}
