//! KV eviction in the persistent batch: a request's policy, budget and seed, and the compaction
//! that keeps its sequence within budget.
//!
//! A sequence evicts once its prompt is in (all prompt chunks score their keys first), then
//! whenever it has grown past its budget by its slack ([`EvictionState::slack`]: a block, or
//! 1/32 of the budget when that is more), so compaction runs at most once per block of new
//! tokens. Each compaction reads the sequence's scores from the backend, lets the policy
//! choose the kept keys of every (layer, KV head), has the backend move them (with their scores)
//! to the leading key indices, and gives the tail blocks back to the [`KvManager`]. The frozen
//! prefix (shared blocks found at admission) is always kept: it counts as attention sinks.

use crate::batch::request::RequestError;
use std::sync::Arc;
use turbo_core::cpu::KvCacheSpec;
use turbo_core::{Backend, KvCompaction, KvRuleCompaction, KvScoring};
use turbo_keyformer::{
    select_kept, Budget, BudgetConfig, Dims, EvictionPolicy, PolicyConfig, PolicyKind,
    SelectionMode,
};
use turbo_kv::{KvError, KvManager, SeqId};
use turbo_llama::Llama;

/// A sequence compacts once it holds 1/COMPACT_SLACK_SHARE of its budget (at least a block)
/// more than the budget ([`EvictionState::slack`]).
const COMPACT_SLACK_SHARE: usize = 32;

/// What a request asks of KV eviction; library users set it per request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvEviction {
    pub policy: PolicyKind,
    /// Settings of the policies that have any (Keyformer's temperature, StreamingLLM's sinks).
    pub config: PolicyConfig,
    pub budget: BudgetConfig,
    pub mode: SelectionMode,
    /// Seed of Keyformer's noise: same seed, same kept keys.
    pub seed: u64,
    /// Evict between prompt chunks too, from the scores of the prompt so far: the sequence never
    /// holds more than its budget plus a prompt chunk and a block, and is admitted on that
    /// (rather than on its whole prompt). Off by default, as in the paper, whose prompt phase
    /// sees the whole prompt before choosing.
    pub during_prefill: bool,
}

impl KvEviction {
    /// `policy` at `budget` with the paper's settings, per-layer selection and seed 0.
    pub fn new(policy: PolicyKind, budget: BudgetConfig) -> Self {
        KvEviction {
            policy,
            config: PolicyConfig::default(),
            budget,
            mode: SelectionMode::PerLayer,
            seed: 0,
            during_prefill: false,
        }
    }
}

/// A running request's eviction: its policy built and its budget resolved for its prompt.
#[derive(Clone)]
pub(crate) struct EvictionState {
    policy: Arc<dyn EvictionPolicy>,
    budget: Budget,
    mode: SelectionMode,
    seed: u64,
    during_prefill: bool,
}

impl EvictionState {
    /// The state of a request with `prompt_len` prompt tokens, or why its settings are invalid;
    /// `None` for a policy that never evicts.
    pub fn new(e: &KvEviction, prompt_len: usize) -> Result<Option<Self>, RequestError> {
        let bad = |e: turbo_keyformer::Error| RequestError::Eviction(e.to_string());
        let policy: Arc<dyn EvictionPolicy> = Arc::from(e.policy.build(&e.config));
        let budget = e
            .budget
            .resolve(prompt_len, policy.default_sinks())
            .map_err(bad)?;
        if !policy.evicts() {
            return Ok(None);
        }
        Ok(Some(EvictionState {
            policy,
            budget,
            mode: e.mode,
            seed: e.seed,
            during_prefill: e.during_prefill,
        }))
    }

    pub fn needs_scores(&self) -> bool {
        self.policy.needs_scores()
    }

    /// The most keys of a shared prefix the sequence may reuse: the budget less its recent
    /// window (the frozen prefix is always kept, so it must leave room for the recent keys;
    /// admission bounds it by this, so the selection's budget below always holds).
    pub fn max_frozen(&self) -> usize {
        self.budget.keep() - self.budget.recent()
    }

    /// How the sequence's chunk at decoding iteration `iteration` (0 for the prompt) of
    /// `total` is scored; `None` when the policy needs no scores.
    pub fn scoring(&self, iteration: usize, total: usize) -> Option<KvScoring> {
        self.needs_scores().then(|| KvScoring {
            function: self.policy.score_function(),
            seed: self.seed,
            iteration: iteration.min(u32::MAX as usize) as u32,
            total_iterations: total.min(u32::MAX as usize) as u32,
        })
    }

