//! `turbo bench --shared-prefix N`: N requests that start with the same system prompt of
//! `--prefix-tokens` tokens, each followed by a distinct user part of `--user-tokens`, all
//! submitted at once; run with prefix sharing and without ([`BatchConfig::prefix_caching`] off).
//!
//! Reported per configuration: prompt tokens actually run through the model (prefill work), the
//! most KV blocks held at once, wall time, time to first token and output throughput.

use super::{median, prose};
use crate::runtime::KvArgs;
use anyhow::{ensure, Result};
use serde::Serialize;
use std::time::Instant;
use turbo_core::Backend;
use turbo_engine::{LoadedModelInfo, ModelTask};
use turbo_llama::Llama;
use turbo_scheduler::{BatchConfig, Completion, PersistentBatch, Request};
use turbo_tokenizer::tokenizer::TextTokenizer;

/// Longest prompt chunk of one sequence per step.
const PREFILL_CHUNK: usize = 512;

pub struct SharedPrefix {
    pub requests: usize,
    pub prefix_tokens: usize,
    pub user_tokens: usize,
    pub gen_tokens: usize,
    pub repeats: usize,
    pub max_batch: usize,
    pub max_batched_tokens: usize,
    pub kv: KvArgs,
    pub json: bool,
    pub model: String,
    /// Overlap steps where the backend runs ahead (off with `--no-overlap`).
    pub overlap: bool,
}

/// One configuration's run.
#[derive(Serialize)]
struct Variant {
    prefix_sharing: bool,
    /// Prompt tokens of all requests.
    prompt_tokens: usize,
    /// Prompt tokens (and recomputed tokens of preempted requests) run through the model.
    prefill_tokens_run: u64,
    /// Prompt tokens found cached at admission.
    cached_prompt_tokens: usize,
    /// Most KV blocks held at once.
    kv_blocks_peak: usize,
    preemptions: u64,
    output_tokens: usize,
    wall_s: Vec<f64>,
    wall_s_median: f64,
    /// Of the median run.
    ttft_ms_mean: f64,
    ttft_ms_median: f64,
    output_tok_s: f64,
}

#[derive(Serialize)]
struct Report {
    device: String,
    model: String,
    requests: usize,
    prefix_tokens: usize,
    user_tokens: usize,
    gen_tokens: usize,
    max_batch: usize,
    max_batched_tokens: usize,
    kv_blocks: usize,
    block_size: usize,
    shared: Variant,
    unshared: Variant,
    /// Requests whose generated tokens are the same with and without sharing.
    same_outputs: usize,
}

impl ModelTask for SharedPrefix {
    type Output = Result<()>;

    fn run<B: Backend>(
        self,
        model: Llama<B>,
        tokenizer: TextTokenizer,
        info: LoadedModelInfo,
    ) -> Result<()> {
        let longest = self.prefix_tokens.saturating_add(self.user_tokens);
        ensure!(
            longest.saturating_add(self.gen_tokens) <= info.context_length,
            "a request of {longest} prompt + {} generated tokens does not fit the model's \
             context of {}",
            self.gen_tokens,
            info.context_length
        );
        ensure!(
            self.requests <= turbo_engine::limits::MAX_BATCH,
            "{} requests is more than the {} allowed",
            self.requests,
            turbo_engine::limits::MAX_BATCH
        );
        let prompts = self.prompts(&tokenizer)?;
        // On the CPU: room for every request at once without sharing, so neither run preempts.
        let tokens = longest + self.gen_tokens;
        let num_blocks = self.kv.num_blocks(&model, &info, self.requests, tokens)?;
        let config = |prefix_caching| BatchConfig {
            max_batch: self.max_batch,
            max_batched_tokens: self.max_batched_tokens,
            block_size: info.block_size,
            num_blocks,
            prefill_chunk: PREFILL_CHUNK,
            prefix_caching,
        };
        let device = model.backend().name();
        let mut parts = (model, tokenizer);
        let mut variants = Vec::new();
        for sharing in [true, false] {
            let mut runs = Vec::new();
            for _ in 0..self.repeats {
                let mut batch = PersistentBatch::new(parts.0, parts.1, config(sharing))?;
                batch.set_overlap(batch.overlaps() && self.overlap);
                runs.push(self.run_once(&mut batch, &prompts)?);
                parts = batch.into_parts();
            }
            variants.push(summarize(sharing, runs));
        }
        let (unshared, unshared_outputs) = variants.pop().expect("two variants");
        let (shared, shared_outputs) = variants.pop().expect("two variants");
        let report = Report {
            device,
            model: self.model.clone(),
            requests: self.requests,
            prefix_tokens: self.prefix_tokens,
            user_tokens: self.user_tokens,
            gen_tokens: self.gen_tokens,
            max_batch: self.max_batch,
            max_batched_tokens: self.max_batched_tokens,
            kv_blocks: num_blocks,
            block_size: info.block_size,
            same_outputs: shared_outputs
                .iter()
                .zip(&unshared_outputs)
                .filter(|(a, b)| a == b)
                .count(),
            shared,
            unshared,
        };
        if self.json {
            outln!("{}", serde_json::to_string(&report)?)?;
        } else {
            print_table(&report)?;
        }
        Ok(())
    }
}

/// What one run measured.
struct Run {
    wall_s: f64,
    prefill_tokens_run: u64,
    kv_blocks_peak: usize,
    preemptions: u64,
    completions: Vec<Completion>,
}

