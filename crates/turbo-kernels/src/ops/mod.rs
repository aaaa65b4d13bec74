//! Rust launchers for the kernels: each checks its shapes, then launches on the device's stream.

pub mod attention;
pub mod elementwise;
pub mod gemv;
pub mod linear;
pub mod merge;
pub mod norm;
pub mod sampling;
pub mod scores;

use crate::error::{CudaError, Result};

/// Fails with a shape error unless `ok`.
pub(crate) fn check(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape(what()))
    }
}
