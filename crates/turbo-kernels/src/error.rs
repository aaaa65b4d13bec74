use thiserror::Error;

#[derive(Debug, Error)]
pub enum CudaError {
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("cuBLASLt: {0}")]
    BlasLt(String),
    #[error("kernel module '{module}' could not be loaded: {reason}")]
    Module { module: String, reason: String },
    #[error("{0}")]
    Shape(String),
}

impl From<CudaError> for turbo_core::BackendError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Driver(d)
                if d.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY =>
            {
                turbo_core::BackendError::OutOfMemory(d.to_string())
            }
            other => turbo_core::BackendError::Device(other.to_string()),
        }
    }
}

pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// Refuses a collective of a tensor-parallel group that was aborted (a rank failed): NCCL's
/// and the peer path's groups both keep such a flag.
pub(crate) fn check_group_alive(aborted: &std::sync::atomic::AtomicBool) -> Result<()> {
    match aborted.load(std::sync::atomic::Ordering::Acquire) {
        true => Err(CudaError::Shape(
            "another rank of the tensor-parallel group failed".into(),
        )),
        false => Ok(()),
    }
}
