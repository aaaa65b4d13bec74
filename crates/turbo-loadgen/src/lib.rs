//! A load generator for OpenAI-compatible HTTP servers, in the manner of vLLM's
//! `benchmarks/benchmark_serving.py`.
//!
//! A [`Workload`] (a JSONL prompts file or a synthetic ShareGPT-like set) is sent to
//! `{url}/v1/completions` as streamed requests, arriving all at once or as a Poisson process
//! ([`Rate`]), optionally capped in concurrency. Each response's server-sent events are timed as
//! they arrive, and [`run`] sums the requests up in a [`Report`]: throughput, and TTFT, ITL, E2E
//! latency and TPOT distributions.

mod client;
mod report;
mod workload;

pub use client::RequestResult;
pub use report::{percentile, ErrorCount, Report, Stats};
pub use workload::{Request, Synthetic, Workload, WORDS};

use client::Target;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp};
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::sync::Semaphore;
use tokio::time::Instant;

#[derive(Debug, Error)]
pub enum LoadgenError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{file} line {line}: {message}")]
    BadLine {
        file: String,
        line: usize,
        message: String,
    },
    #[error("invalid server URL {url:?}: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("cannot start the HTTP client: {0}")]
    Client(String),
    #[error("cannot start the tokio runtime: {0}")]
    Runtime(String),
}

/// When requests arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rate {
    /// Every request at time zero: measures peak throughput.
    Infinite,
    /// A Poisson process of this many requests per second, the usual model of independent users.
    PerSecond(f64),
}

impl Rate {
    /// When each of `n` requests is sent, relative to the start. Poisson arrivals draw
    /// exponential gaps from a ChaCha generator seeded by `seed`, the first request at zero.
    pub fn arrival_offsets(self, n: usize, seed: u64) -> Result<Vec<Duration>, LoadgenError> {
        match self {
            Rate::Infinite => Ok(vec![Duration::ZERO; n]),
            Rate::PerSecond(rate) => {
                if !(rate.is_finite() && rate > 0.0) {
                    let msg = format!("request rate {rate} is not a positive number");
                    return Err(LoadgenError::Config(msg));
                }
                let exp = Exp::new(rate).map_err(|e| LoadgenError::Config(e.to_string()))?;
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                let mut t = 0.0f64;
                (0..n)
                    .map(|i| {
                        if i > 0 {
                            t += exp.sample(&mut rng);
                        }
                        // Far beyond any benchmark, and safe from overflow when added to now.
                        (t < 1e9)
                            .then(|| Duration::from_secs_f64(t))
                            .ok_or_else(|| {
                                LoadgenError::Config(format!("request rate {rate} is too low"))
                            })
                    })
                    .collect()
            }
        }
    }
}

/// Everything one benchmark run needs; [`LoadgenConfig::new`] fills in the usual defaults.
#[derive(Clone)]
pub struct LoadgenConfig {
    /// The server's base URL (`http://host:port`); requests go to `{url}/v1/completions`.
    pub url: String,
    /// The model name sent with each request; empty sends none (the server picks its one model).
    pub model: String,
    /// Sent as `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    pub workload: Workload,
    pub rate: Rate,
    /// Requests in flight at most; arrivals beyond it wait for a free slot.
    pub max_concurrency: Option<usize>,
    /// Seeds the arrival times.
    pub seed: u64,
    /// A request still unfinished after this long counts as failed.
    pub timeout: Option<Duration>,
    /// Asks the server to generate all `max_tokens`, so output lengths follow the workload.
    pub ignore_eos: bool,
}

impl LoadgenConfig {
    /// All requests at once, no concurrency cap or timeout, seed 0, `ignore_eos` on.
    pub fn new(url: impl Into<String>, model: impl Into<String>, workload: Workload) -> Self {
        LoadgenConfig {
            url: url.into(),
            model: model.into(),
            api_key: None,
            workload,
            rate: Rate::Infinite,
            max_concurrency: None,
            seed: 0,
            timeout: None,
            ignore_eos: true,
        }
    }
}

