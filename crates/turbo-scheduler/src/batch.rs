//! The persistent batch (TurboMind's name for continuous batching): a batch whose lifetime is the
//! server's. Requests take one of `max_batch` slots when one is free and give it back the moment
//! they finish; every step runs one forward pass over whatever the slots need: one token per
//! decoding sequence and chunks of prompts being prefilled, within a token budget.
//!
//! A step is `schedule -> run -> postprocess` ([`PersistentBatch::step`]):
//! - **schedule** decides, on plain data, which tokens of which sequences run and reserves their
//!   KV blocks in the [`KvManager`]; when blocks run out it preempts the most recently admitted
//!   request (its KV is dropped, it goes back to the front of the queue and is recomputed from
//!   its tokens later), then admits waiting requests into free slots;
//! - **run** is one [`Llama::forward`] over the scheduled chunks;
//! - **postprocess** commits the KV, samples a token for every sequence whose tokens are all
//!   computed, streams its text and ends finished requests.
//!
//! Sessions: a request naming a session runs on that session's sequence, which stays resident
//! after the request (idle, evicted least recently used first) so that its next turn prefills
//! only its new tokens; after an eviction the next turn recomputes what is no longer resident.
//! A request without a session gets a sequence of its own, freed when it ends. With
//! [`BatchConfig::prefix_caching`] off, no KV is reused at all (every prompt is prefilled whole).
//!
//! Progress: a request is refused at submission if it could not fit in the KV cache alone, and a
//! request is only ever preempted in favour of one admitted before it, so the oldest running
//! request always advances and the batch never deadlocks.

mod eviction;
mod overlap;
mod profile;
mod request;

use eviction::EvictionState;
pub use eviction::KvEviction;
use profile::{StepClock, StepProfile};
pub use profile::{StepPhases, StepTiming, MAX_PROFILED_STEPS};

pub use crate::completion::{Completion, Timings};
pub use request::{
    Event, EventSink, Request, RequestError, RequestHandle, RequestId, RequestLimits,
    TokenLogprobs, MAX_SESSION_NAME_BYTES, MAX_TOP_LOGPROBS,
};

use crate::completion::FinishReason;
use crate::sampling::Sampler;
use crate::stop::StopStrings;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::mpsc::channel;
use std::time::Instant;
use thiserror::Error;
use turbo_core::backend::CARRIED_TOKEN;
use turbo_core::sampling::NO_FINITE_LOGIT;
use turbo_core::sampling::{PenaltyLists, PenaltyRow, SampleParams};
use turbo_core::Backend;
use turbo_kv::{KvError, KvManager, SeqId, SeqState};
use turbo_llama::{Llama, LlamaError, SequenceChunk};
use turbo_tokenizer::tokenizer::{TextStream, TextTokenizer, TokenizerError};

/// Sizes of a persistent batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchConfig {
    /// Slots: requests that run at once.
    pub max_batch: usize,
    /// Tokens per forward pass (decode tokens plus prefill chunks); at least `max_batch`, so
    /// that every decoding sequence advances every step.
    pub max_batched_tokens: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the cache.
    pub num_blocks: usize,
    /// Most prompt tokens of one sequence per step, so long prompts do not stall decoding.
    pub prefill_chunk: usize,
    /// Reuse computed KV: full blocks with equal content are shared between sequences (a common
    /// system prompt is computed once) and a session's history stays resident for its next turn.
    /// Off, every request prefills its whole prompt and keeps nothing afterwards: the baseline
    /// that measures what the cache saves.
    pub prefix_caching: bool,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            max_batch: 8,
            max_batched_tokens: 512,
            block_size: 16,
            num_blocks: 1024,
            prefill_chunk: 256,
            prefix_caching: true,
        }
    }
}

impl BatchConfig {
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("max_batch", self.max_batch),
            ("max_batched_tokens", self.max_batched_tokens),
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("prefill_chunk", self.prefill_chunk),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} must be positive"));
        }
        if self.max_batched_tokens < self.max_batch {
            return Err(format!(
                "max_batched_tokens ({}) must be at least max_batch ({}) so that every running \
                 sequence can decode each step",
                self.max_batched_tokens, self.max_batch
            ));
        }
        if u32::try_from(self.num_blocks).is_err() {
            return Err(format!("num_blocks ({}) exceeds u32", self.num_blocks));
        }
        Ok(())
    }
}

#[derive(Debug, Error)]
pub enum BatchError {
    #[error("invalid batch configuration: {0}")]
    Config(String),
    /// KV bookkeeping refused an operation the scheduler believed valid: a bug.
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error(transparent)]
    Model(#[from] LlamaError),
}

/// A snapshot of the batch, for monitoring and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Requests holding a slot.
    pub running: usize,
    /// Requests queued (new or preempted).
    pub waiting: usize,
    pub kv_blocks_total: usize,
    /// Blocks held by sequences (running, or idle sessions).
    pub kv_blocks_used: usize,
    /// Blocks holding nothing.
    pub kv_blocks_free: usize,
    /// Blocks nobody holds that keep reusable KV until reallocated.
    pub kv_blocks_evictable: usize,
    /// Finished sessions whose KV is resident.
    pub idle_sessions: usize,
    /// Steps that ran a forward pass.
    pub steps: u64,
    /// Tokens run through the model (prefill, recomputation and decode).
    pub tokens_run: u64,
    /// Of `tokens_run`, those of prompts and of preempted sequences being recomputed: the
    /// prefill work that cached KV did not save.
    pub prefill_tokens_run: u64,
    /// Most KV blocks held by sequences at once, measured after each step's scheduling (when
    /// the step's blocks are reserved and before finished requests give theirs back).
    pub kv_blocks_peak: usize,
    /// Preemptions since the batch was made.
    pub preemptions: u64,
    /// Steps that ran only decode rows (no prompt chunk, no recomputation), their tokens and
    /// their wall time in microseconds (scheduling, forward pass, sampling and KV compaction):
    /// decode throughput apart from prefill.
    pub decode_steps: u64,
    pub decode_step_tokens: u64,
    pub decode_step_micros: u64,
    /// KV compactions (eviction) and their host wall time in microseconds: choosing the kept
    /// keys (with the scores read back), and issuing the move and the release of blocks.
    pub compactions: u64,
    pub compaction_micros: u64,
    /// Where the steps' time went (host phases, the wait for results, device time when
    /// measured), summed over every step.
    pub phases: StepPhases,
    /// Steps issued before the previous step's tokens were read back (overlapped stepping).
    pub overlapped_steps: u64,
}

