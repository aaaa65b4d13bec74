//! The eviction policies and the trait the engine drives them through.

use crate::score::{ScoreFunction, StepContext, TauSchedule};
use crate::{Budget, Error};
use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

/// A KV-cache eviction policy, held by the engine as `Box<dyn EvictionPolicy>`.
///
/// The engine feeds every attention-logits row through [`accumulate`](Self::accumulate) into one
/// f32 accumulator per (layer, KV head), and when a sequence's cache outgrows its budget it asks
/// [`select_into`](Self::select_into) which slots to keep, then compacts keys, values and
/// accumulators alike.
pub trait EvictionPolicy: Send + Sync + fmt::Debug {
    /// Which policy this is (for logs and metrics).
    fn kind(&self) -> PolicyKind;

    /// What is accumulated per key; a GPU kernel dispatches on it.
    fn score_function(&self) -> ScoreFunction;

    /// Whether the engine must compute scores at all; `false` skips the extra softmax.
    fn needs_scores(&self) -> bool {
        self.score_function().needs_scores()
    }

    /// Whether the policy ever drops keys; `false` (Full) means the engine never selects.
    fn evicts(&self) -> bool {
        true
    }

    /// The sink count a [`crate::BudgetConfig`] without explicit sinks resolves to.
    fn default_sinks(&self) -> usize {
        0
    }

    /// Adds the score increments of one logits row of one query head into the accumulator of its
    /// KV head (see [`ScoreFunction::accumulate`] for the conventions).
    fn accumulate(&self, logits: &[f32], ctx: &StepContext, acc: &mut [f32]) {
        self.score_function().accumulate(logits, ctx, acc);
    }

    /// Replaces `out` with the kept slots of one (layer, KV head) whose `n = scores.len()` cached
    /// keys have the accumulated `scores` (slot order = position order).
    ///
    /// Contract, checked by [`crate::select_kept`]: exactly `budget.kept_count(n)` slots, strictly
    /// increasing, all `< n`; the count must not depend on the scores, so that every layer and
    /// head keeps as many keys.
    fn select_into(&self, scores: &[f32], budget: &Budget, out: &mut Vec<usize>);

    /// The policy's choice as a [`KeepRule`] for `budget`, when it is one (a backend can then
    /// choose on the device, from scores it never reads back); `None` for a custom choice, which
    /// the engine makes on the host through [`select_into`](Self::select_into). Must choose
    /// exactly what `select_into` does.
    fn keep_rule(&self, budget: &Budget) -> Option<KeepRule> {
        let _ = budget;
        None
    }

    /// [`select_into`](Self::select_into) into a fresh vector.
    fn select(&self, scores: &[f32], budget: &Budget) -> Vec<usize> {
        let mut out = Vec::with_capacity(budget.kept_count(scores.len()));
        self.select_into(scores, budget, &mut out);
        out
    }
}

/// Keyformer (MLSys 2024): keeps the sinks, the `recent` most recent keys, and the rest by the
/// accumulated Gumbel-softmax score `softmax((x + g) / tau)`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Keyformer {
    pub tau: TauSchedule,
}

impl Keyformer {
    /// A Keyformer with the temperature rising linearly from `tau_start` to `tau_end`.
    pub fn new(tau_start: f32, tau_end: f32) -> Result<Self, Error> {
        Ok(Self {
            tau: TauSchedule::new(tau_start, tau_end)?,
        })
    }
}

impl EvictionPolicy for Keyformer {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Keyformer
    }

    fn score_function(&self) -> ScoreFunction {
        ScoreFunction::GumbelSoftmax(self.tau)
    }

    fn keep_rule(&self, budget: &Budget) -> Option<KeepRule> {
        Some(KeepRule::by_score(budget))
    }

    fn select_into(&self, scores: &[f32], budget: &Budget, out: &mut Vec<usize>) {
        select_by_score(scores, budget, out);
    }
}

/// H2O (heavy hitters): like Keyformer, but the score is the plain attention probability,
/// without noise or temperature.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct H2O;

impl EvictionPolicy for H2O {
    fn kind(&self) -> PolicyKind {
        PolicyKind::H2O
    }

    fn score_function(&self) -> ScoreFunction {
        ScoreFunction::Softmax
    }

