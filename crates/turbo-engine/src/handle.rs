//! The engine handle and the thread that steps its persistent batch.

use crate::load::{LoadedModelInfo, ModelOptions, ModelTask};
use crate::{EngineError, KvSize, SubmitError};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use turbo_core::Backend;
use turbo_llama::Llama;
use turbo_scheduler::{
    BatchConfig, BatchStats, Completion, Event, EventSink, PersistentBatch, Request, RequestError,
    RequestLimits, StepTiming, MAX_PROFILED_STEPS,
};
use turbo_tokenizer::{ChatMessage, ChatTemplate, TextTokenizer};

/// Everything an [`Engine`] is made from.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub model: ModelOptions,
    pub kv: KvSize,
    /// Slots: requests that run at once.
    pub max_batch: usize,
    /// Tokens per forward pass (decode tokens plus prefill chunks); raised to `max_batch` if
    /// lower.
    pub max_batched_tokens: usize,
    /// Most prompt tokens of one sequence per forward pass.
    pub prefill_chunk: usize,
    /// Share computed KV between requests with a common prefix and keep finished sequences
    /// resident (the cache of KV caches). Off only to measure what it saves.
    pub prefix_caching: bool,
    /// Requests running or queued beyond which [`Engine::submit`] refuses new ones
    /// ([`SubmitError::QueueFull`]), so that a burst is answered at once instead of piling up.
    pub max_pending: usize,
    /// Keep a timing of every step (host phases, device time), for
    /// [`Engine::take_step_profile`].
    pub profile_steps: bool,
    /// Before taking requests, run a prefill chunk and decode steps of one row and of
    /// `max_batch` rows once ([`PersistentBatch::warm_up`]) on backends whose first steps cost
    /// more (a GPU's: kernels loaded, product algorithms chosen, step graphs recorded), so that
    /// the first requests do not pay for them.
    pub warm_up: bool,
}

impl EngineConfig {
    /// The defaults for `model`: 64 slots, 2048 tokens a step, a bounded queue of 1024.
    pub fn new(model: ModelOptions) -> Self {
        EngineConfig {
            model,
            kv: KvSize::Default {
                cpu_slots: 64,
                cpu_tokens_per_slot: 4096,
            },
            max_batch: 64,
            max_batched_tokens: 2048,
            prefill_chunk: 512,
            prefix_caching: true,
            max_pending: 1024,
            profile_steps: false,
            warm_up: true,
        }
    }
}

/// What the engine runs, once it is loaded.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub model_path: PathBuf,
    /// The name clients address the model by: the file or directory name without extension.
    pub model_id: String,
    /// The backend's description, e.g. "CPU (AVX-512, 16 threads)" or the GPU's name.
    pub backend: String,
    pub context_length: usize,
    pub vocab_size: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// How the KV cache stores keys and values (`bf16`, `int8`, `fp8`).
    pub kv_dtype: turbo_core::KvDtype,
    /// The element the cache holds on this backend: the dtype's name, or `f32` for the
    /// unquantized cache on the CPU.
    pub kv_storage: &'static str,
    pub max_batch: usize,
    pub max_pending: usize,
    /// What a request may ask (context, vocabulary, KV cache size).
    pub limits: RequestLimits,
    /// Longest prompt text, in bytes, worth tokenizing: any longer text is more tokens than
    /// the context holds (see [`max_prompt_bytes`]), so it is refused before tokenizing.
    pub max_prompt_bytes: u64,
    /// The most bytes of text one token can stand for (see [`max_prompt_bytes`]): a reader that
    /// wants the first N tokens of a text needs at most N times this many bytes of it.
    pub max_bytes_per_token: u64,
}

/// A snapshot of the engine, published after every step.
#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    pub batch: BatchStats,
    /// Requests submitted and not yet ended (running, waiting, or not yet seen by the batch).
    pub pending: usize,
    /// Whether the engine thread is running (false after it stopped or failed).
    pub alive: bool,
}

/// A command for the engine thread.
enum Command {
    Submit(Box<Request>, Box<dyn EventSink>),
    EndSession(String, mpsc::SyncSender<bool>),
    /// Accept nothing more; finish what runs, and cancel what is left at the deadline.
    Drain(Instant),
}

