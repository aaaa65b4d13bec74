//! `turbo generate --prompts-file F.jsonl`: many requests at once through the persistent batch.

use crate::generate::Output;
use crate::runtime::{KvArgs, LoadedModelInfo, ModelTask};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Instant;
use turbo_core::Backend;
use turbo_tokenizer::tokenizer::TextTokenizer;
use turbo_llama::Llama;
use turbo_scheduler::{BatchConfig, Completion, PersistentBatch, Request, SamplingParams};

/// One line of the prompts file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    prompt: String,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    seed: Option<u64>,
    session: Option<String>,
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
}

pub struct BatchTask(pub BatchArgs);

impl ModelTask for BatchTask {
    type Output = ();

    fn run<B: Backend>(
        self,
        model: Llama<B>,
        tokenizer: TextTokenizer,
        info: LoadedModelInfo,
    ) -> Result<()> {
        let args = self.0;
        let text = std::fs::read_to_string(&args.file)
            .with_context(|| format!("cannot read prompts file {}", args.file.display()))?;
        let mut requests = Vec::new();
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
            let prompt = tokenizer.encode_with_bos(&line.prompt)?;
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
            requests.push(request);
        }
        if requests.is_empty() {
            bail!("{} holds no requests", args.file.display());
        }
        let block_size = info.block_size;
        // CPU default: room for every slot to hold a full context (capped at 4096 tokens each).
        let cpu_default = args.max_batch * info.context_length.min(4096);
        let num_blocks = args.kv.num_blocks(&model, &info, cpu_default)?;
        let config = BatchConfig {
            max_batch: args.max_batch,
            max_batched_tokens: args.max_batched_tokens.max(args.max_batch),
            block_size,
            num_blocks,
            prefill_chunk: 512,
            prefix_caching: true,
        };
        let prompts: Vec<Vec<u32>> = requests.iter().map(|r| r.prompt.clone()).collect();
        let mut batch = PersistentBatch::new(model, tokenizer, config)?;
        let started = Instant::now();
        let handles: Vec<_> = requests.into_iter().map(|r| batch.submit(r)).collect();
        batch.run_until_idle()?;
        let elapsed = started.elapsed().as_secs_f64();
        let mut generated = 0usize;
        for (handle, prompt) in handles.into_iter().zip(&prompts) {
            let c: Completion = handle.wait()?;
            generated += c.token_ids.len();
            let out = Output::new(prompt, &c);
            println!("{}", serde_json::to_string(&out)?);
        }
        let stats = batch.stats();
        let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
        eprintln!(
            "{} requests ({prompt_tokens} prompt tokens) in {elapsed:.2} s: {:.2} requests/s, {:.1} output tok/s ({generated} tokens), {} preemptions, {} KV blocks of {block_size}",
            prompts.len(),
            prompts.len() as f64 / elapsed,
            generated as f64 / elapsed,
            stats.preemptions,
            num_blocks,
        );
        Ok(())
    }
}
