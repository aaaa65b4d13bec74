//! Causal attention over paged KV (`kernels/attention.cu`), with the semantics of
//! [`turbo_attention::paged_attention`]: each query row attends to its sequence's keys `0..=pos`
//! through the sequence's block table, query head `h` reading KV head `h / (n_heads / n_kv_heads)`.
//!
//! Two kernels share the work:
//! - Prefill spans (at least [`PREFILL_MIN_ROWS`] query rows of one sequence) with head_dim 64 or
//!   128 go, under [`KvSplit::Auto`], to a tensor-core FlashAttention-2 kernel: one CTA computes 128
//!   consecutive rows of a span for one head, walking the keys in tiles of 32 (d128) or 64 (d64)
//!   (`mma.sync` bf16 with f32 accumulation, online softmax).
//! - Every other row (decode rows, short spans, other head dimensions, and all rows under an
//!   explicit [`KvSplit::Off`] or [`KvSplit::Chunk`]) goes to the row kernel: one CTA computes one
//!   (query row, head) over one chunk of that row's keys. When those rows alone would leave the GPU
//!   idle (decode of few sequences), they are split into chunks whose states `(o, lse)` go to f32
//!   scratch and a second kernel merges them ("flash-decoding"); otherwise each CTA covers all of
//!   its row's keys and writes the output directly.
//!
//! A batch may mix both: the two launches cover disjoint rows.

use super::check;
use crate::device::CudaDevice;
use crate::error::Result;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;
use turbo_attention::QuerySpan;

/// Shape of one layer's paged KV: `[block][slot in block][kv head][head_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct KvLayout {
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// How each query row's keys are divided among CTAs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvSplit {
    /// Prefill spans (see [`PREFILL_MIN_ROWS`]) go to the tensor-core prefill kernel; the other
    /// rows are split only when their (row, head) pairs would not fill the GPU, into chunks sized
    /// so that the CTAs about fill it (at least [`MIN_AUTO_CHUNK`] keys each).
    Auto,
    /// Every row to the row kernel, one CTA per (row, head) over all of the row's keys, writing the
    /// output directly.
    Off,
    /// Every row to the row kernel, in chunks of this many keys (at least 1), always merged by the
    /// second kernel, also for rows with a single chunk.
    Chunk(usize),
}

/// Threads of the chunk kernel (`ATTN_THREADS`: 4 warps).
const CHUNK_THREADS: u32 = 128;
/// Threads of the merge kernel (`ATTN_MERGE_THREADS`).
const MERGE_THREADS: u32 = 128;
/// The smallest chunk [`KvSplit::Auto`] makes: below it, merging costs more than it gains.
pub const MIN_AUTO_CHUNK: usize = 128;
/// CTAs per SM that [`KvSplit::Auto`] aims for: about two waves (4 to 5 chunk CTAs fit an SM at
/// once). Batches with more (row, head) pairs than that are not split.
const AUTO_CTAS_PER_SM: usize = 8;

/// Head dimensions the attention kernels are instantiated for.
pub const SUPPORTED_HEAD_DIMS: [usize; 6] = [32, 64, 96, 128, 192, 256];

/// Query rows a span needs for [`KvSplit::Auto`] to send it to the prefill kernel (with head_dim
/// 64 or 128). Shorter spans (decode rows, small speculative or chunked steps) stay with the row
/// kernel, where the prefill kernel's 128-row CTAs would be mostly empty; the threshold is a
/// choice, not a measured crossover.
pub const PREFILL_MIN_ROWS: usize = 16;
/// The shape a prefill kernel was instantiated with (`ATTN_PREFILL_KERNEL` in
/// `kernels/attention.cu`; the two must agree).
struct PrefillKernel {
    name: &'static str,
    /// Warps per CTA.
    warps: usize,
    /// 16-row m-tiles per warp.
    m_tiles: usize,
    /// Keys per tile.
    key_tile: usize,
}

impl PrefillKernel {
    /// Query rows per CTA.
    fn rows(&self) -> usize {
        16 * self.warps * self.m_tiles
    }

    /// Dynamic shared memory (`pf_smem_bytes`): K and V tiles and the Q tile, Q sharing V's space
    /// when it is only read once (one m-tile per warp).
    fn smem_bytes(&self, head_dim: usize) -> usize {
        let q = self.rows();
        let tiles = if self.m_tiles == 1 {
            self.key_tile + q.max(self.key_tile)
        } else {
            q + 2 * self.key_tile
        };
        tiles * head_dim * 2
    }
}

