//! What every model-running subcommand shares: finding the model, the device, the engine, the
//! size of the persistent batch's KV cache.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use turbo_core::cpu::CpuActivations;
use turbo_core::{Backend, KvDtype};
use turbo_engine::{Device, EngineConfig, KvSize, LoadedModelInfo, ModelOptions, ModelTask};
use turbo_llama::Llama;
use turbo_scheduler::SamplingParams;

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
    /// On a model split over GPUs, all-reduce through NCCL only, instead of through the GPUs'
    /// mapped memory for decode-sized messages (for comparison; split steps are then not
    /// recorded as CUDA graphs).
    #[arg(long)]
    pub no_peer_all_reduce: bool,
    /// On a GPU, run steps one after another, the host waiting for each step's tokens before
    /// preparing the next, instead of overlapping the host's work with the device's (for
    /// comparison).
    #[arg(long)]
    pub no_overlap: bool,
    /// On a GPU, start without first running a prefill chunk and decode steps once; the first
    /// requests' steps then load kernels, choose product algorithms and record step graphs.
    #[arg(long)]
    pub no_warm_up: bool,
    /// KV blocks to map at a time on a GPU, as steps reach them (rounded up to the driver's
    /// allocation granularity, 2 MiB of each layer's keys and of its values on current GPUs),
    /// so that the KV cache holds memory only for the blocks used so far; default: the whole
    /// cache at start.
    #[arg(long, value_name = "BLOCKS")]
    pub kv_alloc_chunk: Option<usize>,
    /// Split the model over N ranks (tensor parallelism): GPUs cuda:K .. cuda:K+N-1 from the
    /// --device named (NCCL), or N groups of CPU threads. Heads, KV heads (or N a multiple of
    /// them) and the FFN width must divide by N.
    #[arg(
        long = "tensor-parallel",
        visible_alias = "tp",
        value_name = "N",
        default_value_t = 1
    )]
    pub tensor_parallel: usize,
    /// How the KV cache stores keys and values: bf16 (unquantized; f32 on the CPU), int8
    /// (symmetric, a scale per token and KV head) or fp8 (E4M3, a scale per token and KV head).
    /// INT8 and FP8 take half the bytes of bf16, so the same --kv-cache-gb holds twice the
    /// tokens; on a GPU they also halve what decode attention reads.
    #[arg(long, default_value = "bf16", value_parser = parse_kv_dtype)]
    pub kv_dtype: KvDtype,
    /// On the CPU: f32 keeps decode products exact; q8 rounds their activations to 8 bits (per
    /// 32 values; per 256 for K-quants) for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K
    /// weights and multiplies on integers, as llama.cpp does (about twice the decode speed,
    /// slightly different logits: docs/perf/cpu.md).
    #[arg(long, default_value = "f32", value_parser = parse_cpu_activations)]
    pub cpu_activations: CpuActivations,
    /// On a GPU: native keeps GGUF-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
    /// Q6_K) as the file's blocks, decoded inside the products (the file's size in memory, and
    /// its exact values); bf16 decodes them to bf16 at load (about 4x the memory of a Q4 file).
    /// Other types are bf16 either way.
    #[arg(long, value_enum, default_value_t = WeightsDtype::Native)]
    pub weights_dtype: WeightsDtype,
}

/// How a GPU holds quantized weights (`--weights-dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightsDtype {
    Native,
    Bf16,
}

fn parse_cpu_activations(s: &str) -> Result<CpuActivations, String> {
    CpuActivations::parse(s).ok_or_else(|| format!("unknown CPU activations {s:?} (f32 or q8)"))
}

fn parse_kv_dtype(s: &str) -> Result<KvDtype, String> {
    KvDtype::parse(s).ok_or_else(|| format!("unknown KV dtype {s:?} (bf16, int8 or fp8)"))
}

#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// 0 is greedy decoding.
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0, allow_hyphen_values = true)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0, allow_hyphen_values = true)]
    pub repetition_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated (OpenAI's), in [-2, 2].
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Subtracted from the logit of every token generated so far (OpenAI's), in [-2, 2].
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
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
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            seed: self.seed,
        }
    }
}

