//! Elementwise and data-movement kernels: RoPE, SwiGLU's `silu(gate) · up`, residual add, embedding
//! and row gathers, and the paged KV write (bf16 or quantized).

use super::check;
use crate::device::CudaDevice;
use crate::error::Result;
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use half::bf16;
use turbo_attention::KvDtype;
use turbo_core::cpu::KvCacheSpec;

/// Threads per block of every kernel here.
const THREADS: u32 = 256;

/// Blocks for a grid-stride kernel over `units` work items (the kernels loop, so any cap is safe).
fn grid_for(units: usize) -> u32 {
    units.div_ceil(THREADS as usize).clamp(1, 65_535) as u32
}

fn config(grid: (u32, u32, u32)) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn fits_i32(v: usize) -> bool {
    v <= i32::MAX as usize
}

/// Interleaved-pair rotary embedding, in place: `x` is `[tokens, heads · head_dim]`; pair `i`
/// (dimensions `2i, 2i+1`) of every head of token `t` rotates by `positions[t] · inv_freq[i]`.
pub fn rope(
    dev: &CudaDevice,
    x: &mut CudaSlice<bf16>,
    tokens: usize,
    heads: usize,
    head_dim: usize,
    positions: &CudaView<'_, u32>,
    inv_freq: &CudaSlice<f32>,
) -> Result<()> {
    let n = tokens * heads * head_dim;
    check(
        head_dim > 0
            && head_dim.is_multiple_of(2)
            && fits_i32(tokens)
            && fits_i32(heads)
            && fits_i32(head_dim)
            && x.len() >= n
            && positions.len() >= tokens
            && inv_freq.len() >= head_dim / 2,
        || {
            format!(
                "rope: x {} / positions {} / inv_freq {} elements for tokens={tokens} heads={heads} head_dim={head_dim}",
                x.len(),
                positions.len(),
                inv_freq.len()
            )
        },
    )?;
    if n == 0 {
        return Ok(());
    }
    let (tokens_i, heads_i, head_dim_i) = (tokens as i32, heads as i32, head_dim as i32);
    let f = dev.function("elementwise", "rope_bf16")?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(x);
    b.arg(&tokens_i);
    b.arg(&heads_i);
    b.arg(&head_dim_i);
    b.arg(positions);
    b.arg(inv_freq);
    // SAFETY: the arguments match the kernel's signature and the buffer sizes were checked.
    unsafe { b.launch(config((grid_for(n / 2), 1, 1))) }?;
    Ok(())
}

