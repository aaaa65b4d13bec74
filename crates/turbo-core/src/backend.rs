//! The interface every compute backend implements, so that a model's forward pass is written once.

use crate::comm::RankInfo;
use crate::cpu::KvCacheSpec;
use crate::sampling::{PenaltyLists, SampleParams};
use crate::WeightMatrix;
use thiserror::Error;
use turbo_attention::QuerySpan;
use turbo_keyformer::{Dims, KeepRule, ScoreFunction};

#[derive(Debug, Error)]
pub enum BackendError {
    #[error("out of device memory: {0}")]
    OutOfMemory(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("device error: {0}")]
    Device(String),
}

pub type Result<T> = std::result::Result<T, BackendError>;

/// A batch's [`QuerySpan`]s with their block tables copied, for a prepared batch that outlives the
/// borrow of the forward pass's layout.
#[derive(Clone, Debug, Default)]
pub struct OwnedSpans(Vec<(usize, usize, usize, Vec<u32>)>);

impl OwnedSpans {
    pub fn new(spans: &[QuerySpan]) -> Self {
        OwnedSpans(
            spans
                .iter()
                .map(|s| (s.q_start, s.n_q, s.kv_len, s.block_table.to_vec()))
                .collect(),
        )
    }

    pub fn spans(&self) -> Vec<QuerySpan<'_>> {
        self.0
            .iter()
            .map(|(q_start, n_q, kv_len, table)| QuerySpan {
                q_start: *q_start,
                n_q: *n_q,
                kv_len: *kv_len,
                block_table: table,
            })
            .collect()
    }
}

/// What a collective of a backend without one does: nothing alone, an error in a group.
fn alone_only(name: String, rank: RankInfo, what: &str) -> Result<()> {
    match rank.world {
        1 => Ok(()),
        n => Err(BackendError::Unsupported(format!(
            "{name} cannot {what} over {n} ranks"
        ))),
    }
}

/// [`Backend::linear_residual_all_reduce`] as separate steps: the product (added to the stream
/// on rank 0, alone on the others), then the all-reduce. Backends that fuse the two fall back on
/// it where they cannot.
pub fn split_linear_residual<B: Backend + ?Sized>(
    b: &B,
    input: &B::Tensor,
    w: &B::Matrix,
    product: &mut B::Tensor,
    x: &mut B::Tensor,
) -> Result<()> {
    match b.rank_info() {
        RankInfo { world: 1, .. } => b.linear_residual(input, w, product, x),
        RankInfo { rank: 0, .. } => {
            b.linear_residual(input, w, product, x)?;
            b.all_reduce_sum(x)
        }
        _ => {
            b.linear(input, w, x)?;
            b.all_reduce_sum(x)
        }
    }
}

/// A token id of a [`BatchLayout`] with this bit set stands for a token the host does not know
/// yet: `CARRIED_TOKEN | row` is the token the previous step run with the same batch object
/// sampled for its output row `row`. The backend takes it from where that step left it, so a
/// step can be issued before the previous step's tokens have come back to the host (the
/// overlapped persistent batch). Real token ids are below the vocabulary size, far below this.
pub const CARRIED_TOKEN: u32 = 1 << 31;

/// The tokens a step sampled, as [`TokensLater::wait`] returns them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SampledTokens {
    /// One per output row of the step.
    pub tokens: Vec<u32>,
    /// The device's time for the step, when step timing is on ([`Backend::set_step_timing`]).
    pub device_micros: Option<f64>,
}

/// A step's sampled tokens on their way to the host ([`Backend::read_tokens_later`]): later
/// steps may be issued before they are waited for.
pub struct TokensLater(Box<dyn FnOnce() -> Result<SampledTokens> + Send>);

impl TokensLater {
    /// Tokens that are already on the host.
    pub fn ready(tokens: SampledTokens) -> Self {
        TokensLater(Box::new(move || Ok(tokens)))
    }

