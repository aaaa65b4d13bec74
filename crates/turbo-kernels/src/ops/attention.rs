//! Causal attention over paged KV (`kernels/attention.cu`), with the semantics of
//! [`turbo_attention::paged_attention`]: each query row attends to its sequence's keys `0..=pos`
//! through the sequence's block table, query head `h` reading KV head `h / (n_heads / n_kv_heads)`.
//!
//! A step's attention is planned once ([`AttentionPlan::new`]: which kernel computes which rows,
//! how keys are split, where states go; all its tables uploaded in one copy) and the plan is run
//! for every layer ([`AttentionPlan::run`]). Three kernels share the work:
//! - Prefill spans (at least [`PREFILL_MIN_ROWS`] query rows of one sequence) with head_dim 64 or
//!   128 go, under [`KvSplit::Auto`], to a tensor-core FlashAttention kernel: one CTA computes 128
//!   consecutive rows of a span for one head, walking the keys in tiles with an online softmax (bf16
//!   in, f32 accumulation). On an sm_90 device with head_dim 128 it is the warpgroup-MMA kernel of
//!   `kernels/attention_sm90a.cu` (wgmma, 128-key tiles gathered by a producer warpgroup, two
//!   consumer warpgroups taking turns on the tensor cores, the softmax of one tile overlapping the
//!   P·V product of the one before; over an 8-bit cache the producer converts each tile's codes
//!   to bf16 and the consumers apply the scales to S and P); elsewhere the `mma.sync` kernels of
//!   `kernels/attention.cu` (see [`PrefillKernel`]).
//! - Every other row (decode rows, short spans) goes to a row kernel: one CTA computes one query
//!   row over one range of its keys, for all the query heads of a KV head at once with tensor cores
//!   (head_dim 64 and 128: each K and V row read once per KV head) or for one query head with CUDA
//!   cores (the other head dimensions). When those rows alone would leave the GPU idle (decode of
//!   few or long sequences), their keys are split into ranges whose states `(o, lse)` go to f32
//!   scratch ("flash-decoding"), merged by the last of a row's CTAs to finish (no second launch);
//!   otherwise each CTA covers all of its row's keys and writes the output directly.
//!
//! - Cascade: when decode rows of several sequences share leading KV blocks (a common prompt prefix
//!   the KV manager shares), [`turbo_attention::cascade::cascade_groups`] finds the groups and
//!   their attention over the shared prefix is one multi-query pass per KV head (the prefill
//!   kernel's body, with the group's rows and query heads as its tile rows), reading each shared
//!   key once for the whole group; each row's own remaining keys go to the row kernel, and the
//!   states are merged as above.
//!
//! A batch may mix all of them: the launches cover disjoint rows (or, with cascade, disjoint keys
//! of a row, merged).

use super::{check, reuse_or_alloc};
use crate::device::{CudaDevice, SideGuard};
use crate::error::Result;
use cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use half::bf16;
use std::ops::Range;
use turbo_attention::{KvDtype, QuerySpan};

/// Shape of one layer's paged KV: `[block][slot in block][kv head][head_dim]` bf16, or with a
/// quantized `dtype` blocks of 8-bit codes in that order followed by the block's f32 scales
/// `[kv head][slot]` (`kernels/common.cuh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
}

impl KvLayout {
    /// Bytes of one block of keys (or values).
    pub fn block_bytes(&self) -> usize {
        self.block_size * self.n_kv_heads * self.dtype.row_bytes(self.head_dim, 2)
    }

    /// Elements of a bf16 range one block takes (a quantized range is passed as bf16 elements
    /// too: two bytes each).
    pub fn block_len(&self) -> usize {
        self.block_bytes() / 2
    }
}

/// A function naming a kernel instantiated per head dimension and cache dtype:
/// `base_d64` (bf16), `base_q8_d64` (INT8), `base_f8_d64` (FP8); `None` for other head dimensions.
macro_rules! kernel_names {
    ($(#[$doc:meta])* $name:ident, $base:literal, [$($hd:literal),+]) => {
        $(#[$doc])*
        fn $name(head_dim: usize, dtype: KvDtype) -> Option<&'static str> {
            Some(match (dtype, head_dim) {
                $((KvDtype::Full, $hd) => concat!($base, "_d", $hd),
                  (KvDtype::Int8, $hd) => concat!($base, "_q8_d", $hd),
                  (KvDtype::Fp8, $hd) => concat!($base, "_f8_d", $hd),)+
                _ => return None,
            })
        }
    };
}

/// How each query row's keys are divided among CTAs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvSplit {
    /// Prefill spans (see [`PREFILL_MIN_ROWS`]) go to the tensor-core prefill kernel; the other
    /// rows are split only when their CTAs would not fill the GPU, into ranges sized so that the
    /// CTAs about fill it (at least [`MIN_AUTO_CHUNK`] keys each).
    Auto,
    /// Every row to a row kernel, one CTA per (row, head group) over all of the row's keys,
    /// writing the output directly.
    Off,
    /// Every row to a row kernel, in ranges of this many keys (at least 1), always merged, also
    /// rows with a single range.
    Chunk(usize),
    /// Every row to a row kernel, in exactly this many ranges (at least 1) of a multiple of 64
    /// keys (trailing ones may be empty), merged when more than one; no cascade. The plan's
    /// launches and table offsets then depend only on the row count and this number, not on the
    /// rows' lengths, so a recorded step can replay it with new tables.
    Fixed(usize),
}

/// Which row kernel computes the rows that are not prefill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowKernel {
    /// Tensor cores with the query heads of a KV head grouped where the head dimension has such a
    /// kernel, else CUDA cores.
    Auto,
    /// CUDA cores, one CTA per query head (every supported head dimension).
    PerHead,
}

/// Choices a plan is made with; the default is what the model uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    pub split: KvSplit,
    pub row_kernel: RowKernel,
    /// Cascade attention over shared prefixes of at least this many keys (`None`: never).
    pub cascade_min_shared: Option<usize>,
    pub prefill_kernel: PrefillKernel,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            split: KvSplit::Auto,
            row_kernel: RowKernel::Auto,
            cascade_min_shared: Some(CASCADE_MIN_SHARED),
            prefill_kernel: PrefillKernel::Auto,
        }
    }
}

/// The shortest shared prefix the default plan computes by cascade. Below it, the prefix is a
/// small part of each row's keys and the extra launch and merge cost about what they save.
pub const CASCADE_MIN_SHARED: usize = 256;
/// The smallest prefix chunk the cascade pass makes when it splits a shared prefix among CTAs.
const CASCADE_MIN_CHUNK: usize = 512;

/// Threads of the row kernels (`ATTN_THREADS`, `DEC_THREADS`: 4 warps).
const ROW_THREADS: u32 = 128;
/// Query heads the grouped decode kernel puts in one CTA (`DEC_ROWS`: one 16-row mma tile).
const GROUPED_ROWS: usize = 16;

