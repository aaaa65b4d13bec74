//! `turbo bench`: prefill and decode throughput, measured like llama-bench's pp and tg tests.

use crate::runtime::ModelArgs;
use crate::runtime::{EngineTask, LoadedModelInfo};
use anyhow::Result;
use clap::Args;
use serde::Serialize;
use turbo_core::Backend;
use turbo_scheduler::{Engine, GenerationRequest, Session};

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length of the prefill test.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens generated in the decode test.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Context the decode test starts from (a prompt of this many tokens, prefilled untimed).
    #[arg(long, default_value_t = 1)]
    decode_context: usize,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Print one JSON object with every measurement.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Report {
    device: String,
    model: String,
    prompt_tokens: usize,
    gen_tokens: usize,
    decode_context: usize,
    prefill_tok_s: Vec<f64>,
    decode_tok_s: Vec<f64>,
    prefill_tok_s_median: f64,
    decode_tok_s_median: f64,
}

const TEXT: &str = "The history of computing is a story of abstraction layered upon abstraction. \
Early machines were programmed by rewiring panels; later, stored programs let the same hardware \
perform many tasks. Compilers translated human-readable code into machine instructions, operating \
systems shared one computer among many users, and networks joined computers into a single system. ";

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

pub fn run(args: BenchArgs) -> Result<()> {
    anyhow::ensure!(args.repeats > 0, "--repeats must be positive");
    anyhow::ensure!(
        args.prompt_tokens > 0 && args.gen_tokens > 0,
        "token counts must be positive"
    );
    let path = args.model.resolve()?;
    let model = args.model.clone();
    model.run(Bench { args, path })
}

struct Bench {
    args: BenchArgs,
    path: std::path::PathBuf,
}

impl EngineTask for Bench {
    type Output = ();

    fn run<B: Backend>(self, mut engine: Engine<B>, info: LoadedModelInfo) -> Result<()> {
        let Bench { args, path } = self;
        anyhow::ensure!(
            args.prompt_tokens < info.context_length
                && args.decode_context >= 1
                && args.decode_context + args.gen_tokens < info.context_length,
            "the model's context is {} tokens",
            info.context_length
        );
        let mut prompt = Vec::new();
        while prompt.len() < args.prompt_tokens.max(args.decode_context) {
            prompt.extend(engine.tokenizer().encode(TEXT)?);
        }
        let decode_prompt = prompt[..args.decode_context].to_vec();
        prompt.truncate(args.prompt_tokens);

        let mut run_once =
            |prompt: &[u32], max_tokens: usize| -> Result<turbo_scheduler::Completion> {
                let mut session = Session::new();
                let request = GenerationRequest {
                    max_tokens,
                    ignore_eos: true,
                    ..Default::default()
                };
                let c = engine.generate(&mut session, prompt, &request, |_| true)?;
                engine.release(&mut session)?;
                Ok(c)
            };
        run_once(&prompt[..prompt.len().min(16)], 2)?; // warm-up: page in the weights
        let mut prefill = Vec::new();
        let mut decode = Vec::new();
        for _ in 0..args.repeats {
            let c = run_once(&prompt, 1)?;
            prefill.push(args.prompt_tokens as f64 / (c.timings.prefill_ms / 1e3));
            // The decode prompt, then gen_tokens forward passes after the first sampled token.
            let c = run_once(&decode_prompt, args.gen_tokens + 1)?;
            decode.push(args.gen_tokens as f64 / (c.timings.decode_ms / 1e3));
        }
        let report = Report {
            device: engine.model().backend().name(),
            model: path.display().to_string(),
            prompt_tokens: args.prompt_tokens,
            gen_tokens: args.gen_tokens,
            decode_context: args.decode_context,
            prefill_tok_s_median: median(&prefill),
            decode_tok_s_median: median(&decode),
            prefill_tok_s: prefill,
            decode_tok_s: decode,
        };
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!("device   {}", report.device);
            println!("model    {}", report.model);
            println!(
                "pp{:<6} {:8.1} tok/s (median of {}; runs {:?})",
                report.prompt_tokens,
                report.prefill_tok_s_median,
                args.repeats,
                report
                    .prefill_tok_s
                    .iter()
                    .map(|x| (x * 10.0).round() / 10.0)
                    .collect::<Vec<_>>()
            );
            println!(
                "tg{:<6} {:8.1} tok/s from context {} (median of {}; runs {:?})",
                report.gen_tokens,
                report.decode_tok_s_median,
                report.decode_context,
                args.repeats,
                report
                    .decode_tok_s
                    .iter()
                    .map(|x| (x * 10.0).round() / 10.0)
                    .collect::<Vec<_>>()
            );
        }
        Ok(())
    }
}
