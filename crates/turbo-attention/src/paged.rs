use crate::kv_quant::MAX_QUANT_HEAD_DIM;
use crate::tiled::{tile_kernel, TileCtx, TileJob, TileKernel, TileScratch};
use crate::{AttentionError, KvDtype, QuantKv};
use rayon::prelude::*;
use std::ops::Range;

/// Keys and values of one KV head stored contiguously, `[n, head_dim]` each.
pub struct KvRows<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub head_dim: usize,
}

impl KvRows<'_> {
    pub fn key(&self, j: usize) -> &[f32] {
        &self.keys[j * self.head_dim..(j + 1) * self.head_dim]
    }
    pub fn value(&self, j: usize) -> &[f32] {
        &self.values[j * self.head_dim..(j + 1) * self.head_dim]
    }
}

/// One layer's KV storage as fixed-size blocks: `[block][slot in block][kv head][head_dim]` for keys
/// and values alike. Sequences reach their tokens through block tables, so their KV need not be
/// contiguous. The rows are f32 (`keys`, `values`), or 8-bit codes with a scale per row
/// (`quant`, and then `keys` and `values` are empty); every attention path reads a row through
/// [`PagedKv::key_row`] / [`PagedKv::value_row`] or decodes a chunk of rows into its scratch, so
/// quantized rows are decoded as they are used, never copied out whole.
#[derive(Clone, Copy)]
pub struct PagedKv<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub quant: Option<QuantKv<'a>>,
}

impl<'a> PagedKv<'a> {
    /// f32 storage in `[block][slot][kv head][head_dim]` order.
    pub fn f32(
        keys: &'a [f32],
        values: &'a [f32],
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        PagedKv {
            keys,
            values,
            block_size,
            n_kv_heads,
            head_dim,
            quant: None,
        }
    }

    /// Elements of key (and of value) storage, codes or f32.
    pub fn elements(&self) -> usize {
        match &self.quant {
            Some(q) => q.keys.len(),
            None => self.keys.len(),
        }
    }

    /// The key row starting at element `at` (a multiple of `head_dim`): the stored f32 row, or
    /// the quantized row decoded into `buf` (at least `head_dim` long).
    #[inline]
    pub fn key_row<'b>(&'b self, at: usize, buf: &'b mut [f32]) -> &'b [f32] {
        let rows = self.quant.as_ref().map(|q| (q.dtype, q.keys, q.key_scales));
        self.row(self.keys, rows, at, buf)
    }

    /// The value row starting at element `at` (see [`PagedKv::key_row`]).
    #[inline]
    pub fn value_row<'b>(&'b self, at: usize, buf: &'b mut [f32]) -> &'b [f32] {
        let rows = self
            .quant
            .as_ref()
            .map(|q| (q.dtype, q.values, q.value_scales));
        self.row(self.values, rows, at, buf)
    }

    /// The key and value rows at element offsets `at`, for kernels that read a chunk of rows at
    /// a time: the f32 storage as it is, or the quantized rows decoded into `keys` and `values`
    /// (`at.len()` rows each), with `at` rewritten to the rows' offsets there.
    pub fn chunk_rows<'b>(
        &'b self,
        at: &mut [usize],
        keys: &'b mut Vec<f32>,
        values: &'b mut Vec<f32>,
    ) -> (&'b [f32], &'b [f32]) {
        let Some(q) = &self.quant else {
            return (self.keys, self.values);
        };
        let d = self.head_dim;
        keys.resize(at.len() * d, 0.0);
        values.resize(at.len() * d, 0.0);
        for (j, a) in at.iter_mut().enumerate() {
            let (row, scale, out) = (*a..*a + d, *a / d, j * d..(j + 1) * d);
            let (k_out, v_out) = (&mut keys[out.clone()], &mut values[out]);
            crate::kv_quant::dequantize_row(
                q.dtype,
                &q.keys[row.clone()],
                q.key_scales[scale],
                k_out,
            );
            crate::kv_quant::dequantize_row(q.dtype, &q.values[row], q.value_scales[scale], v_out);
            *a = j * d;
        }
        (keys, values)
    }

    /// An f32 row of `plain`, or a row of codes with its scale decoded into `buf`.
    #[inline]
    fn row<'b>(
        &self,
        plain: &'b [f32],
        quant: Option<(KvDtype, &'b [u8], &'b [f32])>,
        at: usize,
        buf: &'b mut [f32],
    ) -> &'b [f32] {
        let d = self.head_dim;
        match quant {
            Some((dtype, codes, scales)) => {
                crate::kv_quant::dequantize_row(
                    dtype,
                    &codes[at..at + d],
                    scales[at / d],
                    &mut buf[..d],
                );
                &buf[..d]
            }
            None => &plain[at..at + d],
        }
    }
}

/// The queries of one sequence in a batch: rows `q_start..q_start + n_q` of the query tensor are
/// its newest tokens, at positions `kv_len - n_q..kv_len`, and attend causally to its first `kv_len`
/// cached tokens (history plus themselves).
#[derive(Clone, Copy, Debug)]
pub struct QuerySpan<'a> {
    pub q_start: usize,
    pub n_q: usize,
    pub kv_len: usize,
    pub block_table: &'a [u32],
}

/// Causal attention for a batch of sequences over paged KV, with grouped-query heads.
///
/// `q` and `out` are `[tokens, n_heads, head_dim]`; `lse`, when given, receives `[tokens, n_heads]`
/// natural-log sum-exps so callers can merge with attention over other keys. A span with one
/// query row is a decode step, computed per (row, head); one with many is a (chunked) prefill,
/// computed in tiles of rows that share each key they load ([`crate::tiled`]). A row that no span
/// covers is treated as position 0 of the first span's sequence.
///
/// # Panics
/// On a malformed batch, with the message of [`try_paged_attention`]'s error.
pub fn paged_attention(
    q: &[f32],
    n_heads: usize,
    kv: &PagedKv,
    spans: &[QuerySpan],
    scale: f32,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) {
    if let Err(e) = try_paged_attention(q, n_heads, kv, spans, scale, out, lse) {
        panic!("paged_attention: {e}");
    }
}

