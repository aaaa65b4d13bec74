//! Matrix-vector products for steps of at most [`GEMV_MAX_TOKENS`] tokens (`kernels/gemv.cu`):
//! a stream over the weights that fuses the ops around a decode step's products (the RMSNorm
//! before; the residual add, SwiGLU, or RoPE and the KV write after), so each is one kernel
//! instead of two or three.

use super::check;
use crate::device::CudaDevice;
use crate::error::Result;
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, LaunchConfig, PushKernelArg};
use half::bf16;
use std::ffi::c_void;
use std::sync::OnceLock;

/// The most tokens (rows of `x`) the kernels take.
pub const GEMV_MAX_TOKENS: usize = 4;
/// Warps per block; each computes one output unit.
const WARPS: usize = 8;

/// Consumer warps of a ring block (`RING_WARPS` in `kernels/gemv_sm90a.cu`), plus one producer.
const RING_WARPS: usize = 8;
/// Stages a ring block may have (`RING_MAX_STAGES`).
const RING_MAX_STAGES: usize = 8;

/// How the one-token products stream their weights on Hopper (`kernels/gemv_sm90a.cu`): through
/// a shared-memory ring of `ring_bytes` per block, `blocks_per_sm` blocks an SM, each launched as
/// a dependent of the kernel ahead so that its ring fills while that kernel finishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemvRing {
    pub ring_bytes: usize,
    pub blocks_per_sm: usize,
    /// Elements of a row a stage holds per weight row of a unit (a multiple of 256).
    pub chunk: usize,
}

/// Environment variable that sets or turns off [`GemvRing`] (read once a process): `off`, or
/// `KIB:BLOCKS[:CHUNK]` (ring KiB per block, blocks per SM, elements of a row per stage), for
/// measuring the forms side by side.
pub const GEMV_RING_ENV: &str = "TURBO_GEMV_RING";

/// Two blocks an SM with rings of up to 96 KiB each, stages of 1024 elements of each row: the
/// fastest of the forms measured on an H200 (docs/perf/h100.md).
const GEMV_RING_DEFAULT: GemvRing = GemvRing {
    ring_bytes: 96 << 10,
    blocks_per_sm: 2,
    chunk: 1024,
};

/// The ring form in use: [`GEMV_RING_ENV`]'s, else the default; `None` when turned off.
pub fn gemv_ring_config() -> Option<GemvRing> {
    static CONFIG: OnceLock<Option<GemvRing>> = OnceLock::new();
    *CONFIG.get_or_init(|| match std::env::var(GEMV_RING_ENV) {
        Err(_) => Some(GEMV_RING_DEFAULT),
        Ok(v) => parse_gemv_ring(&v).unwrap_or_else(|| {
            tracing::warn!(
                "{GEMV_RING_ENV}={v:?} is not `off` or `KIB:BLOCKS[:CHUNK]`; using the default"
            );
            Some(GEMV_RING_DEFAULT)
        }),
    })
}

/// `off` → `Some(None)`; `KIB:BLOCKS[:CHUNK]` with a ring of 8-220 KiB, 1-4 blocks and chunks
/// of 256-8192 elements (a multiple of 256) → that form.
fn parse_gemv_ring(v: &str) -> Option<Option<GemvRing>> {
    if v.trim() == "off" {
        return Some(None);
    }
    let parts: Vec<usize> = v
        .trim()
        .split(':')
        .map(|p| p.parse().ok())
        .collect::<Option<_>>()?;
    let (kib, blocks, chunk) = match parts[..] {
        [kib, blocks] => (kib, blocks, GEMV_RING_DEFAULT.chunk),
        [kib, blocks, chunk] => (kib, blocks, chunk),
        _ => return None,
    };
    ((8..=220).contains(&kib)
        && (1..=4).contains(&blocks)
        && (256..=8192).contains(&chunk)
        && chunk.is_multiple_of(256))
    .then_some(Some(GemvRing {
        ring_bytes: kib << 10,
        blocks_per_sm: blocks,
        chunk,
    }))
}

/// A ring launch's shape for `units` units of `r` rows of `k` elements.
struct RingShape {
    chunk: usize,
    stages: usize,
    blocks: usize,
    smem: usize,
}

