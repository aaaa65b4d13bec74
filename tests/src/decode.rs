//! Stored tensors and an independent f64 decoder of every element type Turbo loads.
//!
//! Encoding uses `turbo_core::quant::quantize_row` (how the bytes were produced does not matter to
//! a test); decoding is written here from the format definitions (ggml's `block_q8_0`,
//! `block_q4_0`, `block_q4_1`, IEEE half and bfloat16), so the reference forward pass sees exactly
//! the values the file holds without trusting Turbo's decoder.

use turbo_core::DType;

/// A tensor as stored in a file: `rows` rows of `cols` elements encoded as `dtype`.
#[derive(Clone, Debug)]
pub struct Stored {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: Vec<u8>,
}

impl Stored {
    /// Encodes row by row (block formats need `cols` to be a multiple of 32).
    pub fn encode(dtype: DType, rows: usize, cols: usize, values: &[f32]) -> Stored {
        assert_eq!(values.len(), rows * cols);
        let bytes = values
            .chunks(cols)
            .flat_map(|row| turbo_core::quant::quantize_row(dtype, row))
            .collect();
        Stored {
            dtype,
            rows,
            cols,
            bytes,
        }
    }

    /// The stored values, decoded in f64.
    pub fn decode(&self) -> Vec<f64> {
        decode(self.dtype, &self.bytes, self.rows * self.cols)
    }
}

/// IEEE 754 binary16 from its bits.
pub fn f16_bits_to_f64(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let mant = (h & 0x3ff) as f64;
    sign * match exp {
        0 => mant * 2f64.powi(-24),
        31 if mant == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        e => (1.0 + mant / 1024.0) * 2f64.powi(e - 15),
    }
}

/// bfloat16 from its bits: the high half of an f32.
pub fn bf16_bits_to_f64(b: u16) -> f64 {
    f32::from_bits((b as u32) << 16) as f64
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// Decodes `n` elements of `dtype` from `bytes`, which must hold exactly that many.
pub fn decode(dtype: DType, bytes: &[u8], n: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(n);
    match dtype {
        DType::F32 => {
            assert_eq!(bytes.len(), n * 4);
            out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64),
            );
        }
        DType::F16 | DType::BF16 => {
            assert_eq!(bytes.len(), n * 2);
            let f = if dtype == DType::F16 {
                f16_bits_to_f64
            } else {
                bf16_bits_to_f64
            };
            out.extend(bytes.chunks_exact(2).map(|c| f(le16(c, 0))));
        }
        DType::Q8_0 => {
            // struct block_q8_0 { ggml_half d; int8_t qs[32]; }: x = qs[j] * d.
            assert_eq!(bytes.len(), n / 32 * 34);
            for b in bytes.chunks_exact(34) {
                let d = f16_bits_to_f64(le16(b, 0));
                out.extend(b[2..34].iter().map(|&q| q as i8 as f64 * d));
            }
        }
        DType::Q4_0 => {
            // struct block_q4_0 { ggml_half d; uint8_t qs[16]; }: element j is the low nibble of
            // qs[j], element j + 16 its high nibble; x = (q - 8) * d.
            assert_eq!(bytes.len(), n / 32 * 18);
            for b in bytes.chunks_exact(18) {
                let d = f16_bits_to_f64(le16(b, 0));
                let qs = &b[2..18];
                out.extend(qs.iter().map(|q| ((q & 0x0f) as f64 - 8.0) * d));
                out.extend(qs.iter().map(|q| ((q >> 4) as f64 - 8.0) * d));
            }
        }
        DType::Q4_1 => {
            // struct block_q4_1 { ggml_half d; ggml_half m; uint8_t qs[16]; }: x = q * d + m.
            assert_eq!(bytes.len(), n / 32 * 20);
            for b in bytes.chunks_exact(20) {
                let d = f16_bits_to_f64(le16(b, 0));
                let m = f16_bits_to_f64(le16(b, 2));
                let qs = &b[4..20];
                out.extend(qs.iter().map(|q| (q & 0x0f) as f64 * d + m));
                out.extend(qs.iter().map(|q| (q >> 4) as f64 * d + m));
            }
        }
        // Types only read from files (no encoder writes them here): their decoding is checked
        // against the gguf package's reference dequantizers (turbo-core's
        // `kquants_dequantize_like_gguf_py`).
        other => panic!("{other} is not written by Stored::encode"),
    }
    assert_eq!(
        out.len(),
        n,
        "{dtype}: {} bytes for {n} elements",
        bytes.len()
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn half_decoders_match_the_half_crate() {
        for bits in (0..=u16::MAX)
            .step_by(7)
            .chain([0x0001, 0x03ff, 0x7bff, 0x8000, 0xfbff])
        {
            let want = f16::from_bits(bits).to_f64();
            let got = f16_bits_to_f64(bits);
            assert!(got == want || (got.is_nan() && want.is_nan()), "{bits:#x}");
            let want = bf16::from_bits(bits).to_f64();
            let got = bf16_bits_to_f64(bits);
            assert!(got == want || (got.is_nan() && want.is_nan()), "{bits:#x}");
        }
    }

    #[test]
    fn block_formats_decode_close_to_their_input() {
        let values: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 64) as f32 - 30.0) / 16.0)
            .collect();
        for (dtype, tol) in [
            (DType::F32, 0.0),
            (DType::F16, 2e-3),
            (DType::BF16, 2e-2),
            (DType::Q8_0, 0.02),
            (DType::Q4_1, 0.2),
            (DType::Q4_0, 0.5),
        ] {
            let back = Stored::encode(dtype, 2, 32, &values).decode();
            for (a, b) in values.iter().zip(&back) {
                assert!((*a as f64 - b).abs() <= tol, "{dtype}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn q4_0_nibble_order() {
        // d = 1: element j = low nibble of byte j minus 8, element j + 16 = high nibble minus 8.
        let mut block = f16::from_f32(1.0).to_le_bytes().to_vec();
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let x = decode(DType::Q4_0, &block, 32);
        for j in 0..16 {
            assert_eq!(x[j], j as f64 - 8.0);
            assert_eq!(x[j + 16], 7.0 - j as f64);
        }
    }
}