/// State shared by the handle, the streams and the engine thread.
struct Shared {
    pending: AtomicUsize,
    accepting: AtomicBool,
    alive: AtomicBool,
    stats: Mutex<EngineStats>,
    /// Cancellation flags of the requests in flight, by id.
    cancels: Mutex<HashMap<u64, Arc<AtomicBool>>>,
    /// Steps profiled and not yet taken (with [`EngineConfig::profile_steps`]).
    profile: Mutex<Vec<StepTiming>>,
}

impl Shared {
    /// Publishes `batch`'s state for [`Engine::stats`].
    fn publish<B: Backend>(&self, batch: &PersistentBatch<B>) {
        *self.stats.lock().unwrap_or_else(PoisonError::into_inner) = EngineStats {
            batch: batch.stats(),
            ..EngineStats::default()
        };
    }

    fn stats(&self) -> EngineStats {
        let mut stats = self
            .stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        stats.pending = self.pending.load(Ordering::Relaxed);
        stats.alive = self.alive.load(Ordering::Relaxed);
        stats
    }
}

/// The engine: a model on a device with its persistent batch, stepped on a thread of its own.
/// Cheap to share behind an `Arc`; every method takes `&self`.
pub struct Engine {
    commands: Mutex<Sender<Command>>,
    shared: Arc<Shared>,
    info: EngineInfo,
    tokenizer: TextTokenizer,
    /// The chat template, or why it does not compile (raw completions still work).
    template: Result<ChatTemplate, String>,
    next_id: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Engine {
    /// Loads the model and starts the engine thread; returns once the model is on the device
    /// and the KV cache is made (or why it could not be).
    pub fn start(config: EngineConfig) -> Result<Engine, EngineError> {
        use crate::limits::{check_positive, MAX_BATCH, MAX_BATCHED_TOKENS};
        check_positive("the batch size", config.max_batch, MAX_BATCH)?;
        check_positive(
            "the tokens per step",
            config.max_batched_tokens.max(1),
            MAX_BATCHED_TOKENS,
        )?;
        check_positive(
            "the prefill chunk",
            config.prefill_chunk,
            MAX_BATCHED_TOKENS,
        )?;
        check_positive("the queue bound", config.max_pending, usize::MAX)?;
        config.model.validate()?;
        let shared = Arc::new(Shared {
            pending: AtomicUsize::new(0),
            accepting: AtomicBool::new(true),
            alive: AtomicBool::new(true),
            stats: Mutex::new(EngineStats::default()),
            cancels: Mutex::new(HashMap::new()),
            profile: Mutex::new(Vec::new()),
        });
        let (commands, inbox) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let task = EngineThread {
            config: config.clone(),
            inbox,
            ready: ready_tx,
            shared: shared.clone(),
        };
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("turbo-engine".into())
            .spawn(move || {
                let model = task.config.model.clone();
                let ready = task.ready.clone();
                // Loading errors go to `start`; a task that ran reported through `ready` itself.
                if let Err(e) = model.run(task) {
                    let _ = ready.send(Err(e));
                }
                thread_shared.alive.store(false, Ordering::Relaxed);
            })
            .map_err(|e| EngineError::Config(format!("cannot start the engine thread: {e}")))?;
        let (info, tokenizer, template) = match ready_rx.recv() {
            Ok(Ok(ready)) => ready,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(EngineError::Stopped);
            }
        };
        Ok(Engine {
            commands: Mutex::new(commands),
            shared,
            info,
            tokenizer,
            template,
            next_id: AtomicU64::new(0),
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// The model's chat template, or why it does not compile.
    pub fn template(&self) -> Result<&ChatTemplate, EngineError> {
        self.template
            .as_ref()
            .map_err(|e| EngineError::Template(e.clone()))
    }

    /// A conversation as the prompt tokens the model was trained on: rendered with its chat
    /// template, ending with the assistant's turn opened. Special tokens' texts in the messages
    /// stay text: only the template's markup makes special tokens. Messages longer in all than
    /// any prompt the context holds are refused before rendering.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, EngineError> {
        let bytes = messages
            .iter()
            .map(|m| m.content.len() as u64)
            .fold(0u64, u64::saturating_add);
        self.check_prompt_bytes(bytes)?;
        // A message longer than a rendered value may be is far past any context this engine
        // serves: say so, rather than that the template refused it.
        let max = turbo_tokenizer::MAX_RENDERED_ITEMS;
        // (Characters are counted only where the bytes alone exceed the bound.)
        if messages
            .iter()
            .any(|m| m.content.len() > max && m.content.chars().count() > max)
        {
            return Err(EngineError::PromptTextTooLong {
                bytes,
                limit: turbo_tokenizer::MAX_RENDERED_ITEMS as u64,
                context: self.info.context_length,
            });
        }
        self.check_prompt_tokens(messages.iter().map(|m| m.content.as_str()))?;
        Ok(self.template()?.encode(&self.tokenizer, messages, true)?)
    }

    /// Raw text as prompt tokens, with the BOS token when the model wants one. Text longer
    /// than any prompt the context holds is refused before tokenizing.
    pub fn text_prompt(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.check_prompt_bytes(text.len() as u64)?;
        self.check_prompt_tokens(std::iter::once(text))?;
        Ok(self.tokenizer.encode_with_bos(text)?)
    }

    /// Refuses long text whose tokens are sure to pass the context, counting them a piece at a
    /// time ([`COUNTED_IN_PIECES_ABOVE`]): tokenizing costs the tokenizer hundreds of bytes of
    /// memory per byte of text, so a few MB of prompt would take GBs to be refused afterwards.
    fn check_prompt_tokens<'a>(
        &self,
        texts: impl Iterator<Item = &'a str> + Clone,
    ) -> Result<(), EngineError> {
        let total: usize = texts.clone().map(str::len).sum();
        if total <= COUNTED_IN_PIECES_ABOVE {
            return Ok(());
        }
        let context = self.info.context_length;
        let (mut tokens, mut pieces) = (0usize, 0usize);
        for piece in texts.flat_map(|t| text_pieces(t, COUNTED_IN_PIECES_ABOVE)) {
            tokens += self.tokenizer.encode(piece)?.len();
            pieces += 1;
            // Each cut may have added a few tokens that the whole text would not have.
            let at_least = tokens.saturating_sub(PIECE_BOUNDARY_TOKENS * pieces);
            if at_least > context {
                return Err(EngineError::PromptTooManyTokens { at_least, context });
            }
        }
        Ok(())
    }

    /// Refuses prompt text of `bytes` bytes when it cannot fit the context.
    pub fn check_prompt_bytes(&self, bytes: u64) -> Result<(), EngineError> {
        let limit = self.info.max_prompt_bytes;
        if bytes > limit {
            return Err(EngineError::PromptTextTooLong {
                bytes,
                limit,
                context: self.info.context_length,
            });
        }
        Ok(())
    }

    pub fn stats(&self) -> EngineStats {
        self.shared.stats()
    }

    /// The steps timed since the last call, oldest first, when the engine was started with
    /// [`EngineConfig::profile_steps`] (empty otherwise).
    pub fn take_step_profile(&self) -> Vec<StepTiming> {
        std::mem::take(
            &mut *self
                .shared
                .profile
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// Queues a request; its events arrive on the returned stream. Refused at once when it can
    /// never run, when the engine is at capacity, or when it is shutting down.
    pub fn submit(&self, request: Request) -> Result<RequestStream, SubmitError> {
        request.validate(&self.info.limits)?;
        if !self.shared.accepting.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        if !self.shared.alive.load(Ordering::Relaxed) {
            return Err(SubmitError::Stopped);
        }
        let max = self.info.max_pending;
        let taken = self
            .shared
            .pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            });
        if taken.is_err() {
            return Err(SubmitError::QueueFull(max));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let cancelled = Arc::new(AtomicBool::new(false));
        self.shared
            .cancels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, cancelled.clone());
        let (tx, rx) = unbounded_channel();
        let sink = StreamSink {
            tx,
            cancelled: cancelled.clone(),
            _flight: InFlight {
                id,
                shared: self.shared.clone(),
            },
        };
        if !self.send(Command::Submit(Box::new(request), Box::new(sink))) {
            return Err(SubmitError::Stopped);
        }
        Ok(RequestStream {
            id,
            events: rx,
            cancelled,
        })
    }

    /// Ends a request by the id of its stream: it finishes as cancelled and its KV is freed at
    /// the engine's next step. False if it has already ended.
    pub fn cancel(&self, id: u64) -> bool {
        let cancels = self
            .shared
            .cancels
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match cancels.get(&id) {
            Some(flag) => !flag.swap(true, Ordering::AcqRel),
            None => false,
        }
    }

    /// Forgets a session and frees its KV; false if it is unknown or a request of it is in the
    /// engine. Blocks until the engine thread has answered.
    pub fn end_session(&self, session: &str) -> bool {
        let (tx, rx) = mpsc::sync_channel(1);
        if !self.send(Command::EndSession(session.to_string(), tx)) {
            return false;
        }
        rx.recv().unwrap_or(false)
    }

    /// Stops accepting requests, lets the running and queued ones finish until `deadline`,
    /// cancels whatever is left then, and waits for the engine thread to end.
    pub fn shutdown(&self, deadline: Duration) {
        self.drain(deadline);
        self.join();
    }

    /// Stops accepting requests and has the engine thread end once the running and queued ones
    /// have finished, or `deadline` from now, when it cancels the rest. Does not wait.
    pub fn drain(&self, deadline: Duration) {
        self.shared.accepting.store(false, Ordering::Release);
        self.send(Command::Drain(Instant::now() + deadline));
    }

    /// Waits for the engine thread to end (after [`drain`](Self::drain)).
    pub fn join(&self) {
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(thread) = thread {
            if thread.join().is_err() {
                tracing::error!("the engine thread panicked");
            }
        }
    }

    /// Hands `command` to the engine thread; false if the thread has ended.
    fn send(&self, command: Command) -> bool {
        self.commands
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(command)
            .is_ok()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown(Duration::ZERO);
    }
}

/// A request's events, in order: [`Event::Token`] and [`Event::Text`] as they are generated,
/// then one [`Event::Finished`] or [`Event::Failed`]. Dropping the stream cancels the request.
pub struct RequestStream {
    id: u64,
    events: UnboundedReceiver<Event>,
    cancelled: Arc<AtomicBool>,
}

impl RequestStream {
    /// The id [`Engine::cancel`] takes.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The next event; `None` once the request has ended (after its terminal event) or the
    /// engine stopped.
    pub async fn next(&mut self) -> Option<Event> {
        self.events.recv().await
    }