/// Shared memory one block of an SM's `blocks` may have: an H100's or H200's 228 KiB an SM,
/// less the 1 KiB the driver keeps per block and the kernel's own barriers.
fn block_smem_budget(blocks: usize) -> usize {
    (228 << 10) / blocks - (1 << 10) - 256
}

/// The ring form of a one-token product, if this device runs it: chunks of `ring.chunk / r`
/// elements of each row (at least 256; whole rows when shorter), a stage of them for each of the block's units, as
/// many stages (2 to 8) as the ring and the block's room beside x (`norm`: x · g in f32, else x
/// in bf16) hold.
fn ring_shape(
    dev: &CudaDevice,
    ring: Option<GemvRing>,
    tokens: usize,
    units: usize,
    (r, norm): (usize, bool),
    k: usize,
) -> Option<RingShape> {
    let ring = ring?;
    if tokens != 1 || !dev.supports_module("gemv_sm90a") {
        return None;
    }
    let chunk = k.min((ring.chunk / r).max(256));
    let stage = RING_WARPS * r * chunk * 2;
    let x_bytes = k * if norm { 4 } else { 2 };
    let room = block_smem_budget(ring.blocks_per_sm).checked_sub(x_bytes)?;
    let stages = (ring.ring_bytes.min(room) / stage).clamp(2, RING_MAX_STAGES);
    let smem = stages * stage + x_bytes;
    if smem > block_smem_budget(1) {
        return None;
    }
    Some(RingShape {
        chunk,
        stages,
        blocks: balanced_blocks(
            units.div_ceil(RING_WARPS),
            dev.sm_count() * ring.blocks_per_sm,
        ),
        smem,
    })
}

/// Blocks for `groups` groups of units on at most `most` blocks at once: the fewest that give
/// each block the most groups any block must take, so that none waits on a block with one more.
fn balanced_blocks(groups: usize, most: usize) -> usize {
    groups.div_ceil(groups.div_ceil(most.max(1)))
}

/// Launches a `gemv_sm90a` kernel of `shape` with `params` (the kernel's arguments before
/// `chunk` and `stages`, which are appended).
///
/// # Safety
/// `params` are the kernel's leading arguments, in order and of its types, over buffers of the
/// sizes it reads and writes.
unsafe fn launch_ring(
    dev: &CudaDevice,
    name: &'static str,
    shape: &RingShape,
    params: &mut Vec<*mut c_void>,
) -> Result<()> {
    let f = dev.function_with_smem("gemv_sm90a", name, shape.smem)?;
    let (mut chunk, mut stages) = (shape.chunk as i32, shape.stages as i32);
    params.push(&mut chunk as *mut i32 as *mut c_void);
    params.push(&mut stages as *mut i32 as *mut c_void);
    let cfg = LaunchConfig {
        grid_dim: (shape.blocks as u32, 1, 1),
        block_dim: (((RING_WARPS + 1) * 32) as u32, 1, 1),
        shared_mem_bytes: shape.smem as u32,
    };
    // SAFETY: the caller's contract; `chunk` and `stages` are the kernel's last two arguments,
    // and the kernel waits for the kernel ahead before it touches anything but the weights,
    // which nothing in the stream writes.
    unsafe { dev.launch_dependent(&f, cfg, params) }
}

/// A buffer's device address, as a kernel argument.
fn address<T>(s: &impl DevicePtr<T>, dev: &CudaDevice) -> u64 {
    s.device_ptr(&dev.stream).0
}

/// A kernel argument's address, for [`launch_ring`].
fn param<T>(v: &mut T) -> *mut c_void {
    v as *mut T as *mut c_void
}

