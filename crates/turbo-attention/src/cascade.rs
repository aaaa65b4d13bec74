//! Cascade (shared-prefix) attention.
//!
//! When several sequences in a batch start with the same KV blocks (the KV cache shares the blocks
//! of a common prompt prefix), the attention of all their query rows over that prefix reads the
//! same key and value rows. Cascade attention computes it as one multi-query pass that reads each
//! shared row once for all of the group's queries, computes each sequence's own remaining keys
//! separately (as tiles for spans of several rows, like [`crate::paged_attention`]), and merges
//! the two states per (row, head) ([`crate::merge_into`]). The result
//! equals [`crate::paged_attention`] up to f32 rounding.
//!
//! [`cascade_groups`] finds the groups from the block tables alone; [`paged_attention_cascade`]
//! runs a batch with them. Backends call the first once per batch and the second per layer.

use crate::paged::{check_batch, dot, head_kernel, row_positions, Tiled};
use crate::{merge_into, AttentionError, PagedKv, QuerySpan};
use rayon::prelude::*;
use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::ops::Range;

/// A group of spans whose rows all see the same leading keys, held in the same blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CascadeGroup {
    /// Indices into the spans, at least two, ascending.
    pub members: Vec<usize>,
    /// Leading keys every member's rows see in full (a multiple of the block size, > 0): for each
    /// member, its first shared_len / block_size block ids are identical to every other member's,
    /// and kv_len - n_q >= shared_len (so no causal mask falls inside the shared part).
    pub shared_len: usize,
}

/// Groups spans by shared leading blocks (as the KV manager's prefix sharing produces); a span is
/// in at most one group; groups with shared_len < min_shared_len are dropped; deterministic.
///
/// A span can share at most the whole blocks before its first query row, `(kv_len - n_q) /
/// block_size` (and no more than its table holds). Spans are bucketed by their first block id;
/// blocks are content-addressed, so only spans in the same bucket can share anything. Each
/// bucket is then split in rounds. A round takes the bucket's lowest span as reference and
/// measures every member's common block prefix with it (the common prefix of any set of members
/// that includes the reference is the smallest of their measures). Ranked by that measure, the
/// first `k` members share `l_k` blocks; the round keeps the `k >= 2` that saves the most key
/// reads, `(k - 1) · l_k`, among those with `l_k · block_size >= min_shared_len`, so a member that
/// would shrink the common prefix a lot is left out rather than dragging everyone down. The rest
/// of the bucket goes to the next round (without the reference when no group qualified).
///
/// Cost: each round is linear in the compared table prefixes; a bucket takes one round per group
/// it yields or reference it drops. With one shared prompt (and forks of it) that is a small
/// multiple of the total table length.
pub fn cascade_groups(
    spans: &[QuerySpan],
    block_size: usize,
    min_shared_len: usize,
) -> Vec<CascadeGroup> {
    if block_size == 0 {
        return Vec::new();
    }
    let shareable = |s: &QuerySpan| -> usize {
        (s.kv_len.saturating_sub(s.n_q) / block_size).min(s.block_table.len())
    };
    let prefix = |i: usize| &spans[i].block_table[..shareable(&spans[i])];
    let min_blocks = min_shared_len.div_ceil(block_size).max(1);
    let mut buckets: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, span) in spans.iter().enumerate() {
        if shareable(span) >= min_blocks {
            buckets.entry(span.block_table[0]).or_default().push(i);
        }
    }
    let mut groups = Vec::new();
    for mut members in buckets.into_values() {
        while members.len() >= 2 {
            let reference = prefix(members[0]);
            // (blocks shared with the reference, span), most shared first; the reference itself
            // shares its whole prefix, so it ranks first (ties go to the lower index).
            let mut ranked: Vec<(usize, usize)> = members
                .iter()
                .map(|&m| {
                    let own = prefix(m);
                    let common = reference
                        .iter()
                        .zip(own)
                        .take_while(|(a, b)| a == b)
                        .count();
                    (common, m)
                })
                .collect();
            ranked.sort_by_key(|&(common, m)| (Reverse(common), m));
            let mut best: Option<(usize, usize)> = None;
            for k in 2..=ranked.len() {
                let blocks = ranked[k - 1].0;
                if blocks < min_blocks {
                    break;
                }
                let saved = (k - 1) * blocks;
                if best.is_none_or(|(s, _)| saved > s) {
                    best = Some((saved, k));
                }
            }
            match best {
                Some((_, k)) => {
                    let mut chosen: Vec<usize> = ranked[..k].iter().map(|&(_, m)| m).collect();
                    chosen.sort_unstable();
                    groups.push(CascadeGroup {
                        members: chosen,
                        shared_len: ranked[k - 1].0 * block_size,
                    });
                    members = ranked[k..].iter().map(|&(_, m)| m).collect();
                    members.sort_unstable();
                }
                None => {
                    members.remove(0);
                }
            }
        }
    }
    groups.sort_by_key(|g| g.members[0]);
    groups
}

