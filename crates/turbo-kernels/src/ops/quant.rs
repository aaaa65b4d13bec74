//! Products with GGUF-quantized weights kept on the device as the file's blocks
//! (`kernels/quant.cu`): decode-step products that decode the blocks in registers, the
//! decoding of rows to bf16 that feeds cuBLASLt for larger steps, and token embedding from a
//! quantized table.

use super::check;
use super::gemv::{GemvNorm, QkvRopeOut};
use crate::device::CudaDevice;
use crate::error::Result;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchArgs, LaunchConfig, PushKernelArg,
};
use half::bf16;
use turbo_core::DType;

/// The most tokens a decode-step product takes; larger steps decode the weights to bf16 first.
pub const QGEMV_MAX_TOKENS: usize = 8;
/// Bytes a quantized buffer holds past its last block: kernels read whole aligned words, which
/// can pass the end of a 2-byte aligned block by up to 4 bytes.
pub const PADDING_BYTES: usize = 16;
/// Warps per block of the decode-step products; each computes a few output units.
const WARPS: usize = 4;
/// Values of x a decode-step product stages in shared memory at a time, over all its tokens
/// (`kernels/quant.cu`'s `X_TILE_VALUES`).
const X_TILE_VALUES: usize = 16384;

/// Whether an `m`-token product's x, over rows of `cols` values, fits one tile: its blocks can
/// then stage x once and loop over groups of rows.
fn x_fits_one_tile(m: usize, cols: usize) -> bool {
    cols <= X_TILE_VALUES / m
}

/// Shared memory of an `m`-token decode-step product over rows of `cols` values: a tile of x in
/// f32 with one 16-byte word of padding per 8 (`x_tile_words` in the kernel).
fn x_tile_bytes(m: usize, cols: usize) -> usize {
    let stride = cols.min(X_TILE_VALUES / m);
    (m * stride / 4 + m * stride / 32 + 1) * 16
}

/// Whether a `tokens`-token product over `rows` rows of `cols` values of `dtype` blocks runs on
/// tensor cores (`qmma1_*`, `qmma_*`), which round the normalized x to bf16 where they apply a
/// norm. (Their blocks address rows by 32-bit offsets: a matrix of 4 GiB or more takes the
/// CUDA-core products.)
pub fn on_tensor_cores(
    dev: &CudaDevice,
    dtype: DType,
    (rows, cols): (usize, usize),
    tokens: usize,
) -> bool {
    let Some(mma1) = names(dtype).and_then(|n| n.mma1.as_ref()) else {
        return false;
    };
    let bytes = dtype.row_bytes(cols).and_then(|b| b.checked_mul(rows));
    if bytes.is_none_or(|b| b > u32::MAX as usize) {
        return false;
    }
    match tokens {
        1 => !mma1.few_blocks_only || few_mma1_blocks(dev, rows),
        _ => mma1.tokens.is_some() && tokens <= QGEMV_MAX_TOKENS,
    }
}

/// Tensor-core products of fewer blocks (16-row tiles, or 8 SwiGLU units) than this many per SM
/// count as few: they apply the norm themselves (more blocks would each repeat it), and Q6_K's
/// run on tensor cores only then. Measured on an H200 (8B shapes, Q4_K): QKV (384 blocks) 11.7
/// µs with the norm kernel launched first, 10.5 fused; gate/up (1,792) 28.8 and 29.2; the
/// 49,152-row LM head (3,072) 41.0 and 44.5.
const MMA1_FEW_BLOCKS_BELOW: usize = 4;

fn few_mma1_blocks(dev: &CudaDevice, rows: usize) -> bool {
    rows.div_ceil(16) < MMA1_FEW_BLOCKS_BELOW * dev.sm_count()
}

/// The widest rows whose tensor-core products apply the RMSNorm themselves (`MMA1_NORM_MAX_K` in
/// kernels/quant.cu: x is normalized into shared memory).
const MMA1_NORM_MAX_COLS: usize = 8192;

/// Whether a `tokens`-token product over `rows` rows of `cols` values of `dtype` blocks takes x
/// already normalized: it runs on tensor cores and does not apply a norm itself (steps of several
/// tokens, too many blocks, or rows wider than its shared memory holds), so a caller with a norm
/// normalizes x first ([`qgemv`] refuses a norm for it), and a SwiGLU product may then come
/// without one.
pub fn takes_normalized_x(
    dev: &CudaDevice,
    dtype: DType,
    (rows, cols): (usize, usize),
    tokens: usize,
) -> bool {
    on_tensor_cores(dev, dtype, (rows, cols), tokens)
        && (tokens > 1 || !mma1_fuses_norm(dev, rows, cols))
}

/// Whether a tensor-core product over `rows` rows of `cols` values applies a norm itself.
fn mma1_fuses_norm(dev: &CudaDevice, rows: usize, cols: usize) -> bool {
    cols <= MMA1_NORM_MAX_COLS && few_mma1_blocks(dev, rows)
}

/// Whether the GPU keeps weights of `dtype` as blocks and decodes them in its kernels.
pub fn supports(dtype: DType) -> bool {
    names(dtype).is_some()
}

/// Rows of a quantized matrix on the device: `rows` rows of `cols` values, each
/// `dtype.row_bytes(cols)` bytes of blocks, followed by [`PADDING_BYTES`].
pub struct QuantRows<'a> {
    pub dtype: DType,
    pub bytes: &'a CudaSlice<u8>,
    pub rows: usize,
    pub cols: usize,
}