/// Dynamic shared memory of the grouped decode kernel: per warp (`DEC_WARPS`), a ring of
/// `DEC_STAGES` stages of 16 keys' K and V rows (bf16), or `DEC_STAGES_Q` stages of their codes
/// and scales.
fn grouped_smem(head_dim: usize, dtype: KvDtype) -> usize {
    match dtype {
        KvDtype::Full => 4 * 3 * 2 * 16 * head_dim * 2,
        KvDtype::Int8 | KvDtype::Fp8 => 4 * 4 * (2 * 16 * head_dim + 2 * 16 * 4),
    }
}
/// Words of a row kernel's work item (see `kernels/attention.cu`).
const ROW_ITEM: usize = 8;
/// The smallest key range [`KvSplit::Auto`] makes: below it, a CTA's fixed costs (loading Q,
/// merging its warps' states) and the merge pass cost more than the parallelism gains.
pub const MIN_AUTO_CHUNK: usize = 256;
/// Key ranges are whole multiples of this: the grouped kernel's four warps take 16 keys each in
/// turn, so a multiple of 64 keeps them evenly loaded.
const CHUNK_ALIGN: usize = 64;
/// Waves of resident CTAs [`KvSplit::Auto`] aims for when it splits: one, of chunks as long as
/// possible (on an H100 a CTA streams its keys at a fraction of the bandwidth its SM share allows
/// until it has several steps in flight, so short chunks cost more than a second wave saves).
const AUTO_WAVES: usize = 1;
/// What a CTA of the cascade pass costs beyond its keys, in keys of its walk: its Q load, the
/// pipeline's fill and its state writes.
const CASCADE_CTA_COST: usize = 256;
/// What one more prefix chunk costs the merge, in keys of a CTA's walk: one more state per row.
const CASCADE_CHUNK_COST: usize = 32;
/// A state slot meaning "write the output directly" (`ATTN_NO_STATE`).
const NO_STATE: u32 = u32::MAX;

/// What a row-kernel CTA costs beyond its keys, in keys of its walk: its Q load, the pipeline's
/// fill, its state write and its share of the merge.
const ROW_CTA_COST: usize = 256;

/// The time of a split, in keys of one CTA's walk: whole waves of `ctas` CTAs over `slots`
/// resident ones, each as long as a `chunk`. A few CTAs past a wave make a wave of their own,
/// which costs a whole chunk however few they are.
fn split_cost(ctas: usize, slots: usize, chunk: usize) -> usize {
    ctas.div_ceil(slots.max(1)) * (chunk + ROW_CTA_COST)
}

/// The chunk that fills `AUTO_WAVES` waves of `slots` resident CTAs when `key_ctas` keys (summed
/// over CTAs) divide evenly.
fn fill_chunk(key_ctas: usize, slots: usize) -> usize {
    key_ctas
        .div_ceil(slots * AUTO_WAVES)
        .max(MIN_AUTO_CHUNK)
        .next_multiple_of(CHUNK_ALIGN)
}

/// The key range [`KvSplit::Auto`] splits row-kernel rows into, if it splits them: `grid_y`
/// CTAs per range, `row_keys` each row's keys. Rows split only when their CTAs do not fill the
/// GPU; the chunk is the one of least [`split_cost`] among those that cut the longest row into
/// at most as many ranges as an even fill of the resident CTAs would (rounding each row up to
/// whole chunks can otherwise spill a few CTAs into a second wave).
fn auto_chunk(
    sms: usize,
    grouped: bool,
    grid_y: usize,
    row_keys: impl Iterator<Item = usize> + Clone,
) -> Option<usize> {
    // Resident CTAs per SM: the grouped kernel is built for 2 (its registers), the per-head one
    // for 4.
    let resident = if grouped { 2 } else { 4 };
    let slots = sms * resident;
    if row_keys.clone().count() * grid_y >= slots {
        return None;
    }
    let max_keys = row_keys.clone().max().unwrap_or(0);
    let fill = fill_chunk(row_keys.clone().sum::<usize>() * grid_y, slots);
    if fill >= max_keys {
        return None;
    }
    let ctas = |c: usize| row_keys.clone().map(|k| k.div_ceil(c)).sum::<usize>() * grid_y;
    let c = (1..=max_keys.div_ceil(fill))
        .map(|r| {
            max_keys
                .div_ceil(r)
                .max(MIN_AUTO_CHUNK)
                .next_multiple_of(CHUNK_ALIGN)
        })
        .min_by_key(|&c| split_cost(ctas(c), slots, c))?;
    (c < max_keys).then_some(c)
}

/// How many key ranges [`KvSplit::Auto`]'s even fill would split the longest row of a decode step
/// into (1: none), for a step of `rows` decode rows with the grouped kernel, whose rows hold
/// `total_keys` keys together and at most `max_keys` each: what a step recorded with
/// [`KvSplit::Fixed`] uses (rounded up to a power of two by the caller). Whole-wave choices as
/// [`auto_chunk`] makes them were measured 2% slower for scored decode steps of 13 rows of 4k
/// keys (docs/perf/h100.md), so recorded steps keep this rule.
pub fn decode_split(
    dev: &CudaDevice,
    rows: usize,
    n_heads: usize,
    n_kv_heads: usize,
    total_keys: usize,
    max_keys: usize,
) -> usize {
    let grid_y = n_kv_heads * (n_heads / n_kv_heads.max(1)).div_ceil(GROUPED_ROWS);
    let slots = dev.sm_count() * 2;
    if rows * grid_y >= slots || max_keys == 0 {
        return 1;
    }
    max_keys.div_ceil(fill_chunk(total_keys * grid_y, slots))
}

/// Head dimensions with a grouped (tensor-core) decode kernel.
pub const GROUPED_HEAD_DIMS: [usize; 2] = [64, 128];

/// Head dimensions the attention kernels are instantiated for.
pub const SUPPORTED_HEAD_DIMS: [usize; 6] = [32, 64, 96, 128, 192, 256];

/// Query rows a span needs for [`KvSplit::Auto`] to send it to the prefill kernel (with head_dim
/// 64 or 128). Shorter spans (decode rows, small speculative or chunked steps) stay with the row
/// kernel, where the prefill kernel's 128-row CTAs would be mostly empty; the threshold is a
/// choice, not a measured crossover.
pub const PREFILL_MIN_ROWS: usize = 16;

/// Which kernel computes prefill spans and cascade prefixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillKernel {
    /// Warpgroup MMA (`kernels/attention_sm90a.cu`) on an sm_90 device with head_dim 128, else
    /// the `mma.sync` kernels.
    Auto,
    /// The `mma.sync` kernels of `kernels/attention.cu` (every device from Ampere on).
    MmaSync,
}

/// A prefill kernel and its launch shape (`ATTN_PREFILL_KERNEL` in `kernels/attention.cu`, the
/// `WG_*` constants of `kernels/attention_sm90a.cu`; the two sides must agree).
#[derive(Clone, Copy, Debug)]
struct PrefillShape {
    module: &'static str,
    /// The prefill kernel; `shared` is its cascade (shared-prefix) twin, same shape.
    prefill: &'static str,
    shared: &'static str,
    threads: u32,
    /// Query rows per CTA.
    rows: usize,
    /// Dynamic shared memory, bytes.
    smem: usize,
    /// CTAs an SM runs at once (registers and shared memory allowing).
    ctas_per_sm: usize,
}

/// Dynamic shared memory of `attn_prefill<HD, WARPS, MT, BN, KIND>` (`pf_smem_bytes`): K and V
/// tiles and the Q tile, Q sharing V's space when it is only read once (one m-tile per warp), and
/// with a quantized cache the K tile's scales.
fn mma_sync_smem(
    head_dim: usize,
    (warps, m_tiles, key_tile): (usize, usize, usize),
    dtype: KvDtype,
) -> usize {
    let q = 16 * warps * m_tiles;
    let tiles = if m_tiles == 1 {
        key_tile + q.max(key_tile)
    } else {
        q + 2 * key_tile
    };
    let scales = match dtype {
        KvDtype::Full => 0,
        KvDtype::Int8 | KvDtype::Fp8 => key_tile * 4,
    };
    tiles * head_dim * 2 + scales
}