    /// Keys the sequence may hold past its budget before it compacts: one block, or 1/32 of
    /// the budget rounded up to whole blocks when that is more. A compaction moves about all of
    /// the kept keys (in order, to the leading slots), reading and writing twice the bytes a
    /// decode step's attention reads of the sequence; amortised over `slack` steps that is
    /// 2/slack of the attention's traffic: 12.5% at one block of 16, under 2% at 1/32 of a
    /// budget of 4k keys, for at most 3% more memory than the budget.
    pub fn slack(&self, block_size: usize) -> usize {
        let bs = block_size.max(1);
        (self.budget.keep().div_ceil(COMPACT_SLACK_SHARE))
            .div_ceil(bs)
            .max(1)
            * bs
    }

    /// Whether a sequence holding `keys` keys is due. Still `prefilling`: only when it evicts
    /// during the prompt, once its slack past its budget. Otherwise past its budget right after
    /// its prompt (`prompt_done_now`), then by its slack.
    pub fn due(
        &self,
        keys: usize,
        prefilling: bool,
        prompt_done_now: bool,
        block_size: usize,
    ) -> bool {
        let keep = self.budget.keep();
        let slack_past = keys >= keep + self.slack(block_size);
        match prefilling {
            true => self.during_prefill && slack_past,
            false => keys > keep && (prompt_done_now || slack_past),
        }
    }

    /// The most keys a sequence of `tokens` tokens holds at once, computed `chunk` tokens per
    /// step: all of them, unless it evicts during the prompt.
    pub fn peak_keys(&self, tokens: usize, chunk: usize, block_size: usize) -> usize {
        match self.during_prefill {
            true => tokens.min(self.budget.keep() + self.slack(block_size) + chunk),
            false => tokens,
        }
    }

    /// Compacts `seq` to its budget: chooses the kept keys from its scores, has the backend move
    /// them and releases its tail blocks. The built-in policies choose by a
    /// [`turbo_keyformer::KeepRule`] the backend runs where the scores are (on a GPU: no
    /// read-back); a custom policy or shared selection chooses on the host. Either way the frozen
    /// prefix (shared blocks) stays put: the policy chooses among the keys after it.
    ///
    /// On a model split over ranks, every (layer, KV head) row lives on one rank: a rule runs on
    /// each rank over its own rows and scores, and a host choice sees every rank's rows (laid out
    /// `[layer][rank][rank's KV heads]`, so shared selection sums them all) and sends each rank
    /// its own. Every row keeps the same count, so the block table stays one.
    pub fn compact<B: Backend>(
        &self,
        model: &Llama<B>,
        cache: &mut B::KvCache,
        kv: &mut KvManager,
        seq: SeqId,
    ) -> Result<(), CompactError> {
        let keys = kv.keys(seq)?;
        let frozen = kv.frozen(seq)?.min(keys);
        let table: Arc<[u32]> = kv.block_table(seq)?.into();
        let kept_per_row = self.budget.kept_count(keys).max(frozen);
        let rank_dims = move |spec: KvCacheSpec| Dims {
            layers: spec.n_layers,
            kv_heads: spec.n_kv_heads,
            keys,
        };
        let rule = match self.mode {
            SelectionMode::PerLayer => self.policy.keep_rule(&self.budget),
            SelectionMode::Shared => None,
        };
        if let Some(rule) = rule {
            let rule = rule.keeping_prefix(frozen);
            model.with_kv(cache, move |backend, cache| {
                let compaction = KvRuleCompaction {
                    block_table: &table,
                    dims: rank_dims(backend.kv_spec(cache)),
                    kept_per_row,
                    rule,
                };
                backend.compact_kv_by_rule(cache, &compaction)?;
                Ok(Vec::new())
            })?;
        } else {
            // Scores matter only when there is a choice beyond the frozen prefix.
            let needs_scores = self.needs_scores() && kept_per_row > frozen;
            let t = table.clone();
            let per_rank = model.with_kv(cache, move |backend, cache| match needs_scores {
                true => Ok(backend.read_kv_scores(cache, &t, keys)?),
                false => Ok(Vec::new()),
            })?;
            let rank = rank_dims(model.kv_spec(1, 1));
            let world = per_rank.len();
            let dims = Dims {
                kv_heads: rank.kv_heads * world,
                ..rank
            };
            // [rank][layer][head][key] -> [layer][rank][head][key].
            let row = rank.kv_heads * keys;
            let scores: Vec<f32> = match needs_scores {
                true => (0..rank.layers)
                    .flat_map(|l| {
                        per_rank
                            .iter()
                            .flat_map(move |r| &r[l * row..(l + 1) * row])
                    })
                    .copied()
                    .collect(),
                false => Vec::new(),
            };
            let kept: Arc<[u32]> = self
                .select_on_host(scores, dims, frozen, kept_per_row)?
                .into();
            model.with_kv(cache, move |backend, cache| {
                // This rank's rows of every layer.
                let r = backend.rank_info().rank;
                let per_layer = rank.kv_heads * kept_per_row;
                let mine: Vec<u32> = (0..rank.layers)
                    .flat_map(|l| {
                        let at = (l * world + r) * per_layer;
                        kept[at..at + per_layer].iter().copied()
                    })
                    .collect();
                let compaction = KvCompaction {
                    block_table: &table,
                    kept: &mine,
                    kept_per_row,
                };
                backend.compact_kv(cache, &compaction)?;
                Ok(Vec::new())
            })?;
        }
        kv.compact(seq, kept_per_row)?;
        Ok(())
    }

