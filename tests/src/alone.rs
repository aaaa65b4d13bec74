//! A request run alone: one request on a fresh persistent batch of one slot, the reference that
//! batched, cached or GPU runs are compared with.
//!
//! A fresh batch has an empty KV cache, so nothing of an earlier run can be reused
//! (`cached_prompt_tokens == 0`), and with one slot and [`PREFILL_CHUNK`] tokens per step a
//! prompt of up to that many tokens is prefilled in one forward pass and every generated token is
//! decoded in a pass of its own: the same forward passes the retired single-sequence engine ran.

use turbo_core::Backend;
use turbo_llama::{Llama, LlamaConfig};
use turbo_scheduler::{BatchConfig, Completion, PersistentBatch, Request, RequestError};
use turbo_tokenizer::tokenizer::TextTokenizer;

/// Most prompt tokens of a sequence per forward pass (and per step) in [`single_sequence`]
/// batches: the chunk the single-sequence engine prefilled in.
pub const PREFILL_CHUNK: usize = 512;

/// A batch that runs one sequence at a time with room for a full-context sequence: one slot,
/// `context_length / block_size` blocks (rounded up), prompts prefilled in chunks of
/// [`PREFILL_CHUNK`] tokens, prefix caching on (so that a session keeps its KV between turns).
pub fn single_sequence(model: &LlamaConfig, block_size: usize) -> BatchConfig {
    BatchConfig {
        max_batch: 1,
        max_batched_tokens: PREFILL_CHUNK,
        block_size,
        num_blocks: model.context_length.div_ceil(block_size),
        prefill_chunk: PREFILL_CHUNK,
        prefix_caching: true,
    }
}

/// Submits `request`, steps `batch` until it is idle and returns the request's outcome.
pub fn run_to_end<B: Backend>(
    batch: &mut PersistentBatch<B>,
    request: Request,
) -> Result<Completion, RequestError> {
    let handle = batch.submit(request);
    batch.run_until_idle().expect("the batch steps");
    handle.wait()
}

/// Runs each request alone on a fresh [`single_sequence`] batch, keeping the model (and its
/// tokenizer) between runs.
pub struct Alone<B: Backend> {
    parts: Option<(Llama<B>, TextTokenizer)>,
    config: BatchConfig,
}

impl<B: Backend> Alone<B> {
    /// Runs on `model` with KV blocks of `block_size` tokens.
    pub fn new(model: Llama<B>, tokenizer: TextTokenizer, block_size: usize) -> Self {
        let config = single_sequence(&model.config, block_size);
        Alone {
            parts: Some((model, tokenizer)),
            config,
        }
    }

    pub fn model(&self) -> &Llama<B> {
        &self
            .parts
            .as_ref()
            .expect("the model is back after each run")
            .0
    }

    pub fn config(&self) -> &BatchConfig {
        &self.config
    }

    /// `request` on a fresh batch: its completion, or why it failed.
    pub fn try_run(&mut self, request: Request) -> Result<Completion, RequestError> {
        let (model, tokenizer) = self.parts.take().expect("the model is back after each run");
        let mut batch =
            PersistentBatch::new(model, tokenizer, self.config.clone()).expect("a batch of one");
        let outcome = run_to_end(&mut batch, request);
        self.parts = Some(batch.into_parts());
        outcome
    }

    /// `request` on a fresh batch; panics if it fails.
    pub fn run(&mut self, request: Request) -> Completion {
        self.try_run(request)
            .unwrap_or_else(|e| panic!("a request run alone failed: {e}"))
    }
}

/// The opposite of alone: `requests` submitted together to a fresh batch of `config` over
/// `model` (continuous batching, chunked prefill beside decode steps), run until idle. Their
/// completions in submission order (panicking on a failed one), and the model back.
pub fn run_together<B: Backend>(
    model: Llama<B>,
    tokenizer: &TextTokenizer,
    config: BatchConfig,
    requests: Vec<Request>,
) -> (Vec<Completion>, Llama<B>) {
    let mut batch = PersistentBatch::new(model, tokenizer.clone(), config).expect("a batch");
    let handles: Vec<_> = requests.into_iter().map(|r| batch.submit(r)).collect();
    batch.run_until_idle().expect("the batch steps");
    let completions = handles
        .into_iter()
        .map(|h| h.wait().unwrap_or_else(|e| panic!("a request failed: {e}")))
        .collect();
    (completions, batch.into_parts().0)
}
