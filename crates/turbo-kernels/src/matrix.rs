//! Weight matrices on the device: bf16, or GGUF blocks kept as the file holds them (a Q4 file
//! then takes about a quarter of the memory and of the bytes a decode step reads, and the
//! products use the file's own values rather than their bf16 roundings).

use crate::backend::CudaTensor;
use crate::device::CudaDevice;
use crate::error::{CudaError, Result};
use crate::ops;
use crate::ops::gemv::GemvNorm;
use crate::ops::linear::{Band, GemmOut};
use crate::ops::quant::{
    NormLink, QuantOut, QuantRows, RopeKvOut, PADDING_BYTES, QGEMV_MAX_TOKENS,
};
use cudarc::driver::CudaSlice;
use half::bf16;
use std::sync::Mutex;
use turbo_core::{DType, WeightMatrix};

/// A weight matrix on the device.
pub struct CudaMatrix {
    pub rows: usize,
    pub cols: usize,
    pub store: MatrixStore,
}

/// How a [`CudaMatrix`] holds its values.
pub enum MatrixStore {
    /// Row-major bf16 (quantized weights decoded at upload with `--weights-dtype bf16`).
    Bf16(CudaSlice<bf16>),
    /// Consecutive bands of rows, each of one block type (a stacked matrix may mix types: Q4_K_M
    /// files keep some layers' V in Q6_K beside Q4_K Q and K).
    Blocks(Vec<BlockBand>),
}

/// Rows `first_row .. first_row + rows` of a matrix as the file's blocks, followed by
/// [`PADDING_BYTES`].
pub struct BlockBand {
    pub dtype: DType,
    pub first_row: usize,
    pub rows: usize,
    pub bytes: CudaSlice<u8>,
}

impl CudaMatrix {
    /// The bf16 values, unless the matrix keeps blocks.
    pub fn bf16(&self) -> Option<&CudaSlice<bf16>> {
        match &self.store {
            MatrixStore::Bf16(d) => Some(d),
            MatrixStore::Blocks(_) => None,
        }
    }

    /// Device memory the values take.
    pub fn device_bytes(&self) -> usize {
        match &self.store {
            MatrixStore::Bf16(d) => d.len() * 2,
            MatrixStore::Blocks(bands) => bands.iter().map(|b| b.bytes.len()).sum(),
        }
    }

    /// Whether a `tokens`-token product with this matrix takes x already normalized: some band
    /// runs on tensor cores without applying the norm itself ([`ops::quant::takes_normalized_x`]).
    pub fn takes_normalized_x(&self, dev: &CudaDevice, tokens: usize) -> bool {
        match &self.store {
            MatrixStore::Bf16(_) => false,
            MatrixStore::Blocks(bands) => bands
                .iter()
                .any(|b| ops::quant::takes_normalized_x(dev, b.dtype, (b.rows, self.cols), tokens)),
        }
    }

    /// Whether a `tokens`-token product with this matrix can take part in a split norm
    /// ([`NormLink`]): as the residual step (`ahead`), one band; as the product that finishes
    /// it, every band; each as [`ops::quant::links_norm`] says (one token, on tensor cores).
    pub fn links_norm(&self, dev: &CudaDevice, tokens: usize, ahead: bool) -> bool {
        match &self.store {
            MatrixStore::Bf16(_) => false,
            MatrixStore::Blocks(bands) => {
                (!ahead || bands.len() == 1)
                    && bands
                        .iter()
                        .all(|b| ops::quant::links_norm(dev, b.dtype, (b.rows, self.cols), tokens))
            }
        }
    }

    /// The block types of the matrix's bands (empty for bf16).
    pub fn block_types(&self) -> Vec<DType> {
        match &self.store {
            MatrixStore::Bf16(_) => Vec::new(),
            MatrixStore::Blocks(bands) => bands.iter().map(|b| b.dtype).collect(),
        }
    }
}