    /// The policy's `k` kept keys of every row, chosen on the host from `scores` (`[layers]
    /// [kv_heads][keys]`, empty for a policy that needs none) among the keys after the frozen
    /// prefix (which is kept in front).
    fn select_on_host(
        &self,
        scores: Vec<f32>,
        dims: Dims,
        frozen: usize,
        k: usize,
    ) -> Result<Vec<u32>, CompactError> {
        let keys = dims.keys;
        let rows = dims.layers * dims.kv_heads;
        let policy_err = |e: turbo_keyformer::Error| CompactError::Policy(e.to_string());
        if k == frozen {
            return Ok((0..rows).flat_map(|_| 0..frozen as u32).collect());
        }
        // The rows' keys after the frozen prefix, chosen within a budget less the prefix.
        let rest = keys - frozen;
        let suffix: Vec<f32> = match scores.is_empty() {
            true => Vec::new(),
            false => scores
                .chunks_exact(keys)
                .flat_map(|row| row[frozen..].iter().copied())
                .collect(),
        };
        let keep = k - frozen;
        let recent = self.budget.recent().min(keep);
        let sinks = self
            .budget
            .sinks()
            .saturating_sub(frozen)
            .min(keep - recent);
        let budget = Budget::new(keep, recent, sinks).map_err(policy_err)?;
        let dims = Dims { keys: rest, ..dims };
        let chosen = select_kept(self.policy.as_ref(), &suffix, dims, &budget, self.mode)
            .map_err(policy_err)?;
        let mut kept = Vec::with_capacity(rows * k);
        for row in chosen.chunks_exact(keep) {
            kept.extend(0..frozen as u32);
            kept.extend(row.iter().map(|&j| (j + frozen) as u32));
        }
        Ok(kept)
    }
}

/// Why a compaction failed: a bug or a backend failure, not the request's fault.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CompactError {
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error(transparent)]
    Backend(#[from] turbo_core::BackendError),
    #[error(transparent)]
    Model(#[from] turbo_llama::LlamaError),
    #[error("eviction policy: {0}")]
    Policy(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use turbo_keyformer::BudgetSize;

    fn state(keep: usize) -> EvictionState {
        let e = KvEviction::new(PolicyKind::H2O, BudgetConfig::new(BudgetSize::Tokens(keep)));
        EvictionState::new(&e, 10_000).unwrap().unwrap()
    }

    #[test]
    fn slack_is_a_block_or_a_32nd_of_the_budget_in_blocks() {
        assert_eq!(state(100).slack(16), 16);
        assert_eq!(state(512).slack(16), 16);
        assert_eq!(state(513).slack(16), 32);
        // 3850 / 32 = 120.3: 121 keys, 8 blocks.
        assert_eq!(state(3850).slack(16), 128);
        assert_eq!(state(3850).slack(1), 121);
        assert_eq!(state(1).slack(0), 1);
    }

    #[test]
    fn due_after_the_prompt_then_once_per_slack() {
        let s = state(3850);
        // Right after the prompt: as soon as it is past the budget.
        assert!(s.due(3851, false, true, 16));
        assert!(!s.due(3850, false, true, 16));
        // Then only once it holds the slack more.
        assert!(!s.due(3850 + 127, false, false, 16));
        assert!(s.due(3850 + 128, false, false, 16));
        // During the prompt only when asked to evict then.
        assert!(!s.due(9000, true, false, 16));
        assert_eq!(s.peak_keys(9000, 512, 16), 9000);
    }
}
