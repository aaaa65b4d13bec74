//! The engine as a library: what the `turbo` command line and `turbo serve` share.
//!
//! - [`load`]: a model file onto a device ([`ModelOptions`], [`Device`]), with the model's
//!   tokenizer and chat template, for work that drives a backend itself ([`ModelTask`]);
//! - [`KvSize`]: how many KV blocks the persistent batch gets on that device;
//! - [`Engine`]: the handle. It owns a [`PersistentBatch`](turbo_scheduler::PersistentBatch) on
//!   a thread of its own that steps while work is queued and sleeps when idle (TurboMind's
//!   persistent batch, which lives as long as the process). [`Engine::submit`] returns a
//!   [`RequestStream`] of events; dropping it, or [`Engine::cancel`], ends the request and frees
//!   its KV within one step. The queue is bounded: past [`EngineConfig::max_pending`] requests,
//!   submission is refused rather than left to grow.

mod device;
mod error;
mod handle;
mod kv_size;
pub mod limits;
pub mod load;
pub mod requests_file;

pub use device::Device;
pub use error::{EngineError, SubmitError};
pub use handle::{Engine, EngineConfig, EngineInfo, EngineStats, RequestStream};
pub use kv_size::{KvSize, DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_KV_FRACTION};
pub use load::{LoadedModelInfo, ModelOptions, ModelTask};
pub use turbo_core::KvDtype;
pub use turbo_scheduler::{
    BatchStats, Completion, Event, FinishReason, Request, RequestError, SamplingParams, Timings,
    TokenLogprobs, MAX_TOP_LOGPROBS,
};
pub use turbo_tokenizer::ChatMessage;