/// The prefill kernel for a head dimension, if there is one (the shapes measured fastest on an
/// H100; see `kernels/attention.cu`).
fn prefill_kernel(head_dim: usize) -> Option<PrefillKernel> {
    let (name, warps, m_tiles, key_tile) = match head_dim {
        64 => ("attn_prefill_d64", 4, 2, 64),
        128 => ("attn_prefill_d128", 4, 2, 32),
        _ => return None,
    };
    Some(PrefillKernel {
        name,
        warps,
        m_tiles,
        key_tile,
    })
}

/// The chunk kernel for a head dimension, which must be one of [`SUPPORTED_HEAD_DIMS`].
fn chunk_kernel(head_dim: usize) -> Option<&'static str> {
    Some(match head_dim {
        32 => "attn_chunk_d32",
        64 => "attn_chunk_d64",
        96 => "attn_chunk_d96",
        128 => "attn_chunk_d128",
        192 => "attn_chunk_d192",
        256 => "attn_chunk_d256",
        _ => return None,
    })
}

/// Causal attention of the query rows of `spans` over paged KV.
///
/// `q` and `out` are `[tokens, n_heads, head_dim]` bf16 with `tokens = q.len() / (n_heads *
/// head_dim)`; `k_cache` and `v_cache` are `[block][slot][kv head][head_dim]` bf16; `lse`, when
/// given, receives `[tokens, n_heads]` natural-log sum-exps of the scaled scores. As in the CPU
/// reference, a row that no span covers is treated as position 0 of the first span's sequence.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    dev: &CudaDevice,
    q: &CudaSlice<bf16>,
    k_cache: &CudaSlice<bf16>,
    v_cache: &CudaSlice<bf16>,
    layout: KvLayout,
    n_heads: usize,
    spans: &[QuerySpan],
    scale: f32,
    out: &mut CudaSlice<bf16>,
    lse: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    paged_attention_split(
        dev,
        q,
        k_cache,
        v_cache,
        layout,
        n_heads,
        spans,
        scale,
        KvSplit::Auto,
        out,
        lse,
    )
}

