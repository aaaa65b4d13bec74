//! `turbo generate --prompts-file F.jsonl`: many requests at once through the persistent batch.

use crate::eviction::{budget_size, KvPolicyArgs};
use crate::generate::Output;
use crate::runtime::{KvArgs, ModelArgs};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Instant;
use turbo_engine::{Engine, EngineConfig};
use turbo_scheduler::{Completion, Request, SamplingParams};

/// One line of the prompts file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    prompt: String,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    seed: Option<u64>,
    session: Option<String>,
    /// KV eviction of this request, overriding the flags.
    kv_policy: Option<String>,
    kv_budget: Option<f64>,
    kv_budget_tokens: Option<usize>,
}

/// Options of batch mode.
pub struct BatchArgs {
    pub file: PathBuf,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub max_batch: usize,
    pub max_batched_tokens: usize,
    pub kv: KvArgs,
    pub eviction: KvPolicyArgs,
}

/// Runs every request of the file through one engine and prints their outcomes in input order.
pub fn run(model: &ModelArgs, args: BatchArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("cannot read prompts file {}", args.file.display()))?;
    let mut lines = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let line: Line = serde_json::from_str(line).with_context(|| {
            format!(
                "{} line {}: not a request object",
                args.file.display(),
                i + 1
            )
        })?;
        lines.push(line);
    }
    if lines.is_empty() {
        bail!("{} holds no requests", args.file.display());
    }
    // CPU default: room for every slot to hold a full context (capped at 4096 tokens each). The
    // whole file is queued at once.
    let engine = Engine::start(EngineConfig {
        kv: args.kv.size(args.max_batch, 4096)?,
        max_batch: args.max_batch,
        max_batched_tokens: args.max_batched_tokens.max(args.max_batch),
        prefill_chunk: 512,
        max_pending: lines.len(),
        ..EngineConfig::new(model.options()?)
    })?;
    let mut requests = Vec::new();
    for line in lines {
        let prompt = engine.text_prompt(&line.prompt)?;
        let mut request = Request::new(prompt);
        request.sampling = SamplingParams {
            temperature: line.temperature.unwrap_or(args.sampling.temperature),
            seed: line.seed.unwrap_or(args.sampling.seed),
            ..args.sampling.clone()
        };
        request.max_tokens = line.max_tokens.unwrap_or(args.max_tokens);
        request.stop_strings = args.stop.clone();
        request.ignore_eos = args.ignore_eos;
        request.session = line.session;
        let size = budget_size(line.kv_budget, line.kv_budget_tokens);
        request.kv_eviction = match (line.kv_policy, size) {
            (None, None) => args.eviction.eviction(request.sampling.seed)?,
            (policy, size) => {
                let policy = match policy {
                    Some(p) => p
                        .parse()
                        .map_err(|e| anyhow::anyhow!("{}: kv_policy: {e}", args.file.display()))?,
                    None => args.eviction.kv_policy,
                };
                args.eviction
                    .eviction_with(policy, size, request.sampling.seed)?
            }
        };
        requests.push(request);
    }
    let prompts: Vec<Vec<u32>> = requests.iter().map(|r| r.prompt.clone()).collect();
    let started = Instant::now();
    let streams = requests
        .into_iter()
        .map(|r| engine.submit(r))
        .collect::<Result<Vec<_>, _>>()?;
    let completions = streams
        .into_iter()
        .map(|s| s.wait())
        .collect::<Result<Vec<Completion>, _>>()?;
    let elapsed = started.elapsed().as_secs_f64();
    let mut generated = 0usize;
    for (c, prompt) in completions.iter().zip(&prompts) {
        generated += c.token_ids.len();
        let out = Output::new(prompt, c);
        println!("{}", serde_json::to_string(&out)?);
    }
    engine.shutdown(std::time::Duration::ZERO); // every request has ended: the stats are final
    let stats = engine.stats().batch;
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    eprintln!(
        "{} requests ({prompt_tokens} prompt tokens) in {elapsed:.2} s: {:.2} requests/s, {:.1} output tok/s ({generated} tokens), {} preemptions, {} KV blocks of {}",
        prompts.len(),
        prompts.len() as f64 / elapsed,
        generated as f64 / elapsed,
        stats.preemptions,
        engine.info().num_blocks,
        engine.info().block_size,
    );
    if stats.decode_step_micros > 0 {
        let seconds = stats.decode_step_micros as f64 / 1e6;
        eprintln!(
            "decode-only steps: {} steps, {} tokens in {seconds:.2} s: {:.1} tok/s, {:.1} sequences per step",
            stats.decode_steps,
            stats.decode_step_tokens,
            stats.decode_step_tokens as f64 / seconds,
            stats.decode_step_tokens as f64 / stats.decode_steps.max(1) as f64,
        );
    }
    if stats.compactions > 0 {
        eprintln!(
            "KV compactions: {} in {:.2} s of host time ({:.2} ms each)",
            stats.compactions,
            stats.compaction_micros as f64 / 1e6,
            stats.compaction_micros as f64 / 1e3 / stats.compactions as f64,
        );
    }
    Ok(())
}
