//! Sampling: the argmax of each row of logits, and the full sampler of
//! [`turbo_core::sampling`] (penalties, temperature, top-k, top-p, min-p, the draw).

use super::check;
use crate::device::CudaDevice;
use crate::error::Result;
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};
use half::bf16;
use turbo_core::sampling::{PenaltyLists, SampleParams};

/// Threads per block of the argmax kernels (one block per row).
const THREADS: u32 = 1024;

fn launch<T: DeviceRepr>(
    dev: &CudaDevice,
    kernel: &'static str,
    logits: &CudaSlice<T>,
    rows: usize,
    cols: usize,
) -> Result<Vec<u32>> {
    check(
        cols > 0
            && rows <= i32::MAX as usize
            && cols <= i32::MAX as usize
            && logits.len() >= rows * cols,
        || {
            format!(
                "{kernel}: logits {} elements for rows={rows} cols={cols}",
                logits.len()
            )
        },
    )?;
    if rows == 0 {
        return Ok(Vec::new());
    }
    let mut out = dev.stream.alloc_zeros::<u32>(rows)?;
    let (rows_i, cols_i) = (rows as i32, cols as i32);
    let f = dev.function("sampling", kernel)?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(logits);
    b.arg(&rows_i);
    b.arg(&cols_i);
    b.arg(&mut out);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature and the buffer sizes were checked.
    unsafe { b.launch(cfg) }?;
    Ok(dev.stream.clone_dtoh(&out)?)
}

/// For each row of `logits` (`[rows, cols]`, `cols >= 1`), the index of its largest value, the lowest
/// such index on ties; NaN counts as -inf, and a row with no value above -inf gives
/// [`turbo_core::sampling::NO_FINITE_LOGIT`].
pub fn argmax(
    dev: &CudaDevice,
    logits: &CudaSlice<bf16>,
    rows: usize,
    cols: usize,
) -> Result<Vec<u32>> {
    launch(dev, "argmax_bf16", logits, rows, cols)
}

/// [`argmax`] of f32 logits.
pub fn argmax_f32(
    dev: &CudaDevice,
    logits: &CudaSlice<f32>,
    rows: usize,
    cols: usize,
) -> Result<Vec<u32>> {
    launch(dev, "argmax_f32", logits, rows, cols)
}

/// Threads per block of `sample_f32` (its `SAMPLE_THREADS`; one block per row).
const SAMPLE_THREADS: u32 = 1024;

/// `u32` words of one row's [`SampleParams`], as `sample` reads them.
pub const SAMPLE_PARAM_WORDS: usize = 8;

/// The largest vocabulary [`sample`] takes: the kernel sums weights as `w · 2^40` in 64 bits.
pub const MAX_SAMPLE_VOCAB: usize = 1 << 24;

// The kernel reads the parameters as they are laid out in memory.
const _: () = assert!(std::mem::size_of::<SampleParams>() == SAMPLE_PARAM_WORDS * 4);

