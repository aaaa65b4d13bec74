//! Runs against a real HTTP server on loopback that streams OpenAI-style events with delays.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use turbo_loadgen::{run, run_blocking, LoadgenConfig, Rate, Request, Workload};

/// Before the first event, which carries empty text and so is not the first token.
const EMPTY_DELAY: u64 = 20;
const FIRST_DELAY: u64 = 100;
const GAP: u64 = 40;
const SPLIT_DELAY: u64 = 30;

#[derive(Default)]
struct Server {
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    bodies: Mutex<Vec<(Value, Option<String>)>>,
}

/// Counts a request in flight until its response stream is dropped.
struct InFlight(Arc<Server>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

fn event(v: Value) -> String {
    format!("data: {v}\r\n\r\n")
}

fn text(t: &str) -> String {
    event(json!({"object": "text_completion", "choices": [{"index": 0, "text": t}], "usage": null}))
}

/// Routes: `ok` (text, usage, [DONE]), `nousage`, `fail` (500), `nodone`, `error` (an error
/// event), `slow` (5 s before answering).
async fn completions(
    State(server): State<Arc<Server>>,
    Path(kind): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    server.bodies.lock().unwrap().push((body.clone(), auth));
    let n = server.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    server.peak.fetch_max(n, Ordering::SeqCst);
    let guard = InFlight(server.clone());
    let ms = Duration::from_millis;
    let max_tokens = body["max_tokens"].as_u64().unwrap_or(1);
    let words = body["prompt"]
        .as_str()
        .unwrap_or("")
        .split_whitespace()
        .count() as u64;
    let mut frames: Vec<(Duration, String)> =
        vec![(ms(EMPTY_DELAY), text("")), (ms(0), ": ping\n\n".into())];
    for i in 0..max_tokens {
        let delay = if i == 0 { FIRST_DELAY } else { GAP };
        let t = text(&format!("t{i} "));
        if i == 1 {
            // One event written as two body frames.
            let (a, b) = t.split_at(t.len() / 2);
            frames.push((ms(delay), a.to_string()));
            frames.push((ms(SPLIT_DELAY), b.to_string()));
        } else {
            frames.push((ms(delay), t));
        }
    }
    let usage = json!({"choices": [], "usage": {"prompt_tokens": 1000 + words, "completion_tokens": max_tokens}});
    match kind.as_str() {
        "ok" => frames.push((ms(5), event(usage))),
        "nousage" => {}
        "fail" => return (StatusCode::INTERNAL_SERVER_ERROR, "engine exploded").into_response(),
        "nodone" => {
            frames.truncate(3);
            return stream(frames, guard);
        }
        "error" => {
            frames.truncate(3);
            frames.push((
                ms(5),
                event(json!({"error": {"message": "out of memory", "code": 500}})),
            ));
        }
        "slow" => tokio::time::sleep(ms(5000)).await,
        _ => return StatusCode::NOT_FOUND.into_response(),
    }
    frames.push((ms(5), "data: [DONE]\n\n".into()));
    stream(frames, guard)
}

fn stream(frames: Vec<(Duration, String)>, guard: InFlight) -> Response {
    let body =
        futures_util::stream::unfold((frames.into_iter(), guard), |(mut it, g)| async move {
            let (delay, frame) = it.next()?;
            tokio::time::sleep(delay).await;
            Some((Ok::<_, Infallible>(frame), (it, g)))
        });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(body))
        .unwrap()
}

async fn serve() -> (String, Arc<Server>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = Arc::new(Server::default());
    let app = Router::new()
        .route("/{kind}/v1/completions", post(completions))
        .with_state(server.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), server)
}

fn workload(n: usize, max_tokens: usize) -> Workload {
    let requests = (0..n)
        .map(|i| Request {
            prompt: format!("hello world {i}"),
            max_tokens,
        })
        .collect();
    Workload { requests }
}

