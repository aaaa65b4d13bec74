//! Running requests through a model: sampling, stop conditions, text streaming, and sessions whose
//! KV outlives a request so that the next turn of a conversation prefills only its new tokens.

pub mod batch;
pub mod completion;
pub mod sampling;
pub mod stop;

pub use batch::{
    BatchConfig, BatchError, BatchStats, Event, EventSink, KvEviction, PersistentBatch, Request,
    RequestError, RequestHandle, RequestId, RequestLimits, StepPhases, StepReport, StepTiming,
    TokenLogprobs, WarmUpReport, MAX_PROFILED_STEPS, MAX_SESSIONS, MAX_SESSION_NAME_BYTES,
    MAX_TOP_LOGPROBS,
};
pub use completion::{Completion, FinishReason, Timings};
pub use sampling::{Sampler, SamplingParams};
