//! The CUDA backend's paged KV cache.
//!
//! Each layer's keys and each layer's values are one range of blocks: `[block][slot][kv
//! head][head_dim]` bf16, or with an INT8/FP8 dtype each block's 8-bit codes in that order and
//! then its f32 scales `[kv head][slot]` (`kernels/common.cuh`). By default every range is allocated in full when the cache is made. With a chunk size
//! ([`crate::CudaBackend::set_kv_chunk_blocks`]), a range is only *reserved* as virtual addresses
//! for all of the cache's blocks (`cuMemAddressReserve`), and device memory is mapped into it a
//! chunk at a time (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`) as the highest block that a step
//! touches grows ([`CudaKvCache::map_blocks`], called by `prepare_batch` before every step).
//!
//! Either way a range never moves: decode steps are recorded as CUDA graphs with the cache's
//! addresses baked in, so the cache cannot grow by reallocating and copying. Mapping more memory
//! behind the same addresses leaves every recording valid.

use crate::device::CudaDevice;
use crate::error::CudaError;
use cudarc::driver::sys::{
    self, CUdevice, CUdeviceptr, CUmemAccessDesc, CUmemAccess_flags,
    CUmemAllocationGranularity_flags, CUmemAllocationHandleType, CUmemAllocationProp,
    CUmemAllocationProp_st__bindgen_ty_1, CUmemAllocationType, CUmemGenericAllocationHandle,
    CUmemLocation, CUmemLocationType,
};
use cudarc::driver::{CudaSlice, CudaStream, DriverError};
use half::bf16;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use turbo_core::backend::{BatchLayout, Result};
use turbo_core::cpu::KvCacheSpec;
use turbo_core::BackendError;