impl QuantRows<'_> {
    /// The checks every kernel needs: a supported type, whole blocks, 16-byte aligned rows of
    /// activations, and the bytes (with padding) present.
    fn check(&self, what: &str) -> Result<(&'static KernelNames, usize)> {
        let names = names(self.dtype);
        let row_bytes = self.dtype.row_bytes(self.cols);
        let ok = names.is_some()
            && self.cols > 0
            && self.cols.is_multiple_of(32)
            && self.cols <= i32::MAX as usize
            && self.rows <= i32::MAX as usize
            && row_bytes.is_some_and(|n| {
                n.checked_mul(self.rows)
                    .and_then(|b| b.checked_add(PADDING_BYTES))
                    .is_some_and(|b| self.bytes.len() >= b)
            });
        check(ok, || {
            format!(
                "{what}: {} bytes for {}x{} {} (the GPU decodes {})",
                self.bytes.len(),
                self.rows,
                self.cols,
                self.dtype,
                SUPPORTED
            )
        })?;
        Ok((names.expect("checked"), row_bytes.expect("checked")))
    }
}

const SUPPORTED: &str = "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K";

/// What happens to each `(token, unit)` product of [`qgemv`]; outputs are `[tokens, ld]`, the
/// views starting at the first unit this call writes.
pub enum QuantOut<'a, 'b> {
    /// `out[t, j] = bf16(p)`.
    Bf16(&'a mut CudaViewMut<'b, bf16>),
    /// `out[t, j] = p` in f32 (logits).
    F32(&'a mut CudaViewMut<'b, f32>),
    /// `out[t, j] = bf16(out[t, j] + p)`: the residual stream, updated in place.
    AddTo(&'a mut CudaViewMut<'b, bf16>),
    /// The rows are a `[gate; up]` pair of `2 · units`: `out[t, j] = silu(gate) · up`.
    SwiGlu(&'a mut CudaViewMut<'b, bf16>),
}

/// An RMSNorm split between two one-token tensor-core products (`NormLink` in kernels/quant.cu),
/// so that it costs no launch of its own: the residual step that writes the stream x also writes
/// x · g and each block's Σx², and the next product multiplies x · g by the weights and scales its
/// sums by rsqrt(mean x² + eps). Its values differ from the unfused norm's by where the one bf16
/// rounding falls (x · g rounded, against x · rsqrt · g). Steps of several tokens keep the norm
/// kernel: their products with the link measured slower than the launch it saves (H200, 8B
/// shape, Q4_K_M: 2 sequences 1% and 8 sequences 2.4% fewer tokens a second).
#[derive(Default)]
pub enum NormLink<'a> {
    #[default]
    None,
    /// The residual step ([`QuantOut::AddTo`], `rows` a multiple of 16): also `scaled` = x · `weight`
    /// rounded to bf16 (`rows` values) and each 16 rows' Σx² of the stored stream, into `parts`
    /// (`rows / 16` values).
    Ahead {
        weight: &'a CudaSlice<bf16>,
        scaled: &'a mut CudaSlice<bf16>,
        parts: &'a mut CudaSlice<f32>,
    },
    /// A product whose x is an `Ahead` step's `scaled`: its sums are multiplied by
    /// rsqrt(Σ `parts` / cols + `eps`) before the output mode applies.
    Finish { parts: &'a CudaSlice<f32>, eps: f32 },
}

/// A [`NormLink`] as the kernels take it (a struct by value; zero pointers where unused).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct NormLinkArgs {
    parts_in: u64,
    g: u64,
    scaled: u64,
    parts_out: u64,
    eps: f32,
    _pad: u32,
}

// SAFETY: a plain C struct of the kernels' layout (four 8-byte pointers, a float, padding).
unsafe impl DeviceRepr for NormLinkArgs {}

impl NormLinkArgs {
    /// Whether the launch takes part in a split norm (its `link_` kernel).
    fn linked(&self) -> bool {
        self.parts_in != 0 || self.g != 0
    }

    /// The arguments of a one-token launch. The pointers' guards are dropped at once:
    /// the device's one stream orders every use.
    fn of(dev: &CudaDevice, link: &mut NormLink) -> Self {
        let stream = &dev.stream;
        match link {
            NormLink::None => Self::default(),
            NormLink::Ahead {
                weight,
                scaled,
                parts,
            } => {
                let g = weight.device_ptr(stream).0;
                let scaled = scaled.device_ptr_mut(stream).0;
                let parts_out = parts.device_ptr_mut(stream).0;
                Self {
                    g,
                    scaled,
                    parts_out,
                    ..Self::default()
                }
            }
            NormLink::Finish { parts, eps } => {
                let parts_in = parts.device_ptr(stream).0;
                Self {
                    parts_in,
                    eps: *eps,
                    ..Self::default()
                }
            }
        }
    }
}

/// Where a one-token QKV product puts its outputs instead of a qkv row, as the kernels take it
/// (`RopeKvOut` in kernels/quant.cu): the step after it ([`super::gemv::gemv_qkv_rope`]'s outputs,
/// a [`QkvRopeOut`] of one token) in the product's epilogue, for the band of its rows from `unit0`
/// on. It holds the borrows of the buffers it points into.
#[derive(Clone, Copy)]
pub struct RopeKvOut<'a> {
    args: RopeKvArgs,
    _borrows: std::marker::PhantomData<&'a mut CudaSlice<bf16>>,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RopeKvArgs {
    q: u64,
    k_cache: u64,
    v_cache: u64,
    positions: u64,
    slots: u64,
    inv_freq: u64,
    cache_slots: i64,
    q_cols: i32,
    kv_cols: i32,
    head_dim: i32,
    unit0: i32,
}

