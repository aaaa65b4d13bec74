//! The two generation endpoints: a request becomes one engine request per choice (per prompt of
//! a completions batch), whose events are merged into one response, streamed or whole.

use crate::api::{ChatRequest, CompletionRequest, Generation, Prompt};
use crate::{read_body, unix_time, ApiError, AppState};
use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, BoxStream, SelectAll, StreamExt};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;
use turbo_engine::{Completion, Event, FinishReason, Request, RequestStream, TokenLogprobs};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
}

/// A request's identity in its responses.
struct Meta {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// Alternatives per token when the request reports log-probabilities.
    logprobs: Option<usize>,
    /// Prompt tokens, counted once per prompt.
    prompt_tokens: usize,
    arrived: Instant,
}

pub async fn completions(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let arrived = Instant::now();
    let result = async {
        let bytes = read_body(
            body,
            state.config.max_body_bytes,
            state.config.body_read_timeout,
        )
        .await?;
        let request: CompletionRequest = parse(&bytes)?;
        check_model(&state, request.common.model.as_deref())?;
        let generation = request.generation()?;
        let prompts = match request.prompt {
            Prompt::Text(t) => off_runtime(&state, move |s| Ok(vec![encode(s, &t)?])).await?,
            Prompt::Texts(ts) => {
                off_runtime(&state, move |s| ts.iter().map(|t| encode(s, t)).collect()).await?
            }
            Prompt::Tokens(ids) => vec![ids],
            Prompt::TokenLists(lists) => lists,
        };
        if prompts.is_empty() {
            return Err(ApiError::invalid("prompt must not be empty").param("prompt"));
        }
        run(&state, Kind::Text, prompts, generation, arrived).await
    }
    .await;
    respond(&state, result)
}

pub async fn chat_completions(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let arrived = Instant::now();
    let result = async {
        let bytes = read_body(
            body,
            state.config.max_body_bytes,
            state.config.body_read_timeout,
        )
        .await?;
        let request: ChatRequest = parse(&bytes)?;
        check_model(&state, request.common.model.as_deref())?;
        let generation = request.generation()?;
        let messages = request.messages()?;
        let prompt = off_runtime(&state, move |s| {
            s.engine
                .chat_prompt(&messages)
                .map_err(|e| prompt_error(e, "messages"))
        })
        .await?;
        run(&state, Kind::Chat, vec![prompt], generation, arrived).await
    }
    .await;
    respond(&state, result)
}

fn respond(state: &AppState, result: Result<Response, ApiError>) -> Response {
    result.unwrap_or_else(|e| {
        state.metrics.outcome("rejected");
        tracing::info!(status = e.status.as_u16(), "request refused: {}", e.message);
        e.into_response()
    })
}

/// Top-level request fields that a parse error can name as its `param`.
const FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "ignore_eos",
    "logit_bias",
    "session",
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "suffix",
    "tools",
    "response_format",
];

/// A parse error as the API reports it: the path of the bad value (when serde kept one) and
/// its top-level field as the `param`.
fn located(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let field = match e.path().iter().next() {
        Some(serde_path_to_error::Segment::Map { key }) => {
            FIELDS.iter().copied().find(|f| *f == key.as_str())
        }
        _ => None,
    };
    let at = match path.as_str() {
        "." | "" => String::new(),
        p => format!("at {p}: "),
    };
    let error = ApiError::invalid(format!(
        "the request body is not a valid request: {at}{}",
        e.into_inner()
    ));
    match field {
        Some(f) => error.param(f),
        None => error,
    }
}

/// The request body as `T`. An error gives the path of the bad value and names its top-level
/// field as the error's `param`. The shared sampling fields are flattened into each request,
/// where serde keeps no path: an error without one is looked for in them on their own.
fn parse<'a, T: serde::Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let has_path =
        |e: &serde_path_to_error::Error<serde_json::Error>| e.path().iter().next().is_some();
    let parsed = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        if has_path(&e) {
            return located(e);
        }
        let shared = serde_json::from_slice::<serde_json::Value>(bytes)
            .ok()
            .and_then(|body| serde_path_to_error::deserialize::<_, crate::api::Common>(body).err())
            .filter(has_path);
        located(shared.unwrap_or(e))
    })?;
    // Nothing but whitespace after the request.
    de.end()
        .map_err(|e| ApiError::invalid(format!("the request body is not a valid request: {e}")))?;
    Ok(parsed)
}

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != state.model_name => Err(ApiError::not_found(format!(
            "the model '{m}' does not exist; this server serves '{}'",
            state.model_name
        ))
        .param("model")
        .code("model_not_found")),
        _ => Ok(()),
    }
}

