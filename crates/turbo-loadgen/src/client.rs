//! One streamed completion request, timed event by event.

use crate::workload::Request;
use crate::{LoadgenConfig, LoadgenError};
use reqwest::{Client, Url};
use serde_json::{json, Value};
use std::time::Duration;
use tokio::time::Instant;

/// What happened to one request.
#[derive(Debug, Clone, Default)]
pub struct RequestResult {
    /// Why the request failed; `None` when it completed.
    pub error: Option<String>,
    /// From sending the request to the first event carrying text.
    pub ttft: Option<Duration>,
    /// Gaps between successive text-carrying events.
    pub itl: Vec<Duration>,
    /// From sending the request to the end of its stream (or its failure).
    pub latency: Duration,
    pub text: String,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// False when the server sent no usage chunk: then `output_tokens` counts text events and
    /// `prompt_tokens` whitespace-separated words, both estimates.
    pub usage_reported: bool,
}

impl RequestResult {
    pub(crate) fn failed(error: String, latency: Duration) -> Self {
        RequestResult {
            error: Some(error),
            latency,
            ..Default::default()
        }
    }
}

/// The server and the request options shared by all requests of a run.
pub(crate) struct Target {
    client: Client,
    endpoint: Url,
    model: String,
    api_key: Option<String>,
    ignore_eos: bool,
    timeout: Option<Duration>,
}

impl Target {
    pub(crate) fn new(config: &LoadgenConfig) -> Result<Self, LoadgenError> {
        let bad = |reason: &str| LoadgenError::BadUrl {
            url: config.url.clone(),
            reason: reason.to_string(),
        };
        let base = config.url.trim_end_matches('/');
        let parsed = Url::parse(base).map_err(|e| bad(&e.to_string()))?;
        if parsed.scheme() != "http" {
            return Err(bad("only http:// is supported (this build has no TLS)"));
        }
        let endpoint = parsed
            .join(&format!(
                "{}/v1/completions",
                parsed.path().trim_end_matches('/')
            ))
            .map_err(|e| bad(&e.to_string()))?;
        // A benchmark measures the server, not whatever proxy the environment names.
        let client = Client::builder()
            .no_proxy()
            .build()
            .map_err(|e| LoadgenError::Client(error_chain(&e)))?;
        Ok(Target {
            client,
            endpoint,
            model: config.model.clone(),
            api_key: config.api_key.clone(),
            ignore_eos: config.ignore_eos,
            timeout: config.timeout,
        })
    }

    pub(crate) async fn send(&self, request: &Request) -> RequestResult {
        let start = Instant::now();
        let mut result = RequestResult::default();
        let outcome = match self.timeout {
            Some(t) => {
                match tokio::time::timeout(t, self.stream(request, start, &mut result)).await {
                    Ok(outcome) => outcome,
                    Err(_) => Err(format!("timed out after {:.1} s", t.as_secs_f64())),
                }
            }
            None => self.stream(request, start, &mut result).await,
        };
        result.latency = start.elapsed();
        if let Err(e) = outcome {
            return RequestResult::failed(e, result.latency);
        }
        if !result.usage_reported {
            result.output_tokens = result.itl.len() + usize::from(result.ttft.is_some());
            result.prompt_tokens = request.prompt.split_whitespace().count();
        }
        result
    }

