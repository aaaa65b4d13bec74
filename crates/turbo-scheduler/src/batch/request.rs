//! What a client hands the persistent batch and what it gets back: a [`Request`], and a
//! [`RequestHandle`] on which its [`Event`]s arrive.

use crate::batch::eviction::KvEviction;
use crate::completion::Completion;
use crate::sampling::SamplingParams;
use serde::Serialize;
use std::fmt;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::time::Duration;
use thiserror::Error;

/// Names a request for its whole life in the batch (waiting, running, preempted).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request {}", self.0)
    }
}

/// A generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// The sequence's full token list: for a session, the whole conversation so far, of which
    /// the part still in the session's KV cache is not run again.
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Most tokens to generate; capped by the model's context.
    pub max_tokens: usize,
    /// Strings that end generation; they never reach the streamed text.
    pub stop_strings: Vec<String>,
    /// Keep going past end-of-sequence tokens (for benchmarks).
    pub ignore_eos: bool,
    /// A conversation whose KV stays resident between its requests (until evicted, least
    /// recently used first), so that the next turn prefills only its new tokens. Requests of one
    /// session run one at a time, in submission order.
    pub session: Option<String>,
    /// Report each generated token's log-probability and this many most likely alternatives
    /// (at most [`MAX_TOP_LOGPROBS`]) in an [`Event::Logprobs`] before its [`Event::Token`].
    pub logprobs: Option<usize>,
    /// Longest a request may wait for its first admission; past it, it ends with
    /// [`RequestError::QueueTimeout`] so that an overloaded server answers instead of
    /// letting clients hang. `None`: it waits as long as it takes.
    pub max_queue_wait: Option<Duration>,
    /// KV eviction (`None`: every key is kept).
    pub kv_eviction: Option<KvEviction>,
    /// Tokens emitted in place of sampled ones, in order (teacher forcing, to evaluate a
    /// model or an eviction policy on a known text); the request's log-probabilities then
    /// report each forced token's. Sampling resumes after them.
    pub forced_tokens: Vec<u32>,
}

/// Most alternatives a request may ask log-probabilities of (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Longest session name, in bytes: names are kept while their sessions are remembered.
pub const MAX_SESSION_NAME_BYTES: usize = 256;

impl Request {
    /// A greedy request for up to 256 tokens after `prompt`.
    pub fn new(prompt: Vec<u32>) -> Self {
        Request {
            prompt,
            sampling: SamplingParams::default(),
            max_tokens: 256,
            stop_strings: Vec::new(),
            ignore_eos: false,
            session: None,
            logprobs: None,
            max_queue_wait: None,
            kv_eviction: None,
            forced_tokens: Vec::new(),
        }
    }
}

/// What a request may ask of a batch: its model's context and vocabulary, its KV cache's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestLimits {
    pub context: usize,
    pub vocab: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

impl Request {
    /// Checks the request against `limits` as the batch does at submission, so that a caller
    /// (a server) can refuse it before it is queued; returns `max_tokens` capped by the context.
    pub fn validate(&self, limits: &RequestLimits) -> Result<usize, RequestError> {
        let RequestLimits {
            context,
            vocab,
            block_size,
            num_blocks,
        } = *limits;
        self.sampling.validate().map_err(RequestError::Sampling)?;
        if let Some(name) = self
            .session
            .as_ref()
            .filter(|s| s.len() > MAX_SESSION_NAME_BYTES)
        {
            return Err(RequestError::SessionName(name.len()));
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(RequestError::TooManyLogprobs(n));
        }
        let prompt = &self.prompt;
        if prompt.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        if prompt.len() >= context {
            return Err(RequestError::PromptTooLong {
                prompt: prompt.len(),
                context,
            });
        }
        if let Some(&id) = prompt
            .iter()
            .chain(&self.forced_tokens)
            .find(|&&t| t as usize >= vocab)
        {
            return Err(RequestError::BadToken { id, vocab });
        }
        let max_tokens = self.max_tokens.min(context - prompt.len());
        // The last generated token's KV is never computed.
        let tokens = prompt.len() + max_tokens.saturating_sub(1);
        let needed = tokens.div_ceil(block_size);
        if needed > num_blocks {
            return Err(RequestError::TooLargeForCache {
                tokens,
                needed,
                total: num_blocks,
            });
        }
        Ok(max_tokens)
    }
}

/// Why a request could not run. It gets no other event after this one.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum RequestError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens, but the model's context holds {context}")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    #[error("invalid sampling parameters: {0}")]
    Sampling(String),
    #[error("at most {MAX_TOP_LOGPROBS} top log-probabilities per token, asked for {0}")]
    TooManyLogprobs(usize),
    #[error("a session name is at most {MAX_SESSION_NAME_BYTES} bytes, this one has {0}")]
    SessionName(usize),
    #[error(
        "the request needs {needed} KV blocks ({tokens} tokens), but the whole cache has {total}: \
         it cannot run even alone"
    )]
    TooLargeForCache {
        tokens: usize,
        needed: usize,
        total: usize,
    },
    #[error("the forward pass failed: {0}")]
    Model(String),
    #[error("cannot decode the generated text: {0}")]
    Detokenize(String),
    /// Every logit of a step was NaN or -inf: the model's weights or arithmetic are broken, and
    /// no token can be sampled.
    #[error(
        "the model gave no finite logit for generated token {index} (every one NaN or -inf): its \
         weights or its arithmetic are broken"
    )]
    NoFiniteLogits { index: usize },
    #[error("the batch was dropped before the request ended")]
    Disconnected,
    #[error("KV eviction: {0}")]
    Eviction(String),
    #[error(
        "the server is overloaded: the request waited {waited_ms} ms for a slot; try again later"
    )]
    QueueTimeout { waited_ms: u64 },
}

