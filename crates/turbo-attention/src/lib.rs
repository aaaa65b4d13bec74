//! Attention states and their algebra.
//!
//! Attention of one query over any subset of the keys is summarised by a state `(o, lse)`: `o` is the
//! softmax-weighted mean of the subset's values and `lse = ln Σ exp(s_j)` the log-sum-exp of its
//! scores. Two states over disjoint subsets merge into the state over their union:
//!
//! ```text
//! lse = ln(exp(lse_a) + exp(lse_b))
//! o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b
//! ```
//!
//! The merge is commutative and associative with the empty set (`lse = -inf`) as identity, so
//! attention can be split over KV chunks (flash-decoding) or over a shared prefix and per-request
//! suffixes (cascade decoding) and combined afterwards.
//!
//! ```
//! use turbo_attention::{attend, AttentionState, KvRows};
//! let d = 2;
//! let q = [1.0, 0.5];
//! let keys = [0.1, 0.2, 0.3, -0.4, 0.5, 0.6];
//! let values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
//! let kv = KvRows { keys: &keys, values: &values, head_dim: d };
//! let scale = 1.0 / (d as f32).sqrt();
//! // Two shards of the KV, attended separately and merged...
//! let mut state = attend(&q, &kv, 0..1, scale);
//! state.merge(&attend(&q, &kv, 1..3, scale));
//! // ...equal attention over all of it.
//! let whole = attend(&q, &kv, 0..3, scale);
//! assert!((state.lse - whole.lse).abs() < 1e-6);
//! assert!(state.o.iter().zip(&whole.o).all(|(a, b)| (a - b).abs() < 1e-6));
//! ```

mod paged;
mod state;

pub use paged::{paged_attention, KvRows, PagedKv, QuerySpan};
pub use state::{attend, merge_into, AttentionState};
