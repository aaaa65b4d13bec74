//! All-reduce between the GPUs of one tensor-parallel group through peer-mapped memory
//! (`kernels/comm.cu`): each rank copies its part into a staging buffer of its own, the ranks
//! meet at a barrier of flags written across the link, and each sums every rank's part in rank
//! order. One kernel and no host involvement, so a decode step's 2 x layers all-reduces cost a
//! few microseconds each instead of a NCCL launch, and the steps that hold them can be recorded
//! into CUDA graphs. Messages larger than a staging half go to NCCL.
//!
//! Small messages (a decode step of a few rows) take a second kernel ([`PeerAllReduceKernel`]):
//! each rank stores its part straight into its peers' inboxes as lines flagged with the call's
//! epoch, so the sums wait only for the link's one-way latency, not for a barrier followed by
//! remote reads.

use crate::device::CudaDevice;
use crate::error::{check_group_alive, CudaError, Result};
use crate::ops::gemv::GemvGroup;
use cudarc::driver::{
    sys, CudaContext, CudaSlice, CudaStream, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use half::bf16;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use std::sync::Arc;
use turbo_core::comm::vocab_part;

/// [`PeerAllReduceKernel`] by the index the group stores.
const KERNELS: [PeerAllReduceKernel; 3] = [
    PeerAllReduceKernel::Auto,
    PeerAllReduceKernel::Flagged,
    PeerAllReduceKernel::Pulled,
];

/// Ranks and blocks the kernel's signal layout has room for (`COMM_MAX_RANKS`,
/// `COMM_MAX_BLOCKS` in `kernels/common.cuh`).
const MAX_RANKS: usize = 8;
pub const PEER_MAX_BLOCKS: usize = 256;
const MAX_BLOCKS: usize = PEER_MAX_BLOCKS;
const THREADS: u32 = 512;

/// bf16 values in each half of a rank's staging buffer: 8 MiB, which holds a decode step of
/// [`crate::backend::MAX_GRAPH_ROWS`] rows for residual streams up to 16,384 wide, so every
/// recorded step's all-reduces take this path.
pub(crate) const STAGING_HALF_ELEMS: usize = 4 << 20;

/// bf16 values a sender's slot of the flagged inbox holds (4 a 16-byte line, beside two flags):
/// a decode step of 64 rows of a 8,192-wide residual stream, or 128 of a 4,096-wide one.
pub const FLAGGED_MAX_ELEMS: usize = 1 << 19;

/// Messages up to this many values take the flagged kernel under [`PeerAllReduceKernel::Auto`]
/// (the crossover measured on 2 H200s, docs/perf/tensor-parallel.md).
const FLAGGED_AUTO_ELEMS: usize = 1 << 15;

/// bf16 values one 16-byte flagged line carries beside its two flags (`comm_push_line`).
const FLAGGED_LINE_ELEMS: usize = 4;

/// Which kernel a peer all-reduce takes; every one gives the same bits (rank-order f32 sums).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerAllReduceKernel {
    /// Flagged lines up to the size where latency rules, pulled parts above; and a decode
    /// step's row-parallel products fused with their all-reduces where the product is a
    /// matrix-vector kernel (`gemv_all_reduce`).
    Auto,
    /// Parts pushed as lines flagged with the call's epoch (messages up to
    /// [`FLAGGED_MAX_ELEMS`]; larger ones are pulled), always in a kernel of their own.
    Flagged,
    /// Parts staged in each rank's own memory; a barrier, then every rank reads its peers'.
    Pulled,
}

/// The arguments that end every `kernels/comm.cu` kernel's signature but the table and the abort
/// flag, which the group holds: the caller's rank, the group's size, the staging room.
struct CallTail {
    rank: i32,
    world: i32,
    room: i64,
}

/// Pinned host memory every rank's kernels can read: the abort flag.
struct HostFlag {
    host: *mut i32,
    device: u64,
    /// The context it was allocated in, bound again to free it.
    ctx: Arc<CudaContext>,
}

impl Drop for HostFlag {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `HostFlag::new`, freed once.
        unsafe {
            if self.ctx.bind_to_thread().is_ok() {
                let _ = sys::cuMemFreeHost(self.host.cast());
            }
        }
    }
}

