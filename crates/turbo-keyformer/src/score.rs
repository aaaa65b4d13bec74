//! How one attention-logits row turns into score increments, in f32 (what the engine runs) and
//! in f64 (the reference that kernels are tested against).

use crate::gumbel::{gumbel, gumbel_uniform};
use crate::Error;

/// Identifies one logits row: which noise stream it draws from and which temperature applies.
///
/// A config struct rather than a long argument list because kernels and the CPU path pass the
/// same fields.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct StepContext {
    /// The sequence's noise seed: same seed, same noise, same choices.
    pub seed: u64,
    /// Position of the query token in the sequence (0-based); the noise counter's `step`. Unique
    /// per row, so each prompt row and each decoding step draws fresh noise.
    pub query_pos: u32,
    /// Decoding iteration driving the temperature: 0 for the prompt pass (every prompt row), `t`
    /// for the `t`-th forward pass after it.
    pub iteration: u32,
    /// Number of iterations planned (the request's maximum new tokens); the temperature reaches
    /// `tau_end` there.
    pub total_iterations: u32,
    /// Layer index; part of the noise counter.
    pub layer: u32,
    /// Query head index; part of the noise counter. Its increments go into the accumulator of its
    /// KV head (`q_head / (q_heads / kv_heads)` under GQA), so query heads sharing a KV head sum.
    pub q_head: u32,
}

/// Keyformer's temperature schedule, validated at construction so that a division by a zero or
/// non-finite temperature cannot happen later.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TauSchedule {
    start: f32,
    end: f32,
}

impl TauSchedule {
    /// The paper's setting: `tau_start = 1` (plain softmax in the prompt pass), `tau_end = 2`.
    pub const PAPER: Self = Self {
        start: 1.0,
        end: 2.0,
    };

    /// A linear schedule from `start` to `end`; both must be finite and positive.
    pub fn new(start: f32, end: f32) -> Result<Self, Error> {
        let ok = |t: f32| t.is_finite() && t > 0.0;
        if ok(start) && ok(end) {
            Ok(Self { start, end })
        } else {
            Err(Error::Temperature { start, end })
        }
    }

    pub fn start(&self) -> f32 {
        self.start
    }

    pub fn end(&self) -> f32 {
        self.end
    }

    /// The temperature at `iteration` of `total` (the reference implementation's schedule,
    /// `tau_delta = (tau_end - tau_start) / max_new_tokens`), computed in f32 exactly as:
    ///
    /// `start + (end - start) * (min(iteration, total) as f32 / max(total, 1) as f32)`
    ///
    /// so iteration 0 (the prompt pass) is `start`, and `end` is reached at `total`.
    pub fn tau(&self, iteration: u32, total: u32) -> f32 {
        let progress = iteration.min(total) as f32 / total.max(1) as f32;
        self.start + (self.end - self.start) * progress
    }
}

impl Default for TauSchedule {
    fn default() -> Self {
        Self::PAPER
    }
}

/// What a policy accumulates per cached key; also tells a GPU kernel what to compute.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScoreFunction {
    /// No scores (Full, Window, StreamingLLM): the engine skips the work.
    None,
    /// H2O: the plain attention probabilities, `softmax(x)`.
    Softmax,
    /// Keyformer: `softmax((x + g) / tau)` with fresh Gumbel noise `g` and the scheduled `tau`.
    GumbelSoftmax(TauSchedule),
}

impl ScoreFunction {
    pub fn needs_scores(&self) -> bool {
        !matches!(self, Self::None)
    }

