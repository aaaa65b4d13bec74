//! Tiled attention for many query rows of one sequence over its paged keys.
//!
//! The per-row path ([`crate::paged`]) reads every key and value row once per query head and row,
//! so a prefill chunk of `n` tokens over a long history fetches the whole history `n · heads` times
//! and does two flops per loaded float. Here one work item takes a *tile* of query rows that read
//! the same keys: the query heads of one KV head for several consecutive tokens of one sequence
//! (`rows = tokens · heads per KV head`). The tile walks its keys in chunks of [`KEY_CHUNK`]
//! (block by block through the block table, so a chunk may span blocks), and for each chunk
//!
//! 1. scores every (key, row) pair, `S[j][r] = q_r · k_j`, with the rows in SIMD lanes: each key
//!    element is loaded once and broadcast against vectors of rows ([`scores_micro`]: `JB` keys ×
//!    `RV` vectors of rows of accumulators held in registers, read straight from the paged
//!    storage, with no copy of the keys);
//! 2. updates each row's online softmax (running max `m`, running sum `l`), a vector of rows at
//!    a time: `corr = 2^(m_old − m_new)`, `P[j][r] = 2^(S[j][r] − m_new)`, with a polynomial `2^x`
//!    that the compiler vectorises ([`exp2`]);
//! 3. rescales and accumulates the output, `O[c][r] = O[c][r] · corr[r] + Σ_j v_j[c] · P[j][r]`
//!    ([`values_micro`]: `CB` value columns × `RV` vectors of rows in registers).
//!
//! Each key and value row fetched from memory thus serves a whole tile (up to 48 queries) instead
//! of one query.
//!
//! Queries are pre-multiplied by `scale · log2(e)`, so scores are in base-2 units and the
//! exponentials are `2^x`; the lse returned is converted back to natural log. Rows see keys up to
//! their own position (chunks past a row's position are masked for it); a row that sees no key
//! gets `o = 0` and `lse = -inf`.
//!
//! Every row's arithmetic is independent of the tile it is in and of the other rows (each is one
//! SIMD lane; chunks start at fixed key positions), so results do not depend on tile sizes,
//! thread counts or how rows are blocked.

use crate::PagedKv;

/// Keys scored together before one softmax update. Fixed, so that results do not depend on the
/// machine.
pub(crate) const KEY_CHUNK: usize = 64;
/// Rows are padded to a multiple of this (the smallest row block of the micro-kernels).
const ROW_LANES: usize = 16;

/// One work item: the query rows of `n_tokens` consecutive tokens of one sequence (rows
/// `first_row..first_row + n_tokens` of `q`, at positions `pos0..pos0 + n_tokens`) for the query
/// heads of KV head `kv_head`, over the sequence's keys from `first_key` up to each row's
/// position.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TileJob<'a> {
    pub table: &'a [u32],
    pub kv_head: usize,
    pub first_row: usize,
    pub n_tokens: usize,
    pub pos0: usize,
    pub first_key: usize,
}

/// What every tile of a call reads.
#[derive(Clone, Copy)]
pub(crate) struct TileCtx<'a> {
    pub q: &'a [f32],
    pub n_heads: usize,
    pub kv: &'a PagedKv<'a>,
    pub scale: f32,
}

/// Per-thread buffers of a tile, reused across tiles.
#[derive(Default)]
pub(crate) struct TileScratch {
    /// Queries transposed, `[head_dim][rows]`, scaled to base-2 scores.
    qt: Vec<f32>,
    /// Scores, then probabilities, of one chunk: `[KEY_CHUNK][rows]`.
    p: Vec<f32>,
    /// Output accumulator transposed, `[head_dim][rows]`.
    ot: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
    corr: Vec<f32>,
    /// Per row: one past the last key position it sees.
    end: Vec<u32>,
    /// Offsets of the chunk's key (and value) rows in the KV storage (in `kq` / `vq` when the
    /// storage is quantized).
    at: Vec<usize>,
    /// A quantized chunk's key and value rows decoded, `[KEY_CHUNK][head_dim]` each: one
    /// chunk at a time, so the decoded rows stay in L1 and nothing is copied out whole.
    kq: Vec<f32>,
    vq: Vec<f32>,
}

