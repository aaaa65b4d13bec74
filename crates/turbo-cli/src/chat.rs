//! `turbo chat`: an interactive conversation whose KV cache persists across turns.
//!
//! The conversation is a session of a persistent batch: each turn submits the whole rendered
//! conversation, and the KV manager finds its history still resident (a cache hit), so only the
//! new message is prefilled. Text is streamed from the request's events as the batch steps.

use crate::runtime::{KvArgs, ModelArgs, SamplingArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::{BufRead, Write};
use turbo_engine::{ChatMessage, Engine, EngineConfig, RequestStream, SubmitError};
use turbo_scheduler::{Completion, Event, Request, RequestError};

#[derive(Args, Clone, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    eviction: crate::eviction::KvPolicyArgs,
    #[command(flatten)]
    kv: KvArgs,
    /// A system message opening the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Longest reply, in tokens.
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
}

/// The session every turn of the conversation runs in.
const SESSION: &str = "chat";

/// Tokens per forward pass while prefilling a turn, bounding activation memory.
const PREFILL_CHUNK: usize = 512;

pub fn run(args: ChatArgs) -> Result<()> {
    args.sampling
        .params()
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid sampling options: {e}"))?;
    anyhow::ensure!(args.max_tokens > 0, "--max-tokens must be positive");
    // One conversation: on the CPU, room for a full context (storage grows as it is used).
    let engine = Engine::start(EngineConfig {
        kv: args.kv.size(1, usize::MAX)?,
        max_batch: 1,
        max_batched_tokens: PREFILL_CHUNK,
        prefill_chunk: PREFILL_CHUNK,
        ..EngineConfig::new(args.model.options()?)
    })?;
    let opening: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s))
        .collect();
    let mut messages = opening.clone();
    eprintln!(
        "Chat on {}. Type a message; /reset starts over, /exit quits.",
        engine.info().backend
    );
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    let mut line = String::new();
    loop {
        write!(stdout, ">>> ").and_then(|_| stdout.flush())?;
        line.clear();
        if stdin.lock().read_line(&mut line)? == 0 {
            writeln!(stdout)?;
            break;
        }
        let input = line.trim_end_matches(['\n', '\r']);
        match input.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                engine.end_session(SESSION);
                messages = opening.clone();
                eprintln!("[conversation cleared]");
                continue;
            }
            cmd if cmd.starts_with('/') => {
                eprintln!("[unknown command {cmd}; commands: /reset, /exit]");
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::new("user", input));
        let request = Request {
            sampling: args.sampling.params(),
            max_tokens: args.max_tokens,
            session: Some(SESSION.into()),
            kv_eviction: args.eviction.eviction(args.sampling.seed)?,
            ..Request::new(engine.chat_prompt(&messages)?)
        };
        let outcome = match engine.submit(request) {
            Ok(stream) => stream_reply(stream, &mut stdout)?,
            Err(SubmitError::Invalid(e)) => Err(e),
            Err(e) => bail!(e),
        };
        let completion = match outcome {
            Ok(c) => c,
            Err(
                e @ (RequestError::PromptTooLong { .. } | RequestError::TooLargeForCache { .. }),
            ) => {
                messages.pop();
                eprintln!("[{e}; /reset to start a new conversation]");
                continue;
            }
            Err(e) => bail!(e),
        };
        writeln!(stdout)?;
        let n = completion.token_ids.len();
        let t = &completion.timings;
        let decode_tps = if n > 1 {
            (n - 1) as f64 / (t.decode_ms / 1e3)
        } else {
            0.0
        };
        eprintln!(
            "[{n} tokens, {decode_tps:.1} tok/s; prompt {} new + {} cached tokens in {:.0} ms]",
            completion.prefilled_tokens, completion.cached_prompt_tokens, t.prefill_ms
        );
        messages.push(ChatMessage::new("assistant", completion.text));
    }
    Ok(())
}

/// Prints the turn's text as it comes and returns its outcome. A closed stdout cancels the turn
/// and ends the chat with an error.
fn stream_reply(
    mut stream: RequestStream,
    out: &mut impl Write,
) -> Result<Result<Completion, RequestError>> {
    while let Some(event) = stream.blocking_next() {
        match event {
            Event::Text(delta) => {
                // Dropping the stream on the way out cancels the turn.
                out.write_all(delta.as_bytes())
                    .and_then(|_| out.flush())
                    .context("cannot write the reply")?;
            }
            Event::Logprobs(_) | Event::Token(_) => {}
            Event::Finished(c) => return Ok(Ok(c)),
            Event::Failed(e) => return Ok(Err(e)),
        }
    }
    Ok(Err(RequestError::Disconnected))
}
