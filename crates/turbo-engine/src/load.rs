//! A model file onto a device: which file (the default model when none is named), which backend,
//! and the few settings a backend takes at start.

use crate::{Device, EngineError};
use std::path::PathBuf;
use turbo_core::comm::CpuGroup;
use turbo_core::cpu::{CpuActivations, CpuBackend};
use turbo_core::{Backend, KvDtype};
use turbo_kernels::CudaBackend;
use turbo_llama::{Llama, LoadedModel};
use turbo_models::DEFAULT_MODEL;
use turbo_tokenizer::{ChatTemplate, TextTokenizer};

/// Which model to run, and where.
#[derive(Clone, Debug)]
pub struct ModelOptions {
    /// A GGUF file, an HF directory or a native directory; `None` is the default model
    /// (SmolLM2-135M-Instruct), fetched on first use.
    pub model: Option<PathBuf>,
    pub device: Device,
    /// CPU threads; `None` uses every core.
    pub threads: Option<usize>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Longest sequence to allow instead of the context the model declares.
    pub context: Option<usize>,
    /// On a GPU, record decode steps as CUDA graphs and replay them.
    pub cuda_graphs: bool,
    /// On a split model whose GPUs map each other's memory, all-reduce decode-sized messages
    /// through that memory (one kernel; steps recordable as CUDA graphs) rather than NCCL.
    pub peer_all_reduce: bool,
    /// On a GPU, map the KV cache's memory this many blocks at a time as steps reach them,
    /// instead of allocating it whole at start.
    pub kv_alloc_chunk: Option<usize>,
    /// Print the default model's download progress on stderr.
    pub progress: bool,
    /// Ranks to split the model over (tensor parallelism): GPUs `cuda:N` .. `cuda:N+ranks-1`
    /// on a GPU, threads of this process on the CPU. 1 runs it whole.
    pub tensor_parallel: usize,
    /// How the KV cache stores keys and values (INT8 or FP8 halve its bytes against bf16).
    pub kv_dtype: KvDtype,
    /// On the CPU, whether decode products round activations to 8 bits (llama.cpp's recipe,
    /// faster) or keep them exact (the default).
    pub cpu_activations: CpuActivations,
    /// On a GPU, issue each step before the previous step's tokens are back, so that the
    /// host's scheduling and output processing run while the device works (steps that need
    /// each token first still run one at a time).
    pub overlap_steps: bool,
    /// On a GPU, keep GGUF-quantized weights as the file's blocks (Q4_0, Q4_1, Q5_0, Q5_1,
    /// Q8_0, Q4_K, Q5_K, Q6_K) and decode them inside the products; off, they are decoded to
    /// bf16 at load (about 4x the memory of a Q4 file).
    pub native_weights: bool,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            model: None,
            device: Device::Auto,
            threads: None,
            block_size: 16,
            context: None,
            cuda_graphs: true,
            peer_all_reduce: true,
            overlap_steps: true,
            kv_alloc_chunk: None,
            progress: true,
            tensor_parallel: 1,
            kv_dtype: KvDtype::Full,
            cpu_activations: CpuActivations::F32,
            native_weights: true,
        }
    }
}

/// What work on a loaded model still needs to know once the weights moved onto the device.
#[derive(Clone, Debug)]
pub struct LoadedModelInfo {
    pub path: PathBuf,
    pub context_length: usize,
    pub vocab_size: usize,
    /// The chat template's Jinja source, when the model ships one.
    pub chat_template: Option<String>,
    pub block_size: usize,
    /// Where the model runs: `Cpu` or `Cuda(n)`, never `Auto`.
    pub device: Device,
}

impl LoadedModelInfo {
    /// The model's chat template (ChatML when it ships none).
    pub fn template(&self, tokenizer: &TextTokenizer) -> Result<ChatTemplate, EngineError> {
        Ok(ChatTemplate::for_model(
            self.chat_template.as_deref(),
            tokenizer,
        )?)
    }
}

/// Work that drives a model on whichever backend it was loaded on (a persistent batch of its own
/// sizes, a benchmark). [`ModelOptions::run`] picks the backend and calls `run` once.
pub trait ModelTask {
    type Output;
    fn run<B: Backend>(
        self,
        model: Llama<B>,
        tokenizer: TextTokenizer,
        info: LoadedModelInfo,
    ) -> Self::Output;
}

