//! The request bodies of the OpenAI API that Turbo serves, and their translation into engine
//! requests. Fields a client may send that do not change the output here (`user`, `metadata`,
//! `store`, ...) are ignored; fields that would change it and are not supported are refused with
//! a 400 rather than silently ignored.

use crate::error::ApiError;
use serde::Deserialize;
use serde_json::Value;
use turbo_engine::{ChatMessage, SamplingParams, MAX_TOP_LOGPROBS};

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The completions `prompt`: text, texts, token ids, or lists of token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// A boolean that may be given as `null` (OpenAI's API documents `stream` and its neighbours as
/// "boolean or null"): null is false.
fn false_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default, deserialize_with = "false_if_null")]
    pub include_usage: bool,
}

/// The parameters both endpoints share.
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<i64>,
    #[serde(default, deserialize_with = "false_if_null")]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    #[serde(default, deserialize_with = "false_if_null")]
    pub ignore_eos: bool,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Turbo's extension: a conversation whose KV stays resident between its requests.
    pub session: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: Common,
    pub logprobs: Option<Value>,
    pub echo: Option<bool>,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    #[serde(flatten)]
    pub common: Common,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub response_format: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

/// A message's content: text, or a list of parts of which Turbo takes text parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// What a request asks for once its parameters are checked: the sampling of each choice and
/// how long each may run.
#[derive(Clone, Debug)]
pub struct Generation {
    pub sampling: SamplingParams,
    /// `None`: until the end of the context.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub n: usize,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
    pub session: Option<String>,
    /// Whether `seed` was given: without one each choice draws a fresh seed.
    pub seeded: bool,
    /// Report log-probabilities, with this many alternatives per token.
    pub logprobs: Option<usize>,
}

/// Most choices one request may ask for.
pub const MAX_N: usize = 16;
/// Most stop strings.
pub const MAX_STOP: usize = 16;

fn positive(value: Option<i64>, name: &'static str) -> Result<Option<usize>, ApiError> {
    match value {
        None => Ok(None),
        Some(v) if v >= 1 => Ok(Some(usize::try_from(v).unwrap_or(usize::MAX))),
        Some(v) => {
            Err(ApiError::invalid(format!("{name} must be at least 1, got {v}")).param(name))
        }
    }
}

/// A count of alternatives per token, 0 to [`MAX_TOP_LOGPROBS`].
fn top_logprobs(n: i64, name: &'static str) -> Result<usize, ApiError> {
    usize::try_from(n)
        .ok()
        .filter(|&n| n <= MAX_TOP_LOGPROBS)
        .ok_or_else(|| {
            ApiError::invalid(format!("{name} must be in 0..={MAX_TOP_LOGPROBS}, got {n}"))
                .param(name)
        })
}

fn unsupported(name: &'static str, what: &str) -> ApiError {
    ApiError::invalid(format!("{name} is not supported: {what}")).param(name)
}

impl Common {
    /// Checks the shared parameters; `max_tokens` is the endpoint's own field when it has a
    /// newer name for it.
    pub fn generation(&self, max_tokens: Option<i64>) -> Result<Generation, ApiError> {
        let max_tokens = positive(max_tokens.or(self.max_tokens), "max_tokens")?;
        let n = positive(self.n, "n")?.unwrap_or(1);
        if n > MAX_N {
            return Err(
                ApiError::invalid(format!("n must be at most {MAX_N}, got {n}")).param("n"),
            );
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(ApiError::invalid(format!(
                "temperature must be a number >= 0, got {temperature}"
            ))
            .param("temperature"));
        }
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
            Some(k) => {
                return Err(ApiError::invalid(format!(
                    "top_k must be -1 (disabled) or positive, got {k}"
                ))
                .param("top_k"))
            }
        };
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return Err(unsupported("logit_bias", "no per-token biases"));
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP {
            return Err(
                ApiError::invalid(format!("at most {MAX_STOP} stop strings")).param("stop"),
            );
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop strings must not be empty").param("stop"));
        }
        let sampling = SamplingParams {
            temperature,
            top_k,
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            // Seeds are 64-bit; a negative one is taken as its two's complement.
            seed: self.seed.unwrap_or(0) as u64,
        };
        sampling
            .validate()
            .map_err(|e| ApiError::invalid(format!("invalid sampling parameters: {e}")))?;
        // Options that ask for something of a stream, on a request that is not streamed (empty
        // or all-null options, as some clients always send, are not a contradiction).
        if self
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
            && !self.stream
        {
            return Err(ApiError::invalid(
                "stream_options.include_usage is only allowed when stream is true",
            )
            .param("stream_options"));
        }
        if self.session.as_ref().is_some_and(|_| n > 1) {
            return Err(
                ApiError::invalid("a session runs one choice at a time: n must be 1")
                    .param("session"),
            );
        }
        Ok(Generation {
            sampling,
            max_tokens,
            stop,
            n,
            ignore_eos: self.ignore_eos,
            stream: self.stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            session: self.session.clone(),
            seeded: self.seed.is_some(),
            logprobs: None,
        })
    }
}