/// [`paged_attention`], returning an error instead of panicking when the shapes, spans or block
/// tables do not fit together.
pub fn try_paged_attention(
    q: &[f32],
    n_heads: usize,
    kv: &PagedKv,
    spans: &[QuerySpan],
    scale: f32,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) -> Result<(), AttentionError> {
    let n_tokens = check_batch(q, n_heads, kv, spans, out, lse.as_deref())?;
    let rows = row_positions(spans, n_tokens);
    let d = kv.head_dim;
    let group = n_heads / kv.n_kv_heads;
    let mut lse_scratch;
    let lse = match lse {
        Some(l) => l,
        None => {
            lse_scratch = vec![0f32; n_tokens * n_heads];
            &mut lse_scratch
        }
    };
    // Spans with many rows run as tiles (all of them from key 0) into `tiled`; the rest, and
    // rows no span covers, row by row.
    let tiled = Tiled::run(q, n_heads, kv, spans, scale, |_| 0);
    let kernel = head_kernel();
    out.par_chunks_mut(d)
        .zip(lse.par_iter_mut())
        .enumerate()
        .for_each_init(Vec::new, |scores, (i, (o, l))| {
            let (token, head) = (i / n_heads, i % n_heads);
            if let Some(at) = tiled.row(token, head) {
                o.copy_from_slice(&tiled.out[at * d..(at + 1) * d]);
                *l = tiled.lse[at];
                return;
            }
            let (s, pos) = rows[token];
            let qh = &q[i * d..(i + 1) * d];
            // SAFETY: the dispatcher only returns kernels whose CPU features were detected.
            *l = unsafe {
                kernel(
                    qh,
                    kv,
                    spans[s].block_table,
                    head / group,
                    0..pos + 1,
                    scale,
                    scores,
                    o,
                )
            };
        });
    Ok(())
}

/// Spans with at least this many query rows take the tiled path ([`crate::tiled`]). Decode steps
/// (one row) stay row by row: their tile would be the KV-head group's few heads padded to 16
/// SIMD lanes, and one sequence would give only as many tiles as KV heads to share among the
/// threads; at 512 keys that was slower (SmolLM2's heads: 125 µs against 70-100 µs), while two
/// rows already ran 2.6x faster tiled.
pub(crate) const TILED_MIN_ROWS: usize = 2;
/// Query rows a tile aims at (tokens x query heads per KV head): with 48, each key and value row a
/// tile loads is used by 48 queries, and a tile's buffers (48 x head_dim x 3, plus 64 x 48 scores)
/// stay in L1/L2.
const TILE_ROWS: usize = 48;
/// Fewest query rows a tile is cut down to when there are too few tiles for the threads.
const MIN_TILE_ROWS: usize = 16;

/// The results of the tiled spans of a batch, `[span][kv head][row of the span][head in the KV
/// group]`, and where each row's output lies.
pub(crate) struct Tiled {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
    /// Per query row of a tiled span: (the span's first entry, its rows, the row's index in it).
    place: Vec<Option<(usize, usize, usize)>>,
    per_kv: usize,
}

impl Tiled {
    /// Runs every span with at least [`TILED_MIN_ROWS`] rows as tiles, each row over its keys
    /// `first_key(span)..=position`.
    pub(crate) fn run(
        q: &[f32],
        n_heads: usize,
        kv: &PagedKv,
        spans: &[QuerySpan],
        scale: f32,
        first_key: impl Fn(usize) -> usize,
    ) -> Tiled {
        Self::run_with(tile_kernel(), None, q, n_heads, kv, spans, scale, first_key)
    }

