//! `turbo serve` over loopback on the real default model (SmolLM2-135M-Instruct, CPU): every
//! endpoint, streamed and whole, greedy output against the HF transformers golden file, errors,
//! a client that goes away, a full queue, the API key, and shutdown with a request running.

use futures_util::StreamExt;
use serde_json::{json, Value};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use turbo_engine::{Device, Engine, EngineConfig, KvSize, ModelOptions};
use turbo_server::ServerConfig;
use turbo_tests::default_model::default_model_path;

/// A server on 127.0.0.1 with its own runtime thread; shut down by dropping the sender.
struct Server {
    url: String,
    engine: Arc<Engine>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<std::sync::Mutex<std::sync::mpsc::Receiver<std::io::Result<()>>>>,
}

fn engine(max_batch: usize, max_pending: usize) -> Arc<Engine> {
    let model = ModelOptions {
        model: Some(default_model_path().to_path_buf()),
        device: Device::Cpu,
        threads: Some(2),
        progress: false,
        ..ModelOptions::default()
    };
    Arc::new(
        Engine::start(EngineConfig {
            kv: KvSize::Blocks(2048),
            max_batch,
            max_pending,
            ..EngineConfig::new(model)
        })
        .expect("the engine starts"),
    )
}

impl Server {
    fn start(engine: Arc<Engine>, config: ServerConfig) -> Server {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done) = std::sync::mpsc::channel();
        let served = engine.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            let result = rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                addr_tx.send(listener.local_addr()?).unwrap();
                let shutdown = async {
                    let _ = stop_rx.await;
                };
                turbo_server::serve(listener, served, config, shutdown).await
            });
            let _ = done_tx.send(result);
        });
        let addr = addr_rx.recv().expect("the server binds");
        Server {
            url: format!("http://{addr}"),
            engine,
            stop: Some(stop),
            done: Some(std::sync::Mutex::new(done)),
        }
    }

    /// Signals shutdown and waits (bounded) for `serve` to return.
    fn shutdown(&mut self, within: Duration) -> std::io::Result<()> {
        drop(self.stop.take());
        self.done
            .take()
            .unwrap()
            .into_inner()
            .unwrap()
            .recv_timeout(within)
            .expect("the server stops in time")
    }
}

/// One server shared by the tests that do not stop or saturate it (they run concurrently, as
/// real clients would).
fn shared() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| Server::start(engine(8, 64), ServerConfig::default()))
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Runtime::new().unwrap()
}

