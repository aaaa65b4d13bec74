//! Merging attention states `(o, lse)` (`kernels/merge.cu`), with the arithmetic of
//! [`turbo_attention::merge_states`] and [`turbo_attention::merge_into`]: shifted by the largest
//! lse, empty states (`lse = -inf`) skipped without reading their `o`, all-empty giving exactly
//! `o = 0, lse = -inf`.
//!
//! States are f32, one per (row, head): `o` is `[rows][heads][head_dim]` and `lse` `[rows][heads]`.
//! [`merge_states`] takes `n` such sets stacked chunk-major, `[n][rows][heads][head_dim]` and
//! `[n][rows][heads]`, which is what a pass over `n` KV chunks writes when each chunk's launch (or
//! grid slice) fills its own slab (the paged attention kernels merge their own split rows, a
//! varying number of ranges each, in the launch that computes them). The merged `o` is written as
//! f32 or bf16 ([`MergeOutput`]).

use super::check;
use crate::device::CudaDevice;
use crate::error::Result;
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use half::bf16;

/// How many states make one set: one per (row, head), `head_dim` values each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateShape {
    pub rows: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl StateShape {
    /// (row, head) pairs.
    pub fn pairs(&self) -> usize {
        self.rows * self.heads
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

/// Element types a merged `o` can be written in: `f32` (to merge again later, or for tests) and
/// `bf16` (the activations' type).
pub trait MergeOutput: DeviceRepr + sealed::Sealed {
    /// `merge_states` kernels for 1 and 4 dimensions per thread.
    #[doc(hidden)]
    const STATES: [&'static str; 2];
    /// `merge_state` kernels for 1 and 4 dimensions per thread.
    #[doc(hidden)]
    const STATE: [&'static str; 2];
}

impl MergeOutput for f32 {
    const STATES: [&'static str; 2] = ["merge_states_f32_v1", "merge_states_f32_v4"];
    const STATE: [&'static str; 2] = ["merge_state_f32_v1", "merge_state_f32_v4"];
}

impl MergeOutput for bf16 {
    const STATES: [&'static str; 2] = ["merge_states_bf16_v1", "merge_states_bf16_v4"];
    const STATE: [&'static str; 2] = ["merge_state_bf16_v1", "merge_state_bf16_v4"];
}

/// Threads a block aims for: several pairs per block when head_dim is small.
const BLOCK_THREADS: usize = 256;

/// The launch for `shape`: 4 dimensions per thread (16-byte loads) when head_dim allows, one
/// pair per `head_dim / vec` threads (blockDim.x), as many pairs per block as fit
/// [`BLOCK_THREADS`] (blockDim.y). Returns the kernel variant (0: 1 dimension per thread, 1: 4)
/// and the config; fails when a pair needs more than 1024 threads or the grid is too large.
fn launch(what: &str, shape: StateShape) -> Result<(usize, LaunchConfig)> {
    let d = shape.head_dim;
    let (variant, vec) = if d.is_multiple_of(4) { (1, 4) } else { (0, 1) };
    let per_pair = d / vec;
    check(d > 0 && per_pair <= 1024 && d <= i32::MAX as usize, || {
        format!("{what}: head_dim {d} unsupported (1 to 1024, or up to 4096 if a multiple of 4)")
    })?;
    let per_block = (BLOCK_THREADS / per_pair).max(1);
    let blocks = shape
        .rows
        .checked_mul(shape.heads)
        .map(|pairs| pairs.div_ceil(per_block));
    check(blocks.is_some_and(|b| b <= i32::MAX as usize), || {
        format!(
            "{what}: {} rows of {} heads are too many",
            shape.rows, shape.heads
        )
    })?;
    let blocks = blocks.unwrap_or(0);
    Ok((
        variant,
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (per_pair as u32, per_block as u32, 1),
            shared_mem_bytes: 0,
        },
    ))
}

/// `rows · heads · head_dim` (and `rows · heads`), or a shape error if it overflows.
fn sizes(what: &str, shape: StateShape, n: usize) -> Result<(usize, usize)> {
    let pairs = shape.rows.checked_mul(shape.heads);
    let lse = pairs.and_then(|p| p.checked_mul(n));
    let o = lse.and_then(|l| l.checked_mul(shape.head_dim));
    match (o, lse) {
        (Some(o), Some(lse)) if o <= isize::MAX as usize / 4 => Ok((o, lse)),
        _ => Err(crate::error::CudaError::Shape(format!(
            "{what}: {n} sets of {shape:?} overflow"
        ))),
    }
}

/// Merges `n` sets of states (`o` `[n][rows][heads][head_dim]`, `lse` `[n][rows][heads]`) into
/// one: `out` `[rows][heads][head_dim]` and, when given, `out_lse` `[rows][heads]`. With `n = 0`
/// every pair is the empty state.
#[allow(clippy::too_many_arguments)]
pub fn merge_states<T: MergeOutput>(
    dev: &CudaDevice,
    shape: StateShape,
    n: usize,
    o: &CudaSlice<f32>,
    lse: &CudaSlice<f32>,
    out: &mut CudaSlice<T>,
    out_lse: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    let (variant, cfg) = launch("merge_states", shape)?;
    let (o_len, lse_len) = sizes("merge_states", shape, n)?;
    let (out_len, pairs) = sizes("merge_states", shape, 1)?;
    check(
        n <= i32::MAX as usize
            && o.len() >= o_len
            && lse.len() >= lse_len
            && out.len() >= out_len
            && out_lse.as_ref().is_none_or(|l| l.len() >= pairs),
        || {
            format!(
                "merge_states: o {} / lse {} / out {} / out_lse {:?} elements for {n} sets of {shape:?}",
                o.len(),
                lse.len(),
                out.len(),
                out_lse.as_ref().map(|l| l.len()),
            )
        },
    )?;
    if pairs == 0 {
        return Ok(());
    }
    let f = dev.function("merge", T::STATES[variant])?;
    let (n_i, pairs_u, d_i) = (n as i32, pairs as u64, shape.head_dim as i32);
    let null: u64 = 0;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(o).arg(lse).arg(&n_i).arg(&pairs_u).arg(&d_i).arg(out);
    match out_lse {
        Some(l) => b.arg(l),
        None => b.arg(&null),
    };
    // SAFETY: the arguments match merge_states_*'s parameters (size_t pairs as u64, null for no
    // lse) and every buffer holds at least the elements the kernel indexes, checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Merges two sets of states, `(o_a, lse_a)` and `(o_b, lse_b)` (`[rows][heads][head_dim]` and
/// `[rows][heads]` each), into `out` and, when given, `out_lse`.
#[allow(clippy::too_many_arguments)]
pub fn merge_state<T: MergeOutput>(
    dev: &CudaDevice,
    shape: StateShape,
    o_a: &CudaSlice<f32>,
    lse_a: &CudaSlice<f32>,
    o_b: &CudaSlice<f32>,
    lse_b: &CudaSlice<f32>,
    out: &mut CudaSlice<T>,
    out_lse: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    let (variant, cfg) = launch("merge_state", shape)?;
    let (o_len, pairs) = sizes("merge_state", shape, 1)?;
    check(
        o_a.len() >= o_len
            && o_b.len() >= o_len
            && lse_a.len() >= pairs
            && lse_b.len() >= pairs
            && out.len() >= o_len
            && out_lse.as_ref().is_none_or(|l| l.len() >= pairs),
        || {
            format!(
                "merge_state: o_a {} / lse_a {} / o_b {} / lse_b {} / out {} / out_lse {:?} elements for {shape:?}",
                o_a.len(),
                lse_a.len(),
                o_b.len(),
                lse_b.len(),
                out.len(),
                out_lse.as_ref().map(|l| l.len()),
            )
        },
    )?;
    if pairs == 0 {
        return Ok(());
    }
    let f = dev.function("merge", T::STATE[variant])?;
    let (pairs_u, d_i) = (pairs as u64, shape.head_dim as i32);
    let null: u64 = 0;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(o_a)
        .arg(lse_a)
        .arg(o_b)
        .arg(lse_b)
        .arg(&pairs_u)
        .arg(&d_i)
        .arg(out);
    match out_lse {
        Some(l) => b.arg(l),
        None => b.arg(&null),
    };
    // SAFETY: the arguments match merge_state_*'s parameters and every buffer holds at least the
    // elements the kernel indexes, checked above; `out` cannot alias the inputs (it is borrowed
    // mutably).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Merges `(o_b, lse_b)` into `(o_a, lse_a)` in place, as [`turbo_attention::merge_into`] does
/// per pair: an empty b leaves a untouched, an empty a becomes a copy of b.
pub fn merge_state_in_place(
    dev: &CudaDevice,
    shape: StateShape,
    o_a: &mut CudaSlice<f32>,
    lse_a: &mut CudaSlice<f32>,
    o_b: &CudaSlice<f32>,
    lse_b: &CudaSlice<f32>,
) -> Result<()> {
    let (variant, cfg) = launch("merge_state_in_place", shape)?;
    let (o_len, pairs) = sizes("merge_state_in_place", shape, 1)?;
    check(
        o_a.len() >= o_len && o_b.len() >= o_len && lse_a.len() >= pairs && lse_b.len() >= pairs,
        || {
            format!(
                "merge_state_in_place: o_a {} / lse_a {} / o_b {} / lse_b {} elements for {shape:?}",
                o_a.len(),
                lse_a.len(),
                o_b.len(),
                lse_b.len(),
            )
        },
    )?;
    if pairs == 0 {
        return Ok(());
    }
    let name = ["merge_state_inplace_v1", "merge_state_inplace_v4"][variant];
    let f = dev.function("merge", name)?;
    let (pairs_u, d_i) = (pairs as u64, shape.head_dim as i32);
    let mut b = dev.stream.launch_builder(&f);
    b.arg(o_a)
        .arg(lse_a)
        .arg(o_b)
        .arg(lse_b)
        .arg(&pairs_u)
        .arg(&d_i);
    // SAFETY: the arguments match merge_state_inplace_*'s parameters and every buffer holds at
    // least the elements the kernel indexes, checked above; a and b are distinct allocations (a is
    // borrowed mutably). All threads of a block reach its one barrier.
    unsafe { b.launch(cfg) }?;
    Ok(())
}
