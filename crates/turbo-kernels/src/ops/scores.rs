//! KV eviction scores on the GPU (`kernels/scores.cu`): a step's plan of scored rows and key
//! tiles, the two kernels that add one layer's increments into the cache's scores, and the gather
//! that reads a sequence's scores back for the host's choice of kept keys.

use super::attention::{logit_row_stride, LogitScoring};
use super::{check, reuse_or_alloc};
use crate::device::{CudaDevice, SideGuard};
use crate::error::{CudaError, Result};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, LaunchConfig, PushKernelArg};
use half::bf16;
use std::ops::Range;
use turbo_attention::{KvDtype, QuerySpan};
use turbo_core::cpu::KvCacheSpec;
use turbo_core::KvScoring;
use turbo_keyformer::ScoreFunction;

/// u32 words per span in the plan (see `kernels/scores.cu`).
const SPAN_WORDS: usize = 11;
/// Keys per CTA of the increment kernel (one thread each).
const TILE: usize = 64;
/// Threads of the kernel merging a row's tile partials (one per query head).
const MERGE_THREADS: u32 = 128;
/// Threads of the tensor-core tile kernels (`SCORE_MMA_WARPS` warps).
const MMA_THREADS: u32 = 128;
/// The largest head dimension the kernels hold in shared memory.
pub const MAX_HEAD_DIM: usize = 256;

/// Whether the scoring kernels handle keys of `head_dim` (16-byte rows of whole bf16 octets).
pub fn supports_head_dim(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(8) && head_dim <= MAX_HEAD_DIM
}

/// Whether keys of `head_dim` in a cache of `dtype` can be scored: quantized caches have
/// tensor-core tile kernels only (head_dim 64 and 128).
pub fn supports(head_dim: usize, dtype: KvDtype) -> bool {
    match dtype {
        KvDtype::Full => supports_head_dim(head_dim),
        KvDtype::Int8 | KvDtype::Fp8 => matches!(head_dim, 64 | 128),
    }
}

/// The cache's geometry, as the kernels index it.
#[derive(Clone, Copy, Debug)]
pub struct ScoreGeometry {
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub dtype: KvDtype,
}

impl ScoreGeometry {
    pub fn of(spec: &KvCacheSpec) -> Self {
        ScoreGeometry {
            n_kv_heads: spec.n_kv_heads,
            head_dim: spec.head_dim,
            block_size: spec.block_size,
            dtype: spec.dtype,
        }
    }

    /// Bytes of one block of keys.
    fn block_bytes(&self) -> usize {
        self.block_size * self.n_kv_heads * self.dtype.row_bytes(self.head_dim, 2)
    }
}

/// The tile kernels (partial, add) for keys of `head_dim`, and their threads per CTA: on tensor
/// cores where there is a variant for it, else on CUDA cores.
fn tile_kernels(head_dim: usize, dtype: KvDtype) -> (&'static str, &'static str, u32) {
    match (dtype, head_dim) {
        (KvDtype::Int8, 64) => (
            "kv_score_partial_mma_q8_d64",
            "kv_score_add_mma_q8_d64",
            MMA_THREADS,
        ),
        (KvDtype::Int8, 128) => (
            "kv_score_partial_mma_q8_d128",
            "kv_score_add_mma_q8_d128",
            MMA_THREADS,
        ),
        (KvDtype::Fp8, 64) => (
            "kv_score_partial_mma_f8_d64",
            "kv_score_add_mma_f8_d64",
            MMA_THREADS,
        ),
        (KvDtype::Fp8, 128) => (
            "kv_score_partial_mma_f8_d128",
            "kv_score_add_mma_f8_d128",
            MMA_THREADS,
        ),
        (_, 64) => (
            "kv_score_partial_mma_d64",
            "kv_score_add_mma_d64",
            MMA_THREADS,
        ),
        (_, 128) => (
            "kv_score_partial_mma_d128",
            "kv_score_add_mma_d128",
            MMA_THREADS,
        ),
        _ => ("kv_score_partial_bf16", "kv_score_add_bf16", TILE as u32),
    }
}

