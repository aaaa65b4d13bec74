//! What to send: prompts files and synthetic ShareGPT-like workloads.

use crate::LoadgenError;
use rand::seq::IndexedRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, LogNormal};
use serde::Deserialize;
use std::path::Path;

/// One completion request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub prompt: String,
    pub max_tokens: usize,
}

/// The requests of one benchmark run, in sending order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Workload {
    pub requests: Vec<Request>,
}

/// One line of a prompts file, as `turbo generate --prompts-file` reads it; unknown fields are
/// refused so that a misspelt `max_tokens` is not silently replaced by the default.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct Line {
    prompt: String,
    max_tokens: Option<usize>,
    temperature: Option<f64>,
    seed: Option<u64>,
    session: Option<String>,
}

/// Common English words, about one token each in LLaMA-style vocabularies; the list of
/// `benches/sharegpt_like.py`, so prompt lengths in words approximate lengths in tokens.
pub const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at",
    "from", "his", "her", "it", "an", "are", "were", "which", "be", "this", "had", "not", "but",
    "they", "have", "one", "all", "their", "there", "been", "has", "when", "who", "will", "more",
    "no", "if", "out", "so", "said", "what", "up", "its", "about", "into", "than", "them", "can",
    "only", "other", "new", "some", "could", "time", "these", "two", "may", "then", "do", "first",
    "any", "my", "now", "such", "like", "our", "over", "man", "me", "even", "most", "made",
    "after", "also", "did", "many", "before", "must", "through", "back", "years", "where", "much",
    "your", "way", "well", "down", "should", "because", "each", "just", "those", "people", "how",
    "too", "little", "state", "good", "very", "make", "world", "still", "own", "see", "men",
    "work", "long", "get", "here", "between", "both", "life", "being", "under", "never", "day",
    "same", "another", "know", "while", "last", "might", "us", "great", "old", "year", "off",
    "come", "since", "against", "go", "came", "right", "used", "take", "three",
];

/// A synthetic ShareGPT-like workload, as `benches/sharegpt_like.py` writes: log-normal lengths
/// (sigma 0.8, long-tailed like ShareGPT conversations) scaled to the means and clipped to
/// [4, 4 * mean], unless fixed; prompts of random [`WORDS`]. The same seed gives the same
/// requests (though not the script's, whose generator differs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Synthetic {
    pub requests: usize,
    /// Mean prompt length in words.
    pub mean_in: usize,
    /// Mean `max_tokens`.
    pub mean_out: usize,
    /// Every prompt this many words long, instead of drawn lengths.
    pub fixed_in: Option<usize>,
    /// Every `max_tokens` this, instead of drawn lengths.
    pub fixed_out: Option<usize>,
    pub seed: u64,
}

impl Default for Synthetic {
    /// The script's defaults.
    fn default() -> Self {
        Synthetic {
            requests: 1000,
            mean_in: 200,
            mean_out: 180,
            fixed_in: None,
            fixed_out: None,
            seed: 0,
        }
    }
}

impl Workload {
    /// Reads a prompts file (one JSON object a line with `prompt` and optional `max_tokens`,
    /// `temperature`, `seed`, `session`; blank lines skipped); `default_max_tokens` fills in
    /// missing `max_tokens`.
    pub fn from_jsonl(path: &Path, default_max_tokens: usize) -> Result<Self, LoadgenError> {
        let text = std::fs::read_to_string(path).map_err(|source| LoadgenError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse_jsonl(&text, &path.display().to_string(), default_max_tokens)
    }

    /// [`Workload::from_jsonl`] on text already read; `source` names it in errors.
    pub fn parse_jsonl(
        text: &str,
        source: &str,
        default_max_tokens: usize,
    ) -> Result<Self, LoadgenError> {
        let bad = |line, message: String| LoadgenError::BadLine {
            file: source.to_string(),
            line,
            message,
        };
        let mut requests = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let line: Line = serde_json::from_str(line)
                .map_err(|e| bad(i + 1, format!("not a request object: {e}")))?;
            requests.push(Request {
                prompt: line.prompt,
                max_tokens: line.max_tokens.unwrap_or(default_max_tokens),
            });
        }
        if requests.is_empty() {
            return Err(LoadgenError::Config(format!("{source} holds no requests")));
        }
        Ok(Workload { requests })
    }

    /// Draws a synthetic workload; lengths are drawn before prompts, in the script's order.
    pub fn synthetic(spec: &Synthetic) -> Result<Self, LoadgenError> {
        let positive = |what: &str, n: usize| match n {
            0 => Err(LoadgenError::Config(format!("{what} must be at least 1"))),
            _ => Ok(n),
        };
        let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
        let mut lengths = |fixed: Option<usize>, mean: usize, what: &str| match fixed {
            Some(n) => Ok(vec![positive(what, n)?; spec.requests]),
            None => lognormal_lengths(&mut rng, spec.requests, positive(what, mean)?),
        };
        let ins = lengths(spec.fixed_in, spec.mean_in, "prompt length")?;
        let outs = lengths(spec.fixed_out, spec.mean_out, "output length")?;
        let requests = ins
            .into_iter()
            .zip(outs)
            .map(|(n_in, max_tokens)| {
                let words: Vec<&str> = (0..n_in)
                    .map(|_| *WORDS.choose(&mut rng).unwrap_or(&"the"))
                    .collect();
                Request {
                    prompt: words.join(" "),
                    max_tokens,
                }
            })
            .collect();
        Ok(Workload { requests })
    }
}

