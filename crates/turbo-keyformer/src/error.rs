//! The crate's one error type: every failure comes from user-controllable input (a flag, a config
//! value, a buffer of the wrong shape), so each message names the value and what was expected.

use thiserror::Error;

/// Why a budget, policy, or selection request was refused.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum Error {
    /// A budget given as a fraction of the prompt must be in (0, 1].
    #[error("KV budget fraction must be in (0, 1], got {0}")]
    BudgetFraction(f64),
    /// A budget given as a token count must keep at least one token.
    #[error("KV budget must keep at least one token")]
    ZeroBudget,
    /// The recent-window fraction must be in [0, 1].
    #[error("recent fraction must be in [0, 1], got {0}")]
    RecentFraction(f64),
    /// Sinks plus recent tokens exceed the budget, leaving a negative number of key tokens.
    #[error("budget keeps {keep} tokens but reserves {recent} recent and {sinks} sink tokens")]
    Overcommitted {
        keep: usize,
        recent: usize,
        sinks: usize,
    },
    /// A `--kv-budget` string that is neither a fraction nor a token count.
    #[error(
        "invalid KV budget {0:?}: expected a fraction of the prompt (0.5 or 50%) or a token count (512)"
    )]
    ParseBudget(String),
    /// A policy name that is not one of the accepted ones.
    #[error(
        "unknown KV eviction policy {0:?}: expected one of full, keyformer, h2o, window, sink"
    )]
    UnknownPolicy(String),
    /// A selection-mode name that is not one of the accepted ones.
    #[error("unknown KV selection mode {0:?}: expected one of per-layer, shared")]
    UnknownMode(String),
    /// Temperatures divide the logits, so they must be finite and positive.
    #[error(
        "Keyformer temperatures must be finite and positive, got tau_start={start}, tau_end={end}"
    )]
    Temperature { start: f32, end: f32 },
    /// `layers * kv_heads * keys` does not fit in `usize`.
    #[error("dimensions {layers} layers x {kv_heads} KV heads x {keys} keys overflow")]
    DimsOverflow {
        layers: usize,
        kv_heads: usize,
        keys: usize,
    },
    /// A flat `[layers][kv_heads][keys]` buffer of the wrong length.
    #[error("buffer holds {got} values, expected {expected} ({layers} layers x {kv_heads} KV heads x {keys})")]
    Shape {
        got: usize,
        expected: usize,
        layers: usize,
        kv_heads: usize,
        keys: usize,
    },
    /// A kept-slot index past the cached keys.
    #[error("kept slot {slot} is out of range for {keys} cached keys")]
    SlotOutOfRange { slot: usize, keys: usize },
    /// A policy broke the selection contract (count, order, or range); guarded so that a custom
    /// policy cannot leave layers with different key counts.
    #[error("policy {policy} returned an invalid selection for layer {layer}, KV head {kv_head}: {reason}")]
    InvalidSelection {
        policy: String,
        layer: usize,
        kv_head: usize,
        reason: &'static str,
    },
}
