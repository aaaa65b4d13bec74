//! The LLaMA forward pass, written once over any [`Backend`].

use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};
use crate::peers::{KvWork, PeerCommand, PeerStep, Peers};
use crate::shard::ShardPlan;
use crate::weights::HostWeights;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Instant;
use turbo_attention::QuerySpan;
use turbo_core::backend::{BatchLayout, NextNorm, Sampling, TokensLater};
use turbo_core::comm::RankInfo;
use turbo_core::cpu::KvCacheSpec;
use turbo_core::sampling::{PenaltyLists, SampleParams};
use turbo_core::{Backend, BackendError, KvDtype, KvScoring};

/// One sequence's part of a batch: its newest tokens, which continue a history already in the KV
/// cache.
#[derive(Clone, Debug)]
pub struct SequenceChunk {
    /// Tokens to run, continuing the sequence.
    pub tokens: Vec<u32>,
    /// Keys of the sequence already cached: the key index `tokens[0]`'s KV goes to. The queries
    /// attend to these keys and, causally, to the chunk's own.
    pub start: usize,
    /// The position of `tokens[0]` in the sequence (for RoPE): `start`, unless KV eviction
    /// dropped keys, when it is `start` plus the number of keys dropped.
    pub position: usize,
    /// Blocks holding the sequence's KV, covering `start + tokens.len()` keys.
    pub block_table: Vec<u32>,
    /// Whether (and how) the chunk's queries add to its keys' eviction scores.
    pub scoring: Option<KvScoring>,
}

impl SequenceChunk {
    /// A chunk of a sequence whose keys were never evicted (its key index is its position).
    pub fn new(tokens: Vec<u32>, start: usize, block_table: Vec<u32>) -> Self {
        SequenceChunk {
            tokens,
            start,
            position: start,
            block_table,
            scoring: None,
        }
    }
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

/// The buffers of a forward pass, kept from step to step: their storage only grows, so a step
/// of a shape seen before runs on the same buffers (which a backend replaying recorded steps
/// needs) and allocates nothing.
struct Workspace<B: Backend> {
    batch: B::Batch,
    x: B::Tensor,
    h: B::Tensor,
    o: B::Tensor,
    qkv: B::Tensor,
    q: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
    attn: B::Tensor,
    gate_up: B::Tensor,
    act: B::Tensor,
    last: B::Tensor,
    normed: B::Tensor,
}

impl<B: Backend> Workspace<B> {
    fn new(b: &B, c: &LlamaConfig) -> Result<Self> {
        let d = c.hidden_size;
        Ok(Workspace {
            batch: b.new_batch()?,
            x: b.tensor(0, d)?,
            h: b.tensor(0, d)?,
            o: b.tensor(0, d)?,
            qkv: b.tensor(0, c.q_dim() + 2 * c.kv_dim())?,
            q: b.tensor(0, c.q_dim())?,
            k: b.tensor(0, c.kv_dim())?,
            v: b.tensor(0, c.kv_dim())?,
            attn: b.tensor(0, c.q_dim())?,
            gate_up: b.tensor(0, 2 * c.intermediate_size)?,
            act: b.tensor(0, c.intermediate_size)?,
            last: b.tensor(0, d)?,
            normed: b.tensor(0, d)?,
        })
    }