/// Leaves out the API key, and the prompts, which may be thousands.
impl fmt::Debug for LoadgenConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadgenConfig")
            .field("url", &self.url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("requests", &self.workload.requests.len())
            .field("rate", &self.rate)
            .field("max_concurrency", &self.max_concurrency)
            .field("seed", &self.seed)
            .field("timeout", &self.timeout)
            .field("ignore_eos", &self.ignore_eos)
            .finish()
    }
}

/// Sends the whole workload and reports on it, on the current tokio runtime (time and I/O
/// enabled). Failed requests are counted in the report, never returned as errors; an error means
/// the run could not start (bad URL or configuration).
pub async fn run(config: &LoadgenConfig) -> Result<Report, LoadgenError> {
    let requests = &config.workload.requests;
    if requests.is_empty() {
        return Err(LoadgenError::Config(
            "the workload holds no requests".into(),
        ));
    }
    if config.max_concurrency == Some(0) {
        return Err(LoadgenError::Config(
            "max concurrency must be at least 1".into(),
        ));
    }
    let offsets = config.rate.arrival_offsets(requests.len(), config.seed)?;
    let target = Arc::new(Target::new(config)?);
    let slots = config.max_concurrency.map(|n| Arc::new(Semaphore::new(n)));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for (request, offset) in requests.iter().zip(offsets) {
        tokio::time::sleep_until(start + offset).await;
        let (target, slots, request) = (target.clone(), slots.clone(), request.clone());
        tasks.push(tokio::spawn(async move {
            let _slot = match &slots {
                Some(s) => s.clone().acquire_owned().await.ok(),
                None => None,
            };
            target.send(&request).await
        }));
    }
    let mut results = Vec::with_capacity(tasks.len());
    for task in tasks {
        results.push(task.await.unwrap_or_else(|e| {
            RequestResult::failed(format!("request task failed: {e}"), Duration::ZERO)
        }));
    }
    Ok(Report::new(results, start.elapsed()))
}

/// [`run`] on a runtime of its own, for callers without one; fails rather than panics when called
/// from inside a tokio runtime, where blocking would stall it.
pub fn run_blocking(config: &LoadgenConfig) -> Result<Report, LoadgenError> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(LoadgenError::Runtime(
            "run_blocking was called inside a tokio runtime; await run() instead".into(),
        ));
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| LoadgenError::Runtime(e.to_string()))?
        .block_on(run(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 20000 exponential gaps of mean 1/rate have a standard deviation of the mean of
    /// (1/rate)/sqrt(20000) = 0.71% of 1/rate, so 4% is more than 5 standard errors: a correct
    /// generator fails it with probability below 1e-6 for any seed.
    #[test]
    fn poisson_gaps_average_one_over_rate() {
        let n = 20_001;
        for (seed, rate) in [(0, 10.0), (1, 0.5), (7, 250.0)] {
            let t = Rate::PerSecond(rate).arrival_offsets(n, seed).unwrap();
            assert_eq!(t[0], Duration::ZERO);
            assert!(t.windows(2).all(|w| w[0] <= w[1]));
            let mean_gap = t[n - 1].as_secs_f64() / (n - 1) as f64;
            let rel = (mean_gap * rate - 1.0).abs();
            assert!(rel < 0.04, "rate {rate}: mean gap {mean_gap}, off by {rel}");
            assert_eq!(t, Rate::PerSecond(rate).arrival_offsets(n, seed).unwrap());
        }
        assert_ne!(
            Rate::PerSecond(1.0).arrival_offsets(10, 1).unwrap(),
            Rate::PerSecond(1.0).arrival_offsets(10, 2).unwrap()
        );
    }

    #[test]
    fn bad_rates_are_errors() {
        for rate in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e-300] {
            assert!(Rate::PerSecond(rate).arrival_offsets(3, 0).is_err());
        }
        let config = LoadgenConfig {
            api_key: Some("sekret".into()),
            ..LoadgenConfig::new("http://h", "m", Workload::default())
        };
        assert!(!format!("{config:?}").contains("sekret"));
        let zeros = Rate::Infinite.arrival_offsets(3, 0).unwrap();
        assert_eq!(zeros, vec![Duration::ZERO; 3]);
    }
}
