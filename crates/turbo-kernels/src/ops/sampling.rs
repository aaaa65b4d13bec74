//! Greedy sampling: the argmax of each row of logits.

use super::check;
use crate::device::CudaDevice;
use crate::error::Result;
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use half::bf16;

/// Threads per block of the argmax kernels (one block per row).
const THREADS: u32 = 1024;

fn launch<T: DeviceRepr>(
    dev: &CudaDevice,
    kernel: &'static str,
    logits: &CudaSlice<T>,
    rows: usize,
    cols: usize,
) -> Result<Vec<u32>> {
    check(
        cols > 0
            && rows <= i32::MAX as usize
            && cols <= i32::MAX as usize
            && logits.len() >= rows * cols,
        || {
            format!(
                "{kernel}: logits {} elements for rows={rows} cols={cols}",
                logits.len()
            )
        },
    )?;
    if rows == 0 {
        return Ok(Vec::new());
    }
    let mut out = dev.stream.alloc_zeros::<u32>(rows)?;
    let (rows_i, cols_i) = (rows as i32, cols as i32);
    let f = dev.function("sampling", kernel)?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(logits);
    b.arg(&rows_i);
    b.arg(&cols_i);
    b.arg(&mut out);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature and the buffer sizes were checked.
    unsafe { b.launch(cfg) }?;
    Ok(dev.stream.clone_dtoh(&out)?)
}

/// For each row of `logits` (`[rows, cols]`, `cols >= 1`), the index of its largest value, the lowest
/// such index on ties; NaN counts as -inf.
pub fn argmax(
    dev: &CudaDevice,
    logits: &CudaSlice<bf16>,
    rows: usize,
    cols: usize,
) -> Result<Vec<u32>> {
    launch(dev, "argmax_bf16", logits, rows, cols)
}

/// [`argmax`] of f32 logits.
pub fn argmax_f32(
    dev: &CudaDevice,
    logits: &CudaSlice<f32>,
    rows: usize,
    cols: usize,
) -> Result<Vec<u32>> {
    launch(dev, "argmax_f32", logits, rows, cols)
}