// SAFETY: a plain C struct of the kernels' layout (six pointers, an i64, four i32s).
unsafe impl DeviceRepr for RopeKvArgs {}

impl<'a> RopeKvOut<'a> {
    /// Checks `t`'s sizes for one token. The pointers' guards are dropped at once: the device's
    /// one stream orders every use.
    pub fn new(dev: &CudaDevice, t: QkvRopeOut<'a, '_>) -> Result<Self> {
        let (q_cols, kv_cols, head_dim) = t.widths;
        check(t.fits(1), || {
            format!(
                "a QKV product's RoPE and KV write: q {} / positions {} / slots {} / inv_freq {} \
                 elements for q_cols={q_cols} kv_cols={kv_cols} head_dim={head_dim}",
                t.q.len(),
                t.positions.len(),
                t.slots.len(),
                t.inv_freq.len()
            )
        })?;
        let stream = &dev.stream;
        let cache_slots = (t.k_cache.len().min(t.v_cache.len()) / kv_cols) as i64;
        let args = RopeKvArgs {
            q: t.q.device_ptr_mut(stream).0,
            k_cache: t.k_cache.device_ptr_mut(stream).0,
            v_cache: t.v_cache.device_ptr_mut(stream).0,
            positions: t.positions.device_ptr(stream).0,
            slots: t.slots.device_ptr(stream).0,
            inv_freq: t.inv_freq.device_ptr(stream).0,
            cache_slots,
            q_cols: q_cols as i32,
            kv_cols: kv_cols as i32,
            head_dim: head_dim as i32,
            unit0: 0,
        };
        Ok(RopeKvOut {
            args,
            _borrows: std::marker::PhantomData,
        })
    }

    /// The same outputs for a band of the QKV rows starting at row `unit0`.
    pub fn from_row(self, unit0: usize) -> Self {
        let mut out = self;
        out.args.unit0 = unit0 as i32;
        out
    }

    /// Rows of the QKV product: `q_cols + 2 · kv_cols`.
    fn rows(&self) -> usize {
        (self.args.q_cols + 2 * self.args.kv_cols) as usize
    }
}

/// `out ← x · wᵀ` for `x` `[tokens, cols]` (1 to [`QGEMV_MAX_TOKENS`] tokens) and quantized `w`,
/// f32 accumulation, with `norm` applied to `x` first when given (SwiGLU needs it, as
/// [`super::gemv::gemv`]). `ld` is the distance between tokens' rows of `out`.
pub fn qgemv(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    tokens: usize,
    w: &QuantRows,
    norm: Option<GemvNorm>,
    out: QuantOut,
    ld: usize,
) -> Result<()> {
    qgemv_linked(dev, (x, tokens), w, (norm, NormLink::None), out, ld)
}

/// Whether a `tokens`-token product over `w` can take part in a [`NormLink`]: one token, on
/// tensor cores, its rows (`Ahead`) and columns (`Finish`) whole groups of 16.
pub fn links_norm(
    dev: &CudaDevice,
    dtype: DType,
    (rows, cols): (usize, usize),
    tokens: usize,
) -> bool {
    tokens == 1
        && on_tensor_cores(dev, dtype, (rows, cols), tokens)
        && rows.is_multiple_of(16)
        && cols.is_multiple_of(16)
}

