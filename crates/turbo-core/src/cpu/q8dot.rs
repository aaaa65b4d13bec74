//! Decode products with activations rounded to 8 bits, a choice beside the exact f32 path.
//!
//! llama.cpp's CPU decode multiplies its 4- and 8-bit weight blocks with activations quantized to
//! 8 bits per 32 elements, so that the inner products are integer multiply-adds on bytes (32
//! products per instruction pair on AVX2) rather than f32 FMAs on decoded weights. This module
//! does the same for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K weights when
//! [`CpuActivations::Q8`] is chosen:
//! activations of each token become blocks of 32 `i8` codes with one f32 scale
//! (`d = max|x| / 127`, `code = round_ties_even(x / d)`), and each weight block's dot product with
//! an activation block is exact integer arithmetic scaled once by `d_w · d_x` (plus, for Q4_1
//! and Q5_1, its minimum times the activation block's sum). The K-quants' sub-blocks (32 values
//! for Q4_K, 16 for Q6_K) line up with the activation blocks, so their dot products are the same
//! integer sums, scaled by the sub-block's scale and corrected by its minimum (Q4_K) or, in the
//! integers, by the 32 its codes are offset by (Q6_K). The only rounding beyond f32 accumulation is
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
    /// Activations rounded to 8 bits (per 32 elements; per 256 for K-quants) for Q4_0, Q4_1,
    /// Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K weights (other types, and prefill, stay f32).
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
    matches!(
        dtype,
        DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q8_0
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
    )
}

/// Whether `dtype` has super-blocks of 256 (the K-quants' kernels) rather than blocks of 32.
fn super_blocks(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_K | DType::Q5_K | DType::Q6_K)
}

/// Activations of up to a few tokens as 8-bit codes in blocks of `block` values (32 for the
/// block formats; 256, one scale per super-block, for the K-quants, as llama.cpp's Q8_K does, so
/// that a super-block's sub-block sums combine in the integers): `codes[t][c]`, per token and
/// block the scale `d` and `d · Σ codes` (for weights with a minimum), and per 16 codes their
/// sum (for the K-quants' minimums and offsets, whose scales change every 16 or 32 values).
pub(crate) struct Q8Activations {
    pub codes: Vec<i8>,
    pub d: Vec<f32>,
    pub sum: Vec<f32>,
    pub sum16: Vec<i32>,
    pub block: usize,
}

impl Q8Activations {
    /// Quantizes `n` rows of `cols` (a multiple of 32) values of `x` in blocks of 32.
    pub fn new(x: &[f32], n: usize, cols: usize) -> Self {
        Self::with_block(x, n, cols, 32)
    }

    /// Quantizes `n` rows of `cols` (a multiple of 256) values of `x` in blocks of 256.
    pub fn super_blocks(x: &[f32], n: usize, cols: usize) -> Self {
        Self::with_block(x, n, cols, 256)
    }

    fn with_block(x: &[f32], n: usize, cols: usize, block: usize) -> Self {
        assert!(cols.is_multiple_of(block) && x.len() >= n * cols);
        let blocks = n * cols / block;
        let mut q = Q8Activations {
            codes: vec![0; n * cols],
            d: vec![0.0; blocks],
            sum: vec![0.0; blocks],
            sum16: vec![0; n * cols / 16],
            block,
        };
        for (b, (xs, codes)) in x[..n * cols]
            .chunks_exact(block)
            .zip(q.codes.chunks_exact_mut(block))
            .enumerate()
        {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            round_codes(xs, inv, codes);
            let sums = &mut q.sum16[b * block / 16..(b + 1) * block / 16];
            for (s, c) in sums.iter_mut().zip(codes.chunks_exact(16)) {
                *s = c.iter().map(|&c| c as i32).sum();
            }
            q.d[b] = d;
            q.sum[b] = d * sums.iter().sum::<i32>() as f32;
        }
        q
    }

    /// The scale of value `c` of token `t`, in rows of `cols` (for references).
    #[cfg(test)]
    pub fn scale(&self, t: usize, c: usize, cols: usize) -> f32 {
        self.d[(t * cols + c) / self.block]
    }

    /// The value code `c` of token `t` stands for, in rows of `cols` (for references).
    #[cfg(test)]
    pub fn value(&self, t: usize, c: usize, cols: usize) -> f32 {
        self.codes[t * cols + c] as f32 * self.scale(t, c, cols)
    }
}

/// `codes[i] = round_ties_even(xs[i] · inv)` clamped to ±127: with AVX2 eight at a time (the
/// scalar rounding is a library call per value).
fn round_codes(xs: &[f32], inv: f32, codes: &mut [i8]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && xs.len().is_multiple_of(8) {
        // SAFETY: AVX2 was detected; the lengths are equal multiples of 8.
        unsafe { avx2::round_codes(xs, inv, codes) };
        return;
    }
    for (c, &v) in codes.iter_mut().zip(xs) {
        *c = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
}

/// Tokens a kernel call takes at most; more are taken in groups of this many.
const KERNEL_TOKENS: usize = 4;

/// `out[t, r] = Σ_c x[t, c] · w[r, c]` with `x` rounded to 8 bits, for a weight type [`serves`]
/// accepts. The tokens go to the kernels four at a time, each task running every group over its
/// rows while they are in cache.
pub(crate) fn gemv_q8(x: &[f32], n: usize, w: &WeightMatrix, out: &mut [f32]) {
    debug_assert!(serves(w.dtype));
    let (blocks32, blocks256) = kernels();
    let cols = w.cols;
    let kernel = if super_blocks(w.dtype) {
        blocks256
    } else {
        blocks32
    };
    // (first token, tokens, their activations): each token's codes are its own, so groups
    // quantized apart hold the codes the whole step would.
    let groups: Vec<(usize, usize, Q8Activations)> = (0..n)
        .step_by(KERNEL_TOKENS)
        .map(|first| {
            let m = (n - first).min(KERNEL_TOKENS);
            let xs = &x[first * cols..(first + m) * cols];
            let acts = match super_blocks(w.dtype) {
                true => Q8Activations::super_blocks(xs, m, cols),
                false => Q8Activations::new(xs, m, cols),
            };
            (first, m, acts)
        })
        .collect();
    let out_ptr = super::linear::SyncPtr(out.as_mut_ptr());
    super::linear::for_row_tasks(w.rows, |rows| {
        for (first, m, acts) in &groups {
            // SAFETY: the dispatcher returns only kernels whose CPU features were detected; each
            // task writes only its own rows of `out` (row stride `w.rows`) for tokens
            // first..first + m, all below n * w.rows.
            unsafe { kernel(w, rows.clone(), acts, *m, out_ptr.get().add(first * w.rows)) };
        }
    });
}

type Q8Kernel = unsafe fn(&WeightMatrix, Range<usize>, &Q8Activations, usize, *mut f32);

/// This CPU's kernels for blocks of 32 and for super-blocks of 256: the AVX2 ones where AVX2,
/// FMA and F16C are present, detected once.
fn kernels() -> (Q8Kernel, Q8Kernel) {
    static KERNELS: std::sync::OnceLock<(Q8Kernel, Q8Kernel)> = std::sync::OnceLock::new();
    *KERNELS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            if avx512::detected() {
                return (avx512::rows, avx512::rows_k);
            }
            return (avx2::rows, avx2::rows_k);
        }
        (rows_portable, rows_k_portable)
    })
}