/// [`paged_attention`] with an explicit choice of how keys are split among CTAs (for tests and
/// tuning; every choice computes the same attention up to f32 rounding).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_split(
    dev: &CudaDevice,
    q: &CudaSlice<bf16>,
    k_cache: &CudaSlice<bf16>,
    v_cache: &CudaSlice<bf16>,
    layout: KvLayout,
    n_heads: usize,
    spans: &[QuerySpan],
    scale: f32,
    split: KvSplit,
    out: &mut CudaSlice<bf16>,
    lse: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    let KvLayout {
        block_size,
        n_kv_heads,
        head_dim,
    } = layout;
    let kernel = chunk_kernel(head_dim);
    check(kernel.is_some(), || {
        format!("paged_attention: head_dim {head_dim} unsupported (32, 64, 96, 128, 192 or 256)")
    })?;
    check(
        block_size > 0
            && n_kv_heads > 0
            && n_heads > 0
            && n_heads % n_kv_heads == 0
            && n_heads <= 65535
            && block_size <= i32::MAX as usize,
        || {
            format!(
                "paged_attention: {n_heads} query heads, {n_kv_heads} KV heads, block size {block_size}"
            )
        },
    )?;
    let row_len = n_heads * head_dim;
    let n_tokens = q.len() / row_len;
    check(out.len() >= n_tokens * row_len, || {
        format!(
            "paged_attention: out has {} elements for {n_tokens} rows of {row_len}",
            out.len()
        )
    })?;
    if let Some(l) = lse.as_deref() {
        check(l.len() >= n_tokens * n_heads, || {
            format!(
                "paged_attention: lse has {} elements for {n_tokens} rows of {n_heads}",
                l.len()
            )
        })?;
    }
    if n_tokens == 0 {
        return Ok(());
    }
    check(n_tokens <= i32::MAX as usize, || {
        format!("paged_attention: {n_tokens} query rows")
    })?;
    check(!spans.is_empty(), || {
        format!("paged_attention: {n_tokens} query rows but no spans")
    })?;
    let block_len = block_size * n_kv_heads * head_dim;
    let n_blocks = k_cache.len().min(v_cache.len()) / block_len;

    // Each row's sequence and position; rows no span covers stay (0, 0), as in the CPU reference.
    let mut token_seq = vec![0u32; n_tokens];
    let mut token_pos = vec![0u32; n_tokens];
    for (s, span) in spans.iter().enumerate() {
        check(
            span.n_q <= span.kv_len
                && span.q_start + span.n_q <= n_tokens
                && span.kv_len <= span.block_table.len() * block_size
                && span.kv_len <= i32::MAX as usize,
            || {
                format!(
                    "paged_attention: span {s} (q_start {}, n_q {}, kv_len {}, {} blocks of {block_size}) \
                     does not fit {n_tokens} rows",
                    span.q_start,
                    span.n_q,
                    span.kv_len,
                    span.block_table.len()
                )
            },
        )?;
        for i in 0..span.n_q {
            token_seq[span.q_start + i] = s as u32;
            token_pos[span.q_start + i] = (span.kv_len - span.n_q + i) as u32;
        }
    }
    // The blocks each sequence's rows reach; only those are uploaded, and each must exist.
    let mut needed = vec![0usize; spans.len()];
    for (&s, &pos) in token_seq.iter().zip(&token_pos) {
        let n = pos as usize / block_size + 1;
        needed[s as usize] = needed[s as usize].max(n);
    }
    let mut meta: Vec<u32> = Vec::new();
    let mut seq_table_start = Vec::with_capacity(spans.len());
    for (s, span) in spans.iter().enumerate() {
        let table = span.block_table;
        check(needed[s] <= table.len(), || {
            format!(
                "paged_attention: span {s} reaches {} blocks, its table has {}",
                needed[s],
                table.len()
            )
        })?;
        seq_table_start.push(meta.len());
        for &b in &table[..needed[s]] {
            check((b as usize) < n_blocks, || {
                format!("paged_attention: span {s} names block {b}, the cache has {n_blocks}")
            })?;
            meta.push(b);
        }
    }

    // Prefill spans: under Auto, with a prefill kernel for this head_dim, the spans of at least
    // PREFILL_MIN_ROWS rows that still own all of their rows (where spans overlap, the last one
    // wins, as in the CPU reference), cut into items of up to the kernel's rows per CTA:
    // [first row, rows, position of the first row, sequence].
    // (The kernel addresses cache rows, block · block_size + slot, as u32, with !0 for none.)
    let prefill = if split == KvSplit::Auto && n_blocks * block_size < u32::MAX as usize {
        prefill_kernel(head_dim)
    } else {
        None
    };
    let mut in_prefill = vec![false; n_tokens];
    let mut prefill_items: Vec<[u32; 4]> = Vec::new();
    if let Some(pk) = &prefill {
        let rows_per_item = pk.rows();
        for (s, span) in spans.iter().enumerate() {
            let rows = span.q_start..span.q_start + span.n_q;
            if span.n_q < PREFILL_MIN_ROWS
                || token_seq[rows.clone()].iter().any(|&x| x as usize != s)
            {
                continue;
            }
            in_prefill[rows].fill(true);
            for i0 in (0..span.n_q).step_by(rows_per_item) {
                prefill_items.push([
                    (span.q_start + i0) as u32,
                    (span.n_q - i0).min(rows_per_item) as u32,
                    (span.kv_len - span.n_q + i0) as u32,
                    s as u32,
                ]);
            }
        }
        // Most keys first, so that the last wave of CTAs is made of the short items.
        prefill_items.sort_by_key(|it| std::cmp::Reverse(it[1] + it[2]));
    }
    // The rows left to the row kernel; all of them unless some went to the prefill kernel.
    let row_tokens: Vec<u32> = (0..n_tokens as u32)
        .filter(|&t| !in_prefill[t as usize])
        .collect();
    let all_rows = row_tokens.len() == n_tokens;

    let max_keys = row_tokens
        .iter()
        .map(|&t| token_pos[t as usize] as usize + 1)
        .max()
        .unwrap_or(0);
    let chunk = match split {
        KvSplit::Off => None,
        KvSplit::Chunk(c) => {
            check(c >= 1, || "paged_attention: chunks of 0 keys".to_string())?;
            Some(c)
        }
        KvSplit::Auto => {
            let sms = dev
                .ctx
                .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            let target = (sms.max(1) as usize) * AUTO_CTAS_PER_SM;
            if row_tokens.len() * n_heads >= target {
                None
            } else {
                let total_keys: usize = row_tokens
                    .iter()
                    .map(|&t| token_pos[t as usize] as usize + 1)
                    .sum();
                let c = (total_keys * n_heads).div_ceil(target).max(MIN_AUTO_CHUNK);
                (c < max_keys).then_some(c)
            }
        }
    };

    // Sections of `meta` after the tables: seq_table_start, token_seq, token_pos; for the row
    // kernel, with a split token_work ([rows + 1]) and work ([items][2]: token, chunk index), without
    // one and with only some rows work for those rows (chunk 0 each); with only some rows and a split
    // the merge's rows; the prefill items.
    let fits_u32 = |n: usize| u32::try_from(n).is_ok();
    let mut sections = Vec::new();
    let mut push = |meta: &mut Vec<u32>, data: &[u32]| {
        let start = meta.len();
        meta.extend_from_slice(data);
        sections.push(start..meta.len());
        sections.len() - 1
    };
    let tables_end = meta.len();
    let mut starts = Vec::with_capacity(seq_table_start.len());
    for &x in &seq_table_start {
        check(fits_u32(x), || {
            "paged_attention: block tables too long".to_string()
        })?;
        starts.push(x as u32);
    }
    let sec_starts = push(&mut meta, &starts);
    let sec_seq = push(&mut meta, &token_seq);
    let sec_pos = push(&mut meta, &token_pos);
    let (n_items, sec_token_work, sec_work) = match chunk {
        None if all_rows => (n_tokens, None, None),
        None => {
            let work: Vec<u32> = row_tokens.iter().flat_map(|&t| [t, 0]).collect();
            (row_tokens.len(), None, Some(push(&mut meta, &work)))
        }
        Some(c) => {
            let mut token_work = Vec::with_capacity(row_tokens.len() + 1);
            let mut work = Vec::new();
            for &t in &row_tokens {
                check(fits_u32(work.len() / 2), || {
                    "paged_attention: too many chunks".to_string()
                })?;
                token_work.push((work.len() / 2) as u32);
                for i in 0..(token_pos[t as usize] as usize + 1).div_ceil(c) {
                    work.push(t);
                    work.push(i as u32);
                }
            }
            let n_items = work.len() / 2;
            check(fits_u32(n_items), || {
                "paged_attention: too many chunks".to_string()
            })?;
            token_work.push(n_items as u32);
            let tw = push(&mut meta, &token_work);
            (n_items, Some(tw), Some(push(&mut meta, &work)))
        }
    };
    let sec_merge_rows = (chunk.is_some() && !all_rows).then(|| push(&mut meta, &row_tokens));
    let flat_items: Vec<u32> = prefill_items.iter().flatten().copied().collect();
    let sec_items = push(&mut meta, &flat_items);
    let n_prefill_ctas = prefill_items.len() * n_heads;
    check(
        n_items <= i32::MAX as usize && n_prefill_ctas <= i32::MAX as usize && fits_u32(meta.len()),
        || format!("paged_attention: {n_items} work items, {n_prefill_ctas} prefill CTAs"),
    )?;
    let meta = dev.stream.clone_htod(&meta)?;
    let section = |i: usize| meta.slice(sections[i].clone());
    let tables = meta.slice(0..tables_end);
    let seq_start_v = section(sec_starts);

    let null: u64 = 0;
    let n_heads_i = n_heads as i32;
    let group = (n_heads / n_kv_heads) as i32;
    let n_kv_heads_i = n_kv_heads as i32;
    let block_size_i = block_size as i32;
    let block_shift: i32 = if block_size.is_power_of_two() {
        block_size.trailing_zeros() as i32
    } else {
        -1
    };
    let head_dim_i = head_dim as i32;
    let mut lse = lse;

    if let Some(pk) = prefill.filter(|_| !prefill_items.is_empty()) {
        let items_v = section(sec_items);
        let f = dev.function("attention", pk.name)?;
        let smem = pk.smem_bytes(head_dim);
        if smem > 48 * 1024 {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let mut b = dev.stream.launch_builder(&f);
        b.arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(&tables)
            .arg(&seq_start_v)
            .arg(&items_v)
            .arg(&n_heads_i)
            .arg(&group)
            .arg(&n_kv_heads_i)
            .arg(&block_size_i)
            .arg(&block_shift)
            .arg(&scale)
            .arg(&mut *out);
        match lse.as_deref_mut() {
            Some(l) => b.arg(l),
            None => b.arg(&null),
        };
        let cfg = LaunchConfig {
            grid_dim: (n_prefill_ctas as u32, 1, 1),
            block_dim: (32 * pk.warps as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: the arguments match attn_prefill_d*'s parameters; every item's rows lie in one
        // span (so within q and out), its keys 0..pos+rows are that span's keys, whose blocks were
        // checked against the cache and uploaded in its table.
        unsafe { b.launch(cfg)? };
    }
    if row_tokens.is_empty() {
        return Ok(());
    }

    let (token_seq_v, token_pos_v) = (section(sec_seq), section(sec_pos));
    let chunk_u32 = chunk.map_or(u32::MAX, |c| c.min(u32::MAX as usize) as u32);
    let chunk_cfg = LaunchConfig {
        grid_dim: (n_items as u32, n_heads as u32, 1),
        block_dim: (CHUNK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = dev.function("attention", kernel.expect("checked above"))?;
    let work_v = sec_work.map(section);

    match chunk {
        None => {
            let mut b = dev.stream.launch_builder(&f);
            b.arg(q)
                .arg(k_cache)
                .arg(v_cache)
                .arg(&tables)
                .arg(&seq_start_v)
                .arg(&token_seq_v)
                .arg(&token_pos_v);
            match &work_v {
                Some(w) => b.arg(w),
                None => b.arg(&null),
            };
            b.arg(&n_heads_i)
                .arg(&group)
                .arg(&n_kv_heads_i)
                .arg(&block_size_i)
                .arg(&block_shift)
                .arg(&chunk_u32)
                .arg(&scale)
                .arg(&null)
                .arg(&null)
                .arg(&mut *out);
            match lse {
                Some(l) => b.arg(l),
                None => b.arg(&null),
            };
            // SAFETY: the arguments match attn_chunk_d*'s parameters; every row index, block id and
            // table offset the kernel derives was checked against the buffers' sizes above (work,
            // when given, names each of the rows left to this kernel once, with chunk 0 of a
            // chunk covering all its keys).
            unsafe { b.launch(chunk_cfg)? };
        }
        Some(_) => {
            let token_work_v = section(sec_token_work.expect("made with the split"));
            let work_v = work_v.expect("made with the split");
            let mut part_o = dev
                .stream
                .alloc_zeros::<f32>(n_items * n_heads * head_dim)?;
            let mut part_lse = dev.stream.alloc_zeros::<f32>(n_items * n_heads)?;
            let mut b = dev.stream.launch_builder(&f);
            b.arg(q)
                .arg(k_cache)
                .arg(v_cache)
                .arg(&tables)
                .arg(&seq_start_v)
                .arg(&token_seq_v)
                .arg(&token_pos_v)
                .arg(&work_v)
                .arg(&n_heads_i)
                .arg(&group)
                .arg(&n_kv_heads_i)
                .arg(&block_size_i)
                .arg(&block_shift)
                .arg(&chunk_u32)
                .arg(&scale)
                .arg(&mut part_o)
                .arg(&mut part_lse)
                .arg(&null)
                .arg(&null);
            // SAFETY: as above; the scratch holds n_items × n_heads states.
            unsafe { b.launch(chunk_cfg)? };

            let merge_rows_v = sec_merge_rows.map(section);
            let merge = dev.function("attention", "attn_merge")?;
            let mut b = dev.stream.launch_builder(&merge);
            b.arg(&part_o).arg(&part_lse).arg(&token_work_v);
            match &merge_rows_v {
                Some(r) => b.arg(r),
                None => b.arg(&null),
            };
            b.arg(&n_heads_i).arg(&head_dim_i).arg(&mut *out);
            match lse {
                Some(l) => b.arg(l),
                None => b.arg(&null),
            };
            let merge_cfg = LaunchConfig {
                grid_dim: (row_tokens.len() as u32, n_heads as u32, 1),
                block_dim: (MERGE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match attn_merge's parameters; token_work has one entry per
            // merge row plus one, indexing the n_items states just written, and the merge rows
            // (when given) are rows of `out`.
            unsafe { b.launch(merge_cfg)? };
        }
    }
    Ok(())
}