    /// [`next`](Self::next) for threads outside an async runtime.
    pub fn blocking_next(&mut self) -> Option<Event> {
        self.events.blocking_recv()
    }

    /// Waits for the outcome, skipping the streamed events (outside an async runtime).
    pub fn wait(mut self) -> Result<Completion, RequestError> {
        while let Some(event) = self.blocking_next() {
            match event {
                Event::Finished(c) => return Ok(c),
                Event::Failed(e) => return Err(e),
                Event::Logprobs(_) | Event::Token(_) | Event::Text(_) => {}
            }
        }
        Err(RequestError::Disconnected)
    }

    /// Ends the request at the engine's next step; it still sends its terminal event.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// The batch's end of a [`RequestStream`].
struct StreamSink {
    tx: UnboundedSender<Event>,
    cancelled: Arc<AtomicBool>,
    _flight: InFlight,
}

impl EventSink for StreamSink {
    fn send(&mut self, event: Event) -> bool {
        self.tx.send(event).is_ok()
    }

    fn is_connected(&self) -> bool {
        !self.cancelled.load(Ordering::Acquire) && !self.tx.is_closed()
    }
}

/// Counts a request as pending from submission until the batch lets go of its sink.
struct InFlight {
    id: u64,
    shared: Arc<Shared>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.shared.pending.fetch_sub(1, Ordering::AcqRel);
        self.shared
            .cancels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.id);
    }
}