/// [`qgemv`] with its part in a split norm ([`NormLink`]; one-token tensor-core products only,
/// without `norm`).
pub fn qgemv_linked(
    dev: &CudaDevice,
    (x, tokens): (&CudaSlice<bf16>, usize),
    w: &QuantRows,
    (norm, mut link): (Option<GemvNorm>, NormLink),
    out: QuantOut,
    ld: usize,
) -> Result<()> {
    let (names, row_bytes) = w.check("qgemv")?;
    let swiglu = matches!(out, QuantOut::SwiGlu(_));
    // (K-quant rows are whole super-blocks of 256: `check` saw whole blocks.)
    let mma = on_tensor_cores(dev, w.dtype, (w.rows, w.cols), tokens);
    let norm_ok = !mma || (tokens == 1 && mma1_fuses_norm(dev, w.rows, w.cols));
    let units = if swiglu { w.rows / 2 } else { w.rows };
    let out_len = match &out {
        QuantOut::Bf16(o) | QuantOut::AddTo(o) | QuantOut::SwiGlu(o) => o.len(),
        QuantOut::F32(o) => o.len(),
    };
    check(
        (1..=QGEMV_MAX_TOKENS).contains(&tokens)
            && units > 0
            && ld >= units
            && ld <= i32::MAX as usize
            && (!swiglu || (w.rows.is_multiple_of(2) && (norm.is_some() || mma)))
            && (norm_ok || norm.is_none())
            && x.len() >= tokens * w.cols
            && out_len >= (tokens - 1) * ld + units
            && norm.as_ref().is_none_or(|n| n.weight.len() >= w.cols)
            && link_fits(
                &link,
                tokens,
                w,
                (mma, norm.is_some(), matches!(out, QuantOut::AddTo(_))),
            ),
        || {
            format!(
                "qgemv: x {} / out {out_len} elements for tokens={tokens} rows={} cols={} ld={ld} \
                 (1 to {QGEMV_MAX_TOKENS} tokens, SwiGLU with a norm{})",
                x.len(),
                w.rows,
                w.cols,
                match norm_ok {
                    false => format!("; this {} product takes normalized x", w.dtype),
                    true => String::new(),
                }
            )
        },
    )?;
    let kind = match (&norm, swiglu) {
        (None, _) => 0,
        (Some(_), false) => 1,
        (Some(_), true) => 2,
    };
    let mode: i32 = match out {
        QuantOut::F32(_) => 1,
        QuantOut::AddTo(_) => 2,
        QuantOut::Bf16(_) | QuantOut::SwiGlu(_) => 0,
    };
    let mut dst = match out {
        QuantOut::Bf16(o) | QuantOut::AddTo(o) | QuantOut::SwiGlu(o) => Dst::Bf16(o.slice_mut(..)),
        QuantOut::F32(o) => Dst::F32(o.slice_mut(..)),
    };
    if let (true, Some(mma1)) = (mma, names.mma1.as_ref()) {
        let shape = (units, swiglu);
        if let (false, Some(multi)) = (tokens == 1, mma1.tokens.as_ref()) {
            // Up to MMA_MAX_TOKENS tokens a launch.
            for first in (0..tokens).step_by(MMA_MAX_TOKENS) {
                let n = (tokens - first).min(MMA_MAX_TOKENS);
                mma_tokens_launch(
                    dev,
                    (names.module, multi),
                    (w, row_bytes),
                    (&x.slice(first * w.cols..), n),
                    shape,
                    (mode, dst.rows_from(first * ld), ld),
                )?;
            }
            return Ok(());
        }
        if tokens == 1 {
            let link = NormLinkArgs::of(dev, &mut link);
            return mma1_launch(
                dev,
                (names.module, mma1),
                (w, row_bytes),
                (x, norm),
                shape,
                Mma1Out::Store(mode, dst),
                link,
            );
        }
    }
    let product = Product {
        names,
        row_bytes,
        w,
        norm,
        kind,
        swiglu,
        units,
        ld,
        mode,
    };
    // Five to eight tokens whose x fits one tile at four tokens but not at eight: two products of
    // at most four tokens, whose blocks loop over their groups staging x once, rather than one
    // whose blocks each stage x tile by tile for their one group (on an H200, Q4_K gate/up of
    // 28672x4096 took 221.7 µs for 8 tokens in one launch and 71.1 µs for 4).
    let half = QGEMV_MAX_TOKENS / 2;
    if tokens > half && !x_fits_one_tile(QGEMV_MAX_TOKENS, w.cols) && x_fits_one_tile(half, w.cols)
    {
        product.launch(dev, &x.slice(..half * w.cols), half, dst.rows_from(0))?;
        return product.launch(
            dev,
            &x.slice(half * w.cols..),
            tokens - half,
            dst.rows_from(half * ld),
        );
    }
    product.launch(dev, &x.slice(..), tokens, dst.rows_from(0))
}

/// A one-token product over `x` (an `Ahead` step's x · g) finishing the split norm `link`, whose
/// rows are a band of a QKV product's: its outputs rotated and written as `rope` says, instead of
/// stored as a qkv row.
pub fn qgemv_rope_kv(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    w: &QuantRows,
    link: NormLink,
    rope: RopeKvOut,
) -> Result<()> {
    let (names, row_bytes) = w.check("qgemv_rope_kv")?;
    let mma1 = names
        .mma1
        .as_ref()
        .filter(|_| on_tensor_cores(dev, w.dtype, (w.rows, w.cols), 1));
    let band_end = (rope.args.unit0 as usize).checked_add(w.rows);
    check(
        mma1.is_some()
            && matches!(link, NormLink::Finish { .. })
            && link_fits(&link, 1, w, (true, false, false))
            && x.len() >= w.cols
            && band_end.is_some_and(|end| end <= rope.rows()),
        || {
            format!(
                "qgemv_rope_kv: a {} band of {} rows from row {} of {} QKV rows, x {} elements \
                 (one token on tensor cores, finishing a split norm)",
                w.dtype,
                w.rows,
                rope.args.unit0,
                rope.rows(),
                x.len()
            )
        },
    )?;
    let mut link = link;
    let link = NormLinkArgs::of(dev, &mut link);
    let mma1 = mma1.expect("checked");
    mma1_launch(
        dev,
        (names.module, mma1),
        (w, row_bytes),
        (x, None),
        (w.rows, false),
        Mma1Out::RopeKv(rope.args),
        link,
    )
}

/// Whether `link` suits a product of `tokens` tokens over `w` (`mma`: on tensor cores; `normed`:
/// with a norm of its own; `adds`: added into the stream), its buffers holding what the kernel
/// touches.
fn link_fits(
    link: &NormLink,
    tokens: usize,
    w: &QuantRows,
    (mma, normed, adds): (bool, bool, bool),
) -> bool {
    let one = tokens == 1 && mma && !normed;
    match link {
        NormLink::None => true,
        NormLink::Ahead {
            weight,
            scaled,
            parts,
        } => {
            one && adds
                && w.rows.is_multiple_of(16)
                && weight.len() >= w.rows
                && scaled.len() >= w.rows
                && parts.len() >= w.rows / 16
        }
        NormLink::Finish { parts, .. } => {
            one && w.cols.is_multiple_of(16) && parts.len() >= w.cols / 16
        }
    }
}