/// Chooses one token per row of `logits` (`[rows, vocab]`, f32) by
/// [`turbo_core::sampling::sample_row`], into `out[..rows]`, applying the penalties to `logits`
/// in place.
///
/// `params` holds `rows` [`SampleParams`] as `u32` words ([`param_words`]); row `r` penalizes
/// `penalty_tokens[penalty_offsets[r]..penalty_offsets[r + 1]]`, each generated as often as the
/// same entry of `penalty_counts` says (ids past the vocabulary are ignored; a token listed twice
/// in a row is a race). With no penalized tokens, pass offsets all 0 and any tokens and counts
/// views (one word, say): none is read. Only launches: no allocation, copy or
/// synchronization, so it can be captured in a CUDA graph.
#[allow(clippy::too_many_arguments)]
pub fn sample(
    dev: &CudaDevice,
    logits: &mut CudaSlice<f32>,
    rows: usize,
    vocab: usize,
    params: &CudaView<'_, u32>,
    penalty_offsets: &CudaView<'_, u32>,
    penalty_tokens: &CudaView<'_, u32>,
    penalty_counts: &CudaView<'_, u32>,
    out: &mut CudaViewMut<'_, u32>,
) -> Result<()> {
    check(
        (1..=MAX_SAMPLE_VOCAB).contains(&vocab)
            && rows <= i32::MAX as usize
            && rows.checked_mul(vocab).is_some_and(|n| n <= logits.len())
            && params.len() >= rows * SAMPLE_PARAM_WORDS
            && penalty_offsets.len() > rows
            && penalty_tokens.len() <= u32::MAX as usize
            && penalty_counts.len() >= penalty_tokens.len()
            && out.len() >= rows,
        || {
            format!(
                "sample: logits {} / params {} / penalty offsets {} / penalty tokens {} / counts {} \
                 / out {} elements for rows={rows} vocab={vocab} (vocab at most {MAX_SAMPLE_VOCAB})",
                logits.len(),
                params.len(),
                penalty_offsets.len(),
                penalty_tokens.len(),
                penalty_counts.len(),
                out.len()
            )
        },
    )?;
    if rows == 0 {
        return Ok(());
    }
    let (rows_i, vocab_i) = (rows as i32, vocab as i32);
    let n_tokens = penalty_tokens.len() as u32;
    let f = dev.function("sampling", "sample_f32")?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(logits);
    b.arg(&rows_i);
    b.arg(&vocab_i);
    b.arg(params);
    b.arg(penalty_offsets);
    b.arg(penalty_tokens);
    b.arg(penalty_counts);
    b.arg(&n_tokens);
    b.arg(out);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (SAMPLE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature and the buffer sizes were checked; the
    // kernel clamps the penalty offsets to the tokens' length.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `params` as the `u32` words [`sample`] reads.
pub fn param_words(params: &[SampleParams]) -> Vec<u32> {
    params
        .iter()
        .flat_map(|p| {
            [
                p.temperature.to_bits(),
                p.top_k,
                p.top_p.to_bits(),
                p.min_p.to_bits(),
                p.repetition_penalty.to_bits(),
                p.uniform.to_bits(),
                p.frequency_penalty.to_bits(),
                p.presence_penalty.to_bits(),
            ]
        })
        .collect()
}

/// [`sample`] from host parameters and penalty lists (uploaded, then the tokens downloaded): for
/// tests and benches, not the decode loop.
pub fn sample_host(
    dev: &CudaDevice,
    logits: &mut CudaSlice<f32>,
    rows: usize,
    vocab: usize,
    params: &[SampleParams],
    penalties: &PenaltyLists,
) -> Result<Vec<u32>> {
    let offsets_ok = penalties.offsets.len() == rows + 1
        && penalties.offsets.windows(2).all(|w| w[0] <= w[1])
        && penalties.offsets[rows] as usize <= penalties.tokens.len()
        && penalties.counts.len() == penalties.tokens.len();
    check(params.len() == rows && offsets_ok, || {
        format!(
            "sample_host: {} params and {} penalty offsets (over {} tokens) for rows={rows}",
            params.len(),
            penalties.offsets.len(),
            penalties.tokens.len()
        )
    })?;
    if rows == 0 {
        return Ok(Vec::new());
    }
    let words = param_words(params);
    let params_d = dev.stream.clone_htod(&words)?;
    let offsets_d = dev.stream.clone_htod(&penalties.offsets)?;
    // The kernel takes a view of at least one word even when no token is listed.
    let at_least_one = |v: &[u32]| {
        if v.is_empty() {
            dev.stream.clone_htod(&[0u32])
        } else {
            dev.stream.clone_htod(v)
        }
    };
    let tokens_d = at_least_one(&penalties.tokens)?;
    let counts_d = at_least_one(&penalties.counts)?;
    let mut out = dev.stream.alloc_zeros::<u32>(rows)?;
    sample(
        dev,
        logits,
        rows,
        vocab,
        &params_d.as_view(),
        &offsets_d.as_view(),
        &tokens_d.as_view(),
        &counts_d.as_view(),
        &mut out.as_view_mut(),
    )?;
    Ok(dev.stream.clone_dtoh(&out)?)
}