/// The prefill kernel for a head dimension on this device, if there is one (the `mma.sync`
/// shapes are those measured fastest on an H100; see `kernels/attention.cu`).
fn prefill_shape(
    dev: &CudaDevice,
    head_dim: usize,
    choice: PrefillKernel,
    dtype: KvDtype,
) -> Option<PrefillShape> {
    if head_dim == 128 && choice == PrefillKernel::Auto && dev.supports_module("attention_sm90a") {
        // A producer warpgroup and two consumer warpgroups of 64 rows; Q and two stages of K
        // and V, 128 x 128 bf16 each, and the stages' nine barriers (`WG_SMEM`). An 8-bit cache
        // adds each K stage's key and value scales and a staging area for one tile's codes and
        // scales (`WG_SMEM_QUANT`).
        let tiles = 5 * 128 * 128 * 2 + 9 * 8;
        let quant = 2 * (2 * 128 * 4) + (2 * 128 * 128 + 2 * 128 * 4);
        let (prefill, shared, smem) = match dtype {
            KvDtype::Full => ("attn_prefill_wg_d128", "attn_shared_wg_d128", tiles),
            KvDtype::Int8 => (
                "attn_prefill_wg_q8_d128",
                "attn_shared_wg_q8_d128",
                tiles + quant,
            ),
            KvDtype::Fp8 => (
                "attn_prefill_wg_f8_d128",
                "attn_shared_wg_f8_d128",
                tiles + quant,
            ),
        };
        return Some(PrefillShape {
            module: "attention_sm90a",
            prefill,
            shared,
            threads: 384,
            rows: 128,
            smem,
            ctas_per_sm: 1,
        });
    }
    // (warps, 16-row m-tiles per warp, keys per tile)
    let (prefill, shared, warps, m_tiles, key_tile) = match (dtype, head_dim) {
        (KvDtype::Full, 64) => ("attn_prefill_d64", "attn_shared_d64", 4, 2, 64),
        (KvDtype::Full, 128) => ("attn_prefill_d128", "attn_shared_d128", 4, 2, 32),
        (KvDtype::Int8, 64) => ("attn_prefill_q8_d64", "attn_shared_q8_d64", 4, 2, 64),
        (KvDtype::Int8, 128) => ("attn_prefill_q8_d128", "attn_shared_q8_d128", 4, 2, 32),
        (KvDtype::Fp8, 64) => ("attn_prefill_f8_d64", "attn_shared_f8_d64", 4, 2, 64),
        (KvDtype::Fp8, 128) => ("attn_prefill_f8_d128", "attn_shared_f8_d128", 4, 2, 32),
        _ => return None,
    };
    Some(PrefillShape {
        module: "attention",
        prefill,
        shared,
        threads: 32 * warps as u32,
        rows: 16 * warps * m_tiles,
        smem: mma_sync_smem(head_dim, (warps, m_tiles, key_tile), dtype),
        // `__launch_bounds__(.., 2)`.
        ctas_per_sm: 2,
    })
}

/// How many chunks the cascade pass splits a shared prefix of `len` keys into, for `tiles` CTAs per
/// chunk (row tiles times KV heads) on `slots` concurrent CTAs: the count (each chunk at least
/// [`CASCADE_MIN_CHUNK`] keys) with the least time, counted as waves of CTAs times what each
/// costs (its keys and [`CASCADE_CTA_COST`]), plus [`CASCADE_CHUNK_COST`] per chunk. Whole waves
/// matter: the CTAs of this pass are equally long, so a last wave a few CTAs deep costs as much
/// as a full one.
fn cascade_chunks(tiles: usize, len: usize, slots: usize) -> usize {
    let most = len.div_ceil(CASCADE_MIN_CHUNK).max(1);
    (1..=most)
        .min_by_key(|&c| {
            let waves = (tiles * c).div_ceil(slots.max(1));
            waves * (len.div_ceil(c) + CASCADE_CTA_COST) + c * CASCADE_CHUNK_COST
        })
        .unwrap_or(1)
}

kernel_names!(
    /// The per-head (CUDA-core) row kernel for a head dimension.
    per_head_kernel, "attn_chunk", [32, 64, 96, 128, 192, 256]
);
kernel_names!(
    /// The grouped (tensor-core) decode kernel for a head dimension, if there is one.
    grouped_kernel, "attn_decode", [64, 128]
);
kernel_names!(
    /// The grouped decode kernel that also writes the scaled logits of chosen rows.
    grouped_logits_kernel, "attn_decode_logits", [64, 128]
);

/// The most logits a plan writes for KV eviction scores (256 MiB of f32): a step of longer or
/// more scored decode rows scores the rest from the cached keys, so that the scratch stays small
/// beside the KV cache.
pub const MAX_LOGITS: usize = 1 << 26;

/// What the decode kernel writes of a span's logits x = scale q.k for the KV eviction scores:
/// f(x), and per row and head the normaliser logsumexp_j f(x_j) (turbo_keyformer's score
/// functions: Keyformer's Gumbel noise is drawn in the kernel, by the same counter as the CPU's).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LogitScoring {
    /// f(x) = x (H2O).
    Softmax,
    /// f(x) = (x + g) / tau, g the Gumbel draw of (seed, the row's position, layer, head, key);
    /// the span's first row is at `position`, the next ones follow.
    GumbelSoftmax { tau: f32, seed: u64, position: u32 },
}

/// The distance in floats between two rows of a span's logits of `kv_len` keys: even, so that
/// the decode kernel writes a lane's two adjacent keys as one 8-byte store (every span's logits
/// then start even too).
pub fn logit_row_stride(kv_len: usize) -> usize {
    kv_len + (kv_len & 1)
}

/// Words per query row of the logit table (`kernels/attention.cu`, attn_decode_logits_d*).
const LOGIT_WORDS: usize = 8;

/// Threads of `attn_logits_gumbel` (`GUMBEL_THREADS` in kernels/attention.cu).
const GUMBEL_THREADS: u32 = 512;

/// Where the row kernel writes f(x) of the logits of the rows asked for (the KV eviction scores'
/// input): span `s`'s are `[row][n_heads][logit_row_stride(kv_len)]` f32 from `bases[s]`, each
/// row filling the keys it sees; and each row's normalisers.
#[derive(Debug)]
struct LogitRows {
    /// Per span, the offset of its logits in the buffer, or `None` (not written).
    bases: Vec<Option<u32>>,
    /// Per query row, [`LOGIT_WORDS`] words: its logits' offset (`NO_STATE` for none), row stride,
    /// function, tau, seed, position and the keys the row sees.
    at: Range<usize>,
    /// The query rows whose scores are a Gumbel softmax, whose f(x) and normaliser a pass after
    /// the attention writes (`attn_logits_gumbel`), one u32 token index each: every row of a plan
    /// with a fixed split (a recorded step replays the pass for whichever rows are Gumbel then),
    /// else just those (a prompt chunk's thousands of rows are not walked). `None` without any.
    gumbel_rows: Option<Range<usize>>,
}

