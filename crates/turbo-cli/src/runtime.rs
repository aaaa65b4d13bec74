//! What every model-running subcommand shares: finding the model, the device, the engine.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use turbo_core::cpu::CpuBackend;
use turbo_core::Backend;
use turbo_kernels::CudaBackend;
use turbo_llama::tokenizer::TextTokenizer;
use turbo_llama::{Llama, LoadedModel};
use turbo_models::DEFAULT_MODEL;
use turbo_scheduler::{Engine, SamplingParams};

/// Where to compute: `auto` (CUDA when a GPU is present, else the CPU), `cpu`, `cuda` or `cuda:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| {
                    format!("unknown device '{s}' (expected auto, cpu, cuda or cuda:N)")
                }),
        }
    }
}

/// Work that needs an engine, whichever backend it runs on.
pub trait EngineTask {
    type Output;
    fn run<B: Backend>(self, engine: Engine<B>, info: LoadedModelInfo) -> Result<Self::Output>;
}

/// Work that needs the model itself (e.g. to build a persistent batch), whichever backend.
pub trait ModelTask {
    type Output;
    fn run<B: Backend>(
        self,
        model: Llama<B>,
        tokenizer: TextTokenizer,
        info: LoadedModelInfo,
    ) -> Result<Self::Output>;
}

/// Adapts an [`EngineTask`] to a [`ModelTask`] by wrapping the model in a single-sequence engine.
struct WithEngine<T>(T);

impl<T: EngineTask> ModelTask for WithEngine<T> {
    type Output = T::Output;
    fn run<B: Backend>(
        self,
        model: Llama<B>,
        tokenizer: TextTokenizer,
        info: LoadedModelInfo,
    ) -> Result<T::Output> {
        let engine = Engine::for_context(model, tokenizer, info.block_size)?;
        self.0.run(engine, info)
    }
}

#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// A GGUF file, an HF model directory, or a native directory from `cargo xtask convert`.
    /// Without it, the default model (SmolLM2-135M-Instruct) is used, downloaded on first use.
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// Where to compute: auto (a GPU when present), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: Device,
    /// CPU threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
}

#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// 0 is greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
        }
    }
}

impl ModelArgs {
    /// The model's path, fetching the default model if none was given.
    pub fn resolve(&self) -> Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => Ok(DEFAULT_MODEL.ensure(true)?),
        }
    }

    pub fn load(&self) -> Result<LoadedModel> {
        anyhow::ensure!(self.threads != Some(0), "--threads must be positive");
        anyhow::ensure!(self.block_size > 0, "--block-size must be positive");
        let path = self.resolve()?;
        LoadedModel::load(&path).with_context(|| format!("cannot load model {}", path.display()))
    }

    /// Loads the model onto the chosen device, wraps it in an engine sized for one full-context
    /// sequence, and runs `task` with it.
    pub fn run<T: EngineTask>(&self, task: T) -> Result<T::Output> {
        self.run_model(WithEngine(task))
    }

    /// Loads the model onto the chosen device and runs `task` with it.
    pub fn run_model<T: ModelTask>(&self, task: T) -> Result<T::Output> {
        let loaded = self.load()?;
        let info = LoadedModelInfo {
            context_length: loaded.config.context_length,
            chat_template: loaded.chat_template.clone(),
            block_size: self.block_size,
        };
        let device = match self.device {
            Device::Auto if turbo_kernels::cuda_available() => Device::Cuda(0),
            Device::Auto => Device::Cpu,
            d => d,
        };
        match device {
            Device::Cuda(ordinal) => {
                let backend = CudaBackend::new(ordinal)?;
                let model = Llama::new(backend, &loaded.config, &loaded.weights)?;
                task.run(model, loaded.tokenizer, info)
            }
            _ => {
                let backend = match self.threads {
                    Some(n) => CpuBackend::with_threads(n)?,
                    None => CpuBackend::new(),
                };
                let model = Llama::new(backend, &loaded.config, &loaded.weights)?;
                task.run(model, loaded.tokenizer, info)
            }
        }
    }
}

/// What a subcommand still needs to know after the weights moved into the engine.
pub struct LoadedModelInfo {
    pub context_length: usize,
    pub chat_template: Option<String>,
    pub block_size: usize,
}

/// The model's chat template (ChatML when it has none).
pub fn chat_template<B: Backend>(
    engine: &Engine<B>,
    source: Option<&str>,
) -> Result<turbo_llama::chat::ChatTemplate> {
    Ok(turbo_llama::chat::ChatTemplate::for_model(
        source,
        engine.tokenizer(),
    )?)
}
