//! The KV eviction flags shared by `generate`, `generate --prompts-file`, `chat` and `eval-kv`.

use anyhow::{bail, Result};
use clap::Args;
use turbo_keyformer::{
    BudgetConfig, BudgetSize, PolicyConfig, PolicyKind, SelectionMode, TauSchedule,
};
use turbo_scheduler::KvEviction;

#[derive(Args, Clone, Debug)]
pub struct KvPolicyArgs {
    /// KV eviction policy: full (keep every key), keyformer, h2o, window or sink
    /// (StreamingLLM).
    #[arg(long, default_value = "full")]
    pub kv_policy: PolicyKind,
    /// Keys each sequence keeps, as a fraction of its prompt (0.5 keeps half).
    #[arg(long, conflicts_with = "kv_budget_tokens", allow_hyphen_values = true)]
    pub kv_budget: Option<f64>,
    /// Keys each sequence keeps, as a count.
    #[arg(long)]
    pub kv_budget_tokens: Option<usize>,
    /// Share of the kept keys reserved for the most recent tokens.
    #[arg(long, default_value_t = BudgetConfig::DEFAULT_RECENT_FRACTION, allow_hyphen_values = true)]
    pub kv_recent: f64,
    /// First tokens always kept (attention sinks; default 4 for sink, 0 for the others).
    #[arg(long)]
    pub kv_sinks: Option<usize>,
    /// Keyformer's temperature, rising from START to END over the generated tokens.
    #[arg(
        long,
        default_value = "1:2",
        value_name = "START:END",
        allow_hyphen_values = true
    )]
    pub keyformer_tau: String,
    /// Choose kept keys per layer and KV head, or once for all (shared).
    #[arg(long, default_value = "per-layer")]
    pub kv_selection: SelectionMode,
    /// Evict between prompt chunks too (from the scores of the prompt so far), so that a
    /// sequence never holds more than its budget plus a chunk and a block.
    #[arg(long)]
    pub kv_evict_prefill: bool,
}

impl KvPolicyArgs {
    /// The eviction settings, or `None` for full attention; `budget` overrides the flags' size.
    pub fn eviction(&self, seed: u64) -> Result<Option<KvEviction>> {
        let size = budget_size(self.kv_budget, self.kv_budget_tokens);
        self.eviction_with(self.kv_policy, size, seed)
    }

    /// The settings of `policy` at `size` (default: half the prompt) with the other flags.
    pub fn eviction_with(
        &self,
        policy: PolicyKind,
        size: Option<BudgetSize>,
        seed: u64,
    ) -> Result<Option<KvEviction>> {
        if policy == PolicyKind::Full {
            if size.is_some() {
                bail!("--kv-budget needs an evicting --kv-policy (keyformer, h2o, window, sink)");
            }
            return Ok(None);
        }
        let budget = BudgetConfig {
            size: size.unwrap_or(BudgetSize::Fraction(0.5)),
            recent_fraction: self.kv_recent,
            sinks: self.kv_sinks,
        };
        budget.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        let tau = parse_tau(&self.keyformer_tau)?;
        let sinks = self.kv_sinks.unwrap_or(PolicyConfig::default().sinks);
        Ok(Some(KvEviction {
            policy,
            config: PolicyConfig { tau, sinks },
            budget,
            mode: self.kv_selection,
            seed,
            during_prefill: self.kv_evict_prefill,
        }))
    }
}

/// A budget given as a fraction of the prompt or a token count (the fraction wins), if any.
pub fn budget_size(fraction: Option<f64>, tokens: Option<usize>) -> Option<BudgetSize> {
    match (fraction, tokens) {
        (Some(f), _) => Some(BudgetSize::Fraction(f)),
        (None, Some(t)) => Some(BudgetSize::Tokens(t)),
        (None, None) => None,
    }
}

fn parse_tau(s: &str) -> Result<TauSchedule> {
    let parsed = s
        .split_once(':')
        .and_then(|(a, b)| Some((a.trim().parse::<f32>().ok()?, b.trim().parse::<f32>().ok()?)));
    match parsed {
        Some((start, end)) => TauSchedule::new(start, end).map_err(|e| anyhow::anyhow!("{e}")),
        None => bail!("--keyformer-tau must be START:END (e.g. 1:2), not {s:?}"),
    }
}