/// Computes one tile: writes `out` (`[n_tokens][heads per KV head][head_dim]`) and `lse`
/// (`[n_tokens][heads per KV head]`, natural log).
pub(crate) type TileKernel =
    unsafe fn(&TileCtx, &TileJob, &mut TileScratch, &mut [f32], &mut [f32]);

/// The fastest [`TileKernel`] this CPU supports.
pub(crate) fn tile_kernel() -> TileKernel {
    static KERNEL: std::sync::OnceLock<TileKernel> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma") {
            return avx512::tile;
        }
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return avx2::tile;
        }
        portable::tile
    })
}

/// Every [`TileKernel`] this CPU supports, by name (for tests).
#[cfg(test)]
pub(crate) fn tile_kernels() -> Vec<(&'static str, TileKernel)> {
    let mut kernels: Vec<(&'static str, TileKernel)> = vec![("portable", portable::tile)];
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        kernels.push(("avx2", avx2::tile));
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma") {
        kernels.push(("avx512", avx512::tile));
    }
    kernels
}

/// The few vector operations the inner loops need, one implementation per feature set. The
/// compiler keeps arrays of these vectors in registers, which it does not reliably do for the same
/// loops written over plain `f32` arrays: there it vectorised the micro-kernels along the wrong
/// axis (across keys, with gathers and scatters) and ran over 10x slower.
trait Simd {
    /// f32 lanes per vector.
    const LANES: usize;
    type V: Copy;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// `a · b + c`, fused where the target has FMA.
    unsafe fn mul_add(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
}

#[cfg(target_arch = "x86_64")]
struct Avx512;
#[cfg(target_arch = "x86_64")]
impl Simd for Avx512 {
    const LANES: usize = 16;
    type V = std::arch::x86_64::__m512;
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        std::arch::x86_64::_mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::V {
        std::arch::x86_64::_mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        std::arch::x86_64::_mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn mul_add(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::arch::x86_64::_mm512_fmadd_ps(a, b, c)
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;
#[cfg(target_arch = "x86_64")]
impl Simd for Avx2 {
    const LANES: usize = 8;
    type V = std::arch::x86_64::__m256;
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        std::arch::x86_64::_mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::V {
        std::arch::x86_64::_mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        std::arch::x86_64::_mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn mul_add(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::arch::x86_64::_mm256_fmadd_ps(a, b, c)
    }
}

/// Whether the portable kernel's target has fused multiply-add instructions.
const PORTABLE_FUSED: bool = cfg!(any(target_arch = "aarch64", target_feature = "fma"));

/// Four lanes as a plain array, which the compiler maps to SSE or NEON registers.
struct Portable;
impl Simd for Portable {
    const LANES: usize = 4;
    type V = [f32; 4];
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        [0.0; 4]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::V {
        [x; 4]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        p.cast::<[f32; 4]>().read_unaligned()
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        p.cast::<[f32; 4]>().write_unaligned(v)
    }
    #[inline(always)]
    unsafe fn mul_add(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        // Fused only where that is an instruction (it is a libm call on x86-64 without FMA).
        std::array::from_fn(|i| {
            if PORTABLE_FUSED {
                a[i].mul_add(b[i], c[i])
            } else {
                a[i] * b[i] + c[i]
            }
        })
    }
}

/// The inner loops of a tile for one feature set (see `tile_for!`): [`scores`] and [`values`]
/// for a block of `BIG_ROWS` rows (`BIG`) or of [`ROW_LANES`] rows.
trait Kernels {
    /// Rows per block of the big kernels (a multiple of [`ROW_LANES`]).
    const BIG_ROWS: usize;
    /// Whether the target has fused multiply-add instructions.
    const FUSED: bool;
    unsafe fn scores<const BIG: bool>(
        keys: &[f32],
        at: &[usize],
        qt: &[f32],
        rows: RowBlock,
        p: &mut [f32],
    );
    unsafe fn values<const BIG: bool>(
        values: &[f32],
        at: &[usize],
        p: &[f32],
        rows: RowBlock,
        corr: &[f32],
        ot: &mut [f32],
    );
}

/// A block of rows of a tile's transposed buffers (`[..][rp]`): its first row, the row stride
/// `rp` (the tile's rows, padded) and the head dimension.
#[derive(Clone, Copy)]
struct RowBlock {
    r0: usize,
    rp: usize,
    d: usize,
}

// One module per feature set: the tile and its inner loops, compiled for those features. The inner
// loops are functions of their own, called directly (a call through a function pointer would be
// inlined), so that each is optimised on its own. Shapes: RV vectors of rows (RV · LANES rows in
// SIMD lanes) by JB keys or value columns of accumulators, for a big and a small (ROW_LANES rows)
// block. AVX-512: 48 rows = 3 zmm by 8 = 24 of 32 registers, and 16 rows by 16; AVX2: 16 rows = 2
// ymm by 6 = 12 of 16; portable (SSE2, NEON): 16 rows = 4 xmm by 3 = 12.
macro_rules! tile_for {
    ($name:ident, $simd:ty, $fused:expr, [$big_rv:literal, $big_jb:literal], [$small_rv:literal, $small_jb:literal] $(, $features:literal)?) => {
        mod $name {
            use super::*;

            $(#[target_feature(enable = $features)])?
            pub(super) unsafe fn tile(
                ctx: &TileCtx,
                job: &TileJob,
                scratch: &mut TileScratch,
                out: &mut [f32],
                lse: &mut [f32],
            ) {
                super::tile::<K>(ctx, job, scratch, out, lse)
            }

            struct K;
            impl Kernels for K {
                const BIG_ROWS: usize = $big_rv * <$simd as Simd>::LANES;
                const FUSED: bool = $fused;
                #[inline(always)]
                unsafe fn scores<const BIG: bool>(
                    keys: &[f32],
                    at: &[usize],
                    qt: &[f32],
                    rows: RowBlock,
                    p: &mut [f32],
                ) {
                    if BIG {
                        scores_big(keys, at, qt, rows, p)
                    } else {
                        scores_small(keys, at, qt, rows, p)
                    }
                }
                #[inline(always)]
                unsafe fn values<const BIG: bool>(
                    values: &[f32],
                    at: &[usize],
                    p: &[f32],
                    rows: RowBlock,
                    corr: &[f32],
                    ot: &mut [f32],
                ) {
                    if BIG {
                        values_big(values, at, p, rows, corr, ot)
                    } else {
                        values_small(values, at, p, rows, corr, ot)
                    }
                }
            }

            $(#[target_feature(enable = $features)])?
            #[inline(never)]
            unsafe fn scores_big(keys: &[f32], at: &[usize], qt: &[f32], rows: RowBlock, p: &mut [f32]) {
                super::scores::<$simd, $big_rv, $big_jb>(keys, at, qt, rows, p)
            }

            $(#[target_feature(enable = $features)])?
            #[inline(never)]
            unsafe fn scores_small(keys: &[f32], at: &[usize], qt: &[f32], rows: RowBlock, p: &mut [f32]) {
                super::scores::<$simd, $small_rv, $small_jb>(keys, at, qt, rows, p)
            }

            $(#[target_feature(enable = $features)])?
            #[inline(never)]
            unsafe fn values_big(
                values: &[f32],
                at: &[usize],
                p: &[f32],
                rows: RowBlock,
                corr: &[f32],
                ot: &mut [f32],
            ) {
                super::values::<$simd, $big_rv, $big_jb>(values, at, p, rows, corr, ot)
            }

            $(#[target_feature(enable = $features)])?
            #[inline(never)]
            unsafe fn values_small(
                values: &[f32],
                at: &[usize],
                p: &[f32],
                rows: RowBlock,
                corr: &[f32],
                ot: &mut [f32],
            ) {
                super::values::<$simd, $small_rv, $small_jb>(values, at, p, rows, corr, ot)
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
tile_for!(avx512, Avx512, true, [3, 8], [1, 16], "avx512f,avx2,fma");
#[cfg(target_arch = "x86_64")]
tile_for!(avx2, Avx2, true, [2, 6], [2, 6], "avx2,fma");
tile_for!(portable, Portable, PORTABLE_FUSED, [4, 3], [4, 3]);

/// See the module docs. Rows go in blocks of `K::RB`, then of [`ROW_LANES`].
#[inline(always)]
fn tile<K: Kernels>(
    ctx: &TileCtx,
    job: &TileJob,
    s: &mut TileScratch,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let kv = ctx.kv;
    let d = kv.head_dim;
    let per_kv = ctx.n_heads / kv.n_kv_heads;
    let rows = job.n_tokens * per_kv;
    let rp = rows.next_multiple_of(ROW_LANES);
    let slot_stride = kv.n_kv_heads * d;
    assert!(out.len() == rows * d && lse.len() == rows);

    // Queries, transposed and scaled; padding rows are zeros.
    s.qt.clear();
    s.qt.resize(d * rp, 0.0);
    let scale = ctx.scale * std::f32::consts::LOG2_E;
    for t in 0..job.n_tokens {
        for g in 0..per_kv {
            let r = t * per_kv + g;
            let head = job.kv_head * per_kv + g;
            let qh = &ctx.q[((job.first_row + t) * ctx.n_heads + head) * d..][..d];
            for (c, &x) in qh.iter().enumerate() {
                s.qt[c * rp + r] = x * scale;
            }
        }
    }
    s.end.clear();
    s.end.extend((0..rp).map(|r| {
        // Padding rows copy the first row (they are computed and dropped).
        let t = if r < rows { r / per_kv } else { 0 };
        (job.pos0 + t + 1) as u32
    }));
    s.max.clear();
    s.max.resize(rp, f32::NEG_INFINITY);
    s.sum.clear();
    s.sum.resize(rp, 0.0);
    s.corr.clear();
    s.corr.resize(rp, 0.0);
    s.ot.clear();
    s.ot.resize(d * rp, 0.0);
    s.p.clear();
    s.p.resize(KEY_CHUNK * rp, 0.0);
    s.at.clear();
    s.at.resize(KEY_CHUNK, 0);

    let block = |r0| RowBlock { r0, rp, d };
    let key_end = job.pos0 + job.n_tokens;
    // Every key before this is seen by every row of the tile.
    let all_see = job.pos0 + 1;
    let mut c0 = job.first_key;
    while c0 < key_end {
        let n = KEY_CHUNK.min(key_end - c0);
        for (j, a) in s.at[..n].iter_mut().enumerate() {
            let pos = c0 + j;
            let block = job.table[pos / kv.block_size] as usize;
            *a = (block * kv.block_size + pos % kv.block_size) * slot_stride + job.kv_head * d;
        }
        let (keys, values) = kv.chunk_rows(&mut s.at[..n], &mut s.kq, &mut s.vq);
        let at = &s.at[..n];
        let rb = K::BIG_ROWS;
        let mut r0 = 0;
        while r0 < rp {
            // SAFETY: the kernels are those of the feature set the caller was dispatched to.
            unsafe {
                if r0 + rb <= rp {
                    K::scores::<true>(keys, at, &s.qt, block(r0), &mut s.p);
                    r0 += rb;
                } else {
                    K::scores::<false>(keys, at, &s.qt, block(r0), &mut s.p);
                    r0 += ROW_LANES;
                }
            }
        }
        let masked = c0 + n > all_see;
        softmax(
            K::FUSED,
            &mut s.p[..n * rp],
            rp,
            c0 as u32,
            masked,
            &s.end,
            &mut s.max,
            &mut s.sum,
            &mut s.corr,
        );
        let mut r0 = 0;
        while r0 < rp {
            // SAFETY: as above.
            unsafe {
                if r0 + rb <= rp {
                    K::values::<true>(values, at, &s.p, block(r0), &s.corr, &mut s.ot);
                    r0 += rb;
                } else {
                    K::values::<false>(values, at, &s.p, block(r0), &s.corr, &mut s.ot);
                    r0 += ROW_LANES;
                }
            }
        }
        c0 += n;
    }

    // Normalise, transpose back, and convert the lse to natural log.
    for r in 0..rows {
        let o = &mut out[r * d..(r + 1) * d];
        let l = s.sum[r];
        if l == 0.0 {
            o.fill(0.0);
            lse[r] = f32::NEG_INFINITY;
            continue;
        }
        let inv = 1.0 / l;
        for (c, x) in o.iter_mut().enumerate() {
            *x = s.ot[c * rp + r] * inv;
        }
        lse[r] = s.max[r] * std::f32::consts::LN_2 + l.ln();
    }
}

/// Scores of the row block against the chunk's keys (rows `at` of `keys`): `p[j][r]`, in key
/// blocks of `JB` (then single keys).
///
/// # Safety
/// `S`'s features are enabled; `RV · S::LANES` rows from `rows.r0` fit in `rows.rp`.
#[inline(always)]
unsafe fn scores<S: Simd, const RV: usize, const JB: usize>(
    keys: &[f32],
    at: &[usize],
    qt: &[f32],
    rows: RowBlock,
    p: &mut [f32],
) {
    let RowBlock { r0, rp, d } = rows;
    // Bounds checked once, so the loops below index without checks.
    assert!(r0 + RV * S::LANES <= rp && qt.len() >= d * rp && p.len() >= at.len() * rp);
    assert!(at.iter().all(|&a| a + d <= keys.len()));
    let mut j0 = 0;
    while j0 + JB <= at.len() {
        scores_micro::<S, RV, JB>(
            keys,
            &at[j0..j0 + JB],
            qt,
            rows,
            p.as_mut_ptr().add(j0 * rp),
        );
        j0 += JB;
    }
    while j0 < at.len() {
        scores_micro::<S, RV, 1>(keys, &at[j0..j0 + 1], qt, rows, p.as_mut_ptr().add(j0 * rp));
        j0 += 1;
    }
}

/// `JB` keys × `RV` vectors of rows of scores, accumulated in registers over the head dimension:
/// each key element is broadcast against the rows' transposed queries.
///
/// # Safety
/// As [`scores`], whose checks cover the accesses.
#[inline(always)]
unsafe fn scores_micro<S: Simd, const RV: usize, const JB: usize>(
    keys: &[f32],
    at: &[usize],
    qt: &[f32],
    rows: RowBlock,
    p: *mut f32,
) {
    let RowBlock { r0, rp, d } = rows;
    let k: [*const f32; JB] = std::array::from_fn(|j| keys.as_ptr().add(at[j]));
    let mut acc = [[S::zero(); RV]; JB];
    let mut q = qt.as_ptr().add(r0);
    for c in 0..d {
        let qv: [S::V; RV] = std::array::from_fn(|i| S::load(q.add(i * S::LANES)));
        for (kj, aj) in k.iter().zip(acc.iter_mut()) {
            let b = S::splat(*kj.add(c));
            for (x, &y) in aj.iter_mut().zip(&qv) {
                *x = S::mul_add(b, y, *x);
            }
        }
        q = q.add(rp);
    }
    for (j, a) in acc.iter().enumerate() {
        for (i, &v) in a.iter().enumerate() {
            S::store(p.add(j * rp + r0 + i * S::LANES), v);
        }
    }
}

/// Online-softmax update of all rows for one chunk of `n = p.len() / rp` keys starting at key
/// position `c0`: turns the scores `p` into probabilities (relative to each row's new running
/// max), writes each row's rescaling factor `corr` of its previous output, and updates `max` and
/// `sum`. With `masked`, keys at or past a row's `end` get probability 0. `fused`: see [`exp2`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn softmax(
    fused: bool,
    p: &mut [f32],
    rp: usize,
    c0: u32,
    masked: bool,
    end: &[u32],
    max: &mut [f32],
    sum: &mut [f32],
    corr: &mut [f32],
) {
    const L: usize = ROW_LANES;
    for r0 in (0..rp).step_by(L) {
        let e: &[u32; L] = end[r0..r0 + L].try_into().unwrap();
        let m_old: &mut [f32; L] = (&mut max[r0..r0 + L]).try_into().unwrap();
        let mut m = *m_old;
        for (j, srow) in p.chunks_exact(rp).enumerate() {
            let sv: &[f32; L] = srow[r0..r0 + L].try_into().unwrap();
            let pos = c0 + j as u32;
            for i in 0..L {
                let x = if masked && pos >= e[i] {
                    f32::NEG_INFINITY
                } else {
                    sv[i]
                };
                m[i] = fmax(m[i], x);
            }
        }
        let cr: &mut [f32; L] = (&mut corr[r0..r0 + L]).try_into().unwrap();
        for i in 0..L {
            // exp2(-inf) and exp2(NaN) (a row with no key yet) are 0.
            cr[i] = exp2_with(fused, m_old[i] - m[i]);
        }
        let mut total = [0f32; L];
        for (j, srow) in p.chunks_exact_mut(rp).enumerate() {
            let sv: &mut [f32; L] = (&mut srow[r0..r0 + L]).try_into().unwrap();
            let pos = c0 + j as u32;
            for i in 0..L {
                let w = exp2_with(fused, sv[i] - m[i]);
                let w = if masked && pos >= e[i] { 0.0 } else { w };
                sv[i] = w;
                total[i] += w;
            }
        }
        let l: &mut [f32; L] = (&mut sum[r0..r0 + L]).try_into().unwrap();
        for i in 0..L {
            l[i] = l[i] * cr[i] + total[i];
        }
        *m_old = m;
    }
}

/// Output of the row block, all value columns: `ot[c][r] = ot[c][r] · corr[r] + Σ_j v_j[c] ·
/// p[j][r]`, in column blocks of `CB` (then single columns).
///
/// # Safety
/// `S`'s features are enabled; `RV · S::LANES` rows from `rows.r0` fit in `rows.rp`.
#[inline(always)]
unsafe fn values<S: Simd, const RV: usize, const CB: usize>(
    values: &[f32],
    at: &[usize],
    p: &[f32],
    rows: RowBlock,
    corr: &[f32],
    ot: &mut [f32],
) {
    let RowBlock { r0, rp, d } = rows;
    // Bounds checked once, so the loops below index without checks.
    assert!(r0 + RV * S::LANES <= rp && p.len() >= at.len() * rp);
    assert!(corr.len() >= rp && ot.len() >= d * rp);
    assert!(at.iter().all(|&a| a + d <= values.len()));
    let mut c0 = 0;
    while c0 + CB <= d {
        values_micro::<S, RV, CB>(values, at, c0, p, rows, corr, ot);
        c0 += CB;
    }
    while c0 < d {
        values_micro::<S, RV, 1>(values, at, c0, p, rows, corr, ot);
        c0 += 1;
    }
}

/// `CB` value columns × `RV` vectors of rows of the output, accumulated in registers over the
/// chunk's keys (each value element broadcast against the rows' probabilities); the previous
/// output, rescaled, is added at the end.
///
/// # Safety
/// As [`values`], whose checks cover the accesses.
#[inline(always)]
unsafe fn values_micro<S: Simd, const RV: usize, const CB: usize>(
    values: &[f32],
    at: &[usize],
    c0: usize,
    p: &[f32],
    rows: RowBlock,
    corr: &[f32],
    ot: &mut [f32],
) {
    let RowBlock { r0, rp, .. } = rows;
    let mut acc = [[S::zero(); RV]; CB];
    let mut pr = p.as_ptr().add(r0);
    for &a in at {
        let v = values.as_ptr().add(a + c0);
        let pv: [S::V; RV] = std::array::from_fn(|i| S::load(pr.add(i * S::LANES)));
        for (c, ac) in acc.iter_mut().enumerate() {
            let b = S::splat(*v.add(c));
            for (x, &y) in ac.iter_mut().zip(&pv) {
                *x = S::mul_add(b, y, *x);
            }
        }
        pr = pr.add(rp);
    }
    let cr: [S::V; RV] = std::array::from_fn(|i| S::load(corr.as_ptr().add(r0 + i * S::LANES)));
    for (c, a) in acc.iter().enumerate() {
        let o = ot.as_mut_ptr().add((c0 + c) * rp + r0);
        for i in 0..RV {
            let o = o.add(i * S::LANES);
            S::store(o, S::mul_add(S::load(o), cr[i], a[i]));
        }
    }
}

/// `a > b ? a : b`: one instruction (`maxps`), unlike `f32::max`'s NaN handling; a NaN `a` gives `b`.
#[inline(always)]
fn fmax(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// [`exp2`], fused or not (`fused` is a constant where this is inlined).
#[inline(always)]
fn exp2_with(fused: bool, x: f32) -> f32 {
    if fused {
        exp2::<true>(x)
    } else {
        exp2::<false>(x)
    }
}

/// `2^x` for `x <= 0` (the only arguments here), written to vectorise: `x = n + f` with `n` an
/// integer and `|f| <= 1/2`, `2^f` by a degree-6 minimax polynomial (Cephes `exp2f`, about 1 ulp),
/// `2^n` built in the exponent bits. Returns 0 for `x <= -126.5`, `-inf` and NaN (the exponent
/// underflows to a zero float). `FUSED`: evaluate the polynomial with fused multiply-adds (only
/// where the target has them: otherwise each is a libm call).
#[inline(always)]
pub(crate) fn exp2<const FUSED: bool>(x: f32) -> f32 {
    // 1.5 · 2^23: adding it rounds to an integer, kept in the low mantissa bits.
    const SHIFT: f32 = 12_582_912.0;
    const P: [f32; 7] = [
        1.535_336_2e-4,
        1.339_887_4e-3,
        9.618_437e-3,
        5.550_332_5e-2,
        2.402_264_8e-1,
        6.931_472e-1,
        1.0,
    ];
    let x = fmax(x, -127.0);
    let x = if x > 127.0 { 127.0 } else { x };
    let t = x + SHIFT;
    let n = t - SHIFT;
    let f = x - n;
    let mut poly = P[0];
    for &c in &P[1..] {
        poly = if FUSED {
            poly.mul_add(f, c)
        } else {
            poly * f + c
        };
    }
    // The integer n sits in t's low mantissa bits, offset by t = SHIFT's bits.
    let n_bits = t.to_bits().wrapping_sub(SHIFT.to_bits());
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    scale * poly
}

#[cfg(test)]
mod tests {
    use super::exp2;

    #[test]
    fn exp2_is_close_to_libm_over_its_range() {
        for exp2 in [exp2::<true>, exp2::<false>] {
            let mut x = -126.0f32;
            while x <= 0.0 {
                let (got, want) = (exp2(x) as f64, (x as f64).exp2());
                // A few f32 ulps (2^-23 = 1.2e-7 relative).
                assert!(
                    (got - want).abs() <= 4e-7 * want,
                    "2^{x}: {got} against {want}"
                );
                x += 0.0137;
            }
            assert_eq!(exp2(f32::NEG_INFINITY), 0.0);
            assert_eq!(exp2(f32::NAN), 0.0);
            assert_eq!(exp2(-200.0), 0.0);
            assert_eq!(exp2(0.0), 1.0);
        }
    }
}