/// One step's scoring work: its scored spans, their rows and key tiles and their block tables,
/// uploaded once and run for every layer. Spans whose logits the attention plan writes
/// ([`crate::ops::attention::AttentionPlan::logit_base`]: decode rows) are scored from those
/// logits; the others (prompt chunks) from the queries and the cached keys. A plan may have no
/// work (a step that scores nothing): it keeps its buffers for the next step that does.
pub struct ScorePlan {
    /// First, so that it is dropped first: the key sums may run on the side stream.
    _side: SideGuard,
    upload: CudaSlice<u32>,
    spans: Range<usize>,
    rows: Range<usize>,
    tiles: Range<usize>,
    tables: Range<usize>,
    n_rows: usize,
    n_tiles: usize,
    /// Spans scored from logits (padded to `n_logit_spans`), their rows (`n_logit_rows`, padded
    /// with `fixed`), and how many parts each span's keys are cut into for the increments.
    logit_spans: Range<usize>,
    n_logit_spans: usize,
    n_logit_rows: usize,
    logit_parts: usize,
    /// Logits the spans scored from logits read (the end of the last span's).
    logit_len: usize,
    /// Threads a CTA of their key sums ([`logit_threads`]).
    logit_threads: u32,
    n_heads: usize,
    tokens: usize,
    /// `[scored rows not from logits][n_heads]` normalisers, rewritten by every layer (those of
    /// rows from logits come from the attention plan).
    lse: CudaSlice<f32>,
    /// Per span `[row][tile][n_heads]` (max, sum) pairs, rewritten by every layer.
    partials: CudaSlice<f32>,
}

/// Keys per part of a span scored from logits, when the parts are not fixed.
const LOGIT_CHUNK: usize = 1024;
/// Threads of `kv_score_logit_add` (at most `LOGIT_MAX_THREADS`) in a step whose scores from
/// logits are all softmax ones (H2O) or some of them Gumbel ones (Keyformer, whose noise pass
/// runs on the side stream just before). The key sums run beside the layer's products, and the
/// CTA size that slows those least differs with what shares the side stream: measured on an H200
/// (docs/keyformer.md; 8-layer 8B-shape file, 12.7 sequences of ~4k keys, device µs a decode
/// step): H2O 1832 / 1858 / 1849 / 1842 at 64 / 128 / 256 / 512 threads, Keyformer 1899 / 1901
/// / 1898 / 1888.
fn logit_threads(gumbel: bool) -> u32 {
    match gumbel {
        true => 512,
        false => 64,
    }
}

/// Launch shapes of a plan that a recorded decode step replays: every scored span is a decode row
/// scored from logits, the tables are padded to `rows` spans, and each span's keys are cut into
/// `parts` ranges whatever its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FixedScoring {
    pub rows: usize,
    pub parts: usize,
}

/// The span's words of the plan (see `kernels/scores.cu`).
fn span_words(
    span: &QuerySpan,
    c: &KvScoring,
    table_start: usize,
    row_base: u32,
    tiles: usize,
    partial_base: usize,
) -> [u32; SPAN_WORDS] {
    let (function, tau) = match c.function {
        ScoreFunction::None => (0, 1.0),
        ScoreFunction::Softmax => (1u32, 1.0f32),
        ScoreFunction::GumbelSoftmax(schedule) => {
            (2, schedule.tau(c.iteration, c.total_iterations))
        }
    };
    [
        span.q_start as u32,
        span.n_q as u32,
        span.kv_len as u32,
        table_start as u32,
        function,
        tau.to_bits(),
        c.seed as u32,
        (c.seed >> 32) as u32,
        row_base,
        tiles as u32,
        partial_base as u32,
    ]
}

/// What the attention plan writes for span `span`'s KV scores when it computes the span's
/// logits (`positions` are the batch's, per token), or `None` when its scoring needs no scores.
pub fn logit_scoring(span: &QuerySpan, c: &KvScoring, positions: &[u32]) -> Option<LogitScoring> {
    match c.function {
        ScoreFunction::None => None,
        ScoreFunction::Softmax => Some(LogitScoring::Softmax),
        ScoreFunction::GumbelSoftmax(schedule) => Some(LogitScoring::GumbelSoftmax {
            tau: schedule.tau(c.iteration, c.total_iterations),
            seed: c.seed,
            position: positions.get(span.q_start).copied().unwrap_or(0),
        }),
    }
}