    /// [`Tiled::run`] with a given kernel and, if given, tokens per tile (for tests).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_with(
        kernel: TileKernel,
        tokens_per_tile: Option<usize>,
        q: &[f32],
        n_heads: usize,
        kv: &PagedKv,
        spans: &[QuerySpan],
        scale: f32,
        first_key: impl Fn(usize) -> usize,
    ) -> Tiled {
        let d = kv.head_dim;
        let per_kv = n_heads / kv.n_kv_heads;
        let n_tokens = q.len() / (n_heads * d);
        let tiled_spans: Vec<usize> = (0..spans.len())
            .filter(|&s| spans[s].n_q >= TILED_MIN_ROWS)
            .collect();
        let mut place = vec![None; n_tokens];
        let mut entries = 0;
        for &s in &tiled_spans {
            let span = &spans[s];
            for t in 0..span.n_q {
                place[span.q_start + t] = Some((entries, span.n_q, t));
            }
            entries += kv.n_kv_heads * span.n_q * per_kv;
        }
        let mut tiled = Tiled {
            out: vec![0.0; entries * d],
            lse: vec![0.0; entries],
            place,
            per_kv,
        };
        if entries == 0 {
            return tiled;
        }
        // Tokens per tile: TILE_ROWS rows, fewer while that leaves threads idle.
        let wanted = 2 * rayon::current_num_threads();
        let min_tokens = MIN_TILE_ROWS.div_ceil(per_kv).max(1);
        let mut tokens = (TILE_ROWS / per_kv).max(1);
        let count = |tokens: usize| -> usize {
            tiled_spans
                .iter()
                .map(|&s| kv.n_kv_heads * spans[s].n_q.div_ceil(tokens))
                .sum()
        };
        while tokens > min_tokens && count(tokens) < wanted {
            tokens = (tokens / 2).max(min_tokens);
        }
        let tokens = tokens_per_tile.unwrap_or(tokens);
        let mut jobs = Vec::with_capacity(count(tokens));
        let (mut out, mut lse) = (&mut tiled.out[..], &mut tiled.lse[..]);
        for &s in &tiled_spans {
            let span = &spans[s];
            for kv_head in 0..kv.n_kv_heads {
                for t0 in (0..span.n_q).step_by(tokens) {
                    let n = tokens.min(span.n_q - t0);
                    let (o, rest) = std::mem::take(&mut out).split_at_mut(n * per_kv * d);
                    out = rest;
                    let (l, rest) = std::mem::take(&mut lse).split_at_mut(n * per_kv);
                    lse = rest;
                    let job = TileJob {
                        table: span.block_table,
                        kv_head,
                        first_row: span.q_start + t0,
                        n_tokens: n,
                        pos0: span.kv_len - span.n_q + t0,
                        first_key: first_key(s),
                    };
                    jobs.push((job, o, l));
                }
            }
        }
        let ctx = TileCtx {
            q,
            n_heads,
            kv,
            scale,
        };
        jobs.into_par_iter()
            .for_each_init(TileScratch::default, |scratch, (job, o, l)| {
                // SAFETY: the dispatcher only returns kernels whose CPU features were detected.
                unsafe { kernel(&ctx, &job, scratch, o, l) }
            });
        tiled
    }

    /// The entry of query row `token`'s head `head`, if its span was tiled.
    pub(crate) fn row(&self, token: usize, head: usize) -> Option<usize> {
        let (first, n_q, t) = self.place[token]?;
        let (kv_head, g) = (head / self.per_kv, head % self.per_kv);
        Some(first + (kv_head * n_q + t) * self.per_kv + g)
    }
}

/// For each query row: its span and its position in the sequence.
pub(crate) fn row_positions(spans: &[QuerySpan], n_tokens: usize) -> Vec<(usize, usize)> {
    let mut rows = vec![(0usize, 0usize); n_tokens];
    for (s, span) in spans.iter().enumerate() {
        for i in 0..span.n_q {
            rows[span.q_start + i] = (s, span.kv_len - span.n_q + i);
        }
    }
    rows
}

/// Checks that a batch's buffers, heads, spans and block tables fit together, so the kernels can
/// index without further checks; returns the number of query rows.
pub(crate) fn check_batch(
    q: &[f32],
    n_heads: usize,
    kv: &PagedKv,
    spans: &[QuerySpan],
    out: &[f32],
    lse: Option<&[f32]>,
) -> Result<usize, AttentionError> {
    let shape = |msg: String| Err(AttentionError::Shape(msg));
    let d = kv.head_dim;
    if d == 0 || kv.block_size == 0 || kv.n_kv_heads == 0 || n_heads == 0 {
        return shape(format!(
            "head_dim {d}, block size {}, {} KV heads and {n_heads} query heads must all be positive",
            kv.block_size, kv.n_kv_heads
        ));
    }
    if !n_heads.is_multiple_of(kv.n_kv_heads) {
        return shape(format!(
            "{n_heads} query heads are not a multiple of {} KV heads",
            kv.n_kv_heads
        ));
    }
    let row_len = n_heads * d;
    if !q.len().is_multiple_of(row_len) || out.len() != q.len() {
        return shape(format!(
            "q has {} and out {} elements; both must be the same multiple of n_heads * head_dim = {row_len}",
            q.len(),
            out.len()
        ));
    }
    let n_tokens = q.len() / row_len;
    if let Some(l) = lse {
        if l.len() != n_tokens * n_heads {
            return shape(format!(
                "lse has {} elements for {n_tokens} rows of {n_heads} heads",
                l.len()
            ));
        }
    }
    let block_len = kv.block_size * kv.n_kv_heads * d;
    let (keys, values) = match &kv.quant {
        Some(_) if d > MAX_QUANT_HEAD_DIM => {
            return shape(format!(
                "a quantized KV cache serves head dimensions up to {MAX_QUANT_HEAD_DIM}, not {d}"
            ))
        }
        Some(q) => {
            if q.key_scales.len() * d != q.keys.len() || q.value_scales.len() * d != q.values.len()
            {
                return shape(format!(
                    "{} key and {} value codes need one scale per {d}; there are {} and {}",
                    q.keys.len(),
                    q.values.len(),
                    q.key_scales.len(),
                    q.value_scales.len()
                ));
            }
            (q.keys.len(), q.values.len())
        }
        None => (kv.keys.len(), kv.values.len()),
    };
    if keys != values || !keys.is_multiple_of(block_len) {
        return shape(format!(
            "keys ({keys}) and values ({values}) must hold the same whole number of {block_len}-element blocks"
        ));
    }
    let n_blocks = keys / block_len;
    if spans.is_empty() && n_tokens > 0 {
        return shape(format!("{n_tokens} query rows but no spans"));
    }
    let mut owner = vec![usize::MAX; n_tokens];
    for (s, span) in spans.iter().enumerate() {
        let fail = |reason: String| Err(AttentionError::Span { span: s, reason });
        if span.n_q > span.kv_len {
            return fail(format!(
                "{} query rows but only {} keys (the rows' own keys are among them)",
                span.n_q, span.kv_len
            ));
        }
        if span.q_start + span.n_q > n_tokens {
            return fail(format!(
                "rows {}..{} past the batch's {n_tokens} rows",
                span.q_start,
                span.q_start + span.n_q
            ));
        }
        if let Some(r) = (span.q_start..span.q_start + span.n_q).find(|&r| owner[r] != usize::MAX) {
            return fail(format!("row {r} is also a row of span {}", owner[r]));
        }
        owner[span.q_start..span.q_start + span.n_q].fill(s);
        let needed = span.kv_len.div_ceil(kv.block_size);
        if needed > span.block_table.len() {
            return fail(format!(
                "{} keys need {needed} blocks of {}, the table has {}",
                span.kv_len,
                kv.block_size,
                span.block_table.len()
            ));
        }
        if let Some(&b) = span.block_table[..needed]
            .iter()
            .find(|&&b| b as usize >= n_blocks)
        {
            return fail(format!(
                "block {b} is past the {n_blocks} blocks of the KV storage"
            ));
        }
    }
    Ok(n_tokens)
}

