//! `out = x · Wᵀ` through cuBLASLt, bf16 in, f32 accumulation, bf16 or f32 out.
//!
//! cuBLASLt is column-major: row-major `out[n, m]` is column-major `outᵀ[m, n] = W · xᵀ`, where W
//! (column-major `[k, m]`) is used transposed and x (column-major `[k, n]`) as is.

use super::check;
use crate::device::{CudaDevice, BLAS_WORKSPACE_BYTES};
use crate::error::Result;
use crate::lt::Shape;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use half::bf16;

/// `x` is `[n, k]` row-major, `w` is `[m, k]` row-major (an nn.Linear weight), `out` is `[n, m]`.
pub fn linear(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    n: usize,
    k: usize,
    m: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    gemm(dev, x, w, n, k, m, 0.0, out)
}

/// How many algorithms cuBLASLt's heuristic offers for the bf16 product of `n` rows of `k` by a
/// `[m, k]` weight: for benchmarks comparing them with [`linear_with_candidate`].
pub fn candidates(dev: &CudaDevice, n: usize, k: usize, m: usize) -> Result<usize> {
    dev.blas
        .candidates(Shape::new(n, k, m, false), BLAS_WORKSPACE_BYTES)
}

/// [`linear`] with the heuristic's `candidate`-th algorithm (0: the one [`linear`] uses).
#[allow(clippy::too_many_arguments)]
pub fn linear_with_candidate(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    n: usize,
    k: usize,
    m: usize,
    candidate: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    gemm_with(dev, x, w, (n, k, m), candidate, Band::whole(m, 0.0), out)
}

/// [`linear`] added to `out`: `out += x · Wᵀ` (the residual step; cuBLASLt may round the product
/// to bf16 before the add, as an unfused product then add would).
pub fn linear_add(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    n: usize,
    k: usize,
    m: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    gemm(dev, x, w, n, k, m, 1.0, out)
}

/// [`linear`] with an f32 `out` (bf16 operands, f32 accumulation): for logits, which sampling
/// penalizes and compares in f32 as the CPU does, without a bf16 rounding first.
pub fn linear_f32_out(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    n: usize,
    k: usize,
    m: usize,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    gemm(dev, x, w, n, k, m, 0.0, out)
}

/// Where [`linear_band`] writes: the output's first element written (a column offset), the
/// distance between its rows, and what it adds (`out = beta · out + product`).
#[derive(Clone, Copy, Debug)]
pub struct Band {
    pub offset: usize,
    pub ld: usize,
    pub beta: f32,
}

impl Band {
    /// The whole output of an `m`-row weight: columns `0 .. m` of rows `m` apart.
    pub fn whole(m: usize, beta: f32) -> Self {
        Band {
            offset: 0,
            ld: m,
            beta,
        }
    }
}

/// `x · wᵀ` for `x` `[n, k]` and `w` `[m, k]` into columns `offset .. offset + m` of an output
/// whose rows are `ld` apart (`out[i · ld + offset + j]`): products of a matrix's bands of rows,
/// as quantized matrices decode them a band at a time.
#[allow(clippy::too_many_arguments)]
pub fn linear_band<T: GemmOut>(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    n: usize,
    k: usize,
    m: usize,
    band: Band,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    gemm_with(dev, x, w, (n, k, m), 0, band, out)
}

/// Output element types of the products: bf16, or f32 for logits.
pub trait GemmOut: DeviceRepr {
    const F32: bool;
}
impl GemmOut for bf16 {
    const F32: bool = false;
}
impl GemmOut for f32 {
    const F32: bool = true;
}

#[allow(clippy::too_many_arguments)]
fn gemm<T: GemmOut>(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    n: usize,
    k: usize,
    m: usize,
    beta: f32,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    gemm_with(dev, x, w, (n, k, m), 0, Band::whole(m, beta), out)
}

fn gemm_with<T: GemmOut>(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    (n, k, m): (usize, usize, usize),
    candidate: usize,
    band: Band,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    // The last element written: row n - 1's band.
    let end = n.checked_sub(1).map_or(Some(0), |last| {
        last.checked_mul(band.ld)
            .and_then(|v| v.checked_add(band.offset.checked_add(m)?))
    });
    check(
        x.len() >= n * k
            && w.len() >= m * k
            && band.ld >= m
            && end.is_some_and(|e| out.len() >= e)
            && n.max(k).max(band.ld) <= i32::MAX as usize,
        || {
            format!(
                "linear: x {} / w {} / out {} elements for n={n} k={k} m={m} {band:?}",
                x.len(),
                w.len(),
                out.len()
            )
        },
    )?;
    if n == 0 || m == 0 {
        return Ok(());
    }
    let shape = Shape::new(n, k, m, T::F32).with_ld_out(band.ld);
    let (w_ptr, _w_sync) = w.device_ptr(&dev.stream);
    let (x_ptr, _x_sync) = x.device_ptr(&dev.stream);
    let (out_ptr, _out_sync) = out.device_ptr_mut(&dev.stream);
    let out_ptr = out_ptr + (band.offset * std::mem::size_of::<T>()) as u64;
    let (ws_ptr, _ws_sync) = dev.blas_workspace.device_ptr(&dev.stream);
    // SAFETY: column-major outᵀ[m, n] (columns ld apart, from the band's offset) = Wᵀ[m, k] ·
    // xᵀ[k, n] over buffers whose sizes were checked above (the band's last element lies inside
    // `out`), of the shape's types; the pointers' guards are held until the call returns and the
    // buffers outlive the stream's use of them (the caller's borrows); the workspace is the
    // device's, used only by products, which the one stream orders.
    unsafe {
        dev.blas.matmul_with(
            shape,
            candidate,
            w_ptr,
            x_ptr,
            out_ptr,
            band.beta,
            ws_ptr,
            BLAS_WORKSPACE_BYTES,
            dev.stream.cu_stream(),
        )
    }
}