/// A row kernel's launch: its work items, and how many CTAs each item takes (`grid.y`).
#[derive(Debug)]
struct RowLaunch {
    kernel: &'static str,
    /// Dynamic shared memory, bytes.
    smem: usize,
    items: Range<usize>,
    n_items: usize,
    grid_y: usize,
}

/// The prefill kernel's launch.
#[derive(Debug)]
struct PrefillLaunch {
    kernel: PrefillShape,
    items: Range<usize>,
    ctas: usize,
}

/// The cascade pass's launch (`attn_shared_d*`): items of 8 u32, the query rows of every group
/// (flattened rows `f` are row `shared_tokens[f / group]`, head `f % group` of the item's KV head),
/// and each row's first state slot.
#[derive(Debug)]
struct SharedLaunch {
    kernel: PrefillShape,
    items: Range<usize>,
    n_items: usize,
    shared_tokens: Range<usize>,
    token_state: Range<usize>,
}

/// One step's attention, planned once and run for every layer: which kernel computes which query
/// rows, how their keys are split, and where partial states go, with all of it (block tables
/// included) uploaded to the device in one copy.
pub struct AttentionPlan {
    /// First, so that it is dropped first: the noise pass may run on the side stream.
    _side: SideGuard,
    layout: KvLayout,
    n_heads: usize,
    n_tokens: usize,
    /// Cache blocks the plan's tables may name (checked when planning).
    n_blocks: usize,
    meta: CudaSlice<u32>,
    tables: Range<usize>,
    seq_table_start: Range<usize>,
    prefill: Option<PrefillLaunch>,
    shared: Option<SharedLaunch>,
    rows: Option<RowLaunch>,
    logit_rows: Option<LogitRows>,
    /// The logits of `logit_rows` (one element when unused).
    logits: CudaSlice<f32>,
    /// `[n_tokens][n_heads]` normalisers of the rows of `logit_rows`, and their partial
    /// (max, sum) pairs per state slot of split rows (one element each when unused).
    score_lse: CudaSlice<f32>,
    part_score: CudaSlice<f32>,
    /// `[slot][n_heads][head_dim]` and `[slot][n_heads]` partial states (one element when unused).
    part_o: CudaSlice<f32>,
    part_lse: CudaSlice<f32>,
    /// The row kernels' count of finished ranges per split row and `grid.y`, which the last range
    /// resets: all zero between launches.
    merge_counts: CudaSlice<u32>,
}

/// Host-side tables of a plan, concatenated into one upload.
#[derive(Default)]
struct Meta(Vec<u32>);

impl Meta {
    /// Appends a section, starting 32 bytes aligned: kernels read work items as `uint4`s, and a
    /// row kernel's 8-word item then lies in one 32-byte sector (the upload itself is aligned far
    /// more).
    fn push(&mut self, data: &[u32]) -> Range<usize> {
        self.0.resize(self.0.len().next_multiple_of(8), 0);
        let start = self.0.len();
        self.0.extend_from_slice(data);
        start..self.0.len()
    }
}

