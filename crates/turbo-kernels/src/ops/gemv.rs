//! Matrix-vector products for steps of at most [`GEMV_MAX_TOKENS`] tokens (`kernels/gemv.cu`):
//! a stream over the weights that fuses the ops around a decode step's products (the RMSNorm
//! before, the residual add or SwiGLU after), so each is one kernel instead of two or three.

use super::check;
use crate::device::CudaDevice;
use crate::error::Result;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
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
pub struct GemvNorm<'a> {
    pub weight: &'a CudaSlice<bf16>,
    pub eps: f32,
}

/// Whether [`gemv`] takes a product of `tokens` rows of width `k`.
pub fn gemv_fits(tokens: usize, k: usize) -> bool {
    (1..=GEMV_MAX_TOKENS).contains(&tokens) && k % 8 == 0 && k > 0 && k <= i32::MAX as usize
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
            && (!swiglu || (rows % 2 == 0 && norm.is_some()))
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
