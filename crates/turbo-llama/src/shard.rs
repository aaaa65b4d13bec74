//! How a LLaMA is split over the ranks of a tensor-parallel group (Megatron-LM's layout).
//!
//! Each rank holds a slice of every layer: its query heads and the KV heads they read (W_q, W_k,
//! W_v split by output rows: column-parallel), the matching columns of W_o (row-parallel: its
//! product is a partial sum of the residual update), and a slice of the FFN (W_gate and W_up by
//! rows, W_down by columns). The two row-parallel products are the only places ranks meet: an
//! all-reduce after each makes the residual stream whole again, so every other op (norms, RoPE,
//! attention over the rank's own heads, SwiGLU) runs on local data. The KV cache of a rank holds
//! its KV heads only. With fewer KV heads than ranks, each KV head is held by the ranks whose
//! query heads read it (replicated). Norms are replicated. The embedding and the LM head are split
//! over the vocabulary ([`vocab_part`]): a rank embeds the tokens of its rows (zeros for the
//! others) and an all-reduce makes the embedding whole; each rank computes the logits of its rows
//! and rank 0 gathers them, samples, and gives its peers the sampled tokens on the devices when
//! the next step is issued before the host has read them. A tied head is the embedding's part.

use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};
use crate::weights::{HostWeights, LayerWeights, LlamaWeights};
use rayon::prelude::*;
use std::ops::Range;
use turbo_core::comm::vocab_part;
use turbo_core::WeightMatrix;

/// The split of one model over `world` ranks; made only for splits that divide evenly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    pub world: usize,
    /// Query heads of each rank.
    pub heads_per_rank: usize,
    /// KV heads each rank holds (1 when KV heads are replicated).
    pub kv_heads_per_rank: usize,
    /// Ranks holding each KV head (1 unless there are fewer KV heads than ranks).
    pub kv_replicas: usize,
    /// FFN width of each rank.
    pub ffn_per_rank: usize,
}

impl ShardPlan {
    /// The plan for `config` over `world` ranks, or why the model cannot be split so.
    pub fn new(config: &LlamaConfig, world: usize) -> Result<Self> {
        let refuse = |why: String| {
            Err(LlamaError::Config(format!(
                "cannot split the model over {world} ranks: {why}"
            )))
        };
        if world == 0 {
            return refuse("a group needs at least one rank".into());
        }
        let (h, kv, f) = (config.n_heads, config.n_kv_heads, config.intermediate_size);
        if !h.is_multiple_of(world) {
            return refuse(format!("its {h} attention heads do not divide by {world}"));
        }
        if config.vocab_size < world {
            return refuse(format!(
                "its vocabulary of {} is smaller",
                config.vocab_size
            ));
        }
        if !f.is_multiple_of(world) {
            return refuse(format!("its FFN width {f} does not divide by {world}"));
        }
        let (kv_heads_per_rank, kv_replicas) = if kv >= world {
            if !kv.is_multiple_of(world) {
                return refuse(format!("its {kv} KV heads do not divide by {world}"));
            }
            (kv / world, 1)
        } else {
            if !world.is_multiple_of(kv) {
                return refuse(format!(
                    "{world} ranks are not a multiple of its {kv} KV heads"
                ));
            }
            (1, world / kv)
        };
        Ok(ShardPlan {
            world,
            heads_per_rank: h / world,
            kv_heads_per_rank,
            kv_replicas,
            ffn_per_rank: f / world,
        })
    }

    /// The configuration each rank's layers have: the whole model's, with its own head counts
    /// and FFN width.
    pub fn rank_config(&self, config: &LlamaConfig) -> LlamaConfig {
        LlamaConfig {
            n_heads: self.heads_per_rank,
            n_kv_heads: self.kv_heads_per_rank,
            intermediate_size: self.ffn_per_rank,
            ..config.clone()
        }
    }

    /// Query heads of `rank`.
    pub fn heads(&self, rank: usize) -> Range<usize> {
        rank * self.heads_per_rank..(rank + 1) * self.heads_per_rank
    }

    /// KV heads held by `rank`.
    pub fn kv_heads(&self, rank: usize) -> Range<usize> {
        let first = rank / self.kv_replicas * self.kv_heads_per_rank;
        first..first + self.kv_heads_per_rank
    }