/// What one [`PersistentBatch::step`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Sequences in the forward pass.
    pub sequences: usize,
    /// Tokens in the forward pass.
    pub tokens: usize,
    /// Sequences that ran one token after generating at least one (decode).
    pub decode_sequences: usize,
    /// Tokens of prompts, or of preempted sequences being recomputed (prefill).
    pub prefill_tokens: usize,
    /// Requests that took a slot.
    pub admitted: usize,
    /// Requests preempted to free KV blocks.
    pub preempted: usize,
    /// Requests that ended (finished, cancelled or failed).
    pub ended: usize,
}

/// One sequence's part of a step: run `len` tokens from position `start`. `carried`: the one
/// token is the one the step still in flight samples for its output row of that number (see
/// [`overlap`]).
#[derive(Clone, Copy, Debug)]
struct Work {
    slot: usize,
    start: usize,
    len: usize,
    carried: Option<u32>,
}

/// What a step's forward pass chose: a token per scheduled chunk, and the logits (`[chunks,
/// vocab]`) when a request asked for log-probabilities.
struct Sampled {
    tokens: Vec<u32>,
    logits: Option<Vec<f32>>,
}

/// A step's forward-pass inputs, in work order.
struct StepInputs {
    chunks: Vec<SequenceChunk>,
    params: Vec<SampleParams>,
    penalties: PenaltyLists,
    /// Whether a row's request reports log-probabilities (the logits must come back).
    logprobs: bool,
}

/// A request from submission to its end: its sequence, its sampling and streaming state.
struct Live {
    id: RequestId,
    seq: SeqId,
    /// The session the request continues, if any.
    session: Option<String>,
    /// Needed until the first admission; afterwards the KV manager holds the tokens.
    prompt: Vec<u32>,
    /// `max_tokens`, capped by the context.
    max_tokens: usize,
    ignore_eos: bool,
    /// Top alternatives to report with each token's log-probability; `None`: none reported.
    logprobs: Option<usize>,
    sampler: Sampler,
    stream: TextStream,
    stops: StopStrings,
    generated: Vec<u32>,
    text: String,
    events: Box<dyn EventSink>,
    /// False once the client went away: the request is cancelled at the next step.
    connected: bool,
    /// Prompt tokens found cached at the first admission; `None` before it.
    cached_prompt: Option<usize>,
    /// Admission order: a request is only preempted for one admitted before it.
    stamp: u64,
    preemptions: usize,
    /// KV eviction, when the request's policy evicts.
    eviction: Option<EvictionState>,
    forced: Vec<u32>,
    /// KV the sequence held, for the completion: keys and blocks at the last step, most blocks.
    kv_held: (usize, usize),
    kv_blocks_peak: usize,
    submitted: Instant,
    /// When a request never admitted gives up waiting ([`Request::max_queue_wait`]).
    queue_deadline: Option<Instant>,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    /// Sampled tokens of steps in flight that the host does not know yet (0 outside overlapped
    /// stepping; 1 between steps, 2 while a step is issued and the one before it not yet read).
    in_flight: u8,
    /// The output row of this request's token in the last step issued.
    out_row: u32,
    /// Where its KV counts as computed once its awaited token is known: the last step issued
    /// ran a row carrying that token.
    commit_when_known: Option<usize>,
}

impl Live {
    /// The output row of the last issued step that holds this request's next token, while the
    /// host does not know it yet.
    fn carry_row(&self) -> Option<u32> {
        (self.in_flight > 0).then_some(self.out_row)
    }

    fn send(&mut self, event: Event) {
        if self.connected && !self.events.send(event) {
            self.connected = false;
        }
    }

    /// Sends the request's last event even when its sink says the client stopped listening:
    /// a request cancelled by its id (not by its client leaving) still hears how it ended.
    fn send_terminal(&mut self, event: Event) {
        self.events.send(event);
        self.connected = false;
    }

    fn completion(&self, finish_reason: FinishReason) -> Completion {
        let ms = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64() * 1e3;
        let now = Instant::now();
        let first = self.first_token.unwrap_or(now);
        let cached = self.cached_prompt.unwrap_or(0);
        Completion {
            token_ids: self.generated.clone(),
            text: self.text.clone(),
            finish_reason,
            cached_prompt_tokens: cached,
            prefilled_tokens: self.prompt.len() - cached,
            preemptions: self.preemptions,
            kv_tokens: self.kv_held.0,
            kv_blocks: self.kv_held.1,
            kv_blocks_peak: self.kv_blocks_peak,
            timings: Timings {
                queue_ms: ms(self.submitted, self.admitted.unwrap_or(now)),
                prefill_ms: ms(self.submitted, first),
                decode_ms: ms(first, now),
            },
        }
    }
}

/// What [`PersistentBatch::warm_up`] ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WarmUpReport {
    pub steps: usize,
    /// The most prompt tokens of one step.
    pub prefill_tokens: usize,
    /// The most decoding sequences of one step.
    pub decode_rows: usize,
}

/// Most sessions a batch remembers; a new one past this forgets the session with no request in
/// the batch that was least recently used (named by a request, or ended one); see
/// [`Request::session`].
pub const MAX_SESSIONS: usize = 4096;

/// A model, its KV cache and the requests running on it; see the [module docs](self).
pub struct PersistentBatch<B: Backend> {
    /// The step issued and not yet read back, when stepping overlaps. First, so that it is
    /// dropped (waiting for its device work) before the model and cache it writes into.
    in_flight: Option<overlap::InFlight>,
    model: Llama<B>,
    tokenizer: TextTokenizer,
    cache: B::KvCache,
    kv: KvManager,
    config: BatchConfig,
    /// `max_batch` slots; a running request holds one.
    slots: Vec<Option<Live>>,
    /// New requests in submission order, preempted ones in front.
    waiting: VecDeque<Live>,
    /// Session name -> its sequence and when a request last named it (`next_stamp`'s clock).
    sessions: HashMap<String, (SeqId, u64)>,
    next_seq: SeqId,
    next_request: u64,
    next_stamp: u64,
    steps: u64,
    tokens_run: u64,
    prefill_tokens_run: u64,
    /// Decode-only steps: count, tokens, microseconds (see [`BatchStats`]).
    decode_steps: (u64, u64, u64),
    /// Compactions and their microseconds (see [`BatchStats`]).
    compactions: (u64, u64),
    kv_blocks_peak: usize,
    preemptions: u64,
    profile: StepProfile,
    /// Issue each step before taking the previous step's tokens (see [`overlap`]).
    overlap: bool,
    overlapped_steps: u64,
}

