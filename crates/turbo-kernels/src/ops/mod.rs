//! Rust launchers for the kernels: each checks its shapes, then launches on the device's stream.

pub mod attention;
pub mod elementwise;
pub mod gemv;
pub mod linear;
pub mod merge;
pub mod norm;
pub mod quant;
pub mod sampling;
pub mod scores;

use crate::error::{CudaError, Result};
use cudarc::driver::CudaSlice;

/// Fails with a shape error unless `ok`.
pub(crate) fn check(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape(what()))
    }
}

/// `old` if it holds at least `len` elements, else a new buffer of a power-of-two length (so that a
/// growing need reallocates rarely); true when new.
pub(crate) fn reuse_or_alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    dev: &crate::device::CudaDevice,
    old: Option<CudaSlice<T>>,
    len: usize,
) -> Result<(CudaSlice<T>, bool)> {
    match old {
        Some(buf) if buf.len() >= len => Ok((buf, false)),
        _ => Ok((
            dev.stream
                .alloc_zeros::<T>(len.max(1).next_power_of_two())?,
            true,
        )),
    }
}