    fn keep_rule(&self, budget: &Budget) -> Option<KeepRule> {
        Some(KeepRule::by_score(budget))
    }

    fn select_into(&self, scores: &[f32], budget: &Budget, out: &mut Vec<usize>) {
        select_by_score(scores, budget, out);
    }
}

/// Window attention: keeps exactly the `keep` most recent keys (ignores recent and sinks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Window;

impl EvictionPolicy for Window {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Window
    }

    fn score_function(&self) -> ScoreFunction {
        ScoreFunction::None
    }

    fn keep_rule(&self, _budget: &Budget) -> Option<KeepRule> {
        Some(KeepRule::sinks_and_recent(0))
    }

    fn select_into(&self, scores: &[f32], budget: &Budget, out: &mut Vec<usize>) {
        select_sinks_and_recent(scores.len(), budget.keep(), 0, out);
    }
}

/// StreamingLLM: keeps the budget's first `sinks` keys (attention sinks) and fills the rest of
/// the budget with the most recent keys. `sinks` is the default for budgets that do not set one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamingLlm {
    pub sinks: usize,
}

impl StreamingLlm {
    /// The paper's four attention sinks.
    pub const DEFAULT_SINKS: usize = 4;
}

impl Default for StreamingLlm {
    fn default() -> Self {
        Self {
            sinks: Self::DEFAULT_SINKS,
        }
    }
}

impl EvictionPolicy for StreamingLlm {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Sink
    }

    fn score_function(&self) -> ScoreFunction {
        ScoreFunction::None
    }

    fn default_sinks(&self) -> usize {
        self.sinks
    }

    fn keep_rule(&self, budget: &Budget) -> Option<KeepRule> {
        Some(KeepRule::sinks_and_recent(budget.sinks()))
    }

    fn select_into(&self, scores: &[f32], budget: &Budget, out: &mut Vec<usize>) {
        select_sinks_and_recent(scores.len(), budget.keep(), budget.sinks(), out);
    }
}

/// No eviction: the baseline. The engine never selects ([`EvictionPolicy::evicts`] is false); if
/// asked anyway it keeps the most recent keys like [`Window`], so the count contract still holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Full;

impl EvictionPolicy for Full {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Full
    }

    fn score_function(&self) -> ScoreFunction {
        ScoreFunction::None
    }

    fn evicts(&self) -> bool {
        false
    }

    fn keep_rule(&self, _budget: &Budget) -> Option<KeepRule> {
        Some(KeepRule::sinks_and_recent(0))
    }

    fn select_into(&self, scores: &[f32], budget: &Budget, out: &mut Vec<usize>) {
        select_sinks_and_recent(scores.len(), budget.keep(), 0, out);
    }
}

/// The policies by name, as a `--kv-policy` flag takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    Full,
    Keyformer,
    H2O,
    Window,
    /// StreamingLLM.
    Sink,
}

impl PolicyKind {
    pub const ALL: [Self; 5] = [
        Self::Full,
        Self::Keyformer,
        Self::H2O,
        Self::Window,
        Self::Sink,
    ];

    /// The name [`FromStr`] accepts.
    pub fn name(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Keyformer => "keyformer",
            Self::H2O => "h2o",
            Self::Window => "window",
            Self::Sink => "sink",
        }
    }

    /// The policy of this kind, with the settings in `config` that apply to it.
    pub fn build(self, config: &PolicyConfig) -> Box<dyn EvictionPolicy> {
        match self {
            Self::Full => Box::new(Full),
            Self::Keyformer => Box::new(Keyformer { tau: config.tau }),
            Self::H2O => Box::new(H2O),
            Self::Window => Box::new(Window),
            Self::Sink => Box::new(StreamingLlm {
                sinks: config.sinks,
            }),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Accepts `full`, `keyformer`, `h2o`, `window`, `sink` (ASCII case-insensitive).
impl FromStr for PolicyKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let s = s.trim();
        Self::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::UnknownPolicy(s.to_string()))
    }
}

/// Settings of the policies that have any; each policy reads only its own.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyConfig {
    /// Keyformer's temperature schedule (validated when built).
    pub tau: TauSchedule,
    /// StreamingLLM's default sink count.
    pub sinks: usize,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            tau: TauSchedule::PAPER,
            sinks: StreamingLlm::DEFAULT_SINKS,
        }
    }
}