impl<B: Backend> PersistentBatch<B> {
    pub fn new(
        model: Llama<B>,
        tokenizer: TextTokenizer,
        config: BatchConfig,
    ) -> Result<Self, BatchError> {
        config.validate().map_err(BatchError::Config)?;
        let cache = model.kv_cache(config.block_size, config.num_blocks)?;
        let model_runs_ahead = model.backend().runs_ahead();
        let kv = match config.prefix_caching {
            true => KvManager::new(config.num_blocks as u32, config.block_size),
            false => KvManager::without_reuse(config.num_blocks as u32, config.block_size),
        };
        Ok(PersistentBatch {
            model,
            tokenizer,
            cache,
            kv,
            slots: (0..config.max_batch).map(|_| None).collect(),
            config,
            waiting: VecDeque::new(),
            sessions: HashMap::new(),
            next_seq: 0,
            next_request: 0,
            next_stamp: 0,
            steps: 0,
            tokens_run: 0,
            prefill_tokens_run: 0,
            decode_steps: (0, 0, 0),
            compactions: (0, 0),
            kv_blocks_peak: 0,
            preemptions: 0,
            profile: StepProfile::default(),
            overlap: model_runs_ahead,
            in_flight: None,
            overlapped_steps: 0,
        })
    }

    /// Takes the model and tokenizer back (e.g. to build a batch of another configuration);
    /// requests still in the batch are dropped, and their handles report
    /// [`RequestError::Disconnected`].
    pub fn into_parts(self) -> (Llama<B>, TextTokenizer) {
        (self.model, self.tokenizer)
    }

    pub fn model(&self) -> &Llama<B> {
        &self.model
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    pub fn config(&self) -> &BatchConfig {
        &self.config
    }

    /// The KV bookkeeping, for inspection (e.g. [`KvManager::check`] in tests).
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    /// The backend's KV cache that the batch's steps run on, for inspection (e.g. how much of a
    /// GPU cache that grows on demand is mapped).
    pub fn cache(&self) -> &B::KvCache {
        &self.cache
    }

    /// The sequence of a session, once a request named it.
    pub fn session_seq(&self, session: &str) -> Option<SeqId> {
        self.sessions.get(session).map(|&(seq, _)| seq)
    }

    pub fn stats(&self) -> BatchStats {
        BatchStats {
            running: self.slots.iter().flatten().count(),
            waiting: self.waiting.len(),
            kv_blocks_total: self.kv.total(),
            kv_blocks_used: self.kv.num_used(),
            kv_blocks_free: self.kv.num_free(),
            kv_blocks_evictable: self.kv.num_evictable(),
            idle_sessions: self.kv.num_cached_idle(),
            steps: self.steps,
            tokens_run: self.tokens_run,
            prefill_tokens_run: self.prefill_tokens_run,
            decode_steps: self.decode_steps.0,
            decode_step_tokens: self.decode_steps.1,
            decode_step_micros: self.decode_steps.2,
            compactions: self.compactions.0,
            compaction_micros: self.compactions.1,
            kv_blocks_peak: self.kv_blocks_peak,
            preemptions: self.preemptions,
            phases: self.profile.phases,
            overlapped_steps: self.overlapped_steps,
        }
    }

    /// Keeps a [`StepTiming`] of every step from now on (`on`), with the device's time where
    /// the backend measures it, or stops keeping them.
    pub fn set_step_profile(&mut self, on: bool) {
        self.profile.set_on(on);
        self.model.set_step_timing(on);
    }

    /// The steps profiled since the last call (see [`Self::set_step_profile`]).
    pub fn take_step_profile(&mut self) -> Vec<StepTiming> {
        self.profile.take()
    }

    /// Whether nothing is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty()
            && self.slots.iter().all(Option::is_none)
            && self.in_flight.is_none()
    }

    /// Queues a request. An invalid one, or one too large for the KV cache even alone, gets its
    /// [`Event::Failed`] at once.
    pub fn submit(&mut self, request: Request) -> RequestHandle {
        let (tx, rx) = channel();
        let id = self.submit_to(request, Box::new(tx));
        RequestHandle { id, events: rx }
    }

    /// Queues a request whose events go to `sink` (called on the thread that steps the batch),
    /// as [`submit`](Self::submit) does with a channel. A sink that reports its client gone is
    /// cancelled at the next step, waiting or running, and its KV freed.
    pub fn submit_to(&mut self, request: Request, mut sink: Box<dyn EventSink>) -> RequestId {
        let id = RequestId(self.next_request);
        self.next_request += 1;
        let max_tokens = match request.validate(&self.limits()) {
            Ok(max_tokens) => max_tokens,
            Err(e) => {
                sink.send(Event::Failed(e));
                return id;
            }
        };
        let eviction = match request
            .kv_eviction
            .as_ref()
            .map(|e| EvictionState::new(e, request.prompt.len()))
            .transpose()
        {
            Ok(e) => e.flatten(),
            Err(e) => {
                sink.send(Event::Failed(e));
                return id;
            }
        };
        if eviction.as_ref().is_some_and(EvictionState::needs_scores)
            && !self
                .model
                .backend()
                .supports_kv_scores(&self.model.backend().kv_spec(&self.cache))
        {
            sink.send(Event::Failed(RequestError::Eviction(format!(
                "the {} policy needs attention scores, which {} does not compute for this \
                 model's attention shape or KV cache dtype; window and sink run here",
                request
                    .kv_eviction
                    .map(|e| e.policy.name())
                    .unwrap_or_default(),
                self.model.backend().name()
            ))));
            return id;
        }
        let seq = match &request.session {
            Some(name) => {
                let used = self.next_stamp;
                self.next_stamp += 1;
                match self.sessions.get_mut(name) {
                    Some((seq, last)) => {
                        *last = used;
                        *seq
                    }
                    None => {
                        if self.sessions.len() >= MAX_SESSIONS {
                            self.forget_oldest_idle_session();
                        }
                        let seq = self.new_seq();
                        self.sessions.insert(name.clone(), (seq, used));
                        seq
                    }
                }
            }
            None => self.new_seq(),
        };
        let submitted = Instant::now();
        let mut live = Live {
            id,
            seq,
            session: request.session.clone(),
            prompt: request.prompt,
            max_tokens,
            ignore_eos: request.ignore_eos,
            logprobs: request.logprobs,
            sampler: Sampler::new(request.sampling),
            stream: TextStream::new(),
            stops: StopStrings::new(request.stop_strings),
            generated: Vec::new(),
            text: String::new(),
            events: sink,
            connected: true,
            cached_prompt: None,
            stamp: 0,
            preemptions: 0,
            eviction,
            forced: request.forced_tokens,
            kv_held: (0, 0),
            kv_blocks_peak: 0,
            submitted,
            queue_deadline: request.max_queue_wait.map(|wait| submitted + wait),
            admitted: None,
            first_token: None,
            in_flight: 0,
            out_row: 0,
            commit_when_known: None,
        };
        if max_tokens == 0 {
            let completion = live.completion(FinishReason::Length);
            live.send(Event::Finished(completion));
        } else {
            self.waiting.push_back(live);
        }
        id
    }

