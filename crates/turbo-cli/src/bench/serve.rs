//! `turbo bench serve`: load on an OpenAI-compatible server (`turbo serve`, llama-server, vLLM),
//! reported as vLLM's `benchmark_serving` does: throughput and percentiles of time to first
//! token, inter-token latency and end-to-end latency.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use turbo_loadgen::{LoadgenConfig, Rate, Synthetic, Workload};

#[derive(Args)]
pub struct ServeBenchArgs {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// The model name to send (default: none, for a server of one model).
    #[arg(long, default_value = "")]
    model_name: String,
    /// Requests, from --prompts-file or synthetic ShareGPT-like lengths.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Arrivals per second (Poisson), or `inf` for all at once.
    #[arg(long, default_value = "inf")]
    rate: String,
    /// Most requests in flight at once.
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Requests as `turbo generate --prompts-file` reads them (JSONL with `prompt`, `max_tokens`);
    /// the first --requests of them.
    #[arg(long)]
    prompts_file: Option<PathBuf>,
    /// Mean prompt length in words of the synthetic requests.
    #[arg(long, default_value_t = 200)]
    mean_in: usize,
    /// Mean output tokens of the synthetic requests.
    #[arg(long, default_value_t = 180)]
    mean_out: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Seconds one request may take.
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long, env = "TURBO_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Stop at end-of-sequence tokens instead of generating every requested token.
    #[arg(long)]
    honor_eos: bool,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Most requests of one run (a ShareGPT-scale run is 1,000).
const MAX_REQUESTS: usize = 100_000;
/// Longest mean prompt of the synthetic requests, in words, and most words of all of them.
const MAX_MEAN_IN: usize = 100_000;
const MAX_SYNTHETIC_WORDS: usize = 20_000_000;
/// Longest mean output of the synthetic requests, in tokens.
const MAX_MEAN_OUT: usize = 1 << 20;

pub fn run(args: ServeBenchArgs) -> Result<()> {
    anyhow::ensure!(args.requests > 0, "--requests must be positive");
    anyhow::ensure!(
        args.requests <= MAX_REQUESTS,
        "--requests {} is more than the {MAX_REQUESTS} allowed",
        args.requests
    );
    anyhow::ensure!(
        args.mean_in <= MAX_MEAN_IN,
        "--mean-in {} is more than the {MAX_MEAN_IN} words allowed",
        args.mean_in
    );
    anyhow::ensure!(
        args.mean_out <= MAX_MEAN_OUT,
        "--mean-out {} is more than the {MAX_MEAN_OUT} tokens allowed",
        args.mean_out
    );
    if args.prompts_file.is_none() {
        let words = args.requests.saturating_mul(args.mean_in);
        anyhow::ensure!(
            words <= MAX_SYNTHETIC_WORDS,
            "--requests {} of --mean-in {} words is {words} words, more than the \
             {MAX_SYNTHETIC_WORDS} allowed",
            args.requests,
            args.mean_in
        );
    }
    anyhow::ensure!(
        args.timeout.is_finite() && args.timeout > 0.0,
        "--timeout must be a positive number of seconds"
    );
    let rate = match args.rate.as_str() {
        "inf" => Rate::Infinite,
        r => Rate::PerSecond(
            r.parse()
                .ok()
                .filter(|r: &f64| r.is_finite() && *r > 0.0)
                .with_context(|| format!("--rate must be a positive number or inf, got {r}"))?,
        ),
    };
    let mut workload = match &args.prompts_file {
        Some(path) => {
            let limit = turbo_engine::limits::MAX_REQUESTS_FILE_BYTES;
            let text = turbo_engine::limits::read_file_bounded(path, limit)
                .with_context(|| format!("prompts file {}", path.display()))?;
            Workload::parse_jsonl(&text, &path.display().to_string(), args.mean_out)?
        }
        None => Workload::synthetic(&Synthetic {
            requests: args.requests,
            mean_in: args.mean_in,
            mean_out: args.mean_out,
            seed: args.seed,
            ..Synthetic::default()
        })?,
    };
    workload.requests.truncate(args.requests);
    let mut config = LoadgenConfig::new(args.url, args.model_name, workload);
    config.api_key = args.api_key;
    config.rate = rate;
    config.max_concurrency = args.max_concurrency;
    config.seed = args.seed;
    config.timeout = Some(crate::runtime::seconds("--timeout", args.timeout)?);
    config.ignore_eos = !args.honor_eos;
    let report = turbo_loadgen::run_blocking(&config)?;
    out!("{}", report.table())?;
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}