/// Orders a score for ranking: NaN ranks lowest, and -0.0 ties with 0.0.
fn rank_key(score: f32) -> f32 {
    if score.is_nan() {
        f32::NEG_INFINITY
    } else {
        score + 0.0
    }
}

/// The built-in policies' choices as numbers: of `n` keys, keep `k`: the first `sinks`, the last
/// `recent` (at most what the sinks leave), and the highest scores in between (ties to the lower
/// slot; a NaN score ranks lowest). With `recent` at least `k`, no score matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeepRule {
    pub sinks: usize,
    pub recent: usize,
}

impl KeepRule {
    /// Keyformer's and H2O's choice: the budget's sinks and recent window, the rest by score.
    pub fn by_score(budget: &Budget) -> Self {
        KeepRule {
            sinks: budget.sinks(),
            recent: budget.recent(),
        }
    }

    /// The first `sinks` keys and the most recent rest (window, StreamingLLM).
    pub fn sinks_and_recent(sinks: usize) -> Self {
        KeepRule {
            sinks,
            recent: usize::MAX,
        }
    }

    /// The rule keeping the first `frozen` keys too (a shared prefix that must not move).
    pub fn keeping_prefix(self, frozen: usize) -> Self {
        KeepRule {
            sinks: self.sinks.max(frozen),
            ..self
        }
    }

    /// (sinks, recent, by score) counts of `k` kept keys.
    pub fn split(&self, k: usize) -> (usize, usize, usize) {
        let sinks = self.sinks.min(k);
        let recent = self.recent.min(k - sinks);
        (sinks, recent, k - sinks - recent)
    }

    /// Whether choosing `k` of `n` keys reads any score.
    pub fn needs_scores(&self, n: usize, k: usize) -> bool {
        k < n && self.split(k).2 > 0
    }

    /// Replaces `out` with the kept slots of one row of `n = scores.len()` keys, keeping
    /// `min(k, n)` (`scores` may be empty when [`KeepRule::needs_scores`] is false; `n` is then
    /// `keys`).
    pub fn select_into(&self, scores: &[f32], keys: usize, k: usize, out: &mut Vec<usize>) {
        out.clear();
        let n = keys;
        let k = k.min(n);
        if k == n {
            out.extend(0..n);
            return;
        }
        let (sinks, recent, top) = self.split(k);
        let recent_start = n - recent;
        out.extend(0..sinks);
        if top > 0 {
            let mut candidates: Vec<usize> = (sinks..recent_start).collect();
            // Higher score first, then lower slot: a total order, so the chosen set is unique.
            let better = |a: &usize, b: &usize| -> Ordering {
                let (sa, sb) = (rank_key(scores[*a]), rank_key(scores[*b]));
                sb.total_cmp(&sa).then(a.cmp(b))
            };
            if top < candidates.len() {
                candidates.select_nth_unstable_by(top - 1, better);
                candidates.truncate(top);
            }
            candidates.sort_unstable();
            out.extend(candidates);
        }
        out.extend(recent_start..n);
    }
}

/// The score-based choice of Keyformer and H2O: the first `sinks`, the last `recent`, and the
/// highest scores in between; ties go to the lower (older) slot.
pub(crate) fn select_by_score(scores: &[f32], budget: &Budget, out: &mut Vec<usize>) {
    KeepRule::by_score(budget).select_into(scores, scores.len(), budget.keep(), out);
}