impl AttentionPlan {
    /// Plans causal attention of `n_tokens` query rows grouped by `spans` over a paged cache of
    /// `n_blocks` blocks of `layout`. As in the CPU reference, a row that no span covers is treated
    /// as position 0 of the first span's sequence.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dev: &CudaDevice,
        layout: KvLayout,
        n_heads: usize,
        n_tokens: usize,
        spans: &[QuerySpan],
        n_blocks: usize,
        options: PlanOptions,
    ) -> Result<Self> {
        let reuse = None;
        let plan = Self::new_reusing(
            dev,
            layout,
            n_heads,
            n_tokens,
            spans,
            n_blocks,
            options,
            &[],
            reuse,
        )?;
        Ok(plan.0)
    }

    /// [`AttentionPlan::new`], keeping the device buffers of `reuse` (an earlier plan) where they
    /// are large enough; also says whether any buffer was replaced (which a recorded launch of
    /// the earlier plan would not follow).
    ///
    /// `logit_scoring` (per span, or empty) asks for f(x) of the scaled logits of a span's rows
    /// and their normalisers: the plan writes them for the spans the grouped decode kernel
    /// computes whole (fewer than [`PREFILL_MIN_ROWS`] rows, head_dim 64 or 128, up to 2^26
    /// logits in all; such spans then take no part in cascade), see
    /// [`AttentionPlan::logit_base`] and [`AttentionPlan::scored_logits`].
    #[allow(clippy::too_many_arguments)]
    pub fn new_reusing(
        dev: &CudaDevice,
        layout: KvLayout,
        n_heads: usize,
        n_tokens: usize,
        spans: &[QuerySpan],
        n_blocks: usize,
        options: PlanOptions,
        logit_scoring: &[Option<LogitScoring>],
        reuse: Option<AttentionPlan>,
    ) -> Result<(Self, bool)> {
        // The side stream may still read the tables and logits this plan reuses.
        dev.join_side()?;
        let KvLayout {
            block_size,
            n_kv_heads,
            head_dim,
            dtype,
        } = layout;
        check(per_head_kernel(head_dim, dtype).is_some(), || {
            format!(
                "paged_attention: head_dim {head_dim} unsupported (32, 64, 96, 128, 192 or 256)"
            )
        })?;
        // Quantized rows start 16-byte aligned (see `kernels/common.cuh`).
        check(
            dtype == KvDtype::Full || (block_size * n_kv_heads).is_multiple_of(4),
            || {
                format!(
                    "paged_attention: a {dtype} cache needs block_size x n_kv_heads to be a \
                     multiple of 4 (block_size {block_size}, {n_kv_heads} KV heads)"
                )
            },
        )?;
        check(
            block_size > 0
                && n_kv_heads > 0
                && n_heads > 0
                && n_heads.is_multiple_of(n_kv_heads)
                && n_heads <= 65535
                && block_size <= i32::MAX as usize,
            || {
                format!(
                    "paged_attention: {n_heads} query heads, {n_kv_heads} KV heads, block size {block_size}"
                )
            },
        )?;
        check(n_tokens <= i32::MAX as usize, || {
            format!("paged_attention: {n_tokens} query rows")
        })?;
        check(n_tokens == 0 || !spans.is_empty(), || {
            format!("paged_attention: {n_tokens} query rows but no spans")
        })?;
        let fits_u32 = |n: usize| u32::try_from(n).is_ok();

        // Each row's sequence and position; rows no span covers stay (0, 0), as in the CPU
        // reference.
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
        let mut meta = Meta::default();
        let mut tables: Vec<u32> = Vec::new();
        let mut starts = Vec::with_capacity(spans.len());
        for (s, span) in spans.iter().enumerate() {
            let table = span.block_table;
            check(needed[s] <= table.len(), || {
                format!(
                    "paged_attention: span {s} reaches {} blocks, its table has {}",
                    needed[s],
                    table.len()
                )
            })?;
            check(fits_u32(tables.len()), || {
                "paged_attention: block tables too long".to_string()
            })?;
            starts.push(tables.len() as u32);
            for &b in &table[..needed[s]] {
                check((b as usize) < n_blocks, || {
                    format!("paged_attention: span {s} names block {b}, the cache has {n_blocks}")
                })?;
                tables.push(b);
            }
        }
        let fixed = match options.split {
            KvSplit::Fixed(ranges) => {
                check(ranges >= 1, || {
                    "paged_attention: a fixed split into 0 ranges".to_string()
                })?;
                // Sections sized by the rows alone: one table start per row.
                starts.resize(starts.len().max(n_tokens), 0);
                Some(ranges)
            }
            _ => None,
        };
        let seq_table_start = meta.push(&starts);

        // Prefill spans: under Auto, with a prefill kernel for this head_dim, the spans of at least
        // PREFILL_MIN_ROWS rows that still own all of their rows (where spans overlap, the last one
        // wins, as in the CPU reference), cut into items of up to the kernel's rows per CTA:
        // [first row, rows, position of the first row, sequence].
        // (The kernel addresses cache rows, block · block_size + slot, as u32, with !0 for none.)
        let prefill_kernel = prefill_shape(dev, head_dim, options.prefill_kernel, dtype)
            .filter(|_| n_blocks.saturating_mul(block_size) < u32::MAX as usize);
        let prefill_choice = prefill_kernel.filter(|_| options.split == KvSplit::Auto);
        let mut in_prefill = vec![false; n_tokens];
        let mut prefill = None;
        if let Some(pk) = prefill_choice {
            let rows_per_item = pk.rows;
            let mut items: Vec<[u32; 4]> = Vec::new();
            for (s, span) in spans.iter().enumerate() {
                let rows = span.q_start..span.q_start + span.n_q;
                if span.n_q < PREFILL_MIN_ROWS
                    || token_seq[rows.clone()].iter().any(|&x| x as usize != s)
                {
                    continue;
                }
                in_prefill[rows].fill(true);
                for i0 in (0..span.n_q).step_by(rows_per_item) {
                    items.push([
                        (span.q_start + i0) as u32,
                        (span.n_q - i0).min(rows_per_item) as u32,
                        (span.kv_len - span.n_q + i0) as u32,
                        s as u32,
                    ]);
                }
            }
            if !items.is_empty() {
                // Most keys first, so that the last wave of CTAs is made of the short items.
                items.sort_by_key(|it| std::cmp::Reverse(it[1] + it[2]));
                let ctas = items.len() * n_heads;
                check(ctas <= i32::MAX as usize, || {
                    format!("paged_attention: {ctas} prefill CTAs")
                })?;
                let flat: Vec<u32> = items.iter().flatten().copied().collect();
                prefill = Some(PrefillLaunch {
                    kernel: pk,
                    items: meta.push(&flat),
                    ctas,
                });
            }
        }

        // The rows left to a row kernel, and the kernel.
        let row_tokens: Vec<u32> = (0..n_tokens as u32)
            .filter(|&t| !in_prefill[t as usize])
            .collect();
        let group = n_heads / n_kv_heads;
        let grouped = match options.row_kernel {
            RowKernel::Auto => grouped_kernel(head_dim, dtype),
            RowKernel::PerHead => None,
        };
        let (kernel, grid_y) = match grouped {
            Some(k) => (k, n_kv_heads * group.div_ceil(GROUPED_ROWS)),
            None => (
                per_head_kernel(head_dim, dtype).expect("checked above"),
                n_heads,
            ),
        };
        let keys = |t: u32| token_pos[t as usize] as usize + 1;
        let sms = dev.sm_count();

        // Spans whose logits the row kernel writes: whole spans of the grouped kernel.
        let mut logit_bases: Vec<Option<u32>> = vec![None; spans.len()];
        let mut logit_len = 0usize;
        if grouped.is_some() {
            for (s, span) in spans.iter().enumerate() {
                let rows = span.q_start..span.q_start + span.n_q;
                if logit_scoring.get(s).copied().flatten().is_none()
                    || span.n_q == 0
                    || span.n_q >= PREFILL_MIN_ROWS
                    || in_prefill[rows.clone()].iter().any(|&p| p)
                    || token_seq[rows].iter().any(|&x| x as usize != s)
                {
                    continue;
                }
                let need = span.n_q * n_heads * logit_row_stride(span.kv_len);
                if logit_len + need > MAX_LOGITS {
                    // Past the bound the span's scores read the keys instead.
                    continue;
                }
                logit_bases[s] = Some(logit_len as u32);
                logit_len += need;
            }
        }
        let has_logits = logit_bases.iter().any(|b| b.is_some());

        // Cascade groups among the spans left to the row kernels (those that own all their rows):
        // per row, the shared keys its states start after, and how many prefix chunks precede
        // its own states.
        let mut shared_keys = vec![0usize; n_tokens];
        let mut prefix_chunks = vec![0usize; n_tokens];
        let mut shared_plan: Vec<(Vec<u32>, usize, usize, usize)> = Vec::new(); // rows, len, chunks, seq
        let shared_kernel = prefill_kernel;
        if let (Some(min_shared), Some(pk), None) =
            (options.cascade_min_shared, shared_kernel, fixed)
        {
            let candidates: Vec<usize> = (0..spans.len())
                .filter(|&s| {
                    let span = &spans[s];
                    let rows = span.q_start..span.q_start + span.n_q;
                    span.n_q > 0
                        && logit_bases[s].is_none()
                        && !in_prefill[rows.clone()].iter().any(|&p| p)
                        && token_seq[rows].iter().all(|&x| x as usize == s)
                })
                .collect();
            let sub: Vec<QuerySpan> = candidates.iter().map(|&s| spans[s]).collect();
            let groups =
                turbo_attention::cascade::cascade_groups(&sub, block_size, min_shared.max(1));
            for g in groups {
                let members: Vec<usize> = g.members.iter().map(|&i| candidates[i]).collect();
                let rows: Vec<u32> = members
                    .iter()
                    .flat_map(|&s| {
                        let sp = &spans[s];
                        (sp.q_start as u32)..(sp.q_start + sp.n_q) as u32
                    })
                    .collect();
                let tiles = (rows.len() * group).div_ceil(pk.rows) * n_kv_heads;
                let chunks = cascade_chunks(tiles, g.shared_len, sms * pk.ctas_per_sm);
                for &t in &rows {
                    shared_keys[t as usize] = g.shared_len;
                    prefix_chunks[t as usize] = chunks;
                }
                shared_plan.push((rows, g.shared_len, chunks, members[0]));
            }
        }
        // Keys each row leaves to the row kernel.
        let own_keys = |t: u32| keys(t) - shared_keys[t as usize];

        let chunk = match options.split {
            KvSplit::Off | KvSplit::Fixed(_) => None,
            KvSplit::Chunk(c) => {
                check(c >= 1, || "paged_attention: chunks of 0 keys".to_string())?;
                Some(c)
            }
            KvSplit::Auto => auto_chunk(
                sms,
                grouped.is_some(),
                grid_y,
                row_tokens.iter().map(|&t| own_keys(t)),
            ),
        };

        // Work items [row, first key, end key, state slot, table start, first state slot, state
        // count, range count]; rows with several ranges, cascade rows (or all rows under an
        // explicit chunk size) get state slots, contiguous per row (the prefix chunks' first),
        // which the row's last range merges.
        let mut items: Vec<u32> = Vec::new();
        let mut token_state = vec![0u32; n_tokens];
        let mut n_states = 0usize;
        for &t in &row_tokens {
            let (first, n) = (shared_keys[t as usize], keys(t));
            let (c, ranges) = match fixed {
                Some(r) => ((n - first).div_ceil(r).next_multiple_of(CHUNK_ALIGN), r),
                None => {
                    let c = chunk.unwrap_or(n - first).max(1);
                    (c, (n - first).div_ceil(c))
                }
            };
            let prefix = prefix_chunks[t as usize];
            let merged = matches!(options.split, KvSplit::Chunk(_)) || ranges > 1 || prefix > 0;
            // A row is merged in its last range, so a merged row needs one (a cascade row always
            // has keys of its own: its query's position is past the prefix).
            check(ranges > 0, || {
                format!("paged_attention: row {t} has no keys past its shared prefix")
            })?;
            if merged {
                token_state[t as usize] = n_states as u32;
                n_states += prefix;
            }
            for i in 0..ranges {
                let state = if merged {
                    n_states += 1;
                    check(fits_u32(n_states), || {
                        "paged_attention: too many key ranges".to_string()
                    })?;
                    (n_states - 1) as u32
                } else {
                    NO_STATE
                };
                let (k0, k1) = ((first + i * c).min(n), (first + (i + 1) * c).min(n));
                items.extend_from_slice(&[
                    t,
                    k0 as u32,
                    k1 as u32,
                    state,
                    starts[token_seq[t as usize] as usize],
                    token_state[t as usize],
                    (prefix + ranges) as u32,
                    ranges as u32,
                ]);
            }
        }
        let n_items = items.len() / ROW_ITEM;
        check(
            n_items <= i32::MAX as usize && grid_y <= 65535 && fits_u32(meta.0.len() + items.len()),
            || format!("paged_attention: {n_items} work items"),
        )?;
        let kernel = match has_logits {
            true => grouped_logits_kernel(head_dim, dtype).expect("grouped above"),
            false => kernel,
        };
        let rows = (n_items > 0).then(|| RowLaunch {
            kernel,
            smem: if grouped.is_some() {
                grouped_smem(head_dim, dtype)
            } else {
                0
            },
            items: meta.push(&items),
            n_items,
            grid_y,
        });
        // The cascade pass: per group, its rows × query heads in tiles of the kernel's rows, per
        // KV head and prefix chunk.
        let shared = match shared_kernel {
            Some(pk) if !shared_plan.is_empty() => {
                let mut tokens: Vec<u32> = Vec::new();
                let mut sitems: Vec<u32> = Vec::new();
                for (rows, len, chunks, seq) in &shared_plan {
                    let f_base = tokens.len() * group;
                    let flat = rows.len() * group;
                    tokens.extend_from_slice(rows);
                    let csize = len.div_ceil(*chunks);
                    for f0 in (0..flat).step_by(pk.rows) {
                        for kv in 0..n_kv_heads {
                            for c in 0..*chunks {
                                let (k0, k1) = (c * csize, ((c + 1) * csize).min(*len));
                                if k0 >= k1 {
                                    continue;
                                }
                                sitems.extend_from_slice(&[
                                    (f_base + f0) as u32,
                                    (flat - f0).min(pk.rows) as u32,
                                    k0 as u32,
                                    k1 as u32,
                                    *seq as u32,
                                    c as u32,
                                    kv as u32,
                                    0,
                                ]);
                            }
                        }
                    }
                }
                let n_items = sitems.len() / 8;
                check(
                    n_items <= i32::MAX as usize && fits_u32(tokens.len() * group),
                    || format!("paged_attention: {n_items} cascade items"),
                )?;
                Some(SharedLaunch {
                    kernel: pk,
                    items: meta.push(&sitems),
                    n_items,
                    shared_tokens: meta.push(&tokens),
                    token_state: meta.push(&token_state),
                })
            }
            _ => None,
        };
        let logit_rows = match has_logits {
            true => {
                let mut at = vec![0; LOGIT_WORDS * n_tokens];
                let mut gumbel: Vec<u32> = Vec::new();
                for t in 0..n_tokens {
                    at[LOGIT_WORDS * t] = NO_STATE;
                }
                for (s, span) in spans.iter().enumerate() {
                    let Some(base) = logit_bases[s] else { continue };
                    let scoring = logit_scoring[s].expect("spans with logits are scored");
                    for r in 0..span.n_q {
                        let t = span.q_start + r;
                        let (function, tau, seed, position) = match scoring {
                            LogitScoring::Softmax => (1u32, 1.0f32, 0u64, 0u32),
                            LogitScoring::GumbelSoftmax {
                                tau,
                                seed,
                                position,
                            } => {
                                gumbel.push(t as u32);
                                (2, tau, seed, position.wrapping_add(r as u32))
                            }
                        };
                        let stride = logit_row_stride(span.kv_len);
                        at[LOGIT_WORDS * t..LOGIT_WORDS * (t + 1)].copy_from_slice(&[
                            base + (r * n_heads * stride) as u32,
                            stride as u32,
                            function,
                            tau.to_bits(),
                            seed as u32,
                            (seed >> 32) as u32,
                            position,
                            (span.kv_len - span.n_q + r + 1) as u32,
                        ]);
                    }
                }
                if fixed.is_some() && !gumbel.is_empty() {
                    gumbel = (0..n_tokens as u32).collect();
                }
                Some(LogitRows {
                    bases: logit_bases,
                    at: meta.push(&at),
                    gumbel_rows: (!gumbel.is_empty()).then(|| meta.push(&gumbel)),
                })
            }
            false => None,
        };
        // Last, so that every other section's offset is the same for plans of one shape.
        let tables_sec = meta.push(&tables);
        check(fits_u32(meta.0.len()), || {
            "paged_attention: plan too large".to_string()
        })?;

        let slots = n_states.max(1);
        let (old_meta, old_o, old_lse, old_counts, old_logits, old_score) = match reuse {
            Some(p) => (
                Some(p.meta),
                Some(p.part_o),
                Some(p.part_lse),
                Some(p.merge_counts),
                Some(p.logits),
                Some((p.score_lse, p.part_score)),
            ),
            None => (None, None, None, None, None, None),
        };
        let (old_score_lse, old_part_score) = old_score.unzip();
        let (mut meta_dev, m1) = reuse_or_alloc(dev, old_meta, meta.0.len())?;
        dev.stream
            .memcpy_htod(&meta.0, &mut meta_dev.slice_mut(..meta.0.len()))?;
        let (part_o, m2) = reuse_or_alloc(dev, old_o, slots * n_heads * head_dim)?;
        let (part_lse, m3) = reuse_or_alloc(dev, old_lse, slots * n_heads)?;
        // The merge's counts, one per (first state slot, grid.y); zero between launches.
        let (merge_counts, m4) = reuse_or_alloc(dev, old_counts, slots * grid_y)?;
        let (logits, m5) = reuse_or_alloc(dev, old_logits, logit_len)?;
        let (score_lse, part_score, m6) = match has_logits {
            true => {
                let (l, a) = reuse_or_alloc(dev, old_score_lse, n_tokens * n_heads)?;
                let (p, b) = reuse_or_alloc(dev, old_part_score, 2 * slots * n_heads)?;
                (l, p, a || b)
            }
            false => {
                let (l, a) = reuse_or_alloc(dev, old_score_lse, 1)?;
                let (p, b) = reuse_or_alloc(dev, old_part_score, 1)?;
                (l, p, a || b)
            }
        };
        let plan = AttentionPlan {
            _side: dev.side_guard(),
            layout,
            n_heads,
            n_tokens,
            n_blocks,
            meta: meta_dev,
            tables: tables_sec,
            seq_table_start,
            prefill,
            shared,
            rows,
            logit_rows,
            logits,
            score_lse,
            part_score,
            part_o,
            part_lse,
            merge_counts,
        };
        Ok((plan, m1 || m2 || m3 || m4 || m5 || m6))
    }

    /// The kernels the plan runs prefill spans and the cascade pass with, where it has them.
    pub fn prefill_kernels(&self) -> (Option<&'static str>, Option<&'static str>) {
        (
            self.prefill.as_ref().map(|p| p.kernel.prefill),
            self.shared.as_ref().map(|s| s.kernel.shared),
        )
    }

    /// Where span `s`'s scaled logits start in [`AttentionPlan::logits`] after [`AttentionPlan::run`]
    /// (`[row][n_heads][logit_row_stride(kv_len)]`, each row filling the keys it sees), if the
    /// plan writes them.
    pub fn logit_base(&self, s: usize) -> Option<u32> {
        self.logit_rows.as_ref()?.bases.get(s).copied().flatten()
    }

    /// What the last [`AttentionPlan::run`] wrote for the eviction scores: f(x) of the logits
    /// (see [`AttentionPlan::logit_base`]) and the `[n_tokens][n_heads]` normalisers
    /// logsumexp_j f(x_j) of their rows.
    ///
    /// Joins the device's side stream first, where the noise pass may still be running.
    pub fn scored_logits(&self, dev: &CudaDevice) -> Result<(&CudaSlice<f32>, &CudaSlice<f32>)> {
        dev.join_side()?;
        Ok(self.scored_logits_unjoined())
    }

    /// [`AttentionPlan::scored_logits`] for work issued on the side stream after the noise pass.
    pub(crate) fn scored_logits_unjoined(&self) -> (&CudaSlice<f32>, &CudaSlice<f32>) {
        (&self.logits, &self.score_lse)
    }

    /// Query rows whose shared prefix the cascade pass computes (0 without cascade).
    pub fn cascade_rows(&self) -> usize {
        self.shared.as_ref().map_or(0, |sh| sh.shared_tokens.len())
    }

    /// Whether the plan was made for this shape (so that a batch's plan is reused only by layers
    /// it fits).
    pub fn fits(&self, layout: KvLayout, n_heads: usize, n_tokens: usize, n_blocks: usize) -> bool {
        self.layout == layout
            && self.n_heads == n_heads
            && self.n_tokens == n_tokens
            && self.n_blocks <= n_blocks
    }

    /// Runs the planned attention on layer `layer`'s cache: `q` and `out` are `[tokens, n_heads,
    /// head_dim]` bf16; `lse`, when given, receives `[tokens, n_heads]` natural-log sum-exps of the
    /// scaled scores. The layer seeds Keyformer's noise of rows whose logits are scored.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        dev: &CudaDevice,
        q: &CudaSlice<bf16>,
        k_cache: &CudaSlice<bf16>,
        v_cache: &CudaSlice<bf16>,
        scale: f32,
        out: &mut CudaSlice<bf16>,
        mut lse: Option<&mut CudaSlice<f32>>,
        layer: usize,
    ) -> Result<()> {
        let KvLayout {
            block_size,
            n_kv_heads,
            head_dim,
            ..
        } = self.layout;
        let n_heads = self.n_heads;
        let row_len = n_heads * head_dim;
        let n_tokens = self.n_tokens;
        check(
            q.len() >= n_tokens * row_len && out.len() >= n_tokens * row_len,
            || {
                format!(
                    "paged_attention: q has {} and out {} elements for {n_tokens} rows of {row_len}",
                    q.len(),
                    out.len()
                )
            },
        )?;
        if let Some(l) = lse.as_deref() {
            check(l.len() >= n_tokens * n_heads, || {
                format!(
                    "paged_attention: lse has {} elements for {n_tokens} rows of {n_heads}",
                    l.len()
                )
            })?;
        }
        let block_len = self.layout.block_len();
        check(
            k_cache.len().min(v_cache.len()) / block_len >= self.n_blocks,
            || {
                format!(
                    "paged_attention: the cache holds fewer than the {} blocks planned for",
                    self.n_blocks
                )
            },
        )?;
        if n_tokens == 0 {
            return Ok(());
        }

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
        let meta = &self.meta;
        let section = |r: &Range<usize>| -> CudaView<'_, u32> { meta.slice(r.clone()) };
        let tables = section(&self.tables);
        let seq_start = section(&self.seq_table_start);

        if let Some(p) = &self.prefill {
            let items = section(&p.items);
            let (k, smem) = (p.kernel, p.kernel.smem);
            let f = dev.function_with_smem(k.module, k.prefill, smem)?;
            let mut b = dev.stream.launch_builder(&f);
            b.arg(q)
                .arg(k_cache)
                .arg(v_cache)
                .arg(&tables)
                .arg(&seq_start)
                .arg(&items)
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
                grid_dim: (p.ctas as u32, 1, 1),
                block_dim: (k.threads, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            // SAFETY: the arguments match attn_prefill_d*'s parameters; every item's rows lie in
            // one span (so within q and out, checked above), its keys 0..pos+rows are that span's
            // keys, whose blocks were checked against the cache (n_blocks, checked above) when
            // the plan was made and uploaded in its table.
            unsafe { b.launch(cfg)? };
        }

        if let Some(sh) = &self.shared {
            let items = section(&sh.items);
            let tokens = section(&sh.shared_tokens);
            let token_state = section(&sh.token_state);
            let k = sh.kernel;
            let f = dev.function_with_smem(k.module, k.shared, k.smem)?;
            let mut b = dev.stream.launch_builder(&f);
            b.arg(q)
                .arg(k_cache)
                .arg(v_cache)
                .arg(&tables)
                .arg(&seq_start)
                .arg(&items)
                .arg(&n_heads_i)
                .arg(&group)
                .arg(&n_kv_heads_i)
                .arg(&block_size_i)
                .arg(&block_shift)
                .arg(&scale)
                .arg(&tokens)
                .arg(&token_state)
                .arg(&mut self.part_o)
                .arg(&mut self.part_lse);
            let cfg = LaunchConfig {
                grid_dim: (sh.n_items as u32, 1, 1),
                block_dim: (k.threads, 1, 1),
                shared_mem_bytes: k.smem as u32,
            };
            // SAFETY: the arguments match attn_shared_d*'s parameters; every item's flattened rows
            // name rows of q in its group, its keys lie in the group's shared prefix (blocks
            // checked when planning, identical in every member's table), and its state slots
            // (token_state[row] + chunk) were reserved for the row's prefix chunks.
            unsafe { b.launch(cfg)? };
        }

        if let Some(r) = &self.rows {
            if self.logit_rows.is_some() {
                // The previous layer's eviction scores may still be reading the logits on the
                // side stream.
                dev.join_side()?;
            }
            let items = section(&r.items);
            let f = dev.function_with_smem("attention", r.kernel, r.smem)?;
            let mut b = dev.stream.launch_builder(&f);
            b.arg(q)
                .arg(k_cache)
                .arg(v_cache)
                .arg(&tables)
                .arg(&items)
                .arg(&n_heads_i)
                .arg(&group)
                .arg(&n_kv_heads_i)
                .arg(&block_size_i)
                .arg(&block_shift)
                .arg(&scale)
                .arg(&mut self.part_o)
                .arg(&mut self.part_lse)
                .arg(&mut self.merge_counts)
                .arg(&mut *out);
            match lse {
                Some(l) => b.arg(l),
                None => b.arg(&null),
            };
            let logit_at = self.logit_rows.as_ref().map(|l| section(&l.at));
            if let Some(at) = &logit_at {
                b.arg(at)
                    .arg(&mut self.logits)
                    .arg(&mut self.score_lse)
                    .arg(&mut self.part_score);
            }
            let cfg = LaunchConfig {
                grid_dim: (r.n_items as u32, r.grid_y as u32, 1),
                block_dim: (ROW_THREADS, 1, 1),
                shared_mem_bytes: r.smem as u32,
            };
            // SAFETY: the arguments match attn_chunk_d* / attn_decode_d*'s parameters; every
            // item names a row of q and out, a key range within the row's keys (whose blocks were
            // checked when planning), and a state slot below the scratch's size or NO_STATE; its
            // table start is its row's, its row's state slots lie below the scratch's size and
            // its count slot (first slot · grid.y + blockIdx.y) below merge_counts'. With logits
            // (attn_decode_logits_d*), each row's entry names its span's rows × heads × kv_len
            // floats of the logits buffer, sized to all of them when planning, its normalisers
            // are its token's n_heads floats of score_lse (n_tokens × n_heads) and its split
            // states' pairs lie in part_score (2 × slots × n_heads).
            unsafe { b.launch(cfg)? };
        }
        if let Some((at, rows)) = self
            .logit_rows
            .as_ref()
            .and_then(|l| Some((section(&l.at), section(l.gumbel_rows.as_ref()?))))
        {
            let n_rows = rows.len();
            let layer_i = layer as i32;
            let f = dev.function("attention", "attn_logits_gumbel")?;
            // Nothing else of the step reads the noised logits but the scores' key sums, which
            // follow on the same stream ([`crate::ops::scores::ScorePlan::run`]).
            let mut b = dev.fork_side()?.launch_builder(&f);
            b.arg(&at)
                .arg(&rows)
                .arg(&mut self.logits)
                .arg(&mut self.score_lse)
                .arg(&n_heads_i)
                .arg(&layer_i);
            let cfg = LaunchConfig {
                grid_dim: (n_rows as u32, n_heads as u32, 1),
                block_dim: (GUMBEL_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match attn_logits_gumbel's parameters; `rows` names n_rows
            // tokens below n_tokens, and every row's entry names its span's logits (rows × heads
            // × row stride floats of the buffer, sized when planning) with the keys the row sees
            // at most kv_len, and its normalisers are its token's n_heads floats of score_lse; the
            // row kernel, which the side stream waits for, wrote both, and nothing touches them
            // again before the next layer's row kernel joins the side stream.
            unsafe { b.launch(cfg)? };
        }

        Ok(())
    }
}

/// Causal attention of the query rows of `spans` over paged KV, planned and run at once (the model
/// plans once per step instead: [`AttentionPlan`]).
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
    paged_attention_with(
        dev,
        q,
        k_cache,
        v_cache,
        layout,
        n_heads,
        spans,
        scale,
        PlanOptions::default(),
        out,
        lse,
    )
}

/// [`paged_attention`] with explicit planning choices (for tests and tuning; every choice computes
/// the same attention up to f32 rounding).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_with(
    dev: &CudaDevice,
    q: &CudaSlice<bf16>,
    k_cache: &CudaSlice<bf16>,
    v_cache: &CudaSlice<bf16>,
    layout: KvLayout,
    n_heads: usize,
    spans: &[QuerySpan],
    scale: f32,
    options: PlanOptions,
    out: &mut CudaSlice<bf16>,
    lse: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    check(
        layout.n_kv_heads > 0 && layout.head_dim > 0 && layout.block_size > 0 && n_heads > 0,
        || format!("paged_attention: layout {layout:?}, {n_heads} heads"),
    )?;
    let n_tokens = q.len() / (n_heads * layout.head_dim);
    let n_blocks = k_cache.len().min(v_cache.len()) / layout.block_len();
    let mut plan = AttentionPlan::new(dev, layout, n_heads, n_tokens, spans, n_blocks, options)?;
    plan.run(dev, q, k_cache, v_cache, scale, out, lse, 0)
}

