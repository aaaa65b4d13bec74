//! `y = x · Wᵀ` for weights in any [`DType`], the CPU's hot path.
//!
//! Few tokens (decode): a matrix-vector product that streams each weight row once and decodes its
//! blocks on the fly into registers, so quantized weights cost their stored size in memory traffic.
//! Many tokens (prefill): row panels are decoded to f32 once and handed to a GEMM, where the decode
//! is amortised over the tokens.

use crate::{quant, DType, WeightMatrix};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use std::cell::RefCell;
use std::sync::OnceLock;

/// Above this many tokens the decode-into-GEMM path wins.
const GEMV_MAX_TOKENS: usize = 4;
/// Output rows per parallel task of the GEMV.
const GEMV_ROWS_PER_TASK: usize = 32;
/// Rows decoded per GEMM panel: bounds the f32 scratch for large matrices.
const GEMM_PANEL_ROWS: usize = 2048;

/// `out[t, r] = Σ_c x[t, c] · w[r, c]` for `n_tokens` rows of `x`.
pub fn linear(x: &[f32], n_tokens: usize, w: &WeightMatrix, out: &mut [f32]) {
    assert_eq!(
        x.len(),
        n_tokens * w.cols,
        "input is not [tokens, {}]",
        w.cols
    );
    assert_eq!(
        out.len(),
        n_tokens * w.rows,
        "output is not [tokens, {}]",
        w.rows
    );
    if n_tokens == 0 {
        return;
    }
    if n_tokens <= GEMV_MAX_TOKENS {
        gemv(x, n_tokens, w, out);
    } else {
        gemm_panels(x, n_tokens, w, out);
    }
}

/// The output pointer shared by GEMV tasks that write disjoint rows.
struct SyncPtr(*mut f32);
unsafe impl Sync for SyncPtr {}
unsafe impl Send for SyncPtr {}

impl SyncPtr {
    fn get(&self) -> *mut f32 {
        self.0
    }
}

fn gemv(x: &[f32], n: usize, w: &WeightMatrix, out: &mut [f32]) {
    let kernel = gemv_kernel();
    let (rows, cols) = (w.rows, w.cols);
    let row_bytes = w.row_bytes();
    let data = w.data.as_slice();
    let out_ptr = SyncPtr(out.as_mut_ptr());
    let tasks = rows.div_ceil(GEMV_ROWS_PER_TASK);
    (0..tasks).into_par_iter().for_each(|task| {
        let r0 = task * GEMV_ROWS_PER_TASK;
        let r1 = (r0 + GEMV_ROWS_PER_TASK).min(rows);
        let mut sums = [0f32; GEMV_MAX_TOKENS];
        for r in r0..r1 {
            let row = &data[r * row_bytes..(r + 1) * row_bytes];
            for chunk in (0..n).step_by(GEMV_MAX_TOKENS) {
                let m = (n - chunk).min(GEMV_MAX_TOKENS);
                // SAFETY: the dispatcher only returns kernels whose CPU features were detected.
                unsafe { kernel(w.dtype, row, &x[chunk * cols..], cols, m, &mut sums) };
                for (t, s) in sums[..m].iter().enumerate() {
                    // SAFETY: each task writes only its own rows; every index is below n * rows.
                    unsafe { *out_ptr.get().add((chunk + t) * rows + r) = *s };
                }
            }
        }
    });
}

type GemvKernel = unsafe fn(DType, &[u8], &[f32], usize, usize, &mut [f32; GEMV_MAX_TOKENS]);