impl ScorePlan {
    /// The plan of the spans whose `scoring` needs scores over a cache of `spec` (empty when none
    /// does); `logit_bases` (per span, or empty) says where the attention plan writes a span's
    /// logits. With `fixed`, every scored span must have logits and the launch shapes depend on
    /// `fixed` alone. `old`'s buffers are reused when large enough; the flag says whether any was
    /// replaced (which a recorded launch of the old plan would not follow).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dev: &CudaDevice,
        spans: &[QuerySpan],
        scoring: &[Option<KvScoring>],
        logit_bases: &[Option<u32>],
        n_heads: usize,
        tokens: usize,
        spec: &KvCacheSpec,
        fixed: Option<FixedScoring>,
        old: Option<ScorePlan>,
    ) -> Result<(ScorePlan, bool)> {
        // The side stream may still read the tables this plan reuses.
        dev.join_side()?;
        let max_blocks = spec.max_blocks;
        let geometry = ScoreGeometry::of(spec);
        let scored: Vec<(&QuerySpan, KvScoring, Option<u32>)> = spans
            .iter()
            .zip(scoring)
            .enumerate()
            .filter_map(|(i, (s, c))| {
                c.filter(|c| c.function.needs_scores())
                    .map(|c| (s, c, logit_bases.get(i).copied().flatten()))
            })
            .collect();
        let bs = geometry.block_size;
        check(
            scored.is_empty()
                || (supports(geometry.head_dim, geometry.dtype)
                    && geometry.n_kv_heads > 0
                    && n_heads.is_multiple_of(geometry.n_kv_heads)
                    && bs > 0),
            || format!("KV scores: {n_heads} heads over {geometry:?}"),
        )?;
        let logit_row_count: usize = scored
            .iter()
            .filter(|(_, _, b)| b.is_some())
            .map(|(s, _, _)| s.n_q)
            .sum();
        let n_logit_spans_real = scored.iter().filter(|(_, _, b)| b.is_some()).count();
        if let Some(f) = fixed {
            check(
                scored.iter().all(|(s, _, b)| b.is_some() && s.n_q == 1)
                    && n_logit_spans_real <= f.rows
                    && f.parts >= 1,
                || {
                    format!(
                        "KV scores: a recorded step of {} rows scores {} spans, not all decode rows \
                         with logits",
                        f.rows,
                        scored.len()
                    )
                },
            )?;
        }
        let (n_logit_spans, n_logit_rows) = match fixed {
            Some(f) => (f.rows, f.rows),
            None => (n_logit_spans_real, logit_row_count),
        };
        let (mut k_words, mut l_words) = (vec![], vec![]);
        let (mut rows, mut tiles, mut tables) = (vec![], vec![], vec![]);
        let mut partial_entries = 0usize;
        let mut logit_len = 0usize;
        let mut longest_logit_span = 0usize;
        let mut gumbel = false;
        for (span, c, logit_base) in &scored {
            let table_len = span.kv_len.div_ceil(bs);
            check(
                span.n_q >= 1
                    && span.n_q <= span.kv_len
                    && span.q_start + span.n_q <= tokens
                    && span.block_table.len() >= table_len
                    && span.block_table[..table_len]
                        .iter()
                        .all(|&b| (b as usize) < max_blocks)
                    && u32::try_from(span.kv_len).is_ok(),
                || {
                    format!(
                        "KV scores: span of {} rows at {} over {} keys, {} blocks, {tokens} tokens",
                        span.n_q,
                        span.q_start,
                        span.kv_len,
                        span.block_table.len()
                    )
                },
            )?;
            let table_start = tables.len();
            tables.extend_from_slice(&span.block_table[..table_len]);
            match logit_base {
                Some(base) => {
                    gumbel |= matches!(c.function, ScoreFunction::GumbelSoftmax(_));
                    l_words.extend(span_words(span, c, table_start, *base, 0, 0));
                    logit_len = logit_len
                        .max(*base as usize + span.n_q * n_heads * logit_row_stride(span.kv_len));
                    longest_logit_span = longest_logit_span.max(span.kv_len);
                }
                None => {
                    let i = (k_words.len() / SPAN_WORDS) as u32;
                    let lse_row = rows.len() / 2;
                    k_words.extend(span_words(
                        span,
                        c,
                        table_start,
                        lse_row as u32,
                        span.kv_len.div_ceil(TILE),
                        partial_entries,
                    ));
                    partial_entries += span.n_q * span.kv_len.div_ceil(TILE);
                    for r in 0..span.n_q {
                        rows.extend_from_slice(&[i, r as u32]);
                    }
                    for first in (0..span.kv_len).step_by(TILE) {
                        tiles.extend_from_slice(&[i, first as u32]);
                    }
                }
            }
        }
        // Padding: spans of no rows, rows of no span.
        l_words.resize(n_logit_spans * SPAN_WORDS, 0);
        let logit_parts = match fixed {
            Some(f) => f.parts,
            None => longest_logit_span.div_ceil(LOGIT_CHUNK).max(1),
        };
        let (n_rows, n_tiles) = (rows.len() / 2, tiles.len() / 2);
        let partial_len = partial_entries * n_heads * 2;
        let lse_len = n_rows * n_heads;
        check(
            n_rows.max(n_tiles).max(n_logit_rows) <= i32::MAX as usize
                && n_logit_spans.saturating_mul(logit_parts) <= i32::MAX as usize
                && n_heads <= 65_535
                && u32::try_from(partial_entries).is_ok()
                && u32::try_from(lse_len).is_ok()
                && u32::try_from(tables.len()).is_ok(),
            || format!("KV scores: {n_rows} rows, {n_tiles} tiles, {partial_entries} partials"),
        )?;
        // The logit sections first and the block tables last: with `fixed`, every section a
        // recorded step reads starts at the same offset in every step.
        let mut host = Vec::new();
        let mut section = |data: &[u32]| {
            let start = host.len();
            host.extend_from_slice(data);
            start..host.len()
        };
        let l_spans_r = section(&l_words);
        let (spans_r, rows_r, tiles_r) = (section(&k_words), section(&rows), section(&tiles));
        let tables_r = section(&tables);
        let (upload, lse, partials) = match old {
            Some(p) => (Some(p.upload), Some(p.lse), Some(p.partials)),
            None => (None, None, None),
        };
        let (mut upload, m1) = reuse_or_alloc(dev, upload, host.len())?;
        let (lse, m2) = reuse_or_alloc(dev, lse, lse_len)?;
        let (partials, m3) = reuse_or_alloc(dev, partials, partial_len)?;
        if !host.is_empty() {
            dev.stream
                .memcpy_htod(&host, &mut upload.slice_mut(..host.len()))
                .map_err(CudaError::from)?;
        }
        let plan = ScorePlan {
            _side: dev.side_guard(),
            upload,
            spans: spans_r,
            rows: rows_r,
            tiles: tiles_r,
            tables: tables_r,
            n_rows,
            n_tiles,
            logit_spans: l_spans_r,
            n_logit_spans,
            n_logit_rows,
            logit_parts,
            logit_len,
            logit_threads: logit_threads(gumbel),
            n_heads,
            tokens,
            lse,
            partials,
        };
        Ok((plan, m1 || m2 || m3))
    }

    /// Whether the plan scores anything.
    pub fn is_empty(&self) -> bool {
        self.n_rows == 0 && self.n_logit_rows == 0
    }

    /// Adds `layer`'s increments into `scores` (`[slot][kv head]`), from the step's rotated
    /// queries `q` (`[tokens][n_heads][head_dim]`) and the layer's `keys`, after the step's keys
    /// were written; spans scored from logits from what the attention plan wrote of them
    /// (`scored_logits`: f(x) of the logits and the `[tokens][n_heads]` normalisers of their rows,
    /// [`crate::ops::attention::AttentionPlan::scored_logits`]).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        dev: &CudaDevice,
        q: &CudaSlice<bf16>,
        keys: &CudaSlice<bf16>,
        scores: &mut CudaSlice<f32>,
        positions: &CudaView<'_, u32>,
        layer: usize,
        geometry: ScoreGeometry,
        scale: f32,
        scored_logits: (&CudaSlice<f32>, &CudaSlice<f32>),
    ) -> Result<()> {
        let ScoreGeometry {
            n_kv_heads,
            head_dim,
            block_size,
            ..
        } = geometry;
        let max_blocks = keys.len() * 2 / geometry.block_bytes().max(1);
        check(
            q.len() >= self.tokens * self.n_heads * head_dim
                && positions.len() >= self.tokens
                && scores.len() >= max_blocks * block_size * n_kv_heads
                && n_kv_heads <= 65_535
                && layer <= i32::MAX as usize,
            || {
                format!(
                    "KV scores: q {} / positions {} / scores {} / keys {} for {} tokens, {geometry:?}",
                    q.len(),
                    positions.len(),
                    scores.len(),
                    keys.len(),
                    self.tokens
                )
            },
        )?;
        if self.n_logit_rows > 0 {
            // A decode step's key sums: nothing later in the step reads this layer's scores, so
            // they run on the side stream, after the noise pass there, beside the layer's
            // products. A step that also scores prompt rows (below, on the main stream, into the
            // same scores) keeps both on the main stream.
            let stream = match self.n_rows {
                0 => dev.fork_side()?,
                _ => {
                    dev.join_side()?;
                    &*dev.stream
                }
            };
            self.run_from_logits(dev, stream, scored_logits, scores, geometry)?;
        }
        if self.n_rows == 0 {
            return Ok(());
        }
        let ints = [self.n_heads, n_kv_heads, head_dim, block_size, layer].map(|v| v as i32);
        let view = |r: &Range<usize>| self.upload.slice(r.clone());
        let (tables, spans) = (view(&self.tables), view(&self.spans));
        let (rows, tiles) = (view(&self.rows), view(&self.tiles));

        let (partial_kernel, add_kernel, threads) = tile_kernels(head_dim, geometry.dtype);
        let f = dev.function("scores", partial_kernel)?;
        let mut b = dev.stream.launch_builder(&f);
        b.arg(q)
            .arg(keys)
            .arg(&tables)
            .arg(&spans)
            .arg(&tiles)
            .arg(positions);
        b.arg(&mut self.partials);
        for a in &ints {
            b.arg(a);
        }
        b.arg(&scale);
        let tile_grid = LaunchConfig {
            grid_dim: (self.n_tiles as u32, n_kv_heads as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature (both variants take the same);
        // `new` checked every span's rows
        // against the step's tokens and its block table against the cache's blocks, sized the
        // partials for every (row, tile) of every span, and the sizes of q, the positions and the
        // scores were checked above.
        unsafe { b.launch(tile_grid) }?;

        let f = dev.function("scores", "kv_score_merge")?;
        let mut b = dev.stream.launch_builder(&f);
        b.arg(&spans)
            .arg(&rows)
            .arg(&self.partials)
            .arg(&mut self.lse);
        b.arg(&ints[0]);
        let cfg = LaunchConfig {
            grid_dim: (self.n_rows as u32, 1, 1),
            block_dim: (MERGE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; each row reads the partials of the tiles it sees, all written by the
        // launch before on this stream, and writes its own normalisers.
        unsafe { b.launch(cfg) }?;

        let f = dev.function("scores", add_kernel)?;
        let mut b = dev.stream.launch_builder(&f);
        b.arg(q)
            .arg(keys)
            .arg(scores)
            .arg(&tables)
            .arg(&spans)
            .arg(&tiles);
        b.arg(positions).arg(&self.lse);
        for a in &ints {
            b.arg(a);
        }
        b.arg(&scale);
        // SAFETY: as above; the normalisers were written by the launch before, on this stream.
        unsafe { b.launch(tile_grid) }?;
        Ok(())
    }

    /// The increments of the spans scored from the logits the step's attention wrote.
    fn run_from_logits(
        &mut self,
        dev: &CudaDevice,
        stream: &CudaStream,
        (logits, lse): (&CudaSlice<f32>, &CudaSlice<f32>),
        scores: &mut CudaSlice<f32>,
        geometry: ScoreGeometry,
    ) -> Result<()> {
        check(
            logits.len() >= self.logit_len && lse.len() >= self.tokens * self.n_heads,
            || {
                format!(
                    "KV scores: {} logits for {}, {} normalisers for {} tokens",
                    logits.len(),
                    self.logit_len,
                    lse.len(),
                    self.tokens
                )
            },
        )?;
        let view = |r: &Range<usize>| self.upload.slice(r.clone());
        let (tables, spans) = (view(&self.tables), view(&self.logit_spans));
        let ints = [
            self.n_heads,
            geometry.n_kv_heads,
            geometry.block_size,
            self.logit_parts,
        ]
        .map(|v| v as i32);
        let f = dev.function("scores", "kv_score_logit_add")?;
        let mut b = stream.launch_builder(&f);
        b.arg(logits).arg(scores).arg(&tables).arg(&spans).arg(lse);
        for a in &ints {
            b.arg(a);
        }
        let cfg = LaunchConfig {
            grid_dim: (
                (self.n_logit_spans * self.logit_parts) as u32,
                geometry.n_kv_heads as u32,
                logit_head_groups(geometry.n_kv_heads),
            ),
            block_dim: (self.logit_threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; every span's logits were sized by
        // the attention plan that gave its base (rows × heads × row stride, checked against the
        // buffer above), its rows' normalisers are their tokens' (checked above), padding spans
        // have no rows and return at once, and the block tables were checked against the cache.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

/// How many CTAs share a key's KV heads in `kv_score_logit_add`: one per four KV heads (each
/// thread then loads one group's logits rather than every head's, a shorter chain of loads), up
/// to 8.
fn logit_head_groups(n_kv_heads: usize) -> u32 {
    match n_kv_heads % 4 {
        0 => (n_kv_heads / 4).clamp(1, 8) as u32,
        _ => 1,
    }
}

/// A sequence's scores, `[layer][kv head][key]` for its first `keys` keys, read back to the host.
/// `layer_scores` holds every layer's scores address; `table` is the sequence's block table.
pub fn gather(
    dev: &CudaDevice,
    layer_scores: &CudaView<'_, u64>,
    table: &CudaView<'_, u32>,
    n_layers: usize,
    geometry: ScoreGeometry,
    keys: usize,
) -> Result<Vec<f32>> {
    let n = n_layers * geometry.n_kv_heads * keys;
    check(
        layer_scores.len() >= n_layers
            && table.len() * geometry.block_size >= keys
            && keys <= i32::MAX as usize
            && geometry.block_size > 0,
        || {
            format!(
                "KV score gather: {keys} keys over {} blocks, {} layer addresses for {n_layers}",
                table.len(),
                layer_scores.len()
            )
        },
    )?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut out = dev.stream.alloc_zeros::<f32>(n).map_err(CudaError::from)?;
    let ints = [n_layers, geometry.n_kv_heads, keys, geometry.block_size].map(|v| v as i32);
    let f = dev.function("scores", "kv_score_gather")?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(&mut out).arg(layer_scores).arg(table);
    for a in &ints {
        b.arg(a);
    }
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256).min(4096) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; the caller passes the addresses of a
    // cache whose blocks include the table's (checked by the backend), and the table covers the
    // keys read.
    unsafe { b.launch(cfg) }?;
    let mut host = vec![0f32; n];
    dev.stream
        .memcpy_dtoh(&out, &mut host)
        .map_err(CudaError::from)?;
    Ok(host)
}

/// Threads of the kept-key selection (`SELECT_THREADS`).
const SELECT_THREADS: u32 = 512;

/// What [`select_kept`] keeps of each row's `keys` keys: `sinks + top + recent` of them (a
/// [`turbo_keyformer::KeepRule`] split for that count).
#[derive(Clone, Copy, Debug)]
pub struct KeepSplit {
    pub keys: usize,
    pub sinks: usize,
    pub top: usize,
    pub recent: usize,
}

/// The kept keys `[n_layers][n_kv_heads][sinks + top + recent]` of one sequence, chosen on the
/// device from the scores of every layer (`layer_scores`, unread when `top` is 0) through its
/// block `table`: the first `sinks`, the last `recent`, and the `top` highest scores in between
/// (ties to the lower key), each row increasing.
pub fn select_kept(
    dev: &CudaDevice,
    layer_scores: &CudaView<'_, u64>,
    table: &CudaView<'_, u32>,
    n_layers: usize,
    geometry: ScoreGeometry,
    split: KeepSplit,
) -> Result<CudaSlice<u32>> {
    let KeepSplit {
        keys,
        sinks,
        top,
        recent,
    } = split;
    let k = sinks + top + recent;
    let rows = n_layers * geometry.n_kv_heads;
    check(
        k <= keys
            && (top == 0 || k < keys)
            && layer_scores.len() >= n_layers
            && table.len() * geometry.block_size >= keys
            && keys <= i32::MAX as usize
            && rows <= i32::MAX as usize
            && geometry.block_size > 0,
        || {
            format!(
                "KV selection: {split:?} over {} blocks, {} layer addresses for {n_layers}",
                table.len(),
                layer_scores.len()
            )
        },
    )?;
    let mut kept = dev
        .stream
        .alloc_zeros::<u32>((rows * k).max(1))
        .map_err(CudaError::from)?;
    if rows == 0 || k == 0 {
        return Ok(kept);
    }
    let ints = [
        geometry.n_kv_heads,
        geometry.block_size,
        keys,
        k,
        sinks,
        recent,
        top,
    ]
    .map(|v| v as i32);
    let f = dev.function("scores", "kv_select_kept")?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(&mut kept).arg(layer_scores).arg(table);
    for a in &ints {
        b.arg(a);
    }
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (SELECT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; kept holds rows × k, the table covers
    // the keys, and the caller passes the addresses of a cache holding the table's blocks (with
    // scores allocated when top > 0).
    unsafe { b.launch(cfg) }?;
    Ok(kept)
}