fn encode(state: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
    state
        .engine
        .text_prompt(text)
        .map_err(|e| prompt_error(e, "prompt"))
}

/// Why a prompt could not be made into tokens: text too long for the context says so in its
/// code, as a prompt of too many tokens does; anything else names the parameter.
fn prompt_error(e: turbo_engine::EngineError, param: &'static str) -> ApiError {
    match e {
        turbo_engine::EngineError::PromptTextTooLong { .. }
        | turbo_engine::EngineError::PromptTooManyTokens { .. } => {
            ApiError::invalid(e.to_string()).code("context_length_exceeded")
        }
        e => ApiError::invalid(e.to_string()).param(param),
    }
}

/// Runs `work` (rendering a chat template, tokenizing: CPU work that grows with the request)
/// on the blocking pool, so that the threads serving every connection stay free for others.
async fn off_runtime<T: Send + 'static>(
    state: &Arc<AppState>,
    work: impl FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let state = state.clone();
    tokio::task::spawn_blocking(move || work(&state))
        .await
        .map_err(|e| ApiError::internal(format!("preparing the prompt failed: {e}")))?
}

/// Submits one engine request per choice and answers with their merged events.
async fn run(
    state: &Arc<AppState>,
    kind: Kind,
    prompts: Vec<Vec<u32>>,
    g: Generation,
    arrived: Instant,
) -> Result<Response, ApiError> {
    let info = state.engine.info();
    let limits = info.limits;
    // More sequences than the engine ever holds at once could never all be admitted: a client
    // error, not a reason to retry.
    let sequences = prompts.len().saturating_mul(g.n);
    if sequences > info.max_pending {
        return Err(ApiError::invalid(format!(
            "this request asks for {sequences} sequences ({} prompts, n = {}); this server \
             takes at most {} at once",
            prompts.len(),
            g.n,
            info.max_pending
        ))
        .param(if g.n > 1 { "n" } else { "prompt" }));
    }
    if g.session.is_some() && sequences > 1 {
        return Err(ApiError::invalid(format!(
            "a session runs one sequence at a time: this request has {} prompts",
            prompts.len()
        ))
        .param("session"));
    }
    let mut streams = Vec::with_capacity(sequences);
    let base_seed = if g.seeded {
        g.sampling.seed
    } else {
        rand::random()
    };
    for (p, prompt) in prompts.iter().enumerate() {
        // Without max_tokens: to the end of the context, or of what the KV cache can hold.
        let room = (limits.num_blocks * limits.block_size + 1).saturating_sub(prompt.len());
        let max_tokens = g.max_tokens.unwrap_or(room.max(1));
        for j in 0..g.n {
            let mut sampling = g.sampling.clone();
            sampling.seed = base_seed.wrapping_add(j as u64);
            let request = Request {
                sampling,
                max_tokens,
                stop_strings: g.stop.clone(),
                ignore_eos: g.ignore_eos,
                session: g.session.clone(),
                logprobs: g.logprobs,
                // The queue's bound is the request's first sequence's: once that one is in, the
                // others of the request wait for slots as long as it takes (a request may fan
                // out wider than the batch).
                max_queue_wait: state.config.max_queue_wait.filter(|_| streams.is_empty()),
                ..Request::new(prompt.clone())
            };
            // An error drops the streams submitted so far, which cancels them.
            let stream = state.engine.submit(request)?;
            streams.push((p * g.n + j, stream));
        }
    }
    let meta = Meta {
        kind,
        id: format!(
            "{}-{:016x}",
            if kind == Kind::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            },
            rand::random::<u64>()
        ),
        created: unix_time(),
        model: state.model_name.clone(),
        include_usage: g.include_usage,
        logprobs: g.logprobs,
        prompt_tokens: prompts.iter().map(Vec::len).sum(),
        arrived,
    };
    let mut collector = Collector::new(state.clone(), meta, streams);
    if g.stream {
        if state.config.max_queue_wait.is_some() {
            // A request refused in the queue gets its status code, not a stream of one error.
            collector.first_event().await?;
        }
        let sse = stream::unfold(collector, |mut c| async move {
            c.next_sse().await.map(|e| (Ok::<_, Infallible>(e), c))
        });
        Ok(Sse::new(sse)
            .keep_alive(KeepAlive::default())
            .into_response())
    } else {
        collector.whole().await
    }
}