/// One query head's attention over a range of a paged sequence's keys (see [`head_attention`]).
pub(crate) type HeadKernel =
    unsafe fn(&[f32], &PagedKv, &[u32], usize, Range<usize>, f32, &mut Vec<f32>, &mut [f32]) -> f32;

/// The fastest [`HeadKernel`] this CPU supports.
pub(crate) fn head_kernel() -> HeadKernel {
    static KERNEL: std::sync::OnceLock<HeadKernel> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma") {
                return head_attention_avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return head_attention_avx2;
            }
        }
        head_attention_portable
    })
}

macro_rules! head_attention_for {
    ($name:ident $(, $features:literal)?) => {
        $(#[target_feature(enable = $features)])?
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name(
            q: &[f32],
            kv: &PagedKv,
            table: &[u32],
            kv_head: usize,
            keys: Range<usize>,
            scale: f32,
            scores: &mut Vec<f32>,
            o: &mut [f32],
        ) -> f32 {
            head_attention(q, kv, table, kv_head, keys, scale, scores, o)
        }
    };
}

#[cfg(target_arch = "x86_64")]
head_attention_for!(head_attention_avx512, "avx512f,avx2,fma");
#[cfg(target_arch = "x86_64")]
head_attention_for!(head_attention_avx2, "avx2,fma");
head_attention_for!(head_attention_portable);

/// Two-pass softmax attention of one query head over the keys `keys` of a paged sequence (all
/// scores, then one exponential each, then the weighted sum of values); returns the lse, `-inf`
/// with `o = 0` for an empty range.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn head_attention(
    q: &[f32],
    kv: &PagedKv,
    table: &[u32],
    kv_head: usize,
    keys: Range<usize>,
    scale: f32,
    scores: &mut Vec<f32>,
    o: &mut [f32],
) -> f32 {
    o.fill(0.0);
    if keys.is_empty() {
        return f32::NEG_INFINITY;
    }
    scores.resize(keys.len(), 0.0);
    // Heads of 64 and 128 values: four keys at a time, over f32 rows or decoded 8-bit ones.
    macro_rules! four_keys {
        ($d:literal) => {
            match &kv.quant {
                None => plain_head_attention::<$d, _>(
                    q,
                    kv,
                    table,
                    kv_head,
                    keys,
                    scale,
                    scores,
                    o,
                    (F32Rows(kv.keys), F32Rows(kv.values)),
                ),
                Some(c) => plain_head_attention::<$d, _>(
                    q,
                    kv,
                    table,
                    kv_head,
                    keys,
                    scale,
                    scores,
                    o,
                    (
                        CodeRows {
                            dtype: c.dtype,
                            codes: c.keys,
                            scales: c.key_scales,
                        },
                        CodeRows {
                            dtype: c.dtype,
                            codes: c.values,
                            scales: c.value_scales,
                        },
                    ),
                ),
            }
        };
    }
    match kv.head_dim {
        64 => return four_keys!(64),
        128 => return four_keys!(128),
        _ => {}
    }
    any_head_attention(q, kv, table, kv_head, keys, scale, scores, o)
}

/// [`head_attention`] for any head size and cache type, a row at a time.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn any_head_attention(
    q: &[f32],
    kv: &PagedKv,
    table: &[u32],
    kv_head: usize,
    keys: Range<usize>,
    scale: f32,
    scores: &mut [f32],
    o: &mut [f32],
) -> f32 {
    let (first, end) = (keys.start, keys.end);
    let mut max = f32::NEG_INFINITY;
    // Room to decode a quantized row into; f32 rows are read in place and need none.
    let mut decoded;
    let row: &mut [f32] = match kv.quant {
        Some(_) => {
            decoded = [0f32; MAX_QUANT_HEAD_DIM];
            &mut decoded
        }
        None => &mut [],
    };
    let (key_storage, value_storage) = match &kv.quant {
        Some(q) => (Storage::codes(q.keys), Storage::codes(q.values)),
        None => (Storage::f32(kv.keys), Storage::f32(kv.values)),
    };
    for_each_row(
        kv,
        table,
        kv_head,
        first..end,
        key_storage,
        #[inline(always)]
        |i, at| {
            let s = dot(q, kv.key_row(at, row)) * scale;
            scores[i] = s;
            max = max.max(s);
        },
    );
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    let sum = exponentials(scores, max);
    for_each_row(
        kv,
        table,
        kv_head,
        first..end,
        value_storage,
        #[inline(always)]
        |i, at| {
            let w = scores[i];
            for (x, v) in o.iter_mut().zip(kv.value_row(at, row)) {
                *x += w * v;
            }
        },
    );
    let inv = 1.0 / sum;
    o.iter_mut().for_each(|x| *x *= inv);
    max + sum.ln()
}

/// Where [`plain_head_attention`] reads its rows of `D` values: an f32 cache in place, or an 8-bit
/// one decoded as [`crate::kv_quant::dequantize_row`] decodes it (the same values).
trait HeadRows<const D: usize> {
    /// Room to decode a row into (nothing for rows read in place).
    type Buf;
    fn buf() -> Self::Buf;
    /// The row at element offset `at`, decoded into `buf` where it must be.
    fn row<'b>(&'b self, at: usize, buf: &'b mut Self::Buf) -> &'b [f32; D];
    /// The storage, for prefetching.
    fn storage(&self) -> Storage;
}

