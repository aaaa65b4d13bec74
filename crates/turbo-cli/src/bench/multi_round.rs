//! `turbo bench --multi-round N`: time to first token of round k of a conversation, k = 1..N,
//! with the KV cache and without.
//!
//! Each round appends a user message of about `--user-tokens` tokens to the conversation,
//! renders it with the chat template, and generates `--gen-tokens` tokens (end-of-sequence
//! ignored) in the conversation's session, as `turbo chat` does. With the cache, the session's
//! history is still resident and a round prefills only its new tokens; without it
//! ([`BatchConfig::prefix_caching`] off) every round prefills the whole history. Both run the same
//! prompts: the uncached conversations replay the replies of the first cached one.

use super::{median, prose};
use crate::runtime::KvArgs;
use anyhow::{anyhow, Result};
use serde::Serialize;
use turbo_core::Backend;
use turbo_engine::{LoadedModelInfo, ModelTask};
use turbo_llama::Llama;
use turbo_scheduler::{BatchConfig, PersistentBatch, Request};
use turbo_tokenizer::chat::{ChatMessage, ChatTemplate};
use turbo_tokenizer::tokenizer::TextTokenizer;

/// Tokens per forward pass while prefilling, as `turbo chat` runs.
const PREFILL_CHUNK: usize = 512;

pub struct MultiRound {
    pub rounds: usize,
    pub user_tokens: usize,
    pub gen_tokens: usize,
    pub repeats: usize,
    pub kv: KvArgs,
    pub json: bool,
    pub model: String,
    /// Overlap steps where the backend runs ahead (off with `--no-overlap`).
    pub overlap: bool,
}

/// One round of one conversation.
struct Round {
    prompt_tokens: usize,
    cached_tokens: usize,
    ttft_ms: f64,
}

/// Round k of every repeat of one configuration.
#[derive(Serialize)]
struct RoundReport {
    round: usize,
    prompt_tokens: usize,
    /// Prompt tokens whose KV was found resident (0 without the cache).
    cached_tokens: usize,
    ttft_ms: Vec<f64>,
    ttft_ms_median: f64,
}

#[derive(Serialize)]
struct Report {
    device: String,
    model: String,
    rounds: usize,
    user_tokens: usize,
    gen_tokens: usize,
    repeats: usize,
    kv_blocks: usize,
    block_size: usize,
    cached: Vec<RoundReport>,
    uncached: Vec<RoundReport>,
}

impl ModelTask for MultiRound {
    type Output = Result<()>;

    fn run<B: Backend>(
        self,
        model: Llama<B>,
        tokenizer: TextTokenizer,
        info: LoadedModelInfo,
    ) -> Result<()> {
        // Every round adds a user message and a reply to the conversation, which must fit the
        // context (the template's markup adds a little more; that is checked as it runs).
        let round_tokens = self.user_tokens.saturating_add(self.gen_tokens);
        anyhow::ensure!(
            self.rounds.saturating_mul(round_tokens) <= info.context_length,
            "{} rounds of ~{round_tokens} tokens do not fit the model's context of {}",
            self.rounds,
            info.context_length
        );
        let template = info.template(&tokenizer)?;
        let users = (0..self.rounds)
            .map(|k| {
                let header = format!("Round {}. ", k + 1);
                prose(&tokenizer, &header, k * 5, self.user_tokens)
            })
            .collect::<Result<Vec<_>>>()?;
        // On the CPU, room for one full context, as `turbo chat` has.
        let num_blocks = self.kv.num_blocks(&model, &info, 1, info.context_length)?;
        let config = |prefix_caching| BatchConfig {
            max_batch: 1,
            max_batched_tokens: PREFILL_CHUNK,
            block_size: info.block_size,
            num_blocks,
            prefill_chunk: PREFILL_CHUNK,
            prefix_caching,
        };
        let (cached_config, uncached_config) = (config(true), config(false));
        let device = model.backend().name();

        let mut batch = PersistentBatch::new(model, tokenizer, cached_config.clone())?;
        batch.set_overlap(batch.overlaps() && self.overlap);
        warm_up(&mut batch)?;
        let mut replies: Option<Vec<String>> = None;
        let mut cached = Vec::new();
        for r in 0..self.repeats {
            let (rounds, texts) =
                self.conversation(&mut batch, &template, r, &users, replies.as_deref())?;
            replies.get_or_insert(texts);
            cached.push(rounds);
        }
        let (model, tokenizer) = batch.into_parts();
        let mut batch = PersistentBatch::new(model, tokenizer, uncached_config)?;
        batch.set_overlap(batch.overlaps() && self.overlap);
        warm_up(&mut batch)?;
        let mut uncached = Vec::new();
        for r in 0..self.repeats {
            let (rounds, _) =
                self.conversation(&mut batch, &template, r, &users, replies.as_deref())?;
            uncached.push(rounds);
        }

        let report = Report {
            device,
            model: self.model.clone(),
            rounds: self.rounds,
            user_tokens: self.user_tokens,
            gen_tokens: self.gen_tokens,
            repeats: self.repeats,
            kv_blocks: cached_config.num_blocks,
            block_size: cached_config.block_size,
            cached: per_round(&cached),
            uncached: per_round(&uncached),
        };
        if self.json {
            outln!("{}", serde_json::to_string(&report)?)?;
        } else {
            print_table(&report)?;
        }
        Ok(())
    }
}

