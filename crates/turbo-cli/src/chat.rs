//! `turbo chat`: an interactive conversation whose KV cache persists across turns.
//!
//! The conversation is a session of a persistent batch: each turn submits the whole rendered
//! conversation, and the KV manager finds its history still resident (a cache hit), so only the
//! new message is prefilled. Text is streamed from the request's events as the batch steps.

use crate::runtime::LoadedModelInfo;
use crate::runtime::{chat_template, KvArgs, ModelArgs, ModelTask, SamplingArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::{BufRead, Write};
use turbo_core::Backend;
use turbo_tokenizer::chat::ChatMessage;
use turbo_tokenizer::tokenizer::TextTokenizer;
use turbo_llama::Llama;
use turbo_scheduler::{
    BatchConfig, Completion, Event, PersistentBatch, Request, RequestError, RequestHandle,
};

#[derive(Args, Clone, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    kv: KvArgs,
    /// A system message opening the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Longest reply, in tokens.
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
}

pub fn run(args: ChatArgs) -> Result<()> {
    args.sampling
        .params()
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid sampling options: {e}"))?;
    anyhow::ensure!(args.max_tokens > 0, "--max-tokens must be positive");
    let model = args.model.clone();
    model.run_model(Chat { args })
}

/// The session every turn of the conversation runs in.
const SESSION: &str = "chat";

/// Tokens per forward pass while prefilling a turn, bounding activation memory.
const PREFILL_CHUNK: usize = 512;

struct Chat {
    args: ChatArgs,
}

impl ModelTask for Chat {
    type Output = ();

    fn run<B: Backend>(
        self,
        model: Llama<B>,
        tokenizer: TextTokenizer,
        info: LoadedModelInfo,
    ) -> Result<()> {
        let Chat { args } = self;
        let template = chat_template(&tokenizer, info.chat_template.as_deref())?;
        // One conversation: on the CPU, room for a full context (storage grows as it is used).
        let config = BatchConfig {
            max_batch: 1,
            max_batched_tokens: PREFILL_CHUNK,
            block_size: info.block_size,
            num_blocks: args.kv.num_blocks(&model, &info, info.context_length)?,
            prefill_chunk: PREFILL_CHUNK,
            prefix_caching: true,
        };
        let mut batch = PersistentBatch::new(model, tokenizer, config)?;
        let opening: Vec<ChatMessage> = args
            .system
            .iter()
            .map(|s| ChatMessage::new("system", s))
            .collect();
        let mut messages = opening.clone();
        eprintln!(
            "Chat on {}. Type a message; /reset starts over, /exit quits.",
            batch.model().backend().name()
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
                    batch.end_session(SESSION)?;
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
            let text = template.render(&messages, true)?;
            let request = Request {
                sampling: args.sampling.params(),
                max_tokens: args.max_tokens,
                session: Some(SESSION.into()),
                ..Request::new(batch.tokenizer().encode(&text)?)
            };
            let handle = batch.submit(request);
            let completion = match stream_reply(&mut batch, &handle, &mut stdout)? {
                Ok(c) => c,
                Err(
                    e
                    @ (RequestError::PromptTooLong { .. } | RequestError::TooLargeForCache { .. }),
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
}

/// Steps the batch until the turn ends, printing its text as it comes. A closed stdout cancels
/// the turn and ends the chat with an error.
fn stream_reply<B: Backend>(
    batch: &mut PersistentBatch<B>,
    handle: &RequestHandle,
    out: &mut impl Write,
) -> Result<Result<Completion, RequestError>> {
    loop {
        for event in handle.events().try_iter() {
            match event {
                Event::Text(delta) => {
                    if let Err(e) = out.write_all(delta.as_bytes()).and_then(|_| out.flush()) {
                        batch.cancel(handle.id())?;
                        return Err(e).context("cannot write the reply");
                    }
                }
                Event::Token(_) => {}
                Event::Finished(c) => return Ok(Ok(c)),
                Event::Failed(e) => return Ok(Err(e)),
            }
        }
        if batch.is_idle() {
            return Ok(Err(RequestError::Disconnected));
        }
        batch.step()?;
    }
}
