//! The LLaMA forward pass, written once over any [`Backend`].

use crate::config::LlamaConfig;
use crate::error::Result;
use crate::weights::{HostWeights, LayerWeights, LlamaWeights};
use turbo_attention::QuerySpan;
use turbo_core::backend::BatchLayout;
use turbo_core::cpu::KvCacheSpec;
use turbo_core::Backend;

/// One sequence's part of a batch: its newest tokens, which continue a history already in the KV
/// cache.
#[derive(Clone, Debug)]
pub struct SequenceChunk {
    /// Tokens to run, continuing the sequence.
    pub tokens: Vec<u32>,
    /// Tokens of the sequence whose KV is already cached (the position of `tokens[0]`).
    pub start: usize,
    /// Blocks holding the sequence's KV, covering `start + tokens.len()` tokens.
    pub block_table: Vec<u32>,
}

/// Which logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// The last token of each sequence: all that generation needs.
    Last,
    /// Every token of the batch, for scoring and tests.
    All,
}

/// A LLaMA model resident on backend `B`.
pub struct Llama<B: Backend> {
    pub config: LlamaConfig,
    backend: B,
    weights: LlamaWeights<B::Matrix, B::Tensor>,
    inv_freq: Vec<f32>,
}

impl<B: Backend> Llama<B> {
    /// Places host weights on the backend.
    pub fn new(backend: B, config: &LlamaConfig, host: &HostWeights) -> Result<Self> {
        let d = config.hidden_size;
        let vector = |v: &Vec<f32>| backend.upload(v, 1, d);
        let layers = host
            .layers
            .iter()
            .map(|l| -> Result<_> {
                Ok(LayerWeights {
                    attn_norm: vector(&l.attn_norm)?,
                    wq: backend.upload_matrix(&l.wq)?,
                    wk: backend.upload_matrix(&l.wk)?,
                    wv: backend.upload_matrix(&l.wv)?,
                    wo: backend.upload_matrix(&l.wo)?,
                    ffn_norm: vector(&l.ffn_norm)?,
                    w_gate: backend.upload_matrix(&l.w_gate)?,
                    w_up: backend.upload_matrix(&l.w_up)?,
                    w_down: backend.upload_matrix(&l.w_down)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let weights = LlamaWeights {
            embed: backend.upload_matrix(&host.embed)?,
            layers,
            final_norm: vector(&host.final_norm)?,
            lm_head: host
                .lm_head
                .as_ref()
                .map(|m| backend.upload_matrix(m))
                .transpose()?,
        };
        Ok(Llama {
            config: config.clone(),
            inv_freq: config.rope_inv_freq(),
            backend,
            weights,
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The KV cache shape this model needs, for `max_blocks` blocks of `block_size` tokens.
    pub fn kv_spec(&self, block_size: usize, max_blocks: usize) -> KvCacheSpec {
        KvCacheSpec {
            n_layers: self.config.n_layers,
            n_kv_heads: self.config.n_kv_heads,
            head_dim: self.config.head_dim,
            block_size,
            max_blocks,
        }
    }

    /// Runs the new tokens of every sequence in `batch`, appending their KV to `cache`, and returns
    /// logits (`[rows, vocab]` row-major) as chosen by `which`.
    pub fn forward(
        &self,
        batch: &[SequenceChunk],
        cache: &mut B::KvCache,
        which: Logits,
    ) -> Result<Vec<f32>> {
        self.backend.run(|| self.forward_inner(batch, cache, which))
    }

    fn forward_inner(
        &self,
        batch: &[SequenceChunk],
        cache: &mut B::KvCache,
        which: Logits,
    ) -> Result<Vec<f32>> {
        let b = &self.backend;
        let c = &self.config;
        let block_size = b.kv_spec(cache).block_size;
        let (ids, positions, slots, spans) = flatten(batch, block_size);
        let n = ids.len();
        let (d, hd) = (c.hidden_size, c.head_dim);
        let scale = 1.0 / (hd as f32).sqrt();

        let spans: Vec<QuerySpan> = spans
            .iter()
            .zip(batch)
            .map(|(&(q_start, n_q, kv_len), s)| QuerySpan {
                q_start,
                n_q,
                kv_len,
                block_table: &s.block_table,
            })
            .collect();
        let batch_layout = b.prepare_batch(&BatchLayout {
            positions: &positions,
            slots: &slots,
            spans: &spans,
            inv_freq: &self.inv_freq,
        })?;
        let mut x = b.tensor(n, d)?;
        b.embed(&self.weights.embed, &ids, &mut x)?;
        let mut h = b.tensor(n, d)?;
        let mut q = b.tensor(n, c.q_dim())?;
        let mut k = b.tensor(n, c.kv_dim())?;
        let mut v = b.tensor(n, c.kv_dim())?;
        let mut attn = b.tensor(n, c.q_dim())?;
        let mut gate = b.tensor(n, c.intermediate_size)?;
        let mut up = b.tensor(n, c.intermediate_size)?;

        for (i, layer) in self.weights.layers.iter().enumerate() {
            // Attention block.
            b.rms_norm(&x, &layer.attn_norm, c.rms_norm_eps, &mut h)?;
            b.linear(&h, &layer.wq, &mut q)?;
            b.linear(&h, &layer.wk, &mut k)?;
            b.linear(&h, &layer.wv, &mut v)?;
            b.rope(&mut q, hd, &batch_layout)?;
            b.rope(&mut k, hd, &batch_layout)?;
            b.write_kv(cache, i, &k, &v, &batch_layout)?;
            b.attention(&q, cache, i, c.n_heads, &batch_layout, scale, &mut attn)?;
            b.linear(&attn, &layer.wo, &mut h)?;
            b.add(&mut x, &h)?;
            // Feed-forward block (SwiGLU).
            b.rms_norm(&x, &layer.ffn_norm, c.rms_norm_eps, &mut h)?;
            b.linear(&h, &layer.w_gate, &mut gate)?;
            b.linear(&h, &layer.w_up, &mut up)?;
            b.silu_mul(&mut gate, &up)?;
            b.linear(&gate, &layer.w_down, &mut h)?;
            b.add(&mut x, &h)?;
        }

        let rows: Vec<usize> = match which {
            Logits::All => (0..n).collect(),
            Logits::Last => spans.iter().map(|s| s.q_start + s.n_q - 1).collect(),
        };
        let mut last = b.tensor(rows.len(), d)?;
        b.gather_rows(&x, &rows, &mut last)?;
        let mut normed = b.tensor(rows.len(), d)?;
        b.rms_norm(&last, &self.weights.final_norm, c.rms_norm_eps, &mut normed)?;
        let head = self.weights.lm_head.as_ref().unwrap_or(&self.weights.embed);
        let mut logits = b.tensor(rows.len(), c.vocab_size)?;
        b.linear(&normed, head, &mut logits)?;
        Ok(b.download(&logits)?)
    }
}

/// Token ids, positions, KV slots, and `(q_start, n_q, kv_len)` per sequence.
type Flat = (Vec<u32>, Vec<u32>, Vec<u32>, Vec<(usize, usize, usize)>);

fn flatten(batch: &[SequenceChunk], block_size: usize) -> Flat {
    let (mut ids, mut positions, mut slots, mut spans) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for s in batch {
        let q_start = ids.len();
        let end = s.start + s.tokens.len();
        assert!(
            end <= s.block_table.len() * block_size,
            "block table holds {} blocks, too few for {end} tokens",
            s.block_table.len()
        );
        ids.extend_from_slice(&s.tokens);
        for p in s.start..end {
            positions.push(p as u32);
            slots.push(s.block_table[p / block_size] * block_size as u32 + (p % block_size) as u32);
        }
        spans.push((q_start, s.tokens.len(), end));
    }
    (ids, positions, slots, spans)
}