impl HostFlag {
    /// A zeroed flag, mapped into every context (portable).
    fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        ctx.bind_to_thread()?;
        let mut host = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: allocates 4 bytes of pinned memory and asks its device address (unified
        // addressing: the same in every context).
        unsafe {
            sys::cuMemHostAlloc(&mut host, 4, flags).result()?;
            let host = host.cast::<i32>();
            host.write_volatile(0);
            let mut device = 0;
            let mapped = sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0).result();
            let flag = HostFlag {
                host,
                device,
                ctx: ctx.clone(),
            };
            mapped?;
            Ok(flag)
        }
    }

    fn raise(&self) {
        // SAFETY: the allocation lives as long as `self`; kernels only read it.
        unsafe { self.host.write_volatile(1) };
    }
}

/// Device memory that other GPUs of the group read and write. Allocated by `cuMemAlloc`:
/// cudarc's buffers come from the stream-ordered pool, which peer access does not cover.
struct SharedBuffer {
    ptr: sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
}

impl SharedBuffer {
    /// `bytes` of zeroed memory on `ctx`'s device.
    fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread()?;
        let mut ptr = 0;
        // SAFETY: allocates and clears `bytes` in the bound context; freed in `drop`.
        unsafe {
            sys::cuMemAlloc_v2(&mut ptr, bytes).result()?;
            let buffer = SharedBuffer {
                ptr,
                ctx: ctx.clone(),
            };
            sys::cuMemsetD8_v2(ptr, 0, bytes).result()?;
            Ok(buffer)
        }
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemAlloc in `zeroed`, freed once, after every rank's stream
            // was drained (see `Group`'s drop).
            unsafe {
                let _ = sys::cuMemFree_v2(self.ptr);
            }
        }
    }
}

/// The buffers of one group, made together and kept until the last rank is dropped.
struct Group {
    staging: Vec<SharedBuffer>,
    signals: Vec<SharedBuffer>,
    inboxes: Vec<SharedBuffer>,
    streams: Vec<Arc<CudaStream>>,
    tables: Vec<CudaSlice<u64>>,
    abort: HostFlag,
    aborted: AtomicBool,
    /// Whether the group's all-reduces take this path (see [`PeerRank::set_enabled`]).
    enabled: AtomicBool,
    /// The kernel all-reduces take ([`PeerAllReduceKernel`] as its index).
    kernel: AtomicUsize,
    /// Most blocks a launch takes (the same on every rank; see `kernels/comm.cu`).
    blocks: AtomicU32,
    /// Fewest SMs of the group's GPUs.
    sms: usize,
    /// Whether the group's GPUs are alike (SMs, compute capability): only then is every rank
    /// sure to make the same choice where a choice rests on the device (a fused kernel's
    /// occupancy), which a mismatch would turn into a hang.
    alike: bool,
    /// Products launched fused with their all-reduce, over every rank.
    fused: AtomicU64,
}

// SAFETY: the host flag is written with volatile stores and only read by kernels; the device
// buffers are used by their own rank's thread only (and read by peers' kernels).
unsafe impl Send for Group {}
unsafe impl Sync for Group {}

/// One rank's end of a peer-memory group.
pub(crate) struct PeerRank {
    group: Arc<Group>,
    rank: usize,
}

