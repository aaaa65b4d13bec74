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