fn gemv_kernel() -> GemvKernel {
    static KERNEL: OnceLock<GemvKernel> = OnceLock::new();
    *KERNEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("fma")
            {
                return row_dots_avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return row_dots_avx2;
            }
        }
        row_dots_portable
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn row_dots_avx512(
    dtype: DType,
    row: &[u8],
    x: &[f32],
    cols: usize,
    m: usize,
    sums: &mut [f32; GEMV_MAX_TOKENS],
) {
    row_dots(dtype, row, x, cols, m, sums)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_dots_avx2(
    dtype: DType,
    row: &[u8],
    x: &[f32],
    cols: usize,
    m: usize,
    sums: &mut [f32; GEMV_MAX_TOKENS],
) {
    row_dots(dtype, row, x, cols, m, sums)
}

unsafe fn row_dots_portable(
    dtype: DType,
    row: &[u8],
    x: &[f32],
    cols: usize,
    m: usize,
    sums: &mut [f32; GEMV_MAX_TOKENS],
) {
    row_dots(dtype, row, x, cols, m, sums)
}

/// Decodes 32 elements starting at element `at` of a row into `out`.
#[inline(always)]
fn decode32(dtype: DType, row: &[u8], at: usize, out: &mut [f32; 32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out
                .iter_mut()
                .zip(row[at * 4..at * 4 + 128].chunks_exact(4))
            {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            let h: &[half::f16] = bytemuck::cast_slice(&row[at * 2..at * 2 + 64]);
            h.convert_to_f32_slice(out);
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(row[at * 2..at * 2 + 64].chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        _ => {
            let bb = dtype.block_bytes();
            let b = at / 32;
            quant::dequantize_block(dtype, &row[b * bb..(b + 1) * bb], out);
        }
    }
}

/// Dot products of one weight row with `m` token rows of `x`, 16 lanes per token.
#[inline(always)]
fn row_dots(
    dtype: DType,
    row: &[u8],
    x: &[f32],
    cols: usize,
    m: usize,
    sums: &mut [f32; GEMV_MAX_TOKENS],
) {
    let mut acc = [[0f32; 16]; GEMV_MAX_TOKENS];
    let mut w = [0f32; 32];
    let full = cols / 32 * 32;
    let mut at = 0;
    while at < full {
        decode32(dtype, row, at, &mut w);
        for (t, acc) in acc.iter_mut().enumerate().take(m) {
            let xs = &x[t * cols + at..t * cols + at + 32];
            for l in 0..16 {
                acc[l] += w[l] * xs[l] + w[l + 16] * xs[l + 16];
            }
        }
        at += 32;
    }
    for (t, s) in sums.iter_mut().enumerate().take(m) {
        let mut total = acc[t].iter().sum::<f32>();
        // Plain float rows may end in a partial group of 32.
        for c in full..cols {
            let wc = match dtype {
                DType::F32 => f32::from_le_bytes(row[c * 4..c * 4 + 4].try_into().unwrap()),
                DType::F16 => half::f16::from_le_bytes([row[c * 2], row[c * 2 + 1]]).to_f32(),
                _ => half::bf16::from_le_bytes([row[c * 2], row[c * 2 + 1]]).to_f32(),
            };
            total += wc * x[t * cols + c];
        }
        *s = total;
    }
}

thread_local! {
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

fn gemm_panels(x: &[f32], n: usize, w: &WeightMatrix, out: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    PANEL.with_borrow_mut(|panel| {
        for r0 in (0..rows).step_by(GEMM_PANEL_ROWS) {
            let pr = (rows - r0).min(GEMM_PANEL_ROWS);
            panel.resize(pr * cols, 0.0);
            panel
                .par_chunks_mut(cols * 16)
                .enumerate()
                .for_each(|(i, chunk)| {
                    for (j, dst) in chunk.chunks_exact_mut(cols).enumerate() {
                        w.dequantize_row(r0 + i * 16 + j, dst);
                    }
                });
            // SAFETY: strides describe in-bounds views: dst is out[:, r0..r0+pr] (row stride
            // `rows`), lhs is x [n, cols], rhs is the panel transposed ([cols, pr], column stride
            // `cols`).
            unsafe {
                gemm::gemm(
                    n,
                    pr,
                    cols,
                    out.as_mut_ptr().add(r0),
                    1,
                    rows as isize,
                    false,
                    x.as_ptr(),
                    1,
                    cols as isize,
                    panel.as_ptr(),
                    cols as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    parallelism,
                );
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row;
    use rand::{Rng, SeedableRng};

    /// f64 reference over the decoded weights.
    fn reference(x: &[f32], n: usize, w: &WeightMatrix) -> Vec<f64> {
        let wf = w.to_f32();
        let mut out = vec![0f64; n * w.rows];
        for t in 0..n {
            for r in 0..w.rows {
                out[t * w.rows + r] = (0..w.cols)
                    .map(|c| x[t * w.cols + c] as f64 * wf[r * w.cols + c] as f64)
                    .sum();
            }
        }
        out
    }

    #[test]
    fn every_dtype_and_path_matches_f64() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for dtype in DType::ALL {
            for (rows, cols) in [(70usize, 96usize), (33, 64), (5, 8192)] {
                let values: Vec<f32> = (0..rows * cols)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let bytes: Vec<u8> = values
                    .chunks(cols)
                    .flat_map(|r| quantize_row(dtype, r))
                    .collect();
                let w = WeightMatrix::new(dtype, rows, cols, crate::Bytes::owned(bytes)).unwrap();
                for n in [1usize, 3, 4, 5, 17] {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
                    let mut out = vec![f32::NAN; n * rows];
                    linear(&x, n, &w, &mut out);
                    let want = reference(&x, n, &w);
                    // f32 accumulation over `cols` terms of magnitude <= 1: error ~ sqrt(cols) ulps.
                    let tol = 1e-6 * cols as f64;
                    for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                        assert!(
                            (*a as f64 - b).abs() <= tol,
                            "{dtype} {rows}x{cols} n={n} [{i}]: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn plain_float_rows_may_end_in_a_partial_group() {
        let w = WeightMatrix::from_f32(2, 35, &(0..70).map(|i| i as f32).collect::<Vec<_>>());
        let x: Vec<f32> = (0..35).map(|i| (i % 3) as f32).collect();
        let mut out = [0f32; 2];
        linear(&x, 1, &w, &mut out);
        let want = reference(&x, 1, &w);
        assert_eq!(out[0] as f64, want[0]);
        assert_eq!(out[1] as f64, want[1]);
    }
}
