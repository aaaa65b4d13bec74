//! RMSNorm.

use super::check;
use crate::device::CudaDevice;
use crate::error::Result;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

/// Threads per block of `rms_norm_bf16` (one block per row).
const THREADS: u32 = 256;

/// `out[r] = x[r] · rsqrt(mean(x[r]²) + eps) · w` for each row `r` of `x` (`[rows, cols]`), in f32,
/// rounded to bf16 once.
pub fn rms_norm(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    rows: usize,
    cols: usize,
    eps: f32,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    check(
        cols > 0
            && rows <= i32::MAX as usize
            && cols <= i32::MAX as usize
            && x.len() >= rows * cols
            && w.len() >= cols
            && out.len() >= rows * cols,
        || {
            format!(
                "rms_norm: x {} / w {} / out {} elements for rows={rows} cols={cols}",
                x.len(),
                w.len(),
                out.len()
            )
        },
    )?;
    if rows == 0 {
        return Ok(());
    }
    let (rows_i, cols_i) = (rows as i32, cols as i32);
    let f = dev.function("norm", "rms_norm_bf16")?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(out);
    b.arg(x);
    b.arg(w);
    b.arg(&rows_i);
    b.arg(&cols_i);
    b.arg(&eps);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature and the buffer sizes were checked.
    unsafe { b.launch(cfg) }?;
    Ok(())
}