impl PeerRank {
    /// The group over `devices` (rank order), or `None` when some pair of them cannot map each
    /// other's memory (then NCCL does every collective) or the group is larger than the kernel's
    /// layout.
    pub(crate) fn group(devices: &[&CudaDevice]) -> Result<Option<Vec<PeerRank>>> {
        let world = devices.len();
        if !(2..=MAX_RANKS).contains(&world) || !peer_access(devices)? {
            return Ok(None);
        }
        let mut staging = Vec::with_capacity(world);
        let mut signals = Vec::with_capacity(world);
        let mut inboxes = Vec::with_capacity(world);
        for d in devices {
            let bytes = 2 * STAGING_HALF_ELEMS * std::mem::size_of::<bf16>();
            staging.push(SharedBuffer::zeroed(&d.ctx, bytes)?);
            let bytes = (MAX_BLOCKS * MAX_RANKS + MAX_BLOCKS) * std::mem::size_of::<u32>();
            signals.push(SharedBuffer::zeroed(&d.ctx, bytes)?);
            let bytes = 2 * world * FLAGGED_MAX_ELEMS / FLAGGED_LINE_ELEMS * 16;
            inboxes.push(SharedBuffer::zeroed(&d.ctx, bytes)?);
        }
        let mut addresses = vec![0u64; 3 * MAX_RANKS];
        for r in 0..world {
            addresses[r] = staging[r].ptr;
            addresses[MAX_RANKS + r] = signals[r].ptr;
            addresses[2 * MAX_RANKS + r] = inboxes[r].ptr;
        }
        let tables = devices
            .iter()
            .map(|d| Ok(d.stream.clone_htod(&addresses)?))
            .collect::<Result<Vec<_>>>()?;
        for d in devices {
            d.stream.synchronize()?;
        }
        let abort = HostFlag::new(&devices[0].ctx)?;
        let sms = devices.iter().map(|d| d.sm_count()).min().unwrap_or(1);
        let alike = devices.iter().all(|d| {
            (d.sm_count(), d.compute_capability())
                == (devices[0].sm_count(), devices[0].compute_capability())
        });
        let group = Arc::new(Group {
            staging,
            signals,
            inboxes,
            streams: devices.iter().map(|d| d.stream.clone()).collect(),
            tables,
            abort,
            aborted: AtomicBool::new(false),
            enabled: AtomicBool::new(true),
            kernel: AtomicUsize::new(0),
            // One block an SM: pulled all-reduces of 83-640 rows of 4,096 ran 4-9% faster
            // than with half the SMs, and no faster with 256 (docs/perf/tensor-parallel.md).
            blocks: AtomicU32::new(sms.clamp(1, MAX_BLOCKS) as u32),
            sms,
            alike,
            fused: AtomicU64::new(0),
        });
        Ok(Some(
            (0..world)
                .map(|rank| PeerRank {
                    group: group.clone(),
                    rank,
                })
                .collect(),
        ))
    }

    /// Turns this path on or off for every rank of the group at once: ranks that disagreed
    /// would wait in different collectives.
    pub(crate) fn set_enabled(&self, enabled: bool) {
        self.group.enabled.store(enabled, Ordering::Relaxed);
    }

    pub(crate) fn enabled(&self) -> bool {
        self.group.enabled.load(Ordering::Relaxed)
    }

    /// Sets the kernel of the whole group's all-reduces.
    pub(crate) fn set_kernel(&self, kernel: PeerAllReduceKernel) {
        let index = KERNELS.iter().position(|&k| k == kernel).unwrap_or(0);
        self.group.kernel.store(index, Ordering::Relaxed);
    }

    /// Caps the blocks of the group's all-reduce and gather launches (at most [`MAX_BLOCKS`]);
    /// one an SM by default.
    pub(crate) fn set_max_blocks(&self, blocks: usize) {
        let blocks = blocks.clamp(1, MAX_BLOCKS) as u32;
        self.group.blocks.store(blocks, Ordering::Relaxed);
    }

    fn max_blocks(&self) -> usize {
        self.group.blocks.load(Ordering::Relaxed) as usize
    }

    /// Whether a message of `n` bf16 values fits this path.
    pub(crate) fn fits(&self, n: usize) -> bool {
        n <= STAGING_HALF_ELEMS
    }

    /// Whether a broadcast of `n` 32-bit words fits this path (a staging half holds half as
    /// many words as bf16 values).
    pub(crate) fn fits_words(&self, n: usize) -> bool {
        n <= STAGING_HALF_ELEMS / 2
    }

    /// Sums the first `n` values of `x` over the group, in place, on `dev`'s stream (this rank's
    /// device); every rank must make the same calls in the same order.
    pub(crate) fn all_reduce_sum(
        &self,
        dev: &CudaDevice,
        x: &mut CudaSlice<bf16>,
        n: usize,
    ) -> Result<()> {
        self.check_call("all-reduce", n, x.len(), STAGING_HALF_ELEMS)?;
        // Enough blocks for one 16-byte chunk a thread, up to the group's cap: a decode step's
        // message takes one block, so one pair of flags crosses the link.
        let blocks = n
            .div_ceil(8)
            .div_ceil(THREADS as usize)
            .clamp(1, self.max_blocks()) as u32;
        let flagged_up_to = match KERNELS[self.group.kernel.load(Ordering::Relaxed)] {
            PeerAllReduceKernel::Auto => FLAGGED_AUTO_ELEMS,
            PeerAllReduceKernel::Flagged => FLAGGED_MAX_ELEMS,
            PeerAllReduceKernel::Pulled => 0,
        };
        if n <= flagged_up_to {
            let slot_lines = (FLAGGED_MAX_ELEMS / FLAGGED_LINE_ELEMS) as i64;
            return self.launch(dev, "all_reduce_flagged_bf16", x, n, blocks, slot_lines);
        }
        let half = STAGING_HALF_ELEMS as i64;
        self.launch(dev, "all_reduce_pulled_bf16", x, n, blocks, half)
    }