    /// Tokens that `wait` brings back, blocking until the step is done.
    pub fn new(wait: impl FnOnce() -> Result<SampledTokens> + Send + 'static) -> Self {
        TokensLater(Box::new(wait))
    }

    /// Blocks until the tokens are on the host and returns them.
    pub fn wait(self) -> Result<SampledTokens> {
        (self.0)()
    }
}

impl std::fmt::Debug for TokensLater {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokensLater")
    }
}

/// What a forward pass tells the backend about its batch, once, before the layers run.
#[derive(Clone, Copy, Debug)]
pub struct BatchLayout<'a> {
    /// Token id of each row; [`CARRIED_TOKEN`] marks one the previous step sampled.
    pub ids: &'a [u32],
    /// Position of each token in its sequence (for RoPE).
    pub positions: &'a [u32],
    /// KV-cache slot of each token (`block * block_size + offset`).
    pub slots: &'a [u32],
    /// Which rows belong to which sequence, and the blocks holding its history.
    pub spans: &'a [QuerySpan<'a>],
    /// RoPE inverse frequencies, one per rotated pair.
    pub inv_freq: &'a [f32],
    /// Rows whose logits the step computes (e.g. each sequence's last), in output order.
    pub outputs: &'a [u32],
    /// Query heads of attention.
    pub n_heads: usize,
    /// Columns of the logits: the whole vocabulary (under tensor parallelism too, where rank 0
    /// gathers them; [`Backend::logits_split`]).
    pub vocab: usize,
    /// How to choose a token from each output row's logits, when the step samples.
    pub sampling: Option<Sampling<'a>>,
    /// Per span, how its queries feed its KV eviction scores (`None`: not scored); empty when
    /// no span of the step is scored.
    pub scoring: &'a [Option<KvScoring>],
}

/// How one sequence's queries feed the eviction scores of its keys (see
/// [`Backend::accumulate_kv_scores`]): every query row of the span adds, per query head, the
/// policy's score function of its attention logits into the scores of the keys it sees.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvScoring {
    pub function: ScoreFunction,
    /// The sequence's noise seed (Keyformer's Gumbel noise).
    pub seed: u64,
    /// Decoding iteration driving Keyformer's temperature: 0 for prompt chunks, `t` for the
    /// `t`-th generated token.
    pub iteration: u32,
    /// Iterations planned (the request's maximum new tokens).
    pub total_iterations: u32,
}

impl BatchLayout<'_> {
    /// Checks that the per-token and per-output lists agree in length and that outputs name
    /// rows of the batch, so a backend can rely on them.
    pub fn check(&self) -> Result<()> {
        let n = self.ids.len();
        if self.positions.len() != n
            || self.slots.len() != n
            || self.outputs.iter().any(|&r| r as usize >= n)
        {
            return Err(BackendError::Unsupported(format!(
                "batch of {n} ids with {} positions, {} slots and outputs {:?}",
                self.positions.len(),
                self.slots.len(),
                self.outputs
            )));
        }
        if !self.scoring.is_empty() && self.scoring.len() != self.spans.len() {
            return Err(BackendError::Unsupported(format!(
                "{} spans with {} scoring entries",
                self.spans.len(),
                self.scoring.len()
            )));
        }
        if let Some(s) = &self.sampling {
            if s.params.len() != self.outputs.len() || s.penalties.rows() != s.params.len() {
                return Err(BackendError::Unsupported(format!(
                    "{} output rows with {} sampling parameters and {} penalty lists",
                    self.outputs.len(),
                    s.params.len(),
                    s.penalties.rows()
                )));
            }
        }
        Ok(())
    }
}

