//! Decode products with activations rounded to 8 bits, a choice beside the exact f32 path.
//!
//! llama.cpp's CPU decode multiplies its 4- and 8-bit weight blocks with activations quantized to
//! 8 bits per 32 elements, so that the inner products are integer multiply-adds on bytes (32
//! products per instruction pair on AVX2) rather than f32 FMAs on decoded weights. This module
//! does the same for Q4_0, Q4_1 and Q8_0 weights when [`CpuActivations::Q8`] is chosen:
//! activations of each token become blocks of 32 `i8` codes with one f32 scale
//! (`d = max|x| / 127`, `code = round_ties_even(x / d)`), and each weight block's dot product with
//! an activation block is exact integer arithmetic scaled once by `d_w · d_x` (plus, for Q4_1,
//! its minimum times the activation block's sum). The only rounding beyond f32 accumulation is
//! the activations' own: the results differ from the f32 path by that, and `docs/perf/cpu.md`
//! reports what it costs in perplexity.

use super::linear::f16_at;
use crate::{DType, WeightMatrix};
use std::ops::Range;

/// How the CPU backend's decode products (up to a few tokens) treat activations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpuActivations {
    /// Exact: f32 activations times exactly decoded weights.
    #[default]
    F32,
    /// Activations rounded to 8 bits per 32 elements for Q4_0, Q4_1 and Q8_0 weights (other
    /// types, and prefill, stay f32).
    Q8,
}

impl CpuActivations {
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(CpuActivations::F32),
            "q8" | "int8" => Some(CpuActivations::Q8),
            _ => None,
        }
    }
}

/// Whether Q8 activations serve products with weights of `dtype`.
pub(crate) fn serves(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0)
}

/// Activations of up to a few tokens as 8-bit blocks of 32: `codes[t][c]`, and per token and
/// block the scale `d` and `d · Σ codes` (for weights with a minimum).
pub(crate) struct Q8Activations {
    pub codes: Vec<i8>,
    pub d: Vec<f32>,
    pub sum: Vec<f32>,
}

impl Q8Activations {
    /// Quantizes `n` rows of `cols` (a multiple of 32) values of `x`.
    pub fn new(x: &[f32], n: usize, cols: usize) -> Self {
        assert!(cols.is_multiple_of(32) && x.len() >= n * cols);
        let blocks = n * cols / 32;
        let mut q = Q8Activations {
            codes: vec![0; n * cols],
            d: vec![0.0; blocks],
            sum: vec![0.0; blocks],
        };
        for (b, (xs, codes)) in x[..n * cols]
            .chunks_exact(32)
            .zip(q.codes.chunks_exact_mut(32))
            .enumerate()
        {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut total = 0i32;
            for (c, &v) in codes.iter_mut().zip(xs) {
                *c = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
                total += *c as i32;
            }
            q.d[b] = d;
            q.sum[b] = d * total as f32;
        }
        q
    }

    /// The value code `c` of token `t` stands for, in rows of `cols` (for references).
    #[cfg(test)]
    pub fn value(&self, t: usize, c: usize, cols: usize) -> f32 {
        self.codes[t * cols + c] as f32 * self.d[(t * cols + c) / 32]
    }
}

/// `out[t, r] = Σ_c x[t, c] · w[r, c]` with `x` rounded to 8 bits, for `n` <= 4 tokens and a
/// weight type [`serves`] accepts.
pub(crate) fn gemv_q8(x: &[f32], n: usize, w: &WeightMatrix, out: &mut [f32]) {
    debug_assert!(serves(w.dtype) && n <= 4);
    let acts = Q8Activations::new(x, n, w.cols);
    let kernel = kernel();
    let out_ptr = super::linear::SyncPtr(out.as_mut_ptr());
    super::linear::for_row_tasks(w.rows, |rows| {
        // SAFETY: the dispatcher returns only kernels whose CPU features were detected; each task
        // writes only its own rows of `out` (row stride `w.rows`), all below n * w.rows.
        unsafe { kernel(w, rows, &acts, n, out_ptr.get()) };
    });
}

type Q8Kernel = unsafe fn(&WeightMatrix, Range<usize>, &Q8Activations, usize, *mut f32);

fn kernel() -> Q8Kernel {
    static KERNEL: std::sync::OnceLock<Q8Kernel> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return avx2::rows;
        }
        rows_portable
    })
}

/// Where a served block's codes start, after its f16 scale (and, for Q4_1, its f16 minimum).
fn codes_at(dtype: DType) -> usize {
    match dtype {
        DType::Q4_1 => 4,
        _ => 2,
    }
}