/// Where a served block's 4- or 8-bit codes start, after its f16 scale (and its f16 minimum,
/// and the 32 fifth bits of Q5 types).
fn codes_at(dtype: DType) -> usize {
    match dtype {
        DType::Q4_1 => 4,
        DType::Q5_0 => 6,
        DType::Q5_1 => 8,
        _ => 2,
    }
}

/// Code `j` (0..32) of a served block of 32, as the unsigned (Q4, Q5) or signed (Q8_0) integer
/// the block's scale multiplies.
fn code(dtype: DType, blk: &[u8], j: usize) -> i32 {
    let at = codes_at(dtype);
    match dtype {
        DType::Q8_0 => blk[at + j] as i8 as i32,
        _ => {
            let q = blk[at + j % 16];
            let nibble = if j < 16 { q & 15 } else { q >> 4 } as i32;
            let high = match dtype {
                DType::Q5_0 | DType::Q5_1 => {
                    let qh = u32::from_le_bytes(blk[at - 4..at].try_into().unwrap());
                    ((qh >> j) & 1) as i32 * 16
                }
                _ => 0,
            };
            nibble + high
        }
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
    let bytes = w.dtype.block_bytes();
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
                let dot: i32 = (0..32).map(|j| code(w.dtype, blk, j) * xs[j] as i32).sum();
                total += dw * dx * dot as f32;
                match w.dtype {
                    DType::Q4_0 => total -= 8.0 * dw * sx,
                    DType::Q5_0 => total -= 16.0 * dw * sx,
                    DType::Q4_1 | DType::Q5_1 => total += f16_at(blk, 2) * sx,
                    _ => {}
                }
            }
            *out.add(t * w.rows + r) = total;
        }
    }
}

