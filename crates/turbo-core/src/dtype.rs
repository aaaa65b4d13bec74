//! Element types of stored weights, including GGUF's block-quantized formats.

use std::fmt;
use std::str::FromStr;

/// How the elements of a stored tensor are encoded.
///
/// Block formats pack [`DType::block_len`] consecutive elements of a row into
/// [`DType::block_bytes`] bytes, so a row's length must be a multiple of the block length: 32 for
/// the legacy formats (`Q8_0`, `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`), 256 for the K-quants, whose
/// super-blocks hold 6-bit or 8-bit scales of 16 or 32-element sub-blocks (llama.cpp's
/// `ggml-quants.c` defines them; [`crate::quant`] decodes them as its reference code does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)] // GGUF's names
pub enum DType {
    F32,
    F16,
    BF16,
    /// 32 elements: an f16 scale `d` and 32 signed bytes; value = q * d.
    Q8_0,
    /// 32 elements: an f16 scale `d` and 16 bytes of nibbles; value = (q - 8) * d.
    Q4_0,
    /// 32 elements: f16 scale `d`, f16 minimum `m` and 16 bytes of nibbles; value = q * d + m.
    Q4_1,
    /// 32 elements: f16 `d`, 32 high bits, 16 bytes of nibbles; value = (q - 16) * d.
    Q5_0,
    /// 32 elements: f16 `d` and `m`, 32 high bits, 16 bytes of nibbles; value = q * d + m.
    Q5_1,
    /// 256 elements: 16 sub-blocks of 16 with 4-bit scales and minimums, 2-bit values.
    Q2_K,
    /// 256 elements: 16 sub-blocks of 16 with 6-bit scales, 3-bit values (2 low bits + a mask).
    Q3_K,
    /// 256 elements: 8 sub-blocks of 32 with 6-bit scales and minimums, 4-bit values.
    Q4_K,
    /// 256 elements: 8 sub-blocks of 32 with 6-bit scales and minimums, 5-bit values.
    Q5_K,
    /// 256 elements: 16 sub-blocks of 16 with 8-bit scales, 6-bit values.
    Q6_K,
}

impl DType {
    pub const ALL: [DType; 13] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
    ];

    /// The types [`crate::quant::quantize_row`] can write (test models, conversions); the others
    /// are only read from files that llama.cpp's quantizer made.
    pub const WRITABLE: [DType; 6] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
    ];

    /// Elements per storage block (1 for plain floats).
    pub const fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => 32,
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K => 256,
        }
    }

    /// Bytes per storage block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q2_K => 84,
            DType::Q3_K => 110,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
        }
    }

    pub const fn is_quantized(self) -> bool {
        self.block_len() > 1
    }

    /// Bytes taken by a row of `n` elements, or `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        n.is_multiple_of(self.block_len())
            .then(|| n / self.block_len() * self.block_bytes())
    }

    /// The GGML type id used in GGUF files.
    pub const fn ggml_id(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::Q8_0 => 8,
            DType::Q2_K => 10,
            DType::Q3_K => 11,
            DType::Q4_K => 12,
            DType::Q5_K => 13,
            DType::Q6_K => 14,
            DType::BF16 => 30,
        }
    }

    pub fn from_ggml_id(id: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.ggml_id() == id)
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q2_K => "Q2_K",
            DType::Q3_K => "Q3_K",
            DType::Q4_K => "Q4_K",
            DType::Q5_K => "Q5_K",
            DType::Q6_K => "Q6_K",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown dtype '{s}'"))
    }
}

/// Name of a GGML type id, for error messages about types Turbo does not load.
pub fn ggml_type_name(id: u32) -> &'static str {
    const NAMES: [&str; 42] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
        "?",
        "?",
    ];
    NAMES.get(id as usize).copied().unwrap_or("?")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_ids_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_ggml_id(d.ggml_id()), Some(d));
            assert_eq!(ggml_type_name(d.ggml_id()), d.name());
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert_eq!(DType::from_ggml_id(16), None);
        assert_eq!(ggml_type_name(16), "IQ2_XXS");
    }

    #[test]
    fn row_bytes_needs_whole_blocks() {
        assert_eq!(DType::Q4_1.row_bytes(64), Some(40));
        assert_eq!(DType::Q8_0.row_bytes(33), None);
        assert_eq!(DType::BF16.row_bytes(3), Some(6));
    }
}