    /// Ends a request now, waiting or running: its KV blocks are released at once (a session's
    /// computed KV stays resident as idle, reclaimable at once) and it finishes as
    /// [`FinishReason::Cancelled`] with what it generated so far. False if it is not in the batch.
    pub fn cancel(&mut self, id: RequestId) -> Result<bool, BatchError> {
        if let Some(slot) = self
            .slots
            .iter()
            .position(|s| s.as_ref().is_some_and(|l| l.id == id))
        {
            self.end(slot, FinishReason::Cancelled)?;
            return Ok(true);
        }
        if let Some(i) = self.waiting.iter().position(|l| l.id == id) {
            let mut live = self.waiting.remove(i).expect("found above");
            self.release(&live, false)?;
            let completion = live.completion(FinishReason::Cancelled);
            live.send(Event::Finished(completion));
            return Ok(true);
        }
        Ok(false)
    }

    /// Cancels every request in the batch, running or waiting (e.g. at a shutdown deadline),
    /// once the tokens of a step in flight have reached their requests; returns how many were
    /// cancelled.
    pub fn cancel_all(&mut self) -> Result<usize, BatchError> {
        // Tokens already computed reach their requests first (one may end them as finished).
        let mut report = StepReport::default();
        if let Err(e) = self.drain(&mut report, &mut StepClock::start()) {
            self.abandon_in_flight(&e)?;
        }
        let ids: Vec<RequestId> = self.lives().map(|l| l.id).collect();
        for &id in &ids {
            self.cancel(id)?;
        }
        Ok(ids.len())
    }

    /// Forgets a session and frees its KV; false if it is unknown or has a request in the batch.
    pub fn end_session(&mut self, session: &str) -> Result<bool, BatchError> {
        let Some(&(seq, _)) = self.sessions.get(session) else {
            return Ok(false);
        };
        if self.seq_in_batch(seq) {
            return Ok(false);
        }
        self.sessions.remove(session);
        if self.kv.state(seq).is_some() {
            self.kv.free(seq)?;
        }
        Ok(true)
    }

    /// The requests in the batch: running, then waiting.
    fn lives(&self) -> impl Iterator<Item = &Live> {
        self.slots.iter().flatten().chain(self.waiting.iter())
    }

    /// Whether a request of `seq` is running or waiting.
    fn seq_in_batch(&self, seq: SeqId) -> bool {
        self.lives().any(|l| l.seq == seq)
    }

    /// Makes room for a new session name: forgets the least recently used session that has no
    /// request in the batch, with its KV and token ids (its next request, which carries the
    /// whole conversation, prefills it again). Sessions are never ended by clients that just stop
    /// using them, so without this bound their names and token lists would pile up forever.
    fn forget_oldest_idle_session(&mut self) {
        let in_batch: HashSet<SeqId> = self.lives().map(|l| l.seq).collect();
        let oldest = self
            .sessions
            .iter()
            .filter(|(_, (seq, _))| !in_batch.contains(seq))
            .min_by_key(|(_, &(_, used))| used)
            .map(|(name, _)| name.clone());
        if let Some(name) = oldest {
            if let Err(e) = self.end_session(&name) {
                tracing::warn!("forgetting session {name:?}: {e}");
            }
        }
    }

    /// One step: decide what runs, run it in one forward pass, act on the logits.
    pub fn step(&mut self) -> Result<StepReport, BatchError> {
        let mut clock = StepClock::start();
        let mut report = StepReport::default();
        let overlap = self.overlap;
        let read_back = self.in_flight.is_some();
        if read_back && (!overlap || self.must_drain()?) {
            self.drain_or_abandon(&mut report, &mut clock)?;
        }
        let mut work = self.schedule(&mut report)?;
        self.kv_blocks_peak = self.kv_blocks_peak.max(self.kv.num_used());
        clock.scheduled();
        let mut overlapped = overlap;
        for w in &work {
            overlapped = overlapped && !self.needs_tokens_now(w)?;
        }
        if !overlapped && self.in_flight.is_some() {
            // This step runs alone: the tokens in flight come back first. Rows that named one
            // now know it, and rows of requests that just ended go.
            self.drain_or_abandon(&mut report, &mut clock)?;
            work.retain(|w| self.slots[w.slot].is_some());
            for w in &mut work {
                w.carried = None;
            }
        }
        if work.is_empty() {
            self.drain_or_abandon(&mut report, &mut clock)?;
            if read_back {
                // A step that only read back the one in flight: its wait and output processing.
                self.profile.record(clock, 0, 0, 0);
            }
            return Ok(report);
        }
        if overlapped {
            if let Err(e) = self.issue(&work, &mut report, &mut clock) {
                self.abandon_in_flight(&e)?;
                return Err(e);
            }
        } else {
            let sampled = match self.run(&work) {
                Ok(sampled) => sampled,
                Err(e) => {
                    self.fail_all(&work, &e)?;
                    return Err(e);
                }
            };
            clock.forwarded(self.model.last_forward_times());
            self.postprocess(&work, &sampled, &mut report)?;
            clock.postprocessed();
        }
        self.prefill_tokens_run += report.prefill_tokens as u64;
        if report.prefill_tokens == 0 {
            let (steps, tokens, micros) = &mut self.decode_steps;
            *steps += 1;
            *tokens += report.tokens as u64;
            *micros += clock.started().elapsed().as_micros() as u64;
        }
        let (sequences, tokens, prefill) = (report.sequences, report.tokens, report.prefill_tokens);
        self.profile.record(clock, sequences, tokens, prefill);
        Ok(report)
    }

