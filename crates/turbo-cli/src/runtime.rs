//! What every model-running subcommand shares: finding the model, the device, the engine, the
//! size of the persistent batch's KV cache.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;
use turbo_core::cpu::CpuBackend;
use turbo_core::Backend;
use turbo_kernels::CudaBackend;
use turbo_tokenizer::tokenizer::TextTokenizer;
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
    /// Longest sequence to allow, instead of the context length the model declares. Beyond what
    /// the model was trained for, its output degrades; this is for measuring long contexts.
    #[arg(long)]
    pub context: Option<usize>,
    /// On a GPU, launch every decode step's kernels one by one instead of replaying the step
    /// recorded as a CUDA graph (for comparison and debugging).
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// KV blocks to map at a time on a GPU, as steps reach them (rounded up to the driver's
    /// allocation granularity, 2 MiB of each layer's keys and of its values on current GPUs),
    /// so that the KV cache holds memory only for the blocks used so far; default: the whole
    /// cache at start.
    #[arg(long, value_name = "BLOCKS")]
    pub kv_alloc_chunk: Option<usize>,
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
        anyhow::ensure!(self.context != Some(0), "--context must be positive");
        anyhow::ensure!(
            self.kv_alloc_chunk != Some(0),
            "--kv-alloc-chunk must be positive"
        );
        let path = self.resolve()?;
        let mut loaded = LoadedModel::load(&path)
            .with_context(|| format!("cannot load model {}", path.display()))?;
        if let Some(context) = self.context {
            if context > loaded.config.context_length {
                tracing::warn!(
                    "--context {context} is past the {} tokens the model declares",
                    loaded.config.context_length
                );
            }
            loaded.config.context_length = context;
        }
        Ok(loaded)
    }

    /// Loads the model onto the chosen device, wraps it in an engine sized for one full-context
    /// sequence, and runs `task` with it.
    pub fn run<T: EngineTask>(&self, task: T) -> Result<T::Output> {
        self.run_model(WithEngine(task))
    }

    /// Loads the model onto the chosen device and runs `task` with it.
    pub fn run_model<T: ModelTask>(&self, task: T) -> Result<T::Output> {
        let loaded = self.load()?;
        let device = match self.device {
            Device::Auto if turbo_kernels::cuda_available() => Device::Cuda(0),
            Device::Auto => Device::Cpu,
            d => d,
        };
        let info = LoadedModelInfo {
            context_length: loaded.config.context_length,
            chat_template: loaded.chat_template.clone(),
            block_size: self.block_size,
            device,
        };
        match device {
            Device::Cuda(ordinal) => {
                let backend = CudaBackend::new(ordinal)?;
                backend.set_graphs(!self.no_cuda_graphs);
                backend.set_kv_chunk_blocks(self.kv_alloc_chunk);
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
    /// Where the model runs: `Cpu` or `Cuda(n)`, never `Auto`.
    pub device: Device,
}

/// The model's chat template (ChatML when it has none).
pub fn chat_template(
    tokenizer: &TextTokenizer,
    source: Option<&str>,
) -> Result<turbo_tokenizer::chat::ChatTemplate> {
    Ok(turbo_tokenizer::chat::ChatTemplate::for_model(
        source, tokenizer,
    )?)
}

/// Share of free GPU memory (measured after the weights are loaded) that the KV cache takes when
/// no size is given: the rest is left for activations, cuBLAS workspaces and other processes.
pub const DEFAULT_GPU_KV_FRACTION: f64 = 0.9;

/// The size of the persistent batch's KV cache: at most one of the three. Without any, a GPU
/// takes [`DEFAULT_GPU_KV_FRACTION`] of its free memory (its cache is allocated up front unless
/// `--kv-alloc-chunk` is given), and the CPU a per-command default (its storage only grows as
/// blocks are used).
#[derive(Args, Clone, Debug, Default)]
pub struct KvArgs {
    /// KV cache size in blocks of --block-size tokens.
    #[arg(long, conflicts_with_all = ["kv_cache_gb", "kv_cache_fraction"])]
    pub kv_blocks: Option<usize>,
    /// KV cache size in GB (10^9 bytes).
    #[arg(long, conflicts_with = "kv_cache_fraction")]
    pub kv_cache_gb: Option<f64>,
    /// KV cache size as a fraction (0 < F <= 1) of the device's free memory once the weights
    /// are loaded (on the CPU: of MemAvailable). Default on a GPU: 0.9.
    #[arg(long)]
    pub kv_cache_fraction: Option<f64>,
}

impl KvArgs {
    /// Whether any size was given.
    pub fn is_set(&self) -> bool {
        self.kv_blocks.is_some() || self.kv_cache_gb.is_some() || self.kv_cache_fraction.is_some()
    }

    /// KV blocks for `model`, from the flags or the default (`cpu_default_tokens` of KV on the
    /// CPU). Refuses sizes that are not positive, a fraction outside (0, 1], and sizes below one
    /// block.
    pub fn num_blocks<B: Backend>(
        &self,
        model: &Llama<B>,
        info: &LoadedModelInfo,
        cpu_default_tokens: usize,
    ) -> Result<usize> {
        let block_size = info.block_size;
        let block_bytes = model.kv_spec(block_size, 1).bytes_per_token() / 4
            * model.backend().kv_element_bytes()
            * block_size;
        let from_bytes = |bytes: f64, what: String| -> Result<usize> {
            let blocks = (bytes / block_bytes as f64).floor();
            if blocks < 1.0 {
                bail!("{what} is less than one KV block ({block_bytes} bytes)");
            }
            Ok(blocks.min(u32::MAX as f64) as usize)
        };
        let fraction_of_free = |f: f64, what: String| -> Result<usize> {
            let Some(free) = model.backend().free_memory() else {
                bail!(
                    "{what}: {} does not report its free memory; use --kv-cache-gb or --kv-blocks",
                    model.backend().name()
                );
            };
            from_bytes(f * free as f64, format!("{what} of {free} free bytes"))
        };
        match (self.kv_blocks, self.kv_cache_gb, self.kv_cache_fraction) {
            (Some(0), _, _) => bail!("--kv-blocks must be positive"),
            (Some(n), _, _) => Ok(n),
            (_, Some(gb), _) => {
                if !(gb.is_finite() && gb > 0.0) {
                    bail!("--kv-cache-gb must be a positive number of GB, got {gb}");
                }
                from_bytes(gb * 1e9, format!("--kv-cache-gb {gb}"))
            }
            (_, _, Some(f)) => {
                if !(f > 0.0 && f <= 1.0) {
                    bail!("--kv-cache-fraction must be in (0, 1], got {f}");
                }
                fraction_of_free(f, format!("--kv-cache-fraction {f}"))
            }
            (None, None, None) => match info.device {
                Device::Cuda(_) => fraction_of_free(
                    DEFAULT_GPU_KV_FRACTION,
                    format!("the default KV cache ({DEFAULT_GPU_KV_FRACTION} of free memory)"),
                ),
                _ => Ok(cpu_default_tokens.div_ceil(block_size).max(1)),
            },
        }
    }
}
