//! [`Backend`] on a CUDA GPU: bf16 weights and activations, f32 accumulation inside kernels.

use crate::device::CudaDevice;
use crate::error::CudaError;
use crate::nccl::NcclRank;
use crate::ops;
use crate::ops::attention::{AttentionPlan, KvLayout, KvSplit, LogitScoring, PlanOptions};
use crate::ops::elementwise::{CompactShape, QuantGeometry};
use crate::ops::gemv::{gemv_fits, GemvNorm, GemvOut, QkvRopeOut};
use crate::ops::quant::QGEMV_MAX_TOKENS;
use crate::ops::scores::{self, FixedScoring, ScoreGeometry, ScorePlan};
use crate::p2p::{PeerAllReduceKernel, PeerRank};
use cudarc::driver::sys::CUstreamCaptureMode;
use cudarc::driver::{
    CudaEvent, CudaGraph, CudaSlice, CudaView, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};
use half::bf16;
use rayon::prelude::*;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use turbo_core::backend::{
    Backend, BatchLayout, BatchRows, KvCompaction, KvRuleCompaction, NextNorm, Result,
    SampledTokens, TokensLater, CARRIED_TOKEN,
};
use turbo_core::comm::{own_vocab_part, RankInfo};
use turbo_core::cpu::KvCacheSpec;
use turbo_core::sampling::SampleParams;
use turbo_core::{BackendError, WeightMatrix};
use turbo_keyformer::ScoreFunction;

pub use crate::kv::CudaKvCache;

/// Activations: a row-major `[rows, cols]` bf16 buffer on the device.
pub struct CudaTensor {
    pub data: CudaSlice<bf16>,
    pub rows: usize,
    pub cols: usize,
}

pub use crate::matrix::CudaMatrix;
use crate::matrix::{MatrixStore, ProductOut};

/// bf16 values of weights decoded and copied up at a time (64 MiB).
const UPLOAD_CHUNK_ELEMS: usize = 32 << 20;

/// Decode steps of at most this many sequences are recorded as CUDA graphs.
pub const MAX_GRAPH_ROWS: usize = 256;
/// The most key ranges a recorded decode step splits each row into.
const MAX_GRAPH_SPLIT: usize = 64;
/// Words of one row's [`SampleParams`].
const PARAM_WORDS: usize = std::mem::size_of::<SampleParams>() / 4;

/// The rows a decode step of `n` sequences is padded to, so that few shapes are recorded: 1, 2,
/// 4, 6, 8, then multiples of 8. Six has its own shape because quantized weights' products
/// decode each code once for all of a step's tokens, so their cost grows with the padded rows
/// (on an H200, 8B Q4_K_M, five and six sequences padded to eight decoded 662 and 793 tok/s,
/// recorded at six 947 and 1135).
pub fn graph_rows(n: usize) -> usize {
    match n {
        0..=4 => n.next_power_of_two(),
        5..=6 => 6,
        _ => n.next_multiple_of(8),
    }
}

/// What a recorded step depends on beyond its buffers' contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct StepShape {
    rows: usize,
    /// Key ranges per row ([`KvSplit::Fixed`]).
    split: usize,
    sampling: bool,
    /// Whether the step scores keys for KV eviction (its scoring kernels are recorded too).
    scored: bool,
    /// Whether any of its rows scores with Gumbel noise (Keyformer), whose pass over the logits is
    /// recorded too.
    gumbel: bool,
    /// The KV cache's id: a recording names the cache it ran on.
    cache: u64,
}

/// A recorded step. CUDA graphs must not be used from two threads at once; the batch only
/// touches them under its mutex.
struct StepGraph(CudaGraph);

// SAFETY: see `StepGraph`: every use is serialized by `CudaBatch::graphs`'s mutex.
unsafe impl Send for StepGraph {}

/// Sections of a step's one upload (u32 words): token ids, positions, KV slots, output rows, the
/// output rows' sampling parameters and penalty-list offsets, then the penalized tokens and their
/// counts (last, as the only sections whose length does not follow from the row counts).
#[derive(Clone, Debug, Default)]
struct Sections {
    ids: Range<usize>,
    positions: Range<usize>,
    slots: Range<usize>,
    outputs: Range<usize>,
    params: Range<usize>,
    penalty_offsets: Range<usize>,
    penalty_tokens: Range<usize>,
    penalty_counts: Range<usize>,
}

/// A batch on the device, refilled every step: one upload of its tables, the attention plan, the
/// logits and sampled tokens, and the steps recorded for its shapes.
pub struct CudaBatch {
    upload: CudaSlice<u32>,
    sections: Sections,
    inv_freq: Vec<f32>,
    inv_freq_dev: CudaSlice<f32>,
    /// Rows of activations (padded) and of outputs (padded), and the outputs asked for.
    tokens: usize,
    outputs: usize,
    real_outputs: usize,
    vocab: usize,
    n_heads: usize,
    sampling: bool,
    attention: Mutex<Option<AttentionPlan>>,
    /// The step's KV eviction scoring, when any of its spans is scored.
    scores: Mutex<Option<ScorePlan>>,
    /// The output rows' logits, on rank 0 of a tensor-parallel group (a place-holder on the
    /// others).
    logits: Mutex<CudaSlice<f32>>,
    /// A rank's part of the logits of a head split over the vocabulary.
    logit_part: Mutex<CudaSlice<f32>>,
    /// Every rank's part, where NCCL gathers them.
    gathered: Mutex<CudaSlice<f32>>,
    sampled: Mutex<CudaSlice<u32>>,
    /// `Some` when this step may be recorded or replayed.
    shape: Option<StepShape>,
    /// The id of the cache of the last step.
    cache: u64,
    /// Per shape: `None` once run directly (the warm-up that loads kernels and lets cuBLASLt pick
    /// its algorithms), then its recording.
    graphs: Mutex<HashMap<StepShape, Option<StepGraph>>>,
    /// Events recorded before and after the last step, while step timing is on.
    step_events: Mutex<Option<(CudaEvent, CudaEvent)>>,
    /// Page-locked host buffers the sampled tokens come back in without a wait, used in turn:
    /// a step's tokens are taken before the step after next reuses its buffer.
    pinned: [PinnedTokens; 2],
    pinned_turn: AtomicUsize,
}

/// Microseconds between a step's timing events (waiting for the end one).
fn step_micros(events: Option<(CudaEvent, CudaEvent)>) -> Option<f64> {
    let (start, end) = events?;
    Some(start.elapsed_ms(&end).ok()? as f64 * 1e3)
}

/// A page-locked buffer of sampled tokens, shared with the [`TokensLater`] reading it.
type PinnedTokens = Mutex<Option<Arc<Mutex<PinnedHostSlice<u32>>>>>;

fn lock<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| BackendError::Device("a step panicked while holding the batch".into()))
}

/// Grows `buf` to at least `len` elements (to a power of two, so that growth is rare); true when
/// it was replaced.
fn ensure_len<T: DeviceRepr + ValidAsZeroBits>(
    dev: &CudaDevice,
    buf: &mut CudaSlice<T>,
    len: usize,
) -> Result<bool> {
    if buf.len() >= len {
        return Ok(false);
    }
    *buf = dev
        .stream
        .alloc_zeros::<T>(len.next_power_of_two())
        .map_err(CudaError::from)?;
    Ok(true)
}

impl CudaBatch {
    fn view(&self, r: &Range<usize>) -> CudaView<'_, u32> {
        self.upload.slice(r.clone())
    }

    /// Refuses a step over `cache` with a batch prepared over another cache: `prepare_batch`
    /// made sure that the blocks of the step are mapped in the cache it was given, not in this
    /// one.
    fn check_cache(&self, cache: &CudaKvCache) -> Result<()> {
        if self.cache != cache.id() {
            return Err(BackendError::Unsupported(
                "a step over a KV cache with a batch prepared over another".into(),
            ));
        }
        Ok(())
    }
}

/// How many decode steps were recorded as CUDA graphs, and how many replayed one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub recorded: usize,
    pub replayed: usize,
}

#[derive(Clone)]
pub struct CudaBackend {
    dev: Arc<CudaDevice>,
    graphs: Arc<AtomicBool>,
    recorded: Arc<AtomicUsize>,
    replayed: Arc<AtomicUsize>,
    /// KV blocks a new cache maps at a time; 0: allocated in full up front.
    kv_chunk_blocks: Arc<AtomicUsize>,
    /// Whether steps record events for their device time (step profiles).
    step_timing: Arc<AtomicBool>,
    /// This GPU's communicator when it is a rank of a tensor-parallel group.
    nccl: Option<Arc<NcclRank>>,
    /// The group's all-reduce through peer-mapped memory, when every pair of its GPUs can map
    /// each other's memory: used for messages that fit it (decode steps) unless turned off.
    peer: Option<Arc<PeerRank>>,
    /// The host buffer weights are decoded into on their way up, reused so that loading a
    /// large model faults its pages in once (at most [`UPLOAD_CHUNK_ELEMS`] values).
    upload_staging: Arc<Mutex<Vec<bf16>>>,
    /// Whether quantized weights stay as their blocks (the default) rather than bf16.
    native_weights: Arc<AtomicBool>,
    /// Where larger steps' products decode bands of quantized weights to bf16
    /// ([`crate::matrix::DecodeScratch`]).
    decode_scratch: Arc<Mutex<crate::matrix::DecodeScratch>>,
    /// A split RMSNorm between the residual step that began it and the `norm_*` call that
    /// finishes it ([`Backend::linear_residual_before_norm`]).
    norm_ahead: Arc<Mutex<NormAhead>>,
}