async fn post(url: &str, path: &str, body: Value) -> (u16, Value) {
    let r = client()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// The status and JSON body of `GET {url}{path}`.
async fn get(url: &str, path: &str) -> (u16, Value) {
    let r = client().get(format!("{url}{path}")).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// The body of `GET {url}{path}`.
async fn get_text(url: &str, path: &str) -> String {
    let r = client().get(format!("{url}{path}")).send().await.unwrap();
    r.text().await.unwrap()
}

/// Streams a request; returns the parsed `data:` payloads before `[DONE]` (panics if none came).
async fn stream(url: &str, path: &str, body: Value) -> Vec<Value> {
    let r = client()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let text = r.text().await.unwrap();
    let mut out = Vec::new();
    let mut done = false;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        assert!(!done, "nothing follows [DONE]");
        if data == "[DONE]" {
            done = true;
        } else {
            out.push(serde_json::from_str(data).unwrap());
        }
    }
    assert!(done, "the stream ends with [DONE]: {text}");
    out
}

/// Two log-probability entries (`token`, `bytes`, `logprob`, `top_logprobs`) that name the same
/// tokens with values within f32 rounding of each other.
fn assert_same_logprob(a: &Value, b: &Value) {
    let close = |x: &Value, y: &Value| {
        let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
    };
    assert_eq!(a["token"], b["token"]);
    assert_eq!(a["bytes"], b["bytes"]);
    close(&a["logprob"], &b["logprob"]);
    let (ta, tb) = (a["top_logprobs"].as_array(), b["top_logprobs"].as_array());
    let (Some(ta), Some(tb)) = (ta, tb) else {
        assert_eq!(a["top_logprobs"], b["top_logprobs"]);
        return;
    };
    assert_eq!(ta.len(), tb.len(), "{a} vs {b}");
    for (x, y) in ta.iter().zip(tb) {
        assert_eq!(
            (&x["token"], &x["bytes"]),
            (&y["token"], &y["bytes"]),
            "{a} vs {b}"
        );
        close(&x["logprob"], &y["logprob"]);
    }
}

fn error_of(body: &Value) -> &Value {
    let e = &body["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(e["type"].is_string(), "{body}");
    assert!(
        e.get("param").is_some() && e.get("code").is_some(),
        "{body}"
    );
    e
}

#[derive(serde::Deserialize)]
struct Golden {
    cases: Vec<GoldenCase>,
}

#[derive(serde::Deserialize)]
struct GoldenCase {
    name: String,
    chat: bool,
    prompt_token_ids: Vec<u32>,
    greedy_token_ids: Vec<u32>,
}

#[test]
fn greedy_completions_match_the_hf_golden_tokens() {
    let golden: Golden = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/golden/smollm2_greedy.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let server = shared();
    let tokenizer = server.engine.tokenizer();
    rt().block_on(async {
        for case in golden.cases.iter().filter(|c| !c.chat) {
            let want = tokenizer.decode(&case.greedy_token_ids).unwrap();
            let body = json!({
                "prompt": case.prompt_token_ids,
                "max_tokens": case.greedy_token_ids.len(),
                "temperature": 0,
                "ignore_eos": true,
            });
            let (status, r) = post(&server.url, "/v1/completions", body.clone()).await;
            assert_eq!(status, 200, "{r}");
            assert_eq!(r["object"], "text_completion");
            assert_eq!(r["choices"][0]["text"], want.as_str(), "case {}", case.name);
            assert_eq!(r["choices"][0]["finish_reason"], "length");
            assert_eq!(r["usage"]["completion_tokens"], case.greedy_token_ids.len());
            assert_eq!(r["usage"]["prompt_tokens"], case.prompt_token_ids.len());
            // The same request streamed gives the same text, in deltas.
            let mut streamed = body;
            streamed["stream"] = json!(true);
            let chunks = stream(&server.url, "/v1/completions", streamed).await;
            let text: String = chunks
                .iter()
                .map(|c| c["choices"][0]["text"].as_str().unwrap())
                .collect();
            assert_eq!(text, want, "case {} streamed", case.name);
            assert_eq!(
                chunks.last().unwrap()["choices"][0]["finish_reason"],
                "length"
            );
        }
    });
}

#[test]
fn chat_completions_whole_streamed_and_multi_round_cached() {
    let server = shared();
    rt().block_on(async {
        let first = json!({
            "model": server.engine.info().model_id,
            "messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
            "max_tokens": 24,
            "temperature": 0,
        });
        let (status, r) = post(&server.url, "/v1/chat/completions", first.clone()).await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["object"], "chat.completion");
        assert!(r["id"].as_str().unwrap().starts_with("chatcmpl-"));
        let reply = r["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(r["choices"][0]["message"]["role"], "assistant");
        assert!(!reply.is_empty());
        let usage = &r["usage"];
        assert_eq!(
            usage["total_tokens"],
            usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
        );

        // Streamed with usage: a role chunk, content deltas, a finish chunk, a usage chunk.
        let mut streamed = first.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let chunks = stream(&server.url, "/v1/chat/completions", streamed).await;
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, reply, "greedy: the same reply streamed");
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"], json!([]));
        assert_eq!(
            last["usage"]["completion_tokens"],
            usage["completion_tokens"]
        );
        assert!(chunks.iter().any(|c| c["choices"]
            .get(0)
            .is_some_and(|c| c["finish_reason"].is_string())));

        // Round two starts with round one's tokens: its KV is found in the cache.
        let second = json!({
            "messages": [
                {"role": "user", "content": "Name three colours of the rainbow."},
                {"role": "assistant", "content": reply},
                {"role": "user", "content": [{"type": "text", "text": "And two more?"}]},
            ],
            "max_tokens": 8,
            "temperature": 0,
        });
        let (status, r) = post(&server.url, "/v1/chat/completions", second).await;
        assert_eq!(status, 200, "{r}");
        let cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(cached >= 16, "round two reuses round one's KV: {r}");
    });
}

#[test]
fn n_choices_seeds_and_stop_strings() {
    let server = shared();
    rt().block_on(async {
        let body = json!({
            "prompt": "Once upon a time",
            "max_tokens": 12,
            "temperature": 1.0,
            "seed": 7,
            "n": 3,
        });
        let (status, a) = post(&server.url, "/v1/completions", body.clone()).await;
        assert_eq!(status, 200, "{a}");
        let texts = |r: &Value| -> Vec<String> {
            let choices = r["choices"].as_array().unwrap();
            assert_eq!(choices.len(), 3);
            for (i, c) in choices.iter().enumerate() {
                assert_eq!(c["index"], i);
            }
            choices
                .iter()
                .map(|c| c["text"].as_str().unwrap().to_string())
                .collect()
        };
        let (_, b) = post(&server.url, "/v1/completions", body).await;
        assert_eq!(texts(&a), texts(&b), "the same seed gives the same choices");
        let t = texts(&a);
        assert!(t[0] != t[1] || t[1] != t[2], "choices draw differently: {t:?}");

        // A stop string ends the text before it.
        let (_, greedy) = post(
            &server.url,
            "/v1/completions",
            json!({"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}),
        )
        .await;
        let full = greedy["choices"][0]["text"].as_str().unwrap().to_string();
        let stop: String = full.trim_start().chars().take(3).collect();
        let (_, stopped) = post(
            &server.url,
            "/v1/completions",
            json!({"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "stop": [stop]}),
        )
        .await;
        let text = stopped["choices"][0]["text"].as_str().unwrap();
        assert!(!text.contains(&stop), "{text:?} holds the stop string {stop:?}");
        assert!(full.starts_with(text));
        assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    });
}

/// Log-probabilities: greedy tokens are the most likely, alternatives are sorted and a
/// distribution's share, the streamed ones equal the whole ones, the token bytes spell the text.
#[test]
fn logprobs_whole_and_streamed() {
    let server = shared();
    rt().block_on(async {
        let body = json!({
            "messages": [{"role": "user", "content": "Count from one to five."}],
            "max_tokens": 10,
            "temperature": 0,
            "logprobs": true,
            "top_logprobs": 3,
        });
        let (status, r) = post(&server.url, "/v1/chat/completions", body.clone()).await;
        assert_eq!(status, 200, "{r}");
        let choice = &r["choices"][0];
        let content = choice["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), r["usage"]["completion_tokens"].as_u64().unwrap() as usize);
        let mut bytes = Vec::new();
        for entry in content {
            let lp = entry["logprob"].as_f64().unwrap();
            let top = entry["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 3, "{entry}");
            // Greedy: the chosen token is the most likely one.
            assert_eq!(top[0]["token"], entry["token"], "{entry}");
            assert!((top[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-6);
            let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
            assert!(lps.windows(2).all(|w| w[0] >= w[1]), "{lps:?}");
            let mass: f64 = lps.iter().map(|l| l.exp()).sum();
            assert!(lp <= 0.0 && mass <= 1.0 + 1e-5, "{entry}");
            bytes.extend(entry["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8));
        }
        // The last token is the end of the turn, whose text the reply does not show.
        let text = choice["message"]["content"].as_str().unwrap();
        assert!(String::from_utf8_lossy(&bytes).starts_with(text), "{bytes:?} vs {text:?}");

        let mut streamed = body;
        streamed["stream"] = json!(true);
        let chunks = stream(&server.url, "/v1/chat/completions", streamed).await;
        let streamed: Vec<Value> = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0)?["logprobs"]["content"].as_array().cloned())
            .flatten()
            .collect();
        // The same tokens and alternatives; the values up to f32 rounding: the streamed request
        // reuses the cached prompt, whose last partial block is recomputed in a chunk of another
        // size, and the CPU's matrix products round by their blocking (which differs between
        // AVX2 and AVX-512 machines).
        assert_eq!(streamed.len(), content.len());
        for (s, w) in streamed.iter().zip(content) {
            assert_same_logprob(s, w);
        }

        // The completions API's lists, the sampled token always among the alternatives.
        let (status, r) = post(
            &server.url,
            "/v1/completions",
            json!({"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0.8, "seed": 3, "logprobs": 2}),
        )
        .await;
        assert_eq!(status, 200, "{r}");
        let lp = &r["choices"][0]["logprobs"];
        let tokens = lp["tokens"].as_array().unwrap();
        assert_eq!(tokens.len(), 6);
        assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 6);
        let offsets: Vec<u64> = lp["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
        assert_eq!(offsets[0], 0);
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
        for (t, top) in tokens.iter().zip(lp["top_logprobs"].as_array().unwrap()) {
            let top = top.as_object().unwrap();
            assert!((2..=3).contains(&top.len()), "{top:?}");
            assert!(top.contains_key(t.as_str().unwrap()), "{t} in {top:?}");
        }
    });
}

/// Frequency and presence penalties change what greedy decoding repeats, and a strong one stops
/// a token from coming back.
#[test]
fn frequency_and_presence_penalties_reduce_repetition() {
    let server = shared();
    rt().block_on(async {
        let run = |extra: Value| {
            let url = server.url.clone();
            async move {
                let mut body = json!({
                    "prompt": "List: apple, apple, apple, apple, apple,",
                    "max_tokens": 24,
                    "temperature": 0,
                    "ignore_eos": true,
                });
                for (k, v) in extra.as_object().unwrap() {
                    body[k] = v.clone();
                }
                let (status, r) = post(&url, "/v1/completions", body).await;
                assert_eq!(status, 200, "{r}");
                r["choices"][0]["text"].as_str().unwrap().to_string()
            }
        };
        let plain = run(json!({})).await;
        let freq = run(json!({"frequency_penalty": 2.0})).await;
        let presence = run(json!({"presence_penalty": 2.0})).await;
        assert_ne!(plain, freq, "a frequency penalty changes greedy output");
        assert_ne!(plain, presence, "a presence penalty changes greedy output");
        let ids = |text: &str| server.engine.tokenizer().encode(text).unwrap();
        let repeats = |text: &str| {
            let ids = ids(text);
            let distinct: std::collections::HashSet<_> = ids.iter().collect();
            ids.len() - distinct.len()
        };
        assert!(
            repeats(&freq) < repeats(&plain),
            "penalized {freq:?} repeats less than {plain:?}"
        );
    });
}

#[test]
fn bad_requests_get_openai_errors() {
    let server = shared();
    let url = &server.url;
    rt().block_on(async {
        let raw = |path: &'static str, body: &'static str| async move {
            let r = client()
                .post(format!("{url}{path}"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        };
        let (s, b) = raw("/v1/completions", "{not json").await;
        assert_eq!(s, 400);
        error_of(&b);
        let (s, b) = raw("/v1/chat/completions", r#"{"messages": "hi"}"#).await;
        assert_eq!(s, 400);
        error_of(&b);
        let (s, b) = post(url, "/v1/completions", json!({"prompt": "x", "model": "gpt-9"})).await;
        assert_eq!(s, 404);
        assert_eq!(error_of(&b)["code"], "model_not_found");
        let long = "word ".repeat(9000);
        let (s, b) = post(url, "/v1/completions", json!({"prompt": long})).await;
        assert_eq!(s, 400);
        assert_eq!(error_of(&b)["code"], "context_length_exceeded");
        for bad in [
            json!({"prompt": "x", "temperature": -1}),
            json!({"prompt": "x", "top_p": 0}),
            json!({"prompt": "x", "max_tokens": 0}),
            json!({"prompt": "x", "n": 0}),
            json!({"prompt": "x", "stop": [""]}),
            json!({"prompt": [999999]}),
            json!({"prompt": ""}),
            json!({"prompt": "x", "presence_penalty": 2.5}),
            json!({"prompt": "x", "frequency_penalty": -3}),
            json!({"prompt": "x", "logprobs": 21}),
            json!({"prompt": "x", "logprobs": "yes"}),
            json!({"prompt": "x", "best_of": 0}),
            json!({"prompt": "x", "stream_options": {"include_usage": true}}),
            json!({"prompt": "x", "session": "s".repeat(257)}),
            json!({"prompt": ["a", "b"], "session": "two-prompts"}),
        ] {
            let (s, b) = post(url, "/v1/completions", bad.clone()).await;
            assert_eq!(s, 400, "{bad}: {b}");
            error_of(&b);
        }
        for bad in [
            json!({"messages": []}),
            json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
            json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 30}),
            json!({"messages": [{"role": "bogus", "content": "x"}]}),
            json!({"messages": [{"role": "user"}]}),
            json!({"messages": [{"role": "user", "content": null}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
        ] {
            let (s, b) = post(url, "/v1/chat/completions", bad.clone()).await;
            assert_eq!(s, 400, "{bad}: {b}");
            error_of(&b);
        }
        let (s, b) = post(
            url,
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        )
        .await;
        assert_eq!(s, 400);
        error_of(&b);
        let r = client().get(format!("{url}/v1/nope")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 404);
        error_of(&r.json().await.unwrap());
        let r = client().get(format!("{url}/v1/completions")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 405);
        let huge = "x".repeat(9 << 20);
        let r = client()
            .post(format!("{url}/v1/completions"))
            .body(huge)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 413);
        // A Content-Length past the limit is answered at once, not after waiting for the body.
        {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let addr = url.trim_start_matches("http://");
            let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
            conn.write_all(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n{}",
            )
            .await
            .unwrap();
            let mut head = [0u8; 12];
            tokio::time::timeout(Duration::from_secs(10), conn.read_exact(&mut head))
                .await
                .expect("an answer before the body comes")
                .unwrap();
            assert_eq!(&head, b"HTTP/1.1 413", "{}", String::from_utf8_lossy(&head));
        }
        // Still healthy, and still serving.
        let r = client().get(format!("{url}/health")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let (s, _) = post(url, "/v1/completions", json!({"prompt": "Hi", "max_tokens": 2})).await;
        assert_eq!(s, 200);
    });
}

#[test]
fn models_and_metrics() {
    let server = shared();
    rt().block_on(async {
        let (status, r) = get(&server.url, "/v1/models").await;
        assert_eq!(status, 200);
        assert_eq!(r["object"], "list");
        let id = &server.engine.info().model_id;
        assert_eq!(r["data"][0]["id"], id.as_str());
        // One model by id (the clients' `models.retrieve`), and an unknown one.
        let (status, one) = get(&server.url, &format!("/v1/models/{id}")).await;
        assert_eq!(status, 200);
        assert_eq!(one, r["data"][0]);
        let (status, missing) = get(&server.url, "/v1/models/no-such-model").await;
        assert_eq!(status, 404);
        assert_eq!(error_of(&missing)["code"], "model_not_found", "{missing}");
        // A fresh server's cache size is on /metrics before any request.
        let fresh = Server::start(engine(2, 8), ServerConfig::default());
        let idle = get_text(&fresh.url, "/metrics").await;
        for name in ["turbo_kv_blocks_total", "turbo_kv_blocks_free"] {
            assert_eq!(
                metric(&idle, name),
                fresh.engine.info().num_blocks as f64,
                "{name}"
            );
        }
        let (s, _) = post(
            &server.url,
            "/v1/completions",
            json!({"prompt": "Hello", "max_tokens": 3}),
        )
        .await;
        assert_eq!(s, 200);
        let text = get_text(&server.url, "/metrics").await;
        for name in [
            "turbo_requests_running",
            "turbo_requests_waiting",
            "turbo_kv_blocks_used",
            "turbo_kv_blocks_free",
            "turbo_kv_blocks_evictable",
            "turbo_idle_sessions",
            "turbo_prefix_cache_hit_tokens_total",
            "turbo_preemptions_total",
            "turbo_prompt_tokens_total",
            "turbo_generation_tokens_total",
            "turbo_time_to_first_token_seconds_bucket",
            "turbo_inter_token_latency_seconds_bucket",
            "turbo_e2e_request_latency_seconds_count",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
        // The CPU's unquantized cache holds f32.
        assert!(
            text.contains("turbo_kv_cache_dtype{dtype=\"f32\"} 1"),
            "kv_cache_dtype in:\n{text}"
        );
    });
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// A client that goes away mid-stream cancels its request: its KV is freed, and `/metrics`
/// counts it as aborted, with the tokens it had generated.
#[test]
fn a_client_that_leaves_mid_stream_frees_its_kv() {
    let server = Server::start(engine(4, 16), ServerConfig::default());
    rt().block_on(async {
        let aborted = |text: &str| {
            text.lines()
                .find_map(|l| {
                    l.strip_prefix("turbo_requests_total{outcome=\"abort\"} ")?
                        .trim()
                        .parse::<f64>()
                        .ok()
                })
                .unwrap_or(0.0)
        };
        let text = get_text(&server.url, "/metrics").await;
        let (before, tokens_before) = (
            aborted(&text),
            metric(&text, "turbo_generation_tokens_total"),
        );
        let r = client()
            .post(format!("{}/v1/completions", server.url))
            .json(&json!({"prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": true, "stream": true}))
            .send()
            .await
            .unwrap();
        let mut body = r.bytes_stream();
        let mut seen = 0;
        while seen < 5 {
            let chunk = body.next().await.unwrap().unwrap();
            seen += chunk.split(|&b| b == b'\n').filter(|l| l.starts_with(b"data:")).count();
        }
        drop(body); // the client goes away
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = get_text(&server.url, "/metrics").await;
            if metric(&text, "turbo_kv_blocks_used") == 0.0
                && metric(&text, "turbo_requests_running") == 0.0
                && aborted(&text) == before + 1.0
            {
                assert!(
                    metric(&text, "turbo_generation_tokens_total") >= tokens_before + 4.0,
                    "the aborted request's tokens are counted:\n{text}"
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "KV still held or no abort counted:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}

/// A chat of tens of thousands of short messages, far past the context, is refused as too long
/// and does not hold up a request running beside it (tokenizing it once took seconds on the
/// threads that serve every connection).
#[test]
fn a_chat_of_many_messages_is_refused_without_holding_others() {
    let server = shared();
    rt().block_on(async {
        let messages: Vec<Value> = (0..40_000)
            .map(
                |i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "hi"}),
            )
            .collect();
        let (status, body) = post(
            &server.url,
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 4}),
        )
        .await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(error_of(&body)["code"], "context_length_exceeded", "{body}");
    });
}

/// `stream`, `ignore_eos` and `stream_options.include_usage` may be null (OpenAI documents them
/// as "boolean or null"): null is false.
#[test]
fn null_booleans_are_false() {
    let server = shared();
    rt().block_on(async {
        let (status, body) = post(
            &server.url,
            "/v1/completions",
            json!({"prompt": "Hello", "max_tokens": 3, "stream": null, "ignore_eos": null,
                   "stream_options": {"include_usage": null}}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["object"], "text_completion", "not streamed: {body}");
    });
}

/// A client that sends part of a request and then nothing does not keep the server from
/// stopping: it stops a second after its shutdown timeout.
#[test]
fn a_half_sent_request_does_not_hold_shutdown() {
    use std::io::Write;
    let config = ServerConfig {
        shutdown_timeout: Duration::from_secs(1),
        ..ServerConfig::default()
    };
    let mut server = Server::start(engine(2, 8), config);
    let addr = server.url.trim_start_matches("http://").to_string();
    let mut partial = std::net::TcpStream::connect(&addr).unwrap();
    partial
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    server
        .shutdown(Duration::from_secs(30))
        .expect("serve returns Ok");
    drop(partial);
}

/// A connection that stops partway through its headers is closed after the header timeout; a
/// request whose body stops arriving gets 408 after the body timeout.
#[test]
fn slow_headers_and_bodies_are_timed_out() {
    use std::io::{Read, Write};
    let config = ServerConfig {
        header_read_timeout: Duration::from_secs(1),
        body_read_timeout: Duration::from_secs(1),
        ..ServerConfig::default()
    };
    let server = Server::start(engine(2, 8), config);
    let addr = server.url.trim_start_matches("http://").to_string();
    let read_all = |s: &mut std::net::TcpStream| {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        String::from_utf8_lossy(&got).into_owned()
    };
    let mut headers = std::net::TcpStream::connect(&addr).unwrap();
    headers
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let answer = read_all(&mut headers);
    assert!(!answer.contains("200 OK"), "{answer}");
    let mut body = std::net::TcpStream::connect(&addr).unwrap();
    body.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\nConnection: close\r\n\r\n{\"pro",
    )
    .unwrap();
    let answer = read_all(&mut body);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"code\":\"timeout\""), "{answer}");
}

#[test]
fn a_full_queue_refuses_with_429_and_recovers() {
    let server = Server::start(engine(1, 2), ServerConfig::default());
    rt().block_on(async {
        let url = server.url.clone();
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move {
                    post(
                        &url,
                        "/v1/completions",
                        json!({"prompt": "Count:", "max_tokens": 24, "ignore_eos": true}),
                    )
                    .await
                })
            })
            .collect();
        let mut ok = 0;
        let mut refused = 0;
        for t in tasks {
            let (status, body) = t.await.unwrap();
            match status {
                200 => ok += 1,
                429 => {
                    assert_eq!(error_of(&body)["code"], "queue_full");
                    refused += 1
                }
                s => panic!("status {s}: {body}"),
            }
        }
        assert!(ok >= 2 && refused >= 1, "{ok} served, {refused} refused");
        let (s, _) = post(
            &url,
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 2}),
        )
        .await;
        assert_eq!(s, 200, "served again once the queue drained");
    });
}

#[test]
fn a_request_that_waits_past_the_queue_limit_gets_503() {
    let config = ServerConfig {
        max_queue_wait: Some(Duration::from_millis(300)),
        ..ServerConfig::default()
    };
    let server = Server::start(engine(1, 8), config);
    rt().block_on(async {
        let url = server.url.clone();
        // Holds the only slot for well over the limit.
        let long = {
            let url = url.clone();
            tokio::spawn(async move {
                post(
                    &url,
                    "/v1/completions",
                    json!({"prompt": "Count:", "max_tokens": 200, "ignore_eos": true}),
                )
                .await
            })
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while metric(&get_text(&url, "/metrics").await, "turbo_requests_running") < 1.0 {
            assert!(Instant::now() < deadline, "the long request never started");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let started = Instant::now();
        let (status, body) = post(&url, "/v1/completions", json!({"prompt": "Hi", "max_tokens": 2})).await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(error_of(&body)["code"], "overloaded");
        // Streamed: refused with the status, not a 200 stream carrying an error.
        let r = client()
            .post(format!("{url}/v1/chat/completions"))
            .json(&json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 503);
        assert_eq!(error_of(&r.json().await.unwrap())["code"], "overloaded");
        assert!(started.elapsed() < Duration::from_secs(10), "refused promptly");
        let (status, body) = long.await.unwrap();
        assert_eq!(status, 200, "the running request is untouched: {body}");
        assert_eq!(body["usage"]["completion_tokens"], 200);
        // Streaming still works when the request is admitted in time.
        let chunks = stream(
            &url,
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 3, "stream": true}),
        )
        .await;
        assert!(chunks.iter().any(|c| c["choices"][0]["finish_reason"] == "length"));
        // A request wider than the batch (n = 3, one slot) is not refused for its own choices'
        // wait: once its first is in, the others wait for the slot.
        let (status, body) = post(
            &url,
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 2, "n": 3, "ignore_eos": true}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"].as_array().unwrap().len(), 3);
        // Wider than the engine ever takes (8 pending): a client error, not "retry later".
        for (request, param) in [
            (json!({"prompt": vec!["Hi"; 9], "max_tokens": 2}), "prompt"),
            (json!({"prompt": "Hi", "max_tokens": 2, "n": 9}), "n"),
        ] {
            let (status, body) = post(&url, "/v1/completions", request).await;
            assert_eq!(status, 400, "{body}");
            assert_eq!(error_of(&body)["param"], param);
        }
        let metrics = get_text(&url, "/metrics").await;
        assert_eq!(metric(&metrics, "turbo_requests_waiting"), 0.0);
    });
}

#[test]
fn the_api_key_guards_v1_routes() {
    let config = ServerConfig {
        api_key: Some("sesame".into()),
        ..ServerConfig::default()
    };
    let server = Server::start(engine(2, 8), config);
    rt().block_on(async {
        let url = &server.url;
        let r = client()
            .get(format!("{url}/v1/models"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 401);
        assert_eq!(
            error_of(&r.json().await.unwrap())["code"],
            "invalid_api_key"
        );
        let r = client()
            .get(format!("{url}/v1/models"))
            .bearer_auth("wrong")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 401);
        let r = client()
            .get(format!("{url}/v1/models"))
            .bearer_auth("sesame")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        // The scheme's case does not matter.
        let r = client()
            .get(format!("{url}/v1/models"))
            .header("authorization", "bearer sesame")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let r = client().get(format!("{url}/health")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200, "health needs no key");
    });
}

#[test]
fn shutdown_finishes_the_running_request_then_stops() {
    let mut server = Server::start(engine(2, 8), ServerConfig::default());
    let url = server.url.clone();
    let rt = rt();
    let running = rt.spawn(async move {
        post(
            &url,
            "/v1/completions",
            json!({"prompt": "Count to ten:", "max_tokens": 40, "ignore_eos": true}),
        )
        .await
    });
    // Shut down once the request is in the engine.
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.engine.stats().batch.running == 0 {
        assert!(Instant::now() < deadline, "the request never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    server
        .shutdown(Duration::from_secs(60))
        .expect("serve returns Ok");
    let (status, body) = rt.block_on(running).unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 40, "it ran to its end");
    assert!(!server.engine.stats().alive, "the engine thread has ended");
}

/// Requests still running when the shutdown timeout passes are cancelled; their clients get an
/// error (503 `unavailable`, or an error event ending the stream after the text sent so far), not
/// a finish reason OpenAI's clients do not know.
#[test]
fn requests_cut_off_by_shutdown_get_an_error() {
    let config = ServerConfig {
        shutdown_timeout: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    let mut server = Server::start(engine(2, 8), config);
    let body = json!({"prompt": "Count to ten:", "max_tokens": 4000, "ignore_eos": true});
    let rt = rt();
    let (url, whole_body) = (server.url.clone(), body.clone());
    let whole = rt.spawn(async move { post(&url, "/v1/completions", whole_body).await });
    let url = server.url.clone();
    let streamed = rt.spawn(async move {
        let mut body = body;
        body["stream"] = json!(true);
        stream(&url, "/v1/completions", body).await
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.engine.stats().batch.running < 2 {
        assert!(Instant::now() < deadline, "the requests never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    server
        .shutdown(Duration::from_secs(60))
        .expect("serve returns Ok");
    let (status, body) = rt.block_on(whole).unwrap();
    assert_eq!(status, 503, "{body}");
    assert_eq!(error_of(&body)["code"], "unavailable", "{body}");
    assert_eq!(error_of(&body)["type"], "server_error", "{body}");
    let chunks = rt.block_on(streamed).unwrap();
    let (last, text) = chunks.split_last().expect("chunks before the error");
    assert_eq!(last["error"]["code"], "unavailable", "{last}");
    assert!(
        text.iter().any(|c| c["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty())),
        "the text generated before the shutdown was sent"
    );
    assert!(
        text.iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null()),
        "no finish reason for a request that did not finish"
    );
}

/// The official `openai` Python client against the server (`openai_client.py`). `.ci/run`
/// installs the client into `target/pydeps` and sets `TURBO_REQUIRE_OPENAI`; without the client
/// (and without that variable) the test says so and skips.
#[test]
fn the_official_openai_client_works() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let pydeps = root.join("target/pydeps");
    let mut path = std::env::var_os("PYTHONPATH").unwrap_or_default();
    if pydeps.is_dir() {
        let mut joined = pydeps.into_os_string();
        if !path.is_empty() {
            joined.push(":");
            joined.push(&path);
        }
        path = joined;
    }
    let python = || {
        let mut c = std::process::Command::new("python3");
        c.env("PYTHONPATH", &path);
        c
    };
    let importable = python()
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !importable {
        assert!(
            std::env::var_os("TURBO_REQUIRE_OPENAI").is_none(),
            "TURBO_REQUIRE_OPENAI is set but python3 cannot import openai"
        );
        eprintln!(
            "skipping: python3 cannot import openai (`.ci/run` installs it into target/pydeps)"
        );
        return;
    }
    let server = shared();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let out = python()
        .arg(script)
        .arg(&server.url)
        .output()
        .expect("python3 runs");
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{log}");
    assert!(
        out.status.success(),
        "the openai client's checks failed:\n{log}"
    );
    assert!(log.contains("checks passed"), "{log}");
}