/// Keys of the shared prefix one task covers. Fixed (not derived from the thread count) so that
/// the result does not depend on the machine: chunks are merged, and merging rounds.
const SHARED_CHUNK_KEYS: usize = 256;
/// Fewest queries a shared-prefix task serves when queries are split to occupy more threads:
/// every key row a task reads is reused by at least this many queries.
const MIN_QUERY_TILE: usize = 8;
/// Keys scored together before one online-softmax update: their K and V rows (2 · 32 · head_dim
/// f32, 16 KiB at head_dim 64) stay in L1 while every query of the task visits them.
const KEY_TILE: usize = 32;

/// [`crate::paged_attention`] with the groups' shared prefixes computed once per group (see the
/// module docs); rows of spans in no group take the plain path. `groups` usually comes from
/// [`cascade_groups`] over the same spans and block size.
///
/// # Panics
/// On a malformed batch or group, with the message of [`try_paged_attention_cascade`]'s error.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_cascade(
    q: &[f32],
    n_heads: usize,
    kv: &PagedKv,
    spans: &[QuerySpan],
    groups: &[CascadeGroup],
    scale: f32,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) {
    if let Err(e) = try_paged_attention_cascade(q, n_heads, kv, spans, groups, scale, out, lse) {
        panic!("paged_attention_cascade: {e}");
    }
}

/// [`paged_attention_cascade`], returning an error instead of panicking when the batch does not
/// fit together or a group breaks [`CascadeGroup`]'s invariants.
#[allow(clippy::too_many_arguments)]
pub fn try_paged_attention_cascade(
    q: &[f32],
    n_heads: usize,
    kv: &PagedKv,
    spans: &[QuerySpan],
    groups: &[CascadeGroup],
    scale: f32,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) -> Result<(), AttentionError> {
    let n_tokens = check_batch(q, n_heads, kv, spans, out, lse.as_deref())?;
    check_groups(spans, groups, kv.block_size)?;
    let d = kv.head_dim;
    let per_kv = n_heads / kv.n_kv_heads;
    let rows = row_positions(spans, n_tokens);

    // Each group's query rows in member order, and each grouped row's (group, index in group).
    let mut place: Vec<Option<(usize, usize)>> = vec![None; n_tokens];
    let group_rows: Vec<Vec<usize>> = groups
        .iter()
        .enumerate()
        .map(|(g, group)| {
            let rows: Vec<usize> = group
                .members
                .iter()
                .flat_map(|&m| spans[m].q_start..spans[m].q_start + spans[m].n_q)
                .collect();
            for (r, &row) in rows.iter().enumerate() {
                place[row] = Some((g, r));
            }
            rows
        })
        .collect();

    // Shared prefixes: per group, states `[kv head][chunk][row][head in kv group]`.
    let mut shared: Vec<SharedStates> = groups
        .iter()
        .zip(&group_rows)
        .map(|(group, rows)| {
            let chunks = group.shared_len.div_ceil(SHARED_CHUNK_KEYS);
            let n = kv.n_kv_heads * chunks * rows.len() * per_kv;
            SharedStates {
                chunks,
                o: vec![0.0; n * d],
                lse: vec![0.0; n],
            }
        })
        .collect();
    let base_tasks: usize = shared.iter().map(|s| kv.n_kv_heads * s.chunks).sum();
    let wanted = 2 * rayon::current_num_threads();
    let mut tasks = Vec::new();
    for (g, states) in shared.iter_mut().enumerate() {
        let queries = group_rows[g].len() * per_kv;
        if queries == 0 {
            continue;
        }
        let splits = wanted
            .div_ceil(base_tasks)
            .clamp(1, queries.div_ceil(MIN_QUERY_TILE));
        let tile = queries.div_ceil(splits);
        let chunks = states.chunks;
        for (t, (o, l)) in states
            .o
            .chunks_mut(queries * d)
            .zip(states.lse.chunks_mut(queries))
            .enumerate()
        {
            let (kv_head, chunk) = (t / chunks, t % chunks);
            let k0 = chunk * SHARED_CHUNK_KEYS;
            let keys = k0..(k0 + SHARED_CHUNK_KEYS).min(groups[g].shared_len);
            for (i, (o, l)) in o.chunks_mut(tile * d).zip(l.chunks_mut(tile)).enumerate() {
                tasks.push(SharedTask {
                    group: g,
                    kv_head,
                    keys: keys.clone(),
                    queries: i * tile..i * tile + l.len(),
                    o,
                    lse: l,
                });
            }
        }
    }
    let kernel = shared_kernel();
    tasks.into_par_iter().for_each(|task| {
        let ctx = SharedCtx {
            q,
            n_heads,
            per_kv,
            kv,
            table: spans[groups[task.group].members[0]].block_table,
            rows: &group_rows[task.group],
            scale,
        };
        // SAFETY: the dispatcher only returns kernels whose CPU features were detected.
        unsafe { kernel(&ctx, task) };
    });

    // Every row: its own keys (all of them outside groups), then the shared chunks merged in.
    let mut lse_scratch;
    let lse = match lse {
        Some(l) => l,
        None => {
            lse_scratch = vec![0f32; n_tokens * n_heads];
            &mut lse_scratch
        }
    };
    // Spans with many rows run their own keys as tiles (see `crate::tiled`), the rest row by row.
    let mut own_start = vec![0; spans.len()];
    for group in groups {
        for &m in &group.members {
            own_start[m] = group.shared_len;
        }
    }
    let tiled = Tiled::run(q, n_heads, kv, spans, scale, |s| own_start[s]);
    let kernel = head_kernel();
    out.par_chunks_mut(d)
        .zip(lse.par_iter_mut())
        .enumerate()
        .for_each_init(Vec::new, |scores, (i, (o, l))| {
            let (token, head) = (i / n_heads, i % n_heads);
            let (s, pos) = rows[token];
            let kv_head = head / per_kv;
            if let Some(at) = tiled.row(token, head) {
                o.copy_from_slice(&tiled.out[at * d..(at + 1) * d]);
                *l = tiled.lse[at];
            } else {
                let first = place[token].map_or(0, |(g, _)| groups[g].shared_len);
                let qh = &q[i * d..(i + 1) * d];
                // SAFETY: the dispatcher only returns kernels whose CPU features were detected.
                *l = unsafe {
                    kernel(
                        qh,
                        kv,
                        spans[s].block_table,
                        kv_head,
                        first..pos + 1,
                        scale,
                        scores,
                        o,
                    )
                };
            }
            if let Some((g, r)) = place[token] {
                let states = &shared[g];
                let n_rows = group_rows[g].len();
                for chunk in 0..states.chunks {
                    let at =
                        ((kv_head * states.chunks + chunk) * n_rows + r) * per_kv + head % per_kv;
                    merge_into(o, l, &states.o[at * d..(at + 1) * d], states.lse[at]);
                }
            }
        });
    Ok(())
}