impl MultiRound {
    /// Runs one conversation (numbered `id`, which opens its system message so that no two
    /// conversations share KV) in its own session; returns its rounds and its replies. With
    /// `replies`, those are the conversation's assistant turns instead of what was generated.
    fn conversation<B: Backend>(
        &self,
        batch: &mut PersistentBatch<B>,
        template: &ChatTemplate,
        id: usize,
        users: &[String],
        replies: Option<&[String]>,
    ) -> Result<(Vec<Round>, Vec<String>)> {
        let session = format!("conversation {id}");
        let mut messages = vec![ChatMessage::new(
            "system",
            format!("Conversation {id}. You are a helpful travel assistant."),
        )];
        let mut rounds = Vec::new();
        let mut texts = Vec::new();
        for (k, user) in users.iter().enumerate() {
            messages.push(ChatMessage::new("user", user));
            let prompt = batch
                .tokenizer()
                .encode(&template.render(&messages, true)?)?;
            let request = Request {
                max_tokens: self.gen_tokens,
                ignore_eos: true,
                session: Some(session.clone()),
                ..Request::new(prompt.clone())
            };
            let handle = batch.submit(request);
            batch.run_until_idle()?;
            let c = handle
                .wait()
                .map_err(|e| anyhow!("round {} ({} prompt tokens): {e}", k + 1, prompt.len()))?;
            rounds.push(Round {
                prompt_tokens: prompt.len(),
                cached_tokens: c.cached_prompt_tokens,
                ttft_ms: c.timings.prefill_ms,
            });
            let reply = replies.map_or(c.text, |r| r[k].clone());
            messages.push(ChatMessage::new("assistant", &reply));
            texts.push(reply);
        }
        batch.end_session(&session)?;
        Ok((rounds, texts))
    }
}

/// One short request, so that the first measured round does not pay for paging in the weights.
fn warm_up<B: Backend>(batch: &mut PersistentBatch<B>) -> Result<()> {
    let prompt = batch.tokenizer().encode_with_bos("Warm-up.")?;
    let handle = batch.submit(Request {
        max_tokens: 2,
        ..Request::new(prompt)
    });
    batch.run_until_idle()?;
    handle.wait()?;
    Ok(())
}

fn per_round(runs: &[Vec<Round>]) -> Vec<RoundReport> {
    (0..runs[0].len())
        .map(|k| {
            let ttft_ms: Vec<f64> = runs.iter().map(|r| r[k].ttft_ms).collect();
            RoundReport {
                round: k + 1,
                prompt_tokens: runs[0][k].prompt_tokens,
                cached_tokens: runs[0][k].cached_tokens,
                ttft_ms_median: median(&ttft_ms),
                ttft_ms,
            }
        })
        .collect()
}

fn print_table(report: &Report) -> Result<()> {
    outln!("device   {}", report.device)?;
    outln!("model    {}", report.model)?;
    outln!(
        "{} rounds of ~{} user tokens, {} generated tokens each; TTFT median of {} conversations",
        report.rounds,
        report.user_tokens,
        report.gen_tokens,
        report.repeats
    )?;
    outln!("round  prompt tokens  cached tokens  TTFT cached (ms)  TTFT uncached (ms)")?;
    for (c, u) in report.cached.iter().zip(&report.uncached) {
        outln!(
            "{:>5}  {:>13}  {:>13}  {:>16.1}  {:>18.1}",
            c.round,
            c.prompt_tokens,
            c.cached_tokens,
            c.ttft_ms_median,
            u.ttft_ms_median
        )?;
    }
    Ok(())
}
