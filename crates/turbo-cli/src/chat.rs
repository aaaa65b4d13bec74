//! `turbo chat`: an interactive conversation whose KV cache persists across turns.
//!
//! The conversation is a session of a persistent batch: each turn submits the whole rendered
//! conversation, and the KV manager finds its history still resident (a cache hit), so only the
//! new message is prefilled. Text is streamed from the request's events as the batch steps.

use crate::runtime::{KvArgs, ModelArgs, SamplingArgs};
use anyhow::{bail, Result};
use clap::Args;
use std::io::BufRead;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use turbo_engine::{ChatMessage, Engine, EngineConfig, RequestStream, SubmitError};
use turbo_scheduler::{Completion, Event, FinishReason, Request, RequestError};

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
    let engine = Arc::new(Engine::start(EngineConfig {
        kv: args.kv.size(1, usize::MAX)?,
        max_batch: 1,
        max_batched_tokens: PREFILL_CHUNK,
        prefill_chunk: PREFILL_CHUNK,
        ..args.model.engine_config()?
    })?);
    let in_flight = Arc::new(AtomicU64::new(IDLE));
    handle_ctrl_c(engine.clone(), in_flight.clone());
    let opening: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s))
        .collect();
    let mut messages = opening.clone();
    eprintln!(
        "Chat on {}. Type a message; /reset starts over, /exit (or Ctrl-D) quits, Ctrl-C stops \
         a reply.",
        engine.info().backend
    );
    let mut stdin = std::io::stdin().lock();
    let limit = engine.info().max_prompt_bytes;
    loop {
        out!(">>> ")?;
        let input = match read_line_bounded(&mut stdin, limit)? {
            Line::End => {
                outln!()?;
                break;
            }
            Line::TooLong => {
                eprintln!("[the message is longer than {limit} bytes, more than the context holds; not sent]");
                continue;
            }
            Line::NotUtf8 => {
                eprintln!("[the message is not UTF-8 text; not sent]");
                continue;
            }
            Line::Endless => anyhow::bail!(
                "the input has a line of more than {} bytes with no end; it is not chat text",
                limit + MAX_DISCARDED_BYTES
            ),
            Line::Text(text) => text,
        };
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
        let prompt = match engine.chat_prompt(&messages) {
            Ok(prompt) => prompt,
            Err(e @ turbo_engine::EngineError::PromptTextTooLong { .. }) => {
                messages.pop();
                eprintln!("[{e}; /reset to start a new conversation]");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let request = Request {
            sampling: args.sampling.params(),
            max_tokens: args.max_tokens,
            session: Some(SESSION.into()),
            kv_eviction: args.eviction.eviction(args.sampling.seed)?,
            ..Request::new(prompt)
        };
        let outcome = match engine.submit(request) {
            Ok(stream) => {
                in_flight.store(stream.id(), Ordering::SeqCst);
                let outcome = stream_reply(stream);
                in_flight.store(IDLE, Ordering::SeqCst);
                outcome?
            }
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
        outln!()?;
        let n = completion.token_ids.len();
        let t = &completion.timings;
        let decode_tps = if n > 1 {
            (n - 1) as f64 / (t.decode_ms / 1e3)
        } else {
            0.0
        };
        // A stopped reply stays in the conversation as far as the user saw it.
        let stopped = match completion.finish_reason {
            FinishReason::Cancelled => "reply stopped: ",
            _ => "",
        };
        eprintln!(
            "[{stopped}{n} tokens, {decode_tps:.1} tok/s; prompt {} new + {} cached tokens in {:.0} ms]",
            completion.prefilled_tokens, completion.cached_prompt_tokens, t.prefill_ms
        );
        messages.push(ChatMessage::new("assistant", completion.text));
    }
    Ok(())
}

/// [`in_flight`](run) when no reply is being generated.
const IDLE: u64 = u64::MAX;

/// Ctrl-C while a reply is generated stops it (the conversation goes on); at the prompt, the
/// first one only says how to quit and a second one quits.
fn handle_ctrl_c(engine: Arc<Engine>, in_flight: Arc<AtomicU64>) {
    let at_prompt = AtomicUsize::new(0);
    crate::interrupt::on_ctrl_c(move |_| {
        let id = in_flight.load(Ordering::SeqCst);
        if id != IDLE {
            engine.cancel(id);
            at_prompt.store(0, Ordering::SeqCst);
        } else if at_prompt.fetch_add(1, Ordering::SeqCst) == 0 {
            eprintln!("\n[Ctrl-C again, Ctrl-D or /exit to quit]");
            let _ = out!(">>> ");
        } else {
            eprintln!();
            std::process::exit(0);
        }
    })
}

/// A line of input, read with a bound on its length.
#[derive(Debug, PartialEq)]
enum Line {
    Text(String),
    /// Longer than the bound; the rest of it was read and dropped.
    TooLong,
    /// Longer than the bound and still going [`MAX_DISCARDED_BYTES`] past it without a line
    /// end: not lines at all (`/dev/zero`, a binary file), so reading stops.
    Endless,
    NotUtf8,
    /// End of input.
    End,
}

/// How far past the bound a line may run before the input is taken for something that has no
/// lines (a few tenths of a second of reading `/dev/zero`).
const MAX_DISCARDED_BYTES: u64 = 64 << 20;

/// Reads one line (without its `\n` or `\r\n`), holding at most `limit` bytes of it: a longer
/// line is consumed to its end and reported, never kept, unless it runs on for
/// [`MAX_DISCARDED_BYTES`] more.
fn read_line_bounded(input: &mut impl BufRead, limit: u64) -> std::io::Result<Line> {
    let mut line = Vec::new();
    let mut too_long = false;
    let mut discarded = 0u64;
    let mut any = false;
    loop {
        let buf = match input.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            if !any {
                return Ok(Line::End);
            }
            break;
        }
        any = true;
        let (chunk, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], Some(i + 1)),
            None => (buf, None),
        };
        if !too_long {
            if (line.len() + chunk.len()) as u64 > limit {
                too_long = true;
                line = Vec::new();
            } else {
                line.extend_from_slice(chunk);
            }
        }
        let used = done.unwrap_or(buf.len());
        input.consume(used);
        if done.is_some() {
            break;
        }
        if too_long {
            discarded += used as u64;
            if discarded > MAX_DISCARDED_BYTES {
                return Ok(Line::Endless);
            }
        }
    }
    if too_long {
        return Ok(Line::TooLong);
    }
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    Ok(String::from_utf8(line).map_or(Line::NotUtf8, Line::Text))
}