/// Checks [`CascadeGroup`]'s invariants against the spans (which [`check_batch`] has checked).
fn check_groups(
    spans: &[QuerySpan],
    groups: &[CascadeGroup],
    block_size: usize,
) -> Result<(), AttentionError> {
    let mut owner = vec![usize::MAX; spans.len()];
    for (g, group) in groups.iter().enumerate() {
        let fail = |reason: String| Err(AttentionError::Group { group: g, reason });
        let members = &group.members;
        if members.len() < 2 {
            return fail(format!("{} member(s); a group needs two", members.len()));
        }
        if !members.windows(2).all(|w| w[0] < w[1]) {
            return fail(format!("members {members:?} are not strictly ascending"));
        }
        if let Some(&m) = members.iter().find(|&&m| m >= spans.len()) {
            return fail(format!("member {m} is past the {} spans", spans.len()));
        }
        if group.shared_len == 0 || group.shared_len % block_size != 0 {
            return fail(format!(
                "shared_len {} is not a positive multiple of the block size {block_size}",
                group.shared_len
            ));
        }
        let blocks = group.shared_len / block_size;
        let first = &spans[members[0]];
        for &m in members {
            if owner[m] != usize::MAX {
                return fail(format!("span {m} is also in group {}", owner[m]));
            }
            owner[m] = g;
            let span = &spans[m];
            if span.kv_len - span.n_q < group.shared_len {
                return fail(format!(
                    "span {m}'s first query row is at position {}, inside the {} shared keys",
                    span.kv_len - span.n_q,
                    group.shared_len
                ));
            }
            if span.block_table[..blocks] != first.block_table[..blocks] {
                return fail(format!(
                    "span {m}'s first {blocks} blocks differ from span {}'s",
                    members[0]
                ));
            }
        }
    }
    Ok(())
}

/// One group's shared-prefix states, `[kv head][chunk][row][head in kv group]`.
struct SharedStates {
    chunks: usize,
    o: Vec<f32>,
    lse: Vec<f32>,
}

