//! What a finished request reports, whichever way it ran.

use serde::Serialize;

/// Why generation ended, in the words OpenAI-compatible clients expect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens`, or the end of the model's context.
    Length,
    /// The caller asked to stop.
    Cancelled,
}

/// Where a request's time went, in milliseconds from its submission.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Timings {
    /// Waiting for a batch slot and KV blocks: submission to first admission.
    pub queue_ms: f64,
    /// Time to first token: submission (queueing included) to the first generated token.
    pub prefill_ms: f64,
    /// First generated token to the end.
    pub decode_ms: f64,
}

/// The outcome of a request that ran (or was cancelled).
#[derive(Clone, Debug, Serialize)]
pub struct Completion {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// Prompt tokens whose KV was already cached when the request was first admitted (its
    /// session's history, or blocks shared with other sequences).
    pub cached_prompt_tokens: usize,
    /// Prompt tokens that were run through the model at first admission.
    pub prefilled_tokens: usize,
    /// Times the request was preempted (its KV dropped and later recomputed).
    pub preemptions: usize,
    /// Keys the sequence held in the KV cache at the end (fewer than its tokens under KV
    /// eviction).
    pub kv_tokens: usize,
    /// KV blocks the sequence held at the end, and the most it held at once.
    pub kv_blocks: usize,
    pub kv_blocks_peak: usize,
    pub timings: Timings,
}