/// One sequence's KV compaction (KV eviction): in every (layer, KV head) row, the keys and values
/// at key indices `kept[row]` move, in order, to key indices `0..kept_per_row` of the sequence's
/// block table. Every row keeps the same number of keys, so one block table still serves all
/// layers and heads, each holding its own choice of tokens; keys are stored rotated, so a moved
/// key keeps its position.
#[derive(Clone, Copy, Debug)]
pub struct KvCompaction<'a> {
    pub block_table: &'a [u32],
    /// `[n_layers][n_kv_heads][kept_per_row]` key indices, strictly increasing in each row.
    pub kept: &'a [u32],
    pub kept_per_row: usize,
}

/// A compaction whose kept keys a [`KeepRule`] chooses from the sequence's scores
/// ([`Backend::compact_kv_by_rule`]): every (layer, KV head) of `dims` keeps `min(kept_per_row,
/// dims.keys)` of its keys.
#[derive(Clone, Copy, Debug)]
pub struct KvRuleCompaction<'a> {
    pub block_table: &'a [u32],
    pub dims: Dims,
    pub kept_per_row: usize,
    pub rule: KeepRule,
}

impl KvCompaction<'_> {
    /// Checks the plan against `spec` (row count, order, block table coverage), so that a backend
    /// can move data without further checks. Strictly increasing rows make the in-order move safe
    /// in place: a key is never overwritten before it moves.
    pub fn check(&self, spec: &KvCacheSpec) -> Result<()> {
        let rows = spec.n_layers * spec.n_kv_heads;
        let k = self.kept_per_row;
        let covered = self.block_table.len() * spec.block_size;
        let bad = |why: String| Err(BackendError::Unsupported(format!("KV compaction: {why}")));
        if self.kept.len() != rows * k {
            return bad(format!(
                "{} kept keys for {rows} rows of {k}",
                self.kept.len()
            ));
        }
        if self
            .block_table
            .iter()
            .any(|&b| b as usize >= spec.max_blocks)
        {
            return bad("a block past the cache".into());
        }
        for row in self.kept.chunks(k.max(1)) {
            if row.windows(2).any(|w| w[0] >= w[1]) {
                return bad("kept keys not strictly increasing".into());
            }
            if row.last().is_some_and(|&last| last as usize >= covered) {
                return bad(format!(
                    "a kept key past the {covered} slots of the block table"
                ));
            }
        }
        Ok(())
    }

    /// The cache slot of key index `key` in the sequence's blocks.
    pub fn slot(&self, key: usize, block_size: usize) -> usize {
        self.block_table[key / block_size] as usize * block_size + key % block_size
    }
}

/// Per output row, its sampling parameters and penalized tokens (see [`crate::sampling`]).
#[derive(Clone, Copy, Debug)]
pub struct Sampling<'a> {
    pub params: &'a [SampleParams],
    pub penalties: &'a PenaltyLists,
}

/// The rows a prepared batch's activations need. A backend may pad a step to a shape it has run
/// before (so that it can replay the recorded step); padded rows compute nothing anyone reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchRows {
    /// Rows of every activation up to the final norm.
    pub tokens: usize,
    /// Rows of the gathered outputs and their logits.
    pub outputs: usize,
}

/// The RMSNorm that follows a residual step ([`Backend::linear_residual_before_norm`]):
/// `rms_norm(x) · weight`, computed by the next `norm_*` call into its `normed` scratch.
pub struct NextNorm<'a, T> {
    pub weight: &'a T,
    pub eps: f32,
    /// The scratch that call takes as `normed`.
    pub normed: &'a mut T,
}

/// The operations of a LLaMA-style decoder, over the backend's own buffers.
///
/// Activations are row-major `[tokens, features]` f32 tensors. A batch is a concatenation of
/// sequences' new tokens; `positions` and `slots` give, per token, its position in its sequence and
/// the KV-cache slot its key and value go to, and [`QuerySpan`]s tell attention which rows belong to
/// which sequence and which blocks hold its history.
pub trait Backend: Send + Sync {
    /// Activations resident on the device.
    type Tensor: Send + Sync;
    /// A weight matrix resident on the device.
    type Matrix: Send + Sync;
    /// Paged KV storage for all layers.
    type KvCache: Send + Sync;
    /// A [`BatchLayout`] made resident (uploaded once per forward pass, not once per layer), with
    /// the step's logits and sampled tokens. One is kept and refilled step after step, so that
    /// its buffers keep their addresses.
    type Batch: Send + Sync;

