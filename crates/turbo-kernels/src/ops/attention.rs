//! Causal attention over paged KV (`kernels/attention.cu`), with the semantics of
//! [`turbo_attention::paged_attention`]: each query row attends to its sequence's keys `0..=pos`
//! through the sequence's block table, query head `h` reading KV head `h / (n_heads / n_kv_heads)`.
//!
//! One CTA computes one (query row, head) over one chunk of that row's keys. When the batch alone
//! would leave the GPU idle (decode of few sequences), rows are split into chunks whose states
//! `(o, lse)` go to f32 scratch and a second kernel merges them ("flash-decoding"); otherwise each
//! CTA covers all of its row's keys and writes the output directly.

use super::check;
use crate::device::CudaDevice;
use crate::error::Result;
use cudarc::driver::sys::CUdevice_attribute;
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
    /// Split only when the batch's (row, head) pairs would not fill the GPU, into chunks sized so
    /// that the CTAs about fill it (at least [`MIN_AUTO_CHUNK`] keys each).
    Auto,
    /// One CTA per (row, head) over all of the row's keys, writing the output directly.
    Off,
    /// Chunks of this many keys (at least 1), always merged by the second kernel, also for rows
    /// with a single chunk.
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

/// The chunk kernel for a head dimension, which must be one of these.
/// Head dimensions the attention kernels are instantiated for.
pub const SUPPORTED_HEAD_DIMS: [usize; 6] = [32, 64, 96, 128, 192, 256];

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

    let max_keys = token_pos.iter().map(|&p| p as usize + 1).max().unwrap_or(0);
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
            if n_tokens * n_heads >= target {
                None
            } else {
                let total_keys: usize = token_pos.iter().map(|&p| p as usize + 1).sum();
                let c = (total_keys * n_heads).div_ceil(target).max(MIN_AUTO_CHUNK);
                (c < max_keys).then_some(c)
            }
        }
    };

    // Sections of `meta` after the tables: seq_table_start, token_seq, token_pos, and with a split
    // token_work ([tokens + 1]) and work ([items][2]: token, chunk index).
    let fits_u32 = |n: usize| u32::try_from(n).is_ok();
    let mut offsets = vec![meta.len()];
    for &x in &seq_table_start {
        check(fits_u32(x), || {
            "paged_attention: block tables too long".to_string()
        })?;
        meta.push(x as u32);
    }
    offsets.push(meta.len());
    meta.extend_from_slice(&token_seq);
    offsets.push(meta.len());
    meta.extend_from_slice(&token_pos);
    offsets.push(meta.len());
    let n_items = match chunk {
        None => n_tokens,
        Some(c) => {
            let mut work = Vec::new();
            for (t, &pos) in token_pos.iter().enumerate() {
                check(fits_u32(work.len() / 2), || {
                    "paged_attention: too many chunks".to_string()
                })?;
                meta.push((work.len() / 2) as u32);
                for i in 0..(pos as usize + 1).div_ceil(c) {
                    work.push(t as u32);
                    work.push(i as u32);
                }
            }
            let n_items = work.len() / 2;
            check(fits_u32(n_items), || {
                "paged_attention: too many chunks".to_string()
            })?;
            meta.push(n_items as u32);
            offsets.push(meta.len());
            meta.extend_from_slice(&work);
            offsets.push(meta.len());
            n_items
        }
    };
    check(n_items <= i32::MAX as usize && fits_u32(meta.len()), || {
        format!("paged_attention: {n_items} work items")
    })?;
    let meta = dev.stream.clone_htod(&meta)?;
    let section = |i: usize| meta.slice(offsets[i]..offsets[i + 1]);
    let tables = meta.slice(0..offsets[0]);
    let (seq_start_v, token_seq_v, token_pos_v) = (section(0), section(1), section(2));

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
    let chunk_u32 = chunk.map_or(u32::MAX, |c| c.min(u32::MAX as usize) as u32);
    let head_dim_i = head_dim as i32;
    let chunk_cfg = LaunchConfig {
        grid_dim: (n_items as u32, n_heads as u32, 1),
        block_dim: (CHUNK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = dev.function("attention", kernel.expect("checked above"))?;

    match chunk {
        None => {
            let mut b = dev.stream.launch_builder(&f);
            b.arg(q)
                .arg(k_cache)
                .arg(v_cache)
                .arg(&tables)
                .arg(&seq_start_v)
                .arg(&token_seq_v)
                .arg(&token_pos_v)
                .arg(&null)
                .arg(&n_heads_i)
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
            // table offset the kernel derives was checked against the buffers' sizes above.
            unsafe { b.launch(chunk_cfg)? };
        }
        Some(_) => {
            let token_work_v = section(3);
            let work_v = section(4);
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

            let merge = dev.function("attention", "attn_merge")?;
            let mut b = dev.stream.launch_builder(&merge);
            b.arg(&part_o)
                .arg(&part_lse)
                .arg(&token_work_v)
                .arg(&n_heads_i)
                .arg(&head_dim_i)
                .arg(&mut *out);
            match lse {
                Some(l) => b.arg(l),
                None => b.arg(&null),
            };
            let merge_cfg = LaunchConfig {
                grid_dim: (n_tokens as u32, n_heads as u32, 1),
                block_dim: (MERGE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match attn_merge's parameters; token_work has n_tokens + 1
            // entries indexing the n_items states just written.
            unsafe { b.launch(merge_cfg)? };
        }
    }
    Ok(())
}
