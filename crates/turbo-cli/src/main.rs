//! `turbo`: chat with, run, inspect and benchmark LLaMA-family models.

mod batch;
mod bench;
mod chat;
mod eval_kv;
mod eviction;
mod generate;
mod info;
mod plot;
mod runtime;
mod serve;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "turbo",
    version,
    about = "Turbo: fast inference for LLaMA-family models"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Options of `chat`, which runs when no subcommand is given.
    #[command(flatten)]
    chat: chat::ChatArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Interactive multi-turn chat (the default).
    Chat(chat::ChatArgs),
    /// Complete one prompt.
    Generate(generate::GenerateArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
    /// Show a model's configuration, tensor types and parameter count.
    Info(info::InfoArgs),
    /// Measure prefill and decode throughput, or what the KV cache saves (--multi-round,
    /// --shared-prefix).
    Bench(bench::BenchArgs),
    /// What KV eviction costs in quality: perplexity, greedy agreement (or a summary's
    /// ROUGE-L) of each policy and budget against full attention, on long texts.
    EvalKv(eval_kv::EvalKvArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TURBO_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        None => chat::run(cli.chat),
        Some(Command::Chat(args)) => chat::run(args),
        Some(Command::Generate(args)) => generate::run(args),
        Some(Command::Serve(args)) => serve::run(args),
        Some(Command::Info(args)) => info::run(args),
        Some(Command::Bench(args)) => bench::run(args),
        Some(Command::EvalKv(args)) => eval_kv::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