/// Where a [`qgemv`] launch writes: `[tokens, ld]` outputs in bf16 or f32.
enum Dst<'v> {
    Bf16(CudaViewMut<'v, bf16>),
    F32(CudaViewMut<'v, f32>),
}

impl<'v> Dst<'v> {
    /// Passes the outputs as a kernel's next argument.
    fn push<'a>(&'a mut self, b: &mut LaunchArgs<'a>) {
        match self {
            Dst::Bf16(o) => b.arg(o),
            Dst::F32(o) => b.arg(o),
        };
    }

    /// The outputs from element `start` on (a later token's row).
    fn rows_from(&mut self, start: usize) -> Dst<'_> {
        match self {
            Dst::Bf16(o) => Dst::Bf16(o.slice_mut(start..)),
            Dst::F32(o) => Dst::F32(o.slice_mut(start..)),
        }
    }
}

/// What every launch of one [`qgemv`] call shares.
struct Product<'a> {
    names: &'static KernelNames,
    row_bytes: usize,
    w: &'a QuantRows<'a>,
    norm: Option<GemvNorm<'a>>,
    /// 0 plain, 1 with RMSNorm, 2 with RMSNorm and SwiGLU (the kernels' families).
    kind: usize,
    swiglu: bool,
    units: usize,
    ld: usize,
    /// The kernels' output mode: 0 bf16, 1 f32, 2 added into bf16.
    mode: i32,
}

