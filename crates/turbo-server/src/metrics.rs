//! Prometheus metrics: the engine's state at scrape time and per-request latencies.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use turbo_engine::EngineStats;

/// Buckets in seconds, from a fast decode step to a long generation.
const LATENCY_BUCKETS: [f64; 20] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
];

pub struct Metrics {
    registry: Mutex<Registry>,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub cached_prompt_tokens: Counter,
    /// Requests by outcome: stop, length, cancelled, error, rejected.
    pub requests: Family<Vec<(String, String)>, Counter>,
    running: Gauge,
    waiting: Gauge,
    pending: Gauge,
    kv_used: Gauge,
    kv_free: Gauge,
    kv_evictable: Gauge,
    kv_total: Gauge,
    idle_sessions: Gauge,
    /// 1 for the KV cache's dtype (`bf16`, `int8`, `fp8`), Prometheus' "info" pattern.
    kv_dtype: Family<Vec<(String, String)>, Gauge>,
    preemptions: Counter,
    /// The engine's preemption count at the last scrape, so the counter only grows by what is new.
    preemptions_seen: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let histogram = || Histogram::new(LATENCY_BUCKETS);
        let m = Metrics {
            registry: Mutex::new(Registry::with_prefix("turbo")),
            ttft: histogram(),
            itl: histogram(),
            e2e: histogram(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            cached_prompt_tokens: Counter::default(),
            requests: Family::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            pending: Gauge::default(),
            kv_used: Gauge::default(),
            kv_free: Gauge::default(),
            kv_evictable: Gauge::default(),
            kv_total: Gauge::default(),
            idle_sessions: Gauge::default(),
            kv_dtype: Family::default(),
            preemptions: Counter::default(),
            preemptions_seen: AtomicU64::new(0),
        };
        {
            let mut r = m.registry.lock().unwrap_or_else(|e| e.into_inner());
            r.register(
                "time_to_first_token_seconds",
                "Time from a request's arrival to its first generated token",
                m.ttft.clone(),
            );
            r.register(
                "inter_token_latency_seconds",
                "Time between successive generated tokens of a request",
                m.itl.clone(),
            );
            r.register(
                "e2e_request_latency_seconds",
                "Time from a request's arrival to its last token",
                m.e2e.clone(),
            );
            r.register(
                "prompt_tokens",
                "Prompt tokens of finished requests",
                m.prompt_tokens.clone(),
            );
            r.register(
                "generation_tokens",
                "Tokens generated",
                m.generation_tokens.clone(),
            );
            r.register(
                "prefix_cache_hit_tokens",
                "Prompt tokens whose KV was found cached (not prefilled)",
                m.cached_prompt_tokens.clone(),
            );
            r.register("requests", "Requests ended, by outcome", m.requests.clone());
            r.register(
                "requests_running",
                "Requests holding a batch slot",
                m.running.clone(),
            );
            r.register(
                "requests_waiting",
                "Requests queued for a slot",
                m.waiting.clone(),
            );
            r.register(
                "requests_pending",
                "Requests accepted and not yet ended",
                m.pending.clone(),
            );
            r.register(
                "kv_blocks_used",
                "KV blocks held by sequences, idle sessions' included (given back when needed)",
                m.kv_used.clone(),
            );
            r.register(
                "kv_blocks_free",
                "KV blocks holding nothing",
                m.kv_free.clone(),
            );
            r.register(
                "kv_blocks_evictable",
                "KV blocks nobody holds that keep reusable KV",
                m.kv_evictable.clone(),
            );
            r.register(
                "kv_blocks_total",
                "KV blocks in the cache",
                m.kv_total.clone(),
            );
            r.register(
                "idle_sessions",
                "Finished sessions whose KV stays resident until its blocks are needed",
                m.idle_sessions.clone(),
            );
            r.register(
                "kv_cache_dtype",
                "How the KV cache stores keys and values (1 for the dtype in use)",
                m.kv_dtype.clone(),
            );
            r.register(
                "preemptions",
                "Requests preempted to free KV blocks",
                m.preemptions.clone(),
            );
        }
        m
    }

    /// Counts a request's outcome.
    pub fn outcome(&self, outcome: &str) {
        self.requests
            .get_or_create(&vec![("outcome".to_string(), outcome.to_string())])
            .inc();
    }

    /// The Prometheus text exposition, with the engine's state as of `stats` and what its KV
    /// cache stores (`EngineInfo::kv_storage`: `f32` or `bf16` unquantized, `int8`, `fp8`).
    pub fn render(&self, stats: &EngineStats, kv_storage: &str) -> String {
        let b = &stats.batch;
        let set = |g: &Gauge, v: usize| g.set(i64::try_from(v).unwrap_or(i64::MAX));
        set(&self.running, b.running);
        set(&self.waiting, b.waiting);
        set(&self.pending, stats.pending);
        set(&self.kv_used, b.kv_blocks_used);
        set(&self.kv_free, b.kv_blocks_free);
        set(&self.kv_evictable, b.kv_blocks_evictable);
        set(&self.kv_total, b.kv_blocks_total);
        set(&self.idle_sessions, b.idle_sessions);
        self.kv_dtype
            .get_or_create(&vec![("dtype".to_string(), kv_storage.to_string())])
            .set(1);
        let seen = self
            .preemptions_seen
            .fetch_max(b.preemptions, Ordering::AcqRel);
        self.preemptions.inc_by(b.preemptions.saturating_sub(seen));
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &registry);
        out
    }
}