impl SharedPrefix {
    /// The system prompt (beginning-of-sequence token and prose, cut to exactly `prefix_tokens`),
    /// then per request a distinct user part of exactly `user_tokens`.
    fn prompts(&self, tokenizer: &TextTokenizer) -> Result<Vec<Vec<u32>>> {
        let mut system =
            tokenizer.encode_with_bos(&prose(tokenizer, "", 0, self.prefix_tokens)?)?;
        system.truncate(self.prefix_tokens);
        (0..self.requests)
            .map(|i| {
                let header = format!("Question {}: ", i + 1);
                let user = prose(tokenizer, &header, i, self.user_tokens)?;
                let mut prompt = system.clone();
                prompt.extend(&tokenizer.encode(&user)?[..self.user_tokens]);
                Ok(prompt)
            })
            .collect()
    }

    /// Submits every request at once into a fresh batch and runs them to the end.
    fn run_once<B: Backend>(
        &self,
        batch: &mut PersistentBatch<B>,
        prompts: &[Vec<u32>],
    ) -> Result<Run> {
        // Page in the weights first, with a prompt that shares nothing with the measured ones.
        let warm_up = batch.tokenizer().encode("Warm-up.")?;
        let handle = batch.submit(Request {
            max_tokens: 2,
            ..Request::new(warm_up)
        });
        batch.run_until_idle()?;
        handle.wait()?;
        let before = batch.stats();

        let started = Instant::now();
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                batch.submit(Request {
                    max_tokens: self.gen_tokens,
                    ignore_eos: true,
                    ..Request::new(p.clone())
                })
            })
            .collect();
        batch.run_until_idle()?;
        let wall_s = started.elapsed().as_secs_f64();
        let completions = handles
            .into_iter()
            .map(|h| h.wait())
            .collect::<Result<Vec<_>, _>>()?;
        let after = batch.stats();
        Ok(Run {
            wall_s,
            prefill_tokens_run: after.prefill_tokens_run - before.prefill_tokens_run,
            kv_blocks_peak: after.kv_blocks_peak,
            preemptions: after.preemptions - before.preemptions,
            completions,
        })
    }
}

/// The figures of `runs` of one configuration (counts from the median-time run), and the
/// generated tokens of each request.
fn summarize(sharing: bool, mut runs: Vec<Run>) -> (Variant, Vec<Vec<u32>>) {
    let wall_s: Vec<f64> = runs.iter().map(|r| r.wall_s).collect();
    let wall_s_median = median(&wall_s);
    let at = runs
        .iter()
        .position(|r| r.wall_s == wall_s_median)
        .expect("the median is one of the runs");
    let run = runs.swap_remove(at);
    let c = &run.completions;
    let ttft: Vec<f64> = c.iter().map(|c| c.timings.prefill_ms).collect();
    let output_tokens = c.iter().map(|c| c.token_ids.len()).sum();
    let variant = Variant {
        prefix_sharing: sharing,
        prompt_tokens: c
            .iter()
            .map(|c| c.cached_prompt_tokens + c.prefilled_tokens)
            .sum(),
        prefill_tokens_run: run.prefill_tokens_run,
        cached_prompt_tokens: c.iter().map(|c| c.cached_prompt_tokens).sum(),
        kv_blocks_peak: run.kv_blocks_peak,
        preemptions: run.preemptions,
        output_tokens,
        wall_s,
        wall_s_median,
        ttft_ms_mean: ttft.iter().sum::<f64>() / ttft.len() as f64,
        ttft_ms_median: median(&ttft),
        output_tok_s: output_tokens as f64 / run.wall_s,
    };
    let outputs = run.completions.into_iter().map(|c| c.token_ids).collect();
    (variant, outputs)
}

fn print_table(r: &Report) -> Result<()> {
    outln!("device   {}", r.device)?;
    outln!("model    {}", r.model)?;
    outln!(
        "{} requests: a {}-token shared system prompt + {} distinct tokens each, {} generated; \
         {} slots, {} tokens per step, {} KV blocks of {} tokens",
        r.requests,
        r.prefix_tokens,
        r.user_tokens,
        r.gen_tokens,
        r.max_batch,
        r.max_batched_tokens,
        r.kv_blocks,
        r.block_size
    )?;
    let (s, u) = (&r.shared, &r.unshared);
    let row = |name: &str, a: String, b: String| outln!("{name:<24} {a:>12} {b:>12}");
    row("", "shared".into(), "unshared".into())?;
    row(
        "prompt tokens",
        s.prompt_tokens.to_string(),
        u.prompt_tokens.to_string(),
    )?;
    row(
        "prefill tokens run",
        s.prefill_tokens_run.to_string(),
        u.prefill_tokens_run.to_string(),
    )?;
    row(
        "cached prompt tokens",
        s.cached_prompt_tokens.to_string(),
        u.cached_prompt_tokens.to_string(),
    )?;
    row(
        "KV blocks (peak)",
        s.kv_blocks_peak.to_string(),
        u.kv_blocks_peak.to_string(),
    )?;
    row(
        "preemptions",
        s.preemptions.to_string(),
        u.preemptions.to_string(),
    )?;
    row(
        "wall time (s)",
        format!("{:.2}", s.wall_s_median),
        format!("{:.2}", u.wall_s_median),
    )?;
    row(
        "TTFT mean (ms)",
        format!("{:.0}", s.ttft_ms_mean),
        format!("{:.0}", u.ttft_ms_mean),
    )?;
    row(
        "TTFT median (ms)",
        format!("{:.0}", s.ttft_ms_median),
        format!("{:.0}", u.ttft_ms_median),
    )?;
    row(
        "output tok/s",
        format!("{:.1}", s.output_tok_s),
        format!("{:.1}", u.output_tok_s),
    )?;
    outln!(
        "same generated tokens with and without sharing: {}/{}",
        r.same_outputs,
        r.requests
    )?;
    Ok(())
}