impl Product<'_> {
    /// The product of `tokens` rows of `x` (`[tokens, cols]`), written to `dst`; the caller
    /// checked the sizes.
    fn launch(
        &self,
        dev: &CudaDevice,
        x: &CudaView<'_, bf16>,
        tokens: usize,
        mut dst: Dst<'_>,
    ) -> Result<()> {
        let w = self.w;
        // The kernels for at most 1, 2, 4 and 8 tokens; a warp takes 4 output units (rows, or
        // SwiGLU's pairs of rows count 2) with at most 2 tokens, else 2 (kernels/quant.cu's
        // WarpUnits).
        let (variant, m, rows_per_warp) = match tokens {
            1 => (0, 1, 4),
            2 => (1, 2, 4),
            3..=4 => (2, 4, 2),
            _ => (3, 8, 2),
        };
        let units_per_warp = if self.swiglu {
            rows_per_warp / 2
        } else {
            rows_per_warp
        };
        let smem = x_tile_bytes(m, w.cols);
        let (f, blocks) = product_launch(
            dev,
            self.names,
            self.kind,
            variant,
            self.units.div_ceil(WARPS * units_per_warp),
            w.cols,
            smem,
        )?;
        let row_bytes_i = self.row_bytes as i64;
        let (tokens_i, units_i, k_i, ld_i) = (
            tokens as i32,
            self.units as i32,
            w.cols as i32,
            self.ld as i32,
        );
        let mut b = dev.stream.launch_builder(&f);
        b.arg(w.bytes);
        b.arg(&row_bytes_i);
        b.arg(x);
        match &self.norm {
            Some(n) => b.arg(n.weight),
            None => b.arg(x),
        };
        let eps = self.norm.as_ref().map_or(0.0, |n| n.eps);
        b.arg(&eps);
        dst.push(&mut b);
        b.arg(&tokens_i);
        b.arg(&units_i);
        b.arg(&k_i);
        b.arg(&ld_i);
        b.arg(&self.mode);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: the arguments match the kernel's signature; `qgemv` checked the sizes for all
        // its tokens (a call for later tokens starts x and the outputs at those tokens' rows),
        // the blocks' buffer holds its padding, and device allocations are 256-byte aligned and
        // cols % 32 == 0, so every 16-byte load of x (from a token's row) and g is aligned;
        // `smem` holds the kernel's tile of x.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

/// Where a one-token tensor-core launch ([`mma1_launch`]) puts its outputs.
enum Mma1Out<'v> {
    /// Stored to `Dst` in qgemv's output mode.
    Store(i32, Dst<'v>),
    /// A QKV band's, rotated and written to q and the KV cache (the `qmma1_link_rope_*` kernel).
    RopeKv(RopeKvArgs),
}

/// A one-token product on tensor cores (`qmma1_*`, from `(module, mma1)`), with `norm` applied to
/// x first when given: a block per 16 rows (8 SwiGLU units), `units` outputs, put where `out`
/// says.
fn mma1_launch(
    dev: &CudaDevice,
    (module, mma1): (&'static str, &Mma1Kernels),
    (w, row_bytes): (&QuantRows, usize),
    (x, norm): (&CudaSlice<bf16>, Option<GemvNorm>),
    (units, swiglu): (usize, bool),
    mut out: Mma1Out<'_>,
    link: NormLinkArgs,
) -> Result<()> {
    let blocks = units.div_ceil(if swiglu { 8 } else { 16 });
    let name = match (&out, norm.is_some(), link.linked()) {
        (Mma1Out::RopeKv(_), _, _) => mma1.rope,
        (_, _, true) => mma1.names[2][swiglu as usize],
        (_, normed, false) => mma1.names[normed as usize][swiglu as usize],
    };
    let f = dev.function(module, name)?;
    let (row_bytes_i, units_i, k_i) = (row_bytes as i64, units as i32, w.cols as i32);
    let eps = norm.as_ref().map_or(0.0, |n| n.eps);
    let (mode, rope) = match &out {
        Mma1Out::Store(mode, _) => (*mode, RopeKvArgs::default()),
        Mma1Out::RopeKv(args) => (0, *args),
    };
    let mut b = dev.stream.launch_builder(&f);
    b.arg(w.bytes);
    b.arg(&row_bytes_i);
    b.arg(x);
    // Without a norm the kernel never reads g: x stands in for it.
    match &norm {
        Some(n) => b.arg(n.weight),
        None => b.arg(x),
    };
    b.arg(&eps);
    match &mut out {
        Mma1Out::Store(_, dst) => dst.push(&mut b),
        // The outputs go where `rope` says: x stands in for `out`, which the kernel never reads.
        Mma1Out::RopeKv(_) => {
            b.arg(x);
        }
    }
    b.arg(&units_i);
    b.arg(&k_i);
    b.arg(&mode);
    b.arg(&link);
    b.arg(&rope);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (mma1.warps * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; the callers checked the sizes (one
    // token: x and the norm's weights hold `cols` values, at most MMA1_NORM_MAX_COLS with a norm;
    // the output `units`, or a QKV band within `rope`'s rows, so that every unit lands in q or a
    // cache row of `kv_cols`, or is skipped past the caches' slots), rows are whole super-blocks,
    // the buffer holds its padding, and device allocations keep x's and g's 16-byte loads aligned;
    // a link's buffers hold what `link_fits` checked, and a `RopeKvOut` holds its buffers' borrows.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Tokens of one tensor-core launch for steps of several tokens (`qmma_<type>_m<2|4|6|8>`).
const MMA_MAX_TOKENS: usize = 8;

/// The widths of the several-token tensor-core kernels, [`MmaTokens`]'s order.
const MMA_TOKEN_WIDTHS: [usize; 4] = [2, 4, 6, 8];

/// A step of `tokens` (2 to [`MMA_MAX_TOKENS`]) tokens on tensor cores (`qmma_*_m2` to `_m8`, the
/// narrowest that holds them; x normalized by the caller): `units` outputs a token, token t's at
/// `dst` + t · `ld`, in qgemv's output `mode`.
fn mma_tokens_launch(
    dev: &CudaDevice,
    (module, kernels): (&'static str, &MmaTokens),
    (w, row_bytes): (&QuantRows, usize),
    (x, tokens): (&CudaView<'_, bf16>, usize),
    (units, swiglu): (usize, bool),
    (mode, mut dst, ld): (i32, Dst<'_>, usize),
) -> Result<()> {
    let blocks = units.div_ceil(if swiglu { 8 } else { 16 });
    let width = MMA_TOKEN_WIDTHS
        .iter()
        .position(|&m| tokens <= m)
        .expect("at most MMA_MAX_TOKENS tokens");
    let smem = kernels.smem[width];
    let f = dev.function_with_smem(module, kernels.names[width][swiglu as usize], smem)?;
    let (row_bytes_i, tokens_i, units_i, k_i, ld_i) = (
        row_bytes as i64,
        tokens as i32,
        units as i32,
        w.cols as i32,
        ld as i32,
    );
    let mut b = dev.stream.launch_builder(&f);
    b.arg(w.bytes);
    b.arg(&row_bytes_i);
    b.arg(x);
    dst.push(&mut b);
    b.arg(&tokens_i);
    b.arg(&units_i);
    b.arg(&k_i);
    b.arg(&ld_i);
    b.arg(&mode);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (kernels.warps * 32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: the arguments match the kernel's signature; `qgemv` checked the sizes for all its
    // tokens (this launch's x and outputs start at its first token's rows, and it reads x only
    // for its `tokens`), rows are whole super-blocks, the buffer holds its padding, and device
    // allocations and cols % 256 == 0 keep x's 16-byte copies aligned.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// One-token products loop over groups of rows (`qgemv_loop_*`) from this many waves of groups.
/// Measured on an H200: the 128,256-row Q6_K LM head (~15 waves) 14% faster looping, products of
/// 1-5 waves 2-5% slower.
const LOOP_MIN_WAVES: usize = 8;

/// The decode-step product's kernel and blocks for `groups` groups of `WARPS` warps' units over
/// rows of `cols` values (`kernels/quant.cu`'s qgemv): a block per group; or, where x fits one
/// tile, for 2-8 tokens (their kernels loop) and for one token over many waves, only the blocks
/// resident at once, each staging x once for the groups it loops over.
fn product_launch(
    dev: &CudaDevice,
    names: &KernelNames,
    kind: usize,
    variant: usize,
    groups: usize,
    cols: usize,
    smem: usize,
) -> Result<(CudaFunction, usize)> {
    let f = dev.function_with_smem(names.module, names.gemv[kind][variant], smem)?;
    let m = 1 << variant;
    let resident = |f: &CudaFunction| -> Result<usize> {
        let per_sm =
            f.occupancy_max_active_blocks_per_multiprocessor((WARPS * 32) as u32, smem, None)?;
        Ok((per_sm as usize).max(1) * dev.sm_count())
    };
    if !x_fits_one_tile(m, cols) {
        return Ok((f, groups));
    }
    if m > 1 {
        let blocks = groups.min(resident(&f)?);
        return Ok((f, blocks));
    }
    // One token: the looping form only for many waves (the check on the group count alone first,
    // so that ordinary products make no occupancy query).
    match names.gemv_loop.get(kind) {
        Some(name) if groups >= LOOP_MIN_WAVES * dev.sm_count() => {
            let looping = dev.function_with_smem(names.module, name, smem)?;
            let blocks = resident(&looping)?;
            match groups >= LOOP_MIN_WAVES * blocks {
                true => Ok((looping, blocks)),
                false => Ok((f, groups)),
            }
        }
        _ => Ok((f, groups)),
    }
}

/// Rows `first_row .. first_row + rows` of `w` decoded to bf16 into `out` (`[rows, cols]`), each
/// value as GGML's reference dequantizer computes it in f32, rounded once.
pub fn dequant(
    dev: &CudaDevice,
    w: &QuantRows,
    first_row: usize,
    rows: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    let (names, row_bytes) = w.check("dequant")?;
    check(
        first_row.checked_add(rows).is_some_and(|end| end <= w.rows) && out.len() >= rows * w.cols,
        || {
            format!(
                "dequant: rows {first_row}+{rows} of {}, out {} elements for {} columns",
                w.rows,
                out.len(),
                w.cols
            )
        },
    )?;
    if rows == 0 {
        return Ok(());
    }
    let chunk = if w.dtype.block_len() == 256 { 64 } else { 32 };
    let threads = rows * (w.cols / chunk);
    let f = dev.function(names.module, names.dequant)?;
    let from = w.bytes.slice(first_row * row_bytes..);
    let (row_bytes_i, rows_i, k_i) = (row_bytes as i64, rows as i32, w.cols as i32);
    let mut b = dev.stream.launch_builder(&f);
    b.arg(&from);
    b.arg(&row_bytes_i);
    b.arg(&rows_i);
    b.arg(&k_i);
    b.arg(out);
    // SAFETY: the arguments match the kernel's signature; the rows lie inside the checked
    // buffer and `out` holds rows x cols values (16-byte aligned rows: cols % 32 == 0).
    let cfg = LaunchConfig {
        grid_dim: (threads.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `out[i] = table[ids[i]]` for `i < n`, decoded to bf16 as [`dequant`] decodes; an id past the
/// table gives a row of NaN.
pub fn embed(
    dev: &CudaDevice,
    table: &QuantRows,
    ids: &CudaView<'_, u32>,
    n: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    embed_part(dev, table, ids, n, (0, table.rows), out)
}

/// [`embed`] from the rows `first..` of a table of `vocab` rows split over the ranks of a
/// tensor-parallel group (`(first, vocab)`): ids of other rows give zeros, ids past `vocab` NaN.
pub fn embed_part(
    dev: &CudaDevice,
    table: &QuantRows,
    ids: &CudaView<'_, u32>,
    n: usize,
    (first, vocab): (usize, usize),
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    let (names, row_bytes) = table.check("embed")?;
    check(
        ids.len() >= n && n <= i32::MAX as usize && out.len() >= n * table.cols,
        || {
            format!(
                "embed: {} ids / out {} elements for n={n} cols={}",
                ids.len(),
                out.len(),
                table.cols
            )
        },
    )?;
    if n == 0 {
        return Ok(());
    }
    let f = dev.function(names.module, names.embed)?;
    let (row_bytes_i, rows_i, n_i, k_i) = (
        row_bytes as i64,
        table.rows as i64,
        n as i32,
        table.cols as i32,
    );
    let (first_i, vocab_i) = (first as i64, vocab as i64);
    let mut b = dev.stream.launch_builder(&f);
    b.arg(table.bytes);
    b.arg(&row_bytes_i);
    b.arg(&rows_i);
    b.arg(&first_i);
    b.arg(&vocab_i);
    b.arg(ids);
    b.arg(&n_i);
    b.arg(&k_i);
    b.arg(out);
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; sizes were checked and the kernel
    // bounds every id by the table's rows.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Loads the module of `dtype`'s kernels now (the driver compiles it at its first load), so a
/// first step does not pay for it, and no recorded step does.
pub fn load(dev: &CudaDevice, dtype: DType) -> Result<()> {
    if let Some(names) = names(dtype) {
        dev.function(names.module, names.dequant)?;
    }
    Ok(())
}

/// The kernels of one block type.
struct KernelNames {
    module: &'static str,
    /// `[plain, norm, norm + SwiGLU][1, 2, 4, 8 tokens]`.
    gemv: [[&'static str; 4]; 3],
    /// `[plain, norm]` one-token products that loop over groups of rows.
    gemv_loop: [&'static str; 2],
    dequant: &'static str,
    embed: &'static str,
    /// Products on tensor cores, for the types that have them.
    mma1: Option<Mma1Kernels>,
}

/// A type's tensor-core products (`qmma1_*` for one token and `qmma_*` for several, in
/// kernels/quant.cu).
struct Mma1Kernels {
    /// One token: `[without, with the norm, in a split norm][plain, SwiGLU]`.
    names: [[&'static str; 2]; 3],
    /// One token in a split norm, a QKV product's outputs rotated and written to the KV cache.
    rope: &'static str,
    /// Warps of a block (`QMMA1_<type>_WARPS`).
    warps: u32,
    /// Taken only for products of few blocks ([`MMA1_FEW_BLOCKS_BELOW`]): with more, the CUDA-core
    /// product is as fast.
    few_blocks_only: bool,
    /// Steps of 2 to [`MMA_MAX_TOKENS`] tokens (`qmma_*`), for the types that have them; taken
    /// whatever the number of blocks.
    tokens: Option<MmaTokens>,
}

/// A type's tensor-core kernels for steps of several tokens.
struct MmaTokens {
    /// `[2, 4, 6, 8 tokens][plain, SwiGLU]`.
    names: [[&'static str; 2]; 4],
    /// Warps a block (`QMMA_<type>_TOKENS_WARPS`).
    warps: u32,
    /// Dynamic shared memory of each width's launch: Q4_K's slots at eight tokens, past the 48
    /// KiB of static shared memory (`qmma1_q4k`: warps · 2 slots · (32 · 8 + 144) words of 16
    /// bytes).
    smem: [usize; 4],
}

macro_rules! kernel_names {
    ($module:literal, $t:literal) => {
        kernel_names!($module, $t, None)
    };
    ($module:literal, $t:literal, $mma1:expr) => {
        KernelNames {
            module: $module,
            gemv: [
                [
                    concat!("qgemv_", $t, "_m1"),
                    concat!("qgemv_", $t, "_m2"),
                    concat!("qgemv_", $t, "_m4"),
                    concat!("qgemv_", $t, "_m8"),
                ],
                [
                    concat!("qgemv_norm_", $t, "_m1"),
                    concat!("qgemv_norm_", $t, "_m2"),
                    concat!("qgemv_norm_", $t, "_m4"),
                    concat!("qgemv_norm_", $t, "_m8"),
                ],
                [
                    concat!("qgemv_norm_swiglu_", $t, "_m1"),
                    concat!("qgemv_norm_swiglu_", $t, "_m2"),
                    concat!("qgemv_norm_swiglu_", $t, "_m4"),
                    concat!("qgemv_norm_swiglu_", $t, "_m8"),
                ],
            ],
            gemv_loop: [
                concat!("qgemv_loop_", $t, "_m1"),
                concat!("qgemv_norm_loop_", $t, "_m1"),
            ],
            dequant: concat!("dequant_", $t),
            embed: concat!("embed_", $t),
            mma1: $mma1,
        }
    };
}

static Q4_0: KernelNames = kernel_names!("quant_q4_0", "Q4_0");
static Q4_1: KernelNames = kernel_names!("quant_q4_1", "Q4_1");
static Q5_0: KernelNames = kernel_names!("quant_q5_0", "Q5_0");
static Q5_1: KernelNames = kernel_names!("quant_q5_1", "Q5_1");
static Q8_0: KernelNames = kernel_names!("quant_q8_0", "Q8_0");
static Q4_K: KernelNames = kernel_names!(
    "quant_q4_k",
    "Q4_K",
    Some(Mma1Kernels {
        names: [
            ["qmma1_Q4_K", "qmma1_swiglu_Q4_K"],
            ["qmma1_norm_Q4_K", "qmma1_norm_swiglu_Q4_K"],
            ["qmma1_link_Q4_K", "qmma1_link_swiglu_Q4_K"],
        ],
        rope: "qmma1_link_rope_Q4_K",
        warps: 4,
        few_blocks_only: false,
        tokens: Some(MmaTokens {
            names: [
                ["qmma_Q4_K_m2", "qmma_swiglu_Q4_K_m2"],
                ["qmma_Q4_K_m4", "qmma_swiglu_Q4_K_m4"],
                ["qmma_Q4_K_m6", "qmma_swiglu_Q4_K_m6"],
                ["qmma_Q4_K_m8", "qmma_swiglu_Q4_K_m8"],
            ],
            warps: 4,
            smem: [0, 0, 0, 4 * 2 * (32 * 8 + 144) * 16],
        }),
    })
);
static Q5_K: KernelNames = kernel_names!("quant_q5_k", "Q5_K");
static Q6_K: KernelNames = kernel_names!(
    "quant_q6_k",
    "Q6_K",
    Some(Mma1Kernels {
        names: [
            ["qmma1_Q6_K", "qmma1_swiglu_Q6_K"],
            ["qmma1_norm_Q6_K", "qmma1_norm_swiglu_Q6_K"],
            ["qmma1_link_Q6_K", "qmma1_link_swiglu_Q6_K"],
        ],
        rope: "qmma1_link_rope_Q6_K",
        warps: 8,
        few_blocks_only: true,
        tokens: Some(MmaTokens {
            names: [
                ["qmma_Q6_K_m2", "qmma_swiglu_Q6_K_m2"],
                ["qmma_Q6_K_m4", "qmma_swiglu_Q6_K_m4"],
                ["qmma_Q6_K_m6", "qmma_swiglu_Q6_K_m6"],
                ["qmma_Q6_K_m8", "qmma_swiglu_Q6_K_m8"],
            ],
            warps: 4,
            smem: [0; 4],
        }),
    })
);

fn names(dtype: DType) -> Option<&'static KernelNames> {
    Some(match dtype {
        DType::Q4_0 => &Q4_0,
        DType::Q4_1 => &Q4_1,
        DType::Q5_0 => &Q5_0,
        DType::Q5_1 => &Q5_1,
        DType::Q8_0 => &Q8_0,
        DType::Q4_K => &Q4_K,
        DType::Q5_K => &Q5_K,
        DType::Q6_K => &Q6_K,
        _ => return None,
    })
}