/// Per-choice progress, for the response and the latency metrics.
#[derive(Default)]
struct ChoiceState {
    text: String,
    last_token: Option<Instant>,
    completion: Option<Completion>,
    /// Every token's log-probabilities, when asked for; the first `streamed` were sent.
    logprobs: Vec<TokenLogprobs>,
    streamed: usize,
    /// Tokens generated so far, and whether the engine has ended the choice (finished or
    /// failed): a choice dropped before that was cancelled (its client went away).
    tokens: usize,
    ended: bool,
}

/// Choices still running when their response is dropped (the client went away, or another
/// choice failed) are cancelled by dropping their streams: they are counted as aborted, with
/// the tokens they had generated.
impl Drop for Collector {
    fn drop(&mut self) {
        let metrics = &self.state.metrics;
        for choice in self.choices.iter().filter(|c| !c.ended) {
            metrics.generation_tokens.inc_by(choice.tokens as u64);
            metrics.outcome("abort");
        }
    }
}

/// Merges the events of a request's choices and turns them into a response.
struct Collector {
    state: Arc<AppState>,
    meta: Meta,
    events: SelectAll<BoxStream<'static, (usize, Event)>>,
    choices: Vec<ChoiceState>,
    /// Server-sent events ready to go.
    queue: VecDeque<SseEvent>,
    failed: Option<ApiError>,
    done: bool,
}

impl Collector {
    fn new(state: Arc<AppState>, meta: Meta, streams: Vec<(usize, RequestStream)>) -> Self {
        let n = streams.len();
        let events = stream::select_all(streams.into_iter().map(|(i, s)| {
            stream::unfold(s, move |mut s| async move {
                s.next().await.map(|e| ((i, e), s))
            })
            .boxed()
        }));
        let mut c = Collector {
            state,
            meta,
            events,
            choices: (0..n).map(|_| ChoiceState::default()).collect(),
            queue: VecDeque::new(),
            failed: None,
            done: false,
        };
        if c.meta.kind == Kind::Chat {
            for i in 0..n {
                let chunk = c.chunk(i, json!({"role": "assistant", "content": ""}), None, None);
                c.queue.push_back(chunk);
            }
        }
        c
    }

    /// Records an event of choice `i`; returns the text it streams, if any.
    fn record(&mut self, i: usize, event: Event) -> Option<String> {
        let now = Instant::now();
        let metrics = &self.state.metrics;
        let choice = &mut self.choices[i];
        match event {
            Event::Logprobs(lp) => {
                choice.logprobs.push(lp);
                None
            }
            Event::Token(_) => {
                choice.tokens += 1;
                match choice.last_token {
                    None => metrics.ttft.observe(secs(self.meta.arrived, now)),
                    Some(last) => metrics.itl.observe(secs(last, now)),
                }
                choice.last_token = Some(now);
                None
            }
            Event::Text(delta) => {
                choice.text.push_str(&delta);
                Some(delta)
            }
            Event::Finished(c) => {
                metrics.e2e.observe(secs(self.meta.arrived, now));
                metrics.generation_tokens.inc_by(c.token_ids.len() as u64);
                metrics
                    .prompt_tokens
                    .inc_by((c.cached_prompt_tokens + c.prefilled_tokens) as u64);
                metrics
                    .cached_prompt_tokens
                    .inc_by(c.cached_prompt_tokens as u64);
                metrics.outcome(finish_reason(c.finish_reason));
                choice.ended = true;
                tracing::info!(
                    id = %self.meta.id,
                    choice = i,
                    prompt_tokens = c.cached_prompt_tokens + c.prefilled_tokens,
                    cached_tokens = c.cached_prompt_tokens,
                    completion_tokens = c.token_ids.len(),
                    ttft_ms = c.timings.prefill_ms,
                    e2e_ms = secs(self.meta.arrived, now) * 1e3,
                    finish = finish_reason(c.finish_reason),
                    "request finished"
                );
                // A request is cancelled while its client listens only when the server shuts
                // down (a client that leaves drops this collector first): it gets an error, not
                // a finish reason OpenAI's clients do not know.
                if c.finish_reason == FinishReason::Cancelled {
                    self.failed = Some(ApiError::cut_off_by_shutdown());
                }
                choice.completion = Some(c);
                None
            }
            Event::Failed(e) => {
                let overloaded = matches!(e, turbo_engine::RequestError::QueueTimeout { .. });
                metrics.outcome(if overloaded { "overloaded" } else { "error" });
                choice.ended = true;
                tracing::warn!(id = %self.meta.id, choice = i, "request failed: {e}");
                self.failed = Some(e.into());
                None
            }
        }
    }

