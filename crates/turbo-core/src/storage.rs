//! Tensor bytes that are either memory-mapped from a model file or owned, and weight matrices over them.

use crate::{quant, DType};
use memmap2::Mmap;
use std::ops::Range;
use std::sync::Arc;

#[derive(Clone)]
enum Backing {
    Mapped(Arc<Mmap>),
    Owned(Arc<Vec<u8>>),
}

/// A cheap-to-clone window of bytes; model weights stay in the page cache instead of being copied.
#[derive(Clone)]
pub struct Bytes {
    backing: Backing,
    range: Range<usize>,
}

impl Bytes {
    /// A window of a memory map; `range` must lie inside it.
    pub fn mapped(map: Arc<Mmap>, range: Range<usize>) -> Bytes {
        assert!(range.end <= map.len(), "window past the end of the mapping");
        Bytes {
            backing: Backing::Mapped(map),
            range,
        }
    }

    pub fn owned(bytes: Vec<u8>) -> Bytes {
        let range = 0..bytes.len();
        Bytes {
            backing: Backing::Owned(Arc::new(bytes)),
            range,
        }
    }

    pub fn from_f32(values: &[f32]) -> Bytes {
        Bytes::owned(bytemuck::cast_slice(values).to_vec())
    }

    pub fn as_slice(&self) -> &[u8] {
        match &self.backing {
            Backing::Mapped(m) => &m[self.range.clone()],
            Backing::Owned(v) => &v[self.range.clone()],
        }
    }

    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// The bytes at `range` of this window (relative to its start), sharing the same backing.
    pub fn slice(&self, range: Range<usize>) -> Bytes {
        assert!(range.end <= self.len(), "slice past the end of the window");
        Bytes {
            backing: self.backing.clone(),
            range: self.range.start + range.start..self.range.start + range.end,
        }
    }

    /// True when the bytes live in a memory-mapped file rather than on the heap.
    pub fn is_mapped(&self) -> bool {
        matches!(self.backing, Backing::Mapped(_))
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Bytes({} bytes, mapped: {})",
            self.len(),
            self.is_mapped()
        )
    }
}

/// A row-major `[rows, cols]` matrix as stored in the model file: `rows` output features, each a row
/// of `cols` input features in `dtype` encoding.
#[derive(Clone, Debug)]
pub struct WeightMatrix {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: Bytes,
}

impl WeightMatrix {
    /// Checks that `data` holds exactly `rows` rows of `cols` elements.
    pub fn new(dtype: DType, rows: usize, cols: usize, data: Bytes) -> Result<Self, String> {
        let row_bytes = dtype.row_bytes(cols).ok_or_else(|| {
            format!(
                "a row of {cols} elements is not a whole number of {dtype} blocks of {}",
                dtype.block_len()
            )
        })?;
        if row_bytes * rows != data.len() {
            return Err(format!(
                "{rows}x{cols} {dtype} needs {} bytes, found {}",
                row_bytes * rows,
                data.len()
            ));
        }
        Ok(WeightMatrix {
            dtype,
            rows,
            cols,
            data,
        })
    }

    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Self {
        assert_eq!(values.len(), rows * cols);
        WeightMatrix {
            dtype: DType::F32,
            rows,
            cols,
            data: Bytes::from_f32(values),
        }
    }

    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }

    pub fn row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.data.as_slice()[r * n..(r + 1) * n]
    }

    /// Decodes row `r` into `out` (`cols` floats).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        quant::dequantize_row(self.dtype, self.row(r), out);
    }

    /// Decodes the whole matrix; for tests and conversions, not hot paths.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
            self.dequantize_row(r, o);
        }
        out
    }

    /// The rows of `parts` stacked into one matrix, byte for byte when they share a type and
    /// decoded to f32 otherwise.
    pub fn stack(parts: &[&WeightMatrix]) -> Result<WeightMatrix, String> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if parts.iter().any(|p| p.cols != cols) {
            return Err("stacked matrices must have the same number of columns".into());
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let dtype = parts.first().map_or(DType::F32, |p| p.dtype);
        if parts.iter().all(|p| p.dtype == dtype) {
            let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
            for p in parts {
                bytes.extend_from_slice(p.data.as_slice());
            }
            return WeightMatrix::new(dtype, rows, cols, Bytes::owned(bytes));
        }
        // Q4_0 and Q5_0 blocks are Q8_0 blocks with fewer code bits (the same f16 scale times a
        // signed code): a mix of the three stacks as Q8_0, exactly, rather than as f32 (4x the
        // bytes for every product). Quantizers mix them (Q4_K_M files keep some layers' V in
        // Q8_0 beside Q5_0 Q and K).
        let widens = |d: DType| matches!(d, DType::Q4_0 | DType::Q5_0 | DType::Q8_0);
        if parts.iter().all(|p| widens(p.dtype)) {
            let mut bytes = Vec::with_capacity(rows * DType::Q8_0.row_bytes(cols).unwrap_or(0));
            for p in parts {
                for block in p.data.as_slice().chunks_exact(p.dtype.block_bytes()) {
                    bytes.extend_from_slice(&block[..2]);
                    bytes.extend((0..32).map(|j| q8_code(p.dtype, block, j) as u8));
                }
            }
            return WeightMatrix::new(DType::Q8_0, rows, cols, Bytes::owned(bytes));
        }
        let values: Vec<f32> = parts.iter().flat_map(|p| p.to_f32()).collect();
        Ok(WeightMatrix::from_f32(rows, cols, &values))
    }

    /// Rows `rows` (output features) of this matrix, sharing its bytes: a column-parallel shard.
    pub fn row_range(&self, rows: Range<usize>) -> Result<WeightMatrix, String> {
        if rows.start > rows.end || rows.end > self.rows {
            return Err(format!("rows {rows:?} of a matrix of {} rows", self.rows));
        }
        let n = self.row_bytes();
        Ok(WeightMatrix {
            rows: rows.len(),
            data: self.data.slice(rows.start * n..rows.end * n),
            ..self.clone()
        })
    }

    /// Columns `cols` (input features) of every row, copied: a row-parallel shard. The range
    /// must start and end on the type's block boundaries.
    pub fn col_range(&self, cols: Range<usize>) -> Result<WeightMatrix, String> {
        let block = self.dtype.block_len();
        if cols.start > cols.end || cols.end > self.cols {
            return Err(format!(
                "columns {cols:?} of a matrix of {} columns",
                self.cols
            ));
        }
        if !cols.start.is_multiple_of(block) || !cols.end.is_multiple_of(block) {
            return Err(format!(
                "columns {cols:?} do not fall on {} blocks of {block}",
                self.dtype
            ));
        }
        let bytes_per_block = self.dtype.block_bytes();
        let (from, to) = (
            cols.start / block * bytes_per_block,
            cols.end / block * bytes_per_block,
        );
        let mut bytes = Vec::with_capacity(self.rows * (to - from));
        for r in 0..self.rows {
            bytes.extend_from_slice(&self.row(r)[from..to]);
        }
        WeightMatrix::new(self.dtype, self.rows, cols.len(), Bytes::owned(bytes))
    }

    /// A new matrix with rows taken in the order `order` (`order[i]` is the source row of row `i`).
    pub fn permute_rows(&self, order: &[usize]) -> WeightMatrix {
        assert_eq!(order.len(), self.rows);
        let mut bytes = Vec::with_capacity(self.data.len());
        for &src in order {
            bytes.extend_from_slice(self.row(src));
        }
        WeightMatrix {
            data: Bytes::owned(bytes),
            ..self.clone()
        }
    }
}

