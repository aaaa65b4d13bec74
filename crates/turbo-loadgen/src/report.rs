//! The summary of a run.

use crate::client::RequestResult;
use serde::Serialize;
use std::fmt::Write;
use std::time::Duration;

/// How many distinct error messages a report keeps.
const MAX_ERRORS: usize = 5;

/// A latency distribution, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Stats {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Stats {
    /// `None` for no values, so that an empty distribution is not reported as zeros.
    pub fn of(mut values: Vec<f64>) -> Option<Stats> {
        values.sort_by(f64::total_cmp);
        let p = |q| percentile(&values, q);
        Some(Stats {
            mean: values.iter().sum::<f64>() / values.len() as f64,
            p50: p(50.0)?,
            p90: p(90.0)?,
            p99: p(99.0)?,
            max: *values.last()?,
        })
    }
}

/// The `p`th percentile (0 to 100) of ascending `sorted`, interpolating linearly between the
/// closest ranks: rank `p / 100 * (n - 1)`, as numpy's default method and vLLM's benchmark do.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let rank = (p.clamp(0.0, 100.0) / 100.0) * last as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64))
}

/// One distinct error message and how many requests failed with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorCount {
    pub message: String,
    pub count: usize,
}

/// A run's throughput and latencies. Token counts and throughputs cover completed requests only.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub completed: usize,
    pub failed: usize,
    /// The first few distinct failure messages.
    pub errors: Vec<ErrorCount>,
    /// From the first request sent to the last one finished.
    pub duration_s: f64,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Output tokens per second.
    pub output_throughput: f64,
    /// Input plus output tokens per second.
    pub total_token_throughput: f64,
    pub input_tokens: usize,
    pub output_tokens: usize,
    /// Completed requests whose server sent no usage chunk: their token counts are estimates
    /// (see [`RequestResult::usage_reported`]).
    pub requests_without_usage: usize,
    /// Time to first token.
    pub ttft_ms: Option<Stats>,
    /// Inter-token latency: every gap between successive text events, of all requests.
    pub itl_ms: Option<Stats>,
    /// End-to-end latency per request.
    pub e2e_ms: Option<Stats>,
    /// Time per output token after the first, per request with at least two.
    pub tpot_ms: Option<Stats>,
    /// Every request's outcome, in workload order; left out of JSON to keep it small.
    #[serde(skip)]
    pub results: Vec<RequestResult>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Report {
    pub(crate) fn new(results: Vec<RequestResult>, duration: Duration) -> Report {
        let ok: Vec<&RequestResult> = results.iter().filter(|r| r.error.is_none()).collect();
        let mut errors: Vec<ErrorCount> = Vec::new();
        for message in results.iter().filter_map(|r| r.error.as_ref()) {
            if let Some(e) = errors.iter_mut().find(|e| &e.message == message) {
                e.count += 1;
            } else if errors.len() < MAX_ERRORS {
                errors.push(ErrorCount {
                    message: message.clone(),
                    count: 1,
                });
            }
        }
        let input_tokens: usize = ok.iter().map(|r| r.prompt_tokens).sum();
        let output_tokens: usize = ok.iter().map(|r| r.output_tokens).sum();
        let secs = duration.as_secs_f64().max(f64::MIN_POSITIVE);
        let tpot = ok.iter().filter_map(|r| match (r.ttft, r.output_tokens) {
            (Some(ttft), n) if n > 1 => Some(ms(r.latency.saturating_sub(ttft)) / (n - 1) as f64),
            _ => None,
        });
        Report {
            completed: ok.len(),
            failed: results.len() - ok.len(),
            errors,
            duration_s: duration.as_secs_f64(),
            request_throughput: ok.len() as f64 / secs,
            output_throughput: output_tokens as f64 / secs,
            total_token_throughput: (input_tokens + output_tokens) as f64 / secs,
            input_tokens,
            output_tokens,
            requests_without_usage: ok.iter().filter(|r| !r.usage_reported).count(),
            ttft_ms: Stats::of(ok.iter().filter_map(|r| r.ttft.map(ms)).collect()),
            itl_ms: Stats::of(
                ok.iter()
                    .flat_map(|r| r.itl.iter().copied().map(ms))
                    .collect(),
            ),
            e2e_ms: Stats::of(ok.iter().map(|r| ms(r.latency)).collect()),
            tpot_ms: Stats::of(tpot.collect()),
            results,
        }
    }

    /// The report as a text table for people.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let mut row = |name: &str, value: String| {
            let _ = writeln!(s, "{name:<34}{value:>14}");
        };
        row("Requests completed", self.completed.to_string());
        row("Requests failed", self.failed.to_string());
        row("Duration (s)", format!("{:.2}", self.duration_s));
        row("Input tokens", self.input_tokens.to_string());
        row("Output tokens", self.output_tokens.to_string());
        row(
            "Request throughput (req/s)",
            format!("{:.2}", self.request_throughput),
        );
        row(
            "Output token throughput (tok/s)",
            format!("{:.2}", self.output_throughput),
        );
        row(
            "Total token throughput (tok/s)",
            format!("{:.2}", self.total_token_throughput),
        );
        if self.requests_without_usage > 0 {
            let _ = writeln!(
                s,
                "({} requests had no usage chunk: their token counts are estimates)",
                self.requests_without_usage
            );
        }
        for e in &self.errors {
            let _ = writeln!(s, "error ({}x): {}", e.count, e.message);
        }
        let _ = writeln!(
            s,
            "{:<12}{:>10}{:>10}{:>10}{:>10}{:>10}",
            "(ms)", "mean", "p50", "p90", "p99", "max"
        );
        for (name, stats) in [
            ("TTFT", &self.ttft_ms),
            ("ITL", &self.itl_ms),
            ("E2E", &self.e2e_ms),
            ("TPOT", &self.tpot_ms),
        ] {
            let _ = match stats {
                Some(t) => writeln!(
                    s,
                    "{name:<12}{:>10.2}{:>10.2}{:>10.2}{:>10.2}{:>10.2}",
                    t.mean, t.p50, t.p90, t.p99, t.max
                ),
                None => writeln!(s, "{name:<12}{:>10}", "-"),
            };
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        // np.percentile([1, 2, 3, 4], [0, 25, 50, 90, 99, 100]) = 1, 1.75, 2.5, 3.7, 3.97, 4
        let v = [1.0, 2.0, 3.0, 4.0];
        let want = [
            (0.0, 1.0),
            (25.0, 1.75),
            (50.0, 2.5),
            (90.0, 3.7),
            (99.0, 3.97),
            (100.0, 4.0),
        ];
        for (p, x) in want {
            assert!((percentile(&v, p).unwrap() - x).abs() < 1e-12, "p{p}");
        }
        // np.percentile([10, 20, 40, 80, 160], 90) = 80 + 0.6 * 80 = 128
        assert!((percentile(&[10.0, 20.0, 40.0, 80.0, 160.0], 90.0).unwrap() - 128.0).abs() < 1e-9);
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        let s = Stats::of(vec![4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!((s.mean, s.p50, s.max), (2.5, 2.5, 4.0));
        assert!(Stats::of(vec![]).is_none());
    }

    #[test]
    fn report_sums_up_results() {
        let d = Duration::from_millis;
        let ok = |ttft, itl: Vec<u64>, latency, out| RequestResult {
            ttft: Some(d(ttft)),
            itl: itl.into_iter().map(d).collect(),
            latency: d(latency),
            prompt_tokens: 10,
            output_tokens: out,
            usage_reported: true,
            ..Default::default()
        };
        let results = vec![
            ok(100, vec![10, 30], 140, 3),
            ok(200, vec![], 200, 1),
            RequestResult::failed("boom".into(), d(5)),
            RequestResult::failed("boom".into(), d(5)),
            RequestResult::failed("bang".into(), d(5)),
        ];
        let r = Report::new(results, Duration::from_secs(2));
        assert_eq!((r.completed, r.failed), (2, 3));
        assert_eq!(
            r.errors[0],
            ErrorCount {
                message: "boom".into(),
                count: 2
            }
        );
        assert_eq!(r.errors[1].count, 1);
        assert_eq!(
            (r.input_tokens, r.output_tokens, r.requests_without_usage),
            (20, 4, 0)
        );
        assert_eq!(
            (
                r.request_throughput,
                r.output_throughput,
                r.total_token_throughput
            ),
            (1.0, 2.0, 12.0)
        );
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(r.ttft_ms.unwrap().mean, 150.0));
        assert!(close(r.itl_ms.unwrap().mean, 20.0));
        assert!(close(r.e2e_ms.unwrap().max, 200.0));
        // Only the first request has tokens after the first: (140 - 100) / 2.
        assert!(close(r.tpot_ms.unwrap().p99, 20.0));
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["failed"], 3);
        assert!(json.get("results").is_none());
        assert!(r.table().contains("error (2x): boom"));
    }
}