    /// Runs the kinds of step that serving starts with once, before any real request: a
    /// prefill chunk of up to `prompt_tokens` tokens and decode steps of one row, then decode
    /// steps of up to `sequences` rows (two of each, so that a backend that records its steps
    /// records those). The one-time costs of those steps (kernels loaded on first use, product
    /// algorithms chosen, step graphs recorded) are then paid here rather than by the first
    /// requests. Afterwards the counters and the step profile start from zero; the requests'
    /// blocks are freed (a cache that keeps finished prefixes may keep theirs, unreferenced,
    /// until it needs the room). Does nothing unless the batch is idle; the shapes are cut to
    /// the batch's limits.
    pub fn warm_up(
        &mut self,
        sequences: usize,
        prompt_tokens: usize,
    ) -> Result<WarmUpReport, BatchError> {
        let mut done = WarmUpReport::default();
        if !self.is_idle() {
            return Ok(done);
        }
        const MAX_TOKENS: usize = 3;
        let limits = self.limits();
        let block = limits.block_size.max(1);
        let room = limits.num_blocks.saturating_mul(block);
        let long = prompt_tokens
            .min(self.config.max_batched_tokens)
            .min(limits.context.saturating_sub(MAX_TOKENS + 1))
            .min(room.saturating_sub(MAX_TOKENS + block));
        // The short prompts all fit one step, so that every sequence decodes in the same steps.
        let sequences = sequences
            .min(self.config.max_batch)
            .min(self.config.max_batched_tokens);
        let short = (self.config.max_batched_tokens / sequences.max(1)).clamp(1, 8);
        let sequences = sequences.min(limits.num_blocks / (short + MAX_TOKENS).div_ceil(block));
        // Ordinary token ids of this vocabulary, cycled: what they say does not matter.
        let ids = self
            .tokenizer
            .encode("The engine runs each kind of step once before it serves requests.")
            .unwrap_or_default();
        if ids.is_empty() {
            return Ok(done);
        }
        let request = |n: usize| Request {
            max_tokens: MAX_TOKENS,
            ignore_eos: true,
            ..Request::new(ids.iter().copied().cycle().take(n).collect())
        };
        let mut phases = Vec::new();
        if long > 0 {
            phases.push(vec![request(long)]);
        }
        if sequences > 1 {
            phases.push((0..sequences).map(|_| request(short)).collect());
        }
        for requests in phases {
            let handles: Vec<RequestHandle> =
                requests.into_iter().map(|r| self.submit(r)).collect();
            while !self.is_idle() {
                let step = self.step()?;
                done.steps += 1;
                done.prefill_tokens = done.prefill_tokens.max(step.prefill_tokens);
                done.decode_rows = done.decode_rows.max(step.decode_sequences);
            }
            for h in handles {
                if let Err(e) = h.wait() {
                    tracing::warn!("a warm-up request failed: {e}");
                }
            }
        }
        self.steps = 0;
        self.tokens_run = 0;
        self.prefill_tokens_run = 0;
        self.decode_steps = (0, 0, 0);
        self.compactions = (0, 0);
        self.kv_blocks_peak = self.kv.num_used();
        self.preemptions = 0;
        self.overlapped_steps = 0;
        self.profile.reset();
        Ok(done)
    }

    /// Steps until nothing is waiting or running.
    pub fn run_until_idle(&mut self) -> Result<(), BatchError> {
        while !self.is_idle() {
            self.step()?;
        }
        Ok(())
    }

    /// Chooses this step's tokens and reserves their KV: first the running requests (preempting
    /// the youngest when blocks run out), then waiting requests admitted into free slots.
    fn schedule(&mut self, report: &mut StepReport) -> Result<Vec<Work>, BatchError> {
        self.drop_disconnected(report)?;
        let mut work = self.schedule_running(report)?;
        // No admission after a preemption: the preempted request would come straight back.
        if report.preempted == 0 {
            let used: usize = work.iter().map(|w| w.len).sum();
            self.admit(self.config.max_batched_tokens - used, &mut work, report)?;
            if work.is_empty() && self.slots.iter().all(Option::is_none) {
                // Nothing runs and the first waiting request could not be admitted into an empty
                // batch: it is too large for the cache, which submission already refuses. End it
                // rather than loop.
                if let Some(mut live) = self.waiting.pop_front() {
                    let error = self.too_large(live.seq, live.prompt.len() + live.max_tokens - 1);
                    self.release(&live, false)?;
                    live.send(Event::Failed(error));
                    report.ended += 1;
                }
            }
        }
        Ok(work)
    }

    /// Cancels the requests whose client went away, and refuses those that waited too long.
    fn drop_disconnected(&mut self, report: &mut StepReport) -> Result<(), KvError> {
        for live in self
            .slots
            .iter_mut()
            .flatten()
            .chain(self.waiting.iter_mut())
        {
            live.connected &= live.events.is_connected();
        }
        for slot in 0..self.slots.len() {
            if self.slots[slot].as_ref().is_some_and(|l| !l.connected) {
                self.end(slot, FinishReason::Cancelled)?;
                report.ended += 1;
            }
        }
        while let Some(i) = self.waiting.iter().position(|l| !l.connected) {
            let mut live = self.waiting.remove(i).expect("found above");
            self.release(&live, false)?;
            live.send_terminal(Event::Finished(live.completion(FinishReason::Cancelled)));
            report.ended += 1;
        }
        // Requests that waited too long for their first admission (a preempted one has started
        // streaming and is not refused).
        let now = Instant::now();
        let expired = |l: &Live| l.admitted.is_none() && l.queue_deadline.is_some_and(|d| d <= now);
        while let Some(i) = self.waiting.iter().position(expired) {
            let mut live = self.waiting.remove(i).expect("found above");
            self.release(&live, false)?;
            let waited_ms = now.duration_since(live.submitted).as_millis() as u64;
            live.send(Event::Failed(RequestError::QueueTimeout { waited_ms }));
            report.ended += 1;
        }
        Ok(())
    }

