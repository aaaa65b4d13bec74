//! The interface every compute backend implements, so that a model's forward pass is written once.

use crate::cpu::KvCacheSpec;
use crate::WeightMatrix;
use thiserror::Error;
use turbo_attention::QuerySpan;

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

/// What a forward pass tells the backend about its batch, once, before the layers run.
#[derive(Clone, Copy, Debug)]
pub struct BatchLayout<'a> {
    /// Position of each token in its sequence (for RoPE).
    pub positions: &'a [u32],
    /// KV-cache slot of each token (`block * block_size + offset`).
    pub slots: &'a [u32],
    /// Which rows belong to which sequence, and the blocks holding its history.
    pub spans: &'a [QuerySpan<'a>],
    /// RoPE inverse frequencies, one per rotated pair.
    pub inv_freq: &'a [f32],
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
    /// A [`BatchLayout`] made resident (e.g. uploaded once per forward pass, not once per layer).
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
    /// A `[rows, cols]` tensor filled from host data.
    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// A `[rows, cols]` tensor whose contents are unspecified until written.
    fn tensor(&self, rows: usize, cols: usize) -> Result<Self::Tensor>;
    fn download(&self, t: &Self::Tensor) -> Result<Vec<f32>>;
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
    fn prepare_batch(&self, layout: &BatchLayout) -> Result<Self::Batch>;

    /// Rows `ids` of the embedding table, decoded to f32.
    fn embed(&self, table: &Self::Matrix, ids: &[u32], out: &mut Self::Tensor) -> Result<()>;
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// `out = x · wᵀ`.
    fn linear(&self, x: &Self::Tensor, w: &Self::Matrix, out: &mut Self::Tensor) -> Result<()>;
    /// Rotary embedding of every head of `x` (`[tokens, heads · head_dim]`), interleaved pairs,
    /// at the batch's positions.
    fn rope(&self, x: &mut Self::Tensor, head_dim: usize, batch: &Self::Batch) -> Result<()>;
    /// `gate = silu(gate) · up`.
    fn silu_mul(&self, gate: &mut Self::Tensor, up: &Self::Tensor) -> Result<()>;
    /// SwiGLU of a fused product: each row of `gate_up` is `[gate | up]`; `out = silu(gate) · up`.
    fn swiglu(&self, gate_up: &Self::Tensor, out: &mut Self::Tensor) -> Result<()>;
    /// `x += y`.
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    /// The residual step of a block: `x += y`, then `out = rms_norm(x) · weight`.
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// Splits the columns of `x` into `a`, `b` and `c` (in that order), e.g. a fused QKV product.
    fn split3(
        &self,
        x: &Self::Tensor,
        a: &mut Self::Tensor,
        b: &mut Self::Tensor,
        c: &mut Self::Tensor,
    ) -> Result<()>;
    /// `out[i] = x[rows[i]]`.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize], out: &mut Self::Tensor) -> Result<()>;
    /// Stores keys and values of the batch's tokens at their slots of `layer`.
    fn write_kv(
        &self,
        cache: &mut Self::KvCache,
        layer: usize,
        k: &Self::Tensor,
        v: &Self::Tensor,
        batch: &Self::Batch,
    ) -> Result<()>;
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
