//! NCCL between the GPUs of one tensor-parallel group: one communicator per rank, on the rank's
//! own stream, so a collective is ordered with the rank's kernels and is recorded into its CUDA
//! graphs like them. NCCL is loaded at run time, as the driver is: a machine without it runs
//! everything but tensor parallelism.

use crate::error::{CudaError, Result};
use cudarc::driver::CudaStream;
use cudarc::nccl::safe::{Comm, ReduceOp};
use half::bf16;
use std::sync::{Arc, Mutex};
use turbo_core::comm::RankInfo;

/// Whether NCCL can be loaded (`libnccl.so` on the library path).
pub fn nccl_available() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// One rank's communicator.
pub(crate) struct NcclRank {
    comm: Mutex<Comm>,
    info: RankInfo,
}

// SAFETY: a communicator may be used from any thread, one call at a time (the mutex); its stream
// is the rank's, which cudarc lets any thread use.
unsafe impl Send for NcclRank {}
unsafe impl Sync for NcclRank {}

impl NcclRank {
    /// The communicators of a group over `streams` (one per GPU, rank order), made together in
    /// this thread.
    pub(crate) fn group(streams: Vec<Arc<CudaStream>>) -> Result<Vec<NcclRank>> {
        if !nccl_available() {
            return Err(CudaError::NoDevice(
                "tensor parallelism on GPUs needs NCCL, and libnccl.so was not found on the \
                 library path (LD_LIBRARY_PATH)"
                    .into(),
            ));
        }
        let world = streams.len();
        let comms = Comm::from_devices(streams)
            .map_err(|e| CudaError::NoDevice(format!("NCCL could not join the GPUs: {e:?}")))?;
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| NcclRank {
                comm: Mutex::new(comm),
                info: RankInfo { rank, world },
            })
            .collect())
    }

    pub(crate) fn info(&self) -> RankInfo {
        self.info
    }

    /// Sums the first `n` values of `x` over the group, in place, on the rank's stream.
    pub(crate) fn all_reduce_sum(
        &self,
        x: &mut cudarc::driver::CudaSlice<bf16>,
        n: usize,
    ) -> Result<()> {
        let comm = self
            .comm
            .lock()
            .map_err(|_| CudaError::Shape("a collective panicked".into()))?;
        let mut view = x.slice_mut(0..n);
        comm.all_reduce_in_place(&mut view, &ReduceOp::Sum)
            .map_err(|e| CudaError::Shape(format!("NCCL all-reduce failed: {e:?}")))?;
        Ok(())
    }
}