fn lognormal_lengths(
    rng: &mut ChaCha8Rng,
    n: usize,
    mean: usize,
) -> Result<Vec<usize>, LoadgenError> {
    const SIGMA: f64 = 0.8;
    // The mean of a log-normal is exp(mu + sigma^2 / 2).
    let mu = (mean as f64).ln() - SIGMA * SIGMA / 2.0;
    let dist = LogNormal::new(mu, SIGMA).map_err(|e| LoadgenError::Config(e.to_string()))?;
    let cap = 4.0 * mean as f64;
    // Python's round() rounds halves to even; min before max, as the script does.
    Ok((0..n)
        .map(|_| dist.sample(rng).round_ties_even().min(cap).max(4.0) as usize)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn jsonl_lines_defaults_and_errors() {
        let text = "{\"prompt\": \"a b\", \"max_tokens\": 5, \"temperature\": 0.5, \"seed\": 1, \
                    \"session\": \"s\"}\n\n  \r\n{\"prompt\": \"c\"}\r\n";
        let w = Workload::parse_jsonl(text, "x.jsonl", 64).unwrap();
        assert_eq!(
            w.requests,
            vec![
                Request {
                    prompt: "a b".into(),
                    max_tokens: 5
                },
                Request {
                    prompt: "c".into(),
                    max_tokens: 64
                },
            ]
        );
        for (text, line) in [
            ("{\"prompt\": \"a\"}\n\n{\"prompt\": 3}\n", 3),
            ("{\"prompt\": \"a\"}\n{\"max_tokens\": 3}\n", 2),
            ("not json\n", 1),
            ("{\"prompt\": \"a\", \"max_token\": 3}\n", 1),
            ("{\"prompt\": \"a\", \"max_tokens\": -3}\n", 1),
        ] {
            let err = Workload::parse_jsonl(text, "x.jsonl", 64)
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(&format!("x.jsonl line {line}: ")), "{err}");
        }
        assert!(Workload::parse_jsonl("\n \n", "x.jsonl", 64).is_err());
    }

    #[test]
    fn jsonl_file_errors_name_the_file() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, "{{\"prompt\": \"hello\", \"max_tokens\": 7}}\n{{oops").unwrap();
        let err = Workload::from_jsonl(f.path(), 16).unwrap_err().to_string();
        assert_eq!(
            err.split(": ").next().unwrap(),
            format!("{} line 2", f.path().display())
        );
        let missing = f.path().with_extension("missing");
        let err = Workload::from_jsonl(&missing, 16).unwrap_err().to_string();
        assert!(err.starts_with("cannot read "), "{err}");
    }

    #[test]
    fn synthetic_is_deterministic_and_bounded() {
        let spec = Synthetic {
            requests: 2000,
            mean_in: 50,
            mean_out: 30,
            seed: 3,
            ..Default::default()
        };
        let a = Workload::synthetic(&spec).unwrap();
        assert_eq!(a, Workload::synthetic(&spec).unwrap());
        let other = Workload::synthetic(&Synthetic {
            seed: 4,
            ..spec.clone()
        })
        .unwrap();
        assert_ne!(a, other);
        let ins: Vec<usize> = a
            .requests
            .iter()
            .map(|r| r.prompt.split(' ').count())
            .collect();
        let outs: Vec<usize> = a.requests.iter().map(|r| r.max_tokens).collect();
        assert!(ins.iter().all(|&n| (4..=200).contains(&n)));
        assert!(outs.iter().all(|&n| (4..=120).contains(&n)));
        assert!(a
            .requests
            .iter()
            .all(|r| r.prompt.split(' ').all(|w| WORDS.contains(&w))));
        // Clipping trims both tails a little; the means stay within 10% of the targets.
        let mean = |v: &[usize]| v.iter().sum::<usize>() as f64 / v.len() as f64;
        assert!((mean(&ins) / 50.0 - 1.0).abs() < 0.1, "{}", mean(&ins));
        assert!((mean(&outs) / 30.0 - 1.0).abs() < 0.1, "{}", mean(&outs));
        // Long-tailed: lengths vary widely.
        assert!(ins.iter().max().unwrap() > &100 && ins.iter().min().unwrap() < &20);

        let fixed = Synthetic {
            requests: 5,
            fixed_in: Some(8),
            fixed_out: Some(3),
            ..spec
        };
        let w = Workload::synthetic(&fixed).unwrap();
        assert!(w
            .requests
            .iter()
            .all(|r| r.prompt.split(' ').count() == 8 && r.max_tokens == 3));
        assert!(Workload::synthetic(&Synthetic {
            mean_in: 0,
            ..Default::default()
        })
        .is_err());
    }
}