struct F32Rows<'a>(&'a [f32]);

impl<const D: usize> HeadRows<D> for F32Rows<'_> {
    type Buf = ();
    fn buf() {}

    #[inline(always)]
    fn row<'b>(&'b self, at: usize, _: &'b mut ()) -> &'b [f32; D] {
        self.0[at..at + D]
            .try_into()
            .expect("a row inside the cache")
    }

    fn storage(&self) -> Storage {
        Storage::f32(self.0)
    }
}

struct CodeRows<'a> {
    dtype: KvDtype,
    codes: &'a [u8],
    scales: &'a [f32],
}

impl<const D: usize> HeadRows<D> for CodeRows<'_> {
    type Buf = [f32; D];
    fn buf() -> [f32; D] {
        [0.0; D]
    }

    #[inline(always)]
    fn row<'b>(&'b self, at: usize, buf: &'b mut [f32; D]) -> &'b [f32; D] {
        let (codes, scale) = (&self.codes[at..at + D], self.scales[at / D]);
        match self.dtype {
            // dequantize_row's operations, inlined so that they vectorize here.
            KvDtype::Int8 => {
                for (o, &c) in buf.iter_mut().zip(codes) {
                    *o = (c as i8) as f32 * scale;
                }
            }
            _ => crate::kv_quant::dequantize_row(self.dtype, codes, scale, buf),
        }
        buf
    }

    fn storage(&self) -> Storage {
        Storage::codes(self.codes)
    }
}

/// [`head_attention`] over rows of `D` values, the same operations in the same order (so the
/// same bits), arranged for the CPU: four keys' dot products at a time (four independent chains
/// of adds, the query's chunks loaded once for the four), and the output row kept in registers
/// across the values instead of read and written back for each.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn plain_head_attention<const D: usize, R: HeadRows<D>>(
    q: &[f32],
    kv: &PagedKv,
    table: &[u32],
    kv_head: usize,
    keys: Range<usize>,
    scale: f32,
    scores: &mut [f32],
    o: &mut [f32],
    (key_rows, value_rows): (R, R),
) -> f32 {
    let q: &[f32; D] = q.try_into().expect("a query row of head_dim values");
    let mut max = f32::NEG_INFINITY;
    let (mut pending, mut held) = ([(0usize, 0usize); 4], 0usize);
    let mut bufs = [R::buf(), R::buf(), R::buf(), R::buf()];
    for_each_row(
        kv,
        table,
        kv_head,
        keys.clone(),
        key_rows.storage(),
        #[inline(always)]
        |i, at| {
            pending[held] = (i, at);
            held += 1;
            if held == 4 {
                let [b0, b1, b2, b3] = &mut bufs;
                let ks = [
                    key_rows.row(pending[0].1, b0),
                    key_rows.row(pending[1].1, b1),
                    key_rows.row(pending[2].1, b2),
                    key_rows.row(pending[3].1, b3),
                ];
                let dots = dot4(q, ks);
                for (j, &(i, _)) in pending.iter().enumerate() {
                    let s = dots[j] * scale;
                    scores[i] = s;
                    max = max.max(s);
                }
                held = 0;
            }
        },
    );
    for &(i, at) in &pending[..held] {
        let s = dot(q, key_rows.row(at, &mut bufs[0])) * scale;
        scores[i] = s;
        max = max.max(s);
    }
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    let sum = exponentials(scores, max);
    let mut acc = [0f32; D];
    for_each_row(
        kv,
        table,
        kv_head,
        keys,
        value_rows.storage(),
        #[inline(always)]
        |i, at| {
            let w = scores[i];
            for (x, v) in acc.iter_mut().zip(value_rows.row(at, &mut bufs[0])) {
                *x += w * v;
            }
        },
    );
    let inv = 1.0 / sum;
    for (o, x) in o.iter_mut().zip(acc) {
        *o = x * inv;
    }
    max + sum.ln()
}

/// Replaces each score by `exp(score - max)` and returns their sum, in order.
#[inline(always)]
fn exponentials(scores: &mut [f32], max: f32) -> f32 {
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    sum
}

/// [`dot`] of `q` with four rows, each summed exactly as `dot` sums it.
#[inline(always)]
fn dot4<const D: usize>(q: &[f32; D], k: [&[f32; D]; 4]) -> [f32; 4] {
    let mut acc = [[0f32; 8]; 4];
    for c in 0..D / 8 {
        for (a, k) in acc.iter_mut().zip(&k) {
            for l in 0..8 {
                a[l] += q[8 * c + l] * k[8 * c + l];
            }
        }
    }
    // `dot` adds its tail (an empty sum for whole chunks) after the lanes.
    let tail: f32 = [0f32; 0].iter().sum();
    acc.map(|a| a.iter().sum::<f32>() + tail)
}