impl BlockBand {
    fn rows(&self, cols: usize) -> QuantRows<'_> {
        QuantRows {
            dtype: self.dtype,
            bytes: &self.bytes,
            rows: self.rows,
            cols,
        }
    }
}

/// Whether `parts`, stacked, can be kept as blocks on the GPU: every part of a type the kernels
/// decode, and rows of whole blocks of 32 (16-byte aligned rows of activations).
pub fn keeps_blocks(parts: &[&WeightMatrix]) -> bool {
    let cols = parts.first().map_or(0, |p| p.cols);
    cols > 0
        && cols.is_multiple_of(32)
        && parts
            .iter()
            .all(|p| p.cols == cols && ops::quant::supports(p.dtype))
}

/// `parts` stacked, uploaded as their blocks: consecutive parts of one type share a band.
pub fn upload_blocks(dev: &CudaDevice, parts: &[&WeightMatrix]) -> Result<CudaMatrix> {
    let cols = parts.first().map_or(0, |p| p.cols);
    let mut bands = Vec::new();
    let mut first_row = 0;
    let mut i = 0;
    while i < parts.len() {
        let dtype = parts[i].dtype;
        let run: Vec<&WeightMatrix> = parts[i..]
            .iter()
            .take_while(|p| p.dtype == dtype)
            .copied()
            .collect();
        i += run.len();
        let rows: usize = run.iter().map(|p| p.rows).sum();
        let len: usize = run.iter().map(|p| p.data.len()).sum();
        let mut bytes = dev.stream.alloc_zeros::<u8>(len + PADDING_BYTES)?;
        let mut at = 0;
        for p in &run {
            let n = p.data.len();
            dev.stream
                .memcpy_htod(p.data.as_slice(), &mut bytes.slice_mut(at..at + n))?;
            at += n;
        }
        ops::quant::load(dev, dtype)?;
        bands.push(BlockBand {
            dtype,
            first_row,
            rows,
            bytes,
        });
        first_row += rows;
    }
    Ok(CudaMatrix {
        rows: first_row,
        cols,
        store: MatrixStore::Blocks(bands),
    })
}

/// Values of decoded weights a larger step's product decodes at a time (64 MiB of bf16): bands
/// of more rows go through in parts.
pub const DECODE_SCRATCH_ELEMS: usize = 32 << 20;

/// Rows a band's part starts on: 128 rows keep every part's output columns 256-byte aligned
/// (bf16 or f32), the alignment cuBLASLt's algorithms assume by default.
const TILE_ALIGN_ROWS: usize = 128;

/// The rows of a `cols`-wide matrix decoded at a time for a larger step's product: as many as
/// the scratch holds, a multiple of [`TILE_ALIGN_ROWS`].
fn tile_rows(cols: usize) -> usize {
    (DECODE_SCRATCH_ELEMS / cols.max(1) / TILE_ALIGN_ROWS).max(1) * TILE_ALIGN_ROWS
}

/// The scratch a matrix's larger products need: the most rows decoded at a time, times `cols`.
fn scratch_elems(m: &CudaMatrix) -> usize {
    match &m.store {
        MatrixStore::Bf16(_) => 0,
        MatrixStore::Blocks(bands) => bands
            .iter()
            .map(|b| b.rows.min(tile_rows(m.cols)) * m.cols)
            .max()
            .unwrap_or(0),
    }
}

/// Where larger steps' products decode bands of quantized weights to bf16. It is sized at
/// upload for the widest band, so that no step allocates. A scratch outgrown by a later upload
/// is kept rather than freed: steps recorded as CUDA graphs before it hold its address.
#[derive(Default)]
pub struct DecodeScratch {
    current: Option<CudaSlice<bf16>>,
    retired: Vec<CudaSlice<bf16>>,
}

