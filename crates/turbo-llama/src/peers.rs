//! The ranks 1.. of a tensor-parallel model: one thread each, holding its shard, its KV cache
//! and its backend (so a GPU rank keeps its context, its buffers and its recorded steps on one
//! thread). Rank 0, on the caller's thread, sends each step to all of them before running its
//! own part; the ranks then meet only inside the step's collectives.

use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};
use crate::model::{Logits, Output, Pass, RankModel, SequenceChunk};
use crate::shard::ShardPlan;
use crate::weights::HostWeights;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use turbo_core::cpu::KvCacheSpec;
use turbo_core::Backend;

/// Work on a rank's KV cache with the rank's backend, and the values it hands back (see
/// [`crate::Llama::with_kv`]).
pub type KvWork<B> =
    Arc<dyn Fn(&B, &mut <B as Backend>::KvCache) -> Result<Vec<f32>> + Send + Sync + 'static>;

/// A peer's answer: the values of a [`PeerCommand::WithKv`], nothing for the others.
type Answer = Result<Vec<f32>>;

/// What rank 0 asks of its peers.
pub(crate) enum PeerCommand<B: Backend> {
    /// Make a KV cache of this shape, replacing the one held.
    NewCache(KvCacheSpec),
    /// Run the layers of this step over the held cache.
    Forward(Arc<PeerStep>),
    /// Run this on the held cache.
    WithKv(KvWork<B>),
}

/// A step as every rank runs it.
pub(crate) struct PeerStep {
    pub batch: Vec<SequenceChunk>,
    pub which: Logits,
    /// Whether rank 0 issues this step ahead of its tokens, which the peers then take
    /// ([`Output::SharedTokens`]).
    pub share_tokens: bool,
}

struct Worker<B: Backend> {
    rank: usize,
    commands: Option<Sender<PeerCommand<B>>>,
    results: Mutex<Receiver<Answer>>,
    thread: Option<JoinHandle<()>>,
}

pub(crate) struct Peers<B: Backend> {
    workers: Vec<Worker<B>>,
}

impl<B: Backend + 'static> Peers<B> {
    /// Starts one thread per backend (ranks 1.. in order), each placing its shard on its
    /// backend; [`wait_ready`](Self::wait_ready) says when they are done.
    pub(crate) fn start(
        backends: Vec<B>,
        plan: &ShardPlan,
        config: &LlamaConfig,
        host: &HostWeights,
    ) -> Result<Self> {
        let mut workers = Vec::with_capacity(backends.len());
        for (i, backend) in backends.into_iter().enumerate() {
            let rank = i + 1;
            let (commands, inbox) = channel::<PeerCommand<B>>();
            let (outbox, results) = channel::<Answer>();
            let (plan, config, host) = (*plan, config.clone(), host.clone());
            let thread = std::thread::Builder::new()
                .name(format!("turbo-rank-{rank}"))
                .spawn(move || {
                    let rank_config = plan.rank_config(&config);
                    let built = plan
                        .shard(&config, &host, rank)
                        .and_then(|shard| RankModel::new(backend, &rank_config, &shard));
                    drop(host);
                    let model = match built {
                        Ok(m) => {
                            let _ = outbox.send(Ok(Vec::new()));
                            m
                        }
                        Err(e) => {
                            let _ = outbox.send(Err(e));
                            return;
                        }
                    };
                    serve(model, inbox, outbox);
                })
                .map_err(|e| LlamaError::Config(format!("cannot start rank {rank}: {e}")))?;
            workers.push(Worker {
                rank,
                commands: Some(commands),
                results: Mutex::new(results),
                thread: Some(thread),
            });
        }
        Ok(Peers { workers })
    }
}

impl<B: Backend> Peers<B> {
    /// Ranks 1.. of the group.
    pub(crate) fn len(&self) -> usize {
        self.workers.len()
    }

    /// Waits for every rank to have placed its shard.
    pub(crate) fn wait_ready(&self) -> Result<()> {
        self.collect()
    }

    /// Each peer's answer to the last command, in rank order; the first failure if any failed.
    pub(crate) fn collect_values(&self) -> Result<Vec<Vec<f32>>> {
        let mut first = Ok(Vec::new());
        for w in &self.workers {
            let answer = match w.results.lock() {
                Ok(r) => r.recv().unwrap_or_else(|_| Err(stopped(w.rank))),
                Err(_) => Err(stopped(w.rank)),
            };
            match (&mut first, answer) {
                (Ok(values), Ok(v)) => values.push(v),
                (Ok(_), Err(e)) => first = Err(e),
                (Err(_), _) => {}
            }
        }
        first
    }

    /// Sends `command()` to every peer, runs rank 0's part, then waits for the peers: rank 0's
    /// result and the peers' values, or the first failure of any rank.
    pub(crate) fn alongside<R>(
        &self,
        command: impl Fn() -> PeerCommand<B>,
        mine: impl FnOnce() -> Result<R>,
    ) -> Result<(R, Vec<Vec<f32>>)> {
        self.broadcast(command)?;
        let mine = mine();
        let theirs = self.collect_values();
        Ok((mine?, theirs?))
    }

    /// Sends `command()` to every peer.
    pub(crate) fn broadcast(&self, command: impl Fn() -> PeerCommand<B>) -> Result<()> {
        for w in &self.workers {
            let sent = w.commands.as_ref().map(|c| c.send(command()));
            if !matches!(sent, Some(Ok(()))) {
                return Err(stopped(w.rank));
            }
        }
        Ok(())
    }

    /// Each peer's answer to the last command; the first failure if any failed.
    pub(crate) fn collect(&self) -> Result<()> {
        self.collect_values().map(|_| ())
    }
}

impl<B: Backend> Drop for Peers<B> {
    fn drop(&mut self) {
        for w in &mut self.workers {
            w.commands = None;
        }
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn stopped(rank: usize) -> LlamaError {
    LlamaError::Config(format!("tensor-parallel rank {rank} has stopped"))
}

/// A peer's loop: one answer per command, until rank 0 goes away.
fn serve<B: Backend>(model: RankModel<B>, inbox: Receiver<PeerCommand<B>>, outbox: Sender<Answer>) {
    let mut cache: Option<B::KvCache> = None;
    for command in inbox {
        let answer = catch_unwind(AssertUnwindSafe(|| match command {
            PeerCommand::NewCache(spec) => {
                cache = None;
                cache = Some(model.backend.kv_cache(spec)?);
                Ok(Vec::new())
            }
            PeerCommand::Forward(step) => {
                let Some(cache) = cache.as_mut() else {
                    model.backend.abort_collectives();
                    return Err(LlamaError::Config(
                        "a tensor-parallel rank has no KV cache".into(),
                    ));
                };
                model
                    .backend
                    .run(|| {
                        let pass = Pass {
                            batch: &step.batch,
                            which: step.which,
                            sampling: None,
                            output: match step.share_tokens {
                                true => Output::SharedTokens,
                                false => Output::Nothing,
                            },
                        };
                        model.forward(pass, cache)
                    })
                    .map(|_| Vec::new())
            }
            PeerCommand::WithKv(work) => match cache.as_mut() {
                Some(cache) => work(&model.backend, cache),
                None => Err(LlamaError::Config(
                    "a tensor-parallel rank has no KV cache".into(),
                )),
            },
        }));
        let answer = answer.unwrap_or_else(|_| {
            model.backend.abort_collectives();
            Err(LlamaError::Config("a tensor-parallel rank panicked".into()))
        });
        if outbox.send(answer).is_err() {
            return;
        }
    }
}
