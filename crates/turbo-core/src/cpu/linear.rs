//! `y = x · Wᵀ` for weights in any [`DType`], the CPU's hot path.
//!
//! Few tokens (decode): a matrix-vector product that streams each weight row once and decodes its
//! blocks on the fly into registers, so quantized weights cost their stored size in memory traffic.
//! Many tokens (prefill): row panels are decoded to f32 once and handed to a GEMM, where the decode
//! is amortised over the tokens.

use crate::{DType, WeightMatrix};
use rayon::prelude::*;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::OnceLock;

/// Tokens a row-dot kernel call takes at most.
const GEMV_MAX_TOKENS: usize = 4;

/// Tokens up to which a product streams the weights ([`gemv`]: each task's rows, while in cache,
/// for every group of [`GEMV_MAX_TOKENS`] tokens) rather than decoding them into panels for the
/// GEMM, which costs a pass over the whole matrix whatever the tokens. Measured on SmolLM2 with
/// two threads (docs/perf/cpu.md): Q4_0 / Q4_1, whose rows have their own vector kernels, stream
/// faster up to about 128 tokens; Q8_0 / Q5_0 (most of a Q4_K_M file of SmolLM2's widths), with
/// such kernels too, up to 32-48; the other types and F32 weights up to about 24.
fn stream_max_tokens(dtype: DType) -> usize {
    match dtype {
        DType::Q4_0 | DType::Q4_1 => 64,
        DType::Q8_0 | DType::Q5_0 => 32,
        _ => 24,
    }
}

/// Tokens up to which 8-bit activations (`--cpu-activations q8`) take a step's products: the
/// integer kernels, four tokens a call, over each task's rows while they are in cache. Longer
/// prompts keep the f32 GEMM, as llama.cpp's do not.
const Q8_MAX_TOKENS: usize = 64;

/// Fewest output rows per parallel task of the GEMV.
const GEMV_MIN_ROWS_PER_TASK: usize = 16;
/// How far ahead of the current row the GEMV prefetches.
const PREFETCH_ROWS_AHEAD: usize = 4;
/// Rows decoded per GEMM panel: bounds the f32 scratch for large matrices.
const GEMM_PANEL_ROWS: usize = 2048;

/// [`linear`], with the decode products' activations rounded to 8 bits where `activations` asks
/// for it and the weights' type has such a kernel ([`super::q8dot`]).
pub fn linear_with(
    x: &[f32],
    n_tokens: usize,
    w: &WeightMatrix,
    out: &mut [f32],
    activations: super::CpuActivations,
) {
    if activations == super::CpuActivations::Q8
        && (1..=Q8_MAX_TOKENS).contains(&n_tokens)
        && super::q8dot::serves(w.dtype)
        && x.len() == n_tokens * w.cols
        && out.len() == n_tokens * w.rows
    {
        super::q8dot::gemv_q8(x, n_tokens, w, out);
    } else {
        linear(x, n_tokens, w, out);
    }
}

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
    if n_tokens <= stream_max_tokens(w.dtype) {
        gemv(x, n_tokens, w, out);
    } else {
        gemm_panels(x, n_tokens, w, out);
    }
}

/// The output pointer shared by GEMV tasks that write disjoint rows.
pub(crate) struct SyncPtr(pub(crate) *mut f32);
unsafe impl Sync for SyncPtr {}
unsafe impl Send for SyncPtr {}

impl SyncPtr {
    pub(crate) fn get(&self) -> *mut f32 {
        self.0
    }
}

/// Runs `task` in parallel over the ranges a GEMV cuts `rows` output rows into: a few tasks per
/// thread balance the load without paying rayon's per-task cost per row.
pub(crate) fn for_row_tasks(rows: usize, task: impl Fn(Range<usize>) + Sync + Send) {
    let per_task = rows
        .div_ceil(rayon::current_num_threads() * 4)
        .max(GEMV_MIN_ROWS_PER_TASK);
    (0..rows.div_ceil(per_task))
        .into_par_iter()
        .for_each(|t| task(t * per_task..((t + 1) * per_task).min(rows)));
}

fn gemv(x: &[f32], n: usize, w: &WeightMatrix, out: &mut [f32]) {
    let kernel = gemv_kernel();
    let rows = w.rows;
    let out_ptr = SyncPtr(out.as_mut_ptr());
    for_row_tasks(rows, |task_rows| {
        for chunk in (0..n).step_by(GEMV_MAX_TOKENS) {
            let m = (n - chunk).min(GEMV_MAX_TOKENS);
            // SAFETY: the dispatcher only returns kernels whose CPU features were detected; each
            // task writes only its own rows of `out`, all below n * rows.
            unsafe {
                kernel(
                    w,
                    task_rows.clone(),
                    &x[chunk * w.cols..],
                    m,
                    out_ptr.get().add(chunk * rows),
                )
            };
        }
    });
}