/// The K-quants' scalar kernel: per super-block and token, the sub-blocks' integer dot products
/// times their integer scales summed in the integers, then scaled once, as the vector kernel does.
unsafe fn rows_k_portable(
    w: &WeightMatrix,
    rows: Range<usize>,
    a: &Q8Activations,
    n: usize,
    out: *mut f32,
) {
    let bytes = w.dtype.block_bytes();
    let data = w.data.as_slice();
    let row_bytes = w.row_bytes();
    let supers = w.cols / 256;
    for r in rows {
        let row = &data[r * row_bytes..(r + 1) * row_bytes];
        for t in 0..n {
            let mut total = 0f32;
            for (sb, b) in row.chunks_exact(bytes).enumerate() {
                let i = t * supers + sb;
                let xs = &a.codes[i * 256..i * 256 + 256];
                let sums = &a.sum16[i * 16..i * 16 + 16];
                let (mut sumi, mut summ) = (0i64, 0i64);
                for s in 0..8 {
                    let xs = &xs[32 * s..32 * s + 32];
                    match w.dtype {
                        DType::Q4_K | DType::Q5_K => {
                            let (sc, m) = crate::quant::scale_min_k4(s, &b[4..16]);
                            let five = w.dtype == DType::Q5_K;
                            let ql = &b[if five { 48 } else { 16 } + 32 * (s / 2)..];
                            let dot: i32 = (0..32)
                                .map(|l| {
                                    let q = if s % 2 == 0 { ql[l] & 15 } else { ql[l] >> 4 };
                                    let high = if five { ((b[16 + l] >> s) & 1) << 4 } else { 0 };
                                    (q | high) as i32 * xs[l] as i32
                                })
                                .sum();
                            sumi += sc as i64 * dot as i64;
                            summ += m as i64 * (sums[2 * s] + sums[2 * s + 1]) as i64;
                        }
                        _ => {
                            let (h, k) = (s / 4, s % 4);
                            let (ql, qh) = (&b[64 * h..], &b[128 + 32 * h..]);
                            for half in 0..2 {
                                let sc = b[192 + 8 * h + 2 * k + half] as i8 as i64;
                                let dot: i32 = (16 * half..16 * half + 16)
                                    .map(|l| {
                                        let low = (ql[l + 32 * (k % 2)] >> (4 * (k / 2))) & 15;
                                        let q = low | (((qh[l] >> (2 * k)) & 3) << 4);
                                        q as i32 * xs[l] as i32
                                    })
                                    .sum();
                                sumi += sc * (dot - 32 * sums[2 * s + half]) as i64;
                            }
                        }
                    }
                }
                total += match w.dtype {
                    DType::Q4_K | DType::Q5_K => {
                        f16_at(b, 0) * a.d[i] * sumi as f32 - f16_at(b, 2) * a.d[i] * summ as f32
                    }
                    _ => f16_at(b, 208) * a.d[i] * sumi as f32,
                };
            }
            *out.add(t * w.rows + r) = total;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{codes_at, Q8Activations};
    use crate::cpu::linear::f16_at;
    use crate::quant::scale_min_k4;
    use crate::{DType, WeightMatrix};
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// The 32 weight codes of the block at `blk` times the activation codes `xs`, summed in
    /// eight i32 lanes (lanes 0-3: elements 0-15, lanes 4-7: elements 16-31). The nibbles come
    /// low ones first, so element j and j + 16 line up with the activations; Q5 types add their
    /// fifth bits. Q4_1 and Q5_1 codes are unsigned (their minimum is added beside); Q4_0 and
    /// Q5_0 codes are made signed here (minus 8, or minus 16 through the fifth bit, as
    /// llama.cpp does), and signed codes multiply as magnitudes with their signs moved onto the
    /// activations, so those types need no term beside the products.
    #[inline(always)]
    pub(super) unsafe fn products(dtype: DType, blk: *const u8, xs: __m256i) -> __m256i {
        let at = codes_at(dtype);
        let p16 = match dtype {
            DType::Q8_0 => signed_products(xs, _mm256_loadu_si256(blk.add(at) as *const __m256i)),
            _ => {
                let qs = _mm_loadu_si128(blk.add(at) as *const __m128i);
                let mask = _mm_set1_epi8(0x0f);
                let lo = _mm_and_si128(qs, mask);
                let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
                let q = _mm256_set_m128i(hi, lo);
                match dtype {
                    DType::Q4_0 => signed_products(xs, _mm256_sub_epi8(q, _mm256_set1_epi8(8))),
                    // Code - 16: where the fifth bit is clear, the byte's top nibble is all ones.
                    DType::Q5_0 => {
                        let bits = bytes_from_bits(blk.add(at - 4));
                        let top = _mm256_andnot_si256(bits, _mm256_set1_epi8(0xF0u8 as i8));
                        signed_products(xs, _mm256_or_si256(q, top))
                    }
                    DType::Q5_1 => {
                        let bits = bytes_from_bits(blk.add(at - 4));
                        let q = _mm256_or_si256(q, _mm256_and_si256(bits, _mm256_set1_epi8(0x10)));
                        _mm256_maddubs_epi16(q, xs)
                    }
                    _ => _mm256_maddubs_epi16(q, xs),
                }
            }
        };
        _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
    }

    /// Q5_K's fifth bits of sub-block `s` (bit `s` of each byte of `qh`) as 16 in each byte.
    #[inline(always)]
    unsafe fn fifth_bits(qh: __m256i, s: i32) -> __m256i {
        let bits = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(s));
        _mm256_slli_epi16(_mm256_and_si256(bits, _mm256_set1_epi8(1)), 4)
    }

    /// Signed weight codes `w` times activation codes `xs`, as pairs in i16 lanes: magnitudes
    /// with the weights' signs moved onto the activations (`maddubs` takes one unsigned side).
    #[inline(always)]
    unsafe fn signed_products(xs: __m256i, w: __m256i) -> __m256i {
        _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xs, w))
    }

    /// The 32 bits at `at` as 32 bytes, byte j all ones where bit j is set.
    #[inline(always)]
    unsafe fn bytes_from_bits(at: *const u8) -> __m256i {
        let bits = (at as *const u32).read_unaligned() as i32;
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits),
            _mm256_set_epi64x(
                0x0303_0303_0303_0303,
                0x0202_0202_0202_0202,
                0x0101_0101_0101_0101,
                0,
            ),
        );
        let probe = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
        _mm256_cmpeq_epi8(probe, _mm256_set1_epi64x(-1))
    }

    #[inline(always)]
    pub(super) unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// A block's scale and its minimum (Q4_1, Q5_1; 0 for the others, whose codes are signed),
    /// converted by F16C (the block's first 4 bytes hold them).
    #[inline(always)]
    pub(super) unsafe fn scales(dtype: DType, blk: *const u8) -> (f32, f32) {
        let bits = (blk as *const u32).read_unaligned();
        let f = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
        let dw = _mm_cvtss_f32(f);
        let min = match dtype {
            DType::Q4_1 | DType::Q5_1 => _mm_cvtss_f32(_mm_movehdup_ps(f)),
            _ => 0.0,
        };
        (dw, min)
    }

    /// Prefetches `rows` rows of `row_bytes` from `at`.
    #[inline(always)]
    pub(super) unsafe fn prefetch_rows(at: *const u8, rows: usize, row_bytes: usize) {
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
        // One copy of the loops per type, so that each block's decoding is straight-line code
        // and types without a minimum carry no term beside the products.
        match w.dtype {
            DType::Q4_0 => rows_of::<Q4_0>(w, rows, a, n, out),
            DType::Q4_1 => rows_of::<Q4_1>(w, rows, a, n, out),
            DType::Q5_0 => rows_of::<Q5_0>(w, rows, a, n, out),
            DType::Q5_1 => rows_of::<Q5_1>(w, rows, a, n, out),
            _ => rows_of::<Q8_0>(w, rows, a, n, out),
        }
    }

    pub(super) const Q4_0: u8 = 0;
    pub(super) const Q4_1: u8 = 1;
    pub(super) const Q5_0: u8 = 2;
    pub(super) const Q5_1: u8 = 3;
    pub(super) const Q8_0: u8 = 4;

    #[inline(always)]
    pub(super) const fn dtype_of(t: u8) -> DType {
        match t {
            Q4_0 => DType::Q4_0,
            Q4_1 => DType::Q4_1,
            Q5_0 => DType::Q5_0,
            Q5_1 => DType::Q5_1,
            _ => DType::Q8_0,
        }
    }

    #[inline(always)]
    unsafe fn rows_of<const T: u8>(
        w: &WeightMatrix,
        rows: Range<usize>,
        a: &Q8Activations,
        n: usize,
        out: *mut f32,
    ) {
        let dtype = dtype_of(T);
        let has_min = matches!(dtype, DType::Q4_1 | DType::Q5_1);
        debug_assert_eq!(dtype, w.dtype);
        let bytes = dtype.block_bytes();
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
                if r + (AHEAD + 1) * ROWS <= end {
                    prefetch_rows(
                        data.as_ptr().add((r + AHEAD * ROWS) * row_bytes),
                        ROWS,
                        row_bytes,
                    );
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
                        let p = _mm256_cvtepi32_ps(products(dtype, blk, xs));
                        acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), p, acc[k]);
                        if has_min {
                            extra[k] += min * sx;
                        }
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
                    let p = _mm256_cvtepi32_ps(products(dtype, blk, xs));
                    let i = t * blocks + g;
                    acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a.d[i]), p, acc[t]);
                    if has_min {
                        extra[t] += min * a.sum[i];
                    }
                }
            }
            for t in 0..n {
                *out.add(t * w.rows + r) = hsum(acc[t]) + extra[t];
            }
        }
    }

    /// Rows the one-token path takes at a time.
    pub(super) const ROWS: usize = 4;
    /// How many groups of [`ROWS`] rows ahead the one-token path prefetches. A decode step
    /// streams the whole model from memory; one group ahead (about 1.4 KB of Q4_1 rows) left
    /// a single core waiting on its loads, 4 groups ahead decoded 10-15% faster and 8 slower
    /// than 4 (docs/perf/cpu.md).
    pub(super) const AHEAD: usize = 4;

    /// See [`super::round_codes`]; `xs.len()` is a multiple of 8 and equals `codes.len()`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn round_codes(xs: &[f32], inv: f32, codes: &mut [i8]) {
        let (scale, lo, hi) = (
            _mm256_set1_ps(inv),
            _mm256_set1_ps(-127.0),
            _mm256_set1_ps(127.0),
        );
        for (x, c) in xs.chunks_exact(8).zip(codes.chunks_exact_mut(8)) {
            let v = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr()), scale);
            let v = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            // NaN stays NaN through the clamp (the second operand is returned) and converts to
            // 0x80000000, whose low byte is 0, as the scalar path's `as i8` gives.
            let i = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)));
            let mut lanes = [0i32; 8];
            _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, i);
            for (c, l) in c.iter_mut().zip(lanes) {
                *c = l as i8;
            }
        }
    }

    /// How many rows ahead the super-block kernel prefetches (as [`AHEAD`]; it prefetched
    /// nothing before).
    pub(super) const K_AHEAD: usize = 4;

    /// Q4_K and Q6_K rows over activations in blocks of 256: each super-block's codes unpacked
    /// to bytes once per row; per token, its sub-blocks' integer dot products times their
    /// integer scales summed in the integers and converted once.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_k(
        w: &WeightMatrix,
        rows: Range<usize>,
        a: &Q8Activations,
        n: usize,
        out: *mut f32,
    ) {
        let bytes = w.dtype.block_bytes();
        let data = w.data.as_slice();
        let row_bytes = w.row_bytes();
        let supers = w.cols / 256;
        assert!(data.len() >= rows.end * row_bytes && a.codes.len() >= n * w.cols && n <= 4);
        assert!(a.block == 256);
        let m4 = _mm256_set1_epi8(0x0f);
        let m2 = _mm256_set1_epi8(0x03);
        let m32 = _mm256_set1_epi8(32);
        let end = rows.end;
        for r in rows {
            if r + K_AHEAD < end {
                prefetch_rows(data.as_ptr().add((r + K_AHEAD) * row_bytes), 1, row_bytes);
            }
            let row = &data[r * row_bytes..(r + 1) * row_bytes];
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut extra = [0f32; 4];
            for (sb, b) in row.chunks_exact(bytes).enumerate() {
                let p = b.as_ptr();
                // The super-block's eight sub-blocks of 32 as unsigned codes, with per 32 (Q4_K)
                // or per 16 (Q6_K) scales.
                let mut q = [_mm256_setzero_si256(); 8];
                match w.dtype {
                    DType::Q4_K => {
                        for j in 0..4 {
                            let qs = _mm256_loadu_si256(p.add(16 + 32 * j) as *const __m256i);
                            q[2 * j] = _mm256_and_si256(qs, m4);
                            q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(qs, 4), m4);
                        }
                    }
                    DType::Q5_K => {
                        // Bit s of byte l of `qh` is the fifth bit of element l of sub-block s.
                        let qh = _mm256_loadu_si256(p.add(16) as *const __m256i);
                        for j in 0..4 {
                            let qs = _mm256_loadu_si256(p.add(48 + 32 * j) as *const __m256i);
                            let lo = _mm256_and_si256(qs, m4);
                            let hi = _mm256_and_si256(_mm256_srli_epi16(qs, 4), m4);
                            q[2 * j] = _mm256_or_si256(lo, fifth_bits(qh, 2 * j as i32));
                            q[2 * j + 1] = _mm256_or_si256(hi, fifth_bits(qh, 2 * j as i32 + 1));
                        }
                    }
                    _ => {
                        for h in 0..2 {
                            let ql0 = _mm256_loadu_si256(p.add(64 * h) as *const __m256i);
                            let ql1 = _mm256_loadu_si256(p.add(64 * h + 32) as *const __m256i);
                            let qh = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
                            let high = |shift: i32| {
                                let bits = match shift {
                                    0 => qh,
                                    2 => _mm256_srli_epi16(qh, 2),
                                    4 => _mm256_srli_epi16(qh, 4),
                                    _ => _mm256_srli_epi16(qh, 6),
                                };
                                _mm256_slli_epi16(_mm256_and_si256(bits, m2), 4)
                            };
                            let low_hi0 = _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4);
                            let low_hi1 = _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4);
                            q[4 * h] = _mm256_or_si256(_mm256_and_si256(ql0, m4), high(0));
                            q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), high(2));
                            q[4 * h + 2] = _mm256_or_si256(low_hi0, high(4));
                            q[4 * h + 3] = _mm256_or_si256(low_hi1, high(6));
                        }
                    }
                }
                // Per sub-block: its integer scale as i16 lanes (Q6_K: one per 16 values, so
                // the low and high 128-bit halves differ), and Q4_K's minimum.
                let mut scales = [_mm256_setzero_si256(); 8];
                let mut mins = [0i32; 8];
                for (s, v) in scales.iter_mut().enumerate() {
                    *v = match w.dtype {
                        DType::Q4_K | DType::Q5_K => {
                            let (sc, m) = scale_min_k4(s, &b[4..16]);
                            mins[s] = m as i32;
                            _mm256_set1_epi16(sc as i16)
                        }
                        _ => {
                            let at = 192 + 8 * (s / 4) + 2 * (s % 4);
                            let (s0, s1) = (b[at] as i8 as i16, b[at + 1] as i8 as i16);
                            _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0))
                        }
                    };
                }
                for t in 0..n {
                    let i = t * supers + sb;
                    let xs_at = a.codes.as_ptr().add(i * 256);
                    let mut sumi = _mm256_setzero_si256();
                    for s in 0..8 {
                        let xs = _mm256_loadu_si256(xs_at.add(32 * s) as *const __m256i);
                        let mut p16 = _mm256_maddubs_epi16(q[s], xs);
                        if w.dtype == DType::Q6_K {
                            // Codes are offset by 32: take 32 x the activations off, exactly
                            // (pairs of products stay within i16: 2 x 63 x 127).
                            p16 = _mm256_sub_epi16(p16, _mm256_maddubs_epi16(m32, xs));
                        }
                        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p16, scales[s]));
                    }
                    let (d, min) = match w.dtype {
                        DType::Q4_K | DType::Q5_K => {
                            let sums = &a.sum16[i * 16..i * 16 + 16];
                            let summ: i32 = (0..8)
                                .map(|s| mins[s] * (sums[2 * s] + sums[2 * s + 1]))
                                .sum();
                            (f16_at(b, 0), f16_at(b, 2) * summ as f32)
                        }
                        _ => (f16_at(b, 208), 0.0),
                    };
                    let scale = _mm256_set1_ps(d * a.d[i]);
                    acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sumi), acc[t]);
                    extra[t] -= min * a.d[i];
                }
            }
            for t in 0..n {
                *out.add(t * w.rows + r) = hsum(acc[t]) + extra[t];
            }
        }
    }
}

