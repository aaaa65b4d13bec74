//! Matrix-vector products for steps of at most [`GEMV_MAX_TOKENS`] tokens (`kernels/gemv.cu`):
//! a stream over the weights that fuses the ops around a decode step's products (the RMSNorm
//! before; the residual add, SwiGLU, or RoPE and the KV write after), so each is one kernel
//! instead of two or three.

use super::check;
use crate::device::CudaDevice;
use crate::error::Result;
use cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use half::bf16;

/// The most tokens (rows of `x`) the kernels take.
pub const GEMV_MAX_TOKENS: usize = 4;
/// Warps per block; each computes one output unit.
const WARPS: usize = 8;

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