/// The first `min(sinks, k)` and the most recent rest of `k = min(keep, n)` slots.
pub(crate) fn select_sinks_and_recent(n: usize, keep: usize, sinks: usize, out: &mut Vec<usize>) {
    out.clear();
    let k = keep.min(n);
    let sinks = sinks.min(k);
    out.extend(0..sinks);
    out.extend(n - (k - sinks)..n);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(keep: usize, recent: usize, sinks: usize) -> Budget {
        Budget::new(keep, recent, sinks).unwrap()
    }

    #[test]
    fn parses_policy_names() {
        for kind in PolicyKind::ALL {
            assert_eq!(kind.name().parse(), Ok(kind));
            assert_eq!(kind.to_string().to_uppercase().parse(), Ok(kind));
            assert_eq!(kind.build(&PolicyConfig::default()).kind(), kind);
        }
        let err = "lru".parse::<PolicyKind>().unwrap_err();
        assert_eq!(err, Error::UnknownPolicy("lru".into()));
        assert_eq!(
            err.to_string(),
            "unknown KV eviction policy \"lru\": expected one of full, keyformer, h2o, window, sink"
        );
    }

    #[test]
    fn policy_traits() {
        let cfg = PolicyConfig::default();
        let needs: Vec<bool> = PolicyKind::ALL
            .iter()
            .map(|k| k.build(&cfg).needs_scores())
            .collect();
        assert_eq!(needs, [false, true, true, false, false]);
        assert!(!Full.evicts() && Keyformer::default().evicts());
        assert_eq!(PolicyKind::Sink.build(&cfg).default_sinks(), 4);
        assert_eq!(PolicyKind::H2O.build(&cfg).default_sinks(), 0);
        assert!(Keyformer::new(1.0, 0.0).is_err());
        assert_eq!(
            Keyformer::new(1.0, 2.0).map(|k| k.score_function()),
            Ok(ScoreFunction::GumbelSoftmax(TauSchedule::PAPER))
        );
    }

    #[test]
    fn score_selection_keeps_recent_and_top() {
        //            0    1    2    3    4    5    6    7
        let scores = [0.1, 0.9, 0.2, 0.8, 0.3, 0.0, 5.0, 5.0];
        // keep 4, recent 2: slots 6, 7 plus the top two of 0..6 (1 and 3).
        assert_eq!(H2O.select(&scores, &budget(4, 2, 0)), vec![1, 3, 6, 7]);
        // With a sink: 0, then 6, 7, then the best of 1..6 (1).
        assert_eq!(H2O.select(&scores, &budget(4, 2, 1)), vec![0, 1, 6, 7]);
        // No recent window: purely by score.
        assert_eq!(H2O.select(&scores, &budget(3, 0, 0)), vec![1, 6, 7]);
        // Everything fits.
        assert_eq!(
            H2O.select(&scores, &budget(8, 2, 0)),
            (0..8).collect::<Vec<_>>()
        );
        assert_eq!(
            H2O.select(&scores, &budget(20, 2, 0)),
            (0..8).collect::<Vec<_>>()
        );
    }

    #[test]
    fn ties_and_nan_rank_deterministically() {
        let scores = [1.0, 1.0, f32::NAN, 1.0, -0.0, 0.0, 2.0];
        // Ties among 0, 1, 3: lower slots first.
        assert_eq!(
            Keyformer::default().select(&scores, &budget(3, 1, 0)),
            vec![0, 1, 6]
        );
        // NaN ranks below everything, -0.0 ties with 0.0 (lower slot wins).
        let scores = [f32::NAN, 0.0, -0.0, f32::NEG_INFINITY];
        assert_eq!(H2O.select(&scores, &budget(1, 0, 0)), vec![1]);
        assert_eq!(H2O.select(&[0.0, -0.0], &budget(1, 0, 0)), vec![0]);
        assert_eq!(H2O.select(&[-0.0, 0.0], &budget(1, 0, 0)), vec![0]);
    }

    #[test]
    fn recency_policies() {
        let scores = [9.0; 10];
        assert_eq!(Window.select(&scores, &budget(3, 1, 1)), vec![7, 8, 9]);
        assert_eq!(Full.select(&scores, &budget(3, 0, 0)), vec![7, 8, 9]);
        assert_eq!(
            StreamingLlm::default().select(&scores, &budget(6, 0, 4)),
            vec![0, 1, 2, 3, 8, 9]
        );
        assert_eq!(
            StreamingLlm::default().select(&scores, &budget(4, 0, 4)),
            vec![0, 1, 2, 3]
        );
        assert_eq!(
            StreamingLlm::default().select(&scores[..3], &budget(6, 0, 4)),
            vec![0, 1, 2]
        );
    }

    #[test]
    fn empty_and_single_inputs() {
        let cfg = PolicyConfig::default();
        for kind in PolicyKind::ALL {
            let p = kind.build(&cfg);
            assert!(p.select(&[], &budget(4, 1, 1)).is_empty());
            assert_eq!(p.select(&[0.5], &budget(4, 1, 1)), vec![0]);
            assert_eq!(p.select(&[0.5, 0.25], &budget(1, 0, 0)).len(), 1);
        }
    }
}