type Ready = Result<(EngineInfo, TextTokenizer, Result<ChatTemplate, String>), EngineError>;

/// The engine thread's work, run on whichever backend the model loaded on.
struct EngineThread {
    config: EngineConfig,
    inbox: Receiver<Command>,
    ready: mpsc::SyncSender<Ready>,
    shared: Arc<Shared>,
}

impl ModelTask for EngineThread {
    type Output = ();

    fn run<B: Backend>(self, model: Llama<B>, tokenizer: TextTokenizer, info: LoadedModelInfo) {
        let EngineThread {
            config,
            inbox,
            ready,
            shared,
        } = self;
        let made = (|| {
            let template = info.template(&tokenizer).map_err(|e| {
                tracing::debug!("{e}: chat requests will fail");
                e.to_string()
            });
            let num_blocks = config.kv.num_blocks(&model, &info)?;
            let batch_config = BatchConfig {
                max_batch: config.max_batch,
                max_batched_tokens: config.max_batched_tokens.max(config.max_batch),
                block_size: info.block_size,
                num_blocks,
                prefill_chunk: config.prefill_chunk,
                prefix_caching: config.prefix_caching,
            };
            let engine_info = EngineInfo {
                model_id: model_id(&info.path),
                model_path: info.path.clone(),
                backend: model.backend().name(),
                context_length: info.context_length,
                vocab_size: info.vocab_size,
                block_size: info.block_size,
                num_blocks,
                kv_dtype: model.kv_dtype(),
                kv_storage: model
                    .kv_dtype()
                    .storage_name(model.backend().kv_element_bytes()),
                max_batch: config.max_batch,
                max_pending: config.max_pending,
                limits: RequestLimits {
                    context: info.context_length,
                    vocab: info.vocab_size,
                    block_size: info.block_size,
                    num_blocks,
                },
                max_prompt_bytes: max_prompt_bytes(&tokenizer, info.context_length),
                max_bytes_per_token: max_bytes_per_token(&tokenizer),
            };
            let mut batch = PersistentBatch::new(model, tokenizer.clone(), batch_config)?;
            batch.set_overlap(batch.overlaps() && config.model.overlap_steps);
            if config.warm_up && batch.model().backend().first_steps_cost_more() {
                let started = Instant::now();
                let done = batch
                    .warm_up(config.max_batch, config.max_batched_tokens)
                    .map_err(|e| EngineError::WarmUp(e.to_string()))?;
                tracing::info!(
                    "warmed up in {:.2} s: {} steps, prefill up to {} tokens, decode up to {} rows",
                    started.elapsed().as_secs_f64(),
                    done.steps,
                    done.prefill_tokens,
                    done.decode_rows
                );
            }
            batch.set_step_profile(config.profile_steps);
            Ok::<_, EngineError>((batch, (engine_info, tokenizer, template)))
        })();
        let mut batch = match made {
            Ok((batch, handle_parts)) => {
                // The cache's size and free blocks are known before the first request.
                shared.publish(&batch);
                if ready.send(Ok(handle_parts)).is_err() {
                    return;
                }
                batch
            }
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        serve(&mut batch, &inbox, &shared);
        // Whatever is left (an engine dropped with work in it) ends as cancelled.
        if let Err(e) = batch.cancel_all() {
            tracing::error!("cancelling the requests left at shutdown: {e}");
        }
    }
}

/// The engine loop: take commands (sleeping while there is nothing to do), step, publish stats.
fn serve<B: Backend>(batch: &mut PersistentBatch<B>, inbox: &Receiver<Command>, shared: &Shared) {
    let mut deadline: Option<Instant> = None;
    loop {
        if batch.is_idle() {
            if deadline.is_some() {
                return;
            }
            match inbox.recv() {
                Ok(command) => apply(batch, command, &mut deadline),
                Err(_) => return, // the handle is gone
            }
        }
        while let Ok(command) = inbox.try_recv() {
            apply(batch, command, &mut deadline);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return;
        }
        if !batch.is_idle() {
            if let Err(e) = batch.step() {
                // The step's requests have failed with this error; the others go on.
                tracing::error!("step failed: {e}");
            }
        }
        shared.publish(batch);
        let steps = batch.take_step_profile();
        if !steps.is_empty() {
            let mut profile = shared
                .profile
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let room = MAX_PROFILED_STEPS.saturating_sub(profile.len());
            profile.extend(steps.into_iter().take(room));
        }
    }
}

fn apply<B: Backend>(
    batch: &mut PersistentBatch<B>,
    command: Command,
    deadline: &mut Option<Instant>,
) {
    match command {
        Command::Submit(request, sink) => {
            batch.submit_to(*request, sink);
        }
        Command::EndSession(name, reply) => {
            let ended = batch.end_session(&name).unwrap_or_else(|e| {
                tracing::error!("ending session {name}: {e}");
                false
            });
            let _ = reply.send(ended);
        }
        Command::Drain(at) => *deadline = Some(deadline.map_or(at, |d| d.min(at))),
    }
}

/// A model's name for clients: the file or directory name, without a `.gguf` extension.
fn model_id(path: &std::path::Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    name.strip_suffix(".gguf")
        .map(str::to_string)
        .unwrap_or(name)
}

/// Prompt text longer than this (bytes) is counted a piece of this size at a time before it is
/// tokenized whole ([`Engine::check_prompt_tokens`]).
const COUNTED_IN_PIECES_ABOVE: usize = 64 << 10;
/// The most tokens that cutting text between two pieces may add: the cut splits at most the
/// tokens of one word (usually it falls before a space, where the pre-tokenizer splits too).
const PIECE_BOUNDARY_TOKENS: usize = 8;

/// `text` in consecutive pieces of at most `size` bytes (one char more where a char is longer),
/// each cut just before a whitespace character where the piece has one.
fn text_pieces(text: &str, size: usize) -> impl Iterator<Item = &str> + '_ {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut end = rest.len().min(size);
        while !rest.is_char_boundary(end) {
            end += 1;
        }
        if end < rest.len() {
            if let Some(cut) = rest[..end].rfind(char::is_whitespace).filter(|&c| c > 0) {
                end = cut;
            }
        }
        let (piece, tail) = rest.split_at(end);
        rest = tail;
        Some(piece)
    })
}

