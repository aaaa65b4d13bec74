//! `turbo bench`: prefill and decode throughput, measured like llama-bench's pp and tg tests;
//! with `--multi-round` or `--shared-prefix`, what the KV cache saves (see [`multi_round`] and
//! [`shared_prefix`]).

mod multi_round;
mod serve;
mod shared_prefix;

use crate::runtime::{KvArgs, ModelArgs};
use anyhow::{bail, Result};
use clap::Args;
use serde::Serialize;
use turbo_core::Backend;
use turbo_engine::{LoadedModelInfo, ModelTask};
use turbo_llama::Llama;
use turbo_scheduler::{BatchConfig, Completion, PersistentBatch, Request};
use turbo_tokenizer::tokenizer::TextTokenizer;

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    /// Load on a running server instead of measuring the engine in process.
    #[command(subcommand)]
    target: Option<BenchTarget>,
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length of the prefill test.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens generated: in the decode test (default 128), per round of --multi-round (default
    /// 64), per request of --shared-prefix (default 16).
    #[arg(long)]
    gen_tokens: Option<usize>,
    /// Context the decode test starts from (a prompt of this many tokens, prefilled untimed).
    #[arg(long, default_value_t = 1)]
    decode_context: usize,
    /// Runs per measurement (default 3; 1 with --shared-prefix).
    #[arg(long)]
    repeats: Option<usize>,
    /// Multi-round chat: time to first token of each of N rounds of one conversation, with the
    /// KV cache (a round prefills only its new message) and without (it prefills the whole
    /// history).
    #[arg(long, conflicts_with = "shared_prefix")]
    multi_round: Option<usize>,
    /// Prefix sharing: N requests sharing a system prompt of --prefix-tokens run at once, with
    /// prefix sharing and without; prefill work, KV blocks and wall time of each.
    #[arg(long)]
    shared_prefix: Option<usize>,
    /// Tokens of the shared system prompt of --shared-prefix.
    #[arg(long, default_value_t = 2000)]
    prefix_tokens: usize,
    /// Tokens of each user message: per round of --multi-round (about; default 150), per request
    /// of --shared-prefix (exactly; default 32).
    #[arg(long)]
    user_tokens: Option<usize>,
    /// Batch slots of --shared-prefix.
    #[arg(long, default_value_t = 64)]
    max_batch: usize,
    /// Tokens per forward pass of --shared-prefix.
    #[arg(long, default_value_t = 2048)]
    max_batched_tokens: usize,
    /// KV cache size of --multi-round and --shared-prefix (default on the CPU: one full context,
    /// or room for every --shared-prefix request unshared).
    #[command(flatten)]
    kv: KvArgs,
    /// Print one JSON object with every measurement.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Subcommand)]
enum BenchTarget {
    /// Requests to an OpenAI-compatible server: throughput and TTFT / ITL / end-to-end latency
    /// percentiles.
    Serve(serve::ServeBenchArgs),
}

#[derive(Serialize)]
struct Report {
    device: String,
    model: String,
    /// Bytes the weight matrices take on the device.
    weight_bytes: usize,
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

/// Sentences that user messages are cut from.
const PROSE: &[&str] = &[
    "I am planning a two-week trip through the north of Portugal in late September, travelling by train where I can. ",
    "My partner likes old towns and wine, while I would rather spend the mornings walking along the coast or in the hills. ",
    "We have a budget of about ninety euros a day for the two of us, not counting the flights. ",
    "Last year we tried to see too much in too little time and came home more tired than when we left. ",
    "This time I would like fewer places and longer stays, ideally three or four nights in each. ",
    "Neither of us drives, so anything that needs a car is out unless there is a reliable bus. ",
    "We also want at least one day with nothing planned at all, just to sit in a square and read. ",
    "Could you suggest how to split the days, and which towns are worth the detour? ",
    "I have read that the Douro valley is beautiful at harvest time but also very busy with tour groups. ",
    "Is it better to stay in a small village there, or in a larger town with more connections? ",
    "We are vegetarian, which I hear can be a little difficult in traditional restaurants. ",
    "Any advice on what to order, or on phrases that would help, would be very welcome. ",
    "Finally, we would like to bring back something made locally that is not just a souvenir. ",
    "Please keep the answer practical: times, distances and rough prices help more than descriptions. ",
    "If something in my plan seems unrealistic, tell me plainly rather than being polite about it. ",
    "We can be flexible about the order of the towns, but we must fly home from Porto. ",
];

/// `PROSE` from sentence `start` on (cyclically), `header` first, until the text has at least
/// `tokens` tokens.
fn prose(tokenizer: &TextTokenizer, header: &str, start: usize, tokens: usize) -> Result<String> {
    let mut text = header.to_string();
    let mut i = start;
    while tokenizer.encode(&text)?.len() < tokens {
        text.push_str(PROSE[i % PROSE.len()]);
        i += 1;
    }
    Ok(text)
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// Most repetitions of a measurement: past this the median does not move, the wall clock does.
const MAX_REPEATS: usize = 1000;

pub fn run(mut args: BenchArgs) -> Result<()> {
    if let Some(BenchTarget::Serve(serve)) = args.target.take() {
        return serve::run(serve);
    }
    let positive = |v: Option<usize>, name: &str| -> Result<()> {
        anyhow::ensure!(v != Some(0), "{name} must be positive");
        Ok(())
    };
    positive(args.repeats, "--repeats")?;
    anyhow::ensure!(
        args.repeats.is_none_or(|r| r <= MAX_REPEATS),
        "--repeats must be at most {MAX_REPEATS}"
    );
    positive(args.gen_tokens, "--gen-tokens")?;
    positive(args.user_tokens, "--user-tokens")?;
    positive(args.multi_round, "--multi-round")?;
    positive(args.shared_prefix, "--shared-prefix")?;
    let path = args.model.resolve()?;
    let model = args.model.clone();
    if let Some(rounds) = args.multi_round {
        return model.run_model(multi_round::MultiRound {
            rounds,
            user_tokens: args.user_tokens.unwrap_or(150),
            gen_tokens: args.gen_tokens.unwrap_or(64),
            repeats: args.repeats.unwrap_or(3),
            kv: args.kv,
            json: args.json,
            model: path.display().to_string(),
            overlap: !args.model.no_overlap,
        });
    }
    if let Some(requests) = args.shared_prefix {
        anyhow::ensure!(args.max_batch > 0, "--max-batch must be positive");
        let max_batched_tokens =
            crate::batch::tokens_per_step(args.max_batched_tokens, args.max_batch)?;
        return model.run_model(shared_prefix::SharedPrefix {
            requests,
            prefix_tokens: args.prefix_tokens,
            user_tokens: args.user_tokens.unwrap_or(32),
            gen_tokens: args.gen_tokens.unwrap_or(16),
            repeats: args.repeats.unwrap_or(1),
            max_batch: args.max_batch,
            max_batched_tokens,
            kv: args.kv,
            json: args.json,
            model: path.display().to_string(),
            overlap: !args.model.no_overlap,
        });
    }
    anyhow::ensure!(
        !args.kv.is_set(),
        "--kv-blocks, --kv-cache-gb and --kv-cache-fraction apply to --multi-round and \
         --shared-prefix; the prefill and decode tests run one sequence"
    );
    anyhow::ensure!(args.prompt_tokens > 0, "--prompt-tokens must be positive");
    model.run_model(Bench { args, path })
}

struct Bench {
    args: BenchArgs,
    path: std::path::PathBuf,
}

impl ModelTask for Bench {
    type Output = Result<()>;

    fn run<B: Backend>(
        self,
        model: Llama<B>,
        tokenizer: TextTokenizer,
        info: LoadedModelInfo,
    ) -> Result<()> {
        let Bench { args, path } = self;
        let gen_tokens = args.gen_tokens.unwrap_or(128);
        let repeats = args.repeats.unwrap_or(3);
        let context = info.context_length;
        anyhow::ensure!(
            args.decode_context >= 1,
            "--decode-context must be at least 1"
        );
        anyhow::ensure!(
            args.prompt_tokens < context,
            "--prompt-tokens {} does not fit the model's context of {context} tokens",
            args.prompt_tokens
        );
        anyhow::ensure!(
            args.decode_context.saturating_add(gen_tokens) < context,
            "--decode-context {} plus --gen-tokens {gen_tokens} does not fit the model's context \
             of {context} tokens",
            args.decode_context
        );
        let mut prompt = Vec::new();
        while prompt.len() < args.prompt_tokens.max(args.decode_context) {
            prompt.extend(tokenizer.encode(TEXT)?);
        }
        let decode_prompt = prompt[..args.decode_context].to_vec();
        prompt.truncate(args.prompt_tokens);

        // One sequence at a time, its prompt in one forward pass, nothing reused between runs.
        let chunk = args.prompt_tokens.max(args.decode_context);
        let config = BatchConfig {
            max_batch: 1,
            max_batched_tokens: chunk,
            block_size: info.block_size,
            num_blocks: info.context_length.div_ceil(info.block_size),
            prefill_chunk: chunk,
            prefix_caching: false,
        };
        let weight_bytes = model.weight_bytes();
        let mut batch = PersistentBatch::new(model, tokenizer, config)?;
        batch.set_overlap(batch.overlaps() && !args.model.no_overlap);
        let mut run_once = |prompt: &[u32], max_tokens: usize| -> Result<Completion> {
            let handle = batch.submit(Request {
                max_tokens,
                ignore_eos: true,
                ..Request::new(prompt.to_vec())
            });
            batch.run_until_idle()?;
            match handle.wait() {
                Ok(c) => Ok(c),
                Err(e) => bail!(e),
            }
        };
        run_once(&prompt[..prompt.len().min(16)], 2)?; // warm-up: page in the weights
        let mut prefill = Vec::new();
        let mut decode = Vec::new();
        for _ in 0..repeats {
            let c = run_once(&prompt, 1)?;
            prefill.push(args.prompt_tokens as f64 / (c.timings.prefill_ms / 1e3));
            // The decode prompt, then gen_tokens forward passes after the first sampled token.
            let c = run_once(&decode_prompt, gen_tokens + 1)?;
            decode.push(gen_tokens as f64 / (c.timings.decode_ms / 1e3));
        }
        let report = Report {
            device: batch.model().backend().name(),
            model: path.display().to_string(),
            weight_bytes,
            prompt_tokens: args.prompt_tokens,
            gen_tokens,
            decode_context: args.decode_context,
            prefill_tok_s_median: median(&prefill),
            decode_tok_s_median: median(&decode),
            prefill_tok_s: prefill,
            decode_tok_s: decode,
        };
        if args.json {
            outln!("{}", serde_json::to_string(&report)?)?;
        } else {
            outln!("device   {}", report.device)?;
            outln!("model    {}", report.model)?;
            outln!(
                "weights  {:.3} GB on the device (the file: {:.3} GB)",
                report.weight_bytes as f64 / 1e9,
                std::fs::metadata(&path).map_or(0, |m| m.len()) as f64 / 1e9
            )?;
            outln!(
                "pp{:<6} {:8.1} tok/s (median of {}; runs {:?})",
                report.prompt_tokens,
                report.prefill_tok_s_median,
                repeats,
                report
                    .prefill_tok_s
                    .iter()
                    .map(|x| (x * 10.0).round() / 10.0)
                    .collect::<Vec<_>>()
            )?;
            outln!(
                "tg{:<6} {:8.1} tok/s from context {} (median of {}; runs {:?})",
                report.gen_tokens,
                report.decode_tok_s_median,
                report.decode_context,
                repeats,
                report
                    .decode_tok_s
                    .iter()
                    .map(|x| (x * 10.0).round() / 10.0)
                    .collect::<Vec<_>>()
            )?;
        }
        Ok(())
    }
}