/// What happens to each `(token, unit)` product.
pub enum GemvOut<'a> {
    /// `out[t, j] = bf16(p)`; `out` is `[tokens, rows]`.
    Bf16(&'a mut CudaSlice<bf16>),
    /// `out[t, j] = p` in f32 (logits).
    F32(&'a mut CudaSlice<f32>),
    /// `out[t, j] = bf16(out[t, j] + p)`: the residual stream, updated in place.
    AddTo(&'a mut CudaSlice<bf16>),
    /// The weight is a fused `[gate; up]` of `2 · units` rows: `out[t, j] = silu(gate) · up`, with
    /// `out` `[tokens, rows / 2]`.
    SwiGlu(&'a mut CudaSlice<bf16>),
}

/// The RMSNorm applied to `x` before the product: `rms_norm(x) · weight`.
#[derive(Clone, Copy)]
pub struct GemvNorm<'a> {
    pub weight: &'a CudaSlice<bf16>,
    pub eps: f32,
}

/// Whether [`gemv`] takes a product of `tokens` rows of width `k`.
pub fn gemv_fits(tokens: usize, k: usize) -> bool {
    (1..=GEMV_MAX_TOKENS).contains(&tokens)
        && k.is_multiple_of(8)
        && k > 0
        && k <= i32::MAX as usize
}

const NAMES: [[&str; GEMV_MAX_TOKENS]; 3] = [
    ["gemv_m1", "gemv_m2", "gemv_m3", "gemv_m4"],
    [
        "gemv_norm_m1",
        "gemv_norm_m2",
        "gemv_norm_m3",
        "gemv_norm_m4",
    ],
    [
        "gemv_norm_swiglu_m1",
        "gemv_norm_swiglu_m2",
        "gemv_norm_swiglu_m3",
        "gemv_norm_swiglu_m4",
    ],
];

/// `out ← x · wᵀ` for `x` `[tokens, k]` and `w` `[rows, k]` (row-major bf16, f32 accumulation),
/// with `norm` applied to `x` first when given. SwiGLU needs `norm` (it follows the feed-forward
/// block's RMSNorm; no other use exists).
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    tokens: usize,
    w: &CudaSlice<bf16>,
    rows: usize,
    k: usize,
    norm: Option<GemvNorm>,
    out: GemvOut,
) -> Result<()> {
    gemv_with_ring(dev, gemv_ring_config(), x, tokens, w, rows, k, norm, out)
}

/// [`gemv`] with the weights streamed through `ring` where the device and the product allow it
/// (one token on Hopper), else as [`gemv`] without a ring: for tests and benches that compare
/// the two forms, which give the same bits.
#[allow(clippy::too_many_arguments)]
pub fn gemv_with_ring(
    dev: &CudaDevice,
    ring: Option<GemvRing>,
    x: &CudaSlice<bf16>,
    tokens: usize,
    w: &CudaSlice<bf16>,
    rows: usize,
    k: usize,
    norm: Option<GemvNorm>,
    out: GemvOut,
) -> Result<()> {
    let swiglu = matches!(out, GemvOut::SwiGlu(_));
    let units = if swiglu { rows / 2 } else { rows };
    let out_len = match &out {
        GemvOut::Bf16(o) | GemvOut::AddTo(o) | GemvOut::SwiGlu(o) => o.len(),
        GemvOut::F32(o) => o.len(),
    };
    check(
        gemv_fits(tokens, k)
            && rows > 0
            && rows <= i32::MAX as usize
            && (!swiglu || (rows.is_multiple_of(2) && norm.is_some()))
            && x.len() >= tokens * k
            && w.len() >= rows * k
            && out_len >= tokens * units
            && norm.as_ref().is_none_or(|n| n.weight.len() >= k),
        || {
            format!(
                "gemv: x {} / w {} / out {out_len} elements for tokens={tokens} rows={rows} k={k} \
                 (at most {GEMV_MAX_TOKENS} tokens, k a multiple of 8, SwiGLU with a norm)",
                x.len(),
                w.len()
            )
        },
    )?;
    let kind = match (&norm, swiglu) {
        (None, _) => 0,
        (Some(_), false) => 1,
        (Some(_), true) => 2,
    };
    if let Some(shape) = ring_shape(
        dev,
        ring,
        tokens,
        units,
        (if swiglu { 2 } else { 1 }, norm.is_some()),
        k,
    ) {
        let name = [
            "gemv_ring_m1",
            "gemv_ring_norm_m1",
            "gemv_ring_norm_swiglu_m1",
        ][kind];
        let mut w_p = address(w, dev);
        let mut x_p = address(x, dev);
        let (mut g_p, mut eps) = match &norm {
            Some(n) => (address(n.weight, dev), n.eps),
            None => (w_p, 0.0f32),
        };
        let mut mode: i32 = match out {
            GemvOut::F32(_) => 1,
            GemvOut::AddTo(_) => 2,
            GemvOut::Bf16(_) | GemvOut::SwiGlu(_) => 0,
        };
        let mut out_p = match out {
            GemvOut::Bf16(o) | GemvOut::AddTo(o) | GemvOut::SwiGlu(o) => address(o, dev),
            GemvOut::F32(o) => address(o, dev),
        };
        let (mut units_i, mut k_i) = (units as i32, k as i32);
        let mut params = vec![
            param(&mut w_p),
            param(&mut x_p),
            param(&mut g_p),
            param(&mut eps),
            param(&mut out_p),
            param(&mut units_i),
            param(&mut k_i),
            param(&mut mode),
        ];
        // SAFETY: the arguments of `gemv_ring_*_m1` in order; the sizes were checked above as
        // for the kernels of gemv.cu, whose bounds these kernels share.
        return unsafe { launch_ring(dev, name, &shape, &mut params) };
    }
    let f = dev.function("gemv", NAMES[kind][tokens - 1])?;
    let (g, eps) = match &norm {
        Some(n) => (n.weight, n.eps),
        None => (w, 0.0),
    };
    let (units_i, k_i) = (units as i32, k as i32);
    let mode: i32 = match out {
        GemvOut::F32(_) => 1,
        GemvOut::AddTo(_) => 2,
        GemvOut::Bf16(_) | GemvOut::SwiGlu(_) => 0,
    };
    let mut b = dev.stream.launch_builder(&f);
    b.arg(w);
    b.arg(x);
    b.arg(g);
    b.arg(&eps);
    match out {
        GemvOut::Bf16(o) | GemvOut::AddTo(o) | GemvOut::SwiGlu(o) => b.arg(o),
        GemvOut::F32(o) => b.arg(o),
    };
    b.arg(&units_i);
    b.arg(&k_i);
    b.arg(&mode);
    let cfg = LaunchConfig {
        grid_dim: (units.div_ceil(WARPS) as u32, 1, 1),
        block_dim: ((WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; the sizes were checked, and device
    // allocations are 256-byte aligned, so with k % 8 == 0 every 16-byte load is aligned.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// The tensor-parallel group that [`gemv_all_reduce`] sums over: its peer-mapped flagged inboxes
/// (`p2p.rs`, `kernels/comm.cu`).
pub struct GemvGroup<'a> {
    pub rank: usize,
    pub world: usize,
    /// Every rank's buffers, as the peer all-reduce kernels take them.
    pub table: &'a CudaSlice<u64>,
    /// 16-byte lines of a sender's inbox slot (4 values each).
    pub slot_lines: usize,
    /// Device address of the group's abort flag.
    pub abort_flag: u64,
    /// Fewest SMs of the group's GPUs: every rank must make the same choice of kernel.
    pub sms: usize,
}

const ALL_REDUCE_NAMES: [&str; GEMV_MAX_TOKENS] = [
    "gemv_all_reduce_m1",
    "gemv_all_reduce_m2",
    "gemv_all_reduce_m3",
    "gemv_all_reduce_m4",
];

/// A row-parallel product of a split decode step and its all-reduce in one kernel: rank 0's
/// `bf16(residual + x · wᵀ)` and every other rank's `bf16(x · wᵀ)`, summed over the group in rank
/// order into `residual` on every rank, the same bits as [`gemv`] followed by the peer
/// all-reduce. Returns `false`, launching nothing, where the kernel does not apply: `rows` not a
/// multiple of the block's 8 outputs, a message larger than an inbox slot, or a grid that the
/// GPU cannot hold resident at once (each block waits for its peers' block of the same index).
#[allow(clippy::too_many_arguments)]
pub fn gemv_all_reduce(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    tokens: usize,
    w: &CudaSlice<bf16>,
    rows: usize,
    k: usize,
    residual: &mut CudaSlice<bf16>,
    group: &GemvGroup,
) -> Result<bool> {
    gemv_all_reduce_with_ring(
        dev,
        gemv_ring_config(),
        x,
        tokens,
        w,
        rows,
        k,
        residual,
        group,
    )
}

/// [`gemv_all_reduce`] with the weights of one-token steps streamed through `ring` (Hopper;
/// every rank must pass the same): the same bits.
#[allow(clippy::too_many_arguments)]
pub fn gemv_all_reduce_with_ring(
    dev: &CudaDevice,
    ring: Option<GemvRing>,
    x: &CudaSlice<bf16>,
    tokens: usize,
    w: &CudaSlice<bf16>,
    rows: usize,
    k: usize,
    residual: &mut CudaSlice<bf16>,
    group: &GemvGroup,
) -> Result<bool> {
    if !rows.is_multiple_of(WARPS) || tokens * rows > 4 * group.slot_lines {
        return Ok(false);
    }
    check(
        gemv_fits(tokens, k)
            && rows > 0
            && rows <= i32::MAX as usize
            && x.len() >= tokens * k
            && w.len() >= rows * k
            && residual.len() >= tokens * rows,
        || {
            format!(
                "gemv_all_reduce: x {} / w {} / residual {} elements for tokens={tokens} \
                 rows={rows} k={k}",
                x.len(),
                w.len(),
                residual.len()
            )
        },
    )?;
    if let Some(done) = ring_all_reduce(dev, ring, x, tokens, w, rows, k, residual, group)? {
        return Ok(done);
    }
    let f = dev.function("gemv", ALL_REDUCE_NAMES[tokens - 1])?;
    let threads = (WARPS * 32) as u32;
    let blocks = rows / WARPS;
    let resident = f.occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)? as usize;
    if resident * group.sms < blocks {
        return Ok(false);
    }
    let (units_i, k_i) = (rows as i32, k as i32);
    let (rank_i, world_i) = (group.rank as i32, group.world as i32);
    let slot_lines = group.slot_lines as i64;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(w);
    b.arg(x);
    b.arg(residual);
    b.arg(&units_i);
    b.arg(&k_i);
    b.arg(&rank_i);
    b.arg(&world_i);
    b.arg(group.table);
    b.arg(&slot_lines);
    b.arg(&group.abort_flag);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; the sizes were checked; the table
    // names the group's buffers, alive as long as the group, of the sizes the kernel assumes.
    unsafe { b.launch(cfg) }?;
    Ok(true)
}

/// The ring form of [`gemv_all_reduce_with_ring`]: `Some(true)` when launched, `None` where it
/// does not apply (more than one token, no ring, or a grid the GPUs cannot hold resident), so
/// that `gemv.cu`'s kernel is tried. The grid follows the group's fewest SMs, so every rank
/// launches the same blocks over the same groups.
#[allow(clippy::too_many_arguments)]
fn ring_all_reduce(
    dev: &CudaDevice,
    ring: Option<GemvRing>,
    x: &CudaSlice<bf16>,
    tokens: usize,
    w: &CudaSlice<bf16>,
    rows: usize,
    k: usize,
    residual: &mut CudaSlice<bf16>,
    group: &GemvGroup,
) -> Result<Option<bool>> {
    let Some(config) = ring else { return Ok(None) };
    let Some(mut shape) = ring_shape(dev, ring, tokens, rows, (1, false), k) else {
        return Ok(None);
    };
    if !rows.is_multiple_of(RING_WARPS) {
        return Ok(None);
    }
    shape.blocks = balanced_blocks(rows / RING_WARPS, group.sms * config.blocks_per_sm);
    let name = "gemv_ring_all_reduce_m1";
    let f = dev.function_with_smem("gemv_sm90a", name, shape.smem)?;
    let threads = ((RING_WARPS + 1) * 32) as u32;
    let resident = f.occupancy_max_active_blocks_per_multiprocessor(threads, shape.smem, None)?;
    if (resident as usize) * group.sms < shape.blocks {
        return Ok(None);
    }
    let mut w_p = address(w, dev);
    let mut x_p = address(x, dev);
    let mut res_p = address(residual, dev);
    let (mut units_i, mut k_i) = (rows as i32, k as i32);
    let (mut rank_i, mut world_i) = (group.rank as i32, group.world as i32);
    let mut table_p = address(group.table, dev);
    let mut slot_lines = group.slot_lines as i64;
    let mut abort = group.abort_flag;
    let mut params = vec![
        param(&mut w_p),
        param(&mut x_p),
        param(&mut res_p),
        param(&mut units_i),
        param(&mut k_i),
        param(&mut rank_i),
        param(&mut world_i),
        param(&mut table_p),
        param(&mut slot_lines),
        param(&mut abort),
    ];
    // SAFETY: the arguments of `gemv_ring_all_reduce_m1` in order; the sizes were checked by
    // the caller; the table names the group's buffers, alive as long as the group, of the sizes
    // the kernel assumes; every block is resident at once (checked above).
    unsafe { launch_ring(dev, name, &shape, &mut params) }?;
    Ok(Some(true))
}

/// Where [`gemv_qkv_rope`] puts its results, and the step's rotary positions.
pub struct QkvRopeOut<'a, 'b> {
    /// `[tokens, q_cols]`, the rotated queries.
    pub q: &'a mut CudaSlice<bf16>,
    /// One layer's paged keys and values, `kv_cols` per slot.
    pub k_cache: &'a mut CudaSlice<bf16>,
    pub v_cache: &'a mut CudaSlice<bf16>,
    pub positions: &'a CudaView<'b, u32>,
    pub slots: &'a CudaView<'b, u32>,
    pub inv_freq: &'a CudaSlice<f32>,
    /// `(q_cols, kv_cols, head_dim)`.
    pub widths: (usize, usize, usize),
}

impl QkvRopeOut<'_, '_> {
    /// Whether the widths are whole heads of pairs and the buffers hold `tokens` tokens' queries,
    /// positions and slots, and the rotation's frequencies.
    pub(crate) fn fits(&self, tokens: usize) -> bool {
        let (q_cols, kv_cols, head_dim) = self.widths;
        head_dim > 0
            && head_dim % 2 == 0
            && q_cols % head_dim == 0
            && kv_cols % head_dim == 0
            && kv_cols > 0
            && q_cols + 2 * kv_cols <= i32::MAX as usize
            && self.q.len() >= tokens * q_cols
            && self.positions.len() >= tokens
            && self.slots.len() >= tokens
            && self.inv_freq.len() >= head_dim / 2
    }
}

/// The attention block's first product and the step after it, in one kernel: `rms_norm(x) ·
/// wqkvᵀ` for the fused `[W_q; W_k; W_v]`, then what `elementwise::qkv_rope_kv` does with it
/// (rotated queries to `q`, rotated keys and values to each token's slot), with the same
/// rounding, so the two paths agree bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn gemv_qkv_rope(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    tokens: usize,
    w: &CudaSlice<bf16>,
    k: usize,
    norm: GemvNorm,
    out: QkvRopeOut,
) -> Result<()> {
    gemv_qkv_rope_with_ring(dev, gemv_ring_config(), x, tokens, w, k, norm, out)
}

/// [`gemv_qkv_rope`] with an explicit [`GemvRing`] (see [`gemv_with_ring`]).
#[allow(clippy::too_many_arguments)]
pub fn gemv_qkv_rope_with_ring(
    dev: &CudaDevice,
    ring: Option<GemvRing>,
    x: &CudaSlice<bf16>,
    tokens: usize,
    w: &CudaSlice<bf16>,
    k: usize,
    norm: GemvNorm,
    out: QkvRopeOut,
) -> Result<()> {
    let (q_cols, kv_cols, head_dim) = out.widths;
    let rows = q_cols + 2 * kv_cols;
    check(
        gemv_fits(tokens, k)
            && out.fits(tokens)
            && x.len() >= tokens * k
            && w.len() >= rows * k
            && norm.weight.len() >= k,
        || {
            format!(
                "gemv_qkv_rope: x {} / w {} / q {} elements for tokens={tokens} k={k} \
                 q_cols={q_cols} kv_cols={kv_cols} head_dim={head_dim}",
                x.len(),
                w.len(),
                out.q.len()
            )
        },
    )?;
    let cache_slots = (out.k_cache.len().min(out.v_cache.len()) / kv_cols.max(1)) as i64;
    let (q_i, kv_i, hd_i, k_i) = (q_cols as i32, kv_cols as i32, head_dim as i32, k as i32);
    if let Some(shape) = ring_shape(dev, ring, tokens, rows / 2, (2, true), k) {
        let mut w_p = address(w, dev);
        let mut x_p = address(x, dev);
        let mut g_p = address(norm.weight, dev);
        let mut eps = norm.eps;
        let mut q_p = address(out.q, dev);
        let mut kc_p = address(out.k_cache, dev);
        let mut vc_p = address(out.v_cache, dev);
        let mut pos_p = address(out.positions, dev);
        let mut slots_p = address(out.slots, dev);
        let mut freq_p = address(out.inv_freq, dev);
        let (mut q_i, mut kv_i, mut hd_i, mut k_i) = (q_i, kv_i, hd_i, k_i);
        let mut cache_slots = cache_slots;
        let mut params = vec![
            param(&mut w_p),
            param(&mut x_p),
            param(&mut g_p),
            param(&mut eps),
            param(&mut q_p),
            param(&mut kc_p),
            param(&mut vc_p),
            param(&mut pos_p),
            param(&mut slots_p),
            param(&mut freq_p),
            param(&mut q_i),
            param(&mut kv_i),
            param(&mut hd_i),
            param(&mut cache_slots),
            param(&mut k_i),
        ];
        // SAFETY: the arguments of `gemv_ring_norm_qkv_rope_m1` in order; the sizes were
        // checked above as for gemv.cu's kernel (slots past the caches are skipped).
        return unsafe { launch_ring(dev, "gemv_ring_norm_qkv_rope_m1", &shape, &mut params) };
    }
    let f = dev.function("gemv", QKV_ROPE_NAMES[tokens - 1])?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(w);
    b.arg(x);
    b.arg(norm.weight);
    b.arg(&norm.eps);
    b.arg(out.q);
    b.arg(out.k_cache);
    b.arg(out.v_cache);
    b.arg(out.positions);
    b.arg(out.slots);
    b.arg(out.inv_freq);
    b.arg(&q_i);
    b.arg(&kv_i);
    b.arg(&hd_i);
    b.arg(&cache_slots);
    b.arg(&k_i);
    let cfg = LaunchConfig {
        grid_dim: ((rows / 2).div_ceil(WARPS) as u32, 1, 1),
        block_dim: ((WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; the sizes were checked (the kernel
    // skips slots past the caches), and with k % 8 == 0 every 16-byte load is aligned.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

const QKV_ROPE_NAMES: [&str; GEMV_MAX_TOKENS] = [
    "gemv_norm_qkv_rope_m1",
    "gemv_norm_qkv_rope_m2",
    "gemv_norm_qkv_rope_m3",
    "gemv_norm_qkv_rope_m4",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_setting_parses_off_and_sizes() {
        assert_eq!(parse_gemv_ring("off"), Some(None));
        assert_eq!(
            parse_gemv_ring(" 64:3 "),
            Some(Some(GemvRing {
                ring_bytes: 64 << 10,
                blocks_per_sm: 3,
                chunk: 1024,
            }))
        );
        assert_eq!(parse_gemv_ring("96:2:2048").unwrap().unwrap().chunk, 2048);
        for bad in [
            "", "on", "64", "64:0", "4:2", "300:1", "64:5", "a:b", "96:2:100", "96:2:1:1",
        ] {
            assert_eq!(parse_gemv_ring(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn blocks_take_equal_shares_of_groups() {
        // 384 groups on at most 264 blocks: two each on 192 blocks, not one or two on 264.
        assert_eq!(balanced_blocks(384, 264), 192);
        assert_eq!(balanced_blocks(1792, 264), 256);
        assert_eq!(balanced_blocks(100, 264), 100);
        assert_eq!(balanced_blocks(6144, 264), 256);
    }
}