    /// Sizes every buffer for `tokens` rows (`outputs` for the gathered ones); true if any
    /// storage was replaced.
    fn resize(&mut self, b: &B, tokens: usize, outputs: usize) -> Result<bool> {
        let mut moved = false;
        for t in [
            &mut self.x,
            &mut self.h,
            &mut self.o,
            &mut self.qkv,
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.attn,
            &mut self.gate_up,
            &mut self.act,
        ] {
            moved |= b.resize(t, tokens)?;
        }
        for t in [&mut self.last, &mut self.normed] {
            moved |= b.resize(t, outputs)?;
        }
        Ok(moved)
    }
}

/// What a forward pass hands back.
#[derive(Clone, Copy)]
pub(crate) enum Output {
    /// Nothing for the host: a tensor-parallel peer runs the layers and its part of the logits,
    /// which rank 0 gathers.
    Nothing,
    /// Nothing, on a peer whose rank 0 hands back [`Output::TokensLater`]: the peer takes rank
    /// 0's sampled tokens ([`Backend::broadcast_sampled`]) for the next step's carried ids.
    SharedTokens,
    Logits,
    Tokens,
    /// The tokens, and the logits they were chosen from (after the penalties).
    Both,
    /// The tokens, on their way back ([`Backend::read_tokens_later`]).
    TokensLater,
}

/// What a forward pass hands back: logits, tokens, or tokens still on their way.
#[derive(Default)]
pub(crate) struct Outputs {
    logits: Vec<f32>,
    tokens: Vec<u32>,
    later: Option<TokensLater>,
}

/// What one forward pass runs and hands back.
#[derive(Clone, Copy)]
pub(crate) struct Pass<'a> {
    pub batch: &'a [SequenceChunk],
    pub which: Logits,
    /// How to sample each output row, when the pass samples.
    pub sampling: Option<Sampling<'a>>,
    pub output: Output,
}

/// One rank's part of a model: all of it when alone, its shard under tensor parallelism.
pub(crate) struct RankModel<B: Backend> {
    /// The rank's shapes (its head counts and FFN width under tensor parallelism).
    config: LlamaConfig,
    pub(crate) backend: B,
    embed: B::Matrix,
    layers: Vec<DeviceLayer<B>>,
    final_norm: B::Tensor,
    /// `None` when tied to the embedding. Under tensor parallelism both hold the rank's rows of
    /// the vocabulary ([`crate::shard`]).
    lm_head: Option<B::Matrix>,
    inv_freq: Vec<f32>,
    /// `None` until the first forward pass.
    workspace: Mutex<Option<Workspace<B>>>,
    /// Where the last forward pass spent its time.
    times: Mutex<ForwardTimes>,
}

/// Where one forward pass spent its time, for step profiles: the host's part, the wait for its
/// results, and the device's own time when the backend measures it
/// ([`Llama::set_step_timing`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ForwardTimes {
    /// Preparing the batch (flattening, the upload, attention plans) and issuing its work.
    pub host_micros: f64,
    /// Waiting for the results (the sampled tokens or logits) to come back.
    pub wait_micros: f64,
    /// The device's time from the step's first work to its last, if measured.
    pub device_micros: Option<f64>,
}

/// A LLaMA model resident on backend `B`: on one device, or split over the ranks of a
/// tensor-parallel group ([`crate::shard`]), rank 0 on the calling thread and each other rank on
/// a thread of its own that runs the same steps.
pub struct Llama<B: Backend> {
    /// The whole model's configuration.
    pub config: LlamaConfig,
    rank: RankModel<B>,
    /// Ranks 1.. of a tensor-parallel group.
    peers: Option<Peers<B>>,
    /// How the KV caches this model makes store keys and values.
    kv_dtype: KvDtype,
}

impl<B: Backend> RankModel<B> {
    /// Places host weights (the rank's shard) on the backend.
    pub(crate) fn new(backend: B, config: &LlamaConfig, host: &HostWeights) -> Result<Self> {
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
        Ok(RankModel {
            times: Mutex::new(ForwardTimes::default()),
            config: config.clone(),
            inv_freq: config.rope_inv_freq(),
            backend,
            embed,
            layers,
            final_norm,
            lm_head,
            workspace: Mutex::new(None),
        })
    }
}

impl<B: Backend> RankModel<B> {
    /// Bytes this rank's weight matrices take on its backend.
    fn weight_bytes(&self) -> usize {
        let b = &self.backend;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                b.matrix_bytes(&l.wqkv)
                    + b.matrix_bytes(&l.wo)
                    + b.matrix_bytes(&l.w_gate_up)
                    + b.matrix_bytes(&l.w_down)
            })
            .sum();
        layers
            + b.matrix_bytes(&self.embed)
            + self.lm_head.as_ref().map_or(0, |h| b.matrix_bytes(h))
    }
}