    /// FFN features of `rank`.
    pub fn ffn(&self, rank: usize) -> Range<usize> {
        rank * self.ffn_per_rank..(rank + 1) * self.ffn_per_rank
    }

    /// Token ids whose embedding and LM head rows `rank` holds.
    pub fn vocab(&self, config: &LlamaConfig, rank: usize) -> Range<usize> {
        vocab_part(config.vocab_size, rank, self.world)
    }

    /// The weights `rank` holds. Column-parallel slices share the host bytes (memory-mapped
    /// files stay mapped); row-parallel ones are copied, and must fall on block boundaries of a
    /// quantized type.
    pub fn shard(
        &self,
        config: &LlamaConfig,
        host: &HostWeights,
        rank: usize,
    ) -> Result<HostWeights> {
        if rank >= self.world {
            return Err(LlamaError::Config(format!(
                "rank {rank} of a group of {}",
                self.world
            )));
        }
        let hd = config.head_dim;
        let scale = |r: Range<usize>| r.start * hd..r.end * hd;
        let (q, kv, ffn) = (
            scale(self.heads(rank)),
            scale(self.kv_heads(rank)),
            self.ffn(rank),
        );
        let cut = |name: &str, layer: usize, m: &WeightMatrix, r: Range<usize>, rows: bool| {
            let part = match rows {
                true => m.row_range(r),
                false => m.col_range(r),
            };
            part.map_err(|e| {
                LlamaError::Config(format!(
                    "cannot split layer {layer}'s {name} over {} ranks: {e}",
                    self.world
                ))
            })
        };
        // Layers in parallel: the row-parallel slices are copies, tens of GB for a 70B model.
        let layers = host
            .layers
            .par_iter()
            .enumerate()
            .map(|(i, l)| -> Result<_> {
                Ok(LayerWeights {
                    attn_norm: l.attn_norm.clone(),
                    wq: cut("W_q", i, &l.wq, q.clone(), true)?,
                    wk: cut("W_k", i, &l.wk, kv.clone(), true)?,
                    wv: cut("W_v", i, &l.wv, kv.clone(), true)?,
                    wo: cut("W_o", i, &l.wo, q.clone(), false)?,
                    ffn_norm: l.ffn_norm.clone(),
                    w_gate: cut("W_gate", i, &l.w_gate, ffn.clone(), true)?,
                    w_up: cut("W_up", i, &l.w_up, ffn.clone(), true)?,
                    w_down: cut("W_down", i, &l.w_down, ffn.clone(), false)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let vocab = self.vocab(config, rank);
        let rows = |name: &str, m: &WeightMatrix| {
            m.row_range(vocab.clone()).map_err(|e| {
                LlamaError::Config(format!(
                    "cannot split the {name} over {} ranks: {e}",
                    self.world
                ))
            })
        };
        Ok(LlamaWeights {
            embed: rows("embedding", &host.embed)?,
            layers,
            final_norm: host.final_norm.clone(),
            lm_head: host
                .lm_head
                .as_ref()
                .map(|m| rows("LM head", m))
                .transpose()?,
        })
    }

    /// Bytes of weights `rank` holds, as stored in the file: its slices of the layers, of the
    /// embedding and of an untied LM head, and the replicated norms.
    pub fn bytes_of_rank(&self, config: &LlamaConfig, host: &HostWeights, rank: usize) -> u64 {
        let len = |m: &WeightMatrix| m.data.len() as u64;
        let world = self.world as u64;
        let kv_share = |m: &WeightMatrix| {
            len(m) * self.kv_heads_per_rank as u64 / config.n_kv_heads.max(1) as u64
        };
        let layers: u64 = host
            .layers
            .iter()
            .map(|l| {
                (len(&l.wq) + len(&l.wo) + len(&l.w_gate) + len(&l.w_up) + len(&l.w_down)) / world
                    + kv_share(&l.wk)
                    + kv_share(&l.wv)
                    + 4 * (l.attn_norm.len() + l.ffn_norm.len()) as u64
            })
            .sum();
        let vocab = self.vocab(config, rank).len() as u64;
        let rows_share = |m: &WeightMatrix| vocab * m.row_bytes() as u64;
        layers
            + rows_share(&host.embed)
            + host.lm_head.as_ref().map_or(0, rows_share)
            + 4 * host.final_norm.len() as u64
    }
}