/// Paged KV for all layers: per layer, keys and values of `spec.max_blocks` blocks (bf16, or
/// codes and scales: see the module's doc), at addresses that never change.
pub struct CudaKvCache {
    spec: KvCacheSpec,
    /// Unique per cache made by this process: a recorded step names the cache it ran on (a new
    /// cache may reuse a dropped one's addresses, layer by layer or not).
    id: u64,
    /// `spec.max_blocks` blocks each. When `mapped` is `Some`, these wrap reserved ranges that
    /// `mapped` owns: they are leaked, never dropped (a `CudaSlice`'s drop would free its address
    /// with `cuMemFreeAsync`), and only their first [`CudaKvCache::mapped_blocks`] blocks are
    /// backed by memory. They are never handed out of the crate, and the backend's kernels only
    /// touch the blocks of a step that `prepare_batch` mapped first.
    keys: Vec<ManuallyDrop<CudaSlice<bf16>>>,
    values: Vec<ManuallyDrop<CudaSlice<bf16>>>,
    /// `None`: allocated up front with `alloc_zeros`.
    mapped: Option<Mapped>,
    /// KV eviction scores, per layer `[slot][kv head]` f32: allocated (all blocks, zeroed) the
    /// first time a step scores keys, empty until then.
    scores: Vec<CudaSlice<f32>>,
    /// On the device, the addresses `[keys | values | scores][layer]` (scores 0 while
    /// unallocated), for kernels that touch every layer in one launch; made with the cache and
    /// remade when the scores are allocated.
    addresses: Option<CudaSlice<u64>>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl CudaKvCache {
    /// A cache of `spec` on `dev`: allocated in full (`chunk_blocks` `None`), or reserved and
    /// mapped `chunk_blocks` blocks at a time (rounded up to the driver's allocation granularity)
    /// as steps reach further blocks.
    pub(crate) fn new(
        dev: &CudaDevice,
        spec: KvCacheSpec,
        chunk_blocks: Option<usize>,
    ) -> Result<Self> {
        let too_large =
            || BackendError::Unsupported(format!("a KV cache of {spec:?} is too large to address"));
        // A quantized block is its codes and then its f32 scales (`kernels/common.cuh`), whose
        // rows start 16-byte aligned only when block_size · n_kv_heads is a multiple of 4.
        let quantized = spec.dtype.is_quantized();
        if quantized && !(spec.block_size * spec.n_kv_heads).is_multiple_of(4) {
            return Err(BackendError::Unsupported(format!(
                "{} KV caches need block_size x KV heads to be a multiple of 4 (block size {}, \
                 {} KV heads)",
                spec.dtype, spec.block_size, spec.n_kv_heads
            )));
        }
        let row_bytes = match quantized {
            true => spec.head_dim.checked_add(4),
            false => spec.head_dim.checked_mul(2),
        };
        // bf16 elements of one block (a quantized range is addressed as bf16 too, 2 bytes each).
        let block_len = spec
            .block_size
            .checked_mul(spec.n_kv_heads)
            .and_then(|n| n.checked_mul(row_bytes?))
            .ok_or_else(too_large)?
            / 2;
        let len = block_len
            .checked_mul(spec.max_blocks)
            .filter(|n| n.checked_mul(2).is_some())
            .ok_or_else(too_large)?
            .max(1);
        let mut cache = CudaKvCache {
            spec,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            keys: Vec::with_capacity(spec.n_layers),
            values: Vec::with_capacity(spec.n_layers),
            mapped: None,
            scores: Vec::new(),
            addresses: None,
        };
        let Some(chunk_blocks) = chunk_blocks else {
            // On an error, what was allocated so far is freed by the cache's drop.
            for i in 0..2 * spec.n_layers {
                let slice = dev
                    .stream
                    .alloc_zeros::<bf16>(len)
                    .map_err(CudaError::from)?;
                let to = match i < spec.n_layers {
                    true => &mut cache.keys,
                    false => &mut cache.values,
                };
                to.push(ManuallyDrop::new(slice));
            }
            cache.upload_addresses(&dev.stream)?;
            return Ok(cache);
        };

        if block_len == 0 {
            return Err(BackendError::Unsupported(format!(
                "a KV cache of {spec:?} has empty blocks"
            )));
        }
        let mapped = Mapped::reserve(
            &dev.stream,
            2 * spec.n_layers,
            block_len * 2,
            spec.max_blocks,
            chunk_blocks,
        )?;
        let bases = mapped.bases();
        // Set before the wrappers exist, so that the cache's drop leaks them from the start.
        cache.mapped = Some(mapped);
        for (i, base) in bases.into_iter().enumerate() {
            // SAFETY: `base` starts a reserved range of at least `len` bf16s (`max_blocks` blocks
            // rounded up to the allocation granularity), which lives as long as `mapped`, i.e. as
            // long as the cache, and outlives this wrapper: `Drop for CudaKvCache` leaks every
            // wrapper before `mapped` unmaps and frees the range, and nothing else can take them
            // out of the cache. Only the mapped prefix holds memory: the backend's kernels reach
            // a block only after `map_blocks` mapped it (see `prepare_batch`), and the wrappers
            // are never given out of this crate. Any bits are a valid bf16, and mapped chunks
            // are zeroed before use.
            let slice = unsafe { dev.stream.upgrade_device_ptr::<bf16>(base, len) };
            let to = match i < spec.n_layers {
                true => &mut cache.keys,
                false => &mut cache.values,
            };
            to.push(ManuallyDrop::new(slice));
        }
        cache.upload_addresses(&dev.stream)?;
        Ok(cache)
    }

    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }

    /// The cache's process-wide unique id (recorded steps are keyed by it).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// `layer`'s keys and values.
    pub(crate) fn layer(&self, layer: usize) -> (&CudaSlice<bf16>, &CudaSlice<bf16>) {
        (&self.keys[layer], &self.values[layer])
    }

    pub(crate) fn layer_mut(
        &mut self,
        layer: usize,
    ) -> (&mut CudaSlice<bf16>, &mut CudaSlice<bf16>) {
        (&mut self.keys[layer], &mut self.values[layer])
    }

