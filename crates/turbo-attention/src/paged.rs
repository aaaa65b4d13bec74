use crate::AttentionError;
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
/// contiguous.
#[derive(Clone, Copy)]
pub struct PagedKv<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
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
/// query row is a decode step, one with many a (chunked) prefill; both are computed alike. A row
/// that no span covers is treated as position 0 of the first span's sequence.
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
    let kernel = head_kernel();
    out.par_chunks_mut(d)
        .zip(lse.par_iter_mut())
        .enumerate()
        .for_each_init(Vec::new, |scores, (i, (o, l))| {
            let (token, head) = (i / n_heads, i % n_heads);
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
    if n_heads % kv.n_kv_heads != 0 {
        return shape(format!(
            "{n_heads} query heads are not a multiple of {} KV heads",
            kv.n_kv_heads
        ));
    }
    let row_len = n_heads * d;
    if q.len() % row_len != 0 || out.len() != q.len() {
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
    if kv.keys.len() != kv.values.len() || kv.keys.len() % block_len != 0 {
        return shape(format!(
            "keys ({}) and values ({}) must hold the same whole number of {block_len}-element blocks",
            kv.keys.len(),
            kv.values.len()
        ));
    }
    let n_blocks = kv.keys.len() / block_len;
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
    let d = kv.head_dim;
    let slot_stride = kv.n_kv_heads * d;
    let (first, end) = (keys.start, keys.end);
    // Visits this head's key (or value) rows in token order, block by block: f(index in the
    // range, offset of the row).
    let for_each_row = |f: &mut dyn FnMut(usize, usize)| {
        let mut p = first;
        while p < end {
            let block = table[p / kv.block_size] as usize;
            let slot0 = p % kv.block_size;
            let stop = end.min(p - slot0 + kv.block_size);
            let base = block * kv.block_size * slot_stride + kv_head * d;
            for slot in slot0..slot0 + (stop - p) {
                f(p - first + slot - slot0, base + slot * slot_stride);
            }
            p = stop;
        }
    };
    scores.resize(end - first, 0.0);
    let mut max = f32::NEG_INFINITY;
    for_each_row(&mut |i, at| {
        let s = dot(q, &kv.keys[at..at + d]) * scale;
        scores[i] = s;
        max = max.max(s);
    });
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    for_each_row(&mut |i, at| {
        let w = scores[i];
        for (x, v) in o.iter_mut().zip(&kv.values[at..at + d]) {
            *x += w * v;
        }
    });
    let inv = 1.0 / sum;
    o.iter_mut().for_each(|x| *x *= inv);
    max + sum.ln()
}

#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
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