/// What a request streams, in order: per generated token (when asked for) its
/// [`Event::Logprobs`], then an [`Event::Token`] and, when the token completes text that cannot
/// be part of a stop string, a [`Event::Text`] delta; then exactly one terminal event,
/// [`Event::Finished`] or [`Event::Failed`]. Concatenating the deltas gives
/// [`Completion::text`]. A preempted request resumes where it was: nothing is streamed twice.
#[derive(Clone, Debug)]
pub enum Event {
    Logprobs(TokenLogprobs),
    Token(u32),
    Text(String),
    Finished(Completion),
    Failed(RequestError),
}

/// A generated token's natural-log probability and the most likely alternatives at its step,
/// from the log-softmax of the logits it was chosen from after the penalties (before temperature
/// and truncation: the model's distribution, as the penalties shaped it).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// Most likely first (lower id first on ties); may include `token` itself.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// From one row of logits (NaN counts as -inf); `top` alternatives.
    pub fn from_logits(logits: &[f32], token: u32, top: usize) -> Self {
        let value = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l };
        let max = logits
            .iter()
            .map(|&l| value(l))
            .fold(f32::NEG_INFINITY, f32::max);
        let lse = if max.is_finite() {
            let sum: f64 = logits
                .iter()
                .map(|&l| ((value(l) - max) as f64).exp())
                .sum();
            max as f64 + sum.ln()
        } else {
            max as f64
        };
        let logprob = |l: f32| (value(l) as f64 - lse) as f32;
        let mut ranked: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, value(l)))
            .collect();
        let by_rank = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let top = top.min(ranked.len());
        if top > 0 && top < ranked.len() {
            ranked.select_nth_unstable_by(top - 1, by_rank);
        }
        ranked.truncate(top);
        // The vocabulary-sized buffer is not kept: a request holds its tokens' logprobs until
        // it ends (thousands of them), and each would otherwise keep the whole row's capacity.
        ranked.shrink_to_fit();
        ranked.sort_unstable_by(by_rank);
        TokenLogprobs {
            token,
            logprob: logits
                .get(token as usize)
                .map_or(f32::NEG_INFINITY, |&l| logprob(l)),
            top: ranked.into_iter().map(|(t, l)| (t, logprob(l))).collect(),
        }
    }
}

impl Event {
    /// Whether this is the request's last event.
    pub fn is_terminal(&self) -> bool {
        matches!(self, Event::Finished(_) | Event::Failed(_))
    }
}

/// Where a request's events go, called on the thread that steps the batch (TurboMind's streaming
/// callback). A server hands each request a sink that forwards to its connection; a closed
/// connection makes the sink report itself gone, and the batch cancels the request.
pub trait EventSink: Send {
    /// Delivers an event in order; false once nobody receives them.
    fn send(&mut self, event: Event) -> bool;

    /// Whether the client still listens. Polled every step, so that a request whose client left
    /// is cancelled even before it has anything to stream (waiting, or prefilling).
    fn is_connected(&self) -> bool {
        true
    }
}

impl EventSink for Sender<Event> {
    fn send(&mut self, event: Event) -> bool {
        Sender::send(self, event).is_ok()
    }
}

/// The client's end of a request: its id and its stream of events.
#[derive(Debug)]
pub struct RequestHandle {
    pub(crate) id: RequestId,
    pub(crate) events: Receiver<Event>,
}

impl RequestHandle {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The event channel, for `recv`, `try_iter` or `recv_timeout`. Dropping the handle cancels
    /// the request at the batch's next step.
    pub fn events(&self) -> &Receiver<Event> {
        &self.events
    }

    /// The events delivered so far, without waiting.
    pub fn drain(&self) -> Vec<Event> {
        self.events.try_iter().collect()
    }

    /// Whether the request has ended, consuming pending events into `sink`.
    pub fn poll(&self, sink: &mut Vec<Event>) -> bool {
        loop {
            match self.events.try_recv() {
                Ok(e) => {
                    let done = e.is_terminal();
                    sink.push(e);
                    if done {
                        return true;
                    }
                }
                Err(TryRecvError::Empty) => return false,
                Err(TryRecvError::Disconnected) => return true,
            }
        }
    }

    /// Blocks until the request ends and returns its outcome, skipping the streamed events.
    /// The batch must be stepped by another thread, or have run already (e.g.
    /// [`super::PersistentBatch::run_until_idle`]).
    pub fn wait(self) -> Result<Completion, RequestError> {
        for event in self.events.iter() {
            match event {
                Event::Finished(c) => return Ok(c),
                Event::Failed(e) => return Err(e),
                Event::Logprobs(_) | Event::Token(_) | Event::Text(_) => {}
            }
        }
        Err(RequestError::Disconnected)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token's logprobs keep its top alternatives only, not a vocabulary-sized buffer: a
    /// request holds one per generated token until it ends.
    #[test]
    fn token_logprobs_hold_only_their_top_entries() {
        let logits: Vec<f32> = (0..49_152).map(|i| (i % 97) as f32 * 0.1).collect();
        let lp = TokenLogprobs::from_logits(&logits, 5, 3);
        assert_eq!(lp.top.len(), 3);
        assert!(lp.top.capacity() < 64, "capacity {}", lp.top.capacity());
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert!(lp.logprob <= 0.0 && lp.top[0].1 <= 0.0);
    }
}
