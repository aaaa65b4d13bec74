//! The LLaMA model family: configuration, weights from GGUF, HF safetensors or Turbo's native
//! directories (with the tokenizer and chat template they carry), and the forward pass over any
//! backend.

pub mod config;
mod error;
pub mod model;
pub mod native;
mod peers;
pub mod shard;
pub mod weights;

pub use config::{LlamaConfig, RopeScaling};
pub use error::{LlamaError, Result};
pub use model::{ForwardTimes, Llama, Logits, SequenceChunk};
pub use shard::ShardPlan;
pub use weights::{HostWeights, LoadedModel, ModelFormat};