/// Computes rows `rows` of `out` (row stride `w.rows`) for `m` tokens of `x`.
type GemvKernel = unsafe fn(&WeightMatrix, Range<usize>, &[f32], usize, *mut f32);

fn gemv_kernel() -> GemvKernel {
    static KERNEL: OnceLock<GemvKernel> = OnceLock::new();
    *KERNEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
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

/// Instantiates the row-dot kernel inside a function compiled for the given CPU features, so the
/// generic code below is auto-vectorised to that instruction set.
macro_rules! row_dots_for {
    ($name:ident, $isa:ty, $q4:path $(, $features:literal)?) => {
        $(#[target_feature(enable = $features)])?
        unsafe fn $name(w: &WeightMatrix, rows: Range<usize>, x: &[f32], m: usize, out: *mut f32) {
            match w.dtype {
                // Q4_1 (the default model's) and Q4_0 have hand-written AVX2 and AVX-512 kernels,
                // Q8_0 and Q5_0 AVX-512 ones (same sums, bit for bit): the generic code below
                // kept its accumulators in memory for them.
                #[cfg(target_arch = "x86_64")]
                DType::Q4_1 | DType::Q4_0 | DType::Q8_0 | DType::Q5_0 if <$isa as Isa>::AVX2 => {
                    $q4(w, rows, x, m, out)
                }
                DType::Q4_1 => rows_by_tokens::<Q4_1, $isa>(w, rows, x, m, out),
                DType::Q4_0 => rows_by_tokens::<Q4_0, $isa>(w, rows, x, m, out),
                DType::Q8_0 => rows_by_tokens::<Q8_0, $isa>(w, rows, x, m, out),
                DType::F32 => rows_by_tokens::<F32, $isa>(w, rows, x, m, out),
                DType::F16 => rows_by_tokens::<F16, $isa>(w, rows, x, m, out),
                DType::BF16 => rows_by_tokens::<BF16, $isa>(w, rows, x, m, out),
                DType::Q5_0 => rows_by_tokens::<Q5_0, $isa>(w, rows, x, m, out),
                DType::Q5_1 => rows_by_tokens::<Q5_1, $isa>(w, rows, x, m, out),
                DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K => {
                    decoded_rows_by_tokens::<$isa>(w, rows, x, m, out)
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
row_dots_for!(
    row_dots_avx512,
    X86Fma,
    q4_blocks::rows_by_tokens_avx512,
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
);
#[cfg(target_arch = "x86_64")]
row_dots_for!(
    row_dots_avx2,
    X86Fma,
    q4_blocks::rows_by_tokens,
    "avx2,fma,f16c"
);
// (The Q4 arm is compiled on x86-64 only, and `Portable` never takes it.)
row_dots_for!(row_dots_portable, Portable, q4_blocks::rows_by_tokens);

/// What the instruction set offers the generic kernel: fused multiply-add and hardware f16
/// conversion. Only kernels compiled with those features may use an `Isa` that claims them.
trait Isa {
    /// Whether kernels of this instruction set may call [`q4_blocks`].
    const AVX2: bool;
    fn mul_add(a: f32, b: f32, c: f32) -> f32;
    fn f16_to_f32(bits: u16) -> f32;
}

struct Portable;
impl Isa for Portable {
    const AVX2: bool = false;
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
    #[inline(always)]
    fn f16_to_f32(bits: u16) -> f32 {
        f16_bits_to_f32(bits)
    }
}

#[cfg(target_arch = "x86_64")]
struct X86Fma;
#[cfg(target_arch = "x86_64")]
impl Isa for X86Fma {
    const AVX2: bool = true;
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    fn f16_to_f32(bits: u16) -> f32 {
        // SAFETY: only instantiated inside kernels compiled with (and dispatched on) f16c.
        unsafe {
            use std::arch::x86_64::{_mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32};
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
        }
    }
}

/// A storage format decoded 32 elements at a time, as two 16-lane halves.
trait Group32 {
    /// Bytes per 32 elements.
    const BYTES: usize;
    fn decode<I: Isa>(bytes: &[u8], lo: &mut [f32; 16], hi: &mut [f32; 16]);
    /// Element `c` of a row, for the partial group that plain float rows may end with.
    fn element(_row: &[u8], _c: usize) -> f32 {
        unreachable!("block formats hold whole groups of 32")
    }
}

/// Exact f16 to f32 for every input, subnormals, infinities and NaN included: the exponent and
/// mantissa are moved into f32 position and rebased by a multiplication with 2^112.
#[inline(always)]
pub(crate) fn f16_bits_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let rest = (h & 0x7fff) as u32;
    let magnitude = if rest >= 0x7c00 {
        f32::from_bits((rest << 13) | 0x7f80_0000)
    } else {
        f32::from_bits(rest << 13) * f32::from_bits(0x7780_0000)
    };
    f32::from_bits(magnitude.to_bits() | sign)
}

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

#[inline(always)]
fn f16_at_with<I: Isa>(b: &[u8], at: usize) -> f32 {
    I::f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

struct Q4_1;
impl Group32 for Q4_1 {
    const BYTES: usize = 20;
    #[inline(always)]
    fn decode<I: Isa>(b: &[u8], lo: &mut [f32; 16], hi: &mut [f32; 16]) {
        let (d, m) = (f16_at_with::<I>(b, 0), f16_at_with::<I>(b, 2));
        let qs: &[u8; 16] = b[4..20].try_into().unwrap();
        for j in 0..16 {
            lo[j] = (qs[j] & 0x0f) as f32 * d + m;
            hi[j] = (qs[j] >> 4) as f32 * d + m;
        }
    }
}

struct Q4_0;
impl Group32 for Q4_0 {
    const BYTES: usize = 18;
    #[inline(always)]
    fn decode<I: Isa>(b: &[u8], lo: &mut [f32; 16], hi: &mut [f32; 16]) {
        let d = f16_at_with::<I>(b, 0);
        let qs: &[u8; 16] = b[2..18].try_into().unwrap();
        for j in 0..16 {
            lo[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
            hi[j] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// Q5_0 and Q5_1: the fifth bit of element `j` is bit `j` of the 32-bit `qh`.
#[inline(always)]
fn decode_q5<I: Isa>(b: &[u8], min: Option<f32>, lo: &mut [f32; 16], hi: &mut [f32; 16]) {
    let d = f16_at_with::<I>(b, 0);
    let at = if min.is_some() { 4 } else { 2 };
    let qh = u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
    let qs: &[u8; 16] = b[at + 4..at + 20].try_into().unwrap();
    for j in 0..16 {
        let q0 = (qs[j] as u32 & 0x0f) | (((qh >> j) << 4) & 0x10);
        let q1 = (qs[j] as u32 >> 4) | ((qh >> (j + 12)) & 0x10);
        match min {
            Some(m) => {
                lo[j] = q0 as f32 * d + m;
                hi[j] = q1 as f32 * d + m;
            }
            None => {
                lo[j] = (q0 as i32 - 16) as f32 * d;
                hi[j] = (q1 as i32 - 16) as f32 * d;
            }
        }
    }
}

struct Q5_0;
impl Group32 for Q5_0 {
    const BYTES: usize = 22;
    #[inline(always)]
    fn decode<I: Isa>(b: &[u8], lo: &mut [f32; 16], hi: &mut [f32; 16]) {
        decode_q5::<I>(b, None, lo, hi);
    }
}

struct Q5_1;
impl Group32 for Q5_1 {
    const BYTES: usize = 24;
    #[inline(always)]
    fn decode<I: Isa>(b: &[u8], lo: &mut [f32; 16], hi: &mut [f32; 16]) {
        let m = f16_at_with::<I>(b, 2);
        decode_q5::<I>(b, Some(m), lo, hi);
    }
}

struct Q8_0;
impl Group32 for Q8_0 {
    const BYTES: usize = 34;
    #[inline(always)]
    fn decode<I: Isa>(b: &[u8], lo: &mut [f32; 16], hi: &mut [f32; 16]) {
        let d = f16_at_with::<I>(b, 0);
        let qs: &[u8; 32] = b[2..34].try_into().unwrap();
        for j in 0..16 {
            lo[j] = (qs[j] as i8) as f32 * d;
            hi[j] = (qs[j + 16] as i8) as f32 * d;
        }
    }
}

struct F32;
impl Group32 for F32 {
    const BYTES: usize = 128;
    #[inline(always)]
    fn decode<I: Isa>(b: &[u8], lo: &mut [f32; 16], hi: &mut [f32; 16]) {
        for j in 0..16 {
            lo[j] = f32::from_le_bytes(b[j * 4..j * 4 + 4].try_into().unwrap());
            hi[j] = f32::from_le_bytes(b[64 + j * 4..64 + j * 4 + 4].try_into().unwrap());
        }
    }
    fn element(row: &[u8], c: usize) -> f32 {
        f32::from_le_bytes(row[c * 4..c * 4 + 4].try_into().unwrap())
    }
}

struct F16;
impl Group32 for F16 {
    const BYTES: usize = 64;
    #[inline(always)]
    fn decode<I: Isa>(b: &[u8], lo: &mut [f32; 16], hi: &mut [f32; 16]) {
        for j in 0..16 {
            lo[j] = f16_at_with::<I>(b, j * 2);
            hi[j] = f16_at_with::<I>(b, 32 + j * 2);
        }
    }
    fn element(row: &[u8], c: usize) -> f32 {
        f16_at(row, c * 2)
    }
}

struct BF16;
impl Group32 for BF16 {
    const BYTES: usize = 64;
    #[inline(always)]
    fn decode<I: Isa>(b: &[u8], lo: &mut [f32; 16], hi: &mut [f32; 16]) {
        let at = |i: usize| f32::from_bits((u16::from_le_bytes([b[i], b[i + 1]]) as u32) << 16);
        for j in 0..16 {
            lo[j] = at(j * 2);
            hi[j] = at(32 + j * 2);
        }
    }
    fn element(row: &[u8], c: usize) -> f32 {
        f32::from_bits((u16::from_le_bytes([row[c * 2], row[c * 2 + 1]]) as u32) << 16)
    }
}

#[inline(always)]
unsafe fn rows_by_tokens<G: Group32, I: Isa>(
    w: &WeightMatrix,
    rows: Range<usize>,
    x: &[f32],
    m: usize,
    out: *mut f32,
) {
    match m {
        1 => rows_for::<G, I, 1>(w, rows, x, out),
        2 => rows_for::<G, I, 2>(w, rows, x, out),
        3 => rows_for::<G, I, 3>(w, rows, x, out),
        _ => rows_for::<G, I, 4>(w, rows, x, out),
    }
}

/// Rows are short (hundreds of bytes): a GEMV at row `r` of `end` asks for a later row early, so
/// that its loads overlap this row's arithmetic instead of stalling at the start of every row.
#[inline(always)]
fn prefetch_ahead(data: &[u8], r: usize, end: usize, row_bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    if r + PREFETCH_ROWS_AHEAD < end {
        let at = (r + PREFETCH_ROWS_AHEAD) * row_bytes;
        for line in (at..(at + row_bytes).min(data.len())).step_by(64) {
            // SAFETY: a prefetch of an address inside `data`; it never faults.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    data.as_ptr().add(line) as *const i8,
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, r, end, row_bytes);
}

#[inline(always)]
unsafe fn rows_for<G: Group32, I: Isa, const M: usize>(
    w: &WeightMatrix,
    rows: Range<usize>,
    x: &[f32],
    out: *mut f32,
) {
    let data = w.data.as_slice();
    let row_bytes = w.row_bytes();
    let end = rows.end;
    for r in rows {
        prefetch_ahead(data, r, end, row_bytes);
        let sums = row_dots::<G, I, M>(&data[r * row_bytes..(r + 1) * row_bytes], x, w.cols);
        for (t, s) in sums.iter().enumerate() {
            *out.add(t * w.rows + r) = *s;
        }
    }
}

thread_local! {
    /// One decoded K-quant row.
    static DECODED_ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The K-quants (super-blocks of 256 with packed sub-block scales): each row is decoded once
/// into an f32 scratch row that stays in cache, then dotted with the tokens as f32 weights.
#[inline(always)]
unsafe fn decoded_rows_by_tokens<I: Isa>(
    w: &WeightMatrix,
    rows: Range<usize>,
    x: &[f32],
    m: usize,
    out: *mut f32,
) {
    // The scratch row is taken out of its cell rather than used inside `with`'s closure: a
    // closure does not inherit this function's target features, so the dot products compiled
    // there called a library `fmaf` per element.
    let mut scratch = DECODED_ROW.take();
    scratch.resize(w.cols, 0.0);
    for r in rows {
        // Decoded here, inlined into this kernel's instruction set (a call to the shared
        // decoder ran it as baseline x86-64 code).
        for (o, block) in scratch
            .chunks_exact_mut(256)
            .zip(w.row(r).chunks_exact(w.dtype.block_bytes()))
        {
            let o: &mut [f32; 256] = o.try_into().expect("chunks of 256");
            crate::quant::dequantize_superblock(w.dtype, block, o);
        }
        let bytes: &[u8] = bytemuck::cast_slice(&scratch);
        let sums: [f32; 4] = match m {
            1 => pad(row_dots::<F32, I, 1>(bytes, x, w.cols)),
            2 => pad(row_dots::<F32, I, 2>(bytes, x, w.cols)),
            3 => pad(row_dots::<F32, I, 3>(bytes, x, w.cols)),
            _ => row_dots::<F32, I, 4>(bytes, x, w.cols),
        };
        for (t, s) in sums.iter().take(m).enumerate() {
            *out.add(t * w.rows + r) = *s;
        }
    }
    DECODED_ROW.set(scratch);
}

#[inline(always)]
fn pad<const M: usize>(sums: [f32; M]) -> [f32; 4] {
    let mut out = [0f32; 4];
    out[..M].copy_from_slice(&sums);
    out
}

/// Dot products of one weight row with `M` token rows of `x`, 16 lanes per token held in registers.
#[inline(always)]
fn row_dots<G: Group32, I: Isa, const M: usize>(row: &[u8], x: &[f32], cols: usize) -> [f32; M] {
    let mut sums = [0f32; M];
    // Two accumulator sets, for even and odd groups, halve the FMA dependency chain.
    let mut acc = [[[0f32; 16]; M]; 2];
    let (mut lo, mut hi) = ([0f32; 16], [0f32; 16]);
    let groups = cols / 32;
    assert!(row.len() >= groups * G::BYTES && x.len() >= (M - 1) * cols + groups * 32);
    for g in 0..groups {
        // SAFETY: g < groups, so the group's bytes and every token's 32 inputs are in bounds
        // (checked by the assertion above).
        unsafe {
            G::decode::<I>(
                row.get_unchecked(g * G::BYTES..(g + 1) * G::BYTES),
                &mut lo,
                &mut hi,
            );
            for (t, acc) in acc[g & 1].iter_mut().enumerate() {
                let xs = x.get_unchecked(t * cols + g * 32..t * cols + g * 32 + 32);
                for l in 0..16 {
                    acc[l] = I::mul_add(
                        hi[l],
                        *xs.get_unchecked(l + 16),
                        I::mul_add(lo[l], *xs.get_unchecked(l), acc[l]),
                    );
                }
            }
        }
    }
    let [mut acc, odd] = acc;
    for (a, b) in acc.iter_mut().zip(odd) {
        for l in 0..16 {
            a[l] += b[l];
        }
    }
    for (t, acc) in acc.iter().enumerate() {
        let mut total = acc.iter().sum::<f32>();
        // Plain float rows may end in a partial group of 32.
        for c in groups * 32..cols {
            total += G::element(row, c) * x[t * cols + c];
        }
        sums[t] = total;
    }
    sums
}

/// Decode products of Q4_1 and Q4_0 rows in AVX2 and AVX-512 intrinsics (Q8_0 and Q5_0 in
/// AVX-512 only): the generic [`row_dots`]'s arithmetic, operation for operation (each group's 32 weights decoded as `code * d (+ m)`, two
/// FMAs per lane into the even or odd groups' accumulators, the two sets added lane by lane, the
/// 16 lanes summed in order), so the sums are the same bits; but the accumulators stay in
/// registers, where the generic code, indexing its two sets by the group's parity, kept them in
/// memory and made every group's FMAs wait on a store and a reload.
#[cfg(target_arch = "x86_64")]
mod q4_blocks {
    use super::{prefetch_ahead, Group32, X86Fma};
    use crate::{DType, WeightMatrix};
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// Calls `$rows_for::<KIND, M>` for `$w`'s type (Q4_1, Q8_0, Q5_0, else Q4_0) and `$m` tokens
    /// (1-4).
    macro_rules! by_type_and_tokens {
        ($rows_for:ident, $w:expr, $rows:expr, $x:expr, $m:expr, $out:expr) => {
            match ($w.dtype, $m) {
                (DType::Q4_1, 1) => $rows_for::<Q4_1, 1>($w, $rows, $x, $out),
                (DType::Q4_1, 2) => $rows_for::<Q4_1, 2>($w, $rows, $x, $out),
                (DType::Q4_1, 3) => $rows_for::<Q4_1, 3>($w, $rows, $x, $out),
                (DType::Q4_1, _) => $rows_for::<Q4_1, 4>($w, $rows, $x, $out),
                (DType::Q8_0, 1) => $rows_for::<Q8_0, 1>($w, $rows, $x, $out),
                (DType::Q8_0, 2) => $rows_for::<Q8_0, 2>($w, $rows, $x, $out),
                (DType::Q8_0, 3) => $rows_for::<Q8_0, 3>($w, $rows, $x, $out),
                (DType::Q8_0, _) => $rows_for::<Q8_0, 4>($w, $rows, $x, $out),
                (DType::Q5_0, 1) => $rows_for::<Q5_0, 1>($w, $rows, $x, $out),
                (DType::Q5_0, 2) => $rows_for::<Q5_0, 2>($w, $rows, $x, $out),
                (DType::Q5_0, 3) => $rows_for::<Q5_0, 3>($w, $rows, $x, $out),
                (DType::Q5_0, _) => $rows_for::<Q5_0, 4>($w, $rows, $x, $out),
                (_, 1) => $rows_for::<Q4_0, 1>($w, $rows, $x, $out),
                (_, 2) => $rows_for::<Q4_0, 2>($w, $rows, $x, $out),
                (_, 3) => $rows_for::<Q4_0, 3>($w, $rows, $x, $out),
                (_, _) => $rows_for::<Q4_0, 4>($w, $rows, $x, $out),
            }
        };
    }

    /// Computes rows `rows` of `out` (row stride `w.rows`) for `m` (1 to 4) tokens of `x`.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; `w` is Q4_1 or Q4_0 and `out` holds `m` rows of
    /// `w.rows`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_by_tokens(
        w: &WeightMatrix,
        rows: Range<usize>,
        x: &[f32],
        m: usize,
        out: *mut f32,
    ) {
        // Q8_0 and Q5_0 have 512-bit kernels only; with AVX2 they keep the generic one.
        match w.dtype {
            DType::Q8_0 => super::rows_by_tokens::<super::Q8_0, X86Fma>(w, rows, x, m, out),
            DType::Q5_0 => super::rows_by_tokens::<super::Q5_0, X86Fma>(w, rows, x, m, out),
            _ => by_type_and_tokens!(rows_for, w, rows, x, m, out),
        }
    }

    /// [`rows_by_tokens`] with 512-bit vectors: each group's 32 weights are two vectors of 16
    /// instead of four of 8, and each token's sums one vector of 16 lanes (even and odd groups)
    /// instead of two of 8, lane for lane the same operations, so the same bits.
    ///
    /// # Safety
    /// As [`rows_by_tokens`] (`w` may also be Q8_0 or Q5_0), and the CPU must have AVX-512 F, BW
    /// and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn rows_by_tokens_avx512(
        w: &WeightMatrix,
        rows: Range<usize>,
        x: &[f32],
        m: usize,
        out: *mut f32,
    ) {
        by_type_and_tokens!(rows_for_avx512, w, rows, x, m, out)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn rows_for_avx512<const KIND: u8, const M: usize>(
        w: &WeightMatrix,
        rows: Range<usize>,
        x: &[f32],
        out: *mut f32,
    ) {
        each_row::<KIND, M>(w, rows, x, out, |row, groups| {
            row_dots_avx512::<KIND, M>(row, x, w.cols, groups)
        })
    }

    /// [`row_dots`] in 512-bit vectors: a token's 16 lanes of sums in one vector.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn row_dots_avx512<const KIND: u8, const M: usize>(
        row: *const u8,
        x: &[f32],
        cols: usize,
        groups: usize,
    ) -> [f32; M] {
        let xp = x.as_ptr();
        let (mut even, mut odd) = ([_mm512_setzero_ps(); M], [_mm512_setzero_ps(); M]);
        let mut g = 0;
        while g + 1 < groups {
            group_avx512::<KIND, M>(row, xp, cols, g, &mut even);
            group_avx512::<KIND, M>(row, xp, cols, g + 1, &mut odd);
            g += 2;
        }
        if g < groups {
            group_avx512::<KIND, M>(row, xp, cols, g, &mut even);
        }
        let mut sums = [0f32; M];
        for t in 0..M {
            let mut lanes = [0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), _mm512_add_ps(even[t], odd[t]));
            sums[t] = lanes.iter().sum::<f32>();
        }
        sums
    }

    /// One group into each token's 16 lanes: lane l takes weight l times x[l], then weight
    /// 16 + l times x[16 + l], as the AVX2 kernel's two 8-lane halves do.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn group_avx512<const KIND: u8, const M: usize>(
        row: *const u8,
        x: *const f32,
        cols: usize,
        g: usize,
        acc: &mut [__m512; M],
    ) {
        let b = row.add(g * block_bytes(KIND));
        let scales = _mm_cvtph_ps(_mm_cvtsi32_si128((b as *const i32).read_unaligned()));
        let d = _mm512_set1_ps(_mm_cvtss_f32(scales));
        let widen = |bytes: __m128i| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
        let mask = _mm_set1_epi8(0x0f);
        let nibbles = |at: usize| {
            let qs = _mm_loadu_si128(b.add(at) as *const __m128i);
            [
                _mm_and_si128(qs, mask),
                _mm_and_si128(_mm_srli_epi16::<4>(qs), mask),
            ]
        };
        let [lo, hi] = if KIND == Q8_0 {
            // code * d, the signed codes widened exactly.
            let signed = |at: usize| {
                let bytes = _mm_loadu_si128(b.add(at) as *const __m128i);
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))
            };
            [signed(2), signed(18)].map(|c| _mm512_mul_ps(c, d))
        } else if KIND == Q5_0 {
            // (code - 16) * d, each code's fifth bit from the block's 32-bit mask: bit j for
            // element j, bit 16 + j for element 16 + j.
            let qh = (b.add(2) as *const u32).read_unaligned();
            let fifth = |bits: u32| _mm_and_si128(_mm_movm_epi8(bits as u16), _mm_set1_epi8(0x10));
            let [lo, hi] = nibbles(6);
            let sixteen = _mm512_set1_ps(16.0);
            [
                _mm_or_si128(lo, fifth(qh)),
                _mm_or_si128(hi, fifth(qh >> 16)),
            ]
            .map(|c| _mm512_mul_ps(_mm512_sub_ps(widen(c), sixteen), d))
        } else if KIND == Q4_1 {
            let codes = nibbles(4).map(widen);
            // code * d + m, rounded twice as the generic code does.
            let m = _mm512_set1_ps(_mm_cvtss_f32(_mm_movehdup_ps(scales)));
            codes.map(|c| _mm512_add_ps(_mm512_mul_ps(c, d), m))
        } else {
            // (code - 8) * d: the difference is exact in f32.
            let eight = _mm512_set1_ps(8.0);
            nibbles(2).map(|c| _mm512_mul_ps(_mm512_sub_ps(widen(c), eight), d))
        };
        for (t, acc) in acc.iter_mut().enumerate() {
            let xs = x.add(t * cols + g * 32);
            *acc = _mm512_fmadd_ps(
                hi,
                _mm512_loadu_ps(xs.add(16)),
                _mm512_fmadd_ps(lo, _mm512_loadu_ps(xs), *acc),
            );
        }
    }

    const Q4_1: u8 = 0;
    const Q4_0: u8 = 1;
    /// Only in the 512-bit kernels.
    const Q8_0: u8 = 2;
    const Q5_0: u8 = 3;

    /// The generic kernel's block size for the type.
    const fn block_bytes(kind: u8) -> usize {
        match kind {
            Q4_1 => <super::Q4_1 as Group32>::BYTES,
            Q8_0 => <super::Q8_0 as Group32>::BYTES,
            Q5_0 => <super::Q5_0 as Group32>::BYTES,
            _ => <super::Q4_0 as Group32>::BYTES,
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_for<const KIND: u8, const M: usize>(
        w: &WeightMatrix,
        rows: Range<usize>,
        x: &[f32],
        out: *mut f32,
    ) {
        each_row::<KIND, M>(w, rows, x, out, |row, groups| {
            row_dots::<KIND, M>(row, x, w.cols, groups)
        })
    }

    /// The row loop both widths share: checks the sizes, then per row prefetches ahead and
    /// stores each token's sum from `dots(row, groups)` (row stride `w.rows`).
    #[inline(always)]
    unsafe fn each_row<const KIND: u8, const M: usize>(
        w: &WeightMatrix,
        rows: Range<usize>,
        x: &[f32],
        out: *mut f32,
        dots: impl Fn(*const u8, usize) -> [f32; M],
    ) {
        let data = w.data.as_slice();
        let row_bytes = w.row_bytes();
        let groups = w.cols / 32;
        assert!(
            row_bytes >= groups * block_bytes(KIND)
                && data.len() >= rows.end * row_bytes
                && x.len() >= (M - 1) * w.cols + groups * 32
        );
        let end = rows.end;
        for r in rows {
            prefetch_ahead(data, r, end, row_bytes);
            let sums = dots(data.as_ptr().add(r * row_bytes), groups);
            for (t, s) in sums.iter().enumerate() {
                *out.add(t * w.rows + r) = *s;
            }
        }
    }

    /// A group's 32 weights as four vectors: lanes 0-7 and 8-15 of the first 16, then of the
    /// second 16 (the generic code's `lo` and `hi`).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn decode<const KIND: u8>(b: *const u8) -> [__m256; 4] {
        // The block's f16 scale (and Q4_1's minimum) by F16C, as the generic kernel converts.
        let scales = _mm_cvtph_ps(_mm_cvtsi32_si128((b as *const i32).read_unaligned()));
        let d = _mm256_set1_ps(_mm_cvtss_f32(scales));
        let widen = |bytes: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
        let at = if KIND == Q4_1 { 4 } else { 2 };
        let qs = _mm_loadu_si128(b.add(at) as *const __m128i);
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(qs, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), mask);
        let codes = [
            widen(lo),
            widen(_mm_srli_si128::<8>(lo)),
            widen(hi),
            widen(_mm_srli_si128::<8>(hi)),
        ];
        if KIND == Q4_1 {
            // code * d + m, rounded twice as the generic code does.
            let m = _mm256_set1_ps(_mm_cvtss_f32(_mm_movehdup_ps(scales)));
            codes.map(|c| _mm256_add_ps(_mm256_mul_ps(c, d), m))
        } else {
            // (code - 8) * d: the difference is exact in f32.
            let eight = _mm256_set1_ps(8.0);
            codes.map(|c| _mm256_mul_ps(_mm256_sub_ps(c, eight), d))
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn group<const KIND: u8, const M: usize>(
        row: *const u8,
        x: *const f32,
        cols: usize,
        g: usize,
        acc: &mut [[__m256; 2]; M],
    ) {
        let [lo0, lo1, hi0, hi1] = decode::<KIND>(row.add(g * block_bytes(KIND)));
        for (t, acc) in acc.iter_mut().enumerate() {
            let xs = x.add(t * cols + g * 32);
            acc[0] = _mm256_fmadd_ps(
                hi0,
                _mm256_loadu_ps(xs.add(16)),
                _mm256_fmadd_ps(lo0, _mm256_loadu_ps(xs), acc[0]),
            );
            acc[1] = _mm256_fmadd_ps(
                hi1,
                _mm256_loadu_ps(xs.add(24)),
                _mm256_fmadd_ps(lo1, _mm256_loadu_ps(xs.add(8)), acc[1]),
            );
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn row_dots<const KIND: u8, const M: usize>(
        row: *const u8,
        x: &[f32],
        cols: usize,
        groups: usize,
    ) -> [f32; M] {
        let zero = _mm256_setzero_ps();
        let (mut even, mut odd) = ([[zero; 2]; M], [[zero; 2]; M]);
        let xp = x.as_ptr();
        let mut g = 0;
        while g + 1 < groups {
            group::<KIND, M>(row, xp, cols, g, &mut even);
            group::<KIND, M>(row, xp, cols, g + 1, &mut odd);
            g += 2;
        }
        if g < groups {
            group::<KIND, M>(row, xp, cols, g, &mut even);
        }
        let mut sums = [0f32; M];
        for t in 0..M {
            let mut lanes = [0f32; 16];
            _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(even[t][0], odd[t][0]));
            _mm256_storeu_ps(
                lanes.as_mut_ptr().add(8),
                _mm256_add_ps(even[t][1], odd[t][1]),
            );
            sums[t] = lanes.iter().sum::<f32>();
        }
        sums
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
                let bytes: Vec<u8> = match DType::WRITABLE.contains(&dtype) {
                    true => values
                        .chunks(cols)
                        .flat_map(|r| quantize_row(dtype, r))
                        .collect(),
                    // Types only read from files: random blocks (all rows here are whole
                    // super-blocks of 256 for the K-quants).
                    false if !cols.is_multiple_of(dtype.block_len()) => continue,
                    false => {
                        crate::quant::random_blocks(dtype, rows * cols / dtype.block_len(), || {
                            rng.random()
                        })
                    }
                };
                let w = WeightMatrix::new(dtype, rows, cols, crate::Bytes::owned(bytes)).unwrap();
                // One group of tokens, several with a partial last one (streamed), and more
                // tokens than any type streams (the GEMM).
                for n in [1usize, 3, 4, 5, 17, 70] {
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

    /// The generic kernel for `dtype` with FMA, which the AVX2 block kernels must equal.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn generic_fma(w: &WeightMatrix, x: &[f32], m: usize, out: *mut f32) {
        let rows = 0..w.rows;
        match w.dtype {
            DType::Q4_1 => rows_by_tokens::<Q4_1, X86Fma>(w, rows, x, m, out),
            DType::Q4_0 => rows_by_tokens::<Q4_0, X86Fma>(w, rows, x, m, out),
            DType::Q8_0 => rows_by_tokens::<Q8_0, X86Fma>(w, rows, x, m, out),
            DType::Q5_0 => rows_by_tokens::<Q5_0, X86Fma>(w, rows, x, m, out),
            _ => rows_by_tokens::<Q4_0, X86Fma>(w, rows, x, m, out),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q4_block_kernels_give_the_generic_sums_bit_for_bit() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            println!("skipping: this CPU lacks AVX2, FMA or F16C");
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for dtype in [DType::Q4_1, DType::Q4_0, DType::Q8_0, DType::Q5_0] {
            // An odd and an even number of groups, and a long row.
            for (rows, cols) in [(9usize, 96usize), (6, 128), (3, 8192)] {
                let values: Vec<f32> = (0..rows * cols)
                    .map(|_| rng.random_range(-2.0..2.0))
                    .collect();
                let bytes: Vec<u8> = match DType::WRITABLE.contains(&dtype) {
                    true => values
                        .chunks(cols)
                        .flat_map(|r| quantize_row(dtype, r))
                        .collect(),
                    // Q5_0 is only read from files: random blocks with finite scales.
                    false => crate::quant::random_blocks(dtype, rows * cols / 32, || rng.random()),
                };
                let w = WeightMatrix::new(dtype, rows, cols, crate::Bytes::owned(bytes)).unwrap();
                for m in 1..=4 {
                    let x: Vec<f32> = (0..m * cols).map(|_| rng.random_range(-3.0..3.0)).collect();
                    let (mut want, mut got) = (vec![0f32; m * rows], vec![1f32; m * rows]);
                    // SAFETY: the features were detected above; both write m rows of `rows`.
                    unsafe {
                        generic_fma(&w, &x, m, want.as_mut_ptr());
                        q4_blocks::rows_by_tokens(&w, 0..rows, &x, m, got.as_mut_ptr());
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{dtype} {rows}x{cols} m={m}");
                    if is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vl")
                    {
                        got.fill(1.0);
                        // SAFETY: AVX-512 F, BW and VL were detected, with the features above.
                        unsafe {
                            q4_blocks::rows_by_tokens_avx512(&w, 0..rows, &x, m, got.as_mut_ptr())
                        };
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "avx512 {dtype} {rows}x{cols} m={m}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn f16_conversion_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let want = half::f16::from_bits(bits).to_f32();
            let got = f16_bits_to_f32(bits);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#06x}: {got} vs {want}"
            );
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
