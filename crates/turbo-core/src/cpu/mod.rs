//! The CPU backend: f32 compute over rayon's thread pool.

mod kv;
pub mod linear;
mod meminfo;
pub mod ops;
pub mod q8dot;
mod scores;

pub use kv::{CpuKvCache, KvCacheSpec};
pub use q8dot::CpuActivations;

use crate::backend::{
    Backend, BackendError, BatchLayout, BatchRows, KvCompaction, KvScoring, OwnedSpans, Result,
    CARRIED_TOKEN,
};
use crate::comm::{own_vocab_part, vocab_part, CpuGroupMember, RankInfo};
use crate::sampling::{sample_row, PenaltyLists, SampleParams, NO_FINITE_LOGIT};
use crate::WeightMatrix;
use rayon::prelude::*;
use std::sync::{Arc, Mutex, OnceLock};
use turbo_attention::cascade::{cascade_groups, try_paged_attention_cascade, CascadeGroup};
use turbo_attention::try_paged_attention;

/// Shared prefix (in keys) from which the CPU backend runs a batch's attention as cascade: a
/// group of at least two sequences whose block tables start with this many keys' worth of the
/// same blocks has that prefix attended once for all of its queries. Below it the second pass and
/// the merge cost about what they save, since a short prefix stays in cache for the plain path
/// too. Measured with `cargo bench -p turbo-attention --bench attention -- cpu_shared_prefix`
/// (4 and 16 decoding sequences, 9 query / 3 KV heads of 64): cascade was no faster at 16 to 64
/// shared keys, and faster from 128 on (1.5x at 128 keys with 4 sequences, 2x at 2048).
pub const CASCADE_MIN_SHARED_KEYS: usize = 128;

/// A row-major `[rows, cols]` f32 tensor in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

/// A batch layout owned by the CPU backend, with the step's logits and tokens.
#[derive(Default)]
pub struct CpuBatch {
    ids: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    spans: OwnedSpans,
    inv_freq: Vec<f32>,
    outputs: Vec<u32>,
    vocab: usize,
    /// Per output row, when the step samples.
    sampling: Option<(Vec<SampleParams>, PenaltyLists)>,
    /// Per span, its eviction scoring (empty: none scored).
    scoring: Vec<Option<KvScoring>>,
    /// The spans' cascade groups for a block size, found at the first attention of the step.
    cascade: OnceLock<(usize, Vec<CascadeGroup>)>,
    logits: Mutex<Vec<f32>>,
    tokens: Mutex<Vec<u32>>,
}

/// The embedding of the batch's tokens from `table`, which holds rows `part` of a vocabulary of
/// `vocab` (all of it, or a tensor-parallel rank's part): other rows' tokens embed as zeros, and
/// a carried token that its step could not sample ([`NO_FINITE_LOGIT`]) as NaN, as a GPU's
/// embedding gives it (its request fails once that token is read back).
fn embed_rows(
    table: &WeightMatrix,
    batch: &CpuBatch,
    part: std::ops::Range<usize>,
    vocab: usize,
    out: &mut HostTensor,
) -> Result<()> {
    for (row, &id) in out.data.chunks_exact_mut(table.cols).zip(&batch.ids) {
        if id == NO_FINITE_LOGIT {
            row.fill(f32::NAN);
            continue;
        }
        let id = id as usize;
        if id >= vocab {
            return Err(BackendError::Unsupported(format!(
                "token id {id} is outside the vocabulary of {vocab}"
            )));
        }
        match part.contains(&id) {
            true => table.dequantize_row(id - part.start, row),
            false => row.fill(0.0),
        }
    }
    Ok(())
}

fn poisoned<T>(_: T) -> BackendError {
    BackendError::Device("a step panicked while holding the batch".into())
}

/// f32 compute on a thread pool of its own. Work is run inside the pool ([`Backend::run`]), so
/// the thread issuing a forward pass is itself a worker and the many short parallel sections of a
/// decode step do not each pay for waking a sleeping thread.
#[derive(Clone, Debug)]
pub struct CpuBackend {
    pool: Arc<rayon::ThreadPool>,
    /// The tensor-parallel group this backend is a rank of, if any.
    group: Option<Arc<CpuGroupMember>>,
    /// How decode products treat activations (exact f32 unless asked otherwise).
    activations: CpuActivations,
}

impl CpuBackend {
    /// A backend using every core.
    pub fn new() -> Self {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_threads(threads).expect("a thread pool of the machine's size")
    }