    /// `layer`'s keys and its scores, the scores of every layer allocated zeroed on first use
    /// (about 1/(2 · head_dim) of the KV's bytes with bf16 keys and values, 1/(head_dim + 4)
    /// with 8-bit ones).
    pub(crate) fn scored_layer(
        &mut self,
        layer: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<(&CudaSlice<bf16>, &mut CudaSlice<f32>)> {
        if self.scores.is_empty() {
            let slots = self
                .spec
                .max_blocks
                .checked_mul(self.spec.block_size)
                .and_then(|n| n.checked_mul(self.spec.n_kv_heads))
                .ok_or_else(|| {
                    BackendError::Unsupported("KV scores too large to address".into())
                })?;
            let mut scores = Vec::with_capacity(self.spec.n_layers);
            for _ in 0..self.spec.n_layers {
                scores.push(
                    stream
                        .alloc_zeros::<f32>(slots.max(1))
                        .map_err(|e| with_context(driver(e), "allocating KV eviction scores"))?,
                );
            }
            self.scores = scores;
            self.upload_addresses(stream)?;
        }
        Ok((&self.keys[layer], &mut self.scores[layer]))
    }

    /// Every layer's scores, `None` while no step has scored keys.
    pub(crate) fn scores(&self) -> Option<&[CudaSlice<f32>]> {
        (!self.scores.is_empty()).then_some(&self.scores[..])
    }

    /// The device copy of every layer's addresses, `[keys | values | scores][layer]` (scores 0
    /// while unallocated).
    pub(crate) fn addresses(&self) -> Result<&CudaSlice<u64>> {
        self.addresses
            .as_ref()
            .ok_or_else(|| BackendError::Device("a KV cache without its layer addresses".into()))
    }

    fn upload_addresses(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        use cudarc::driver::DevicePtr;
        let mut host = Vec::with_capacity(3 * self.spec.n_layers);
        host.extend(self.keys.iter().map(|k| k.device_ptr(stream).0));
        host.extend(self.values.iter().map(|v| v.device_ptr(stream).0));
        match self.scores.is_empty() {
            true => host.extend(std::iter::repeat_n(0, self.spec.n_layers)),
            false => host.extend(self.scores.iter().map(|s| s.device_ptr(stream).0)),
        }
        let uploaded = stream
            .clone_htod(&host)
            .map_err(|e| with_context(driver(e), "uploading the KV cache's layer addresses"))?;
        self.addresses = Some(uploaded);
        Ok(())
    }

    /// Whether memory is mapped as blocks are reached rather than allocated up front.
    pub fn grows(&self) -> bool {
        self.mapped.is_some()
    }

    /// Blocks (from block 0) backed by device memory in every layer: `spec().max_blocks` for a
    /// cache allocated up front.
    pub fn mapped_blocks(&self) -> usize {
        match &self.mapped {
            Some(m) => m.blocks(),
            None => self.spec.max_blocks,
        }
    }

    /// Blocks mapped at a time by a growing cache (the chunk size asked for, rounded up to the
    /// driver's allocation granularity); `None` for a cache allocated up front.
    pub fn chunk_blocks(&self) -> Option<usize> {
        self.mapped
            .as_ref()
            .map(|m| (m.chunk / m.block_bytes).clamp(1, self.spec.max_blocks.max(1)))
    }

    /// Makes sure the first `blocks` blocks (at most `spec().max_blocks`) are backed by device
    /// memory in every layer, mapping whole chunks as needed; a no-op for a cache allocated up
    /// front. Out of device memory is [`BackendError::OutOfMemory`], and leaves the cache as it
    /// was for the blocks mapped before (chunks mapped into some layers stay, for the next try).
    pub fn map_blocks(&self, blocks: usize) -> Result<()> {
        match &self.mapped {
            Some(m) => m.map(blocks),
            None => Ok(()),
        }
    }
}

impl Drop for CudaKvCache {
    fn drop(&mut self) {
        let grows = self.mapped.is_some();
        for slice in self.keys.drain(..).chain(self.values.drain(..)) {
            let slice = ManuallyDrop::into_inner(slice);
            if grows {
                // The range belongs to `self.mapped`, released when that field drops, after this.
                slice.leak();
            } else {
                drop(slice);
            }
        }
    }
}

/// One past the highest block a step over `layout` reads or writes in a cache of `max_blocks`
/// blocks of `block_size` tokens: the blocks of its KV slots (a slot past the cache is skipped
/// by the kernels) and, for each span, the blocks of its table that hold its `kv_len` keys
/// (at least the first: a row no span covers attends to position 0 of the first span). Block ids
/// past the cache are left out (attention's plan refuses them).
pub(crate) fn blocks_touched(layout: &BatchLayout, block_size: usize, max_blocks: usize) -> usize {
    let cache_slots = max_blocks.saturating_mul(block_size);
    let slots = layout
        .slots
        .iter()
        .map(|&s| s as usize)
        .filter(|&s| s < cache_slots)
        .map(|s| s / block_size + 1);
    let tables = layout.spans.iter().flat_map(|span| {
        let reach = span
            .kv_len
            .div_ceil(block_size)
            .max(1)
            .min(span.block_table.len());
        span.block_table[..reach]
            .iter()
            .map(|&b| b as usize)
            .filter(|&b| b < max_blocks)
            .map(|b| b + 1)
    });
    slots.chain(tables).max().unwrap_or(0)
}

/// `x` rounded up to a multiple of `m` (`m > 0`), saturating near `usize::MAX`.
fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m).saturating_mul(m)
}