/// Visits `kv_head`'s key (or value) rows `keys` of a paged sequence in token order, block by
/// block: `f(index in the range, element offset of the row)`. Generic and inlined, so that the
/// per-row work is compiled into its caller with the caller's target features (a closure called
/// through a pointer is compiled for the baseline CPU: SSE, no FMA).
///
/// `rows`, the storage the offsets index, is prefetched [`ROWS_AHEAD`] rows ahead: a head's rows
/// lie `n_kv_heads · head_dim` elements apart, block by block, and a long context's cache does
/// not stay in the caches between decode steps. The row ahead is found from the current block and
/// the next one, looked up once per block (no division per row).
#[inline(always)]
fn for_each_row(
    kv: &PagedKv,
    table: &[u32],
    kv_head: usize,
    keys: Range<usize>,
    rows: Storage,
    mut f: impl FnMut(usize, usize),
) {
    let (d, bs) = (kv.head_dim, kv.block_size);
    let slot_stride = kv.n_kv_heads * d;
    let block_base = |b: usize| table[b] as usize * bs * slot_stride + kv_head * d;
    let (first, end) = (keys.start, keys.end);
    let mut p = first;
    while p < end {
        let b = p / bs;
        let slot0 = p % bs;
        let stop = end.min(p - slot0 + bs);
        let base = block_base(b);
        // Where the rows after this block start (the next block, if the range reaches it).
        let next = (stop < end).then(|| block_base(b + 1));
        for slot in slot0..slot0 + (stop - p) {
            let key = p + slot - slot0;
            let ahead = slot + ROWS_AHEAD;
            if key + ROWS_AHEAD < end {
                if ahead < bs {
                    rows.prefetch(base + ahead * slot_stride, d);
                } else if let Some(next) = next.filter(|_| ahead - bs < bs) {
                    rows.prefetch(next + (ahead - bs) * slot_stride, d);
                }
            }
            f(key - first, base + slot * slot_stride);
        }
        p = stop;
    }
}

/// How many rows ahead [`for_each_row`] prefetches.
const ROWS_AHEAD: usize = 8;

/// A cache's key or value storage as bytes, for prefetching its rows: f32 values, or 8-bit codes.
#[derive(Clone, Copy)]
struct Storage {
    bytes: *const u8,
    len: usize,
    element: usize,
}

impl Storage {
    fn f32(rows: &[f32]) -> Self {
        Storage {
            bytes: rows.as_ptr() as *const u8,
            len: std::mem::size_of_val(rows),
            element: 4,
        }
    }

    fn codes(rows: &[u8]) -> Self {
        Storage {
            bytes: rows.as_ptr(),
            len: rows.len(),
            element: 1,
        }
    }

    /// Asks for the `d` elements at element offset `at` to be brought into the caches.
    #[inline(always)]
    fn prefetch(self, at: usize, d: usize) {
        #[cfg(target_arch = "x86_64")]
        if (at + d) * self.element <= self.len {
            let row = self.bytes.wrapping_add(at * self.element);
            for line in 0..(d * self.element).div_ceil(64) {
                // SAFETY: a prefetch of an address inside the storage; it reads nothing.
                unsafe {
                    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                    _mm_prefetch::<_MM_HINT_T0>(row.add(64 * line) as *const i8);
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (at, d, self.len);
    }
}

/// A dot product in eight lanes, which the compiler vectorises (the order of the sums is fixed,
/// so results are reproducible).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Online-softmax attention of one query over `(key, value)` rows; writes `o` and returns lse.
pub(crate) fn attend_rows<'a>(
    q: &[f32],
    rows: impl Iterator<Item = (&'a [f32], &'a [f32])>,
    scale: f32,
    o: &mut [f32],
) -> f32 {
    o.fill(0.0);
    let mut max = f32::NEG_INFINITY;
    let mut sum = 0f32;
    for (k, v) in rows {
        let s = dot(q, k) * scale;
        if s > max {
            let correction = (max - s).exp();
            sum *= correction;
            o.iter_mut().for_each(|x| *x *= correction);
            max = s;
        }
        let p = (s - max).exp();
        sum += p;
        for (x, vv) in o.iter_mut().zip(v) {
            *x += p * vv;
        }
    }
    if sum == 0.0 {
        return f32::NEG_INFINITY;
    }
    let inv = 1.0 / sum;
    o.iter_mut().for_each(|x| *x *= inv);
    max + sum.ln()
}

#[cfg(test)]
mod tests {
    //! Every tile kernel this CPU has (not only the one dispatched to), tile sizes, and key ranges
    //! that start past 0, against a naive f64 softmax; the public path is tested in
    //! `tests/tiled_prefill.rs`.

    use super::*;
    use crate::tiled::tile_kernels;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// The kernels for 64- and 128-value heads (four keys' dots at a time, the output in
    /// registers) give what the row-at-a-time kernel gives, bit for bit, over f32, INT8 and FP8
    /// caches: on shuffled blocks, key ranges that start and end inside blocks, fewer keys than
    /// four, and infinite scores.
    #[test]
    fn plain_head_kernels_equal_the_row_kernel_bit_for_bit() {
        for d in [64usize, 128] {
            for dtype in [KvDtype::Full, KvDtype::Int8, KvDtype::Fp8] {
                let mut case = Case::new(23 + d as u64, 16, 3, d, &[(143, 1)]);
                if dtype != KvDtype::Full {
                    case = case.quantized(dtype);
                }
                let kv = case.kv();
                let table = &case.tables[0];
                let q = &case.q[..d];
                for (range, scale) in [
                    (0..137, 0.125),
                    (5..8, 0.3),
                    (17..18, 1.0),
                    (3..144, f32::INFINITY),
                ] {
                    for kv_head in 0..case.n_kv_heads {
                        let (mut s1, mut s2) = (Vec::new(), vec![0f32; range.len()]);
                        let (mut o1, mut o2) = (vec![f32::NAN; d], vec![0f32; d]);
                        let l1 = head_attention(
                            q,
                            &kv,
                            table,
                            kv_head,
                            range.clone(),
                            scale,
                            &mut s1,
                            &mut o1,
                        );
                        let l2 = any_head_attention(
                            q,
                            &kv,
                            table,
                            kv_head,
                            range.clone(),
                            scale,
                            &mut s2,
                            &mut o2,
                        );
                        let what = format!("d {d} {dtype:?} {range:?} head {kv_head}");
                        assert_eq!(l1.to_bits(), l2.to_bits(), "{what}: lse");
                        let bits = |o: &[f32]| o.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&o1), bits(&o2), "{what}: out");
                    }
                }
            }
        }
    }