/// Prints the turn's text as it comes and returns its outcome. A closed stdout cancels the turn
/// and ends the chat (quietly: the reader went away).
fn stream_reply(mut stream: RequestStream) -> Result<Result<Completion, RequestError>> {
    while let Some(event) = stream.blocking_next() {
        match event {
            // Dropping the stream on the way out cancels the turn.
            Event::Text(delta) => out!("{delta}")?,
            Event::Logprobs(_) | Event::Token(_) => {}
            Event::Finished(c) => return Ok(Ok(c)),
            Event::Failed(e) => return Ok(Err(e)),
        }
    }
    Ok(Err(RequestError::Disconnected))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8], limit: u64) -> Vec<Line> {
        let mut reader = std::io::BufReader::with_capacity(4, input);
        let mut out = Vec::new();
        loop {
            let line = read_line_bounded(&mut reader, limit).unwrap();
            let end = line == Line::End;
            out.push(line);
            if end {
                return out;
            }
        }
    }

    #[test]
    fn an_endless_line_stops_the_reading() {
        let mut reader = std::io::BufReader::new(std::io::repeat(0));
        assert_eq!(read_line_bounded(&mut reader, 100).unwrap(), Line::Endless);
        // A long line that does end is only refused.
        let mut long = vec![b'a'; 5 << 20];
        long.extend_from_slice(b"\nok\n");
        let mut reader = std::io::BufReader::new(&long[..]);
        assert_eq!(read_line_bounded(&mut reader, 100).unwrap(), Line::TooLong);
        assert_eq!(
            read_line_bounded(&mut reader, 100).unwrap(),
            Line::Text("ok".into())
        );
    }

    #[test]
    fn lines_are_bounded_checked_and_keep_their_neighbours() {
        let text = |s: &str| Line::Text(s.into());
        assert_eq!(
            lines(b"hello\r\n0123456789abc\nbad \xff\n\nlast", 10),
            [
                text("hello"),
                Line::TooLong,
                Line::NotUtf8,
                text(""),
                text("last"),
                Line::End
            ]
        );
        // Exactly at the bound is fine; a line with multi-byte characters counts bytes.
        assert_eq!(
            lines("0123456789\né".as_bytes(), 10)[..2],
            [text("0123456789"), text("é")]
        );
    }
}