/// Longest prompt text that can still fit a context of `context` tokens: no token stands for
/// more than the longest token's bytes, with a factor of 4 for normalizers that shrink text
/// (NFKC folding, dropped characters), capped at [`crate::limits::MAX_PROMPT_BYTES`].
fn max_prompt_bytes(tokenizer: &TextTokenizer, context: usize) -> u64 {
    (context as u64)
        .saturating_mul(max_bytes_per_token(tokenizer))
        .min(crate::limits::MAX_PROMPT_BYTES)
}

/// Four times the longest token's bytes (see [`max_prompt_bytes`]).
fn max_bytes_per_token(tokenizer: &TextTokenizer) -> u64 {
    let longest = (0..tokenizer.vocab_size() as u32)
        .filter_map(|id| tokenizer.token_bytes(id).ok())
        .map(|b| b.len() as u64)
        .max()
        .unwrap_or(1)
        .max(1);
    longest.saturating_mul(4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_pieces_cover_the_text_and_cut_before_whitespace() {
        let text = "héllo wörld, a b  c\n".repeat(1000) + &"x".repeat(300);
        for size in [1, 7, 64, 1000, 1 << 20] {
            let pieces: Vec<&str> = text_pieces(&text, size).collect();
            assert_eq!(pieces.concat(), text, "size {size}");
            // A piece passes the size only to end on a char boundary.
            assert!(pieces.iter().all(|p| !p.is_empty() && p.len() < size + 4));
        }
        // Where a piece holds whitespace, the next one starts at it (the run of x's at the end
        // has none, and is cut where the size says).
        let pieces: Vec<&str> = text_pieces(&text, 64).collect();
        let spaced = &pieces[1..pieces.len() - 5];
        assert!(
            spaced.iter().all(|p| p.starts_with(char::is_whitespace)),
            "{spaced:?}"
        );
    }
}
