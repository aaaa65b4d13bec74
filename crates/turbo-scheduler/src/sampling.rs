//! Turning logits into the next token: greedy, or sampled after penalties and truncation.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
pub use turbo_core::sampling::argmax;
use turbo_core::sampling::{sample_row, PenaltyRow, SampleParams};

/// How the next token is chosen. A temperature of 0 is greedy decoding (the other fields, but the
/// repetition penalty, are then ignored).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1 keeps all.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 keeps all.
    pub min_p: f32,
    /// HF-style penalty on tokens already in the sequence (prompt and generated): positive
    /// logits divided by it, negative ones multiplied; 1 disables it.
    pub repetition_penalty: f32,
    /// OpenAI's: subtracted from a token's logit once per time it was generated; 0 disables it.
    pub frequency_penalty: f32,
    /// OpenAI's: subtracted from the logit of every token generated at least once.
    pub presence_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
        }
    }
}

/// The repetition penalties a request may ask for (1 is none; HF's definition).
pub const REPETITION_PENALTY_RANGE: std::ops::RangeInclusive<f32> = 0.001..=1000.0;

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        // A penalty divides (or multiplies) logits: far from 1 it takes them past f32's range,
        // and the step's distribution would be made of infinities.
        if !(REPETITION_PENALTY_RANGE).contains(&self.repetition_penalty) {
            return Err(format!(
                "repetition_penalty must be in [{}, {}], got {}",
                REPETITION_PENALTY_RANGE.start(),
                REPETITION_PENALTY_RANGE.end(),
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        Ok(())
    }
}

/// A request's seeded source of [`SampleParams`]: the same seed and history give the same
/// tokens. The uniform number of each draw comes from the request's own generator, so a request's
/// tokens do not depend on what else shares its batch.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Distinct penalized tokens of the history, in first-seen order, and how often each was
    /// generated (prompt tokens count 0).
    tokens: Vec<u32>,
    counts: Vec<u32>,
    index: HashMap<u32, usize>,
    /// History tokens already looked at.
    covered: usize,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Sampler {
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            params,
            tokens: Vec::new(),
            counts: Vec::new(),
            index: HashMap::new(),
            covered: 0,
        }
    }

    /// Whether a penalty applies, so that each draw depends on every token before it.
    pub fn has_penalties(&self) -> bool {
        let p = &self.params;
        p.repetition_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0
    }

    /// The parameters of the next token's draw (drawing its uniform number when it samples).
    pub fn next_params(&mut self) -> SampleParams {
        let p = &self.params;
        let sampled = p.temperature > 0.0;
        SampleParams {
            temperature: p.temperature,
            top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            uniform: if sampled {
                self.rng.random::<f32>()
            } else {
                0.0
            },
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
        }
    }

    /// The tokens of `history` (the sequence so far, which only grows between calls; its first
    /// `prompt` tokens are the prompt) that the penalties apply to, each once, with its count of
    /// generated occurrences. The repetition penalty lists every distinct token; the frequency
    /// and presence penalties alone list only generated ones. Empty without a penalty.
    pub fn penalties(&mut self, history: &[u32], prompt: usize) -> PenaltyRow<'_> {
        let p = &self.params;
        let repetition = p.repetition_penalty != 1.0;
        if !repetition && p.frequency_penalty == 0.0 && p.presence_penalty == 0.0 {
            return PenaltyRow::default();
        }
        if history.len() < self.covered {
            self.tokens.clear();
            self.counts.clear();
            self.index.clear();
            self.covered = 0;
        }
        for (i, &t) in history.iter().enumerate().skip(self.covered) {
            let generated = i >= prompt;
            if !generated && !repetition {
                continue;
            }
            let at = *self.index.entry(t).or_insert_with(|| {
                self.tokens.push(t);
                self.counts.push(0);
                self.tokens.len() - 1
            });
            self.counts[at] += u32::from(generated);
        }
        self.covered = history.len();
        PenaltyRow {
            tokens: &self.tokens,
            counts: &self.counts,
        }
    }

    /// Picks the next token from `logits` (modified in place), given the sequence so far, of
    /// which the first `prompt` tokens are the prompt.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32], prompt: usize) -> u32 {
        let params = self.next_params();
        sample_row(logits, &params, self.penalties(history, prompt))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0], &[], 0), 1);
    }

    #[test]
    fn penalized_tokens_are_distinct_and_follow_the_history() {
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 1.3,
            ..Default::default()
        });
        let row = |t: &[u32], c: &[u32]| (t.to_vec(), c.to_vec());
        let got = |r: PenaltyRow<'_>| (r.tokens.to_vec(), r.counts.to_vec());
        assert_eq!(got(s.penalties(&[4, 2, 4], 3)), row(&[4, 2], &[0, 0]));
        assert_eq!(
            got(s.penalties(&[4, 2, 4, 9, 2], 3)),
            row(&[4, 2, 9], &[0, 1, 1])
        );
        // A shorter history (a new conversation) starts over.
        assert_eq!(got(s.penalties(&[7], 1)), row(&[7], &[0]));
        let mut off = Sampler::new(SamplingParams::default());
        assert!(off.penalties(&[1, 2, 3], 1).tokens.is_empty());
        // Frequency and presence penalties alone list generated tokens only, with their counts.
        let mut freq = Sampler::new(SamplingParams {
            frequency_penalty: 0.5,
            ..Default::default()
        });
        assert_eq!(
            got(freq.penalties(&[1, 2, 3, 3, 5, 3], 3)),
            row(&[3, 5], &[2, 1])
        );
        assert_eq!(
            got(freq.penalties(&[1, 2, 3, 3, 5, 3, 1], 3)),
            row(&[3, 5, 1], &[2, 1, 1])
        );
    }

    #[test]
    fn out_of_range_penalties_are_refused() {
        for (f, p) in [(2.5, 0.0), (0.0, -3.0), (f32::NAN, 0.0)] {
            let params = SamplingParams {
                frequency_penalty: f,
                presence_penalty: p,
                ..Default::default()
            };
            assert!(params.validate().is_err(), "{f} {p}");
        }
    }

    #[test]
    fn greedy_draws_nothing_from_the_generator() {
        let params = SamplingParams {
            temperature: 0.0,
            seed: 5,
            ..Default::default()
        };
        let mut s = Sampler::new(params);
        assert_eq!(s.next_params().uniform, 0.0);
        assert_eq!(s.next_params(), s.next_params());
    }

    #[test]
    fn repetition_penalties_far_from_one_are_refused() {
        let with = |p: f32| SamplingParams {
            repetition_penalty: p,
            ..SamplingParams::default()
        };
        for p in [1.0, 0.5, 2.0, 0.001, 1000.0] {
            assert!(with(p).validate().is_ok(), "{p}");
        }
        for p in [1e-45, 0.0, -1.0, 1e4, f32::INFINITY, f32::NAN] {
            let msg = with(p).validate().unwrap_err();
            assert!(msg.contains("repetition_penalty must be in"), "{p}: {msg}");
        }
    }

    #[test]
    fn repetition_penalty_follows_hf() {
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        let mut logits = [4.0, 3.0, -1.0];
        assert_eq!(s.sample(&mut logits, &[0, 0, 2], 3), 1);
        assert_eq!(logits, [2.0, 3.0, -2.0]);
    }

    #[test]
    fn truncation_keeps_only_allowed_tokens() {
        let logits = [5.0f32, 4.9, 1.0, 0.0, -3.0];
        for (params, allowed) in [
            (
                SamplingParams {
                    temperature: 1.0,
                    top_k: 2,
                    ..Default::default()
                },
                vec![0, 1],
            ),
            (
                SamplingParams {
                    temperature: 1.0,
                    top_p: 0.5,
                    ..Default::default()
                },
                vec![0],
            ),
            (
                SamplingParams {
                    temperature: 1.0,
                    min_p: 0.5,
                    ..Default::default()
                },
                vec![0, 1],
            ),
        ] {
            let mut s = Sampler::new(SamplingParams { seed: 9, ..params });
            let mut seen = std::collections::BTreeSet::new();
            for _ in 0..300 {
                seen.insert(s.sample(&mut logits.clone(), &[], 0));
            }
            assert_eq!(seen.into_iter().collect::<Vec<_>>(), allowed);
        }
    }

    #[test]
    fn sampling_follows_the_distribution_and_the_seed() {
        let logits = [0.0f32, (3.0f32).ln()]; // probabilities 1/4, 3/4
        let params = SamplingParams {
            temperature: 1.0,
            seed: 42,
            ..Default::default()
        };
        let draw = |params: &SamplingParams| {
            let mut s = Sampler::new(params.clone());
            (0..4000)
                .map(|_| s.sample(&mut logits.clone(), &[], 0))
                .collect::<Vec<_>>()
        };
        let a = draw(&params);
        assert_eq!(a, draw(&params), "same seed, same tokens");
        let ones = a.iter().filter(|&&t| t == 1).count() as f64 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
        assert_ne!(a, draw(&SamplingParams { seed: 43, ..params }));
    }
}