impl<B: Backend> Llama<B> {
    /// Bytes the weight matrices take on the first rank's backend: the whole model's unless it
    /// is split (the norms' vectors are left out: a few KB a layer).
    pub fn weight_bytes(&self) -> usize {
        self.rank.weight_bytes()
    }

    /// Places host weights on the backend.
    pub fn new(backend: B, config: &LlamaConfig, host: &HostWeights) -> Result<Self> {
        if backend.rank_info().world != 1 {
            return Err(LlamaError::Config(
                "a backend of a tensor-parallel group needs Llama::new_parallel".into(),
            ));
        }
        Ok(Llama {
            config: config.clone(),
            rank: RankModel::new(backend, config, host)?,
            peers: None,
            kv_dtype: KvDtype::Full,
        })
    }

    /// Splits the model over `backends`, the ranks of one tensor-parallel group in rank order
    /// (each one's `rank_info` says so), each rank uploading its shard on a thread of its own.
    pub fn new_parallel(backends: Vec<B>, config: &LlamaConfig, host: &HostWeights) -> Result<Self>
    where
        B: 'static,
    {
        let world = backends.len();
        let plan = ShardPlan::new(config, world)?;
        for (r, b) in backends.iter().enumerate() {
            let info = b.rank_info();
            if info.rank != r || info.world != world {
                return Err(LlamaError::Config(format!(
                    "backend {r} of {world} is rank {} of a group of {}",
                    info.rank, info.world
                )));
            }
        }
        if world == 1 {
            let backend = backends.into_iter().next().expect("one backend");
            return Self::new(backend, config, host);
        }
        let rank_config = plan.rank_config(config);
        let mut backends = backends.into_iter();
        let first = backends.next().expect("a group has rank 0");
        let peers = Peers::start(backends.collect(), &plan, config, host)?;
        let shard = plan.shard(config, host, 0)?;
        let rank = RankModel::new(first, &rank_config, &shard);
        let ready = peers.wait_ready();
        let rank = rank?;
        ready?;
        Ok(Llama {
            config: config.clone(),
            rank,
            peers: Some(peers),
            kv_dtype: KvDtype::Full,
        })
    }

    /// Rank 0's backend (the only one when the model is not split).
    pub fn backend(&self) -> &B {
        &self.rank.backend
    }

    /// Where the last forward pass spent its time (rank 0's, for a split model).
    pub fn last_forward_times(&self) -> ForwardTimes {
        self.rank.times.lock().map(|t| *t).unwrap_or_default()
    }

    /// Measures the device time of every forward pass from now on (`on`), or stops: rank 0's
    /// backend records events around each step, a little work per step.
    pub fn set_step_timing(&self, on: bool) {
        self.rank.backend.set_step_timing(on);
    }

    /// Ranks the model is split over (1 when it is not).
    pub fn world(&self) -> usize {
        self.peers.as_ref().map_or(1, |p| p.len() + 1)
    }

    /// The KV cache shape each rank needs (its own KV heads), for `max_blocks` blocks of
    /// `block_size` tokens.
    pub fn kv_spec(&self, block_size: usize, max_blocks: usize) -> KvCacheSpec {
        KvCacheSpec {
            n_layers: self.rank.config.n_layers,
            n_kv_heads: self.rank.config.n_kv_heads,
            head_dim: self.rank.config.head_dim,
            block_size,
            max_blocks,
            dtype: self.kv_dtype,
        }
    }