    /// This step's work for the running requests. The token budget goes to decoding sequences
    /// first (one token each), so that long prompts never stall them, then to prefill chunks,
    /// oldest request first. KV blocks are reserved oldest first; when they run out, the most
    /// recently admitted request gives way (preempted), so the oldest always advances.
    fn schedule_running(&mut self, report: &mut StepReport) -> Result<Vec<Work>, BatchError> {
        let mut order: Vec<usize> = (0..self.slots.len())
            .filter(|&s| self.slots[s].is_some())
            .collect();
        order.sort_by_key(|&s| self.live(s).stamp);
        let mut budget = self.config.max_batched_tokens;
        let mut want = vec![0; self.slots.len()];
        for decoding in [true, false] {
            for &s in &order {
                let pending = self.pending(s)?;
                if (pending == 1) == decoding {
                    want[s] = pending.min(self.config.prefill_chunk).min(budget);
                    budget -= want[s];
                }
            }
        }

        let mut work: Vec<Work> = Vec::new();
        for &s in &order {
            if want[s] == 0 || self.slots[s].is_none() {
                continue;
            }
            let seq = self.live(s).seq;
            let start = self.kv.computed(seq)?;
            loop {
                match self.kv.reserve(seq, start + want[s]) {
                    Ok(()) => {
                        work.push(Work {
                            slot: s,
                            start,
                            len: want[s],
                            carried: self.live(s).carry_row(),
                        });
                        break;
                    }
                    Err(KvError::OutOfBlocks { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
                // The youngest other running request without work this step, if younger.
                let stamp = self.live(s).stamp;
                let victim = (0..self.slots.len())
                    .filter(|&v| v != s && !work.iter().any(|w| w.slot == v))
                    .filter_map(|v| Some((self.slots[v].as_ref()?.stamp, v)))
                    .max()
                    .filter(|&(victim_stamp, _)| victim_stamp > stamp);
                if let Some((_, v)) = victim {
                    self.preempt(v)?;
                    report.preempted += 1;
                    continue;
                }
                if self.slots.iter().flatten().count() > 1 {
                    self.preempt(s)?;
                    report.preempted += 1;
                } else {
                    // Alone and still too large: submission refuses such requests, so this is
                    // a safety net that ends the request rather than looping.
                    let error = self.too_large(seq, 0);
                    self.fail(s, error)?;
                    report.ended += 1;
                }
                break;
            }
        }
        Ok(work)
    }

    /// Admits waiting requests into free slots, in order, while `budget` tokens last. A request
    /// whose session is busy (running, or claimed by an earlier waiting request) is passed over,
    /// and so is a new one whose prefix a running request is still prefilling (it will share
    /// those blocks once they are computed, rather than compute them a second time).
    /// As in nano-vllm, a request is admitted only if the KV of all its uncomputed tokens fits in
    /// the blocks not yet promised to the requests admitted before it in this step, though only
    /// its first chunk is reserved now; otherwise admission stops (first come, first served).
    /// This keeps admission from filling the cache with half-prefilled prompts that running
    /// requests would then have to preempt.
    fn admit(
        &mut self,
        mut budget: usize,
        work: &mut Vec<Work>,
        report: &mut StepReport,
    ) -> Result<(), BatchError> {
        let bs = self.config.block_size;
        let mut claimed: HashSet<SeqId> = self
            .slots
            .iter()
            .flatten()
            .filter(|l| l.session.is_some())
            .map(|l| l.seq)
            .collect();
        // Blocks the requests admitted in this step still need for their prompts.
        let mut promised = 0;
        let mut i = 0;
        while budget > 0 && i < self.waiting.len() {
            let Some(slot) = self.slots.iter().position(Option::is_none) else {
                break;
            };
            let candidate = &self.waiting[i];
            if candidate.session.is_some() && !claimed.insert(candidate.seq) {
                i += 1;
                continue;
            }
            if candidate.cached_prompt.is_none() && self.prefix_in_flight(&candidate.prompt)? {
                i += 1;
                continue;
            }
            let mut live = self.waiting.remove(i).expect("index checked above");
            let first = live.cached_prompt.is_none();
            let cached = match (first, &live.eviction) {
                (true, None) => self.kv.admit(live.seq, &live.prompt).cached,
                (true, Some(e)) => {
                    self.kv
                        .admit_evicting(live.seq, &live.prompt, e.max_frozen())
                        .cached
                }
                (false, _) => self.kv.resume(live.seq)?.cached,
            };
            let total = self.kv.tokens(live.seq)?.len();
            let len = (total - cached).min(self.config.prefill_chunk).min(budget);
            // The most it will hold: the whole sequence, or for one evicting during its prompt,
            // its budget plus a chunk and a block.
            let peak = match &live.eviction {
                Some(e) => e.peak_keys(total, self.config.prefill_chunk, bs),
                None => total,
            };
            // `promised` more blocks on top of that, as `can_reserve` counts them.
            let fits = self.kv.can_reserve(live.seq, peak + promised * bs);
            match self.kv.reserve(live.seq, cached + len) {
                Ok(()) if fits => {}
                Ok(()) | Err(KvError::OutOfBlocks { .. }) => {
                    self.unadmit(&live, first)?;
                    self.waiting.insert(i, live);
                    break;
                }
                Err(e) => return Err(e.into()),
            }
            promised += peak
                .div_ceil(bs)
                .saturating_sub((cached + len).div_ceil(bs));
            if first {
                live.cached_prompt = Some(cached);
                live.admitted = Some(Instant::now());
            }
            live.stamp = self.next_stamp;
            self.next_stamp += 1;
            self.slots[slot] = Some(live);
            work.push(Work {
                slot,
                start: cached,
                len,
                carried: None,
            });
            budget -= len;
            report.admitted += 1;
        }
        Ok(())
    }

    /// Whether a running sequence is computing full blocks of `prompt`'s prefix that are not
    /// resident yet. Such blocks become shareable when their step commits them, so a request
    /// admitted now would compute them a second time; waiting a few steps lets it share them.
    /// The running sequence always advances, so the wait ends.
    fn prefix_in_flight(&self, prompt: &[u32]) -> Result<bool, KvError> {
        if !self.config.prefix_caching {
            return Ok(false);
        }
        let bs = self.config.block_size;
        let resident = self.kv.resident_prefix(prompt);
        let limit = prompt.len().saturating_sub(1);
        for live in self.slots.iter().flatten() {
            // An evicting sequence publishes nothing to wait for.
            if self.kv.is_evicting(live.seq)? {
                continue;
            }
            let tokens = self.kv.tokens(live.seq)?;
            let common = tokens
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count();
            if common.min(limit) / bs * bs > resident {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Undoes an admission that found too few blocks: the request waits with its sequence as it
    /// was (a session's resident prefix stays resident).
    fn unadmit(&mut self, live: &Live, first: bool) -> Result<(), KvError> {
        match (first, live.session.is_some()) {
            (false, _) => self.kv.preempt(live.seq),
            (true, true) => self.kv.finish(live.seq),
            (true, false) => self.kv.free(live.seq),
        }
    }

    /// One forward pass over the scheduled chunks; returns the token sampled for each (only the
    /// tokens of chunks that end their sequence's known tokens are used; the others are sampled
    /// greedily, without drawing from their request's generator), with the logits they were
    /// chosen from when a request reports log-probabilities.
    fn run(&mut self, work: &[Work]) -> Result<Sampled, BatchError> {
        let inputs = self.inputs(work)?;
        let (tokens, logits) = if inputs.logprobs {
            let (tokens, logits) = self.model.forward_sample_with_logits(
                &inputs.chunks,
                &mut self.cache,
                &inputs.params,
                &inputs.penalties,
            )?;
            (tokens, Some(logits))
        } else {
            let tokens = self.model.forward_sample(
                &inputs.chunks,
                &mut self.cache,
                &inputs.params,
                &inputs.penalties,
            )?;
            (tokens, None)
        };
        Ok(Sampled { tokens, logits })
    }

    /// The forward pass's inputs for `work`: each chunk's tokens (a carried row's one token named
    /// by [`CARRIED_TOKEN`]), KV positions and block table, and each output row's sampling (its
    /// request's next draw where the chunk ends the known tokens, greedy otherwise).
    fn inputs(&mut self, work: &[Work]) -> Result<StepInputs, BatchError> {
        let mut chunks = Vec::with_capacity(work.len());
        let mut params = Vec::with_capacity(work.len());
        let mut penalties = PenaltyLists::empty(0);
        let mut logprobs = false;
        for w in work {
            let seq = self.live(w.slot).seq;
            let tokens = self.kv.tokens(seq)?;
            let ends = w.carried.is_some() || w.start + w.len >= tokens.len();
            let live = self.slots[w.slot].as_ref().expect("scheduled slots run");
            // Tokens in flight count among those generated: the temperature is the one the
            // step would have one step at a time.
            let generated = live.generated.len() + live.in_flight as usize;
            let scoring = live
                .eviction
                .as_ref()
                .and_then(|e| e.scoring(generated, live.max_tokens));
            let chunk_tokens = match w.carried {
                Some(row) => vec![CARRIED_TOKEN | row],
                None => tokens[w.start..w.start + w.len].to_vec(),
            };
            chunks.push(SequenceChunk {
                tokens: chunk_tokens,
                start: w.start - self.kv.evicted(seq)?,
                position: w.start,
                block_table: self.kv.block_table(seq)?.to_vec(),
                scoring,
            });
            let live = self.slots[w.slot].as_mut().expect("scheduled slots run");
            if ends {
                logprobs |= live.logprobs.is_some();
                params.push(live.sampler.next_params());
                let prompt = tokens.len() - live.generated.len();
                penalties.push_row(live.sampler.penalties(tokens, prompt));
            } else {
                params.push(SampleParams::GREEDY);
                penalties.push_row(PenaltyRow::default());
            }
        }
        Ok(StepInputs {
            chunks,
            params,
            penalties,
            logprobs,
        })
    }

    /// Compacts the KV of the request in `slot` to its eviction budget; false when that failed,
    /// in which case the request has failed (and is counted in `report`) while the others go on.
    fn compact(&mut self, slot: usize, report: &mut StepReport) -> Result<bool, BatchError> {
        let live = self.slots[slot].as_ref().expect("a running slot");
        let Some(e) = &live.eviction else {
            return Ok(true);
        };
        let started = Instant::now();
        let result = e.compact(&self.model, &mut self.cache, &mut self.kv, live.seq);
        self.compactions.0 += 1;
        self.compactions.1 += started.elapsed().as_micros() as u64;
        let Err(error) = result else {
            return Ok(true);
        };
        tracing::error!(request = live.id.0, "KV compaction failed: {error}");
        self.fail(slot, RequestError::Model(error.to_string()))?;
        report.ended += 1;
        Ok(false)
    }

    /// Commits the KV just written; streams the sampled token and checks the end of every
    /// sequence whose tokens are now all computed.
    fn postprocess(
        &mut self,
        work: &[Work],
        sampled: &Sampled,
        report: &mut StepReport,
    ) -> Result<(), BatchError> {
        let vocab = sampled
            .logits
            .as_ref()
            .map_or(0, |l| l.len() / work.len().max(1));
        self.steps += 1;
        report.sequences = work.len();
        report.tokens = work.iter().map(|w| w.len).sum();
        self.tokens_run += report.tokens as u64;
        for (row, (w, &token)) in work.iter().zip(&sampled.tokens).enumerate() {
            let live = self.slots[w.slot].as_mut().expect("scheduled slots run");
            let seq = live.seq;
            if w.len == 1 && !live.generated.is_empty() {
                report.decode_sequences += 1;
            } else {
                report.prefill_tokens += w.len;
            }
            self.kv.commit(seq, w.start + w.len)?;
            let blocks = self.kv.block_table(seq)?.len();
            live.kv_blocks_peak = live.kv_blocks_peak.max(blocks);
            // Evicts once the prompt is in, then once per slack of growth; while the prompt is
            // still coming only when asked to evict during it.
            let prefilling = w.start + w.len < self.kv.tokens(seq)?.len();
            let keys = self.kv.keys(seq)?;
            let prompt_done_now = live.generated.is_empty();
            let due = live
                .eviction
                .as_ref()
                .is_some_and(|e| e.due(keys, prefilling, prompt_done_now, self.config.block_size));
            if due && !self.compact(w.slot, report)? {
                continue;
            }
            let live = self.slots[w.slot].as_mut().expect("scheduled slots run");
            live.kv_held = (self.kv.keys(seq)?, self.kv.block_table(seq)?.len());
            if prefilling {
                continue;
            }
            live.first_token.get_or_insert_with(Instant::now);
            if token == NO_FINITE_LOGIT {
                self.fail_without_finite_logits(w.slot)?;
                report.ended += 1;
                continue;
            }
            // Teacher forcing: the forced token replaces the sampled one.
            let token = live
                .forced
                .get(live.generated.len())
                .copied()
                .unwrap_or(token);
            self.kv.append_token(seq, token)?;
            if let (Some(top), Some(logits)) = (live.logprobs, &sampled.logits) {
                let logits = &logits[row * vocab..(row + 1) * vocab];
                live.send(Event::Logprobs(TokenLogprobs::from_logits(
                    logits, token, top,
                )));
            }
            match stream_token(live, &self.tokenizer, token) {
                Ok(None) => continue,
                Ok(Some(reason)) => self.end(w.slot, reason)?,
                Err(e) => self.fail(w.slot, RequestError::Detokenize(e.to_string()))?,
            }
            report.ended += 1;
        }
        Ok(())
    }

    fn live(&self, slot: usize) -> &Live {
        self.slots[slot].as_ref().expect("an occupied slot")
    }

    /// Tokens of the running request in `slot` whose KV is not computed yet, counting a token
    /// still on its way from the device unless it will be the request's last.
    fn pending(&self, slot: usize) -> Result<usize, KvError> {
        let live = self.live(slot);
        let known = self.kv.tokens(live.seq)?.len() - self.kv.computed(live.seq)?;
        let awaited = live.in_flight > 0 && live.generated.len() + 1 < live.max_tokens;
        Ok(known + usize::from(awaited))
    }

    /// Sends the running request in `slot` back to the front of the queue without its KV; it is
    /// recomputed from its tokens (prompt and generated so far) when readmitted.
    fn preempt(&mut self, slot: usize) -> Result<(), KvError> {
        let mut live = self.slots[slot].take().expect("an occupied slot");
        if live.in_flight > 0 {
            // Overlapped stepping reads the step in flight back before any step that could
            // preempt (`must_drain`), so this does not happen; if it did, the token in flight
            // would be drawn again after the request's recomputation.
            tracing::warn!(request = live.id.0, "preempted with a token in flight");
            live.in_flight = 0;
            live.commit_when_known = None;
        }
        self.kv.preempt(live.seq)?;
        live.preemptions += 1;
        self.preemptions += 1;
        tracing::debug!(request = live.id.0, "preempted");
        self.waiting.push_front(live);
        Ok(())
    }

    /// Ends the request in `slot` with a completion and frees the slot.
    fn end(&mut self, slot: usize, reason: FinishReason) -> Result<(), KvError> {
        let mut live = self.slots[slot].take().expect("an occupied slot");
        self.release(&live, true)?;
        let completion = live.completion(reason);
        live.send_terminal(Event::Finished(completion));
        Ok(())
    }

    /// Ends the request in `slot` with an error and frees the slot.
    fn fail(&mut self, slot: usize, error: RequestError) -> Result<(), KvError> {
        let mut live = self.slots[slot].take().expect("an occupied slot");
        self.release(&live, true)?;
        live.send(Event::Failed(error));
        Ok(())
    }

    /// Ends the request in `slot` whose step gave no finite logit: its KV is not to be trusted,
    /// so its sequence is discarded (no later request reuses its blocks) and a session forgets
    /// it (the session's next request prefills from scratch).
    fn fail_without_finite_logits(&mut self, slot: usize) -> Result<(), KvError> {
        let mut live = self.slots[slot].take().expect("an occupied slot");
        let index = live.generated.len();
        if self.kv.state(live.seq).is_some() {
            self.kv.discard(live.seq)?;
        }
        if let Some(name) = &live.session {
            self.sessions.remove(name);
        }
        live.send(Event::Failed(RequestError::NoFiniteLogits { index }));
        Ok(())
    }

    /// Ends every request of a step whose forward pass failed.
    fn fail_all(&mut self, work: &[Work], error: &BatchError) -> Result<(), KvError> {
        for w in work {
            self.fail(w.slot, RequestError::Model(error.to_string()))?;
        }
        Ok(())
    }

    /// Gives back the KV of a request that ends, `running` (holding a slot) or waiting. A
    /// session's sequence stays resident (idle) for its next turn, and is left alone while the
    /// request waits (another request of the session may be running on it, or it was preempted
    /// and keeps its tokens); any other sequence is the request's own and is forgotten.
    fn release(&mut self, live: &Live, running: bool) -> Result<(), KvError> {
        // A session is used until its request ends: the bound on sessions forgets by this.
        if let Some(entry) = live.session.as_ref().and_then(|n| self.sessions.get_mut(n)) {
            entry.1 = self.next_stamp;
            self.next_stamp += 1;
        }
        match self.kv.state(live.seq) {
            None => Ok(()),
            Some(_) if live.session.is_none() => self.kv.free(live.seq),
            Some(SeqState::Active) if running => self.kv.finish(live.seq),
            Some(_) => Ok(()),
        }
    }

    /// What a request may ask of this batch.
    pub fn limits(&self) -> RequestLimits {
        RequestLimits {
            context: self.model.config.context_length,
            vocab: self.model.config.vocab_size,
            block_size: self.config.block_size,
            num_blocks: self.config.num_blocks,
        }
    }

    /// The error of a request (`seq`, else `tokens` long) that cannot fit in the cache.
    fn too_large(&self, seq: SeqId, tokens: usize) -> RequestError {
        let tokens = self.kv.tokens(seq).map_or(tokens, <[u32]>::len);
        RequestError::TooLargeForCache {
            tokens,
            needed: tokens.div_ceil(self.config.block_size),
            total: self.config.num_blocks,
        }
    }

    fn new_seq(&mut self) -> SeqId {
        self.next_seq += 1;
        self.next_seq
    }
}

/// Records a sampled token of `live` and streams its text; returns why the request ends, if it
/// does. The text held back for incomplete characters or a possible stop string is flushed at the
/// end unless a stop string was hit (then what follows it is dropped).
fn stream_token(
    live: &mut Live,
    tokenizer: &TextTokenizer,
    token: u32,
) -> Result<Option<FinishReason>, TokenizerError> {
    live.generated.push(token);
    live.send(Event::Token(token));
    let mut finish = None;
    let mut stop_hit = false;
    if !live.ignore_eos && tokenizer.is_eos(token) {
        finish = Some(FinishReason::Stop);
    } else {
        let delta = live.stream.push(tokenizer, token)?;
        let (released, hit) = live.stops.push(&delta);
        if !released.is_empty() {
            live.text.push_str(&released);
            live.send(Event::Text(released));
        }
        if hit {
            stop_hit = true;
            finish = Some(FinishReason::Stop);
        }
    }
    if finish.is_none() && live.generated.len() >= live.max_tokens {
        finish = Some(FinishReason::Length);
    }
    if finish.is_some() && !stop_hit {
        let (tail, _) = live.stops.push(&live.stream.finish(tokenizer)?);
        let tail = tail + &live.stops.finish();
        if !tail.is_empty() {
            live.text.push_str(&tail);
            live.send(Event::Text(tail));
        }
    }
    Ok(finish)
}