    /// The whole response, once every choice has ended.
    async fn whole(mut self) -> Result<Response, ApiError> {
        while let Some((i, event)) = self.events.next().await {
            self.record(i, event);
            if let Some(e) = self.failed.take() {
                return Err(e);
            }
        }
        let mut choices = Vec::with_capacity(self.choices.len());
        for (i, c) in self.choices.iter().enumerate() {
            let Some(completion) = &c.completion else {
                return Err(
                    ApiError::internal("the engine stopped before the request ended")
                        .status(StatusCode::SERVICE_UNAVAILABLE),
                );
            };
            let reason = finish_reason(completion.finish_reason);
            let logprobs = self.render_logprobs(&c.logprobs, 0);
            choices.push(match self.meta.kind {
                Kind::Chat => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }),
                Kind::Text => json!({
                    "index": i,
                    "text": c.text,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }),
            });
        }
        let object = match self.meta.kind {
            Kind::Chat => "chat.completion",
            Kind::Text => "text_completion",
        };
        Ok(Json(json!({
            "id": self.meta.id,
            "object": object,
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
            "usage": self.usage(),
        }))
        .into_response())
    }

    /// The next server-sent event; `None` after `data: [DONE]`.
    async fn next_sse(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(e) = self.queue.pop_front() {
                return Some(e);
            }
            if self.done {
                return None;
            }
            let next = self.events.next().await;
            self.absorb(next);
        }
    }

    /// Waits for the first engine event; a failure before it is returned as the response's
    /// error instead of being streamed.
    async fn first_event(&mut self) -> Result<(), ApiError> {
        let next = self.events.next().await;
        if let Some((i, event @ Event::Failed(_))) = next {
            self.record(i, event);
            return Err(self.failed.take().expect("recorded above"));
        }
        self.absorb(next);
        Ok(())
    }

    /// Turns the next engine event (`None`: all choices ended) into server-sent events.
    fn absorb(&mut self, next: Option<(usize, Event)>) {
        match next {
            Some((i, event)) => {
                let finished = matches!(event, Event::Finished(_));
                if let Some(text) = self.record(i, event) {
                    let before = self.choices[i].text.len() - text.len();
                    let logprobs = self.unsent_logprobs(i, before);
                    let chunk = match self.meta.kind {
                        Kind::Chat => self.chunk(i, json!({"content": text}), None, logprobs),
                        Kind::Text => self.chunk(i, Value::String(text), None, logprobs),
                    };
                    self.queue.push_back(chunk);
                }
                let completion = self.choices[i].completion.as_ref();
                let cut_off =
                    completion.is_some_and(|c| c.finish_reason == FinishReason::Cancelled);
                if finished && !cut_off {
                    let reason = completion.map(|c| finish_reason(c.finish_reason));
                    let empty = match self.meta.kind {
                        Kind::Chat => json!({}),
                        Kind::Text => Value::String(String::new()),
                    };
                    let logprobs = self.unsent_logprobs(i, self.choices[i].text.len());
                    let chunk = self.chunk(i, empty, reason, logprobs);
                    self.queue.push_back(chunk);
                }
                if let Some(e) = self.failed.take() {
                    // The other choices are cancelled when the collector is dropped.
                    let json = serde_json::to_string(&e.body()).unwrap_or_default();
                    self.queue.push_back(SseEvent::default().data(json));
                    self.end();
                }
            }
            None => {
                if self.meta.include_usage {
                    let mut chunk = self.envelope();
                    chunk["choices"] = json!([]);
                    chunk["usage"] = self.usage();
                    self.queue
                        .push_back(SseEvent::default().data(chunk.to_string()));
                }
                self.end();
            }
        }
    }

    fn end(&mut self) {
        self.queue.push_back(SseEvent::default().data("[DONE]"));
        self.done = true;
        self.events = SelectAll::new();
    }

    fn envelope(&self) -> Value {
        let object = match self.meta.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Text => "text_completion",
        };
        json!({
            "id": self.meta.id,
            "object": object,
            "created": self.meta.created,
            "model": self.meta.model,
        })
    }

    /// A chunk of choice `i`: a chat `delta` object, or a completion's text, with the
    /// log-probabilities of the tokens it completes.
    fn chunk(
        &self,
        i: usize,
        content: Value,
        finish: Option<&str>,
        logprobs: Option<Value>,
    ) -> SseEvent {
        let logprobs = logprobs.unwrap_or(Value::Null);
        let choice = match self.meta.kind {
            Kind::Chat => json!({
                "index": i, "delta": content, "logprobs": logprobs, "finish_reason": finish,
            }),
            Kind::Text => json!({
                "index": i, "text": content, "logprobs": logprobs, "finish_reason": finish,
            }),
        };
        let mut chunk = self.envelope();
        chunk["choices"] = json!([choice]);
        if self.meta.include_usage {
            chunk["usage"] = Value::Null;
        }
        SseEvent::default().data(chunk.to_string())
    }

    /// The log-probabilities of choice `i` not streamed yet (`None` when it reports none), for a
    /// chunk whose text starts at byte `offset` of the choice's text.
    fn unsent_logprobs(&mut self, i: usize, offset: usize) -> Option<Value> {
        let choice = &self.choices[i];
        if self.meta.logprobs.is_none() || choice.streamed == choice.logprobs.len() {
            return None;
        }
        let entries = &choice.logprobs[choice.streamed..];
        let value = self.render_logprobs(entries, offset);
        self.choices[i].streamed = self.choices[i].logprobs.len();
        value
    }

    /// Log-probabilities in the endpoint's format (`None` when the request asked for none):
    /// chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`, or the completions API's
    /// parallel lists, whose `text_offset`s (byte offsets in the choice's text) start at
    /// `offset`.
    fn render_logprobs(&self, entries: &[TokenLogprobs], offset: usize) -> Option<Value> {
        self.meta.logprobs?;
        let tokenizer = self.state.engine.tokenizer();
        // A token's text (an incomplete UTF-8 character as U+FFFD), and its bytes.
        let token = |id: u32| {
            let bytes = tokenizer.token_bytes(id).unwrap_or_default();
            (String::from_utf8_lossy(&bytes).into_owned(), bytes)
        };
        Some(match self.meta.kind {
            Kind::Chat => {
                let entry = |id: u32, lp: f32| {
                    let (text, bytes) = token(id);
                    json!({"token": text, "logprob": finite(lp), "bytes": bytes})
                };
                let content: Vec<Value> = entries
                    .iter()
                    .map(|e| {
                        let mut value = entry(e.token, e.logprob);
                        value["top_logprobs"] = e.top.iter().map(|&(t, lp)| entry(t, lp)).collect();
                        value
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
            Kind::Text => {
                let mut at = offset;
                let (mut tokens, mut lps, mut tops, mut offsets) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                // The legacy format names tokens by their text: one that is not whole UTF-8
                // (a piece of a character) is `bytes:\xNN...`, as OpenAI writes it, so that
                // such tokens keep distinct names.
                let bytes_of = |id: u32| tokenizer.token_bytes(id).unwrap_or_default();
                for e in entries {
                    let bytes = bytes_of(e.token);
                    offsets.push(at);
                    at += bytes.len();
                    lps.push(finite(e.logprob));
                    // The sampled token is always listed, as OpenAI's legacy API does. Two
                    // tokens of the same name keep the likelier one's logprob (ranked first).
                    let mut top = serde_json::Map::new();
                    for &(id, lp) in &e.top {
                        top.entry(legacy_token_name(&bytes_of(id)))
                            .or_insert(finite(lp).into());
                    }
                    let text = legacy_token_name(&bytes);
                    top.entry(text.clone()).or_insert(finite(e.logprob).into());
                    tokens.push(text);
                    tops.push(Value::Object(top));
                }
                json!({
                    "tokens": tokens,
                    "token_logprobs": lps,
                    "top_logprobs": tops,
                    "text_offset": offsets,
                })
            }
        })
    }

    fn usage(&self) -> Value {
        let completion_tokens: usize = self
            .choices
            .iter()
            .filter_map(|c| c.completion.as_ref())
            .map(|c| c.token_ids.len())
            .sum();
        // The prompt tokens any one choice found cached (choices of one prompt share its blocks;
        // a completions batch of several prompts reports its best hit).
        let cached: usize = self
            .choices
            .iter()
            .filter_map(|c| c.completion.as_ref())
            .map(|c| c.cached_prompt_tokens)
            .max()
            .unwrap_or(0);
        json!({
            "prompt_tokens": self.meta.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.meta.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }
}

/// A log-probability JSON can carry: -inf (a token the penalties or the model ruled out) as
/// -9999, as OpenAI reports it.
fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        -9999.0
    }
}

fn secs(from: Instant, to: Instant) -> f64 {
    to.duration_since(from).as_secs_f64()
}

/// The finish reason a client sees (`Cancelled` only in logs and metrics, as `abort`: a client
/// still listening gets [`ApiError::cut_off_by_shutdown`] instead).
fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "abort",
    }
}