/// The step after a fused QKV product: `qkv` is `[tokens, q_cols + 2 · kv_cols]` (each row `[q | k |
/// v]`); `q` (`[tokens, q_cols]`) receives the rotated queries (as [`rope`]), and the rotated keys
/// and the values of token `t` are stored at cache slot `slots[t]` (as [`write_kv`]; a slot beyond
/// the caches is skipped). One launch instead of a split, two rotations and a KV write.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_kv(
    dev: &CudaDevice,
    qkv: &CudaSlice<bf16>,
    q: &mut CudaSlice<bf16>,
    k_cache: &mut CudaSlice<bf16>,
    v_cache: &mut CudaSlice<bf16>,
    tokens: usize,
    (q_cols, kv_cols, head_dim): (usize, usize, usize),
    positions: &CudaView<'_, u32>,
    slots: &CudaView<'_, u32>,
    inv_freq: &CudaSlice<f32>,
) -> Result<()> {
    check(
        head_dim > 0
            && head_dim % 2 == 0
            && q_cols % head_dim == 0
            && kv_cols % head_dim == 0
            && kv_cols > 0
            && fits_i32(tokens)
            && fits_i32(q_cols + 2 * kv_cols)
            && qkv.len() >= tokens * (q_cols + 2 * kv_cols)
            && q.len() >= tokens * q_cols
            && positions.len() >= tokens
            && slots.len() >= tokens
            && inv_freq.len() >= head_dim / 2,
        || {
            format!(
                "qkv_rope_kv: qkv {} / q {} / positions {} / slots {} / inv_freq {} elements for \
                 tokens={tokens} q_cols={q_cols} kv_cols={kv_cols} head_dim={head_dim}",
                qkv.len(),
                q.len(),
                positions.len(),
                slots.len(),
                inv_freq.len()
            )
        },
    )?;
    if tokens == 0 {
        return Ok(());
    }
    let cache_slots = (k_cache.len().min(v_cache.len()) / kv_cols) as i64;
    let (q_i, kv_i, hd_i) = (q_cols as i32, kv_cols as i32, head_dim as i32);
    let f = dev.function("elementwise", "qkv_rope_kv_bf16")?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(qkv);
    b.arg(q);
    b.arg(k_cache);
    b.arg(v_cache);
    b.arg(positions);
    b.arg(slots);
    b.arg(inv_freq);
    b.arg(&q_i);
    b.arg(&kv_i);
    b.arg(&hd_i);
    b.arg(&cache_slots);
    // A thread per pair of the row (the kernel strides over any remainder).
    let per_token = ((q_cols / 2 + kv_cols) as u32)
        .div_ceil(THREADS)
        .min(65_535);
    // SAFETY: the arguments match the kernel's signature, the buffer sizes were checked and the
    // kernel bounds every slot by cache_slots.
    unsafe { b.launch(config((tokens as u32, per_token, 1))) }?;
    Ok(())
}

/// The geometry of one layer's quantized keys (or values) on the GPU (`kernels/common.cuh`,
/// "Quantized KV cache"): `max_blocks` blocks of [`QuantGeometry::block_bytes`] bytes, each the
/// block's codes `[slot][kv head][head_dim]` (u8) then its scales `[slot][kv head]` (f32). The
/// range is held as a `CudaSlice<bf16>` of [`QuantGeometry::range_len`] elements, so that block
/// tables, mapping on demand and the layer addresses work as for a bf16 cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantGeometry {
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub max_blocks: usize,
}

impl QuantGeometry {
    pub fn of(spec: &KvCacheSpec) -> Self {
        QuantGeometry {
            block_size: spec.block_size,
            n_kv_heads: spec.n_kv_heads,
            head_dim: spec.head_dim,
            max_blocks: spec.max_blocks,
        }
    }

    /// Bytes of one block: a code byte per element and an f32 scale per (slot, KV head).
    pub fn block_bytes(&self) -> usize {
        self.block_size * self.n_kv_heads * KvDtype::Int8.row_bytes(self.head_dim, 2)
    }

    /// Bytes of one layer's keys (or values).
    pub fn range_bytes(&self) -> usize {
        self.max_blocks * self.block_bytes()
    }

    /// The bf16 elements of a slice holding one layer's keys (or values).
    pub fn range_len(&self) -> usize {
        self.range_bytes().div_ceil(2)
    }

    /// Whether the kernels serve this geometry: code rows of a multiple of 16 bytes (16-byte moves),
    /// at most 256 per row (two groups of four per lane of a warp), and `block_size · n_kv_heads`
    /// a multiple of 4 so that every block, code row and scale stays aligned.
    pub fn is_supported(&self) -> bool {
        self.block_size > 0
            && self.n_kv_heads > 0
            && self.head_dim > 0
            && self.head_dim.is_multiple_of(16)
            && self.head_dim <= 256
            && (self.block_size * self.n_kv_heads).is_multiple_of(4)
            && [self.block_size, self.n_kv_heads, self.head_dim]
                .iter()
                .all(|&v| fits_i32(v))
    }

    /// Whether `k_cache` and `v_cache` each hold a whole range.
    fn fits(&self, k_cache: &CudaSlice<bf16>, v_cache: &CudaSlice<bf16>) -> bool {
        2 * k_cache.len().min(v_cache.len()) >= self.range_bytes()
    }