    /// Human-readable device name, for logs and benchmark records.
    fn name(&self) -> String;

    /// Runs `f`, a sequence of this backend's operations, in the backend's execution context (for
    /// the CPU: on its worker threads, so that the ops' parallel sections start without a wake-up).
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    fn upload_matrix(&self, w: &WeightMatrix) -> Result<Self::Matrix>;
    /// One matrix holding the rows of `parts` in order (e.g. fused W_q, W_k, W_v), so a single
    /// product computes all of them.
    fn upload_stacked(&self, parts: &[&WeightMatrix]) -> Result<Self::Matrix>;
    /// Bytes of memory `m`'s values take on this backend (quantized weights kept as blocks
    /// take their file's bytes; decoded ones, their decoded type's).
    fn matrix_bytes(&self, m: &Self::Matrix) -> usize;
    /// A `[rows, cols]` tensor filled from host data.
    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// A `[rows, cols]` tensor whose contents are unspecified until written.
    fn tensor(&self, rows: usize, cols: usize) -> Result<Self::Tensor>;
    fn download(&self, t: &Self::Tensor) -> Result<Vec<f32>>;
    /// Makes `t` hold `rows` rows (contents unspecified), keeping its storage when it is large
    /// enough; returns whether the storage was replaced.
    fn resize(&self, t: &mut Self::Tensor, rows: usize) -> Result<bool>;
    fn kv_cache(&self, spec: KvCacheSpec) -> Result<Self::KvCache>;
    fn kv_spec(&self, cache: &Self::KvCache) -> KvCacheSpec;
    /// Bytes of one stored key or value element (f32 on the CPU, bf16 on a GPU), for sizing the
    /// cache from a memory budget.
    fn kv_element_bytes(&self) -> usize;
    /// Bytes of memory still free for this backend's buffers (device memory on a GPU, available
    /// RAM on the CPU), for sizing the KV cache as a fraction of it; `None` if unknown.
    fn free_memory(&self) -> Option<usize> {
        None
    }
    /// An empty batch, for [`Backend::prepare_batch`] to fill.
    fn new_batch(&self) -> Result<Self::Batch>;
    /// Makes `layout` resident in `batch` (reusing its buffers), for a step over `cache`; returns
    /// the rows the step's activations need.
    fn prepare_batch(
        &self,
        batch: &mut Self::Batch,
        layout: &BatchLayout,
        cache: &Self::KvCache,
    ) -> Result<BatchRows>;
    /// Runs `step`, the device work of the step `batch` was prepared for. A backend may record
    /// the work the first time it sees a step of this shape and replay the recording for later
    /// ones instead of calling `step` (a CUDA graph), so `step` must issue the same work on the
    /// same buffers for every batch of a shape: only the batch's contents may differ.
    fn run_step(&self, batch: &Self::Batch, step: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let _ = batch;
        step()
    }
    /// Forgets every recorded step of `batch`: a buffer a step uses has been replaced.
    fn forget_steps(&self, batch: &Self::Batch) {
        let _ = batch;
    }
    /// Measures the device time of each step from now on (`on`), or stops; for step profiles.
    /// Backends whose steps run on the calling thread have nothing to measure apart from the
    /// host's time and ignore it.
    fn set_step_timing(&self, on: bool) {
        let _ = on;
    }
    /// Device time of the last step `batch` ran, in microseconds, once its results were read
    /// back; `None` when step timing is off or the backend has no device of its own.
    fn step_device_micros(&self, batch: &Self::Batch) -> Option<f64> {
        let _ = batch;
        None
    }
    /// Whether a step's device work goes on after [`Backend::run_step`] returns (a GPU), so
    /// that the host gains by preparing the next step meanwhile; false where the calling
    /// thread computes the step itself.
    fn runs_ahead(&self) -> bool {
        false
    }