/// Bytes of a chunk of `chunk_blocks` blocks: a multiple of `granularity`, at most `reserved`.
fn chunk_bytes(
    chunk_blocks: usize,
    block_bytes: usize,
    granularity: usize,
    reserved: usize,
) -> usize {
    round_up(chunk_blocks.max(1).saturating_mul(block_bytes), granularity).min(reserved)
}

/// Bytes each range maps to back `blocks` blocks: whole chunks, at most the reservation.
fn mapped_target(blocks: usize, block_bytes: usize, chunk: usize, reserved: usize) -> usize {
    round_up(blocks.saturating_mul(block_bytes), chunk).min(reserved)
}

/// Whole blocks of at most `max_blocks` in `bytes`.
fn whole_blocks(bytes: usize, block_bytes: usize, max_blocks: usize) -> usize {
    (bytes / block_bytes).min(max_blocks)
}

/// The reserved ranges of a growing cache: equal sizes, each mapped from its start.
struct Mapped {
    stream: Arc<CudaStream>,
    device: CUdevice,
    /// Bytes of one block in one range.
    block_bytes: usize,
    max_blocks: usize,
    /// Bytes reserved per range: `max_blocks` blocks rounded up to the allocation granularity.
    reserved: usize,
    /// Bytes mapped at a time: a multiple of the granularity, at most `reserved`.
    chunk: usize,
    state: Mutex<MapState>,
}

struct MapState {
    ranges: Vec<Range>,
    /// Blocks backed in every range (`ranges` may be mapped further after a failed growth).
    blocks: usize,
}

/// One reserved range.
struct Range {
    base: CUdeviceptr,
    /// Bytes mapped from `base`: a multiple of the granularity.
    mapped: usize,
    /// The physical allocations mapped, in address order.
    chunks: Vec<Chunk>,
}

struct Chunk {
    offset: usize,
    bytes: usize,
    handle: CUmemGenericAllocationHandle,
}