    /// The kernels' `(n_kv_heads, head_dim, block_size, cache_slots)` arguments.
    fn args(&self) -> (i32, i32, i32, i64) {
        (
            self.n_kv_heads as i32,
            self.head_dim as i32,
            self.block_size as i32,
            (self.max_blocks * self.block_size) as i64,
        )
    }
}

/// The kernel of `dtype`: `q8` for INT8, `f8` for FP8; an error for an unquantized dtype.
fn quant_kernel(
    what: &str,
    dtype: KvDtype,
    q8: &'static str,
    f8: &'static str,
) -> Result<&'static str> {
    check(dtype.is_quantized(), || {
        format!("{what}: {dtype} is not a quantized KV dtype")
    })?;
    Ok(if dtype == KvDtype::Int8 { q8 } else { f8 })
}

/// [`qkv_rope_kv`] into a quantized cache: `q` receives the same rotated queries; the rotated keys
/// (rounded to bf16 as [`qkv_rope_kv`] stores them) and the values of token `t` are quantized per
/// (token, KV head) row as `turbo_attention::kv_quant::quantize_row` does, bit for bit, and stored
/// at slot `slots[t]` of the layer ranges `k_cache` and `v_cache` ([`QuantGeometry`]; a slot
/// beyond `max_blocks · block_size` is skipped). One launch, as for bf16: quantizing needs each
/// row's maximum, so a warp takes a whole row. Where the dtype
/// [`rotates_keys`](KvDtype::rotates_keys), each key row is taken to the Hadamard basis before it
/// is quantized (`kv_quant::hadamard_rotate`'s bits), and each query head, rounded to bf16 after
/// RoPE, is rotated too, times `1 / head_dim`, and rounded again.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_kv_quant(
    dev: &CudaDevice,
    dtype: KvDtype,
    qkv: &CudaSlice<bf16>,
    q: &mut CudaSlice<bf16>,
    k_cache: &mut CudaSlice<bf16>,
    v_cache: &mut CudaSlice<bf16>,
    tokens: usize,
    geometry: QuantGeometry,
    q_cols: usize,
    positions: &CudaView<'_, u32>,
    slots: &CudaView<'_, u32>,
    inv_freq: &CudaSlice<f32>,
) -> Result<()> {
    let kernel = quant_kernel(
        "qkv_rope_kv_quant",
        dtype,
        "qkv_rope_kv_q8",
        "qkv_rope_kv_f8",
    )?;
    let (head_dim, kv_cols) = (geometry.head_dim, geometry.n_kv_heads * geometry.head_dim);
    check(
        geometry.is_supported()
            && geometry.fits(k_cache, v_cache)
            && q_cols.is_multiple_of(head_dim)
            && fits_i32(tokens)
            && fits_i32(q_cols + 2 * kv_cols)
            && qkv.len() >= tokens * (q_cols + 2 * kv_cols)
            && q.len() >= tokens * q_cols
            && positions.len() >= tokens
            && slots.len() >= tokens
            && inv_freq.len() >= head_dim / 2,
        || {
            format!(
                "qkv_rope_kv_quant: caches {} / {} / qkv {} / q {} / positions {} / slots {} \
                 / inv_freq {} elements for tokens={tokens} q_cols={q_cols} {geometry:?}",
                k_cache.len(),
                v_cache.len(),
                qkv.len(),
                q.len(),
                positions.len(),
                slots.len(),
                inv_freq.len()
            )
        },
    )?;
    if tokens == 0 {
        return Ok(());
    }
    let q_i = q_cols as i32;
    let (heads_i, hd_i, bs_i, cache_slots) = geometry.args();
    let f = dev.function("elementwise", kernel)?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(qkv);
    b.arg(q);
    b.arg(k_cache);
    b.arg(v_cache);
    b.arg(positions);
    b.arg(slots);
    b.arg(inv_freq);
    b.arg(&q_i);
    b.arg(&heads_i);
    b.arg(&hd_i);
    b.arg(&bs_i);
    b.arg(&cache_slots);
    let hadamard = dtype.rotates_keys(head_dim);
    let hadamard_i = hadamard as i32;
    b.arg(&hadamard_i);
    // A warp per 32 query pairs (per query head when rotating) and per KV row (the kernel
    // strides over any remainder).
    let query_tasks = match hadamard {
        true => q_cols / head_dim,
        false => (q_cols / 2).div_ceil(32),
    };
    let warp_tasks = query_tasks + 2 * geometry.n_kv_heads;
    let per_token = warp_tasks.div_ceil(THREADS as usize / 32).min(65_535) as u32;
    // SAFETY: the arguments match the kernel's signature, the buffer sizes and the geometry were
    // checked, and the kernel bounds every slot by cache_slots.
    unsafe { b.launch(config((tokens as u32, per_token, 1))) }?;
    Ok(())
}

