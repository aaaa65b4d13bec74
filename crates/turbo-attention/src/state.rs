use crate::KvRows;
use std::ops::Range;

/// Attention of one query head over a subset of the keys; see the crate docs for the algebra.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionState {
    /// Softmax-weighted mean of the subset's values (zeros for the empty set).
    pub o: Vec<f32>,
    /// Natural-log sum of exp(score) over the subset; `-inf` for the empty set.
    pub lse: f32,
}

impl AttentionState {
    /// The state over no keys: the identity of [`AttentionState::merge`].
    pub fn empty(head_dim: usize) -> Self {
        AttentionState {
            o: vec![0.0; head_dim],
            lse: f32::NEG_INFINITY,
        }
    }

    /// Folds `other` (over a disjoint subset of keys) into `self`.
    pub fn merge(&mut self, other: &AttentionState) {
        merge_into(&mut self.o, &mut self.lse, &other.o, other.lse);
    }

    /// Merges any number of states at once, shifted by their largest lse ([`merge_states`]); the
    /// order does not change the result beyond rounding.
    pub fn merge_all<'a>(
        head_dim: usize,
        states: impl IntoIterator<Item = &'a AttentionState>,
    ) -> Self {
        let parts: Vec<(&[f32], f32)> = states
            .into_iter()
            .map(|s| (s.o.as_slice(), s.lse))
            .collect();
        let mut merged = Self::empty(head_dim);
        merged.lse = merge_states(&parts, &mut merged.o);
        merged
    }
}

/// Merges the state `(o_b, lse_b)` into `(o_a, lse_a)` in place, max-shifted so that no exponent
/// overflows, and exact when either side is empty (an empty side's `o` is never read).
pub fn merge_into(o_a: &mut [f32], lse_a: &mut f32, o_b: &[f32], lse_b: f32) {
    debug_assert_eq!(o_a.len(), o_b.len());
    if lse_b == f32::NEG_INFINITY {
        return;
    }
    if *lse_a == f32::NEG_INFINITY {
        o_a.copy_from_slice(o_b);
        *lse_a = lse_b;
        return;
    }
    let max = lse_a.max(lse_b);
    let wa = (*lse_a - max).exp();
    let wb = (lse_b - max).exp();
    let sum = wa + wb;
    let (wa, wb) = (wa / sum, wb / sum);
    for (a, b) in o_a.iter_mut().zip(o_b) {
        *a = *a * wa + *b * wb;
    }
    *lse_a = max + sum.ln();
}

/// Merges the states `(o_i, lse_i)` (over disjoint key subsets) into `out` and returns the merged
/// lse: `M = max lse_i`, `out = Σ exp(lse_i − M) o_i / Σ exp(lse_i − M)`, `lse = M + ln Σ exp(lse_i
/// − M)`. One shift for all of them, so every exponent is at most 0. Empty states (`lse = -inf`)
/// are skipped without reading their `o`; with no non-empty state the result is exactly the empty
/// state (`out = 0`, `-inf`), and with exactly one it is that state, bit for bit.
///
/// This is the CPU reference of the GPU `merge_states` kernel, which sums in the same order.
pub fn merge_states(states: &[(&[f32], f32)], out: &mut [f32]) -> f32 {
    let max = states
        .iter()
        .fold(f32::NEG_INFINITY, |m, &(_, lse)| m.max(lse));
    out.fill(0.0);
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    let mut sum = 0f32;
    for &(o, lse) in states {
        if lse == f32::NEG_INFINITY {
            continue;
        }
        debug_assert_eq!(o.len(), out.len());
        let w = (lse - max).exp();
        sum += w;
        for (x, v) in out.iter_mut().zip(o) {
            *x += w * v;
        }
    }
    let inv = 1.0 / sum;
    out.iter_mut().for_each(|x| *x *= inv);
    max + sum.ln()
}

/// Attention of `q` over the keys `keys` of a contiguous KV, as a state.
pub fn attend(q: &[f32], kv: &KvRows, keys: Range<usize>, scale: f32) -> AttentionState {
    let mut state = AttentionState::empty(kv.head_dim);
    state.lse = crate::paged::attend_rows(
        q,
        keys.map(|j| (kv.key(j), kv.value(j))),
        scale,
        &mut state.o,
    );
    state
}
