//! KV-cache eviction policies: which cached keys a sequence keeps once its cache outgrows a
//! budget of `k` tokens per layer and KV head.
//!
//! The policies (see Keyformer, MLSys 2024, and its baselines):
//! - [`Keyformer`]: keeps the `w` most recent keys plus the `k - w` "key tokens" with the highest
//!   accumulated score `softmax((x + g) / tau)`, where `x = q·k / sqrt(d)` are the logits of a
//!   step, `g` fresh Gumbel noise ([`gumbel()`]) and `tau` rising linearly from `tau_start` (1)
//!   in the prompt pass to `tau_end` (2) over the generated length ([`TauSchedule`]).
//! - [`H2O`]: the same split, scored by the plain attention probabilities `softmax(x)`.
//! - [`Window`]: keeps only the `k` most recent keys; no scores.
//! - [`StreamingLlm`]: keeps the first `sinks` keys (attention sinks, 4 by default) and the most
//!   recent rest; no scores.
//! - [`Full`]: keeps everything (the baseline); the engine never selects.
//!
//! Scores accumulate over steps in one f32 accumulator per (layer, KV head): every prompt row
//! adds its increments in the prompt pass, every decoding step adds one row, and query heads
//! sharing a KV head (GQA) add into the same accumulator. The attention output itself always uses
//! the plain softmax; scores only decide what to keep.
//!
//! Four facts the engine relies on:
//! 1. **Same count everywhere.** Every (layer, KV head) keeps exactly `min(k, n)` of its `n`
//!    cached keys ([`Budget::kept_count`]), whatever the scores, so one block table (one key count
//!    per sequence) serves all layers and heads. [`select_kept`] checks it for every row.
//! 2. **Keys are stored rotated.** RoPE is applied before a key enters the cache, so a kept key
//!    keeps its original position after it moves; the paper finds original positions more accurate
//!    than renumbered ones. New tokens keep taking the next position of the sequence, not the next
//!    slot.
//! 3. **Compaction keeps order.** The kept slots are returned sorted, and compaction moves the key,
//!    value and score of kept slot `kept[j]` to slot `j`: the kept keys fill the leading slots in
//!    position order, and slot order stays position order, which the recent window and sinks rely
//!    on. [`compact_scores`] does this for the accumulators; an evicted key's score is dropped.
//! 4. **Selection works for any `n >= k`.** After the prompt the cache grows by one key per step
//!    and the engine selects when it exceeds the budget by its slack (a block or more), so the
//!    recent window then covers generated tokens as well.
//!
//! Usage per sequence: build a policy once from a [`PolicyKind`] and a [`PolicyConfig`]; resolve a
//! [`BudgetConfig`] into a [`Budget`] from the prompt length; feed logits rows through
//! [`EvictionPolicy::accumulate`] with a [`StepContext`]; when the cache exceeds the budget, call
//! [`select_kept`] (per layer or [`SelectionMode::Shared`]), compact, and [`compact_scores`].
//! [`score_increment_reference`] is the f64 reference for testing score kernels.

mod budget;
mod error;
pub mod gumbel;
mod policy;
mod score;
mod select;

pub use budget::{Budget, BudgetConfig, BudgetSize};
pub use error::Error;
pub use gumbel::{gumbel, gumbel_bits, gumbel_uniform};
pub use policy::{
    EvictionPolicy, Full, KeepRule, Keyformer, PolicyConfig, PolicyKind, StreamingLlm, Window, H2O,
};
pub use score::{score_increment_reference, ScoreFunction, StepContext, TauSchedule};
pub use select::{compact_scores, select_kept, Dims, SelectionMode};