/// Pinned device memory on `device`, no exportable handle.
fn allocation_prop(device: CUdevice) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: CUmemLocation {
            type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

fn driver(e: DriverError) -> BackendError {
    CudaError::from(e).into()
}

/// `e`, of the same kind, with `what` in front of its message.
fn with_context(e: BackendError, what: &str) -> BackendError {
    match e {
        BackendError::OutOfMemory(m) => BackendError::OutOfMemory(format!("{what}: {m}")),
        BackendError::Unsupported(m) => BackendError::Unsupported(format!("{what}: {m}")),
        BackendError::Device(m) => BackendError::Device(format!("{what}: {m}")),
    }
}

impl Mapped {
    /// Reserves `n_ranges` ranges of `max_blocks` blocks of `block_bytes`, none mapped yet.
    fn reserve(
        stream: &Arc<CudaStream>,
        n_ranges: usize,
        block_bytes: usize,
        max_blocks: usize,
        chunk_blocks: usize,
    ) -> Result<Self> {
        let ctx = stream.context();
        ctx.bind_to_thread().map_err(driver)?;
        let vmm = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
            )
            .map_err(driver)?;
        if vmm == 0 {
            return Err(BackendError::Unsupported(
                "this GPU does not support virtual memory management, which a KV cache mapped in \
                 chunks needs; allocate it up front (no KV allocation chunk)"
                    .into(),
            ));
        }
        let device = ctx.cu_device();
        let prop = allocation_prop(device);
        let mut granularity = 0usize;
        // SAFETY: `granularity` and `prop` are valid for the call; the context is current.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        }
        .result()
        .map_err(driver)?;
        let granularity = granularity.max(1);
        let reserved = round_up(max_blocks.saturating_mul(block_bytes).max(1), granularity);
        let mapped = Mapped {
            stream: stream.clone(),
            device,
            block_bytes,
            max_blocks,
            reserved,
            chunk: chunk_bytes(chunk_blocks, block_bytes, granularity, reserved),
            state: Mutex::new(MapState {
                ranges: Vec::with_capacity(n_ranges),
                blocks: 0,
            }),
        };
        for _ in 0..n_ranges {
            let mut base: CUdeviceptr = 0;
            // SAFETY: writes the reserved address to `base`; the context is current. On an error
            // the ranges reserved so far are freed by `mapped`'s drop.
            unsafe { sys::cuMemAddressReserve(&mut base, reserved, granularity, 0, 0) }
                .result()
                .map_err(|e| {
                    with_context(
                        driver(e),
                        &format!("reserving {reserved} bytes of addresses for the KV cache"),
                    )
                })?;
            mapped.state_mut().ranges.push(Range {
                base,
                mapped: 0,
                chunks: Vec::new(),
            });
        }
        Ok(mapped)
    }

    fn state_mut(&self) -> std::sync::MutexGuard<'_, MapState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bases(&self) -> Vec<CUdeviceptr> {
        self.state_mut().ranges.iter().map(|r| r.base).collect()
    }

    fn blocks(&self) -> usize {
        self.state_mut().blocks
    }

    /// Maps every range up to the chunk that holds block `blocks - 1` (capped at the cache).
    fn map(&self, blocks: usize) -> Result<()> {
        let blocks = blocks.min(self.max_blocks);
        // A poisoned state is still consistent: every field is updated only after the driver
        // call it records succeeded.
        let mut state = self.state_mut();
        if state.blocks >= blocks {
            return Ok(());
        }
        let target = mapped_target(blocks, self.block_bytes, self.chunk, self.reserved);
        self.stream.context().bind_to_thread().map_err(driver)?;
        for range in state.ranges.iter_mut() {
            if range.mapped < target {
                self.grow(range, target).map_err(|e| {
                    with_context(
                        e,
                        &format!(
                            "mapping KV cache blocks up to {} of {} ({} bytes of each layer's keys and values)",
                            whole_blocks(target, self.block_bytes, self.max_blocks),
                            self.max_blocks,
                            target
                        ),
                    )
                })?;
            }
        }
        state.blocks = whole_blocks(target, self.block_bytes, self.max_blocks);
        Ok(())
    }

    /// Maps one new allocation behind `range` from its mapped end to `target` bytes, readable
    /// and writable by the device, and zeroes it on the stream (ordered before the step).
    fn grow(&self, range: &mut Range, target: usize) -> Result<()> {
        let bytes = target - range.mapped;
        let at = range.base + range.mapped as CUdeviceptr;
        let prop = allocation_prop(self.device);
        let mut handle: CUmemGenericAllocationHandle = 0;
        // SAFETY: `bytes` is a multiple of the granularity (both ends are); `handle` and `prop`
        // are valid for the call; the context is current.
        unsafe { sys::cuMemCreate(&mut handle, bytes, &prop, 0) }
            .result()
            .map_err(driver)?;
        // SAFETY: `at..at + bytes` lies in `range`'s reservation (`target <= reserved`) and is
        // unmapped (past `range.mapped`); the allocation is exactly `bytes` long.
        if let Err(e) = unsafe { sys::cuMemMap(at, bytes, 0, handle, 0) }.result() {
            // SAFETY: the handle is ours and mapped nowhere.
            unsafe { sys::cuMemRelease(handle) };
            return Err(driver(e));
        }
        let access = CUmemAccessDesc {
            location: prop.location,
            flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: `at..at + bytes` was just mapped; `access` is one valid descriptor.
        if let Err(e) = unsafe { sys::cuMemSetAccess(at, bytes, &access, 1) }.result() {
            // SAFETY: nothing has used the mapping yet; undo it, then free the allocation.
            unsafe {
                sys::cuMemUnmap(at, bytes);
                sys::cuMemRelease(handle);
            }
            return Err(driver(e));
        }
        range.chunks.push(Chunk {
            offset: range.mapped,
            bytes,
            handle,
        });
        range.mapped = target;
        // SAFETY: the range was just mapped read/write for this device; the stream is this
        // context's. Issued outside any capture (`prepare_batch`), before the step's kernels.
        unsafe { sys::cuMemsetD8Async(at, 0, bytes, self.stream.cu_stream()) }
            .result()
            .map_err(driver)
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // Work still queued may use the ranges: let it finish first. Errors cannot be reported
        // from here; the releases are attempted regardless.
        let _ = self.stream.synchronize();
        let _ = self.stream.context().bind_to_thread();
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        for range in state.ranges.drain(..) {
            for c in &range.chunks {
                // SAFETY: each chunk is mapped at `base + offset` and is released once; the
                // stream is idle and the cache's wrappers of the range are gone (leaked).
                unsafe {
                    sys::cuMemUnmap(range.base + c.offset as CUdeviceptr, c.bytes);
                    sys::cuMemRelease(c.handle);
                }
            }
            // SAFETY: the reservation is ours, of `reserved` bytes, and now wholly unmapped.
            unsafe { sys::cuMemAddressFree(range.base, self.reserved) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use turbo_attention::QuerySpan;

    const MIB: usize = 1 << 20;

    #[test]
    fn chunks_are_whole_granules_within_the_reservation() {
        // 6 KiB blocks (16 slots of 3 heads of 64 bf16s), 2 MiB granules.
        let block = 6 * 1024;
        let reserved = round_up(1024 * block, 2 * MIB);
        assert_eq!(reserved, 6 * MIB);
        assert_eq!(chunk_bytes(4, block, 2 * MIB, reserved), 2 * MIB);
        assert_eq!(chunk_bytes(0, block, 2 * MIB, reserved), 2 * MIB);
        assert_eq!(chunk_bytes(342, block, 2 * MIB, reserved), 4 * MIB);
        assert_eq!(chunk_bytes(5000, block, 2 * MIB, reserved), reserved);
        assert_eq!(chunk_bytes(usize::MAX, block, 2 * MIB, reserved), reserved);
        // 512 KiB blocks: four to a granule.
        assert_eq!(chunk_bytes(4, MIB / 2, 2 * MIB, 64 * MIB), 2 * MIB);
        assert_eq!(chunk_bytes(5, MIB / 2, 2 * MIB, 64 * MIB), 4 * MIB);
    }

    #[test]
    fn growth_maps_whole_chunks_up_to_the_cache() {
        let block = MIB / 2;
        let (chunk, reserved, max_blocks) = (2 * MIB, 5 * MIB, 10);
        let mapped = |blocks| mapped_target(blocks, block, chunk, reserved);
        assert_eq!(mapped(0), 0);
        assert_eq!(mapped(1), 2 * MIB);
        assert_eq!(mapped(4), 2 * MIB);
        assert_eq!(mapped(5), 4 * MIB);
        // The last chunk is cut at the reservation.
        assert_eq!(mapped(9), 5 * MIB);
        assert_eq!(mapped(10), 5 * MIB);
        assert_eq!(whole_blocks(mapped(5), block, max_blocks), 8);
        assert_eq!(whole_blocks(mapped(10), block, max_blocks), 10);
        // Blocks that straddle a chunk's end are not counted as mapped.
        assert_eq!(whole_blocks(2 * MIB, 6 * 1024, 1000), 341);
        assert_eq!(mapped_target(342, 6 * 1024, 2 * MIB, 6 * MIB), 4 * MIB);
    }

    fn layout<'a>(slots: &'a [u32], spans: &'a [QuerySpan<'a>]) -> BatchLayout<'a> {
        BatchLayout {
            ids: &[],
            positions: &[],
            slots,
            spans,
            inv_freq: &[],
            outputs: &[],
            n_heads: 1,
            vocab: 1,
            sampling: None,
            scoring: &[],
        }
    }

    #[test]
    fn a_step_touches_its_slots_blocks_and_its_tables_up_to_its_keys() {
        let span = |kv_len, block_table| QuerySpan {
            q_start: 0,
            n_q: 1,
            kv_len,
            block_table,
        };
        // Blocks of 4 tokens, a cache of 100 blocks.
        let touched =
            |slots: &[u32], spans: &[QuerySpan]| blocks_touched(&layout(slots, spans), 4, 100);
        assert_eq!(touched(&[], &[]), 0);
        assert_eq!(touched(&[0], &[]), 1);
        assert_eq!(touched(&[3, 4], &[]), 2);
        assert_eq!(touched(&[39], &[]), 10);
        // Padding slots (past the cache) are skipped by the kernels.
        assert_eq!(touched(&[7, u32::MAX, 400], &[]), 2);
        // 9 keys fill 3 blocks of the table; block 70 is held but not read yet.
        assert_eq!(touched(&[], &[span(9, &[5, 20, 2, 70])]), 21);
        assert_eq!(touched(&[], &[span(8, &[5, 20, 2, 70])]), 21);
        assert_eq!(touched(&[], &[span(12, &[5, 20, 2, 70])]), 21);
        assert_eq!(touched(&[], &[span(13, &[5, 20, 2, 70])]), 71);
        // A span without keys still names its first block.
        assert_eq!(touched(&[], &[span(0, &[30, 50])]), 31);
        assert_eq!(touched(&[], &[span(0, &[])]), 0);
        // Ids past the cache are refused by attention's plan, not mapped.
        assert_eq!(touched(&[], &[span(8, &[3, 100])]), 4);
        // The highest of all.
        assert_eq!(touched(&[10, 41], &[span(5, &[1, 9]), span(1, &[60])]), 61);
    }
}
