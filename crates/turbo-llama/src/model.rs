//! The LLaMA forward pass, written once over any [`Backend`].

use crate::config::LlamaConfig;
use crate::error::Result;
use crate::weights::HostWeights;
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

/// A transformer block as placed on a backend: W_q/W_k/W_v and W_gate/W_up fused so that each
/// pair of products sharing an input is one product.
struct DeviceLayer<B: Backend> {
    attn_norm: B::Tensor,
    wqkv: B::Matrix,
    wo: B::Matrix,
    ffn_norm: B::Tensor,
    w_gate_up: B::Matrix,
    w_down: B::Matrix,
}

/// A LLaMA model resident on backend `B`.
pub struct Llama<B: Backend> {
    pub config: LlamaConfig,
    backend: B,
    embed: B::Matrix,
    layers: Vec<DeviceLayer<B>>,
    final_norm: B::Tensor,
    /// `None` when tied to the embedding.
    lm_head: Option<B::Matrix>,
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
                Ok(DeviceLayer {
                    attn_norm: vector(&l.attn_norm)?,
                    wqkv: backend.upload_stacked(&[&l.wq, &l.wk, &l.wv])?,
                    wo: backend.upload_matrix(&l.wo)?,
                    ffn_norm: vector(&l.ffn_norm)?,
                    w_gate_up: backend.upload_stacked(&[&l.w_gate, &l.w_up])?,
                    w_down: backend.upload_matrix(&l.w_down)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = backend.upload_matrix(&host.embed)?;
        let final_norm = vector(&host.final_norm)?;
        let lm_head = host
            .lm_head
            .as_ref()
            .map(|m| backend.upload_matrix(m))
            .transpose()?;
        Ok(Llama {
            config: config.clone(),
            inv_freq: config.rope_inv_freq(),
            backend,
            embed,
            layers,
            final_norm,
            lm_head,
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
        b.embed(&self.embed, &ids, &mut x)?;
        let mut h = b.tensor(n, d)?;
        let mut o = b.tensor(n, d)?;
        let mut qkv = b.tensor(n, c.q_dim() + 2 * c.kv_dim())?;
        let mut q = b.tensor(n, c.q_dim())?;
        let mut k = b.tensor(n, c.kv_dim())?;
        let mut v = b.tensor(n, c.kv_dim())?;
        let mut attn = b.tensor(n, c.q_dim())?;
        let mut gate_up = b.tensor(n, 2 * c.intermediate_size)?;
        let mut act = b.tensor(n, c.intermediate_size)?;

        let eps = c.rms_norm_eps;
        b.rms_norm(&x, &self.layers[0].attn_norm, eps, &mut h)?;
        for (i, layer) in self.layers.iter().enumerate() {
            // Attention block; `h` holds the normalised input.
            b.linear(&h, &layer.wqkv, &mut qkv)?;
            b.split3(&qkv, &mut q, &mut k, &mut v)?;
            b.rope(&mut q, hd, &batch_layout)?;
            b.rope(&mut k, hd, &batch_layout)?;
            b.write_kv(cache, i, &k, &v, &batch_layout)?;
            b.attention(&q, cache, i, c.n_heads, &batch_layout, scale, &mut attn)?;
            b.linear(&attn, &layer.wo, &mut o)?;
            b.add_rms_norm(&mut x, &o, &layer.ffn_norm, eps, &mut h)?;
            // Feed-forward block (SwiGLU).
            b.linear(&h, &layer.w_gate_up, &mut gate_up)?;
            b.swiglu(&gate_up, &mut act)?;
            b.linear(&act, &layer.w_down, &mut o)?;
            match self.layers.get(i + 1) {
                Some(next) => b.add_rms_norm(&mut x, &o, &next.attn_norm, eps, &mut h)?,
                None => b.add(&mut x, &o)?,
            }
        }

        let rows: Vec<usize> = match which {
            Logits::All => (0..n).collect(),
            Logits::Last => spans.iter().map(|s| s.q_start + s.n_q - 1).collect(),
        };
        let mut last = b.tensor(rows.len(), d)?;
        b.gather_rows(&x, &rows, &mut last)?;
        let mut normed = b.tensor(rows.len(), d)?;
        b.rms_norm(&last, &self.final_norm, eps, &mut normed)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
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
