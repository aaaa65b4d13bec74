use rayon::prelude::*;

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
/// natural-log sum-exps so callers can merge with attention over other keys.
pub fn paged_attention(
    q: &[f32],
    n_heads: usize,
    kv: &PagedKv,
    spans: &[QuerySpan],
    scale: f32,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) {
    let d = kv.head_dim;
    assert!(
        n_heads % kv.n_kv_heads == 0,
        "query heads must be a multiple of KV heads"
    );
    let group = n_heads / kv.n_kv_heads;
    let n_tokens = q.len() / (n_heads * d);
    assert_eq!(out.len(), q.len());
    // For each token row: its span and its position in the sequence.
    let mut rows = vec![(0usize, 0usize); n_tokens];
    for (s, span) in spans.iter().enumerate() {
        assert!(span.n_q <= span.kv_len && span.q_start + span.n_q <= n_tokens);
        assert!(
            span.kv_len <= span.block_table.len() * kv.block_size,
            "block table too short"
        );
        for i in 0..span.n_q {
            rows[span.q_start + i] = (s, span.kv_len - span.n_q + i);
        }
    }
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
                    pos + 1,
                    scale,
                    scores,
                    o,
                )
            };
        });
}

type HeadKernel =
    unsafe fn(&[f32], &PagedKv, &[u32], usize, usize, f32, &mut Vec<f32>, &mut [f32]) -> f32;

fn head_kernel() -> HeadKernel {
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
            n_keys: usize,
            scale: f32,
            scores: &mut Vec<f32>,
            o: &mut [f32],
        ) -> f32 {
            head_attention(q, kv, table, kv_head, n_keys, scale, scores, o)
        }
    };
}

#[cfg(target_arch = "x86_64")]
head_attention_for!(head_attention_avx512, "avx512f,avx2,fma");
#[cfg(target_arch = "x86_64")]
head_attention_for!(head_attention_avx2, "avx2,fma");
head_attention_for!(head_attention_portable);

/// Two-pass softmax attention of one query head over the first `n_keys` tokens of a paged
/// sequence: all scores, then one exponential each, then the weighted sum of values.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn head_attention(
    q: &[f32],
    kv: &PagedKv,
    table: &[u32],
    kv_head: usize,
    n_keys: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    o: &mut [f32],
) -> f32 {
    let d = kv.head_dim;
    let slot_stride = kv.n_kv_heads * d;
    let blocks = n_keys.div_ceil(kv.block_size);
    // Visits this head's key (or value) rows in token order, block by block.
    let for_each_row = |f: &mut dyn FnMut(usize, usize)| {
        for (b, &block) in table[..blocks].iter().enumerate() {
            let first = block as usize * kv.block_size * slot_stride + kv_head * d;
            let p0 = b * kv.block_size;
            for slot in 0..kv.block_size.min(n_keys - p0) {
                f(p0 + slot, first + slot * slot_stride);
            }
        }
    };
    scores.resize(n_keys, 0.0);
    let mut max = f32::NEG_INFINITY;
    for_each_row(&mut |p, at| {
        let s = dot(q, &kv.keys[at..at + d]) * scale;
        scores[p] = s;
        max = max.max(s);
    });
    if n_keys == 0 || max == f32::NEG_INFINITY {
        o.fill(0.0);
        return f32::NEG_INFINITY;
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    o.fill(0.0);
    for_each_row(&mut |p, at| {
        let w = scores[p];
        for (x, v) in o.iter_mut().zip(&kv.values[at..at + d]) {
            *x += w * v;
        }
    });
    let inv = 1.0 / sum;
    o.iter_mut().for_each(|x| *x *= inv);
    max + sum.ln()
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
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