    /// How the KV caches made from now on store keys and values (unquantized by default).
    pub fn set_kv_dtype(&mut self, dtype: KvDtype) {
        self.kv_dtype = dtype;
    }

    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    /// A KV cache of `max_blocks` blocks of `block_size` tokens for this model: rank 0's, which
    /// the forward passes take; each peer makes (and keeps) its own of the same shape, replacing
    /// the one it had, so a split model serves one cache at a time.
    pub fn kv_cache(&self, block_size: usize, max_blocks: usize) -> Result<B::KvCache> {
        let spec = self.kv_spec(block_size, max_blocks);
        let mine = || Ok(self.rank.backend.kv_cache(spec)?);
        match &self.peers {
            Some(peers) => Ok(peers.alongside(|| PeerCommand::NewCache(spec), mine)?.0),
            None => mine(),
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
        let pass = Pass {
            batch,
            which,
            sampling: None,
            output: Output::Logits,
        };
        Ok(self.run_ranks(pass, cache)?.logits)
    }

    /// Runs the new tokens of every sequence in `batch`, appending their KV to `cache`, and
    /// returns the token chosen for each sequence from its last token's logits by `params` (one
    /// per sequence, with its penalized tokens in `penalties`). Only the tokens leave the device.
    pub fn forward_sample(
        &self,
        batch: &[SequenceChunk],
        cache: &mut B::KvCache,
        params: &[SampleParams],
        penalties: &PenaltyLists,
    ) -> Result<Vec<u32>> {
        let pass = Pass {
            batch,
            which: Logits::Last,
            sampling: Some(Sampling { params, penalties }),
            output: Output::Tokens,
        };
        Ok(self.run_ranks(pass, cache)?.tokens)
    }

    /// [`forward_sample`](Self::forward_sample) that returns once the step is issued, with its
    /// tokens on their way back: the caller may issue the next step, naming these tokens by
    /// [`CARRIED_TOKEN`](turbo_core::backend::CARRIED_TOKEN) ids, before waiting for them. On a
    /// split model the peers take rank 0's tokens on their devices
    /// ([`Backend::broadcast_sampled`]), so they resolve those ids too.
    pub fn forward_sample_later(
        &self,
        batch: &[SequenceChunk],
        cache: &mut B::KvCache,
        params: &[SampleParams],
        penalties: &PenaltyLists,
    ) -> Result<TokensLater> {
        let pass = Pass {
            batch,
            which: Logits::Last,
            sampling: Some(Sampling { params, penalties }),
            output: Output::TokensLater,
        };
        self.run_ranks(pass, cache)?
            .later
            .ok_or_else(|| BackendError::Device("a step issued without its tokens".into()).into())
    }

    /// [`forward_sample`](Self::forward_sample), also returning the logits each token was chosen
    /// from (`[sequences, vocab]`, after the penalties), for callers that report log-probabilities.
    /// The logits leave the device: slower, so only for steps that need them.
    pub fn forward_sample_with_logits(
        &self,
        batch: &[SequenceChunk],
        cache: &mut B::KvCache,
        params: &[SampleParams],
        penalties: &PenaltyLists,
    ) -> Result<(Vec<u32>, Vec<f32>)> {
        let pass = Pass {
            batch,
            which: Logits::Last,
            sampling: Some(Sampling { params, penalties }),
            output: Output::Both,
        };
        let out = self.run_ranks(pass, cache)?;
        Ok((out.tokens, out.logits))
    }

    /// Runs `work` on every rank's KV cache with that rank's backend (`cache` is rank 0's) and
    /// returns what each hands back, in rank order: what a rank's cache holds (its KV heads,
    /// their eviction scores) is for its own backend to read and rewrite, so a compaction, for
    /// one, runs on each rank. The first failure of any rank is the result.
    pub fn with_kv(
        &self,
        cache: &mut B::KvCache,
        work: impl Fn(&B, &mut B::KvCache) -> Result<Vec<f32>> + Send + Sync + 'static,
    ) -> Result<Vec<Vec<f32>>> {
        let Some(peers) = &self.peers else {
            return Ok(vec![work(&self.rank.backend, cache)?]);
        };
        let work: KvWork<B> = Arc::new(work);
        let (mine, theirs) = peers.alongside(
            || PeerCommand::WithKv(work.clone()),
            || work(&self.rank.backend, cache),
        )?;
        Ok(std::iter::once(mine).chain(theirs).collect())
    }

    /// One forward pass on every rank: the peers get the step, rank 0 runs it here, and the
    /// first failure of any rank is the step's.
    fn run_ranks(&self, pass: Pass, cache: &mut B::KvCache) -> Result<Outputs> {
        let Some(peers) = &self.peers else {
            return self.rank.backend.run(|| self.rank.forward(pass, cache));
        };
        let step = Arc::new(PeerStep {
            batch: pass.batch.to_vec(),
            which: pass.which,
            share_tokens: matches!(pass.output, Output::TokensLater),
        });
        peers.broadcast(|| PeerCommand::Forward(step.clone()))?;
        let mine = catch_unwind(AssertUnwindSafe(|| {
            self.rank.backend.run(|| self.rank.forward(pass, cache))
        }));
        let mine = mine.unwrap_or_else(|panic| {
            // Peers waiting in a collective must not wait forever.
            self.rank.backend.abort_collectives();
            let _ = peers.collect();
            resume_unwind(panic)
        });
        let theirs = peers.collect();
        let mine = mine?;
        theirs?;
        Ok(mine)
    }
}

impl<B: Backend> RankModel<B> {
    /// A forward pass of this rank; a failure releases peers waiting in a collective.
    pub(crate) fn forward(&self, pass: Pass, cache: &mut B::KvCache) -> Result<Outputs> {
        let result = self.forward_inner(pass, cache);
        if result.is_err() {
            self.backend.abort_collectives();
        }
        result
    }