impl ModelArgs {
    /// The library's form of these options, refusing values that can never work in the flags'
    /// own words.
    pub fn options(&self) -> Result<ModelOptions> {
        anyhow::ensure!(self.threads != Some(0), "--threads must be positive");
        anyhow::ensure!(self.block_size > 0, "--block-size must be positive");
        anyhow::ensure!(self.context != Some(0), "--context must be positive");
        anyhow::ensure!(
            self.kv_alloc_chunk != Some(0),
            "--kv-alloc-chunk must be positive"
        );
        anyhow::ensure!(
            self.tensor_parallel > 0,
            "--tensor-parallel must be positive"
        );
        Ok(ModelOptions {
            model: self.model.clone(),
            device: self.device,
            threads: self.threads,
            block_size: self.block_size,
            context: self.context,
            cuda_graphs: !self.no_cuda_graphs,
            peer_all_reduce: !self.no_peer_all_reduce,
            overlap_steps: !self.no_overlap,
            kv_alloc_chunk: self.kv_alloc_chunk,
            progress: true,
            tensor_parallel: self.tensor_parallel,
            kv_dtype: self.kv_dtype,
            cpu_activations: self.cpu_activations,
            native_weights: self.weights_dtype == WeightsDtype::Native,
        })
    }

    /// The engine's defaults with these options (and the warm-up unless `--no-warm-up`).
    pub fn engine_config(&self) -> Result<EngineConfig> {
        Ok(EngineConfig {
            warm_up: !self.no_warm_up,
            ..EngineConfig::new(self.options()?)
        })
    }

    /// The model's path, fetching the default model if none was given.
    pub fn resolve(&self) -> Result<PathBuf> {
        Ok(self.options()?.resolve()?)
    }

    /// Loads the model onto the chosen device and runs `task` with it.
    pub fn run_model<T: ModelTask<Output = Result<()>>>(&self, task: T) -> Result<()> {
        self.options()?.run(task)?
    }
}

/// The size of the persistent batch's KV cache: at most one of the three. Without any, a GPU
/// takes [`turbo_engine::DEFAULT_GPU_KV_FRACTION`] of its free memory (its cache is allocated up front unless
/// `--kv-alloc-chunk` is given), and the CPU a per-command default (its storage only grows as
/// blocks are used).
#[derive(Args, Clone, Debug, Default)]
pub struct KvArgs {
    /// KV cache size in blocks of --block-size tokens.
    #[arg(long, conflicts_with_all = ["kv_cache_gb", "kv_cache_fraction"])]
    pub kv_blocks: Option<usize>,
    /// KV cache size in GB (10^9 bytes).
    #[arg(long, conflicts_with = "kv_cache_fraction", allow_hyphen_values = true)]
    pub kv_cache_gb: Option<f64>,
    /// KV cache size as a fraction (0 < F <= 1) of the device's free memory once the weights
    /// are loaded (on the CPU: of MemAvailable). Default on a GPU: 0.9.
    #[arg(long, allow_hyphen_values = true)]
    pub kv_cache_fraction: Option<f64>,
}

impl KvArgs {
    /// Whether any size was given.
    pub fn is_set(&self) -> bool {
        self.kv_blocks.is_some() || self.kv_cache_gb.is_some() || self.kv_cache_fraction.is_some()
    }

    /// The library's form of the flags; without any, room on the CPU for `cpu_slots` sequences
    /// of `cpu_tokens_per_slot` tokens (at most the model's context each).
    pub fn size(&self, cpu_slots: usize, cpu_tokens_per_slot: usize) -> Result<KvSize> {
        anyhow::ensure!(self.kv_blocks != Some(0), "--kv-blocks must be positive");
        if let Some(gb) = self.kv_cache_gb {
            anyhow::ensure!(
                gb.is_finite() && gb > 0.0,
                "--kv-cache-gb must be a positive number of GB, got {gb:?}"
            );
        }
        if let Some(f) = self.kv_cache_fraction {
            anyhow::ensure!(
                f > 0.0 && f <= 1.0,
                "--kv-cache-fraction must be in (0, 1], got {f:?}"
            );
        }
        Ok(
            match (self.kv_blocks, self.kv_cache_gb, self.kv_cache_fraction) {
                (Some(n), _, _) => KvSize::Blocks(n),
                (_, Some(gb), _) => KvSize::Bytes(gb * 1e9),
                (_, _, Some(f)) => KvSize::Fraction(f),
                (None, None, None) => KvSize::Default {
                    cpu_slots,
                    cpu_tokens_per_slot,
                },
            },
        )
    }

    /// KV blocks for `model`, from the flags or the default (see [`KvArgs::size`]).
    pub fn num_blocks<B: Backend>(
        &self,
        model: &Llama<B>,
        info: &LoadedModelInfo,
        cpu_slots: usize,
        cpu_tokens_per_slot: usize,
    ) -> Result<usize> {
        let size = self.size(cpu_slots, cpu_tokens_per_slot)?;
        Ok(size.num_blocks(model, info)?)
    }
}

/// A flag's seconds as a duration: a clear error for a negative, non-finite or absurdly large
/// value instead of a panic.
pub fn seconds(flag: &str, value: f64) -> anyhow::Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(value)
        .map_err(|_| anyhow::anyhow!("{flag} must be a number of seconds >= 0, not {value}"))
}
