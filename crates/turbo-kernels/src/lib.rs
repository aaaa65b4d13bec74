//! The CUDA backend.
//!
//! Kernels are CUDA C++ in `kernels/*.cu`, compiled to PTX by `cargo xtask kernels` and embedded
//! here; cuBLASLt does the matrix products. The CUDA driver is loaded at run time (cudarc's dynamic
//! loading), so this crate builds and its CPU-side tests run on machines without CUDA, and GPU
//! tests skip there with a message.

pub mod backend;
pub mod device;
mod error;
mod kv;
mod lt;
pub mod matrix;
mod nccl;
pub mod ops;
mod p2p;
pub mod ptx;

pub use backend::{CudaBackend, CudaKvCache, CudaMatrix, CudaTensor, GraphStats};
pub use device::{cuda_available, device_count, CudaDevice};
pub use error::{CudaError, Result};
pub use nccl::nccl_available;
pub use p2p::{PeerAllReduceKernel, FLAGGED_MAX_ELEMS, PEER_MAX_BLOCKS};