/// Partial sums a split norm holds at most: one per 16 values of the stream, for streams of up to
/// 65,536 values (one-token steps).
const NORM_PARTS: usize = 4096;

/// The state of a split RMSNorm ([`ops::quant::NormLink`]): the residual step's partial sums,
/// allocated with the backend (a recorded step must not allocate), and which norm they belong to.
struct NormAhead {
    parts: CudaSlice<f32>,
    pending: Option<NormKey>,
}

/// What a split norm's parts were computed for: the stream `x`, the norm's weights and eps,
/// the `normed` scratch holding x · weight, and the step's tokens. The `norm_*` call that
/// finishes it must name the same.
#[derive(PartialEq, Eq, Clone, Copy)]
struct NormKey {
    x: u64,
    weight: u64,
    normed: u64,
    eps: u32,
    rows: usize,
}

impl NormKey {
    fn of(
        dev: &CudaDevice,
        x: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
        normed: &CudaTensor,
    ) -> Self {
        use cudarc::driver::DevicePtr;
        let ptr = |t: &CudaTensor| t.data.device_ptr(&dev.stream).0;
        NormKey {
            x: ptr(x),
            weight: ptr(weight),
            normed: ptr(normed),
            eps: eps.to_bits(),
            rows: x.rows,
        }
    }
}

impl CudaBackend {
    /// The backend on device `ordinal`, with every kernel module loaded: on a machine's first
    /// run the driver compiles the PTX then (seconds), rather than inside the first steps.
    pub fn new(ordinal: usize) -> Result<Self> {
        let dev = CudaDevice::new(ordinal)?;
        dev.load_modules()?;
        let norm_ahead = NormAhead {
            parts: dev
                .stream
                .alloc_zeros::<f32>(NORM_PARTS)
                .map_err(CudaError::from)?,
            pending: None,
        };
        Ok(CudaBackend {
            dev: Arc::new(dev),
            graphs: Arc::new(AtomicBool::new(true)),
            recorded: Arc::new(AtomicUsize::new(0)),
            replayed: Arc::new(AtomicUsize::new(0)),
            kv_chunk_blocks: Arc::new(AtomicUsize::new(0)),
            step_timing: Arc::new(AtomicBool::new(false)),
            nccl: None,
            peer: None,
            upload_staging: Arc::new(Mutex::new(Vec::new())),
            native_weights: Arc::new(AtomicBool::new(true)),
            decode_scratch: Arc::new(Mutex::new(Default::default())),
            norm_ahead: Arc::new(Mutex::new(norm_ahead)),
        })
    }

    /// Drops a pending split norm: called by every operation that may write a stream or a scratch
    /// before the `norm_*` call that would finish it.
    fn forget_norm_ahead(&self) -> Result<()> {
        lock(&self.norm_ahead)?.pending = None;
        Ok(())
    }

    /// Takes the pending split norm if it was computed for this `norm_*` call (same stream,
    /// weights, eps, scratch and tokens); any other pending norm is dropped, since the call may
    /// write the scratch it would have used.
    fn take_norm_ahead(
        &self,
        x: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
        normed: &CudaTensor,
    ) -> Result<bool> {
        let pending = lock(&self.norm_ahead)?.pending.take();
        Ok(pending.is_some_and(|k| k == NormKey::of(&self.dev, x, weight, eps, normed)))
    }

    /// `out ← rms_norm(x) · weight · wᵀ` for a quantized `w` from a split norm's parts (the
    /// pending one taken, `normed` holding x · weight): `false` (nothing done) where `w` cannot
    /// finish it.
    fn finish_norm_product(
        &self,
        normed: &CudaTensor,
        eps: f32,
        w: &CudaMatrix,
        out: ProductOut,
    ) -> Result<bool> {
        if !w.links_norm(&self.dev, normed.rows, false) {
            return Ok(false);
        }
        self.finishing_norm(eps, |link| {
            crate::matrix::product(
                &self.dev,
                &self.decode_scratch,
                normed,
                w,
                (None, link),
                out,
            )
        })?;
        Ok(true)
    }

    /// Runs `f` with the link that finishes the split norm whose parts the backend holds.
    fn finishing_norm<R>(
        &self,
        eps: f32,
        f: impl FnOnce(ops::quant::NormLink) -> crate::Result<R>,
    ) -> Result<R> {
        let guard = lock(&self.norm_ahead)?;
        let link = ops::quant::NormLink::Finish {
            parts: &guard.parts,
            eps,
        };
        Ok(f(link)?)
    }

    /// The backends of a tensor-parallel group over GPUs `first .. first + world`, rank order,
    /// joined by NCCL, and by an all-reduce through peer-mapped memory where the GPUs can map
    /// each other's (NVLink, or PCIe peer access).
    pub fn group(first: usize, world: usize) -> Result<Vec<Self>> {
        let count = crate::device_count();
        if first.checked_add(world).is_none_or(|end| end > count) {
            return Err(CudaError::NoDevice(format!(
                "{world} GPUs from cuda:{first} requested, {count} present"
            ))
            .into());
        }
        let mut backends = (first..first + world)
            .map(CudaBackend::new)
            .collect::<Result<Vec<_>>>()?;
        let streams = backends.iter().map(|b| b.dev.stream.clone()).collect();
        for (b, rank) in backends.iter_mut().zip(NcclRank::group(streams)?) {
            b.nccl = Some(Arc::new(rank));
        }
        let devices: Vec<&CudaDevice> = backends.iter().map(|b| &*b.dev).collect();
        if let Some(ranks) = PeerRank::group(&devices)? {
            for (b, rank) in backends.iter_mut().zip(ranks) {
                b.peer = Some(Arc::new(rank));
            }
        }
        Ok(backends)
    }

    /// Whether the group's all-reduces of decode-sized messages go through peer-mapped memory
    /// (on by default where the group has it) rather than NCCL; set on any rank, it holds for the
    /// whole group. Off, a split model's steps are not recorded as CUDA graphs.
    pub fn set_peer_all_reduce(&self, enabled: bool) {
        if let Some(p) = &self.peer {
            p.set_enabled(enabled);
        }
    }

    /// Which kernel the group's peer all-reduces take (all give the same bits;
    /// [`PeerAllReduceKernel::Auto`] by default, the others for benchmarks and tests). Set on any
    /// rank, it holds for the whole group: every rank must launch the same kernel. Set it before
    /// a model runs: steps already recorded as CUDA graphs keep the kernels they were recorded
    /// with.
    pub fn set_peer_all_reduce_kernel(&self, kernel: PeerAllReduceKernel) {
        if let Some(p) = &self.peer {
            p.set_kernel(kernel);
        }
    }

    /// Caps the blocks of the group's peer all-reduce and gather kernels (at most
    /// [`crate::PEER_MAX_BLOCKS`]; one an SM by default), for the whole group at once. Set it
    /// before a model runs, as [`Self::set_peer_all_reduce_kernel`].
    pub fn set_peer_max_blocks(&self, blocks: usize) {
        if let Some(p) = &self.peer {
            p.set_max_blocks(blocks);
        }
    }

    /// Row-parallel products that the group's ranks launched fused with their all-reduce
    /// ([`PeerAllReduceKernel::Auto`] at decode), so tests and benchmarks can tell it ran.
    pub fn fused_all_reduces(&self) -> u64 {
        self.peer.as_ref().map_or(0, |p| p.fused_count())
    }

    /// Whether this rank is part of a group whose GPUs map each other's memory.
    pub fn has_peer_all_reduce(&self) -> bool {
        self.peer.is_some()
    }

    /// The peer all-reduce, when the group has it and it is on.
    fn peer(&self) -> Option<&PeerRank> {
        self.peer.as_deref().filter(|p| p.enabled())
    }

