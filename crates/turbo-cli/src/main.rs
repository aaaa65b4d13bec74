//! `turbo`: chat with, run, inspect and benchmark LLaMA-family models.

#[macro_use]
mod output;
mod batch;
mod bench;
mod chat;
mod eval_kv;
mod eviction;
mod generate;
mod info;
mod interrupt;
mod plot;
mod runtime;
mod serve;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
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
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TURBO_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = match numbers_may_be_negative(Cli::command())
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m))
    {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    // Ctrl-C is the command's from the start (the server handles its own signals).
    if !matches!(cli.command, Some(Command::Serve(_))) {
        if let Err(e) = interrupt::install() {
            return exit_code(Err(e));
        }
    }
    let result = match cli.command {
        None => chat::run(cli.chat),
        Some(Command::Chat(args)) => chat::run(args),
        Some(Command::Generate(args)) => generate::run(args),
        Some(Command::Serve(args)) => serve::run(args),
        Some(Command::Info(args)) => info::run(args),
        Some(Command::Bench(args)) => bench::run(args),
        Some(Command::EvalKv(args)) => eval_kv::run(args),
    };
    exit_code(result)
}

/// How a command's outcome ends the process: a reader that went away ends it quietly with
/// success (its output was not wanted any more), Ctrl-C with 130, any other error with one line
/// on stderr and 1.
fn exit_code(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if output::is_closed_pipe(&e) => ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<interrupt::Interrupted>().is_some() => {
            ExitCode::from(interrupt::EXIT_CODE)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A command line clap refuses: its first line (`error: ...`, naming what was wrong) and exit
/// code 2, as for any other refusal one line; `--help` and `--version` print as usual.
/// Lets every option that takes a value take a negative number, so that `--threads -1` is refused
/// by the option's own check, naming it, rather than taken for an unknown flag `-1`. Clap's test
/// of "a number" does not take `-inf` or a pair such as `-1:2`: the floating-point options and
/// `--keyformer-tau` allow any value that starts with a hyphen where they are defined.
fn numbers_may_be_negative(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| match a.get_action().takes_values() {
        true => a.allow_negative_numbers(true),
        false => a,
    })
    .mut_subcommands(numbers_may_be_negative)
}

fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        let _ = e.print();
        return ExitCode::SUCCESS;
    }
    // Clap's first paragraph, as one line: a missing argument's name is on the lines after
    // "the following required arguments were not provided:".
    let rendered = e.render().to_string();
    let paragraph: Vec<&str> = rendered
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    let line = match paragraph.is_empty() {
        true => "error: invalid arguments".to_string(),
        false => paragraph.join(" "),
    };
    eprintln!("{line} (see --help)");
    ExitCode::from(2)
}