/// Decode rows (one token) in 512-bit vectors with AVX-512 VNNI. Blocks of 32 ([`rows`]): two
/// blocks a vector, and one `vpdpbusd` where AVX2 takes a sign pair, `maddubs` and `madd`.
/// K-quants ([`rows_k`]): two sub-blocks a vector, their scales applied by `vpdpwssd`.
///
/// `vpdpbusd` multiplies unsigned bytes by signed ones, so the weights are the unsigned side:
/// Q4 and Q5 codes as they are (0..15, 0..31), Q8_0 codes moved to 0..255 by flipping their sign
/// bit (code + 128). A signed type's offset (8, 16 or 128) times the activation codes is taken off
/// in the integers by starting each lane's sum at `-offset · (its four activation codes' sum)`,
/// so each block's integer sum is exactly the AVX2 kernel's; the sums are then scaled and added
/// in f32 lanes in another order than AVX2's, so results agree to f32 rounding.
///
/// Q4 and Q5 weights come as low nibbles (elements 0-15) and high nibbles (16-31) of 16 bytes; a
/// vector holds [block 0 elements 0-15, block 1 0-15, block 0 16-31, block 1 16-31], and the
/// activations are permuted once per call to that order. Q8_0 keeps the natural order.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{avx2, codes_at, Q8Activations};
    use crate::cpu::linear::f16_at;
    use crate::quant::scale_min_k4;
    use crate::{DType, WeightMatrix};
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// Whether this CPU has what [`rows`] and [`rows_k`] use.
    pub(super) fn detected() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("bmi2")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }

    /// The block-of-32 kernel: one to four tokens.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,bmi2,avx2,fma,f16c")]
    pub(super) unsafe fn rows(
        w: &WeightMatrix,
        rows: Range<usize>,
        a: &Q8Activations,
        n: usize,
        out: *mut f32,
    ) {
        macro_rules! by_tokens {
            ($t:expr) => {
                match n {
                    2 => rows_of_tokens::<{ $t }, 2>(w, rows, a, out),
                    3 => rows_of_tokens::<{ $t }, 3>(w, rows, a, out),
                    _ => rows_of_tokens::<{ $t }, 4>(w, rows, a, out),
                }
            };
        }
        if n > 4 {
            return avx2::rows(w, rows, a, n, out);
        }
        if n > 1 {
            return match w.dtype {
                DType::Q4_0 => by_tokens!(avx2::Q4_0),
                DType::Q4_1 => by_tokens!(avx2::Q4_1),
                DType::Q5_0 => by_tokens!(avx2::Q5_0),
                DType::Q5_1 => by_tokens!(avx2::Q5_1),
                _ => by_tokens!(avx2::Q8_0),
            };
        }
        match w.dtype {
            DType::Q4_0 => rows_of::<{ avx2::Q4_0 }>(w, rows, a, out),
            DType::Q4_1 => rows_of::<{ avx2::Q4_1 }>(w, rows, a, out),
            DType::Q5_0 => rows_of::<{ avx2::Q5_0 }>(w, rows, a, out),
            DType::Q5_1 => rows_of::<{ avx2::Q5_1 }>(w, rows, a, out),
            _ => rows_of::<{ avx2::Q8_0 }>(w, rows, a, out),
        }
    }

    /// What every row shares for a pair of blocks: the activation codes in the weights' order,
    /// each lane's starting sum (the signed types' offset), and `d_x` per lane.
    struct Pair {
        xs: __m512i,
        start: __m512i,
        dx: __m512,
        /// `[0, sum_0, 0, sum_1]`: the activation blocks' `d · Σ codes`, beside the weights'
        /// `[d_0, min_0, d_1, min_1]` (Q4_1, Q5_1).
        sums: __m128,
    }

    /// The activations of token `token` as [`Pair`]s of blocks, laid out for `dtype`'s weights.
    #[inline(always)]
    unsafe fn pairs(dtype: DType, a: &Q8Activations, blocks: usize, token: usize) -> Vec<Pair> {
        let (codes, scales) = (&a.codes[token * blocks * 32..], token * blocks);
        let nibbles = dtype != DType::Q8_0;
        // Lane l of a vector covers block (l / 4) % 2 (nibble order) or l / 8 (natural order).
        let lane_block = match nibbles {
            true => _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1),
            false => _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        };
        let offset = match dtype {
            DType::Q4_0 => 8,
            DType::Q5_0 => 16,
            DType::Q8_0 => 128,
            _ => 0, // Q4_1, Q5_1: unsigned codes and a minimum beside
        };
        (0..blocks / 2)
            .map(|p| {
                let natural = _mm512_loadu_si512(codes.as_ptr().add(64 * p) as *const _);
                let xs = match nibbles {
                    true => {
                        _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7), natural)
                    }
                    false => natural,
                };
                let ones = _mm512_set1_epi8(1);
                let lane_sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, xs);
                let start = _mm512_mullo_epi32(lane_sums, _mm512_set1_epi32(-offset));
                let d = _mm_setr_ps(a.d[scales + 2 * p], a.d[scales + 2 * p + 1], 0.0, 0.0);
                let dx = _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(d));
                let sums = _mm_setr_ps(0.0, a.sum[scales + 2 * p], 0.0, a.sum[scales + 2 * p + 1]);
                Pair {
                    xs,
                    start,
                    dx,
                    sums,
                }
            })
            .collect()
    }

    /// Rows of type `T` (one of `avx2`'s type constants) times one token's activations: four
    /// rows at a time sharing each pair's activations, and a block left over (an odd count of
    /// blocks) through the AVX2 block product.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,bmi2,avx2,fma,f16c")]
    unsafe fn rows_of<const T: u8>(
        w: &WeightMatrix,
        rows: Range<usize>,
        a: &Q8Activations,
        out: *mut f32,
    ) {
        let dtype = avx2::dtype_of(T);
        debug_assert_eq!(dtype, w.dtype);
        let bytes = dtype.block_bytes();
        let data = w.data.as_slice();
        let row_bytes = w.row_bytes();
        let blocks = w.cols / 32;
        assert!(data.len() >= rows.end * row_bytes && a.codes.len() >= w.cols && a.block == 32);
        let pairs = pairs(dtype, a, blocks, 0);
        let lane_block = weight_lanes(dtype);
        let tail = |row: *const u8| odd_block(dtype, a, row, w.cols, 0);
        let end = rows.end;
        let mut r = rows.start;
        while r + ROWS <= end {
            if r + (AHEAD + 1) * ROWS <= end {
                avx2::prefetch_rows(
                    data.as_ptr().add((r + AHEAD * ROWS) * row_bytes),
                    ROWS,
                    row_bytes,
                );
            }
            let base = data.as_ptr().add(r * row_bytes);
            let mut acc = [_mm512_setzero_ps(); ROWS];
            let mut mins = [_mm_setzero_ps(); ROWS];
            for (p, pair) in pairs.iter().enumerate() {
                for k in 0..ROWS {
                    let b0 = base.add(k * row_bytes + 2 * p * bytes);
                    pair_product::<T>(b0, pair, lane_block, &mut acc[k], &mut mins[k]);
                }
            }
            for k in 0..ROWS {
                *out.add(r + k) = total(acc[k], mins[k]) + tail(base.add(k * row_bytes));
            }
            r += ROWS;
        }
        for r in r..end {
            let row = data.as_ptr().add(r * row_bytes);
            let (mut acc, mut mins) = (_mm512_setzero_ps(), _mm_setzero_ps());
            for (p, pair) in pairs.iter().enumerate() {
                pair_product::<T>(
                    row.add(2 * p * bytes),
                    pair,
                    lane_block,
                    &mut acc,
                    &mut mins,
                );
            }
            *out.add(r) = total(acc, mins) + tail(row);
        }
    }

    /// Which of a pair's `[d_0, min_0, d_1, min_1]` each lane of its products takes: the block
    /// the lane's codes come from (nibble order, or natural order for Q8_0).
    #[inline(always)]
    unsafe fn weight_lanes(dtype: DType) -> __m512i {
        match dtype {
            DType::Q8_0 => _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
            _ => _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2),
        }
    }

    /// Token `t`'s product with the block past a row's last pair (rows of an odd count of
    /// blocks): the AVX2 block product, its scale and minimum; 0 when the count is even.
    #[inline(always)]
    unsafe fn odd_block(
        dtype: DType,
        a: &Q8Activations,
        row: *const u8,
        cols: usize,
        t: usize,
    ) -> f32 {
        let blocks = cols / 32;
        if blocks.is_multiple_of(2) {
            return 0.0;
        }
        let g = blocks - 1;
        let (at, b) = (t * cols + 32 * g, t * blocks + g);
        let blk = row.add(g * dtype.block_bytes());
        let xs = _mm256_loadu_si256(a.codes.as_ptr().add(at) as *const __m256i);
        let (dw, min) = avx2::scales(dtype, blk);
        let dot = avx2::hsum(_mm256_cvtepi32_ps(avx2::products(dtype, blk, xs)));
        let has_min = matches!(dtype, DType::Q4_1 | DType::Q5_1);
        dw * a.d[b] * dot + if has_min { min * a.sum[b] } else { 0.0 }
    }

    /// The sum of a row's f32 lanes and its minimums' terms.
    #[inline(always)]
    unsafe fn total(acc: __m512, mins: __m128) -> f32 {
        _mm512_reduce_add_ps(acc) + avx2::hsum(_mm256_castps128_ps256(mins))
    }

    /// Adds the products of a row's blocks at `b0` and the next with `pair` into `acc` (f32 lanes)
    /// and, for Q4_1 and Q5_1, their minimums' terms into `mins`.
    #[inline(always)]
    unsafe fn pair_product<const T: u8>(
        b0: *const u8,
        pair: &Pair,
        lane_block: __m512i,
        acc: &mut __m512,
        mins: &mut __m128,
    ) {
        let weights = pair_weights::<T>(b0, lane_block);
        pair_accumulate::<T>(&weights, pair, acc, mins);
    }

    /// A pair of blocks' weights as the products take them: the unsigned codes, the blocks'
    /// `[d_0, min_0, d_1, min_1]`, and each lane's `d`.
    struct PairWeights {
        codes: __m512i,
        dm: __m128,
        dw: __m512,
    }

    #[inline(always)]
    unsafe fn pair_weights<const T: u8>(b0: *const u8, lane_block: __m512i) -> PairWeights {
        let dtype = avx2::dtype_of(T);
        let at = codes_at(dtype);
        let b1 = b0.add(dtype.block_bytes());
        let codes = match dtype {
            DType::Q8_0 => {
                let lo = _mm256_loadu_si256(b0.add(at) as *const __m256i);
                let hi = _mm256_loadu_si256(b1.add(at) as *const __m256i);
                let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                _mm512_xor_si512(both, _mm512_set1_epi8(-128))
            }
            _ => {
                let qs =
                    _mm256_loadu2_m128i(b1.add(at) as *const __m128i, b0.add(at) as *const __m128i);
                let high = _mm256_srli_epi16::<4>(qs);
                let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qs), high);
                let q = _mm512_and_si512(both, _mm512_set1_epi8(0x0f));
                match dtype {
                    DType::Q5_0 | DType::Q5_1 => {
                        // Bit j of a block's 32 fifth bits is element j's; the vector holds
                        // elements 0-15 of both blocks, then 16-31 of both.
                        let h0 = (b0.add(at - 4) as *const u32).read_unaligned() as u64;
                        let h1 = (b1.add(at - 4) as *const u32).read_unaligned() as u64;
                        let bits = _pdep_u64(h0, 0x0000_FFFF_0000_FFFF)
                            | _pdep_u64(h1, 0xFFFF_0000_FFFF_0000);
                        _mm512_mask_add_epi8(q, bits, q, _mm512_set1_epi8(16))
                    }
                    _ => q,
                }
            }
        };
        // The two blocks' f16 scale and minimum words, as [d_0, min_0, d_1, min_1] (the
        // "minimum" of a type without one is code bytes, never used).
        let h0 = (b0 as *const u32).read_unaligned() as i32;
        let h1 = (b1 as *const u32).read_unaligned() as i32;
        let dm = _mm_cvtph_ps(_mm_insert_epi32::<1>(_mm_cvtsi32_si128(h0), h1));
        let dw = _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(dm));
        PairWeights { codes, dm, dw }
    }

    /// Adds a pair of blocks' products with one token's `pair` into `acc` and `mins`.
    #[inline(always)]
    unsafe fn pair_accumulate<const T: u8>(
        weights: &PairWeights,
        pair: &Pair,
        acc: &mut __m512,
        mins: &mut __m128,
    ) {
        let dots = _mm512_dpbusd_epi32(pair.start, weights.codes, pair.xs);
        *acc = _mm512_fmadd_ps(
            _mm512_mul_ps(weights.dw, pair.dx),
            _mm512_cvtepi32_ps(dots),
            *acc,
        );
        if matches!(avx2::dtype_of(T), DType::Q4_1 | DType::Q5_1) {
            *mins = _mm_fmadd_ps(weights.dm, pair.sums, *mins);
        }
    }

    /// Rows of type `T` times `M` (2 to 4) tokens: each row's pair of blocks decoded once and
    /// multiplied with every token's activations, a row at a time; a block left over (an odd
    /// count) through the AVX2 block product, as the one-token kernel does.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,bmi2,avx2,fma,f16c")]
    unsafe fn rows_of_tokens<const T: u8, const M: usize>(
        w: &WeightMatrix,
        rows: Range<usize>,
        a: &Q8Activations,
        out: *mut f32,
    ) {
        let dtype = avx2::dtype_of(T);
        debug_assert_eq!(dtype, w.dtype);
        let bytes = dtype.block_bytes();
        let data = w.data.as_slice();
        let row_bytes = w.row_bytes();
        let blocks = w.cols / 32;
        assert!(data.len() >= rows.end * row_bytes && a.codes.len() >= M * w.cols && a.block == 32);
        let pairs: [Vec<Pair>; M] = std::array::from_fn(|t| pairs(dtype, a, blocks, t));
        let lane_block = weight_lanes(dtype);
        let tail = |row: *const u8, t: usize| odd_block(dtype, a, row, w.cols, t);
        let end = rows.end;
        for r in rows {
            if r + AHEAD * ROWS < end {
                avx2::prefetch_rows(
                    data.as_ptr().add((r + AHEAD * ROWS) * row_bytes),
                    1,
                    row_bytes,
                );
            }
            let row = data.as_ptr().add(r * row_bytes);
            let mut acc = [_mm512_setzero_ps(); M];
            let mut mins = [_mm_setzero_ps(); M];
            // (An index loop: `p` also places the pair in the row, and a closure would not
            // inherit this function's target features.)
            #[allow(clippy::needless_range_loop)]
            for p in 0..blocks / 2 {
                let weights = pair_weights::<T>(row.add(2 * p * bytes), lane_block);
                for t in 0..M {
                    pair_accumulate::<T>(&weights, &pairs[t][p], &mut acc[t], &mut mins[t]);
                }
            }
            for t in 0..M {
                *out.add(t * w.rows + r) = total(acc[t], mins[t]) + tail(row, t);
            }
        }
    }

    /// The super-block kernel: one to four tokens here, more through the AVX2 kernel. Two
    /// sub-blocks of 32 a vector: `maddubs` (as AVX2) then `vpdpwssd` for the sub-blocks' integer
    /// scales, where AVX2 takes `madd` and an add per sub-block. The integer sums are the AVX2
    /// kernel's.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,bmi2,avx2,fma,f16c")]
    pub(super) unsafe fn rows_k(
        w: &WeightMatrix,
        rows: Range<usize>,
        a: &Q8Activations,
        n: usize,
        out: *mut f32,
    ) {
        match n {
            1 => rows_k_tokens::<1>(w, rows, a, out),
            2 => rows_k_tokens::<2>(w, rows, a, out),
            3 => rows_k_tokens::<3>(w, rows, a, out),
            4 => rows_k_tokens::<4>(w, rows, a, out),
            _ => avx2::rows_k(w, rows, a, n, out),
        }
    }

    /// [`rows_k`] for `M` (1 to 4) tokens: each super-block's codes and scales taken apart once,
    /// then multiplied with every token's codes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,bmi2,avx2,fma,f16c")]
    unsafe fn rows_k_tokens<const M: usize>(
        w: &WeightMatrix,
        rows: Range<usize>,
        a: &Q8Activations,
        out: *mut f32,
    ) {
        let bytes = w.dtype.block_bytes();
        let data = w.data.as_slice();
        let row_bytes = w.row_bytes();
        let supers = w.cols / 256;
        assert!(
            data.len() >= rows.end * row_bytes && a.codes.len() >= M * w.cols && a.block == 256
        );
        let m4 = _mm512_set1_epi8(0x0f);
        let m32 = _mm512_set1_epi8(32);
        let end = rows.end;
        for r in rows {
            if r + avx2::K_AHEAD < end {
                avx2::prefetch_rows(
                    data.as_ptr().add((r + avx2::K_AHEAD) * row_bytes),
                    1,
                    row_bytes,
                );
            }
            let row = &data[r * row_bytes..(r + 1) * row_bytes];
            let mut acc = [_mm512_setzero_ps(); M];
            let mut extra = [0f32; M];
            for (sb, b) in row.chunks_exact(bytes).enumerate() {
                let p = b.as_ptr();
                // The super-block's four pairs of sub-blocks: unsigned codes and i16 scales.
                let mut codes = [_mm512_setzero_si512(); 4];
                let mut scales = [_mm512_setzero_si512(); 4];
                let q6 = w.dtype == DType::Q6_K;
                let mut mins = [0i32; 8];
                // The super-block's scale and (Q4_K, Q5_K) the scale of its minimums.
                let (d, dmin) = match w.dtype {
                    DType::Q4_K | DType::Q5_K => {
                        let mut sc = [0i16; 8];
                        for (s, v) in sc.iter_mut().enumerate() {
                            let (scale, min) = scale_min_k4(s, &b[4..16]);
                            *v = scale as i16;
                            mins[s] = min as i32;
                        }
                        let q5 = w.dtype == DType::Q5_K;
                        let (qs_at, qh) = match q5 {
                            true => (48, _mm256_loadu_si256(p.add(16) as *const __m256i)),
                            false => (16, _mm256_setzero_si256()),
                        };
                        let qh = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qh), qh);
                        for j in 0..4 {
                            let qs = _mm256_loadu_si256(p.add(qs_at + 32 * j) as *const __m256i);
                            let both = _mm512_inserti64x4::<1>(
                                _mm512_castsi256_si512(qs),
                                _mm256_srli_epi16::<4>(qs),
                            );
                            let mut q = _mm512_and_si512(both, m4);
                            if q5 {
                                let probe = _mm512_inserti64x4::<1>(
                                    _mm512_set1_epi8(1 << (2 * j)),
                                    _mm256_set1_epi8(1 << (2 * j + 1)),
                                );
                                let bits = _mm512_test_epi8_mask(qh, probe);
                                q = _mm512_mask_add_epi8(q, bits, q, _mm512_set1_epi8(16));
                            }
                            codes[j] = q;
                            scales[j] = _mm512_inserti64x4::<1>(
                                _mm512_set1_epi16(sc[2 * j]),
                                _mm256_set1_epi16(sc[2 * j + 1]),
                            );
                        }
                        (f16_at(b, 0), f16_at(b, 2))
                    }
                    _ => {
                        let sc16 =
                            _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192) as *const __m128i));
                        let sc16 = _mm512_castsi256_si512(sc16);
                        for h in 0..2 {
                            let ql = _mm512_loadu_si512(p.add(64 * h) as *const _);
                            let qh = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
                            let qh = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qh), qh);
                            for k in 0..2 {
                                let lo = match k {
                                    0 => _mm512_and_si512(ql, m4),
                                    _ => _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
                                };
                                let shifts = match k {
                                    0 => _mm512_inserti64x4::<1>(
                                        _mm512_setzero_si512(),
                                        _mm256_set1_epi16(2),
                                    ),
                                    _ => _mm512_inserti64x4::<1>(
                                        _mm512_set1_epi16(4),
                                        _mm256_set1_epi16(6),
                                    ),
                                };
                                let hi = _mm512_and_si512(
                                    _mm512_slli_epi16::<4>(_mm512_srlv_epi16(qh, shifts)),
                                    _mm512_set1_epi8(0x30),
                                );
                                let j = 2 * h + k;
                                codes[j] = _mm512_or_si512(lo, hi);
                                let index = _mm512_add_epi16(
                                    _mm512_set1_epi16(4 * j as i16),
                                    _mm512_inserti64x4::<1>(
                                        _mm512_castsi256_si512(_mm256_set_m128i(
                                            _mm_set1_epi16(1),
                                            _mm_setzero_si128(),
                                        )),
                                        _mm256_set_m128i(_mm_set1_epi16(3), _mm_set1_epi16(2)),
                                    ),
                                );
                                scales[j] = _mm512_permutexvar_epi16(index, sc16);
                            }
                        }
                        (f16_at(b, 208), 0.0)
                    }
                };
                for t in 0..M {
                    let xs_at = a.codes.as_ptr().add(t * w.cols + sb * 256);
                    let ad = a.d[t * supers + sb];
                    let mut sumi = _mm512_setzero_si512();
                    for j in 0..4 {
                        let xs = _mm512_loadu_si512(xs_at.add(64 * j) as *const _);
                        let p16 = match q6 {
                            // Codes offset by 32: 32 x the activations taken off, exactly.
                            true => _mm512_sub_epi16(
                                _mm512_maddubs_epi16(codes[j], xs),
                                _mm512_maddubs_epi16(m32, xs),
                            ),
                            false => _mm512_maddubs_epi16(codes[j], xs),
                        };
                        sumi = _mm512_dpwssd_epi32(sumi, p16, scales[j]);
                    }
                    acc[t] =
                        _mm512_fmadd_ps(_mm512_set1_ps(d * ad), _mm512_cvtepi32_ps(sumi), acc[t]);
                    if !q6 {
                        let sums = &a.sum16[(t * w.cols + sb * 256) / 16..][..16];
                        let summ: i32 = (0..8)
                            .map(|s| mins[s] * (sums[2 * s] + sums[2 * s + 1]))
                            .sum();
                        extra[t] -= dmin * summ as f32 * ad;
                    }
                }
            }
            for t in 0..M {
                *out.add(t * w.rows + r) = _mm512_reduce_add_ps(acc[t]) + extra[t];
            }
        }
    }

    /// Rows a group takes, and groups ahead prefetched, as the AVX2 kernel's.
    const ROWS: usize = avx2::ROWS;
    const AHEAD: usize = avx2::AHEAD;
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
        // (blocks of 32, super-blocks of 256) kernels.
        let mut kernels: Vec<(&str, Q8Kernel, Q8Kernel)> =
            vec![("portable", rows_portable, rows_k_portable)];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            kernels.push(("avx2", avx2::rows, avx2::rows_k));
        }
        #[cfg(target_arch = "x86_64")]
        if avx512::detected() {
            kernels.push(("avx512", avx512::rows, avx512::rows_k));
        }
        let types = [
            DType::Q4_0,
            DType::Q4_1,
            DType::Q8_0,
            DType::Q5_0,
            DType::Q5_1,
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
        ];
        for dtype in types {
            // An odd count of blocks (352 = 11 x 32) for the types in blocks of 32.
            let shapes: &[(usize, usize)] = match super_blocks(dtype) {
                true => &[(37, 256), (9, 2048)],
                false => &[(37, 256), (9, 2048), (13, 352)],
            };
            for &(rows, cols) in shapes {
                // Types Turbo writes are quantized from random values; those it only reads are
                // random blocks with finite scales.
                let bytes: Vec<u8> = match DType::WRITABLE.contains(&dtype) {
                    true => (0..rows)
                        .flat_map(|_| {
                            let row: Vec<f32> =
                                (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
                            quantize_row(dtype, &row)
                        })
                        .collect(),
                    false => {
                        crate::quant::random_blocks(dtype, rows * cols / dtype.block_len(), || {
                            rng.random()
                        })
                    }
                };
                let w = WeightMatrix::new(dtype, rows, cols, crate::Bytes::owned(bytes)).unwrap();
                let wf = w.to_f32();
                for n in 1..=4usize {
                    // Mixed magnitudes, one block all zeros.
                    let mut x: Vec<f32> = (0..n * cols)
                        .map(|i| rng.random_range(-1.0..1.0) * if i % 96 < 32 { 4.0 } else { 0.1 })
                        .collect();
                    x[32..64].fill(0.0);
                    let acts = match super_blocks(dtype) {
                        true => Q8Activations::super_blocks(&x, n, cols),
                        false => Q8Activations::new(&x, n, cols),
                    };
                    for &(name, blocks32, blocks256) in &kernels {
                        let kernel = if super_blocks(dtype) {
                            blocks256
                        } else {
                            blocks32
                        };
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
                                    bound += wv.abs() * acts.scale(t, c, cols) as f64 / 2.0;
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