    /// dtype, key and value codes, key and value scales.
    type QuantStore = (KvDtype, Vec<u8>, Vec<u8>, Vec<f32>, Vec<f32>);

    struct Case {
        block_size: usize,
        n_kv_heads: usize,
        n_heads: usize,
        d: usize,
        keys: Vec<f32>,
        values: Vec<f32>,
        q: Vec<f32>,
        tables: Vec<Vec<u32>>,
        /// Per span: (q_start, n_q, kv_len).
        spans: Vec<(usize, usize, usize)>,
        /// Quantized storage: dtype, key and value codes, key and value scales (`keys` and
        /// `values` then hold the decoded rows, which the reference reads).
        quant: Option<QuantStore>,
    }

    impl Case {
        fn new(
            seed: u64,
            block_size: usize,
            per_kv: usize,
            d: usize,
            shapes: &[(usize, usize)],
        ) -> Case {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let n_kv_heads = 2;
            let blocks: usize = shapes
                .iter()
                .map(|&(h, n)| (h + n).div_ceil(block_size))
                .sum();
            let mut pool: Vec<u32> = (0..blocks as u32).collect();
            pool.shuffle(&mut rng);
            let (mut tables, mut spans, mut row) = (Vec::new(), Vec::new(), 0);
            for &(history, new) in shapes {
                let kv_len = history + new;
                tables.push(pool.drain(..kv_len.div_ceil(block_size)).collect());
                spans.push((row, new, kv_len));
                row += new;
            }
            let n_heads = n_kv_heads * per_kv;
            let len = blocks * block_size * n_kv_heads * d;
            let mut r =
                |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect() };
            Case {
                block_size,
                n_kv_heads,
                n_heads,
                d,
                keys: r(len),
                values: r(len),
                q: r(row * n_heads * d),
                tables,
                spans,
                quant: None,
            }
        }

        /// The same case with its keys and values stored as `dtype` codes.
        fn quantized(mut self, dtype: KvDtype) -> Case {
            let d = self.d;
            let encode = |rows: &mut Vec<f32>| {
                let mut codes = vec![0u8; rows.len()];
                let mut scales = Vec::new();
                for (x, c) in rows.chunks_mut(d).zip(codes.chunks_mut(d)) {
                    let scale = crate::kv_quant::quantize_row(dtype, x, c);
                    crate::kv_quant::dequantize_row(dtype, c, scale, x);
                    scales.push(scale);
                }
                (codes, scales)
            };
            let (kc, ks) = encode(&mut self.keys);
            let (vc, vs) = encode(&mut self.values);
            self.quant = Some((dtype, kc, vc, ks, vs));
            self
        }