impl CompletionRequest {
    /// The checked parameters; a completion defaults to 16 tokens, as OpenAI's does.
    pub fn generation(&self) -> Result<Generation, ApiError> {
        if self.echo == Some(true) {
            return Err(unsupported("echo", "the prompt is not repeated"));
        }
        match self.best_of {
            Some(b) if b > 1 => return Err(unsupported("best_of", "use n")),
            Some(b) if b < 1 => {
                return Err(
                    ApiError::invalid(format!("best_of must be at least 1, got {b}"))
                        .param("best_of"),
                )
            }
            _ => {}
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(unsupported("suffix", "no fill-in-the-middle"));
        }
        let logprobs = match &self.logprobs {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_i64()
                    .ok_or_else(|| {
                        ApiError::invalid(format!("logprobs must be an integer, got {v}"))
                            .param("logprobs")
                    })
                    .and_then(|n| top_logprobs(n, "logprobs"))?,
            ),
        };
        let mut g = self.common.generation(None)?;
        g.max_tokens = Some(g.max_tokens.unwrap_or(16));
        g.logprobs = logprobs;
        Ok(g)
    }
}

impl ChatRequest {
    /// The checked parameters; a chat completion runs to the end of the context by default.
    pub fn generation(&self) -> Result<Generation, ApiError> {
        let logprobs = match (self.logprobs, self.top_logprobs) {
            (Some(true), top) => Some(top_logprobs(top.unwrap_or(0), "top_logprobs")?),
            (_, Some(n)) if n != 0 => {
                return Err(ApiError::invalid("top_logprobs needs logprobs set to true")
                    .param("top_logprobs"))
            }
            _ => None,
        };
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(unsupported("tools", "no tool calls"));
        }
        if let Some(format) = &self.response_format {
            if format.get("type").and_then(Value::as_str) != Some("text") {
                return Err(unsupported("response_format", "only text"));
            }
        }
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages must not be empty").param("messages"));
        }
        let mut g = self.common.generation(self.max_completion_tokens)?;
        g.logprobs = logprobs;
        Ok(g)
    }

    /// The conversation as the chat template takes it.
    pub fn messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                // OpenAI's roles; only an assistant's message may come without content (it then
                // held tool calls, which are not supported here anyway).
                if !KNOWN_ROLES.contains(&m.role.as_str()) {
                    return Err(ApiError::invalid(format!(
                        "messages[{i}].role '{}' is not one of {}",
                        m.role,
                        KNOWN_ROLES.join(", ")
                    ))
                    .param("messages"));
                }
                let content = match &m.content {
                    None if m.role == "assistant" => String::new(),
                    None => {
                        return Err(ApiError::invalid(format!(
                            "messages[{i}].content is required for role '{}'",
                            m.role
                        ))
                        .param("messages"))
                    }
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => {
                        let mut text = String::new();
                        for part in parts {
                            match (part.kind.as_str(), &part.text) {
                                ("text", Some(t)) => text.push_str(t),
                                ("text", None) => {
                                    return Err(ApiError::invalid(format!(
                                        "messages[{i}]: a content part of type 'text' needs \
                                         its 'text'"
                                    ))
                                    .param("messages"))
                                }
                                (kind, _) => {
                                    return Err(ApiError::invalid(format!(
                                        "message content of type '{kind}' is not supported: \
                                         only text"
                                    ))
                                    .param("messages"))
                                }
                            }
                        }
                        text
                    }
                };
                Ok(ChatMessage::new(m.role.clone(), content))
            })
            .collect()
    }
}

/// Message roles a chat request may use (OpenAI's; `developer` is its newer name for `system`).
const KNOWN_ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];
