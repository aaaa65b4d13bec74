//! `turbo serve`: an OpenAI-compatible HTTP server over one [`Engine`].
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions` (streamed as server-sent events
//! ending in `data: [DONE]`, or whole), `GET /v1/models`, `GET /health`, `GET /metrics`
//! (Prometheus). Every request runs on the engine's one persistent batch; multi-round chat needs
//! no session id, since a round's prompt starts with the previous round's tokens and the KV
//! cache's prefix sharing finds them (`usage.prompt_tokens_details.cached_tokens` shows it).
//!
//! Failure is per request: bad input gets an OpenAI-style error (400, 404, 413, 401), a full
//! queue 429, a request that waited past `--max-queue-wait` or a stopping server 503; a client that goes away cancels its request, whose KV is
//! freed at the engine's next step.

mod api;
mod error;
mod generate;
mod metrics;

pub use error::ApiError;
pub use metrics::Metrics;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use turbo_engine::Engine;

/// How the server listens and what it allows.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Requests to `/v1/*` must carry `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// The model name clients use; default: the engine's model id.
    pub served_model_name: Option<String>,
    /// Largest request body, in bytes (413 past it).
    pub max_body_bytes: usize,
    /// After a shutdown signal, how long running requests may take to finish before they are
    /// cancelled.
    pub shutdown_timeout: Duration,
    /// Longest a request waits for a batch slot before it is refused with 503, so that under
    /// overload every client gets an answer in bounded time. A streamed response then starts
    /// (its headers are sent) when its first token or refusal is known. `None`: no limit.
    pub max_queue_wait: Option<Duration>,
    /// How long a connection may take to send a request's headers: a client that opens a
    /// connection and sends nothing, or a byte now and then, is dropped then instead of holding
    /// a socket (and the graceful shutdown) forever.
    pub header_read_timeout: Duration,
    /// How long a request's body may take to arrive once its headers have (408 after).
    pub body_read_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            api_key: None,
            served_model_name: None,
            max_body_bytes: 8 << 20,
            shutdown_timeout: Duration::from_secs(30),
            max_queue_wait: None,
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(60),
        }
    }
}

/// What every handler shares.
pub struct AppState {
    pub engine: Arc<Engine>,
    pub metrics: Metrics,
    pub config: ServerConfig,
    pub model_name: String,
    pub created: u64,
}

/// The routes over `engine`, for [`serve`] or a test that drives them itself.
pub fn router(engine: Arc<Engine>, config: ServerConfig) -> Router {
    let model_name = config
        .served_model_name
        .clone()
        .unwrap_or_else(|| engine.info().model_id.clone());
    let state = Arc::new(AppState {
        engine,
        metrics: Metrics::new(),
        config,
        model_name,
        created: unix_time(),
    });
    let v1 = Router::new()
        .route("/v1/completions", post(generate::completions))
        .route("/v1/chat/completions", post(generate::chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// Serves on `listener` until `shutdown` resolves; then stops accepting, lets running requests
/// finish for [`ServerConfig::shutdown_timeout`] (cancelling the rest), and stops the engine.
/// HTTP/1.1, each connection on a task of its own, with [`ServerConfig::header_read_timeout`].
pub async fn serve(
    listener: TcpListener,
    engine: Arc<Engine>,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (grace, header_timeout) = (config.shutdown_timeout, config.header_read_timeout);
    let service = hyper_util::service::TowerToHyperService::new(router(engine.clone(), config));
    let connections = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, most likely: wait for connections to close.
                    tracing::warn!("accept error: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Streamed tokens go out as they come, not when a segment fills.
        let _ = stream.set_nodelay(true);
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(header_timeout)
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service.clone());
        let connection = connections.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!("connection ended: {e}");
            }
        });
    }
    // New connections are refused from here on.
    drop(listener);
    tracing::info!("shutting down: finishing running requests");
    engine.drain(grace);
    // Requests end within the grace (the engine cancels the rest); a connection still sending
    // its request a second after that is not waited for.
    tokio::select! {
        () = connections.shutdown() => {}
        () = tokio::time::sleep(grace + Duration::from_secs(1)) => {
            tracing::warn!("connections still open after the shutdown timeout: closed");
        }
    }
    tokio::task::spawn_blocking(move || engine.join())
        .await
        .map_err(std::io::Error::other)?;
    Ok(())
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn authorize(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(key) = &state.config.api_key else {
        return next.run(request).await;
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        // The scheme is case-insensitive (RFC 9110, 11.1).
        .and_then(|v| {
            v.split_once(' ')
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        })
        .map(|(_, key)| key);
    if given.is_some_and(|g| constant_time_eq(g.trim().as_bytes(), key.as_bytes())) {
        return next.run(request).await;
    }
    ApiError::invalid("invalid or missing API key: send 'Authorization: Bearer <key>'")
        .status(StatusCode::UNAUTHORIZED)
        .code("invalid_api_key")
        .into_response()
}

/// Equality whose time does not depend on where the inputs first differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The served model as OpenAI's API describes a model.
fn model_object(state: &AppState) -> serde_json::Value {
    serde_json::json!({
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "turbo",
        "max_model_len": state.engine.info().context_length,
    })
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    Json(serde_json::json!({"object": "list", "data": [model_object(&state)]})).into_response()
}

/// `GET /v1/models/{id}` (the clients' `models.retrieve`): the served model, or 404.
async fn model(
    State(state): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if id != state.model_name {
        return ApiError::not_found(format!(
            "the model '{id}' does not exist; this server serves '{}'",
            state.model_name
        ))
        .code("model_not_found")
        .into_response();
    }
    Json(model_object(&state)).into_response()
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let stats = state.engine.stats();
    if stats.alive {
        (StatusCode::OK, Json(serde_json::json!({"status": "ok"}))).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "engine stopped"})),
        )
            .into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let text = state
        .metrics
        .render(&state.engine.stats(), state.engine.info().kv_storage);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::not_found(format!("no route for {method} {}", uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::invalid(format!("{method} is not allowed on {}", uri.path()))
        .status(StatusCode::METHOD_NOT_ALLOWED)
        .code("method_not_allowed")
}

/// The body of a request, at most `limit` bytes, arriving within `timeout`.
async fn read_body(
    body: Body,
    limit: usize,
    timeout: Duration,
) -> Result<axum::body::Bytes, ApiError> {
    use axum::body::HttpBody;
    let too_large = || {
        ApiError::invalid(format!("the request body is larger than {limit} bytes"))
            .status(StatusCode::PAYLOAD_TOO_LARGE)
            .code("body_too_large")
    };
    // A Content-Length far past the limit is refused before any of the body is read: waiting
    // for a body that large would hold the connection until the client gives up. Up to twice
    // the limit the body is read up to the limit as before, so that a client still writing the
    // rest gets the 413 rather than a reset connection.
    if body.size_hint().lower() > 2 * limit as u64 {
        return Err(too_large());
    }
    let read = tokio::time::timeout(timeout, axum::body::to_bytes(body, limit));
    let Ok(read) = read.await else {
        return Err(ApiError::invalid(format!(
            "the request body did not arrive within {:.1} s",
            timeout.as_secs_f64()
        ))
        .status(StatusCode::REQUEST_TIMEOUT)
        .code("timeout"));
    };
    read.map_err(|e| {
        let over = std::error::Error::source(&e)
            .is_some_and(|s| s.to_string().contains("length limit"))
            || e.to_string().contains("length limit");
        if over {
            too_large()
        } else {
            ApiError::invalid(format!("cannot read the request body: {e}"))
        }
    })
}