    /// Whether a step's first run at a shape costs more than later ones (kernels loaded and
    /// product algorithms chosen on first use, steps recorded for replay), so that an engine
    /// gains by running its first kinds of step once before it serves.
    fn first_steps_cost_more(&self) -> bool {
        false
    }

    /// The embedding table's rows for the batch's token ids.
    fn embed(
        &self,
        table: &Self::Matrix,
        batch: &Self::Batch,
        out: &mut Self::Tensor,
    ) -> Result<()>;
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// `out = x · wᵀ`.
    fn linear(&self, x: &Self::Tensor, w: &Self::Matrix, out: &mut Self::Tensor) -> Result<()>;
    /// `out = (rms_norm(x) · weight) · wᵀ`: a block's product after its RMSNorm. `normed` is
    /// scratch for the normalised rows (this default normalises, then multiplies; a GPU fuses the
    /// two when few tokens make the product a stream over the weights).
    #[allow(clippy::too_many_arguments)]
    fn norm_linear(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
        normed: &mut Self::Tensor,
        w: &Self::Matrix,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.rms_norm(x, weight, eps, normed)?;
        self.linear(normed, w, out)
    }
    /// The feed-forward block's first half: [`Backend::norm_linear`] with a fused `[gate; up]`
    /// weight, then `out = silu(gate) · up`. `normed` and `gate_up` are scratch.
    #[allow(clippy::too_many_arguments)]
    fn norm_linear_swiglu(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
        normed: &mut Self::Tensor,
        w_gate_up: &Self::Matrix,
        gate_up: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.norm_linear(x, weight, eps, normed, w_gate_up, gate_up)?;
        self.swiglu(gate_up, out)
    }
    /// A block's residual step: `x += input · wᵀ`. `product` is scratch for backends that
    /// multiply, then add (this default).
    fn linear_residual(
        &self,
        input: &Self::Tensor,
        w: &Self::Matrix,
        product: &mut Self::Tensor,
        x: &mut Self::Tensor,
    ) -> Result<()> {
        self.linear(input, w, product)?;
        self.add(x, product)
    }
    /// Rotary embedding of every head of `x` (`[tokens, heads · head_dim]`), interleaved pairs,
    /// at the batch's positions.
    fn rope(&self, x: &mut Self::Tensor, head_dim: usize, batch: &Self::Batch) -> Result<()>;
    /// `gate = silu(gate) · up`.
    fn silu_mul(&self, gate: &mut Self::Tensor, up: &Self::Tensor) -> Result<()>;
    /// SwiGLU of a fused product: each row of `gate_up` is `[gate | up]`; `out = silu(gate) · up`.
    fn swiglu(&self, gate_up: &Self::Tensor, out: &mut Self::Tensor) -> Result<()>;
    /// `x += y`.
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    /// This backend's place in a tensor-parallel group ([`crate::comm`]); rank 0 of 1 when alone.
    fn rank_info(&self) -> RankInfo {
        RankInfo { rank: 0, world: 1 }
    }
    /// `x` becomes the sum of every rank's `x`, on every rank of the backend's tensor-parallel
    /// group, in an order that gives all ranks the same values. Nothing to do alone.
    fn all_reduce_sum(&self, x: &mut Self::Tensor) -> Result<()> {
        let _ = x;
        alone_only(self.name(), self.rank_info(), "reduce")
    }
    /// A row-parallel block's residual step on a tensor-parallel group: `x += input · wᵀ` where
    /// `w` holds this rank's input columns, so each rank's product is a partial sum. Rank 0 adds
    /// its part to the stream, the others contribute theirs alone, and the all-reduce makes every
    /// rank's `x` the whole stream again. Alone, it is [`Backend::linear_residual`]. Backends may
    /// fuse the product with the all-reduce; the values must be those of this default.
    fn linear_residual_all_reduce(
        &self,
        input: &Self::Tensor,
        w: &Self::Matrix,
        product: &mut Self::Tensor,
        x: &mut Self::Tensor,
    ) -> Result<()> {
        split_linear_residual(self, input, w, product, x)
    }
    /// [`Backend::linear_residual_all_reduce`] where the next use of `x` is the RMSNorm `next`,
    /// in the next `norm_*` call ([`Backend::norm_linear`], [`Backend::norm_linear_swiglu`],
    /// [`Backend::norm_qkv_rope_write`]) with the same `x`, weight, eps and `normed` scratch, and
    /// nothing writes `x` or `normed` in between: a backend may compute that norm's parts in
    /// this step's epilogue, so that the norm costs no pass of its own. The default is the plain
    /// step.
    fn linear_residual_before_norm(
        &self,
        input: &Self::Tensor,
        w: &Self::Matrix,
        product: &mut Self::Tensor,
        x: &mut Self::Tensor,
        next: NextNorm<'_, Self::Tensor>,
    ) -> Result<()> {
        let _ = next;
        self.linear_residual_all_reduce(input, w, product, x)
    }
    /// Called by a rank that failed where its peers may be waiting in a collective: they get an
    /// error instead of waiting forever. The group is unusable afterwards.
    fn abort_collectives(&self) {}
    /// Every rank's `batch` takes the tokens rank 0 sampled for it ([`Backend::sample`] runs on
    /// rank 0 only), so that each rank resolves the next step's [`CARRIED_TOKEN`] ids itself and
    /// a split model's steps can be issued ahead of their tokens. A collective: every rank calls
    /// it after the same steps. Nothing to do alone.
    fn broadcast_sampled(&self, batch: &Self::Batch) -> Result<()> {
        let _ = batch;
        alone_only(self.name(), self.rank_info(), "share sampled tokens")
    }
    /// Splits the columns of `x` into `a`, `b` and `c` (in that order), e.g. a fused QKV product.
    fn split3(
        &self,
        x: &Self::Tensor,
        a: &mut Self::Tensor,
        b: &mut Self::Tensor,
        c: &mut Self::Tensor,
    ) -> Result<()>;
    /// `out[i] = x[outputs[i]]` for the batch's output rows.
    fn gather_outputs(
        &self,
        x: &Self::Tensor,
        batch: &Self::Batch,
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// The output rows' logits, `x · headᵀ` in f32, kept in the batch.
    fn logits(&self, x: &Self::Tensor, head: &Self::Matrix, batch: &Self::Batch) -> Result<()>;
    /// [`Backend::embed`] from this rank's rows of a table split over the vocabulary
    /// ([`vocab_part`](crate::comm::vocab_part) of the whole `vocab`): tokens outside them embed
    /// as zeros, so that an all-reduce then makes the whole embedding on every rank. Alone, the
    /// table is whole and this is [`Backend::embed`].
    fn embed_split(
        &self,
        table: &Self::Matrix,
        batch: &Self::Batch,
        vocab: usize,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let _ = vocab;
        alone_only(self.name(), self.rank_info(), "embed from a split table")?;
        self.embed(table, batch, out)
    }
    /// [`Backend::logits`] of a head split over the vocabulary: `head` holds this rank's rows
    /// ([`vocab_part`](crate::comm::vocab_part) of the whole `vocab`). Every rank computes its
    /// part and rank 0 gathers them all, in vocabulary order, where [`Backend::logits`] leaves
    /// logits; the other ranks keep none. A collective. Alone, [`Backend::logits`].
    fn logits_split(
        &self,
        x: &Self::Tensor,
        head: &Self::Matrix,
        batch: &Self::Batch,
        vocab: usize,
    ) -> Result<()> {
        let _ = vocab;
        alone_only(self.name(), self.rank_info(), "gather logits")?;
        self.logits(x, head, batch)
    }
    /// Chooses each output row's token from its logits by the batch's sampling (penalizing the
    /// logits in place); an error if the batch was prepared without sampling.
    fn sample(&self, batch: &Self::Batch) -> Result<()>;
    /// The output rows' logits, `[outputs, vocab]` row-major.
    fn read_logits(&self, batch: &Self::Batch) -> Result<Vec<f32>>;
    /// The output rows' sampled tokens.
    fn read_tokens(&self, batch: &Self::Batch) -> Result<Vec<u32>>;
    /// Starts bringing the tokens [`Backend::sample`] chose back to the host and returns without
    /// waiting for the step; the next step may be issued (with [`CARRIED_TOKEN`] ids naming these
    /// tokens) before [`TokensLater::wait`]. By default the tokens are read at once.
    fn read_tokens_later(&self, batch: &Self::Batch) -> Result<TokensLater> {
        let tokens = self.read_tokens(batch)?;
        Ok(TokensLater::ready(SampledTokens {
            tokens,
            device_micros: self.step_device_micros(batch),
        }))
    }
    /// Moves a sequence's kept keys and values to its leading key indices ([`KvCompaction`]),
    /// with their eviction scores.
    fn compact_kv(&self, cache: &mut Self::KvCache, compaction: &KvCompaction) -> Result<()>;
    /// Chooses each (layer, KV head)'s kept keys by a rule and compacts them like
    /// [`Backend::compact_kv`]. This default reads the scores back (when the rule needs them) and
    /// chooses on the host; a device backend chooses where the scores are.
    fn compact_kv_by_rule(
        &self,
        cache: &mut Self::KvCache,
        compaction: &KvRuleCompaction,
    ) -> Result<()> {
        let KvRuleCompaction {
            block_table,
            dims,
            kept_per_row,
            rule,
        } = *compaction;
        let n = dims.keys;
        let k = kept_per_row.min(n);
        let scores = match rule.needs_scores(n, k) {
            true => self.read_kv_scores(cache, block_table, n)?,
            false => Vec::new(),
        };
        let rows = dims
            .rows()
            .map_err(|e| BackendError::Unsupported(e.to_string()))?;
        let mut kept = Vec::with_capacity(rows * k);
        let mut row = Vec::with_capacity(k);
        for r in 0..rows {
            let s = scores.get(r * n..(r + 1) * n).unwrap_or(&[]);
            rule.select_into(s, n, k, &mut row);
            kept.extend(row.iter().map(|&j| j as u32));
        }
        self.compact_kv(
            cache,
            &KvCompaction {
                block_table,
                kept: &kept,
                kept_per_row: k,
            },
        )
    }
    /// Whether [`Backend::accumulate_kv_scores`] is implemented for caches of `spec` (else
    /// eviction policies that need scores are refused up front).
    fn supports_kv_scores(&self, spec: &KvCacheSpec) -> bool {
        let _ = spec;
        false
    }
    /// Adds the eviction scores of `layer` for the batch's scored spans ([`KvScoring`]), from
    /// the rotated queries `q` (`[tokens, n_heads * head_dim]`) and the keys in `cache`, after
    /// the layer's [`Backend::attention`] (a backend may take decode rows' logits from it). A
    /// key's score sums over the query heads of its KV head; a key is scored from the step it is
    /// written in (scores of newly written keys start at 0).
    #[allow(clippy::too_many_arguments)]
    fn accumulate_kv_scores(
        &self,
        q: &Self::Tensor,
        cache: &mut Self::KvCache,
        layer: usize,
        n_heads: usize,
        batch: &Self::Batch,
        scale: f32,
    ) -> Result<()> {
        let _ = (q, cache, layer, n_heads, batch, scale);
        Err(BackendError::Unsupported(format!(
            "KV eviction scores are not implemented on {}",
            self.name()
        )))
    }
    /// The accumulated eviction scores of a sequence's first `keys` keys, `[layers][kv_heads][keys]`.
    fn read_kv_scores(
        &self,
        cache: &Self::KvCache,
        block_table: &[u32],
        keys: usize,
    ) -> Result<Vec<f32>> {
        let _ = (cache, block_table, keys);
        Err(BackendError::Unsupported(format!(
            "KV eviction scores are not implemented on {}",
            self.name()
        )))
    }
    /// Stores keys and values of the batch's tokens at their slots of `layer`.
    fn write_kv(
        &self,
        cache: &mut Self::KvCache,
        layer: usize,
        k: &Self::Tensor,
        v: &Self::Tensor,
        batch: &Self::Batch,
    ) -> Result<()>;
    /// Multiplies each `head_dim`-wide row of `x` by the Hadamard matrix
    /// ([`turbo_attention::kv_quant::hadamard_rotate`]), then by `scale`: how
    /// [`Backend::qkv_rope_write`] takes queries and keys into the basis of a cache whose dtype
    /// [`KvDtype::rotates_keys`](turbo_attention::KvDtype::rotates_keys).
    fn hadamard_heads(&self, x: &mut Self::Tensor, head_dim: usize, scale: f32) -> Result<()> {
        let _ = (x, head_dim, scale);
        Err(BackendError::Unsupported(format!(
            "Hadamard rotations are not implemented on {}",
            self.name()
        )))
    }
    /// The attention block's step after the fused QKV product (`qkv` rows are `[q | k | v]`):
    /// `q` receives the rotated queries, and the rotated keys and the values are stored at the
    /// batch's slots of `layer`. `k` and `v` are scratch a backend may use (this default splits
    /// into them, rotates and writes; a GPU does it all in one kernel). A cache whose dtype
    /// [`rotates_keys`](turbo_attention::KvDtype::rotates_keys) gets its keys in the Hadamard
    /// basis, and `q` comes out in it too (scaled so that every `q·k` is kept):
    /// [`Backend::attention`] and the eviction scores take queries as this step leaves them.
    #[allow(clippy::too_many_arguments)]
    fn qkv_rope_write(
        &self,
        qkv: &Self::Tensor,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &mut Self::Tensor,
        head_dim: usize,
        cache: &mut Self::KvCache,
        layer: usize,
        batch: &Self::Batch,
    ) -> Result<()> {
        self.split3(qkv, q, k, v)?;
        self.rope(q, head_dim, batch)?;
        self.rope(k, head_dim, batch)?;
        if self.kv_spec(cache).dtype.rotates_keys(head_dim) {
            let query_scale = turbo_attention::kv_quant::rotated_query_scale(head_dim);
            self.hadamard_heads(q, head_dim, query_scale)?;
            self.hadamard_heads(k, head_dim, 1.0)?;
        }
        self.write_kv(cache, layer, k, v, batch)
    }
    /// The attention block's first half: [`Backend::norm_linear`] with the fused QKV weight,
    /// then [`Backend::qkv_rope_write`]. `normed`, `qkv`, `k` and `v` are scratch (a GPU rotates
    /// and stores straight from the product at decode).
    #[allow(clippy::too_many_arguments)]
    fn norm_qkv_rope_write(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
        normed: &mut Self::Tensor,
        wqkv: &Self::Matrix,
        qkv: &mut Self::Tensor,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &mut Self::Tensor,
        head_dim: usize,
        cache: &mut Self::KvCache,
        layer: usize,
        batch: &Self::Batch,
    ) -> Result<()> {
        self.norm_linear(x, weight, eps, normed, wqkv, qkv)?;
        self.qkv_rope_write(qkv, q, k, v, head_dim, cache, layer, batch)
    }
    /// Causal attention of the batch's queries over each sequence's cached KV.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Tensor,
        cache: &Self::KvCache,
        layer: usize,
        n_heads: usize,
        batch: &Self::Batch,
        scale: f32,
        out: &mut Self::Tensor,
    ) -> Result<()>;
}