impl DecodeScratch {
    /// Makes the scratch hold at least what `m`'s larger products need.
    pub fn reserve_for(&mut self, dev: &CudaDevice, m: &CudaMatrix) -> Result<()> {
        let need = scratch_elems(m);
        if need == 0 || self.current.as_ref().is_some_and(|s| s.len() >= need) {
            return Ok(());
        }
        // SAFETY: the scratch is written by a decode before every read.
        let grown = unsafe { dev.stream.alloc::<bf16>(need) }?;
        self.retired.extend(self.current.replace(grown));
        Ok(())
    }
}

/// What a quantized product does with its result (`[tokens, rows]`).
pub enum ProductOut<'a> {
    Bf16(&'a mut CudaSlice<bf16>),
    F32(&'a mut CudaSlice<f32>),
    /// Added to the residual stream in place.
    AddTo(&'a mut CudaSlice<bf16>),
    /// A one-token QKV product finishing a split norm: its outputs rotated and written to q and
    /// the KV cache ([`ops::quant::qgemv_rope_kv`]).
    RopeKv(RopeKvOut<'a>),
}

/// `out ← x · wᵀ` (or `+=` for [`ProductOut::AddTo`]) for a matrix of blocks. Steps of at most
/// [`QGEMV_MAX_TOKENS`] tokens decode the blocks inside the product (with `norm` applied to `x`
/// first when given, or with a part in a split norm, `link`, where [`CudaMatrix::links_norm`]);
/// larger ones decode bands of rows to bf16 in `scratch` and multiply them by cuBLASLt, and take
/// no `norm` (the caller normalizes first).
pub fn product(
    dev: &CudaDevice,
    scratch: &Mutex<DecodeScratch>,
    x: &CudaTensor,
    w: &CudaMatrix,
    (norm, link): (Option<GemvNorm>, NormLink),
    out: ProductOut,
) -> Result<()> {
    let MatrixStore::Blocks(bands) = &w.store else {
        return Err(CudaError::Shape(
            "a quantized product over a bf16 matrix".into(),
        ));
    };
    if x.rows <= QGEMV_MAX_TOKENS {
        let mut out = out;
        let mut link = link;
        if !matches!(link, NormLink::None)
            && !w.links_norm(dev, x.rows, matches!(link, NormLink::Ahead { .. }))
        {
            return Err(CudaError::Shape(format!(
                "a split norm over a {}x{} product of {} tokens that cannot take part in one",
                w.rows, w.cols, x.rows
            )));
        }
        let short = || {
            CudaError::Shape(format!(
                "a quantized product's output is shorter than {} rows",
                w.rows
            ))
        };
        for band in bands {
            let rows = band.rows(w.cols);
            // Every band finishes a split norm from the same parts; `Ahead` has one band.
            let link = match &mut link {
                NormLink::None => NormLink::None,
                NormLink::Finish { parts, eps } => NormLink::Finish { parts, eps: *eps },
                NormLink::Ahead { .. } => std::mem::take(&mut link),
            };
            let x = (&x.data, x.rows);
            match &mut out {
                ProductOut::RopeKv(rope) => {
                    let rope = rope.from_row(band.first_row);
                    ops::quant::qgemv_rope_kv(dev, x.0, &rows, link, rope)?;
                }
                ProductOut::Bf16(o) => {
                    let mut view = o.try_slice_mut(band.first_row..).ok_or_else(short)?;
                    let out = QuantOut::Bf16(&mut view);
                    ops::quant::qgemv_linked(dev, x, &rows, (norm, link), out, w.rows)?;
                }
                ProductOut::AddTo(o) => {
                    let mut view = o.try_slice_mut(band.first_row..).ok_or_else(short)?;
                    let out = QuantOut::AddTo(&mut view);
                    ops::quant::qgemv_linked(dev, x, &rows, (norm, link), out, w.rows)?;
                }
                ProductOut::F32(o) => {
                    let mut view = o.try_slice_mut(band.first_row..).ok_or_else(short)?;
                    let out = QuantOut::F32(&mut view);
                    ops::quant::qgemv_linked(dev, x, &rows, (norm, link), out, w.rows)?;
                }
            }
        }
        return Ok(());
    }
    if !matches!(link, NormLink::None) {
        return Err(CudaError::Shape(format!(
            "a split norm over a quantized product of {} tokens",
            x.rows
        )));
    }
    if norm.is_some() {
        return Err(CudaError::Shape(format!(
            "a quantized product of {} tokens takes normalized activations",
            x.rows
        )));
    }
    let mut guard = scratch.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = guard.current.as_mut().ok_or_else(|| {
        CudaError::Shape("a quantized product before its matrix's scratch was made".into())
    })?;
    match out {
        ProductOut::Bf16(o) => decoded_product(dev, scratch, x, w, bands, 0.0, o),
        ProductOut::AddTo(o) => decoded_product(dev, scratch, x, w, bands, 1.0, o),
        ProductOut::F32(o) => decoded_product(dev, scratch, x, w, bands, 0.0, o),
        ProductOut::RopeKv(_) => Err(CudaError::Shape(format!(
            "a QKV product's RoPE and KV write in its epilogue over {} tokens",
            x.rows
        ))),
    }
}

fn decoded_product<T: GemmOut>(
    dev: &CudaDevice,
    scratch: &mut CudaSlice<bf16>,
    x: &CudaTensor,
    w: &CudaMatrix,
    bands: &[BlockBand],
    beta: f32,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    let tile = tile_rows(w.cols);
    for band in bands {
        let rows = band.rows(w.cols);
        for start in (0..band.rows).step_by(tile) {
            let n = tile.min(band.rows - start);
            ops::quant::dequant(dev, &rows, start, n, scratch)?;
            let at = Band {
                offset: band.first_row + start,
                ld: w.rows,
                beta,
            };
            ops::linear::linear_band(dev, &x.data, scratch, x.rows, w.cols, n, at, out)?;
        }
    }
    Ok(())
}

/// `[gate; up]` times the normalized `x` (normalized here by `norm`, or by the caller where
/// [`CudaMatrix::takes_normalized_x`], or finished from a split norm's parts by `link`), then
/// SwiGLU, in one kernel per step of at most [`QGEMV_MAX_TOKENS`] tokens when the matrix is one
/// band (gate and up of one type); `false` when the caller must take the unfused path.
pub fn swiglu_product(
    dev: &CudaDevice,
    x: &CudaTensor,
    w: &CudaMatrix,
    (norm, link): (Option<GemvNorm>, NormLink),
    out: &mut CudaSlice<bf16>,
) -> Result<bool> {
    let MatrixStore::Blocks(bands) = &w.store else {
        return Ok(false);
    };
    let [band] = bands.as_slice() else {
        return Ok(false);
    };
    if x.rows == 0 || x.rows > QGEMV_MAX_TOKENS {
        return Ok(false);
    }
    let mut view = out.slice_mut(0..);
    let units = w.rows / 2;
    ops::quant::qgemv_linked(
        dev,
        (&x.data, x.rows),
        &band.rows(w.cols),
        (norm, link),
        QuantOut::SwiGlu(&mut view),
        units,
    )?;
    Ok(true)
}

/// Token embedding from a quantized table (one band) holding rows `first..` of a vocabulary of
/// `vocab` (all of it, or a tensor-parallel rank's part; see [`ops::quant::embed_part`]).
pub fn embed(
    dev: &CudaDevice,
    table: &CudaMatrix,
    ids: &cudarc::driver::CudaView<'_, u32>,
    n: usize,
    (first, vocab): (usize, usize),
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    match &table.store {
        MatrixStore::Blocks(bands) if bands.len() == 1 => {
            let rows = bands[0].rows(table.cols);
            ops::quant::embed_part(dev, &rows, ids, n, (first, vocab), out)
        }
        _ => Err(CudaError::Shape(
            "an embedding table of several block types".into(),
        )),
    }
}
