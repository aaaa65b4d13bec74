//! `cargo xtask`: project chores written in Rust, so they need no extra tools.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;
use turbo_llama::{LoadedModel, ModelFormat};

mod kernels;

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum From {
    Hf,
    Gguf,
}

#[derive(Subcommand)]
enum Command {
    /// Compile kernels/*.cu to PTX (kernels/ptx/) with nvcc and record the sources' hashes.
    /// nvcc: $NVCC, else `nvcc` on PATH, else /usr/local/cuda/bin/nvcc.
    Kernels,
    /// Build the GPU test and bench binaries into .gpu/ with a run.sh that runs them all, for the
    /// GPU machine (which has no Rust toolchain).
    GpuBundle,
    /// Write a model as a native Turbo directory (safetensors in the native W_q/W_k layout), which
    /// the engine loads by memory-mapping, with no re-layout.
    Convert {
        /// Layout of the input: an HF directory or a GGUF file.
        #[arg(long, value_enum)]
        from: From,
        input: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
}

fn convert(from: From, input: PathBuf, out: PathBuf) -> Result<()> {
    let model =
        LoadedModel::load(&input).with_context(|| format!("cannot load {}", input.display()))?;
    match (from, model.format) {
        (From::Hf, ModelFormat::HfSafetensors) | (From::Gguf, ModelFormat::Gguf) => {}
        (_, found) => bail!(
            "{} is a {found} model, not what --from says",
            input.display()
        ),
    }
    turbo_llama::native::write(&model, &out)
        .with_context(|| format!("cannot write {}", out.display()))?;
    println!(
        "wrote {} ({} layers, {} tensor types: {:?})",
        out.display(),
        model.config.n_layers,
        model.tensor_types().len(),
        model.tensor_types()
    );
    Ok(())
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Convert { from, input, out } => convert(from, input, out),
        Command::Kernels => kernels::compile(),
        Command::GpuBundle => kernels::gpu_bundle(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