    /// [`Backend::run_step`] without its timing events: replays the step's recording, records
    /// it, or runs it directly.
    fn run_step_untimed(
        &self,
        batch: &CudaBatch,
        step: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        // A rank of a tensor-parallel group records its steps only when their all-reduces go
        // through peer memory (every recordable step's fit it): replaying steps recorded with
        // NCCL all-reduces inside hung in a 100-request run on two H200s, while the same run
        // launched directly finished.
        let graphs_on =
            self.graphs.load(Ordering::Relaxed) && (self.nccl.is_none() || self.peer().is_some());
        // Every step ends joined with the side stream: a recording must end with all its
        // streams joined, and what follows a step may read what side work wrote.
        let mut step = || {
            let ran = step();
            // Also after a failure part-way, so that a recording ends with its streams joined.
            let joined = self.dev.join_side();
            ran.and(joined.map_err(BackendError::from))
        };
        let Some(shape) = batch.shape.filter(|_| graphs_on) else {
            return step();
        };
        let mut graphs = lock(&batch.graphs)?;
        match graphs.get(&shape) {
            Some(Some(graph)) => {
                graph.0.launch().map_err(CudaError::from)?;
                self.replayed.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            None => {
                step()?;
                graphs.insert(shape, None);
                Ok(())
            }
            Some(None) => {
                let stream = &self.dev.stream;
                stream
                    .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .map_err(CudaError::from)?;
                let recorded = step();
                // The capture always ends, also when the step failed part-way.
                // Each kernel keeps the priority of the stream it was recorded on (the side
                // stream's passes run below the step's own kernels, see `CudaDevice::fork_side`).
                let graph = stream.end_capture(
                    cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY,
                );
                recorded?;
                let graph = graph.map_err(CudaError::from)?.ok_or_else(|| {
                    BackendError::Device("recording a step captured no work".into())
                })?;
                graph.launch().map_err(CudaError::from)?;
                graphs.insert(shape, Some(StepGraph(graph)));
                self.recorded.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
        }
    }

    pub fn graph_stats(&self) -> GraphStats {
        GraphStats {
            recorded: self.recorded.load(Ordering::Relaxed),
            replayed: self.replayed.load(Ordering::Relaxed),
        }
    }

    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// Whether decode steps are recorded and replayed as CUDA graphs (on by default). Off, every
    /// step issues its kernels one by one: the reference the graphs are tested against.
    pub fn set_graphs(&self, enabled: bool) {
        self.graphs.store(enabled, Ordering::Relaxed);
    }

    /// How KV caches made from now on get their memory. `None` (the default): every layer's keys
    /// and values are allocated in full when the cache is made. `Some(n)`: each is reserved as
    /// addresses for the whole cache, and device memory is mapped behind them `n` blocks at a
    /// time (rounded up to the driver's allocation granularity, 2 MiB on current GPUs; `n = 0` is
    /// taken as 1) as steps reach further blocks, so that a large cache only holds the memory of
    /// the blocks used so far. Either way the cache's addresses never change, as the recorded
    /// decode steps need. See [`CudaKvCache::map_blocks`].
    pub fn set_kv_chunk_blocks(&self, blocks: Option<usize>) {
        let n = blocks.map_or(0, |n| n.max(1));
        self.kv_chunk_blocks.store(n, Ordering::Relaxed);
    }

    /// The setting of [`CudaBackend::set_kv_chunk_blocks`].
    pub fn kv_chunk_blocks(&self) -> Option<usize> {
        Some(self.kv_chunk_blocks.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }

    /// Whether matrices uploaded from now on keep GGUF blocks of the types the kernels decode
    /// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) as they are (the default), or are
    /// decoded to bf16 at upload.
    pub fn set_native_weights(&self, enabled: bool) {
        self.native_weights.store(enabled, Ordering::Relaxed);
    }

    /// A product of few tokens by the stream kernels of [`ops::gemv`] (bf16 weights).
    fn gemv(
        &self,
        x: &CudaTensor,
        w: &CudaSlice<bf16>,
        (rows, cols): (usize, usize),
        norm: Option<GemvNorm>,
        out: GemvOut,
    ) -> Result<()> {
        Ok(ops::gemv::gemv_with_ring(
            &self.dev,
            self.gemv_ring(),
            &x.data,
            x.rows,
            w,
            rows,
            cols,
            norm,
            out,
        )?)
    }

    /// Whether one-token products stream their weights through the ring
    /// ([`ops::gemv::GemvRing`]): on one GPU, and on tensor-parallel ranks whose residual
    /// products and all-reduces are fused through mapped memory (the ring form of those lets
    /// the next product start early too); not on ranks that all-reduce through NCCL, where the
    /// ring's costs would remain without its gain (measured at TP 2 with only the QKV and
    /// gate/up products on the ring: batch-1 decode 401 -> 394 tok/s on two H200s).
    fn gemv_ring(&self) -> Option<ops::gemv::GemvRing> {
        match (&self.nccl, self.peer()) {
            (Some(_), None) => None,
            _ => ops::gemv::gemv_ring_config(),
        }
    }

    /// The embedding of the batch's tokens from `table`, rows `part` of a vocabulary of `vocab`.
    fn embed_rows(
        &self,
        table: &CudaMatrix,
        batch: &CudaBatch,
        part: std::ops::Range<usize>,
        vocab: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let ids = batch.view(&batch.sections.ids);
        let Some(data) = table.bf16() else {
            let bounds = (part.start, vocab);
            return Ok(crate::matrix::embed(
                &self.dev,
                table,
                &ids,
                batch.tokens,
                bounds,
                &mut out.data,
            )?);
        };
        Ok(ops::elementwise::embed_part(
            &self.dev,
            data,
            &ids,
            batch.tokens,
            table.cols,
            part,
            vocab,
            &mut out.data,
        )?)
    }

    /// `out = x · headᵀ` in f32 (`[x.rows, head.rows]`): the logits, or a rank's part of them.
    fn head_product(
        &self,
        x: &CudaTensor,
        head: &CudaMatrix,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let Some(data) = head.bf16() else {
            return self.quant_product(x, head, None, ProductOut::F32(out));
        };
        if gemv_fits(x.rows, head.cols) {
            return self.gemv(x, data, (head.rows, head.cols), None, GemvOut::F32(out));
        }
        Ok(ops::linear::linear_f32_out(
            &self.dev, &x.data, data, x.rows, head.cols, head.rows, out,
        )?)
    }

    /// A product with a matrix of blocks ([`crate::matrix::product`]).
    fn quant_product(
        &self,
        x: &CudaTensor,
        w: &CudaMatrix,
        norm: Option<GemvNorm>,
        out: ProductOut,
    ) -> Result<()> {
        Ok(crate::matrix::product(
            &self.dev,
            &self.decode_scratch,
            x,
            w,
            (norm, ops::quant::NormLink::None),
            out,
        )?)
    }

    /// Makes the decode scratch hold at least what `m`'s larger products need.
    fn reserve_decode_scratch(&self, m: &CudaMatrix) -> Result<()> {
        Ok(lock(&self.decode_scratch)?.reserve_for(&self.dev, m)?)
    }

    /// The padded rows, key ranges per row and KV eviction scoring of a step that can be
    /// recorded: a decode step (one new token per sequence) of at most [`MAX_GRAPH_ROWS`]
    /// sequences, with a grouped decode kernel for the head dimension and no shared prefix worth a
    /// cascade pass; where rows are scored, their logits must fit the attention's logits buffer
    /// (they are then scored from logits with launch shapes fixed by the rows).
    fn graph_shape(&self, layout: &BatchLayout, spec: &KvCacheSpec) -> Option<GraphShape> {
        let n = layout.ids.len();
        let decode = n > 0
            && n <= MAX_GRAPH_ROWS
            && layout.spans.len() == n
            && layout.outputs.len() == n
            && layout
                .spans
                .iter()
                .enumerate()
                .all(|(i, s)| s.n_q == 1 && s.q_start == i)
            && layout
                .outputs
                .iter()
                .enumerate()
                .all(|(i, &r)| r as usize == i);
        if !self.graphs.load(Ordering::Relaxed)
            || !decode
            || !ops::attention::GROUPED_HEAD_DIMS.contains(&spec.head_dim)
            || !layout.n_heads.is_multiple_of(spec.n_kv_heads)
        {
            return None;
        }
        let scored_logits: usize = layout
            .spans
            .iter()
            .zip(layout.scoring)
            .filter(|(_, c)| c.is_some_and(|c| c.function.needs_scores()))
            .map(|(s, _)| layout.n_heads * ops::attention::logit_row_stride(s.kv_len))
            .sum();
        let scored = layout
            .scoring
            .iter()
            .any(|s| s.is_some_and(|s| s.function.needs_scores()));
        let gumbel = layout
            .scoring
            .iter()
            .any(|s| s.is_some_and(|s| matches!(s.function, ScoreFunction::GumbelSoftmax(_))));
        if scored && scored_logits > ops::attention::MAX_LOGITS {
            return None;
        }
        let shared = turbo_attention::cascade::cascade_groups(
            layout.spans,
            spec.block_size,
            ops::attention::CASCADE_MIN_SHARED,
        );
        if !shared.is_empty() {
            return None;
        }
        let rows = graph_rows(n);
        let keys = layout.spans.iter().map(|s| s.kv_len);
        let split = ops::attention::decode_split(
            &self.dev,
            rows,
            layout.n_heads,
            spec.n_kv_heads,
            keys.clone().sum(),
            keys.max().unwrap_or(0),
        )
        .next_power_of_two()
        .min(MAX_GRAPH_SPLIT);
        Some(GraphShape {
            rows,
            split,
            scored,
            gumbel,
        })
    }
}

/// What [`CudaBackend::graph_shape`] fixes of a recordable step.
#[derive(Clone, Copy, Debug)]
struct GraphShape {
    rows: usize,
    split: usize,
    scored: bool,
    gumbel: bool,
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|x| bf16::from_f32(*x)).collect()
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Matrix = CudaMatrix;
    type KvCache = CudaKvCache;
    type Batch = CudaBatch;

    fn name(&self) -> String {
        format!("cuda ({})", self.dev.name())
    }

    fn upload_matrix(&self, w: &WeightMatrix) -> Result<CudaMatrix> {
        self.upload_stacked(&[w])
    }

    fn matrix_bytes(&self, m: &CudaMatrix) -> usize {
        m.device_bytes()
    }

    fn upload_stacked(&self, parts: &[&WeightMatrix]) -> Result<CudaMatrix> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if parts.iter().any(|p| p.cols != cols) {
            return Err(turbo_core::BackendError::Unsupported(
                "stacked matrices must have the same number of columns".into(),
            ));
        }
        if self.native_weights.load(Ordering::Relaxed) && crate::matrix::keeps_blocks(parts) {
            let m = crate::matrix::upload_blocks(&self.dev, parts)?;
            self.reserve_decode_scratch(&m)?;
            return Ok(m);
        }
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        // SAFETY: every element is written below before the matrix is returned.
        let mut data = unsafe { self.dev.stream.alloc::<bf16>((rows * cols).max(1)) }
            .map_err(CudaError::from)?;
        // Each part decodes straight into its rows (no stacked copy of the quantized bytes),
        // a chunk of rows at a time through the reused host buffer, 16 rows a task.
        let mut staging = self
            .upload_staging
            .lock()
            .map_err(|_| BackendError::Device("an earlier weight upload panicked".into()))?;
        let chunk_rows = (UPLOAD_CHUNK_ELEMS / cols.max(1)).max(1);
        let mut first_row = 0;
        for w in parts {
            for start in (0..w.rows).step_by(chunk_rows) {
                let n = chunk_rows.min(w.rows - start);
                if staging.len() < n * cols {
                    staging.resize(n * cols, bf16::ZERO);
                }
                let host = &mut staging[..n * cols];
                host.par_chunks_mut(cols.max(1) * 16)
                    .enumerate()
                    .for_each(|(i, chunk)| {
                        let mut row = vec![0f32; cols];
                        for (j, dst) in chunk.chunks_exact_mut(cols.max(1)).enumerate() {
                            w.dequantize_row(start + i * 16 + j, &mut row);
                            for (d, s) in dst.iter_mut().zip(&row) {
                                *d = bf16::from_f32(*s);
                            }
                        }
                    });
                let at = (first_row + start) * cols;
                // From pageable memory the copy has read `host` when it returns, so the buffer
                // can take the next chunk.
                self.dev
                    .stream
                    .memcpy_htod(&*host, &mut data.slice_mut(at..at + n * cols))
                    .map_err(CudaError::from)?;
            }
            first_row += w.rows;
        }
        Ok(CudaMatrix {
            rows,
            cols,
            store: MatrixStore::Bf16(data),
        })
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaTensor> {
        assert_eq!(data.len(), rows * cols);
        Ok(CudaTensor {
            data: self
                .dev
                .stream
                .clone_htod(&to_bf16(data))
                .map_err(CudaError::from)?,
            rows,
            cols,
        })
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        Ok(CudaTensor {
            data: self
                .dev
                .stream
                .alloc_zeros::<bf16>((rows * cols).max(1))
                .map_err(CudaError::from)?,
            rows,
            cols,
        })
    }

    fn resize(&self, t: &mut CudaTensor, rows: usize) -> Result<bool> {
        let moved = ensure_len(&self.dev, &mut t.data, (rows * t.cols).max(1))?;
        t.rows = rows;
        Ok(moved)
    }

    fn download(&self, t: &CudaTensor) -> Result<Vec<f32>> {
        let host = self
            .dev
            .stream
            .clone_dtoh(&t.data)
            .map_err(CudaError::from)?;
        Ok(host[..t.rows * t.cols].iter().map(|x| x.to_f32()).collect())
    }

    fn kv_cache(&self, spec: KvCacheSpec) -> Result<CudaKvCache> {
        if !ops::attention::SUPPORTED_HEAD_DIMS.contains(&spec.head_dim) {
            return Err(turbo_core::BackendError::Unsupported(format!(
                "the CUDA backend has no attention kernel for head dimension {} (supported: {:?})",
                spec.head_dim,
                ops::attention::SUPPORTED_HEAD_DIMS
            )));
        }
        CudaKvCache::new(&self.dev, spec, self.kv_chunk_blocks())
    }

    fn kv_spec(&self, cache: &CudaKvCache) -> KvCacheSpec {
        *cache.spec()
    }

    fn kv_element_bytes(&self) -> usize {
        2
    }

    fn new_batch(&self) -> Result<CudaBatch> {
        let stream = &self.dev.stream;
        Ok(CudaBatch {
            upload: stream.alloc_zeros::<u32>(1).map_err(CudaError::from)?,
            sections: Sections::default(),
            inv_freq: Vec::new(),
            inv_freq_dev: stream.alloc_zeros::<f32>(1).map_err(CudaError::from)?,
            tokens: 0,
            outputs: 0,
            real_outputs: 0,
            vocab: 0,
            n_heads: 0,
            sampling: false,
            attention: Mutex::new(None),
            scores: Mutex::new(None),
            logits: Mutex::new(stream.alloc_zeros::<f32>(1).map_err(CudaError::from)?),
            logit_part: Mutex::new(stream.alloc_zeros::<f32>(1).map_err(CudaError::from)?),
            gathered: Mutex::new(stream.alloc_zeros::<f32>(1).map_err(CudaError::from)?),
            sampled: Mutex::new(stream.alloc_zeros::<u32>(1).map_err(CudaError::from)?),
            shape: None,
            cache: 0,
            graphs: Mutex::new(HashMap::new()),
            step_events: Mutex::new(None),
            pinned: [Mutex::new(None), Mutex::new(None)],
            pinned_turn: AtomicUsize::new(0),
        })
    }

    fn prepare_batch(
        &self,
        batch: &mut CudaBatch,
        layout: &BatchLayout,
        cache: &CudaKvCache,
    ) -> Result<BatchRows> {
        layout.check()?;
        let n = layout.ids.len();
        let unsupported = |m: String| BackendError::Unsupported(m);
        let spec = *cache.spec();
        // Every block the step reads or writes must be backed by memory before its kernels run
        // (they bound slots by the whole cache, not by what is mapped). Mapping more keeps the
        // cache's addresses, so recorded steps stay valid.
        if cache.mapped_blocks() < spec.max_blocks {
            cache.map_blocks(crate::kv::blocks_touched(
                layout,
                spec.block_size,
                spec.max_blocks,
            ))?;
        }
        let graph = self.graph_shape(layout, &spec);
        let (tokens, split) = graph.map_or((n, 0), |g| (g.rows, g.split));
        let outputs = if graph.is_some() {
            tokens
        } else {
            layout.outputs.len()
        };

        // The one upload: padded rows embed token 0 at position 0, write no KV (a slot past the
        // cache is skipped) and output themselves, greedily.
        let mut host: Vec<u32> = Vec::with_capacity(3 * tokens + (PARAM_WORDS + 2) * outputs + 1);
        let push = |host: &mut Vec<u32>, data: &[u32], len: usize, pad: &dyn Fn(usize) -> u32| {
            let start = host.len();
            host.extend_from_slice(data);
            host.extend((data.len()..len).map(pad));
            start..host.len()
        };
        let ids = push(&mut host, layout.ids, tokens, &|_| 0);
        let positions = push(&mut host, layout.positions, tokens, &|_| 0);
        let slots = push(&mut host, layout.slots, tokens, &|_| u32::MAX);
        let outputs_sec = push(&mut host, layout.outputs, outputs, &|r| r as u32);
        let (params, penalty_offsets, penalty_tokens, penalty_counts) = match &layout.sampling {
            Some(s) => {
                let words: &[u32] = bytemuck::cast_slice(s.params);
                let greedy: &[u32] =
                    bytemuck::cast_slice(std::slice::from_ref(&SampleParams::GREEDY));
                let params = push(&mut host, words, outputs * PARAM_WORDS, &|i| {
                    greedy[i % PARAM_WORDS]
                });
                let last = s.penalties.offsets.last().copied().unwrap_or(0);
                let offsets = push(&mut host, &s.penalties.offsets, outputs + 1, &|_| last);
                let listed = s.penalties.tokens.len().max(1);
                let toks = push(&mut host, &s.penalties.tokens, listed, &|_| 0);
                let counts = push(&mut host, &s.penalties.counts, listed, &|_| 0);
                (params, offsets, toks, counts)
            }
            None => {
                let at = host.len();
                (at..at, at..at, at..at, at..at)
            }
        };
        let mut moved = ensure_len(&self.dev, &mut batch.upload, host.len())?;
        self.dev
            .stream
            .memcpy_htod(&host, &mut batch.upload.slice_mut(..host.len()))
            .map_err(CudaError::from)?;
        // Ids naming the last step's tokens take them now, before its buffer may be replaced.
        if layout.ids.iter().any(|&id| id & CARRIED_TOKEN != 0) {
            let sampled = batch
                .sampled
                .get_mut()
                .map_err(|_| unsupported("poisoned".into()))?;
            ops::elementwise::resolve_carried_tokens(
                &self.dev,
                &mut batch.upload.slice_mut(ids.clone()),
                sampled,
                n,
            )?;
        }
        batch.sections = Sections {
            ids,
            positions,
            slots,
            outputs: outputs_sec,
            params,
            penalty_offsets,
            penalty_tokens,
            penalty_counts,
        };
        if batch.inv_freq != layout.inv_freq {
            moved = true;
            batch.inv_freq = layout.inv_freq.to_vec();
            batch.inv_freq_dev = self
                .dev
                .stream
                .clone_htod(layout.inv_freq)
                .map_err(CudaError::from)?;
        }
        // Under tensor parallelism each rank computes its part of the logits and rank 0 alone
        // keeps them all.
        let RankInfo { rank, world } = self.rank_info();
        let (kept, part) = match (rank, world) {
            (_, 1) => (outputs * layout.vocab, 0),
            (0, _) => (
                outputs * layout.vocab,
                outputs * layout.vocab.div_ceil(world),
            ),
            _ => (0, outputs * layout.vocab.div_ceil(world)),
        };
        moved |= ensure_len(
            &self.dev,
            batch
                .logits
                .get_mut()
                .map_err(|_| unsupported("poisoned".into()))?,
            kept.max(1),
        )?;
        moved |= ensure_len(
            &self.dev,
            batch
                .logit_part
                .get_mut()
                .map_err(|_| unsupported("poisoned".into()))?,
            part.max(1),
        )?;
        moved |= ensure_len(
            &self.dev,
            batch
                .sampled
                .get_mut()
                .map_err(|_| unsupported("poisoned".into()))?,
            outputs.max(1),
        )?;

        // Attention's plan, made now so that a recorded step replays it with new tables.
        let kv_layout = KvLayout {
            block_size: spec.block_size,
            n_kv_heads: spec.n_kv_heads,
            head_dim: spec.head_dim,
            dtype: spec.dtype,
        };
        let options = if graph.is_some() {
            PlanOptions {
                split: KvSplit::Fixed(split),
                cascade_min_shared: None,
                ..PlanOptions::default()
            }
        } else {
            PlanOptions::default()
        };
        let old = batch
            .attention
            .get_mut()
            .map_err(|_| unsupported("poisoned".into()))?
            .take();
        // Scored decode rows have the attention kernel write their logits for the scores.
        let logit_scoring: Vec<Option<LogitScoring>> = layout
            .scoring
            .iter()
            .zip(layout.spans)
            .map(|(c, span)| c.and_then(|c| scores::logit_scoring(span, &c, layout.positions)))
            .collect();
        let (plan, plan_moved) = AttentionPlan::new_reusing(
            &self.dev,
            kv_layout,
            layout.n_heads,
            tokens,
            layout.spans,
            spec.max_blocks,
            options,
            &logit_scoring,
            old,
        )?;
        moved |= plan_moved;
        let logit_bases: Vec<Option<u32>> = match layout.scoring.is_empty() {
            true => Vec::new(),
            false => (0..layout.spans.len())
                .map(|s| plan.logit_base(s))
                .collect(),
        };
        *batch
            .attention
            .get_mut()
            .map_err(|_| unsupported("poisoned".into()))? = Some(plan);

        let old = batch
            .scores
            .get_mut()
            .map_err(|_| unsupported("poisoned".into()))?
            .take();
        let fixed = graph.filter(|g| g.scored).map(|g| FixedScoring {
            rows: g.rows,
            parts: g.split,
        });
        let (scores, scores_moved) = ScorePlan::new(
            &self.dev,
            layout.spans,
            layout.scoring,
            &logit_bases,
            layout.n_heads,
            tokens,
            &spec,
            fixed,
            old,
        )?;
        moved |= scores_moved;
        *batch
            .scores
            .get_mut()
            .map_err(|_| unsupported("poisoned".into()))? = Some(scores);

        batch.tokens = tokens;
        batch.outputs = outputs;
        batch.real_outputs = layout.outputs.len();
        batch.vocab = layout.vocab;
        batch.n_heads = layout.n_heads;
        batch.sampling = layout.sampling.is_some();
        batch.shape = graph.map(|g| StepShape {
            rows: g.rows,
            split: g.split,
            scored: g.scored,
            gumbel: g.gumbel,
            sampling: layout.sampling.is_some(),
            cache: cache.id(),
        });
        // Recordings on another cache are never replayed again.
        moved |= std::mem::replace(&mut batch.cache, cache.id()) != cache.id();
        if moved {
            self.forget_steps(batch);
        }
        Ok(BatchRows { tokens, outputs })
    }

    fn run_step(&self, batch: &CudaBatch, step: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if !self.step_timing.load(Ordering::Relaxed) {
            return self.run_step_untimed(batch, step);
        }
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let stream = &self.dev.stream;
        let start = stream.record_event(timing).map_err(CudaError::from)?;
        self.run_step_untimed(batch, step)?;
        let end = stream.record_event(timing).map_err(CudaError::from)?;
        *lock(&batch.step_events)? = Some((start, end));
        Ok(())
    }

    fn set_step_timing(&self, on: bool) {
        self.step_timing.store(on, Ordering::Relaxed);
    }

    fn runs_ahead(&self) -> bool {
        true
    }

    fn first_steps_cost_more(&self) -> bool {
        true
    }

    fn step_device_micros(&self, batch: &CudaBatch) -> Option<f64> {
        step_micros(batch.step_events.lock().ok()?.take())
    }

    fn forget_steps(&self, batch: &CudaBatch) {
        if let Ok(mut graphs) = batch.graphs.lock() {
            graphs.clear();
        }
    }

    fn embed(&self, table: &CudaMatrix, batch: &CudaBatch, out: &mut CudaTensor) -> Result<()> {
        self.forget_norm_ahead()?;
        self.embed_rows(table, batch, 0..table.rows, table.rows, out)
    }

    fn embed_split(
        &self,
        table: &CudaMatrix,
        batch: &CudaBatch,
        vocab: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.forget_norm_ahead()?;
        let part = own_vocab_part("an embedding part", table.rows, vocab, self.rank_info())?;
        self.embed_rows(table, batch, part, vocab, out)
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<()> {
        self.forget_norm_ahead()?;
        Ok(ops::norm::rms_norm(
            &self.dev,
            &x.data,
            &w.data,
            x.rows,
            x.cols,
            eps,
            &mut out.data,
        )?)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaMatrix, out: &mut CudaTensor) -> Result<()> {
        self.forget_norm_ahead()?;
        let Some(data) = w.bf16() else {
            return self.quant_product(x, w, None, ProductOut::Bf16(&mut out.data));
        };
        if gemv_fits(x.rows, w.cols) {
            return self.gemv(
                x,
                data,
                (w.rows, w.cols),
                None,
                GemvOut::Bf16(&mut out.data),
            );
        }
        Ok(ops::linear::linear(
            &self.dev,
            &x.data,
            data,
            x.rows,
            w.cols,
            w.rows,
            &mut out.data,
        )?)
    }

    fn norm_linear(
        &self,
        x: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
        normed: &mut CudaTensor,
        w: &CudaMatrix,
        out: &mut CudaTensor,
    ) -> Result<()> {
        if self.take_norm_ahead(x, weight, eps, normed)?
            && self.finish_norm_product(normed, eps, w, ProductOut::Bf16(&mut out.data))?
        {
            return Ok(());
        }
        let norm = GemvNorm {
            weight: &weight.data,
            eps,
        };
        match w.bf16() {
            Some(data) if gemv_fits(x.rows, w.cols) => {
                return self.gemv(
                    x,
                    data,
                    (w.rows, w.cols),
                    Some(norm),
                    GemvOut::Bf16(&mut out.data),
                );
            }
            // (Some tensor-core products take x normalized by the unfused path below.)
            None if x.rows <= QGEMV_MAX_TOKENS && !w.takes_normalized_x(&self.dev, x.rows) => {
                return self.quant_product(x, w, Some(norm), ProductOut::Bf16(&mut out.data));
            }
            _ => {}
        }
        self.rms_norm(x, weight, eps, normed)?;
        self.linear(normed, w, out)
    }

    fn norm_linear_swiglu(
        &self,
        x: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
        normed: &mut CudaTensor,
        w_gate_up: &CudaMatrix,
        gate_up: &mut CudaTensor,
        out: &mut CudaTensor,
    ) -> Result<()> {
        if self.take_norm_ahead(x, weight, eps, normed)?
            && w_gate_up.links_norm(&self.dev, x.rows, false)
        {
            let fused = self.finishing_norm(eps, |link| {
                crate::matrix::swiglu_product(
                    &self.dev,
                    normed,
                    w_gate_up,
                    (None, link),
                    &mut out.data,
                )
            })?;
            if fused {
                return Ok(());
            }
            self.finish_norm_product(normed, eps, w_gate_up, ProductOut::Bf16(&mut gate_up.data))?;
            return self.swiglu(gate_up, out);
        }
        let norm = GemvNorm {
            weight: &weight.data,
            eps,
        };
        match w_gate_up.bf16() {
            Some(data) if gemv_fits(x.rows, w_gate_up.cols) => {
                let shape = (w_gate_up.rows, w_gate_up.cols);
                return self.gemv(x, data, shape, Some(norm), GemvOut::SwiGlu(&mut out.data));
            }
            None if w_gate_up.takes_normalized_x(&self.dev, x.rows) => {
                self.rms_norm(x, weight, eps, normed)?;
                let fused = crate::matrix::swiglu_product(
                    &self.dev,
                    normed,
                    w_gate_up,
                    (None, ops::quant::NormLink::None),
                    &mut out.data,
                )?;
                if fused {
                    return Ok(());
                }
                self.linear(normed, w_gate_up, gate_up)?;
                return self.swiglu(gate_up, out);
            }
            None if crate::matrix::swiglu_product(
                &self.dev,
                x,
                w_gate_up,
                (Some(norm), ops::quant::NormLink::None),
                &mut out.data,
            )? =>
            {
                return Ok(());
            }
            _ => {}
        }
        self.norm_linear(x, weight, eps, normed, w_gate_up, gate_up)?;
        self.swiglu(gate_up, out)
    }

    fn linear_residual(
        &self,
        input: &CudaTensor,
        w: &CudaMatrix,
        _product: &mut CudaTensor,
        x: &mut CudaTensor,
    ) -> Result<()> {
        self.forget_norm_ahead()?;
        let Some(data) = w.bf16() else {
            return self.quant_product(input, w, None, ProductOut::AddTo(&mut x.data));
        };
        if gemv_fits(input.rows, w.cols) {
            return self.gemv(
                input,
                data,
                (w.rows, w.cols),
                None,
                GemvOut::AddTo(&mut x.data),
            );
        }
        Ok(ops::linear::linear_add(
            &self.dev,
            &input.data,
            data,
            input.rows,
            w.cols,
            w.rows,
            &mut x.data,
        )?)
    }

    fn rope(&self, x: &mut CudaTensor, head_dim: usize, batch: &CudaBatch) -> Result<()> {
        let heads = x.cols / head_dim;
        Ok(ops::elementwise::rope(
            &self.dev,
            &mut x.data,
            x.rows,
            heads,
            head_dim,
            &batch.view(&batch.sections.positions),
            &batch.inv_freq_dev,
        )?)
    }

    fn silu_mul(&self, gate: &mut CudaTensor, up: &CudaTensor) -> Result<()> {
        let n = gate.rows * gate.cols;
        Ok(ops::elementwise::silu_mul(
            &self.dev,
            &mut gate.data,
            &up.data,
            n,
        )?)
    }

    fn swiglu(&self, gate_up: &CudaTensor, out: &mut CudaTensor) -> Result<()> {
        Ok(ops::elementwise::swiglu(
            &self.dev,
            &gate_up.data,
            out.rows,
            out.cols,
            &mut out.data,
        )?)
    }

    fn split3(
        &self,
        x: &CudaTensor,
        a: &mut CudaTensor,
        b: &mut CudaTensor,
        c: &mut CudaTensor,
    ) -> Result<()> {
        let widths = (a.cols, b.cols, c.cols);
        Ok(ops::elementwise::split3(
            &self.dev,
            &x.data,
            x.rows,
            widths,
            &mut a.data,
            &mut b.data,
            &mut c.data,
        )?)
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        self.forget_norm_ahead()?;
        let n = x.rows * x.cols;
        Ok(ops::elementwise::add(&self.dev, &mut x.data, &y.data, n)?)
    }

    fn rank_info(&self) -> RankInfo {
        self.nccl
            .as_ref()
            .map_or(RankInfo { rank: 0, world: 1 }, |n| n.info())
    }

    fn all_reduce_sum(&self, x: &mut CudaTensor) -> Result<()> {
        self.forget_norm_ahead()?;
        let n = x.rows * x.cols;
        match (self.peer(), &self.nccl) {
            (Some(p), _) if p.fits(n) => Ok(p.all_reduce_sum(&self.dev, &mut x.data, n)?),
            (_, Some(nccl)) => Ok(nccl.all_reduce_sum(&mut x.data, n)?),
            _ => Ok(()),
        }
    }

    fn linear_residual_all_reduce(
        &self,
        input: &CudaTensor,
        w: &CudaMatrix,
        product: &mut CudaTensor,
        x: &mut CudaTensor,
    ) -> Result<()> {
        self.forget_norm_ahead()?;
        // A decode step's product and all-reduce in one kernel where the peer path allows it.
        if let (Some(p), Some(data)) = (self.peer(), w.bf16()) {
            let group = match gemv_fits(input.rows, w.cols) && x.cols == w.rows {
                true => p.fused(x.rows * x.cols)?,
                false => None,
            };
            if let Some(group) = group {
                if ops::gemv::gemv_all_reduce_with_ring(
                    &self.dev,
                    self.gemv_ring(),
                    &input.data,
                    input.rows,
                    data,
                    w.rows,
                    w.cols,
                    &mut x.data,
                    &group,
                )? {
                    p.count_fused();
                    return Ok(());
                }
            }
        }
        turbo_core::backend::split_linear_residual(self, input, w, product, x)
    }

    fn linear_residual_before_norm(
        &self,
        input: &CudaTensor,
        w: &CudaMatrix,
        product: &mut CudaTensor,
        x: &mut CudaTensor,
        next: NextNorm<'_, CudaTensor>,
    ) -> Result<()> {
        let mut ahead = lock(&self.norm_ahead)?;
        ahead.pending = None;
        let tokens = input.rows;
        let linked = self.rank_info().world == 1
            && x.rows == tokens
            && x.cols == w.rows
            && w.links_norm(&self.dev, tokens, true)
            && tokens * (w.rows / 16) <= ahead.parts.len()
            && next.normed.rows == tokens
            && next.normed.cols == w.rows
            && next.weight.data.len() >= w.rows;
        if !linked {
            drop(ahead);
            return self.linear_residual_all_reduce(input, w, product, x);
        }
        let NormAhead { parts, pending } = &mut *ahead;
        let link = ops::quant::NormLink::Ahead {
            weight: &next.weight.data,
            scaled: &mut next.normed.data,
            parts,
        };
        crate::matrix::product(
            &self.dev,
            &self.decode_scratch,
            input,
            w,
            (None, link),
            ProductOut::AddTo(&mut x.data),
        )?;
        *pending = Some(NormKey::of(
            &self.dev,
            x,
            next.weight,
            next.eps,
            next.normed,
        ));
        Ok(())
    }

    fn broadcast_sampled(&self, batch: &CudaBatch) -> Result<()> {
        let mut sampled = lock(&batch.sampled)?;
        let n = batch.outputs;
        match (self.peer(), &self.nccl) {
            (Some(p), _) if p.fits_words(n) => {
                Ok(p.broadcast_from_first(&self.dev, &mut sampled, n)?)
            }
            (_, Some(nccl)) => Ok(nccl.broadcast_from_first(&mut sampled, n)?),
            _ => Ok(()),
        }
    }

    fn abort_collectives(&self) {
        if let Some(p) = &self.peer {
            p.abort();
        }
        if let Some(n) = &self.nccl {
            n.abort();
        }
    }

    fn gather_outputs(
        &self,
        x: &CudaTensor,
        batch: &CudaBatch,
        out: &mut CudaTensor,
    ) -> Result<()> {
        Ok(ops::elementwise::gather_rows(
            &self.dev,
            &x.data,
            &batch.view(&batch.sections.outputs),
            batch.outputs,
            x.cols,
            &mut out.data,
        )?)
    }

    fn logits(&self, x: &CudaTensor, head: &CudaMatrix, batch: &CudaBatch) -> Result<()> {
        if head.rows != batch.vocab {
            return Err(BackendError::Unsupported(format!(
                "logits over {} rows, the batch was prepared for a vocabulary of {}",
                head.rows, batch.vocab
            )));
        }
        self.head_product(x, head, &mut *lock(&batch.logits)?)
    }

    fn logits_split(
        &self,
        x: &CudaTensor,
        head: &CudaMatrix,
        batch: &CudaBatch,
        vocab: usize,
    ) -> Result<()> {
        let RankInfo { rank, world } = self.rank_info();
        if world == 1 {
            return self.logits(x, head, batch);
        }
        own_vocab_part("a head part", head.rows, vocab, self.rank_info())?;
        if vocab != batch.vocab {
            return Err(BackendError::Unsupported(format!(
                "logits of a vocabulary of {vocab}, the batch was prepared for {}",
                batch.vocab
            )));
        }
        let mut mine = lock(&batch.logit_part)?;
        self.head_product(x, head, &mut mine)?;
        let mut logits = lock(&batch.logits)?;
        match (self.peer(), &self.nccl) {
            (Some(p), _) => Ok(p.gather_to_first(&self.dev, &mine, &mut logits, x.rows, vocab)?),
            (_, Some(nccl)) => {
                // Steps that take NCCL are never recorded, so the buffer may grow here.
                let stride = x.rows * vocab.div_ceil(world);
                let mut gathered = lock(&batch.gathered)?;
                ensure_len(&self.dev, &mut gathered, world * stride)?;
                nccl.all_gather_f32(&mine, &mut gathered, stride)?;
                if rank == 0 {
                    ops::elementwise::place_vocab_parts(
                        &self.dev,
                        &gathered,
                        stride,
                        world,
                        x.rows,
                        vocab,
                        &mut logits,
                    )?;
                }
                Ok(())
            }
            (None, None) => Err(BackendError::Unsupported(
                "a split head on a backend without a group".into(),
            )),
        }
    }

    fn sample(&self, batch: &CudaBatch) -> Result<()> {
        if !batch.sampling {
            return Err(BackendError::Unsupported(
                "sampling a batch prepared without sampling".into(),
            ));
        }
        let mut logits = lock(&batch.logits)?;
        let mut sampled = lock(&batch.sampled)?;
        let sec = &batch.sections;
        Ok(ops::sampling::sample(
            &self.dev,
            &mut logits,
            batch.outputs,
            batch.vocab,
            &batch.view(&sec.params),
            &batch.view(&sec.penalty_offsets),
            &batch.view(&sec.penalty_tokens),
            &batch.view(&sec.penalty_counts),
            &mut sampled.slice_mut(..batch.outputs),
        )?)
    }

    fn read_logits(&self, batch: &CudaBatch) -> Result<Vec<f32>> {
        let logits = lock(&batch.logits)?;
        let len = batch.real_outputs * batch.vocab;
        let mut host = vec![0f32; len];
        self.dev
            .stream
            .memcpy_dtoh(&logits.slice(..len), &mut host)
            .map_err(CudaError::from)?;
        Ok(host)
    }

    fn read_tokens(&self, batch: &CudaBatch) -> Result<Vec<u32>> {
        let sampled = lock(&batch.sampled)?;
        let mut host = vec![0u32; batch.real_outputs];
        self.dev
            .stream
            .memcpy_dtoh(&sampled.slice(..batch.real_outputs), &mut host)
            .map_err(CudaError::from)?;
        Ok(host)
    }

    fn read_tokens_later(&self, batch: &CudaBatch) -> Result<TokensLater> {
        let sampled = lock(&batch.sampled)?;
        let n = batch.real_outputs;
        let turn = batch.pinned_turn.fetch_add(1, Ordering::Relaxed) % batch.pinned.len();
        let mut slot = lock(&batch.pinned[turn])?;
        // The copy moves the whole token buffer (a few KiB): a device-to-host copy takes the
        // host buffer's length, so the two are kept the same length.
        let fits = match slot.as_ref() {
            Some(p) => lock(p)?.len() == sampled.len(),
            None => false,
        };
        if !fits {
            // SAFETY: the buffer is only read after a copy into it has completed (its event).
            let host = unsafe {
                self.dev
                    .ctx
                    .alloc_pinned_with_flags::<u32>(sampled.len(), 0)
            }
            .map_err(CudaError::from)?;
            *slot = Some(Arc::new(Mutex::new(host)));
        }
        let pinned = slot.clone().expect("set above");
        drop(slot);
        {
            let mut host = lock(&pinned)?;
            self.dev
                .stream
                .memcpy_dtoh(&*sampled, &mut *host)
                .map_err(CudaError::from)?;
        }
        drop(sampled);
        // Marks the copy's end (cudarc records the host buffer's own event only where it manages
        // stream synchronization, which this backend's single stream does not ask for).
        let copied = self
            .dev
            .stream
            .record_event(None)
            .map_err(CudaError::from)?;
        let events = lock(&batch.step_events)?.take();
        Ok(TokensLater::new(move || {
            copied.synchronize().map_err(CudaError::from)?;
            let host = lock(&pinned)?;
            let data = host.as_slice().map_err(CudaError::from)?;
            let tokens = data
                .get(..n)
                .ok_or_else(|| {
                    BackendError::Device(format!("{n} tokens read from {}", data.len()))
                })?
                .to_vec();
            Ok(SampledTokens {
                tokens,
                device_micros: step_micros(events),
            })
        }))
    }

    fn compact_kv(&self, cache: &mut CudaKvCache, compaction: &KvCompaction) -> Result<()> {
        // Scores a step added on the side stream are read and moved below.
        self.dev.join_side()?;
        let spec = *cache.spec();
        compaction.check(&spec)?;
        if compaction.kept_per_row == 0 {
            return Ok(());
        }
        let stream = &self.dev.stream;
        let table = stream
            .clone_htod(compaction.block_table)
            .map_err(CudaError::from)?;
        let kept = stream
            .clone_htod(compaction.kept)
            .map_err(CudaError::from)?;
        Ok(ops::elementwise::compact_kv(
            &self.dev,
            &cache.addresses()?.as_view(),
            &table.as_view(),
            &kept.as_view(),
            CompactShape {
                k: compaction.kept_per_row,
                block_size: spec.block_size,
                n_layers: spec.n_layers,
                n_kv_heads: spec.n_kv_heads,
                head_dim: spec.head_dim,
                dtype: spec.dtype,
            },
        )?)
    }

    /// Chooses the kept keys on the device (no scores read back, no kept list uploaded), then
    /// compacts as [`Backend::compact_kv`].
    fn compact_kv_by_rule(
        &self,
        cache: &mut CudaKvCache,
        compaction: &KvRuleCompaction,
    ) -> Result<()> {
        // Scores a step added on the side stream are read and moved below.
        self.dev.join_side()?;
        let spec = *cache.spec();
        let KvRuleCompaction {
            block_table,
            dims,
            kept_per_row,
            rule,
        } = *compaction;
        let n = dims.keys;
        let k = kept_per_row.min(n);
        if dims.layers != spec.n_layers
            || dims.kv_heads != spec.n_kv_heads
            || n > block_table.len() * spec.block_size
            || block_table.iter().any(|&b| b as usize >= spec.max_blocks)
        {
            return Err(BackendError::Unsupported(format!(
                "KV compaction: {dims:?} over a block table of {} blocks, cache {spec:?}",
                block_table.len()
            )));
        }
        if k == n || k == 0 {
            return Ok(());
        }
        let (sinks, recent, top) = rule.split(k);
        if top > 0 && cache.scores().is_none() {
            return Err(BackendError::Unsupported(
                "KV compaction by score before any step scored keys".into(),
            ));
        }
        let table = self
            .dev
            .stream
            .clone_htod(block_table)
            .map_err(CudaError::from)?;
        let addresses = cache.addresses()?;
        let kept = ops::scores::select_kept(
            &self.dev,
            &addresses.slice(2 * spec.n_layers..),
            &table.as_view(),
            spec.n_layers,
            ScoreGeometry::of(&spec),
            ops::scores::KeepSplit {
                keys: n,
                sinks,
                top,
                recent,
            },
        )?;
        Ok(ops::elementwise::compact_kv(
            &self.dev,
            &addresses.as_view(),
            &table.as_view(),
            &kept.as_view(),
            CompactShape {
                k,
                block_size: spec.block_size,
                n_layers: spec.n_layers,
                n_kv_heads: spec.n_kv_heads,
                head_dim: spec.head_dim,
                dtype: spec.dtype,
            },
        )?)
    }

    fn supports_kv_scores(&self, spec: &KvCacheSpec) -> bool {
        ops::scores::supports(spec.head_dim, spec.dtype)
    }

    fn accumulate_kv_scores(
        &self,
        q: &CudaTensor,
        cache: &mut CudaKvCache,
        layer: usize,
        n_heads: usize,
        batch: &CudaBatch,
        scale: f32,
    ) -> Result<()> {
        batch.check_cache(cache)?;
        let mut plan = lock(&batch.scores)?;
        let Some(plan) = plan.as_mut().filter(|p| !p.is_empty()) else {
            return Ok(());
        };
        let mut attention = lock(&batch.attention)?;
        let attention = attention.as_mut().ok_or_else(|| {
            BackendError::Unsupported("KV scores of a batch that was never prepared".into())
        })?;
        if n_heads != batch.n_heads || layer >= cache.spec().n_layers {
            return Err(BackendError::Unsupported(format!(
                "KV scores of layer {layer} with {n_heads} heads, the batch was prepared for {}",
                batch.n_heads
            )));
        }
        let geometry = ScoreGeometry::of(cache.spec());
        let (keys, scores) = cache.scored_layer(layer, &self.dev.stream)?;
        Ok(plan.run(
            &self.dev,
            &q.data,
            keys,
            scores,
            &batch.view(&batch.sections.positions),
            layer,
            geometry,
            scale,
            attention.scored_logits_unjoined(),
        )?)
    }

    fn read_kv_scores(
        &self,
        cache: &CudaKvCache,
        block_table: &[u32],
        keys: usize,
    ) -> Result<Vec<f32>> {
        // Scores a step added on the side stream are read below.
        self.dev.join_side()?;
        let spec = *cache.spec();
        if cache.scores().is_none() {
            return Err(BackendError::Unsupported(
                "KV scores read before any step scored keys".into(),
            ));
        }
        if keys > block_table.len() * spec.block_size
            || block_table.iter().any(|&b| b as usize >= spec.max_blocks)
        {
            return Err(BackendError::Unsupported(format!(
                "scores of {keys} keys from a block table of {} blocks",
                block_table.len()
            )));
        }
        let table = self
            .dev
            .stream
            .clone_htod(block_table)
            .map_err(CudaError::from)?;
        Ok(ops::scores::gather(
            &self.dev,
            &cache.addresses()?.slice(2 * spec.n_layers..),
            &table.as_view(),
            spec.n_layers,
            ScoreGeometry::of(&spec),
            keys,
        )?)
    }

    fn write_kv(
        &self,
        cache: &mut CudaKvCache,
        layer: usize,
        k: &CudaTensor,
        v: &CudaTensor,
        batch: &CudaBatch,
    ) -> Result<()> {
        batch.check_cache(cache)?;
        let spec = *cache.spec();
        let slot_len = spec.n_kv_heads * spec.head_dim;
        let (keys, values) = cache.layer_mut(layer);
        if spec.dtype.is_quantized() {
            return Ok(ops::elementwise::write_kv_quant(
                &self.dev,
                spec.dtype,
                keys,
                values,
                &k.data,
                &v.data,
                &batch.view(&batch.sections.slots),
                batch.tokens,
                QuantGeometry::of(&spec),
            )?);
        }
        Ok(ops::elementwise::write_kv(
            &self.dev,
            keys,
            values,
            &k.data,
            &v.data,
            &batch.view(&batch.sections.slots),
            batch.tokens,
            slot_len,
        )?)
    }

    fn qkv_rope_write(
        &self,
        qkv: &CudaTensor,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        _v: &mut CudaTensor,
        head_dim: usize,
        cache: &mut CudaKvCache,
        layer: usize,
        batch: &CudaBatch,
    ) -> Result<()> {
        batch.check_cache(cache)?;
        let (q_cols, kv_cols) = (q.cols, k.cols);
        let spec = *cache.spec();
        let (keys, values) = cache.layer_mut(layer);
        if spec.dtype.is_quantized() {
            return Ok(ops::elementwise::qkv_rope_kv_quant(
                &self.dev,
                spec.dtype,
                &qkv.data,
                &mut q.data,
                keys,
                values,
                batch.tokens,
                QuantGeometry::of(&spec),
                q_cols,
                &batch.view(&batch.sections.positions),
                &batch.view(&batch.sections.slots),
                &batch.inv_freq_dev,
            )?);
        }
        Ok(ops::elementwise::qkv_rope_kv(
            &self.dev,
            &qkv.data,
            &mut q.data,
            keys,
            values,
            batch.tokens,
            (q_cols, kv_cols, head_dim),
            &batch.view(&batch.sections.positions),
            &batch.view(&batch.sections.slots),
            &batch.inv_freq_dev,
        )?)
    }

    fn norm_qkv_rope_write(
        &self,
        x: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
        normed: &mut CudaTensor,
        wqkv: &CudaMatrix,
        qkv: &mut CudaTensor,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        v: &mut CudaTensor,
        head_dim: usize,
        cache: &mut CudaKvCache,
        layer: usize,
        batch: &CudaBatch,
    ) -> Result<()> {
        // A quantized row's scale needs the whole row, which no warp of the fused product holds:
        // quantized caches take the product, then the quantizing RoPE and KV write.
        let fused = wqkv.bf16().filter(|_| {
            gemv_fits(x.rows, wqkv.cols)
                && wqkv.rows == q.cols + 2 * k.cols
                && !cache.spec().dtype.is_quantized()
        });
        let Some(wqkv_data) = fused else {
            // One token finishing a split norm, with a bf16 cache: the product rotates its
            // outputs and writes the KV cache itself.
            if x.rows == 1
                && wqkv.rows == q.cols + 2 * k.cols
                && !cache.spec().dtype.is_quantized()
                && wqkv.links_norm(&self.dev, 1, false)
                && self.take_norm_ahead(x, weight, eps, normed)?
            {
                batch.check_cache(cache)?;
                let (keys, values) = cache.layer_mut(layer);
                let (positions, slots) = (
                    batch.view(&batch.sections.positions),
                    batch.view(&batch.sections.slots),
                );
                let rope = ops::quant::RopeKvOut::new(
                    &self.dev,
                    QkvRopeOut {
                        q: &mut q.data,
                        k_cache: keys,
                        v_cache: values,
                        positions: &positions,
                        slots: &slots,
                        inv_freq: &batch.inv_freq_dev,
                        widths: (q.cols, k.cols, head_dim),
                    },
                )?;
                let out = ProductOut::RopeKv(rope);
                return self.finishing_norm(eps, |link| {
                    crate::matrix::product(
                        &self.dev,
                        &self.decode_scratch,
                        normed,
                        wqkv,
                        (None, link),
                        out,
                    )
                });
            }
            self.norm_linear(x, weight, eps, normed, wqkv, qkv)?;
            return self.qkv_rope_write(qkv, q, k, v, head_dim, cache, layer, batch);
        };
        self.forget_norm_ahead()?;
        batch.check_cache(cache)?;
        let widths = (q.cols, k.cols, head_dim);
        let (k_cache, v_cache) = cache.layer_mut(layer);
        Ok(ops::gemv::gemv_qkv_rope_with_ring(
            &self.dev,
            self.gemv_ring(),
            &x.data,
            x.rows,
            wqkv_data,
            wqkv.cols,
            GemvNorm {
                weight: &weight.data,
                eps,
            },
            QkvRopeOut {
                q: &mut q.data,
                k_cache,
                v_cache,
                positions: &batch.view(&batch.sections.positions),
                slots: &batch.view(&batch.sections.slots),
                inv_freq: &batch.inv_freq_dev,
                widths,
            },
        )?)
    }

    fn attention(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        layer: usize,
        n_heads: usize,
        batch: &CudaBatch,
        scale: f32,
        out: &mut CudaTensor,
    ) -> Result<()> {
        if n_heads != batch.n_heads {
            return Err(BackendError::Unsupported(format!(
                "attention with {n_heads} heads, the batch was prepared for {}",
                batch.n_heads
            )));
        }
        batch.check_cache(cache)?;
        let mut plan = lock(&batch.attention)?;
        let plan = plan.as_mut().ok_or_else(|| {
            BackendError::Unsupported("attention over a batch that was never prepared".into())
        })?;
        let (keys, values) = cache.layer(layer);
        Ok(plan.run(
            &self.dev,
            &q.data,
            keys,
            values,
            scale,
            &mut out.data,
            None,
            layer,
        )?)
    }

    /// Free device memory as the driver reports it (`cuMemGetInfo` in this device's context),
    /// after the stream's pending work, so that buffers freed by earlier steps are counted.
    fn free_memory(&self) -> Option<usize> {
        self.dev.stream.synchronize().ok()?;
        self.dev.ctx.mem_get_info().ok().map(|(free, _total)| free)
    }
}

#[cfg(test)]
mod tests {
    use super::graph_rows;

    #[test]
    fn decode_steps_pad_to_few_shapes_that_hold_them() {
        let padded: Vec<usize> = (1..=17).map(graph_rows).collect();
        assert_eq!(
            padded,
            [1, 2, 4, 4, 6, 6, 8, 8, 16, 16, 16, 16, 16, 16, 16, 16, 24]
        );
        assert!((1..2000).all(|n| graph_rows(n) >= n));
    }
}