    /// Adds one row's increments into `acc`.
    ///
    /// `logits[j]` is `q·k_j / sqrt(d)` for the `j`-th cached key. A row shorter than `acc` (a
    /// prompt row sees only keys up to its own position) adds into the leading slots; logits past
    /// `acc.len()` are ignored. Non-finite logits (`-inf` masks, NaN) are masked: they add 0. A
    /// row with at least one finite logit adds increments summing to 1; a fully masked row adds
    /// nothing. The noise of slot `j` is `gumbel(seed, query_pos, layer, q_head, j as u32)`.
    pub fn accumulate(&self, logits: &[f32], ctx: &StepContext, acc: &mut [f32]) {
        let tau = match self {
            Self::None => return,
            Self::Softmax => None,
            Self::GumbelSoftmax(schedule) => {
                Some(schedule.tau(ctx.iteration, ctx.total_iterations))
            }
        };
        let n = logits.len().min(acc.len());
        let (logits, acc) = (&logits[..n], &mut acc[..n]);
        let adjusted = |j: usize, x: f32| match tau {
            None => x,
            Some(tau) => {
                (x + gumbel(ctx.seed, ctx.query_pos, ctx.layer, ctx.q_head, j as u32)) / tau
            }
        };
        // Two passes over the row: the shifted exponentials are kept in a scratch buffer so that
        // each noise value is drawn once.
        let mut max = f32::NEG_INFINITY;
        let mut shifted = Vec::with_capacity(n);
        for (j, &x) in logits.iter().enumerate() {
            let y = if x.is_finite() {
                // A huge logit divided by tau < 1 may overflow; clamping keeps `y - max` finite.
                adjusted(j, x).min(f32::MAX)
            } else {
                f32::NEG_INFINITY
            };
            max = max.max(y);
            shifted.push(y);
        }
        if !max.is_finite() {
            return;
        }
        let mut sum = 0.0f32;
        for y in &mut shifted {
            *y = (*y - max).exp();
            sum += *y;
        }
        // sum >= 1: the maximum contributes exp(0).
        let inv = 1.0 / sum;
        for (a, e) in acc.iter_mut().zip(&shifted) {
            *a += e * inv;
        }
    }
}

