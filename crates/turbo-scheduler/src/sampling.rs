//! Turning logits into the next token: greedy, or sampled after penalties and truncation.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

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
    /// HF-style penalty on tokens already in the sequence: positive logits divided by it, negative
    /// ones multiplied; 1 disables it.
    pub repetition_penalty: f32,
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
            seed: 0,
        }
    }
}

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
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        Ok(())
    }
}

/// A seeded sampler: the same seed, logits and history give the same tokens.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Sampler {
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            params,
            candidates: Vec::new(),
        }
    }

    /// Picks the next token from `logits` (modified in place), given the sequence so far.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let mut seen = vec![false; logits.len()];
            for &t in history {
                if let Some(s) = seen.get_mut(t as usize) {
                    if !*s {
                        *s = true;
                        let l = &mut logits[t as usize];
                        *l = if *l > 0.0 {
                            *l / p.repetition_penalty
                        } else {
                            *l * p.repetition_penalty
                        };
                    }
                }
            }
        }
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, l / p.temperature)),
        );
        let by_logit_desc =
            |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, by_logit_desc);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(by_logit_desc);
        // Softmax over the survivors, then top-p and min-p on the probabilities.
        let max = c[0].1;
        for x in c.iter_mut() {
            x.1 = (x.1 - max).exp();
        }
        let total: f32 = c.iter().map(|x| x.1).sum();
        let mut keep = c.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, x) in c.iter().enumerate() {
                cum += x.1 / total;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = p.min_p * c[0].1;
            keep = keep.min(c.iter().take_while(|x| x.1 >= floor).count().max(1));
        }
        c.truncate(keep);
        let kept: f32 = c.iter().map(|x| x.1).sum();
        let mut r = self.rng.random::<f32>() * kept;
        for x in c.iter() {
            r -= x.1;
            if r < 0.0 {
                return x.0;
            }
        }
        c[c.len() - 1].0
    }
}

/// Index of the largest logit, the lowest index on ties (as torch.argmax).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0], &[]), 1);
    }

    #[test]
    fn repetition_penalty_follows_hf() {
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        let mut logits = [4.0, 3.0, -1.0];
        assert_eq!(s.sample(&mut logits, &[0, 0, 2]), 1);
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
                seen.insert(s.sample(&mut logits.clone(), &[]));
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
                .map(|_| s.sample(&mut logits.clone(), &[]))
                .collect::<Vec<_>>()
        };
        let a = draw(&params);
        assert_eq!(a, draw(&params), "same seed, same tokens");
        let ones = a.iter().filter(|&&t| t == 1).count() as f64 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
        assert_ne!(a, draw(&SamplingParams { seed: 43, ..params }));
    }
}