/// Every test's requests give up after 10 s, so no test can hang.
fn config(url: String, workload: Workload) -> LoadgenConfig {
    LoadgenConfig {
        timeout: Some(Duration::from_secs(10)),
        ..LoadgenConfig::new(url, "m", workload)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_timed_and_usage_counted() {
    let (url, server) = serve().await;
    let mut cfg = config(format!("{url}/ok/"), workload(4, 5));
    cfg.max_concurrency = Some(2);
    cfg.api_key = Some("sekret".into());
    cfg.model = "tiny".into();
    let r = run(&cfg).await.unwrap();
    assert_eq!((r.completed, r.failed), (4, 0), "{:?}", r.errors);
    assert_eq!((r.input_tokens, r.output_tokens), (4 * 1003, 20));
    assert_eq!(r.requests_without_usage, 0);
    assert!(server.peak.load(Ordering::SeqCst) <= 2);

    // The server spends at least this long on each request; a loaded machine only adds to it.
    let first = EMPTY_DELAY + FIRST_DELAY;
    let busy = first + 4 * GAP + SPLIT_DELAY;
    for res in &r.results {
        assert_eq!(res.text, "t0 t1 t2 t3 t4 ");
        assert!(res.usage_reported);
        let ttft = res.ttft.unwrap().as_millis() as u64;
        assert!((first..3000).contains(&ttft), "TTFT {ttft} ms");
        assert_eq!(res.itl.len(), 4);
        assert!(res.latency.as_millis() as u64 >= busy);
        assert!(res.latency >= res.ttft.unwrap() + res.itl.iter().sum::<Duration>());
    }
    // Two waves of two requests.
    assert!(r.duration_s * 1e3 >= 2.0 * busy as f64);
    let (ttft, itl, e2e, tpot) = (
        r.ttft_ms.unwrap(),
        r.itl_ms.unwrap(),
        r.e2e_ms.unwrap(),
        r.tpot_ms.unwrap(),
    );
    assert!(ttft.p50 >= first as f64 && ttft.max < 3000.0);
    // Gaps are 40 ms, one 70 ms; client-side scheduling delay can shift single gaps either way.
    assert!((20.0..1000.0).contains(&itl.p50), "ITL p50 {}", itl.p50);
    assert!(
        (itl.mean * 16.0
            - r.results
                .iter()
                .flat_map(|x| &x.itl)
                .map(|d| d.as_secs_f64() * 1e3)
                .sum::<f64>())
        .abs()
            < 1e-6
    );
    assert!(e2e.p50 >= busy as f64 && e2e.max <= r.duration_s * 1e3);
    assert!((10.0..1000.0).contains(&tpot.mean), "TPOT {}", tpot.mean);
    assert!(r.table().contains("TTFT"));

    let bodies = server.bodies.lock().unwrap();
    assert_eq!(bodies.len(), 4);
    let (body, auth) = &bodies[0];
    assert_eq!(auth.as_deref(), Some("Bearer sekret"));
    assert_eq!(body["model"], "tiny");
    assert_eq!(body["max_tokens"], 5);
    assert_eq!(body["temperature"], 0);
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"]["include_usage"], true);
    assert_eq!(body["ignore_eos"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_usage_text_events_are_counted() {
    let (url, _server) = serve().await;
    let mut cfg = config(format!("{url}/nousage"), workload(2, 3));
    cfg.ignore_eos = false;
    let r = run(&cfg).await.unwrap();
    assert_eq!((r.completed, r.failed), (2, 0));
    assert_eq!(
        (r.input_tokens, r.output_tokens, r.requests_without_usage),
        (6, 6, 2)
    );
    assert!(!r.results[0].usage_reported);
    assert!(r.table().contains("estimates"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_not_fatal() {
    let (url, server) = serve().await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    for (base, needle) in [
        (
            format!("{url}/fail"),
            "HTTP 500 Internal Server Error: engine exploded",
        ),
        (format!("{url}/nodone"), "without [DONE]"),
        (format!("{url}/error"), "server error: out of memory"),
        (format!("{url}/slow"), "timed out after 0.3 s"),
        (closed, "error sending request"),
    ] {
        let mut cfg = config(base, workload(3, 4));
        cfg.timeout = Some(Duration::from_millis(300));
        let r = run(&cfg).await.unwrap();
        assert_eq!((r.completed, r.failed), (0, 3));
        assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
        assert_eq!(r.errors[0].count, 3);
        assert!(
            r.errors[0].message.contains(needle),
            "{}",
            r.errors[0].message
        );
        assert!(r.ttft_ms.is_none() && r.e2e_ms.is_none());
        assert_eq!(r.output_tokens, 0);
    }
    assert!(server.bodies.lock().unwrap().len() >= 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisson_arrivals_keep_their_schedule() {
    let (url, _server) = serve().await;
    let mut cfg = config(format!("{url}/ok"), workload(8, 1));
    cfg.rate = Rate::PerSecond(20.0);
    cfg.seed = 5;
    let last = *Rate::PerSecond(20.0)
        .arrival_offsets(8, 5)
        .unwrap()
        .last()
        .unwrap();
    let r = run(&cfg).await.unwrap();
    assert_eq!(r.completed, 8);
    assert!(r.duration_s >= last.as_secs_f64() + FIRST_DELAY as f64 / 1e3);
}

#[tokio::test]
async fn bad_configurations_are_clear_errors() {
    let w = workload(1, 1);
    for (url, needle) in [
        ("not a url", "invalid server URL \"not a url\""),
        ("https://localhost:1", "only http://"),
        ("http://", "invalid server URL"),
    ] {
        let err = run(&config(url.into(), w.clone()))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{err}");
    }
    let url = String::from("http://127.0.0.1:1");
    assert!(run(&config(url.clone(), Workload::default()))
        .await
        .is_err());
    let bad_rate = LoadgenConfig {
        rate: Rate::PerSecond(0.0),
        ..config(url.clone(), w.clone())
    };
    assert!(run(&bad_rate)
        .await
        .unwrap_err()
        .to_string()
        .contains("rate"));
    let no_slots = LoadgenConfig {
        max_concurrency: Some(0),
        ..config(url.clone(), w.clone())
    };
    assert!(run(&no_slots).await.is_err());
    assert!(run_blocking(&config(url, w))
        .unwrap_err()
        .to_string()
        .contains("inside a tokio runtime"));
}

#[test]
fn run_blocking_runs_on_its_own_runtime() {
    let server_rt = tokio::runtime::Runtime::new().unwrap();
    let (url, _server) = server_rt.block_on(serve());
    let r = run_blocking(&config(format!("{url}/ok"), workload(2, 2))).unwrap();
    assert_eq!((r.completed, r.output_tokens), (2, 4));
}