    fn forward_inner(&self, pass: Pass, cache: &mut B::KvCache) -> Result<Outputs> {
        let Pass {
            batch,
            which,
            sampling,
            output,
        } = pass;
        let b = &self.backend;
        let c = &self.config;
        let block_size = b.kv_spec(cache).block_size;
        let started = Instant::now();
        let (ids, positions, slots, spans) = flatten(batch, block_size)?;
        let n = ids.len();
        let hd = c.head_dim;
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
        let scoring: Vec<Option<KvScoring>> = match batch.iter().any(|s| s.scoring.is_some()) {
            true => batch.iter().map(|s| s.scoring).collect(),
            false => Vec::new(),
        };
        let outputs: Vec<u32> = match which {
            Logits::All => (0..n as u32).collect(),
            Logits::Last => spans
                .iter()
                .map(|s| (s.q_start + s.n_q - 1) as u32)
                .collect(),
        };
        let mut guard = self
            .workspace
            .lock()
            .map_err(|_| BackendError::Device("an earlier forward pass panicked".into()))?;
        let ws = match guard.as_mut() {
            Some(ws) => ws,
            None => guard.insert(Workspace::new(b, c)?),
        };
        let RankInfo { world, .. } = b.rank_info();
        let rows = b.prepare_batch(
            &mut ws.batch,
            &BatchLayout {
                ids: &ids,
                positions: &positions,
                slots: &slots,
                spans: &spans,
                inv_freq: &self.inv_freq,
                outputs: &outputs,
                n_heads: c.n_heads,
                vocab: c.vocab_size,
                sampling,
                scoring: &scoring,
            },
            cache,
        )?;
        if ws.resize(b, rows.tokens, rows.outputs)? {
            b.forget_steps(&ws.batch);
        }
        let Workspace {
            batch: batch_layout,
            x,
            h,
            o,
            qkv,
            q,
            k,
            v,
            attn,
            gate_up,
            act,
            last,
            normed,
        } = ws;
        let batch_layout = &*batch_layout;
        let eps = c.rms_norm_eps;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let sample = matches!(output, Output::Tokens | Output::Both | Output::TokensLater);
        b.run_step(batch_layout, &mut || {
            match world {
                1 => b.embed(&self.embed, batch_layout, x)?,
                _ => {
                    b.embed_split(&self.embed, batch_layout, c.vocab_size, x)?;
                    b.all_reduce_sum(x)?;
                }
            }
            for (i, layer) in self.layers.iter().enumerate() {
                // Attention block; `x` is the residual stream.
                b.norm_qkv_rope_write(
                    x,
                    &layer.attn_norm,
                    eps,
                    h,
                    &layer.wqkv,
                    qkv,
                    q,
                    k,
                    v,
                    hd,
                    cache,
                    i,
                    batch_layout,
                )?;
                b.attention(q, cache, i, c.n_heads, batch_layout, scale, attn)?;
                if !scoring.is_empty() {
                    b.accumulate_kv_scores(q, cache, i, c.n_heads, batch_layout, scale)?;
                }
                // Each residual step names the norm that comes next, which a backend may
                // begin in the step's epilogue.
                let ffn_norm = NextNorm {
                    weight: &layer.ffn_norm,
                    eps,
                    normed: &mut *h,
                };
                b.linear_residual_before_norm(attn, &layer.wo, o, x, ffn_norm)?;
                // Feed-forward block (SwiGLU).
                b.norm_linear_swiglu(x, &layer.ffn_norm, eps, h, &layer.w_gate_up, gate_up, act)?;
                match self.layers.get(i + 1) {
                    Some(next) => {
                        let attn_norm = NextNorm {
                            weight: &next.attn_norm,
                            eps,
                            normed: &mut *h,
                        };
                        b.linear_residual_before_norm(act, &layer.w_down, o, x, attn_norm)?;
                    }
                    None => b.linear_residual_all_reduce(act, &layer.w_down, o, x)?,
                }
            }
            b.gather_outputs(x, batch_layout, last)?;
            b.rms_norm(last, &self.final_norm, eps, normed)?;
            match world {
                1 => b.logits(normed, head, batch_layout)?,
                _ => b.logits_split(normed, head, batch_layout, c.vocab_size)?,
            }
            if sample {
                b.sample(batch_layout)?;
            }
            Ok(())
        })?;
        // A split model's next step may name these tokens before the host knows them: every
        // rank takes rank 0's (outside the recorded step, whose collectives are the embedding's
        // and the layers' all-reduces and the gather of the logits).
        if matches!(output, Output::TokensLater | Output::SharedTokens) && world > 1 {
            b.broadcast_sampled(batch_layout)?;
        }
        let launched = Instant::now();
        let mut out = Outputs::default();
        match output {
            Output::Nothing | Output::SharedTokens => {}
            Output::Logits => out.logits = b.read_logits(batch_layout)?,
            Output::Tokens => out.tokens = b.read_tokens(batch_layout)?,
            Output::Both => {
                out.logits = b.read_logits(batch_layout)?;
                out.tokens = b.read_tokens(batch_layout)?;
            }
            Output::TokensLater => out.later = Some(b.read_tokens_later(batch_layout)?),
        }
        let times = ForwardTimes {
            host_micros: (launched - started).as_secs_f64() * 1e6,
            wait_micros: launched.elapsed().as_secs_f64() * 1e6,
            // Tokens still on their way carry the step's device time themselves.
            device_micros: match output {
                Output::TokensLater => None,
                _ => b.step_device_micros(batch_layout),
            },
        };
        if let Ok(mut t) = self.times.lock() {
            *t = times;
        }
        Ok(out)
    }
}

/// Token ids, positions, KV slots, and `(q_start, n_q, kv_len)` per sequence.
type Flat = (Vec<u32>, Vec<u32>, Vec<u32>, Vec<(usize, usize, usize)>);

fn flatten(batch: &[SequenceChunk], block_size: usize) -> Result<Flat> {
    let (mut ids, mut positions, mut slots, mut spans) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for s in batch {
        let q_start = ids.len();
        let end = s.start + s.tokens.len();
        if s.tokens.is_empty() || end > s.block_table.len() * block_size {
            return Err(BackendError::Unsupported(format!(
                "a chunk of {} tokens ending at {end} with a block table of {} blocks of {block_size}",
                s.tokens.len(),
                s.block_table.len()
            ))
            .into());
        }
        ids.extend_from_slice(&s.tokens);
        for (i, key) in (s.start..end).enumerate() {
            positions.push((s.position + i) as u32);
            slots.push(
                s.block_table[key / block_size] * block_size as u32 + (key % block_size) as u32,
            );
        }
        spans.push((q_start, s.tokens.len(), end));
    }
    Ok((ids, positions, slots, spans))
}