/// [`paged_attention`] with an explicit choice of how keys are split among CTAs.
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
    let options = PlanOptions {
        split,
        ..PlanOptions::default()
    };
    paged_attention_with(
        dev, q, k_cache, v_cache, layout, n_heads, spans, scale, options, out, lse,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_splits_do_not_spill_a_few_ctas_into_a_second_wave() {
        // 4 rows of 32k keys, 8 KV heads, 132 SMs of 2 resident CTAs (264 slots). An even fill
        // wants chunks of 4032, which cut each row into 9 ranges: 288 CTAs, 24 of them in a
        // second wave. Eight ranges of 4096 make one wave.
        assert_eq!(
            auto_chunk(132, true, 8, [32768usize; 4].into_iter()),
            Some(4096)
        );
        // 13 rows of 4000: three ranges would make 312 CTAs; two make one wave of 208.
        assert_eq!(
            auto_chunk(132, true, 8, [4000usize; 13].into_iter()),
            Some(2048)
        );
        // One row of 32k: 32 ranges of 1024 fill the slots.
        assert_eq!(
            auto_chunk(132, true, 8, [32768usize].into_iter()),
            Some(1024)
        );
        // Rows that fill the GPU alone are not split, nor rows below MIN_AUTO_CHUNK.
        assert_eq!(auto_chunk(132, true, 8, [4000usize; 33].into_iter()), None);
        assert_eq!(auto_chunk(132, true, 8, [200usize; 2].into_iter()), None);
        assert_eq!(
            auto_chunk(132, true, 8, [1000usize; 2].into_iter()),
            Some(256)
        );
    }

    #[test]
    fn cascade_chunks_fill_whole_waves() {
        // Prefix 32k, 128 rows x 4 heads = 4 row tiles x 8 KV heads, 132 SMs of one CTA: four
        // chunks make one wave of 128 CTAs; seventeen (the old two-waves rule) would leave a
        // fifth wave of 16 CTAs.
        assert_eq!(cascade_chunks(32, 32768, 132), 4);
        // Two CTAs an SM: eight chunks, 256 CTAs in one wave.
        assert_eq!(cascade_chunks(32, 32768, 264), 8);
        // Few tiles: split until the SMs are about full, chunks of at least CASCADE_MIN_CHUNK.
        assert_eq!(cascade_chunks(8, 32768, 132), 16);
        assert_eq!(cascade_chunks(8, 1024, 132), 2);
        // Three waves and a few CTAs unsplit: splitting evens the waves out.
        let c = cascade_chunks(400, 32768, 132);
        let waves = (400 * c).div_ceil(132);
        assert!(c > 1 && waves as f64 * 32768.0 / c as f64 <= 1.1 * 400.0 * 32768.0 / 132.0);
        // Every count is within bounds.
        for (tiles, len, slots) in [(1, 1, 1), (3, 513, 7), (1000, 100_000, 132)] {
            let c = cascade_chunks(tiles, len, slots);
            assert!(c >= 1 && c <= len.div_ceil(CASCADE_MIN_CHUNK).max(1));
        }
    }
}
