//! `out = x · Wᵀ` through cuBLAS, bf16 in and out, f32 accumulation.

use super::check;
use crate::device::CudaDevice;
use crate::error::Result;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::{Gemm, GemmConfig};
use cudarc::driver::CudaSlice;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

/// `x` is `[n, k]` row-major, `w` is `[m, k]` row-major (an nn.Linear weight), `out` is `[n, m]`.
///
/// cuBLAS is column-major: row-major `out[n, m]` is column-major `outᵀ[m, n] = W · xᵀ`, where W
/// (column-major `[k, m]`) is used transposed and x (column-major `[k, n]`) as is.
pub fn linear(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    n: usize,
    k: usize,
    m: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    gemm_bf16(dev, x, w, n, k, m, false, out)
}

/// [`linear`] added to `out`: `out += x · Wᵀ`, rounded to bf16 once (the residual step).
pub fn linear_add(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    n: usize,
    k: usize,
    m: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    gemm_bf16(dev, x, w, n, k, m, true, out)
}

#[allow(clippy::too_many_arguments)]
fn gemm_bf16(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    n: usize,
    k: usize,
    m: usize,
    accumulate: bool,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    check(
        x.len() >= n * k && w.len() >= m * k && out.len() >= n * m,
        || {
            format!(
                "linear: x {} / w {} / out {} elements for n={n} k={k} m={m}",
                x.len(),
                w.len(),
                out.len()
            )
        },
    )?;
    if n == 0 {
        return Ok(());
    }
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: m as i32,
        n: n as i32,
        k: k as i32,
        alpha: bf16::ONE,
        lda: k as i32,
        ldb: k as i32,
        beta: if accumulate { bf16::ONE } else { bf16::ZERO },
        ldc: m as i32,
    };
    // SAFETY: the dimensions and leading dimensions describe buffers whose sizes were checked.
    unsafe { dev.blas.gemm(cfg, w, x, out)? };
    Ok(())
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
    check(
        x.len() >= n * k
            && w.len() >= m * k
            && out.len() >= n * m
            && n.max(k).max(m) <= i32::MAX as usize,
        || {
            format!(
                "linear_f32_out: x {} / w {} / out {} elements for n={n} k={k} m={m}",
                x.len(),
                w.len(),
                out.len()
            )
        },
    )?;
    if n == 0 {
        return Ok(());
    }
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (w_ptr, _w_sync) = w.device_ptr(&dev.stream);
    let (x_ptr, _x_sync) = x.device_ptr(&dev.stream);
    let (out_ptr, _out_sync) = out.device_ptr_mut(&dev.stream);
    // SAFETY: as in `linear`: column-major outᵀ[m, n] = Wᵀ[m, k] · xᵀ[k, n] over buffers whose
    // sizes were checked; the pointers outlive the call (their guards are held above).
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *dev.blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            m as i32,
            n as i32,
            k as i32,
            (&alpha) as *const f32 as *const _,
            w_ptr as *const _,
            cudaDataType::CUDA_R_16BF,
            k as i32,
            x_ptr as *const _,
            cudaDataType::CUDA_R_16BF,
            k as i32,
            (&beta) as *const f32 as *const _,
            out_ptr as *mut _,
            cudaDataType::CUDA_R_32F,
            m as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )?;
    }
    Ok(())
}