    pub fn with_threads(threads: usize) -> Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("turbo-cpu-{i}"))
            .build()
            .map_err(|e| BackendError::Device(format!("cannot start CPU threads: {e}")))?;
        Ok(CpuBackend {
            pool: Arc::new(pool),
            group: None,
            activations: CpuActivations::F32,
        })
    }

    /// A backend of `threads` threads that is one rank of an in-process tensor-parallel group.
    pub fn with_group(threads: usize, member: CpuGroupMember) -> Result<Self> {
        let mut backend = Self::with_threads(threads)?;
        backend.group = Some(Arc::new(member));
        Ok(backend)
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Rounds the activations of decode products to 8 bits ([`CpuActivations::Q8`]) or keeps
    /// them exact.
    pub fn set_activations(&mut self, activations: CpuActivations) {
        self.activations = activations;
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl Backend for CpuBackend {
    type Tensor = HostTensor;
    type Matrix = WeightMatrix;
    type KvCache = CpuKvCache;
    type Batch = CpuBatch;

    fn name(&self) -> String {
        format!("cpu ({} threads)", self.threads())
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    fn rank_info(&self) -> RankInfo {
        match &self.group {
            Some(g) => g.info(),
            None => RankInfo { rank: 0, world: 1 },
        }
    }

    fn all_reduce_sum(&self, x: &mut HostTensor) -> Result<()> {
        match &self.group {
            Some(g) => g.all_reduce_sum(&mut x.data[..x.rows * x.cols]),
            None => Ok(()),
        }
    }

    fn abort_collectives(&self) {
        if let Some(g) = &self.group {
            g.abort();
        }
    }

    fn broadcast_sampled(&self, batch: &CpuBatch) -> Result<()> {
        match &self.group {
            Some(g) => g.broadcast_from_first(&mut *batch.tokens.lock().map_err(poisoned)?),
            None => Ok(()),
        }
    }

    fn upload_matrix(&self, w: &WeightMatrix) -> Result<WeightMatrix> {
        Ok(w.clone())
    }

    fn matrix_bytes(&self, m: &WeightMatrix) -> usize {
        m.data.len()
    }

    fn upload_stacked(&self, parts: &[&WeightMatrix]) -> Result<WeightMatrix> {
        WeightMatrix::stack(parts).map_err(BackendError::Unsupported)
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<HostTensor> {
        assert_eq!(data.len(), rows * cols);
        Ok(HostTensor {
            data: data.to_vec(),
            rows,
            cols,
        })
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<HostTensor> {
        Ok(HostTensor {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        })
    }

    fn download(&self, t: &HostTensor) -> Result<Vec<f32>> {
        Ok(t.data.clone())
    }

    fn resize(&self, t: &mut HostTensor, rows: usize) -> Result<bool> {
        let moved = rows * t.cols > t.data.capacity();
        t.data.resize(rows * t.cols, 0.0);
        t.rows = rows;
        Ok(moved)
    }

    fn kv_cache(&self, spec: KvCacheSpec) -> Result<CpuKvCache> {
        CpuKvCache::try_new(spec)
    }

    fn kv_spec(&self, cache: &CpuKvCache) -> KvCacheSpec {
        *cache.spec()
    }

    fn kv_element_bytes(&self) -> usize {
        4
    }

    fn free_memory(&self) -> Option<usize> {
        meminfo::mem_available()
    }

    fn new_batch(&self) -> Result<CpuBatch> {
        Ok(CpuBatch::default())
    }

    fn prepare_batch(
        &self,
        batch: &mut CpuBatch,
        layout: &BatchLayout,
        _cache: &CpuKvCache,
    ) -> Result<BatchRows> {
        layout.check()?;
        let n = layout.ids.len();
        let logits = std::mem::take(batch.logits.get_mut().map_err(poisoned)?);
        // Tokens the last step sampled stand in for the ids that name them.
        let sampled = batch.tokens.get_mut().map_err(poisoned)?;
        let ids = layout
            .ids
            .iter()
            .map(|&id| match id & CARRIED_TOKEN {
                0 => Ok(id),
                _ => {
                    let row = (id & !CARRIED_TOKEN) as usize;
                    sampled.get(row).copied().ok_or_else(|| {
                        BackendError::Unsupported(format!(
                            "a carried token of output row {row}, of a step that sampled {}",
                            sampled.len()
                        ))
                    })
                }
            })
            .collect::<Result<Vec<u32>>>()?;
        *batch = CpuBatch {
            ids,
            positions: layout.positions.to_vec(),
            slots: layout.slots.to_vec(),
            spans: OwnedSpans::new(layout.spans),
            inv_freq: layout.inv_freq.to_vec(),
            outputs: layout.outputs.to_vec(),
            vocab: layout.vocab,
            sampling: layout
                .sampling
                .map(|s| (s.params.to_vec(), s.penalties.clone())),
            scoring: layout.scoring.to_vec(),
            cascade: OnceLock::new(),
            logits: Mutex::new(logits),
            tokens: Mutex::new(Vec::new()),
        };
        Ok(BatchRows {
            tokens: n,
            outputs: layout.outputs.len(),
        })
    }

    fn embed(&self, table: &WeightMatrix, batch: &CpuBatch, out: &mut HostTensor) -> Result<()> {
        embed_rows(table, batch, 0..table.rows, table.rows, out)
    }

    fn embed_split(
        &self,
        table: &WeightMatrix,
        batch: &CpuBatch,
        vocab: usize,
        out: &mut HostTensor,
    ) -> Result<()> {
        let part = own_vocab_part("an embedding part", table.rows, vocab, self.rank_info())?;
        embed_rows(table, batch, part, vocab, out)
    }
    fn rms_norm(
        &self,
        x: &HostTensor,
        w: &HostTensor,
        eps: f32,
        out: &mut HostTensor,
    ) -> Result<()> {
        ops::rms_norm(&x.data, &w.data, eps, &mut out.data);
        Ok(())
    }

    fn linear(&self, x: &HostTensor, w: &WeightMatrix, out: &mut HostTensor) -> Result<()> {
        linear::linear_with(&x.data, x.rows, w, &mut out.data, self.activations);
        Ok(())
    }

    fn rope(&self, x: &mut HostTensor, head_dim: usize, batch: &CpuBatch) -> Result<()> {
        ops::rope_interleaved(&mut x.data, head_dim, &batch.positions, &batch.inv_freq);
        Ok(())
    }

    fn hadamard_heads(&self, x: &mut HostTensor, head_dim: usize, scale: f32) -> Result<()> {
        if !head_dim.is_power_of_two() || !x.cols.is_multiple_of(head_dim) {
            return Err(BackendError::Unsupported(format!(
                "a Hadamard rotation of {head_dim}-wide heads over rows of {}",
                x.cols
            )));
        }
        self.pool.install(|| {
            x.data.par_chunks_mut(head_dim).for_each(|row| {
                turbo_attention::kv_quant::hadamard_rotate(row);
                if scale != 1.0 {
                    row.iter_mut().for_each(|v| *v *= scale);
                }
            })
        });
        Ok(())
    }

    fn silu_mul(&self, gate: &mut HostTensor, up: &HostTensor) -> Result<()> {
        ops::silu_mul(&mut gate.data, &up.data);
        Ok(())
    }

    fn swiglu(&self, gate_up: &HostTensor, out: &mut HostTensor) -> Result<()> {
        ops::swiglu(&gate_up.data, &mut out.data, out.cols);
        Ok(())
    }

    fn add(&self, x: &mut HostTensor, y: &HostTensor) -> Result<()> {
        ops::add(&mut x.data, &y.data);
        Ok(())
    }

    fn split3(
        &self,
        x: &HostTensor,
        a: &mut HostTensor,
        b: &mut HostTensor,
        c: &mut HostTensor,
    ) -> Result<()> {
        for (r, row) in x.data.chunks_exact(x.cols).enumerate() {
            let (ra, rest) = row.split_at(a.cols);
            let (rb, rc) = rest.split_at(b.cols);
            a.data[r * a.cols..(r + 1) * a.cols].copy_from_slice(ra);
            b.data[r * b.cols..(r + 1) * b.cols].copy_from_slice(rb);
            c.data[r * c.cols..(r + 1) * c.cols].copy_from_slice(&rc[..c.cols]);
        }
        Ok(())
    }

    fn gather_outputs(&self, x: &HostTensor, batch: &CpuBatch, out: &mut HostTensor) -> Result<()> {
        for (dst, &r) in out.data.chunks_exact_mut(x.cols).zip(&batch.outputs) {
            let r = r as usize;
            dst.copy_from_slice(&x.data[r * x.cols..(r + 1) * x.cols]);
        }
        Ok(())
    }

    fn logits(&self, x: &HostTensor, head: &WeightMatrix, batch: &CpuBatch) -> Result<()> {
        let mut logits = batch.logits.lock().map_err(poisoned)?;
        logits.resize(x.rows * head.rows, 0.0);
        linear::linear_with(&x.data, x.rows, head, &mut logits, self.activations);
        Ok(())
    }

    fn logits_split(
        &self,
        x: &HostTensor,
        head: &WeightMatrix,
        batch: &CpuBatch,
        vocab: usize,
    ) -> Result<()> {
        let Some(group) = &self.group else {
            return self.logits(x, head, batch);
        };
        let info = group.info();
        own_vocab_part("a head part", head.rows, vocab, info)?;
        let mut mine = vec![0.0; x.rows * head.rows];
        linear::linear_with(&x.data, x.rows, head, &mut mine, self.activations);
        let Some(parts) = group.gather_to_first(&mine)? else {
            return Ok(());
        };
        let mut logits = batch.logits.lock().map_err(poisoned)?;
        logits.resize(x.rows * vocab, 0.0);
        for (r, p) in parts.iter().enumerate() {
            let cols = vocab_part(vocab, r, info.world);
            if p.len() != x.rows * cols.len() {
                return Err(BackendError::Device(format!(
                    "rank {r} gave {} logits for {} rows of {} columns",
                    p.len(),
                    x.rows,
                    cols.len()
                )));
            }
            if cols.is_empty() {
                continue;
            }
            for (row, src) in logits
                .chunks_exact_mut(vocab)
                .zip(p.chunks_exact(cols.len()))
            {
                row[cols.clone()].copy_from_slice(src);
            }
        }
        Ok(())
    }

    fn sample(&self, batch: &CpuBatch) -> Result<()> {
        let (params, penalties) = batch.sampling.as_ref().ok_or_else(|| {
            BackendError::Unsupported("sampling a batch prepared without sampling".into())
        })?;
        let mut logits = batch.logits.lock().map_err(poisoned)?;
        let tokens: Vec<u32> = logits
            .par_chunks_mut(batch.vocab.max(1))
            .zip(params.par_iter())
            .enumerate()
            .map(|(r, (row, p))| sample_row(row, p, penalties.row(r)))
            .collect();
        *batch.tokens.lock().map_err(poisoned)? = tokens;
        Ok(())
    }

    fn read_logits(&self, batch: &CpuBatch) -> Result<Vec<f32>> {
        let logits = batch.logits.lock().map_err(poisoned)?;
        let len = batch.outputs.len() * batch.vocab;
        logits.get(..len).map(<[f32]>::to_vec).ok_or_else(|| {
            BackendError::Unsupported("reading logits of a step that computed none".into())
        })
    }

    fn read_tokens(&self, batch: &CpuBatch) -> Result<Vec<u32>> {
        Ok(batch.tokens.lock().map_err(poisoned)?.clone())
    }

    fn compact_kv(&self, cache: &mut CpuKvCache, compaction: &KvCompaction) -> Result<()> {
        cache.compact(compaction)
    }

    fn supports_kv_scores(&self, _spec: &KvCacheSpec) -> bool {
        true
    }

    fn accumulate_kv_scores(
        &self,
        q: &HostTensor,
        cache: &mut CpuKvCache,
        layer: usize,
        n_heads: usize,
        batch: &CpuBatch,
        scale: f32,
    ) -> Result<()> {
        if batch.scoring.iter().all(Option::is_none) {
            return Ok(());
        }
        let spans = batch.spans.spans();
        let (kv, scores) = cache.layer_with_scores(layer);
        let config = scores::ScoreLayer {
            q: &q.data,
            n_heads,
            kv: &kv,
            layer,
            scale,
            positions: &batch.positions,
        };
        let increments = scores::increments(&config, &spans, &batch.scoring)?;
        scores::add(&kv, scores, &spans, &increments);
        Ok(())
    }

    fn read_kv_scores(
        &self,
        cache: &CpuKvCache,
        block_table: &[u32],
        keys: usize,
    ) -> Result<Vec<f32>> {
        cache.read_scores(block_table, keys)
    }

    fn write_kv(
        &self,
        cache: &mut CpuKvCache,
        layer: usize,
        k: &HostTensor,
        v: &HostTensor,
        batch: &CpuBatch,
    ) -> Result<()> {
        self.pool
            .install(|| cache.write(layer, &k.data, &v.data, &batch.slots));
        Ok(())
    }

    fn attention(
        &self,
        q: &HostTensor,
        cache: &CpuKvCache,
        layer: usize,
        n_heads: usize,
        batch: &CpuBatch,
        scale: f32,
        out: &mut HostTensor,
    ) -> Result<()> {
        let spans = batch.spans.spans();
        let kv = cache.layer(layer);
        let find = || cascade_groups(&spans, kv.block_size, CASCADE_MIN_SHARED_KEYS);
        let cached = batch.cascade.get_or_init(|| (kv.block_size, find()));
        let uncached;
        let groups = if cached.0 == kv.block_size {
            &cached.1
        } else {
            uncached = find();
            &uncached
        };
        let result = if groups.is_empty() {
            try_paged_attention(&q.data, n_heads, &kv, &spans, scale, &mut out.data, None)
        } else {
            try_paged_attention_cascade(
                &q.data,
                n_heads,
                &kv,
                &spans,
                groups,
                scale,
                &mut out.data,
                None,
            )
        };
        result.map_err(|e| BackendError::Unsupported(format!("attention: {e}")))
    }
}