        fn kv(&self) -> PagedKv<'_> {
            let mut kv = PagedKv::f32(
                &self.keys,
                &self.values,
                self.block_size,
                self.n_kv_heads,
                self.d,
            );
            if let Some((dtype, kc, vc, ks, vs)) = &self.quant {
                kv.keys = &[];
                kv.values = &[];
                kv.quant = Some(QuantKv {
                    dtype: *dtype,
                    keys: kc,
                    values: vc,
                    key_scales: ks,
                    value_scales: vs,
                });
            }
            kv
        }

        fn spans(&self) -> Vec<QuerySpan<'_>> {
            self.spans
                .iter()
                .zip(&self.tables)
                .map(|(&(q_start, n_q, kv_len), table)| QuerySpan {
                    q_start,
                    n_q,
                    kv_len,
                    block_table: table,
                })
                .collect()
        }

        /// f64 attention of row `token`, `head` over keys `keys` of span `s`: (o, lse).
        fn reference(
            &self,
            s: usize,
            token: usize,
            head: usize,
            keys: Range<usize>,
        ) -> (Vec<f64>, f64) {
            let d = self.d;
            let scale = 1.0 / (d as f64).sqrt();
            let kv_head = head / (self.n_heads / self.n_kv_heads);
            let table = &self.tables[s];
            let at = |p: usize| {
                ((table[p / self.block_size] as usize * self.block_size + p % self.block_size)
                    * self.n_kv_heads
                    + kv_head)
                    * d
            };
            let q = &self.q[(token * self.n_heads + head) * d..][..d];
            let scores: Vec<(usize, f64)> = keys
                .map(|p| {
                    let k = &self.keys[at(p)..][..d];
                    (
                        p,
                        q.iter()
                            .zip(k)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            * scale,
                    )
                })
                .collect();
            let mut o = vec![0f64; d];
            if scores.is_empty() {
                return (o, f64::NEG_INFINITY);
            }
            let max = scores.iter().fold(f64::NEG_INFINITY, |m, s| m.max(s.1));
            let sum: f64 = scores.iter().map(|s| (s.1 - max).exp()).sum();
            for &(p, s) in &scores {
                for (x, &v) in o.iter_mut().zip(&self.values[at(p)..][..d]) {
                    *x += (s - max).exp() / sum * v as f64;
                }
            }
            (o, max + sum.ln())
        }

        /// Runs the tiled path with `kernel` and checks every row of every span against the
        /// reference, each row over keys `first_key(span)..=position`; returns (out, lse).
        fn check(
            &self,
            kernel: TileKernel,
            tokens: Option<usize>,
            first_key: impl Fn(usize) -> usize + Copy,
        ) -> (Vec<f32>, Vec<f32>) {
            let (kv, spans) = (self.kv(), self.spans());
            let scale = 1.0 / (self.d as f32).sqrt();
            let tiled = Tiled::run_with(
                kernel,
                tokens,
                &self.q,
                self.n_heads,
                &kv,
                &spans,
                scale,
                first_key,
            );
            let d = self.d;
            for (s, &(q_start, n_q, kv_len)) in self.spans.iter().enumerate() {
                if n_q < TILED_MIN_ROWS {
                    continue;
                }
                for t in 0..n_q {
                    let (token, pos) = (q_start + t, kv_len - n_q + t);
                    for head in 0..self.n_heads {
                        let at = tiled.row(token, head).unwrap();
                        let (o_ref, lse_ref) =
                            self.reference(s, token, head, first_key(s)..pos + 1);
                        let o = &tiled.out[at * d..(at + 1) * d];
                        let lse = tiled.lse[at];
                        if lse_ref == f64::NEG_INFINITY {
                            assert_eq!(lse, f32::NEG_INFINITY, "span {s} row {t} head {head}");
                            assert!(o.iter().all(|&x| x == 0.0), "span {s} row {t} head {head}");
                            continue;
                        }
                        let big = 1.0 + o_ref.iter().fold(0f64, |m, x| m.max(x.abs()));
                        for (&x, &y) in o.iter().zip(&o_ref) {
                            // As in tests/tiled_prefill.rs: f32 accumulation in another order.
                            assert!(
                                (x as f64 - y).abs() < 2e-5 * big,
                                "span {s} row {t} head {head}: {x} against {y}"
                            );
                        }
                        assert!(
                            (lse as f64 - lse_ref).abs() < 2e-5 * (1.0 + lse_ref.abs()),
                            "span {s} row {t} head {head}: lse {lse} against {lse_ref}"
                        );
                    }
                }
            }
            (tiled.out, tiled.lse)
        }
    }

    const SHAPES: &[(usize, usize)] = &[(0, 50), (70, 19), (3, 2), (10, 1), (130, 64)];

    #[test]
    fn every_kernel_matches_the_reference() {
        let mut seed = 0;
        for (name, kernel) in tile_kernels() {
            for per_kv in [1usize, 3, 4] {
                for d in [16usize, 64, 128, 9] {
                    for block_size in [1usize, 4, 16] {
                        seed += 1;
                        eprintln!("{name}: per_kv {per_kv}, d {d}, block {block_size}");
                        Case::new(seed, block_size, per_kv, d, SHAPES).check(kernel, None, |_| 0);
                    }
                }
            }
        }
    }

    /// Quantized storage: every kernel decodes each chunk's rows as the reference (which reads
    /// the decoded rows) sees them, decode rows included.
    #[test]
    fn every_kernel_matches_the_reference_on_quantized_kv() {
        let mut seed = 100;
        for (name, kernel) in tile_kernels() {
            for dtype in [KvDtype::Int8, KvDtype::Fp8] {
                for (per_kv, d, block_size) in [(4usize, 64usize, 16usize), (3, 9, 4), (1, 128, 1)]
                {
                    seed += 1;
                    eprintln!("{name} {dtype}: per_kv {per_kv}, d {d}, block {block_size}");
                    Case::new(seed, block_size, per_kv, d, SHAPES)
                        .quantized(dtype)
                        .check(kernel, None, |_| 0);
                }
            }
        }
    }

    /// The public path (tiled spans, per-head decode rows) over quantized storage gives the bits
    /// it gives over the decoded rows stored as f32.
    #[test]
    fn quantized_storage_equals_its_decoded_rows() {
        for dtype in [KvDtype::Int8, KvDtype::Fp8] {
            let case = Case::new(5, 4, 4, 64, SHAPES).quantized(dtype);
            let spans = case.spans();
            let scale = 0.125;
            let run = |kv: &PagedKv| {
                let mut out = vec![0f32; case.q.len()];
                let mut lse = vec![0f32; case.q.len() / case.d];
                paged_attention(
                    &case.q,
                    case.n_heads,
                    kv,
                    &spans,
                    scale,
                    &mut out,
                    Some(&mut lse),
                );
                (out, lse)
            };
            let quant = run(&case.kv());
            let plain = run(&PagedKv::f32(
                &case.keys,
                &case.values,
                4,
                case.n_kv_heads,
                case.d,
            ));
            assert!(
                quant
                    .0
                    .iter()
                    .zip(&plain.0)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dtype}"
            );
            assert!(
                quant
                    .1
                    .iter()
                    .zip(&plain.1)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dtype}"
            );
        }
    }

    /// A row's arithmetic does not depend on the tile it is in: any tile size gives the same bits.
    #[test]
    fn results_do_not_depend_on_the_tile_size() {
        for (name, kernel) in tile_kernels() {
            let case = Case::new(11, 16, 3, 64, SHAPES);
            let first = case.check(kernel, None, |_| 0);
            for tokens in [1usize, 2, 5, 16, 33, 200] {
                let other = case.check(kernel, Some(tokens), |_| 0);
                assert!(
                    first
                        .0
                        .iter()
                        .zip(&other.0)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                        && first
                            .1
                            .iter()
                            .zip(&other.1)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{name}: {tokens} tokens per tile"
                );
            }
        }
    }

    /// Key ranges that start past 0 (as over a sequence's own keys after a shared prefix),
    /// including rows that see no key at all: o = 0 and lse = -inf.
    #[test]
    fn key_ranges_past_the_start_and_empty_ones() {
        for (_, kernel) in tile_kernels() {
            for per_kv in [1usize, 3] {
                let case = Case::new(21, 4, per_kv, 16, SHAPES);
                // Span 0's rows are at positions 0..50: from key 20 on, its first 20 rows see
                // nothing. Others start inside their history, in the middle of a block.
                let first = |s: usize| [20, 65, 1, 0, 129][s];
                case.check(kernel, Some(7), first);
                case.check(kernel, None, |s| case.spans[s].2);
            }
        }
    }
}