#[cfg(test)]
mod parse_tests {
    use super::*;
    use crate::api::{ChatRequest, CompletionRequest};

    fn error(body: &str, chat: bool) -> (String, Option<&'static str>) {
        let e = match chat {
            true => parse::<ChatRequest>(body.as_bytes()).err(),
            false => parse::<CompletionRequest>(body.as_bytes()).err(),
        }
        .expect("refused");
        (e.message, e.param)
    }

    #[test]
    fn errors_name_the_field_that_is_wrong() {
        let (m, p) = error(r#"{"prompt": 5}"#, false);
        assert!(m.contains("at prompt"), "{m}");
        assert_eq!(p, Some("prompt"));
        // The shared sampling fields too, though they are flattened into each request.
        let (m, p) = error(r#"{"prompt": "x", "max_tokens": 5.5}"#, false);
        assert!(m.contains("at max_tokens") && m.contains("5.5"), "{m}");
        assert_eq!(p, Some("max_tokens"));
        let (m, p) = error(
            r#"{"messages": [], "stream_options": {"include_usage": "yes"}}"#,
            true,
        );
        assert!(m.contains("at stream_options.include_usage"), "{m}");
        assert_eq!(p, Some("stream_options"));
        let (m, p) = error(r#"{"messages": [{"role": "user", "content": 5}]}"#, true);
        assert!(m.contains("messages[0]"), "{m}");
        assert_eq!(p, Some("messages"));
        let (m, _) = error(r#"{"prompt": "x"} {"prompt": "y"}"#, false);
        assert!(m.contains("trailing"), "{m}");
    }
}

/// A token's name in the completions API's logprobs: its text, or, where its bytes are not whole
/// UTF-8, `bytes:` and each byte as `\xNN` (OpenAI's form).
fn legacy_token_name(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => text.to_string(),
        Err(_) => {
            let mut name = String::from("bytes:");
            for b in bytes {
                name.push_str(&format!("\\x{b:02x}"));
            }
            name
        }
    }
}

#[cfg(test)]
mod tests {
    use super::legacy_token_name;

    #[test]
    fn tokens_that_are_not_whole_utf8_are_named_by_their_bytes() {
        assert_eq!(legacy_token_name(b" Paris"), " Paris");
        assert_eq!(legacy_token_name("é".as_bytes()), "é");
        assert_eq!(legacy_token_name(&[0xf0, 0x9f]), "bytes:\\xf0\\x9f");
        assert_ne!(legacy_token_name(&[0xf0]), legacy_token_name(&[0x9f]));
    }
}