impl ModelOptions {
    /// Refuses settings that can never work or that are past what this machine and the code can
    /// hold ([`crate::limits`]), before anything is loaded.
    pub fn validate(&self) -> Result<(), EngineError> {
        use crate::limits::{
            check_positive, max_threads, MAX_BLOCK_SIZE, MAX_CONTEXT, MAX_TENSOR_PARALLEL,
        };
        if let Some(threads) = self.threads {
            let cores = max_threads();
            if threads > cores {
                return Err(EngineError::Config(format!(
                    "{threads} threads is more than the {cores} CPUs of this machine"
                )));
            }
            check_positive("the thread count", threads, cores)?;
        }
        check_positive("the block size", self.block_size, MAX_BLOCK_SIZE)?;
        if let Some(context) = self.context {
            check_positive("the context", context, MAX_CONTEXT)?;
        }
        if let Some(chunk) = self.kv_alloc_chunk {
            check_positive("the KV allocation chunk", chunk, u32::MAX as usize)?;
        }
        check_positive(
            "the tensor-parallel size",
            self.tensor_parallel,
            MAX_TENSOR_PARALLEL,
        )?;
        Ok(())
    }

    /// The model's path, fetching the default model if none was given.
    pub fn resolve(&self) -> Result<PathBuf, EngineError> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => Ok(DEFAULT_MODEL.ensure(self.progress)?),
        }
    }

    /// Reads the model's files (weights stay memory-mapped where the format allows).
    pub fn load(&self) -> Result<LoadedModel, EngineError> {
        self.validate()?;
        let path = self.resolve()?;
        let mut loaded = LoadedModel::load(&path).map_err(|error| EngineError::Load {
            path: path.display().to_string(),
            error,
        })?;
        if let Some(context) = self.context {
            if context > loaded.config.context_length {
                tracing::warn!(
                    "a context of {context} is past the {} tokens the model declares",
                    loaded.config.context_length
                );
            }
            loaded.config.context_length = context;
        } else if loaded.config.context_length > crate::limits::MAX_CONTEXT {
            tracing::warn!(
                "the model declares a context of {} tokens; sequences are limited to {}",
                loaded.config.context_length,
                crate::limits::MAX_CONTEXT
            );
            loaded.config.context_length = crate::limits::MAX_CONTEXT;
        }
        Ok(loaded)
    }

    /// Loads the model onto the chosen device and runs `task` with it.
    pub fn run<T: ModelTask>(&self, task: T) -> Result<T::Output, EngineError> {
        let loaded = self.load()?;
        let device = self.device.resolve();
        let info = LoadedModelInfo {
            path: loaded.path.clone(),
            context_length: loaded.config.context_length,
            vocab_size: loaded.config.vocab_size,
            chat_template: loaded.chat_template.clone(),
            block_size: self.block_size,
            device,
        };
        let world = self.tensor_parallel;
        match device {
            Device::Cuda(ordinal) => {
                let backends = match world {
                    1 => vec![CudaBackend::new(ordinal)?],
                    _ => CudaBackend::group(ordinal, world)?,
                };
                for b in &backends {
                    b.set_graphs(self.cuda_graphs);
                    b.set_peer_all_reduce(self.peer_all_reduce);
                    b.set_kv_chunk_blocks(self.kv_alloc_chunk);
                    b.set_native_weights(self.native_weights);
                }
                let mut model = Llama::new_parallel(backends, &loaded.config, &loaded.weights)?;
                model.set_kv_dtype(self.kv_dtype);
                Ok(task.run(model, loaded.tokenizer, info))
            }
            _ => {
                let model = match world {
                    1 => {
                        let mut backend = match self.threads {
                            Some(n) => CpuBackend::with_threads(n)?,
                            None => CpuBackend::new(),
                        };
                        backend.set_activations(self.cpu_activations);
                        Llama::new(backend, &loaded.config, &loaded.weights)?
                    }
                    _ => {
                        // The ranks share the machine's cores.
                        let threads = self.threads.unwrap_or_else(crate::limits::max_threads);
                        let per_rank = (threads / world).max(1);
                        let backends = CpuGroup::members(world)
                            .into_iter()
                            .map(|member| {
                                let mut b = CpuBackend::with_group(per_rank, member)?;
                                b.set_activations(self.cpu_activations);
                                Ok(b)
                            })
                            .collect::<Result<Vec<_>, turbo_core::BackendError>>()?;
                        Llama::new_parallel(backends, &loaded.config, &loaded.weights)?
                    }
                };
                let mut model = model;
                model.set_kv_dtype(self.kv_dtype);
                Ok(task.run(model, loaded.tokenizer, info))
            }
        }
    }
}