    async fn stream(
        &self,
        request: &Request,
        start: Instant,
        result: &mut RequestResult,
    ) -> Result<(), String> {
        let mut body = json!({
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": self.ignore_eos,
        });
        // An empty name leaves the choice to the server (which serves one model).
        if !self.model.is_empty() {
            body["model"] = json!(self.model);
        }
        let mut post = self.client.post(self.endpoint.clone()).json(&body);
        if let Some(key) = &self.api_key {
            post = post.bearer_auth(key);
        }
        let mut response = post.send().await.map_err(|e| error_chain(&e))?;
        let status = response.status();
        if !status.is_success() {
            let text = response.text().await.unwrap_or_default();
            return Err(format!("HTTP {status}: {}", truncate(text.trim(), 200)));
        }
        let mut parser = SseParser::default();
        let mut last_text: Option<Instant> = None;
        let mut done = false;
        while !done {
            let chunk = response.chunk().await.map_err(|e| error_chain(&e))?;
            let now = Instant::now();
            let events = match &chunk {
                Some(bytes) => parser.push(bytes),
                None => parser.finish(),
            };
            for data in events {
                if data.trim() == "[DONE]" {
                    done = true;
                    break;
                }
                let event: Value = serde_json::from_str(&data)
                    .map_err(|e| format!("bad event {:?}: {e}", truncate(&data, 100)))?;
                if let Some(error) = event.get("error").filter(|e| !e.is_null()) {
                    let message = error.get("message").and_then(Value::as_str);
                    return Err(format!(
                        "server error: {}",
                        message.map_or(error.to_string(), str::to_string)
                    ));
                }
                let text = event.pointer("/choices/0/text").and_then(Value::as_str);
                if let Some(text) = text.filter(|t| !t.is_empty()) {
                    match last_text {
                        None => result.ttft = Some(now - start),
                        Some(last) => result.itl.push(now - last),
                    }
                    last_text = Some(now);
                    result.text.push_str(text);
                }
                let count = |key: &str| event.pointer(key).and_then(Value::as_u64);
                if let Some(n) = count("/usage/completion_tokens") {
                    result.output_tokens = n as usize;
                    result.prompt_tokens = count("/usage/prompt_tokens").unwrap_or(0) as usize;
                    result.usage_reported = true;
                }
            }
            if chunk.is_none() && !done {
                return Err("the stream ended without [DONE]".into());
            }
        }
        Ok(())
    }
}

/// An incremental server-sent-events parser: bytes in, the `data` of complete events out, however
/// the network splits them. Lines end in `\n`, `\r\n` or `\r`; comments (`:`) and fields other
/// than `data` are skipped.
#[derive(Default)]
pub(crate) struct SseParser {
    line: Vec<u8>,
    data: Option<String>,
    after_cr: bool,
}

impl SseParser {
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut events = Vec::new();
        for &b in bytes {
            let after_cr = std::mem::replace(&mut self.after_cr, b == b'\r');
            match b {
                b'\n' if after_cr => {}
                b'\n' | b'\r' => events.extend(self.end_line()),
                _ => self.line.push(b),
            }
        }
        events
    }

    /// The end of the stream: a last event without its blank line still counts.
    pub(crate) fn finish(&mut self) -> Vec<String> {
        let mut events: Vec<String> = self.end_line().into_iter().collect();
        events.extend(self.data.take());
        events
    }

    fn end_line(&mut self) -> Option<String> {
        let line = String::from_utf8_lossy(&self.line).into_owned();
        self.line.clear();
        if line.is_empty() {
            return self.data.take();
        }
        let (field, value) = line.split_once(':').unwrap_or((&line, ""));
        if field == "data" {
            let value = value.strip_prefix(' ').unwrap_or(value);
            match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => self.data = Some(value.to_string()),
            }
        }
        None
    }
}

fn truncate(s: &str, max: usize) -> &str {
    s.char_indices().nth(max).map_or(s, |(i, _)| &s[..i])
}

/// reqwest's own message ("error sending request") hides the cause, which is in its sources.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        message = format!("{message}: {s}");
        source = s.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_survive_any_split() {
        let stream = ": keep-alive\r\ndata: {\"a\":1}\r\n\r\nevent: x\ndata: b\ndata:c\n\n\
                      id: 3\rdata: é\r\rdata: [DONE]\n\n";
        let want = vec!["{\"a\":1}", "b\nc", "é", "[DONE]"];
        let bytes = stream.as_bytes();
        for cut in 0..=bytes.len() {
            for cut2 in cut..=bytes.len() {
                let mut p = SseParser::default();
                let mut got = p.push(&bytes[..cut]);
                got.extend(p.push(&bytes[cut..cut2]));
                got.extend(p.push(&bytes[cut2..]));
                got.extend(p.finish());
                assert_eq!(got, want, "cut at {cut}, {cut2}");
            }
        }
        let mut p = SseParser::default();
        assert!(p.push(b"data: [DONE]").is_empty());
        assert_eq!(p.finish(), vec!["[DONE]"]);
    }
}