/// `gate = silu(gate) · up` over the first `n` elements.
pub fn silu_mul(
    dev: &CudaDevice,
    gate: &mut CudaSlice<bf16>,
    up: &CudaSlice<bf16>,
    n: usize,
) -> Result<()> {
    binary(dev, "silu_mul_bf16", gate, up, n)
}

/// `x += y` over the first `n` elements.
pub fn add(dev: &CudaDevice, x: &mut CudaSlice<bf16>, y: &CudaSlice<bf16>, n: usize) -> Result<()> {
    binary(dev, "add_bf16", x, y, n)
}

/// An in-place `a = op(a, b)` kernel with the signature `(bf16* a, const bf16* b, long long n)`.
fn binary(
    dev: &CudaDevice,
    kernel: &'static str,
    a: &mut CudaSlice<bf16>,
    b: &CudaSlice<bf16>,
    n: usize,
) -> Result<()> {
    check(a.len() >= n && b.len() >= n, || {
        format!(
            "{kernel}: buffers of {} / {} elements for n={n}",
            a.len(),
            b.len()
        )
    })?;
    if n == 0 {
        return Ok(());
    }
    let n_i = n as i64;
    let f = dev.function("elementwise", kernel)?;
    let mut l = dev.stream.launch_builder(&f);
    l.arg(a);
    l.arg(b);
    l.arg(&n_i);
    // SAFETY: the arguments match the kernel's signature and the buffer sizes were checked.
    unsafe { l.launch(config((grid_for(n.div_ceil(8)), 1, 1))) }?;
    Ok(())
}

/// `out[i] = table[ids[i]]` for `i < n`: token embedding from a `[vocab, dim]` table. An id out of
/// range yields a row of NaN.
pub fn embed(
    dev: &CudaDevice,
    table: &CudaSlice<bf16>,
    ids: &CudaView<'_, u32>,
    n: usize,
    dim: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    let rows = table.len() / dim.max(1);
    gather(dev, "embed", table, ids, n, dim, (0, rows as i64), out)
}

/// [`embed`] from `table`, the rows `part` of a table of `vocab` rows split over the ranks of a
/// tensor-parallel group: ids of the other rows give zeros (a sum over the ranks is then the
/// embedding), ids past `vocab` NaN.
#[allow(clippy::too_many_arguments)]
pub fn embed_part(
    dev: &CudaDevice,
    table: &CudaSlice<bf16>,
    ids: &CudaView<'_, u32>,
    n: usize,
    dim: usize,
    part: std::ops::Range<usize>,
    vocab: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    check(table.len() >= part.len() * dim && part.end <= vocab, || {
        format!(
            "embed_part: table of {} elements for rows {part:?} of {vocab}, dim {dim}",
            table.len()
        )
    })?;
    let bounds = (part.start as i64, vocab as i64);
    gather(dev, "embed_part", table, ids, n, dim, bounds, out)
}

