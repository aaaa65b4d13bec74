//! NCCL between the GPUs of one tensor-parallel group: one communicator per rank, on the rank's
//! own stream, so a collective is ordered with the rank's kernels and is recorded into its CUDA
//! graphs like them. NCCL is loaded at run time, as the driver is: a machine without it runs
//! everything but tensor parallelism.

use crate::error::{check_group_alive, CudaError, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result, sys};
use half::bf16;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use turbo_core::comm::RankInfo;

/// Whether NCCL can be loaded (`libnccl.so` on the library path).
pub fn nccl_available() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

/// The communicators of one group, made together; aborted together when a rank fails, so that
/// no rank waits forever in a collective its peer will never join.
struct Group {
    comms: Vec<sys::ncclComm_t>,
    aborted: AtomicBool,
}

// SAFETY: NCCL communicators may be used from any thread; each rank issues its collectives from
// its own thread only, and ncclCommAbort is documented as callable from another thread.
unsafe impl Send for Group {}
unsafe impl Sync for Group {}

impl Group {
    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::AcqRel) {
            for &c in &self.comms {
                // SAFETY: each communicator is aborted once and never used after.
                let _ = unsafe { result::comm_abort(c) };
            }
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // Every rank's work has been read back or abandoned: nothing is in flight.
        self.abort();
    }
}

/// One rank's communicator.
pub(crate) struct NcclRank {
    group: Arc<Group>,
    stream: Arc<CudaStream>,
    info: RankInfo,
}

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
        let ordinals: Vec<i32> = streams
            .iter()
            .map(|s| s.context().ordinal() as i32)
            .collect();
        let mut comms = vec![std::ptr::null_mut(); world];
        // SAFETY: `comms` and `ordinals` hold `world` elements.
        unsafe { result::comm_init_all(comms.as_mut_ptr(), world as i32, ordinals.as_ptr()) }
            .map_err(|e| CudaError::NoDevice(format!("NCCL could not join the GPUs: {e:?}")))?;
        let group = Arc::new(Group {
            comms,
            aborted: AtomicBool::new(false),
        });
        Ok(streams
            .into_iter()
            .enumerate()
            .map(|(rank, stream)| NcclRank {
                group: group.clone(),
                stream,
                info: RankInfo { rank, world },
            })
            .collect())
    }

    pub(crate) fn info(&self) -> RankInfo {
        self.info
    }

    /// Sums the first `n` values of `x` over the group, in place, on the rank's stream.
    pub(crate) fn all_reduce_sum(&self, x: &mut CudaSlice<bf16>, n: usize) -> Result<()> {
        check_group_alive(&self.group.aborted)?;
        let mut view = x.slice_mut(0..n);
        let (ptr, _sync) = view.device_ptr_mut(&self.stream);
        // SAFETY: `ptr` holds `n` bf16 values on this rank's device, ordered on its stream.
        unsafe {
            result::all_reduce(
                ptr as *const _,
                ptr as *mut _,
                n,
                sys::ncclDataType_t::ncclBfloat16,
                sys::ncclRedOp_t::ncclSum,
                self.group.comms[self.info.rank],
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| CudaError::Shape(format!("NCCL all-reduce failed: {e:?}")))?;
        Ok(())
    }

    /// Replaces the first `n` words of `x` on every other rank by rank 0's, on the rank's stream.
    pub(crate) fn broadcast_from_first(&self, x: &mut CudaSlice<u32>, n: usize) -> Result<()> {
        check_group_alive(&self.group.aborted)?;
        let mut view = x.slice_mut(0..n);
        let (ptr, _sync) = view.device_ptr_mut(&self.stream);
        // SAFETY: `ptr` holds `n` words on this rank's device, ordered on its stream.
        unsafe {
            result::broadcast(
                ptr as *const _,
                ptr as *mut _,
                n,
                sys::ncclDataType_t::ncclUint32,
                0,
                self.group.comms[self.info.rank],
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| CudaError::Shape(format!("NCCL broadcast failed: {e:?}")))?;
        Ok(())
    }

    /// Every rank's first `n` values of `send`, in rank order, into `recv` (`world` x `n`), on
    /// the rank's stream.
    pub(crate) fn all_gather_f32(
        &self,
        send: &CudaSlice<f32>,
        recv: &mut CudaSlice<f32>,
        n: usize,
    ) -> Result<()> {
        check_group_alive(&self.group.aborted)?;
        if send.len() < n || recv.len() < n * self.info.world {
            return Err(CudaError::Shape(format!(
                "NCCL all-gather of {n} values from {} into {}",
                send.len(),
                recv.len()
            )));
        }
        let (src, _a) = send.device_ptr(&self.stream);
        let (dst, _b) = recv.device_ptr_mut(&self.stream);
        // SAFETY: `src` holds `n` f32 values and `dst` world x n on this rank's device, ordered
        // on its stream.
        unsafe {
            result::all_gather(
                src as *const _,
                dst as *mut _,
                n,
                sys::ncclDataType_t::ncclFloat32,
                self.group.comms[self.info.rank],
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| CudaError::Shape(format!("NCCL all-gather failed: {e:?}")))?;
        Ok(())
    }

    /// Aborts every communicator of the group (see [`Group`]).
    pub(crate) fn abort(&self) {
        self.group.abort();
    }
}
