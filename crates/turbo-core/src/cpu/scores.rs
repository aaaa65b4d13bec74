//! KV eviction scores on the CPU: each scored query row's attention logits, turned into score
//! increments by its policy's [`ScoreFunction`](turbo_keyformer::ScoreFunction) (the reference
//! definition itself, so the CPU is what other backends are tested against).

use crate::backend::{BackendError, KvScoring, Result};
use rayon::prelude::*;
use turbo_attention::{dot, PagedKv, QuerySpan};
use turbo_keyformer::StepContext;

/// What every span of one layer's scoring shares.
pub struct ScoreLayer<'a> {
    /// Rotated queries, `[tokens, n_heads * head_dim]`.
    pub q: &'a [f32],
    pub n_heads: usize,
    pub kv: &'a PagedKv<'a>,
    pub layer: usize,
    pub scale: f32,
    /// Each row's position (the noise counter of its query).
    pub positions: &'a [u32],
}

/// One (span, KV head)'s increments: `kv_len` values, summed over the KV head's query heads.
pub struct Increment {
    span: usize,
    kv_head: usize,
    values: Vec<f32>,
}

/// The increments of every scored span and KV head, computed in parallel.
pub fn increments(
    c: &ScoreLayer,
    spans: &[QuerySpan],
    scoring: &[Option<KvScoring>],
) -> Result<Vec<Increment>> {
    let (kv_heads, hd) = (c.kv.n_kv_heads, c.kv.head_dim);
    if kv_heads == 0
        || !c.n_heads.is_multiple_of(kv_heads)
        || !c.q.len().is_multiple_of((c.n_heads * hd).max(1))
    {
        return Err(BackendError::Unsupported(format!(
            "scoring {} query heads over {kv_heads} KV heads of {hd}",
            c.n_heads
        )));
    }
    let work: Vec<(usize, usize)> = scoring
        .iter()
        .enumerate()
        .filter(|(_, s)| s.is_some_and(|s| s.function.needs_scores()))
        .flat_map(|(i, _)| (0..kv_heads).map(move |g| (i, g)))
        .collect();
    Ok(work
        .into_par_iter()
        .map(|(i, g)| {
            let span = &spans[i];
            let scoring = scoring[i].expect("filtered above");
            Increment {
                span: i,
                kv_head: g,
                values: span_increments(c, span, &scoring, g),
            }
        })
        .collect())
}

fn span_increments(c: &ScoreLayer, span: &QuerySpan, scoring: &KvScoring, g: usize) -> Vec<f32> {
    let (kv_heads, hd, bs) = (c.kv.n_kv_heads, c.kv.head_dim, c.kv.block_size);
    let group = c.n_heads / kv_heads;
    let mut acc = vec![0.0f32; span.kv_len];
    let mut logits = vec![0.0f32; span.kv_len];
    // Room to decode a quantized key into (f32 keys are read in place).
    let mut row_buf = vec![0f32; if c.kv.quant.is_some() { hd } else { 0 }];
    for r in 0..span.n_q {
        let row = span.q_start + r;
        // Causal: the chunk's row r sees the cached keys and its chunk up to itself.
        let visible = span.kv_len - span.n_q + r + 1;
        for h in g * group..(g + 1) * group {
            let q = &c.q[(row * c.n_heads + h) * hd..][..hd];
            for (j, logit) in logits[..visible].iter_mut().enumerate() {
                let slot = span.block_table[j / bs] as usize * bs + j % bs;
                let k = c.kv.key_row((slot * kv_heads + g) * hd, &mut row_buf);
                *logit = c.scale * dot(q, k);
            }
            let ctx = StepContext {
                seed: scoring.seed,
                query_pos: c.positions[row],
                iteration: scoring.iteration,
                total_iterations: scoring.total_iterations,
                layer: c.layer as u32,
                q_head: h as u32,
            };
            scoring
                .function
                .accumulate(&logits[..visible], &ctx, &mut acc[..visible]);
        }
    }
    acc
}

/// Adds the increments into the layer's scores (`[slot][kv head]`).
pub fn add(kv: &PagedKv, scores: &mut [f32], spans: &[QuerySpan], increments: &[Increment]) {
    let (kv_heads, bs) = (kv.n_kv_heads, kv.block_size);
    for inc in increments {
        let table = spans[inc.span].block_table;
        for (j, v) in inc.values.iter().enumerate() {
            let slot = table[j / bs] as usize * bs + j % bs;
            scores[slot * kv_heads + inc.kv_head] += v;
        }
    }
}
