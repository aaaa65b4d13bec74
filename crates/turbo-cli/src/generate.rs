//! `turbo generate`: one completion, streamed or as JSON.

use crate::eviction::KvPolicyArgs;
use crate::runtime::{KvArgs, ModelArgs, SamplingArgs};
use anyhow::{bail, Result};
use clap::Args;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use turbo_engine::limits::ReadError;
use turbo_engine::{ChatMessage, Engine, EngineConfig, KvSize};
use turbo_scheduler::{Completion, Event, FinishReason, Request, Timings};

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text.
    #[arg(
        long,
        short = 'p',
        conflicts_with_all = ["prompt_file", "prompts_file"],
        required_unless_present_any = ["prompt_file", "prompts_file"]
    )]
    prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(long, conflicts_with = "prompts_file")]
    prompt_file: Option<PathBuf>,
    /// Run many requests concurrently through the persistent batch: one JSON object per line
    /// (`prompt`, optional `max_tokens`, `temperature`, `seed`, `session`); prints one JSON line
    /// per request, in input order, and throughput on stderr.
    #[arg(long)]
    prompts_file: Option<PathBuf>,
    /// Batch slots (requests running at once) with --prompts-file.
    #[arg(long, default_value_t = 64)]
    max_batch: usize,
    /// Tokens per forward pass with --prompts-file (decode tokens plus prefill chunks).
    #[arg(long, default_value_t = 2048)]
    max_batched_tokens: usize,
    /// KV cache size with --prompts-file (default on the CPU: a context of up to 4096 tokens
    /// per batch slot).
    #[command(flatten)]
    kv: KvArgs,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    eviction: KvPolicyArgs,
    /// Stop when this text is generated (repeatable); it is not included in the output.
    #[arg(long)]
    stop: Vec<String>,
    /// Wrap the prompt (with --prompts-file, each line's prompt) as a user message in the
    /// model's chat template.
    #[arg(long)]
    chat: bool,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
    /// With --prompts-file: write one JSON line per step to this file (its sequences and
    /// tokens, the host's scheduling, forward and postprocessing time, the wait for results,
    /// the device's time), and print where the steps' time went.
    #[arg(long, requires = "prompts_file")]
    step_profile: Option<PathBuf>,
}

/// The JSON record of one request, as `--json` and `--prompts-file` print it.
#[derive(Serialize)]
pub struct Output<'a> {
    prompt_token_ids: &'a [u32],
    token_ids: &'a [u32],
    text: &'a str,
    finish_reason: FinishReason,
    timings: &'a Timings,
    /// Keys cached at the end (fewer than the tokens under KV eviction), the blocks holding
    /// them, and the most blocks held at once.
    kv_tokens: usize,
    kv_blocks: usize,
    kv_blocks_peak: usize,
}

impl<'a> Output<'a> {
    pub fn new(prompt_token_ids: &'a [u32], c: &'a Completion) -> Self {
        Output {
            prompt_token_ids,
            token_ids: &c.token_ids,
            text: &c.text,
            finish_reason: c.finish_reason,
            timings: &c.timings,
            kv_tokens: c.kv_tokens,
            kv_blocks: c.kv_blocks,
            kv_blocks_peak: c.kv_blocks_peak,
        }
    }
}

pub fn run(args: GenerateArgs) -> Result<()> {
    // Checked for one prompt too (where they do not matter), so that a mistake is not silent.
    anyhow::ensure!(args.max_batch > 0, "--max-batch must be positive");
    anyhow::ensure!(
        args.max_batched_tokens > 0,
        "--max-batched-tokens must be positive"
    );
    if let Some(file) = &args.prompts_file {
        let batch = crate::batch::BatchArgs {
            file: file.clone(),
            max_tokens: args.max_tokens,
            sampling: args.sampling.params(),
            stop: args.stop.clone(),
            ignore_eos: args.ignore_eos,
            max_batch: args.max_batch,
            max_batched_tokens: args.max_batched_tokens,
            kv: args.kv.clone(),
            eviction: args.eviction.clone(),
            step_profile: args.step_profile.clone(),
            chat: args.chat,
        };
        return crate::batch::run(&args.model, batch);
    }
    anyhow::ensure!(
        !args.kv.is_set(),
        "--kv-blocks, --kv-cache-gb and --kv-cache-fraction size the persistent batch of \
         --prompts-file; a single prompt runs with room for one full context"
    );
    let model = args.model.options()?;
    // One request: room for one full context, prefilled in chunks of 512 tokens; no warm-up,
    // whose steps would only add to this one request's.
    let engine = Arc::new(Engine::start(EngineConfig {
        kv: KvSize::Contexts(1),
        max_batch: 1,
        max_batched_tokens: 512,
        prefill_chunk: 512,
        warm_up: false,
        ..EngineConfig::new(model)
    })?);
    let prompt = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => read_prompt_file(f, engine.info().max_prompt_bytes)?,
        (None, None) => unreachable!("clap requires one of them"),
    };
    let ids = if args.chat {
        engine.chat_prompt(&[ChatMessage::new("user", prompt)])?
    } else {
        engine.text_prompt(&prompt)?
    };
    let request = Request {
        sampling: args.sampling.params(),
        max_tokens: args.max_tokens,
        stop_strings: args.stop.clone(),
        ignore_eos: args.ignore_eos,
        kv_eviction: args.eviction.eviction(args.sampling.seed)?,
        ..Request::new(ids.clone())
    };
    let mut stream = engine.submit(request)?;
    let id = stream.id();
    let cancel = engine.clone();
    crate::interrupt::cancel_on_ctrl_c(move || {
        cancel.cancel(id);
    });
    let completion = loop {
        match stream.blocking_next() {
            // A closed stdout (e.g. `| head`) ends the command; dropping the stream cancels
            // generation.
            Some(Event::Text(text)) if !args.json => out!("{text}")?,
            Some(Event::Finished(c)) => break c,
            Some(Event::Failed(e)) => bail!(e),
            Some(_) => {}
            None => bail!("the engine stopped before the request ended"),
        }
    };
    if args.json {
        outln!(
            "{}",
            serde_json::to_string(&Output::new(&ids, &completion))?
        )?;
    } else {
        outln!()?;
    }
    if completion.finish_reason == FinishReason::Cancelled {
        return Err(crate::interrupt::Interrupted.into());
    }
    Ok(())
}

/// The prompt in `path`, refused without reading further once it is longer than `limit` bytes
/// (more than the context holds) or is not UTF-8.
pub fn read_prompt_file(path: &Path, limit: u64) -> Result<String> {
    turbo_engine::limits::read_file_bounded(path, limit).map_err(|e| match e {
        ReadError::TooLong { limit } => anyhow::anyhow!(
            "prompt file {} is longer than {limit} bytes, more than the model's context holds",
            path.display()
        ),
        e => anyhow::anyhow!("cannot read prompt file {}: {e}", path.display()),
    })
}
