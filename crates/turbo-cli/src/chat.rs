//! `turbo chat`: an interactive conversation whose KV cache persists across turns.

use crate::runtime::{chat_template, ModelArgs, SamplingArgs};
use crate::runtime::{EngineTask, LoadedModelInfo};
use anyhow::Result;
use clap::Args;
use std::io::{BufRead, Write};
use turbo_core::Backend;
use turbo_llama::chat::ChatMessage;
use turbo_scheduler::{Engine, EngineError, GenerationRequest, Session};

#[derive(Args, Clone, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// A system message opening the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Longest reply, in tokens.
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
}

pub fn run(args: ChatArgs) -> Result<()> {
    let model = args.model.clone();
    model.run(Chat { args })
}

struct Chat {
    args: ChatArgs,
}

impl EngineTask for Chat {
    type Output = ();

    fn run<B: Backend>(self, mut engine: Engine<B>, info: LoadedModelInfo) -> Result<()> {
        let Chat { args } = self;
        let template = chat_template(&engine, info.chat_template.as_deref())?;
        let request = GenerationRequest {
            sampling: args.sampling.params(),
            max_tokens: args.max_tokens,
            ..Default::default()
        };
        let opening: Vec<ChatMessage> = args
            .system
            .iter()
            .map(|s| ChatMessage::new("system", s))
            .collect();
        let mut messages = opening.clone();
        let mut session = Session::new();
        eprintln!(
            "Chat on {}. Type a message; /reset starts over, /exit quits.",
            engine.model().backend().name()
        );
        let stdin = std::io::stdin();
        let mut stdout = std::io::stdout();
        let mut line = String::new();
        loop {
            print!(">>> ");
            stdout.flush()?;
            line.clear();
            if stdin.lock().read_line(&mut line)? == 0 {
                println!();
                break;
            }
            let input = line.trim_end_matches(['\n', '\r']);
            match input.trim() {
                "" => continue,
                "/exit" | "/quit" => break,
                "/reset" => {
                    engine.release(&mut session)?;
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
            let ids = engine.tokenizer().encode(&text)?;
            let result = engine.generate(&mut session, &ids, &request, |delta| {
                print!("{delta}");
                stdout.flush().is_ok()
            });
            let completion = match result {
                Ok(c) => c,
                Err(e @ EngineError::PromptTooLong { .. }) => {
                    messages.pop();
                    eprintln!("[{e}; /reset to start a new conversation]");
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            println!();
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