    /// The group as a product fused with its all-reduce sums over it ([`gemv_all_reduce`]), for
    /// a message of `n` values: `None` where the standalone kernels are asked for, the message
    /// is larger than an inbox slot, or the group's GPUs differ.
    ///
    /// [`gemv_all_reduce`]: crate::ops::gemv::gemv_all_reduce
    pub(crate) fn fused(&self, n: usize) -> Result<Option<GemvGroup<'_>>> {
        check_group_alive(&self.group.aborted)?;
        let auto = KERNELS[self.group.kernel.load(Ordering::Relaxed)] == PeerAllReduceKernel::Auto;
        if !auto || n > FLAGGED_MAX_ELEMS || !self.group.alike {
            return Ok(None);
        }
        let g = &*self.group;
        Ok(Some(GemvGroup {
            rank: self.rank,
            world: g.tables.len(),
            table: &g.tables[self.rank],
            slot_lines: FLAGGED_MAX_ELEMS / FLAGGED_LINE_ELEMS,
            abort_flag: g.abort.device,
            sms: g.sms,
        }))
    }

    /// Counts a product launched fused with its all-reduce.
    pub(crate) fn count_fused(&self) {
        self.group.fused.fetch_add(1, Ordering::Relaxed);
    }

    /// Products launched fused with their all-reduce, over every rank of the group.
    pub(crate) fn fused_count(&self) -> u64 {
        self.group.fused.load(Ordering::Relaxed)
    }

    /// Replaces the first `n` words of `x` on every other rank by rank 0's, on `dev`'s stream;
    /// a call of the group like an all-reduce (same order on every rank).
    pub(crate) fn broadcast_from_first(
        &self,
        dev: &CudaDevice,
        x: &mut CudaSlice<u32>,
        n: usize,
    ) -> Result<()> {
        self.check_call("broadcast", n, x.len(), STAGING_HALF_ELEMS / 2)?;
        let half = STAGING_HALF_ELEMS as i64;
        self.launch(dev, "broadcast_from_first_u32", x, n, 1, half)
    }

    /// Rank 0's `out` (`[rows, vocab]`) takes every rank's `part` of the logits of a head split
    /// over the vocabulary (`rows` x its [`vocab_part`] columns, row-major); on the other ranks
    /// `out` is left alone. Calls of as many rows as a staging half holds, the same on every rank.
    pub(crate) fn gather_to_first(
        &self,
        dev: &CudaDevice,
        part: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        vocab: usize,
    ) -> Result<()> {
        check_group_alive(&self.group.aborted)?;
        let g = &*self.group;
        let world = g.tables.len();
        let cols = vocab_part(vocab, self.rank, world).len();
        let widest = vocab.div_ceil(world);
        // A staging half holds half as many f32 values as bf16 ones.
        let room = STAGING_HALF_ELEMS / 2;
        let out_len = if self.rank == 0 { rows * vocab } else { 0 };
        if widest > room || part.len() < rows * cols || out.len() < out_len {
            return Err(CudaError::Shape(format!(
                "peer gather of {rows} rows of {cols} of {vocab} logits: part of {}, out of {}, \
                 staging of {room}",
                part.len(),
                out.len()
            )));
        }
        let step = room / widest;
        let f = dev.function("comm", "gather_parts_to_first_f32")?;
        let vocab_i = vocab as i64;
        let tail = self.call_tail(STAGING_HALF_ELEMS as i64);
        for first in (0..rows).step_by(step.max(1)) {
            let n = step.min(rows - first);
            // The same grid on every rank: it depends on the widest part only.
            let blocks = (n * widest)
                .div_ceil(4 * THREADS as usize)
                .clamp(1, self.max_blocks()) as u32;
            let mine = part.slice(first * cols..(first + n) * cols);
            let mut dst = match self.rank {
                0 => out.slice_mut(first * vocab..(first + n) * vocab),
                _ => out.slice_mut(0..out.len()),
            };
            let n_i = n as i64;
            let mut l = dev.stream.launch_builder(&f);
            l.arg(&mut dst);
            l.arg(&mine);
            l.arg(&n_i);
            l.arg(&vocab_i);
            // SAFETY: the kernel's leading arguments; `mine` holds the rank's n rows of its
            // columns, rank 0's `dst` n rows of the vocabulary (the sizes checked above); each
            // staging half holds `room` f32 values, at least n rows of the widest part.
            unsafe { self.launch_with_tail(&mut l, &tail, blocks) }?;
        }
        Ok(())
    }

    /// The arguments every comm kernel takes after its own, with the staging `room` of its
    /// unit.
    fn call_tail(&self, room: i64) -> CallTail {
        CallTail {
            rank: self.rank as i32,
            world: self.group.tables.len() as i32,
            room,
        }
    }

    /// Pushes `tail` (rank, world, the rank's table, room, the abort flag) after the kernel's own
    /// arguments and launches `blocks` blocks.
    ///
    /// # Safety
    /// `l` holds the leading arguments of a `comm` kernel whose signature ends with these, over
    /// buffers of the sizes the kernel reads and writes.
    unsafe fn launch_with_tail<'a>(
        &'a self,
        l: &mut LaunchArgs<'a>,
        tail: &'a CallTail,
        blocks: u32,
    ) -> Result<()> {
        l.arg(&tail.rank);
        l.arg(&tail.world);
        l.arg(&self.group.tables[self.rank]);
        l.arg(&tail.room);
        l.arg(&self.group.abort.device);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the caller's contract; the table names buffers of the sizes the kernels
        // assume, alive as long as the group.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// Refuses a call after an abort, or of `n` values where `len` are held or `room` fit.
    fn check_call(&self, what: &str, n: usize, len: usize, room: usize) -> Result<()> {
        check_group_alive(&self.group.aborted)?;
        if n > room || len < n {
            return Err(CudaError::Shape(format!(
                "peer {what} of {n} values: buffer of {len}, staging of {room}"
            )));
        }
        Ok(())
    }

    /// Launches one of `kernels/comm.cu`'s calls over the first `n` values of `x`; `room` is
    /// the size of the buffer half the kernel stages through (its own unit).
    fn launch<T: DeviceRepr>(
        &self,
        dev: &CudaDevice,
        kernel: &'static str,
        x: &mut CudaSlice<T>,
        n: usize,
        blocks: u32,
        room: i64,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let f = dev.function("comm", kernel)?;
        let n_i = n as i64;
        let tail = self.call_tail(room);
        let mut l = dev.stream.launch_builder(&f);
        l.arg(x);
        l.arg(&n_i);
        // SAFETY: every kernel launched here takes (x, n) before the tail; `x` holds `n` values
        // of the kernel's type.
        unsafe { self.launch_with_tail(&mut l, &tail, blocks) }
    }

    /// Releases every rank waiting in this group's kernels for a rank that will not come, and
    /// refuses the group's later collectives.
    pub(crate) fn abort(&self) {
        self.group.aborted.store(true, Ordering::Release);
        self.group.abort.raise();
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // The staging and signal buffers are read by peers' kernels: every rank's stream is
        // drained before any of them is freed.
        for s in &self.streams {
            let _ = s.synchronize();
        }
        self.staging.clear();
        self.signals.clear();
        self.inboxes.clear();
    }
}

/// Whether every rank can read and write every other rank's memory; enables that access.
fn peer_access(devices: &[&CudaDevice]) -> Result<bool> {
    for a in devices {
        for b in devices {
            if a.ctx.ordinal() == b.ctx.ordinal() {
                continue;
            }
            let mut can = 0;
            // SAFETY: plain queries on valid device handles.
            unsafe {
                sys::cuDeviceCanAccessPeer(&mut can, a.ctx.cu_device(), b.ctx.cu_device())
                    .result()?
            };
            if can == 0 {
                return Ok(false);
            }
        }
    }
    for a in devices {
        a.ctx.bind_to_thread()?;
        for b in devices {
            if a.ctx.ordinal() == b.ctx.ordinal() {
                continue;
            }
            // SAFETY: `a`'s context is current; `b`'s context is valid for the call.
            match unsafe { sys::cuCtxEnablePeerAccess(b.ctx.cu_ctx(), 0) } {
                sys::CUresult::CUDA_SUCCESS
                | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                e => e.result()?,
            }
        }
    }
    Ok(true)
}