/// What every shared-prefix task of a group reads.
struct SharedCtx<'a> {
    q: &'a [f32],
    n_heads: usize,
    /// Query heads per KV head.
    per_kv: usize,
    kv: &'a PagedKv<'a>,
    /// The group's first member's table (its shared blocks are everyone's).
    table: &'a [u32],
    /// The group's query rows, in member order.
    rows: &'a [usize],
    scale: f32,
}

/// States of the group's queries `queries` (indices `row * per_kv + head in kv group`) reading KV
/// head `kv_head`, over the shared keys `keys`.
struct SharedTask<'a> {
    group: usize,
    kv_head: usize,
    keys: Range<usize>,
    queries: Range<usize>,
    o: &'a mut [f32],
    lse: &'a mut [f32],
}

type SharedKernel = unsafe fn(&SharedCtx, SharedTask);

fn shared_kernel() -> SharedKernel {
    static KERNEL: std::sync::OnceLock<SharedKernel> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma") {
                return shared_states_avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return shared_states_avx2;
            }
        }
        shared_states_portable
    })
}

macro_rules! shared_states_for {
    ($name:ident $(, $features:literal)?) => {
        $(#[target_feature(enable = $features)])?
        unsafe fn $name(ctx: &SharedCtx, task: SharedTask) {
            shared_states(ctx, task)
        }
    };
}

#[cfg(target_arch = "x86_64")]
shared_states_for!(shared_states_avx512, "avx512f,avx2,fma");
#[cfg(target_arch = "x86_64")]
shared_states_for!(shared_states_avx2, "avx2,fma");
shared_states_for!(shared_states_portable);

/// Multi-query online softmax: the keys are walked in tiles of [`KEY_TILE`]; each tile's K and V
/// rows are fetched once and then visited by every query of the task (which is the saving: the
/// plain path fetches them once per query), each query keeping its own running max, sum and
/// output.
#[inline(always)]
fn shared_states(ctx: &SharedCtx, task: SharedTask) {
    let kv = ctx.kv;
    let d = kv.head_dim;
    let slot_stride = kv.n_kv_heads * d;
    let SharedTask {
        kv_head,
        keys,
        queries,
        o,
        lse: sum,
        ..
    } = task;
    let mut max = vec![f32::NEG_INFINITY; queries.len()];
    o.fill(0.0);
    sum.fill(0.0);
    let mut at = [0usize; KEY_TILE];
    let mut p = [0f32; KEY_TILE];
    // A quantized tile's rows, decoded once for all the group's queries.
    let (mut kt, mut vt) = (Vec::new(), Vec::new());
    let mut k0 = keys.start;
    while k0 < keys.end {
        let n = KEY_TILE.min(keys.end - k0);
        for (t, a) in at[..n].iter_mut().enumerate() {
            let pos = k0 + t;
            let block = ctx.table[pos / kv.block_size] as usize;
            *a = (block * kv.block_size + pos % kv.block_size) * slot_stride + kv_head * d;
        }
        let (tile_keys, tile_values) = kv.chunk_rows(&mut at[..n], &mut kt, &mut vt);
        for (i, query) in queries.clone().enumerate() {
            let (row, j) = (ctx.rows[query / ctx.per_kv], query % ctx.per_kv);
            let head = kv_head * ctx.per_kv + j;
            let qv = &ctx.q[(row * ctx.n_heads + head) * d..][..d];
            let mut m = max[i];
            for (s, &a) in p[..n].iter_mut().zip(&at[..n]) {
                *s = dot(qv, &tile_keys[a..a + d]) * ctx.scale;
                m = m.max(*s);
            }
            if m == f32::NEG_INFINITY {
                continue;
            }
            let oq = &mut o[i * d..(i + 1) * d];
            if m > max[i] {
                // exp(-inf) = 0 on the first tile: the zeros stay zeros.
                let correction = (max[i] - m).exp();
                sum[i] *= correction;
                oq.iter_mut().for_each(|x| *x *= correction);
                max[i] = m;
            }
            for (s, &a) in p[..n].iter().zip(&at[..n]) {
                let w = (s - m).exp();
                sum[i] += w;
                for (x, v) in oq.iter_mut().zip(&tile_values[a..a + d]) {
                    *x += w * v;
                }
            }
        }
        k0 += n;
    }
    // Running sums to states.
    for (i, (oq, l)) in o.chunks_mut(d).zip(sum.iter_mut()).enumerate() {
        if *l == 0.0 {
            *l = f32::NEG_INFINITY;
            continue;
        }
        let inv = 1.0 / *l;
        oq.iter_mut().for_each(|x| *x *= inv);
        *l = max[i] + l.ln();
    }
}