/// Code `j` of a Q4_0, Q5_0 or Q8_0 block as the signed 8-bit code its f16 scale multiplies.
fn q8_code(dtype: DType, block: &[u8], j: usize) -> i8 {
    match dtype {
        DType::Q8_0 => block[2 + j] as i8,
        DType::Q4_0 => {
            let q = block[2 + j % 16];
            (if j < 16 { q & 15 } else { q >> 4 }) as i8 - 8
        }
        _ => {
            let qh = u32::from_le_bytes(block[2..6].try_into().unwrap());
            let q = block[6 + j % 16];
            let low = if j < 16 { q & 15 } else { q >> 4 };
            (low | (((qh >> j) & 1) as u8) << 4) as i8 - 16
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize_row, random_blocks};
    use rand::{Rng, SeedableRng};

    fn matrix(dtype: DType, rows: usize, cols: usize, rng: &mut impl Rng) -> WeightMatrix {
        let bytes = match DType::WRITABLE.contains(&dtype) {
            true => (0..rows)
                .flat_map(|_| {
                    let row: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
                    quantize_row(dtype, &row)
                })
                .collect(),
            false => random_blocks(dtype, rows * cols / dtype.block_len(), || rng.random()),
        };
        WeightMatrix::new(dtype, rows, cols, Bytes::owned(bytes)).unwrap()
    }

    /// Stacked parts decode to exactly the parts' values: Q4_0, Q5_0 and Q8_0 mixed become one
    /// Q8_0 matrix; other mixes become f32.
    #[test]
    fn stacks_keep_every_value() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let cols = 96;
        for (types, want) in [
            (vec![DType::Q5_0, DType::Q5_0, DType::Q8_0], DType::Q8_0),
            (vec![DType::Q4_0, DType::Q8_0, DType::Q5_0], DType::Q8_0),
            (vec![DType::Q5_0, DType::F16], DType::F32),
            (vec![DType::Q4_1, DType::Q4_1], DType::Q4_1),
        ] {
            let parts: Vec<WeightMatrix> = types
                .iter()
                .enumerate()
                .map(|(i, &d)| matrix(d, 3 + i, cols, &mut rng))
                .collect();
            let refs: Vec<&WeightMatrix> = parts.iter().collect();
            let stacked = WeightMatrix::stack(&refs).unwrap();
            assert_eq!(stacked.dtype, want, "{types:?}");
            let values: Vec<f32> = parts.iter().flat_map(|p| p.to_f32()).collect();
            let got = stacked.to_f32();
            assert!(
                got.iter()
                    .zip(&values)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{types:?}: stacked values differ"
            );
        }
    }
}