/// Places every rank's part of the logits of a head split over the vocabulary into `out`
/// (`[rows, vocab]`): rank r's `rows` x [`vocab_part`] columns lie row-major at `r * stride` of
/// `parts` (what a NCCL all-gather leaves).
///
/// [`vocab_part`]: turbo_core::comm::vocab_part
pub fn place_vocab_parts(
    dev: &CudaDevice,
    parts: &CudaSlice<f32>,
    stride: usize,
    world: usize,
    rows: usize,
    vocab: usize,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    check(
        world > 0
            && stride >= rows * vocab.div_ceil(world)
            && parts.len() >= world * stride
            && out.len() >= rows * vocab,
        || {
            format!(
                "place_vocab_parts: {} values for {world} parts of stride {stride}, out {} for \
                 {rows} x {vocab}",
                parts.len(),
                out.len()
            )
        },
    )?;
    if rows == 0 {
        return Ok(());
    }
    let blocks = (rows * vocab.div_ceil(world)).div_ceil(256).min(1024) as u32;
    let (rows_i, vocab_i, world_i, stride_i) =
        (rows as i64, vocab as i64, world as i32, stride as i64);
    let f = dev.function("elementwise", "place_vocab_parts_f32")?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(out);
    b.arg(parts);
    b.arg(&rows_i);
    b.arg(&vocab_i);
    b.arg(&world_i);
    b.arg(&stride_i);
    let cfg = LaunchConfig {
        grid_dim: (blocks, world as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; the sizes were checked above and the
    // kernel writes only rows x vocab values of out and reads each part's rows x columns.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Replaces each of the first `n` ids that carries [`CARRIED_TOKEN`] by the token `sampled`
/// holds at the row it names (an id no vocabulary holds when the row is past `sampled`), in
/// place: the tokens of the previous step, which the host does not know yet.
///
/// [`CARRIED_TOKEN`]: turbo_core::backend::CARRIED_TOKEN
pub fn resolve_carried_tokens(
    dev: &CudaDevice,
    ids: &mut CudaViewMut<'_, u32>,
    sampled: &CudaSlice<u32>,
    n: usize,
) -> Result<()> {
    check(
        ids.len() >= n && fits_i32(n) && fits_i32(sampled.len()),
        || {
            format!(
                "resolve_carried_tokens: {} ids for n={n}, {} sampled",
                ids.len(),
                sampled.len()
            )
        },
    )?;
    if n == 0 {
        return Ok(());
    }
    let (n_i, sampled_len) = (n as i32, sampled.len() as i32);
    let f = dev.function("elementwise", "resolve_carried_tokens")?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(ids);
    b.arg(sampled);
    b.arg(&n_i);
    b.arg(&sampled_len);
    // SAFETY: the arguments match the kernel's signature; it touches ids[..n] (checked) and
    // reads sampled only below sampled_len.
    unsafe { b.launch(config((n.div_ceil(THREADS as usize) as u32, 1, 1))) }?;
    Ok(())
}

/// `out[i] = x[rows[i]]` for `i < n`, rows of `cols` elements. A row index out of range yields a
/// row of NaN.
pub fn gather_rows(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    rows: &CudaView<'_, u32>,
    n: usize,
    cols: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    let src_rows = x.len() / cols.max(1);
    gather(
        dev,
        "gather_rows",
        x,
        rows,
        n,
        cols,
        (0, src_rows as i64),
        out,
    )
}

/// `out[i] = src[idx[i] - first]`, zeros for an index below `first` or past `src`'s rows, NaN for
/// one at or past `limit` (`(first, limit)`).
#[allow(clippy::too_many_arguments)]
fn gather(
    dev: &CudaDevice,
    what: &str,
    src: &CudaSlice<bf16>,
    idx: &CudaView<'_, u32>,
    n: usize,
    cols: usize,
    (first, limit): (i64, i64),
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    check(
        cols > 0 && fits_i32(n) && fits_i32(cols) && idx.len() >= n && out.len() >= n * cols,
        || {
            format!(
                "{what}: source {} / indices {} / out {} elements for n={n} cols={cols}",
                src.len(),
                idx.len(),
                out.len()
            )
        },
    )?;
    if n == 0 {
        return Ok(());
    }
    let (n_i, cols_i, src_rows) = (n as i32, cols as i32, (src.len() / cols) as i64);
    let f = dev.function("elementwise", "gather_rows_bf16")?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(out);
    b.arg(src);
    b.arg(idx);
    b.arg(&n_i);
    b.arg(&cols_i);
    b.arg(&src_rows);
    b.arg(&first);
    b.arg(&limit);
    // SAFETY: the arguments match the kernel's signature, the buffer sizes were checked and the
    // kernel bounds every index by src_rows.
    unsafe { b.launch(config((n as u32, 1, 1))) }?;
    Ok(())
}

/// Paged KV write: `k_cache[slots[i] · slot_len + j] = k[i · slot_len + j]` for `i < tokens`,
/// `j < slot_len`, and the same for values. A slot is `block · block_size + offset` in a
/// `[block][slot][kv head][head_dim]` cache, so `slot_len = n_kv_heads · head_dim`. A slot beyond
/// the cache is skipped.
#[allow(clippy::too_many_arguments)]
pub fn write_kv(
    dev: &CudaDevice,
    k_cache: &mut CudaSlice<bf16>,
    v_cache: &mut CudaSlice<bf16>,
    k: &CudaSlice<bf16>,
    v: &CudaSlice<bf16>,
    slots: &CudaView<'_, u32>,
    tokens: usize,
    slot_len: usize,
) -> Result<()> {
    check(
        slot_len > 0
            && fits_i32(tokens)
            && fits_i32(slot_len)
            && k.len() >= tokens * slot_len
            && v.len() >= tokens * slot_len
            && slots.len() >= tokens,
        || {
            format!(
                "write_kv: k {} / v {} / slots {} elements for tokens={tokens} slot_len={slot_len}",
                k.len(),
                v.len(),
                slots.len()
            )
        },
    )?;
    if tokens == 0 {
        return Ok(());
    }
    let cache_slots = (k_cache.len().min(v_cache.len()) / slot_len) as i64;
    let (tokens_i, slot_len_i) = (tokens as i32, slot_len as i32);
    let f = dev.function("elementwise", "write_kv_bf16")?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(k_cache);
    b.arg(v_cache);
    b.arg(k);
    b.arg(v);
    b.arg(slots);
    b.arg(&tokens_i);
    b.arg(&slot_len_i);
    b.arg(&cache_slots);
    // SAFETY: the arguments match the kernel's signature, the buffer sizes were checked and the
    // kernel bounds every slot by cache_slots.
    unsafe { b.launch(config((tokens as u32, 2, 1))) }?;
    Ok(())
}

/// [`write_kv`] into a quantized cache: `k` and `v` are `[tokens, n_kv_heads · head_dim]`; each
/// (token, KV head) row is quantized as `turbo_attention::kv_quant::quantize_row` does, bit for
/// bit, and stored at slot `slots[t]` of the layer ranges `k_cache` and `v_cache`
/// ([`QuantGeometry`]; a slot beyond `max_blocks · block_size` is skipped).
#[allow(clippy::too_many_arguments)]
pub fn write_kv_quant(
    dev: &CudaDevice,
    dtype: KvDtype,
    k_cache: &mut CudaSlice<bf16>,
    v_cache: &mut CudaSlice<bf16>,
    k: &CudaSlice<bf16>,
    v: &CudaSlice<bf16>,
    slots: &CudaView<'_, u32>,
    tokens: usize,
    geometry: QuantGeometry,
) -> Result<()> {
    let kernel = quant_kernel("write_kv_quant", dtype, "write_kv_q8", "write_kv_f8")?;
    let slot_len = geometry.n_kv_heads * geometry.head_dim;
    check(
        geometry.is_supported()
            && geometry.fits(k_cache, v_cache)
            && fits_i32(tokens)
            && k.len() >= tokens * slot_len
            && v.len() >= tokens * slot_len
            && slots.len() >= tokens,
        || {
            format!(
                "write_kv_quant: caches {} / {} / k {} / v {} / slots {} elements for \
                 tokens={tokens} {geometry:?}",
                k_cache.len(),
                v_cache.len(),
                k.len(),
                v.len(),
                slots.len()
            )
        },
    )?;
    if tokens == 0 {
        return Ok(());
    }
    let tokens_i = tokens as i32;
    let (heads_i, hd_i, bs_i, cache_slots) = geometry.args();
    let f = dev.function("elementwise", kernel)?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(k_cache);
    b.arg(v_cache);
    b.arg(k);
    b.arg(v);
    b.arg(slots);
    b.arg(&tokens_i);
    b.arg(&heads_i);
    b.arg(&hd_i);
    b.arg(&bs_i);
    b.arg(&cache_slots);
    // A warp per (token, k | v, KV head) row; the kernel strides over any remainder.
    let warp_rows = tokens * 2 * geometry.n_kv_heads;
    let grid = warp_rows.div_ceil(THREADS as usize / 32).clamp(1, 65_535) as u32;
    // SAFETY: the arguments match the kernel's signature, the buffer sizes and the geometry were
    // checked, and the kernel bounds every slot by cache_slots.
    unsafe { b.launch(config((grid, 1, 1))) }?;
    Ok(())
}

/// Moves a sequence's kept keys, values and scores to its leading key indices in every layer at
/// once (KV eviction): in layer `l`, KV head `h`, key index `kept[(l * n_kv_heads + h) * k + j]`
/// moves to key index `j`, key index `i` living at slot
/// `block_table[i / block_size] * block_size + i % block_size`. `layers` holds the device
/// addresses `[keys | values | scores][layer]` (a scores address of 0: none). Each row of `kept`
/// must be strictly increasing and within the block table ([`turbo_core::KvCompaction::check`]),
/// and the addresses those of a cache with the table's blocks: the kernel trusts both. A
/// quantized cache ([`CompactShape::dtype`], [`QuantGeometry`] layout) moves each kept key's codes
/// and scale together.
pub fn compact_kv(
    dev: &CudaDevice,
    layers: &CudaView<'_, u64>,
    block_table: &CudaView<'_, u32>,
    kept: &CudaView<'_, u32>,
    shape: CompactShape,
) -> Result<()> {
    let CompactShape {
        k,
        block_size,
        n_layers,
        n_kv_heads,
        head_dim,
        dtype,
    } = shape;
    // The quantized kernel moves code rows 16 bytes at a time (QuantGeometry::is_supported).
    let quant_ok = !dtype.is_quantized()
        || (head_dim.is_multiple_of(16) && (block_size * n_kv_heads).is_multiple_of(4));
    check(
        (1..=1024).contains(&head_dim)
            && quant_ok
            && block_size > 0
            && [k, block_size, n_kv_heads, n_layers]
                .iter()
                .all(|&v| fits_i32(v))
            && n_layers <= 65_535
            && layers.len() >= 3 * n_layers
            && kept.len() >= n_layers * n_kv_heads * k,
        || {
            format!(
                "compact_kv: kept {} / table {} / addresses {} for {shape:?}",
                kept.len(),
                block_table.len(),
                layers.len(),
            )
        },
    )?;
    if k == 0 || n_kv_heads == 0 || n_layers == 0 {
        return Ok(());
    }
    let args = [k, block_size, n_layers, n_kv_heads, head_dim].map(|v| v as i32);
    let kernel = match dtype {
        KvDtype::Full => "compact_kv_bf16",
        KvDtype::Int8 | KvDtype::Fp8 => "compact_kv_quant",
    };
    let f = dev.function("elementwise", kernel)?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(layers);
    b.arg(block_table);
    b.arg(kept);
    for a in &args {
        b.arg(a);
    }
    // Rows of keys move in chunks of 512 threads (16 bytes each when head_dim allows), at least
    // one row per chunk; quantized scales 512 per chunk.
    let cfg = LaunchConfig {
        grid_dim: (n_kv_heads as u32, 3, n_layers as u32),
        block_dim: (head_dim.max(512) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's signature; the caller checked the plan against the
    // cache (rows strictly increasing, every key inside the block table, blocks inside the cache)
    // and passed that cache's addresses.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// The shape of one [`compact_kv`]: keys kept per (layer, KV head) and the cache's geometry and
/// storage.
#[derive(Clone, Copy, Debug)]
pub struct CompactShape {
    pub k: usize,
    pub block_size: usize,
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
}

/// SwiGLU of a fused product: `gate_up` is `[rows, 2 · cols]`, each row `[gate | up]`;
/// `out[r, c] = silu(gate[r, c]) · up[r, c]`.
pub fn swiglu(
    dev: &CudaDevice,
    gate_up: &CudaSlice<bf16>,
    rows: usize,
    cols: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    check(
        gate_up.len() >= 2 * rows * cols && out.len() >= rows * cols,
        || {
            format!(
                "swiglu: gate_up {} / out {} elements for rows={rows} cols={cols}",
                gate_up.len(),
                out.len()
            )
        },
    )?;
    if rows * cols == 0 {
        return Ok(());
    }
    let (rows_i, cols_i) = (rows as i64, cols as i64);
    let f = dev.function("elementwise", "swiglu_bf16")?;
    let mut b = dev.stream.launch_builder(&f);
    b.arg(out);
    b.arg(gate_up);
    b.arg(&rows_i);
    b.arg(&cols_i);
    // Rows of a multiple of 8 go 8 values per thread.
    let units = match cols % 8 {
        0 => rows * cols / 8,
        _ => rows * cols,
    };
    // SAFETY: the arguments match the kernel's signature and the buffer sizes were checked.
    unsafe { b.launch(config((grid_for(units), 1, 1))) }?;
    Ok(())
}

/// Splits the columns of `x` (`[rows, ca + cb + cc]`) into `a` (`[rows, ca]`), `b` and `c`.
#[allow(clippy::too_many_arguments)]
pub fn split3(
    dev: &CudaDevice,
    x: &CudaSlice<bf16>,
    rows: usize,
    (ca, cb, cc): (usize, usize, usize),
    a: &mut CudaSlice<bf16>,
    b: &mut CudaSlice<bf16>,
    c: &mut CudaSlice<bf16>,
) -> Result<()> {
    check(
        x.len() >= rows * (ca + cb + cc)
            && a.len() >= rows * ca
            && b.len() >= rows * cb
            && c.len() >= rows * cc,
        || {
            format!(
                "split3: x {} elements for rows={rows} widths=({ca}, {cb}, {cc})",
                x.len()
            )
        },
    )?;
    let n = rows * (ca + cb + cc);
    if n == 0 {
        return Ok(());
    }
    let widths = [rows as i64, ca as i64, cb as i64, cc as i64];
    let f = dev.function("elementwise", "split3_bf16")?;
    let mut l = dev.stream.launch_builder(&f);
    l.arg(a);
    l.arg(b);
    l.arg(c);
    l.arg(x);
    for w in &widths {
        l.arg(w);
    }
    // SAFETY: the arguments match the kernel's signature and the buffer sizes were checked.
    unsafe { l.launch(config((grid_for(n), 1, 1))) }?;
    Ok(())
}