/// The f64 reference of [`ScoreFunction::accumulate`]: the increments of one row, for testing
/// CPU and GPU kernels. Same conventions (masking, truncation is up to the caller: the result has
/// `logits.len()` entries); the noise uses the same bit-exact uniforms, with the logarithms, the
/// exponentials and the sums in f64. The temperature is the schedule's f32 value.
pub fn score_increment_reference(
    score: &ScoreFunction,
    logits: &[f32],
    ctx: &StepContext,
) -> Vec<f64> {
    let mut out = vec![0.0f64; logits.len()];
    let tau = match score {
        ScoreFunction::None => return out,
        ScoreFunction::Softmax => None,
        ScoreFunction::GumbelSoftmax(schedule) => {
            Some(f64::from(schedule.tau(ctx.iteration, ctx.total_iterations)))
        }
    };
    for (j, (o, &x)) in out.iter_mut().zip(logits).enumerate() {
        *o = if x.is_finite() {
            let x = f64::from(x);
            match tau {
                None => x,
                Some(tau) => {
                    let u = f64::from(gumbel_uniform(
                        ctx.seed,
                        ctx.query_pos,
                        ctx.layer,
                        ctx.q_head,
                        j as u32,
                    ));
                    (x - (-u.ln()).ln()) / tau
                }
            }
        } else {
            f64::NEG_INFINITY
        };
    }
    let max = out.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if !max.is_finite() {
        out.fill(0.0);
        return out;
    }
    for y in &mut out {
        *y = (*y - max).exp();
    }
    let sum: f64 = out.iter().sum();
    for y in &mut out {
        *y /= sum;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> StepContext {
        StepContext {
            seed: 3,
            query_pos: 10,
            iteration: 2,
            total_iterations: 8,
            layer: 1,
            q_head: 5,
        }
    }

    #[test]
    fn tau_schedule_is_linear_and_clamped() {
        let s = TauSchedule::PAPER;
        assert_eq!(s.tau(0, 100), 1.0);
        assert_eq!(s.tau(50, 100), 1.5);
        assert_eq!(s.tau(100, 100), 2.0);
        assert_eq!(s.tau(1000, 100), 2.0);
        assert_eq!(s.tau(7, 0), 1.0);
        assert!(TauSchedule::new(0.0, 2.0).is_err());
        assert!(TauSchedule::new(1.0, f32::INFINITY).is_err());
        assert!(TauSchedule::new(f32::NAN, 1.0).is_err());
        assert!(TauSchedule::new(-1.0, 1.0).is_err());
        assert_eq!(TauSchedule::new(2.0, 1.0).map(|s| s.tau(1, 2)), Ok(1.5));
    }

    #[test]
    fn softmax_matches_hand_computation() {
        let mut acc = vec![1.0f32; 3];
        ScoreFunction::Softmax.accumulate(&[0.0, 0.0, 2.0f32.ln()], &ctx(), &mut acc);
        // exp: 1, 1, 2 → 0.25, 0.25, 0.5 added to 1.
        for (a, want) in acc.iter().zip([1.25, 1.25, 1.5]) {
            assert!((a - want).abs() < 1e-6, "{a} {want}");
        }
    }

    #[test]
    fn none_adds_nothing() {
        let mut acc = vec![0.5f32; 4];
        ScoreFunction::None.accumulate(&[1.0, 2.0, 3.0, 4.0], &ctx(), &mut acc);
        assert_eq!(acc, vec![0.5; 4]);
        assert_eq!(
            score_increment_reference(&ScoreFunction::None, &[1.0, 2.0], &ctx()),
            vec![0.0, 0.0]
        );
    }

    #[test]
    fn gumbel_softmax_matches_its_definition() {
        let logits = [0.3f32, -1.0, 2.5, 0.0, f32::NEG_INFINITY];
        let c = ctx();
        let schedule = TauSchedule::PAPER;
        let tau = schedule.tau(c.iteration, c.total_iterations);
        let ys: Vec<f64> = logits
            .iter()
            .enumerate()
            .map(|(j, &x)| {
                let g = gumbel(c.seed, c.query_pos, c.layer, c.q_head, j as u32);
                f64::from((x + g) / tau)
            })
            .collect();
        let z: f64 = ys.iter().map(|y| y.exp()).sum();
        let mut acc = vec![0.0f32; logits.len()];
        ScoreFunction::GumbelSoftmax(schedule).accumulate(&logits, &c, &mut acc);
        for (a, y) in acc.iter().zip(&ys) {
            assert!((f64::from(*a) - y.exp() / z).abs() < 1e-6);
        }
        assert_eq!(acc[4], 0.0);
    }

    #[test]
    fn short_rows_fill_leading_slots_and_long_rows_are_truncated() {
        let mut acc = vec![0.0f32; 4];
        ScoreFunction::Softmax.accumulate(&[1.0, 1.0], &ctx(), &mut acc);
        assert_eq!(acc, vec![0.5, 0.5, 0.0, 0.0]);
        let mut acc = vec![0.0f32; 2];
        ScoreFunction::Softmax.accumulate(&[1.0, 1.0, 1.0, 1.0], &ctx(), &mut acc);
        assert_eq!(acc, vec![0.5, 0.5]);
    }

    #[test]
    fn empty_and_masked_rows_add_nothing() {
        let schedule = ScoreFunction::GumbelSoftmax(TauSchedule::PAPER);
        for score in [ScoreFunction::Softmax, schedule] {
            let mut acc: Vec<f32> = Vec::new();
            score.accumulate(&[], &ctx(), &mut acc);
            score.accumulate(&[1.0], &ctx(), &mut acc);
            let mut acc = vec![0.25f32; 3];
            score.accumulate(
                &[f32::NEG_INFINITY, f32::NAN, f32::INFINITY],
                &ctx(),
                &mut acc,
            );
            assert_eq!(acc, vec![0.25; 3]);
            assert_eq!(
                score_increment_reference(&score, &[f32::NEG_INFINITY; 2], &ctx()),
                vec![0.0, 0.0]
            );
            assert!(score_increment_reference(&score, &[], &ctx()).is_empty());
            // A single key takes all the mass.
            let mut acc = vec![0.0f32; 1];
            score.accumulate(&[-3.0], &ctx(), &mut acc);
            assert_eq!(acc, vec![1.0]);
        }
    }

    #[test]
    fn extreme_logits_stay_finite() {
        let logits = [1e30f32, -1e30, 0.0, f32::MAX, f32::MIN];
        let cold = TauSchedule::new(0.25, 0.25).unwrap();
        for score in [
            ScoreFunction::Softmax,
            ScoreFunction::GumbelSoftmax(TauSchedule::PAPER),
            // tau < 1 overflows f32::MAX / tau; the clamp keeps the row finite.
            ScoreFunction::GumbelSoftmax(cold),
        ] {
            let mut acc = vec![0.0f32; logits.len()];
            score.accumulate(&logits, &ctx(), &mut acc);
            assert!(acc.iter().all(|a| a.is_finite() && *a >= 0.0), "{acc:?}");
            let sum: f32 = acc.iter().sum();
            assert!((sum - 1.0).abs() < 1e-6, "{sum}");
        }
    }
}
