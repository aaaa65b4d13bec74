//! `turbo serve`: the model behind an OpenAI-compatible HTTP API, until SIGINT or SIGTERM.

use crate::runtime::{seconds, KvArgs, ModelArgs};
use anyhow::{Context, Result};
use clap::Args;
use std::sync::Arc;
use turbo_engine::{Engine, EngineConfig};
use turbo_server::ServerConfig;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 routes (also read from TURBO_API_KEY).
    #[arg(long, env = "TURBO_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model name clients use (default: the model file's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Batch slots: requests that run at once.
    #[arg(long, default_value_t = 64)]
    max_batch: usize,
    /// Tokens per forward pass (decode tokens plus prefill chunks); below --max-batch it is
    /// raised to it.
    #[arg(long, default_value_t = 2048)]
    max_batched_tokens: usize,
    /// Requests running or queued at once; past it, new ones get 429.
    #[arg(long, default_value_t = 512)]
    max_pending: usize,
    /// Seconds a request may wait for a batch slot before it is refused with 503 (0: no
    /// limit). Bounds how long clients wait under overload.
    #[arg(long, default_value_t = 0.0)]
    max_queue_wait: f64,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 8 << 20)]
    max_body_bytes: usize,
    /// Seconds running requests get to finish after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// KV cache size (default on the CPU: up to 4096 tokens per batch slot).
    #[command(flatten)]
    kv: KvArgs,
}

pub fn run(args: ServeArgs) -> Result<()> {
    // An empty key (say `--api-key "$UNSET"`) would serve without authentication unnoticed.
    anyhow::ensure!(
        !args.api_key.as_ref().is_some_and(|k| k.trim().is_empty()),
        "the API key (--api-key or TURBO_API_KEY) is empty: give a key, or set neither to serve \
         without one"
    );
    anyhow::ensure!(
        !args
            .served_model_name
            .as_ref()
            .is_some_and(|n| n.trim().is_empty()),
        "--served-model-name is empty"
    );
    anyhow::ensure!(
        args.max_body_bytes > 0,
        "--max-body-bytes must be at least 1"
    );
    anyhow::ensure!(args.max_batch > 0, "--max-batch must be positive");
    anyhow::ensure!(args.max_pending > 0, "--max-pending must be positive");
    let max_batched_tokens =
        crate::batch::tokens_per_step(args.max_batched_tokens, args.max_batch)?;
    let shutdown_timeout = seconds("--shutdown-timeout", args.shutdown_timeout)?;
    let max_queue_wait = seconds("--max-queue-wait", args.max_queue_wait)?;
    let engine = Arc::new(Engine::start(EngineConfig {
        kv: args.kv.size(args.max_batch, 4096)?,
        max_batch: args.max_batch,
        max_batched_tokens,
        prefill_chunk: 512,
        max_pending: args.max_pending,
        ..args.model.engine_config()?
    })?);
    if let Err(e) = engine.template() {
        eprintln!("warning: {e}; /v1/chat/completions will answer with an error");
    }
    let config = ServerConfig {
        api_key: args.api_key,
        served_model_name: args.served_model_name,
        max_body_bytes: args.max_body_bytes,
        shutdown_timeout,
        max_queue_wait: (!max_queue_wait.is_zero()).then_some(max_queue_wait),
        ..ServerConfig::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let info = engine.info();
        eprintln!(
            "Serving {} on http://{} ({}; {} KV blocks of {} tokens, {} slots)",
            config
                .served_model_name
                .as_deref()
                .unwrap_or(&info.model_id),
            listener.local_addr()?,
            info.backend,
            info.num_blocks,
            info.block_size,
            info.max_batch,
        );
        // The first SIGINT or SIGTERM starts the graceful shutdown; a second one ends the
        // process at once (requests still running are cut off), as a second Ctrl-C does
        // elsewhere.
        let shutdown = async {
            turbo_server::shutdown_signal().await;
            tokio::spawn(async {
                turbo_server::shutdown_signal().await;
                eprintln!("Second signal: stopping now.");
                std::process::exit(130);
            });
        };
        turbo_server::serve(listener, engine, config, shutdown)
            .await
            .context("server error")
    })?;
    eprintln!("Server stopped.");
    Ok(())
}
