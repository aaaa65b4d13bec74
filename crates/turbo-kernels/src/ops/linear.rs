//! `out = x · Wᵀ` through cuBLAS, bf16 in and out, f32 accumulation.

use super::check;
use crate::device::CudaDevice;
use crate::error::Result;
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{Gemm, GemmConfig};
use cudarc::driver::CudaSlice;
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
        beta: bf16::ZERO,
        ldc: m as i32,
    };
    // SAFETY: the dimensions and leading dimensions describe buffers whose sizes were checked.
    unsafe { dev.blas.gemm(cfg, w, x, out)? };
    Ok(())
}