/// The scalar kernel: the reference for the vector one, and the path of CPUs without AVX2.
unsafe fn rows_portable(
    w: &WeightMatrix,
    rows: Range<usize>,
    a: &Q8Activations,
    n: usize,
    out: *mut f32,
) {
    let (bytes, at) = (w.dtype.block_bytes(), codes_at(w.dtype));
    let data = w.data.as_slice();
    let row_bytes = w.row_bytes();
    let blocks = w.cols / 32;
    for r in rows {
        let row = &data[r * row_bytes..(r + 1) * row_bytes];
        for t in 0..n {
            let mut total = 0f32;
            for g in 0..blocks {
                let blk = &row[g * bytes..(g + 1) * bytes];
                let xs = &a.codes[t * w.cols + g * 32..][..32];
                let (dx, sx) = (a.d[t * blocks + g], a.sum[t * blocks + g]);
                let dw = f16_at(blk, 0);
                let dot: i32 = match w.dtype {
                    DType::Q8_0 => (0..32)
                        .map(|j| blk[at + j] as i8 as i32 * xs[j] as i32)
                        .sum(),
                    _ => (0..16)
                        .map(|j| {
                            let q = blk[at + j];
                            (q & 15) as i32 * xs[j] as i32 + (q >> 4) as i32 * xs[j + 16] as i32
                        })
                        .sum(),
                };
                total += dw * dx * dot as f32;
                match w.dtype {
                    DType::Q4_0 => total -= 8.0 * dw * sx,
                    DType::Q4_1 => total += f16_at(blk, 2) * sx,
                    _ => {}
                }
            }
            *out.add(t * w.rows + r) = total;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{codes_at, Q8Activations};
    use crate::{DType, WeightMatrix};
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// The 32 weight bytes of a block as unsigned values for `maddubs` (Q4: the nibbles, low ones
    /// first, so element j and j + 16 line up with the activations; Q8_0: magnitudes, with the
    /// weights' signs moved onto the activations).
    #[inline(always)]
    unsafe fn products(dtype: DType, blk: *const u8, xs: __m256i) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        let p16 = match dtype {
            DType::Q8_0 => {
                let w = _mm256_loadu_si256(blk as *const __m256i);
                _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xs, w))
            }
            _ => {
                let qs = _mm_loadu_si128(blk as *const __m128i);
                let mask = _mm_set1_epi8(0x0f);
                let lo = _mm_and_si128(qs, mask);
                let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
                _mm256_maddubs_epi16(_mm256_set_m128i(hi, lo), xs)
            }
        };
        _mm256_madd_epi16(p16, ones)
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// A block's scale and the constant its codes are offset by (Q4_1: its f16 minimum; Q4_0:
    /// -8 scales; Q8_0: none), converted by F16C (the block's first 4 bytes hold them).
    #[inline(always)]
    unsafe fn scales(dtype: DType, blk: *const u8) -> (f32, f32) {
        let bits = (blk as *const u32).read_unaligned();
        let f = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
        let dw = _mm_cvtss_f32(f);
        let min = match dtype {
            DType::Q4_1 => _mm_cvtss_f32(_mm_movehdup_ps(f)),
            DType::Q4_0 => -8.0 * dw,
            _ => 0.0,
        };
        (dw, min)
    }

    /// Prefetches `rows` rows of `row_bytes` from `at`.
    #[inline(always)]
    unsafe fn prefetch_rows(at: *const u8, rows: usize, row_bytes: usize) {
        for line in (0..rows * row_bytes).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(at.add(line) as *const i8);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows(
        w: &WeightMatrix,
        rows: Range<usize>,
        a: &Q8Activations,
        n: usize,
        out: *mut f32,
    ) {
        let dtype = w.dtype;
        let (bytes, at) = (dtype.block_bytes(), codes_at(dtype));
        let data = w.data.as_slice();
        let row_bytes = w.row_bytes();
        let blocks = w.cols / 32;
        assert!(data.len() >= rows.end * row_bytes && a.codes.len() >= n * w.cols);
        let end = rows.end;
        let mut r = rows.start;
        // One token (decode of one sequence): four rows at a time, each block's activations
        // loaded once for the four, and four independent accumulations (one row's FMAs alone are
        // a chain of dependent adds that the block loop waits on).
        if n == 1 {
            while r + ROWS <= end {
                if r + 2 * ROWS <= end {
                    prefetch_rows(data.as_ptr().add((r + ROWS) * row_bytes), ROWS, row_bytes);
                }
                let base = data.as_ptr().add(r * row_bytes);
                let mut acc = [_mm256_setzero_ps(); ROWS];
                let mut extra = [0f32; ROWS];
                for g in 0..blocks {
                    let xs = _mm256_loadu_si256(a.codes.as_ptr().add(g * 32) as *const __m256i);
                    let (dx, sx) = (a.d[g], a.sum[g]);
                    for k in 0..ROWS {
                        let blk = base.add(k * row_bytes + g * bytes);
                        let (dw, min) = scales(dtype, blk);
                        let p = _mm256_cvtepi32_ps(products(dtype, blk.add(at), xs));
                        acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), p, acc[k]);
                        extra[k] += min * sx;
                    }
                }
                for k in 0..ROWS {
                    *out.add(r + k) = hsum(acc[k]) + extra[k];
                }
                r += ROWS;
            }
        }
        for r in r..end {
            if r + 4 < end {
                prefetch_rows(data.as_ptr().add((r + 4) * row_bytes), 1, row_bytes);
            }
            let row = data.as_ptr().add(r * row_bytes);
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut extra = [0f32; 4];
            for g in 0..blocks {
                let blk = row.add(g * bytes);
                let (dw, min) = scales(dtype, blk);
                for t in 0..n {
                    let xs = _mm256_loadu_si256(
                        a.codes.as_ptr().add(t * w.cols + g * 32) as *const __m256i
                    );
                    let p = _mm256_cvtepi32_ps(products(dtype, blk.add(at), xs));
                    let i = t * blocks + g;
                    acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a.d[i]), p, acc[t]);
                    extra[t] += min * a.sum[i];
                }
            }
            for t in 0..n {
                *out.add(t * w.rows + r) = hsum(acc[t]) + extra[t];
            }
        }
    }

    /// Rows the one-token path takes at a time.
    const ROWS: usize = 4;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row;
    use rand::{Rng, SeedableRng};

    /// Every kernel this CPU has, for each served type and 1-4 tokens, against an f64 sum over
    /// the decoded weights and the decoded 8-bit activations: the kernels' only rounding is f32
    /// accumulation. Against the exact f32 inputs, the difference is the activations' rounding,
    /// at most half a step (d / 2) per element.
    #[test]
    fn kernels_match_the_f64_product_of_decoded_values() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        let mut kernels: Vec<(&str, Q8Kernel)> = vec![("portable", rows_portable)];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            kernels.push(("avx2", avx2::rows));
        }
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            for (rows, cols) in [(37usize, 64usize), (9, 2048)] {
                let values: Vec<f32> = (0..rows * cols)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let bytes: Vec<u8> = values
                    .chunks(cols)
                    .flat_map(|r| quantize_row(dtype, r))
                    .collect();
                let w = WeightMatrix::new(dtype, rows, cols, crate::Bytes::owned(bytes)).unwrap();
                let wf = w.to_f32();
                for n in 1..=4usize {
                    // Mixed magnitudes, one block all zeros.
                    let mut x: Vec<f32> = (0..n * cols)
                        .map(|i| rng.random_range(-1.0..1.0) * if i % 96 < 32 { 4.0 } else { 0.1 })
                        .collect();
                    x[32..64].fill(0.0);
                    let acts = Q8Activations::new(&x, n, cols);
                    for (name, kernel) in &kernels {
                        let mut out = vec![f32::NAN; n * rows];
                        // SAFETY: the kernel's features were detected above; out holds n * rows.
                        unsafe { kernel(&w, 0..rows, &acts, n, out.as_mut_ptr()) };
                        for t in 0..n {
                            for r in 0..rows {
                                let (mut want, mut exact, mut bound) = (0f64, 0f64, 0f64);
                                for c in 0..cols {
                                    let wv = wf[r * cols + c] as f64;
                                    want += wv * acts.value(t, c, cols) as f64;
                                    exact += wv * x[t * cols + c] as f64;
                                    bound += wv.abs() * acts.d[(t * cols + c) / 32] as f64 / 2.0;
                                }
                                let got = out[t * rows + r] as f64;
                                assert!(
                                    (got - want).abs() <= 2e-6 * cols as f64,
                                    "{name} {dtype} {rows}x{cols} t{t} r{r}: {got} vs {want}"
                                );
                                assert!(
                                    (got - exact).abs()
                                        <= bound * (1.0 + 1e-4) + 2e-6 * cols as f64
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The public entry takes the Q8 path only where it serves, and the exact path elsewhere.
    #[test]
    fn linear_with_falls_back_to_f32_where_q8_does_not_serve() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let (rows, cols) = (8usize, 64usize);
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let bytes: Vec<u8> = values
            .chunks(cols)
            .flat_map(|r| quantize_row(DType::F16, r))
            .collect();
        let w = WeightMatrix::new(DType::F16, rows, cols, crate::Bytes::owned(bytes)).unwrap();
        let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
        super::super::linear::linear(&x, 1, &w, &mut a);
        super::super::linear::linear_with(&x, 1, &w, &mut b, CpuActivations::Q8);
        assert_eq!(a, b);
    }
}
