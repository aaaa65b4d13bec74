//! Selection over a whole sequence: all layers and KV heads at once, per layer or shared.

use crate::{Budget, Error, EvictionPolicy};
use std::fmt;
use std::str::FromStr;

/// The shape of a flat `[layers][kv_heads][keys]` buffer (scores, or kept slots with `keys = k`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dims {
    pub layers: usize,
    pub kv_heads: usize,
    /// Cached keys per (layer, KV head): the same everywhere, one block table serving all.
    pub keys: usize,
}

impl Dims {
    /// Number of (layer, KV head) rows.
    pub fn rows(&self) -> Result<usize, Error> {
        self.layers
            .checked_mul(self.kv_heads)
            .ok_or(self.overflow())
    }

    /// Total number of values, `layers * kv_heads * keys`.
    pub fn total(&self) -> Result<usize, Error> {
        self.rows()?.checked_mul(self.keys).ok_or(self.overflow())
    }

    fn overflow(&self) -> Error {
        Error::DimsOverflow {
            layers: self.layers,
            kv_heads: self.kv_heads,
            keys: self.keys,
        }
    }

    fn check(&self, got: usize) -> Result<(), Error> {
        let expected = self.total()?;
        if got == expected {
            Ok(())
        } else {
            Err(Error::Shape {
                got,
                expected,
                layers: self.layers,
                kv_heads: self.kv_heads,
                keys: self.keys,
            })
        }
    }
}

/// Whether each (layer, KV head) chooses its own keys, or all share one choice. The paper finds
/// per-layer more accurate (layers attend to different tokens); shared is its ablation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SelectionMode {
    /// Every (layer, KV head) selects from its own accumulated scores.
    #[default]
    PerLayer,
    /// Scores are summed over layers and heads, and the one resulting choice is used everywhere.
    Shared,
}

impl SelectionMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::PerLayer => "per-layer",
            Self::Shared => "shared",
        }
    }
}

impl fmt::Display for SelectionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Accepts `per-layer` and `shared` (ASCII case-insensitive).
impl FromStr for SelectionMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let s = s.trim();
        [Self::PerLayer, Self::Shared]
            .into_iter()
            .find(|m| m.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::UnknownMode(s.to_string()))
    }
}

/// The kept slots of every (layer, KV head), laid out `[layers][kv_heads][k]` with
/// `k = budget.kept_count(dims.keys)`.
///
/// `scores` is laid out `[layers][kv_heads][keys]`; it may be empty for a policy that does not
/// need scores. Every row keeps exactly `k` strictly increasing slots `< keys` — checked here, so
/// that even a faulty custom policy cannot leave layers with different key counts.
pub fn select_kept(
    policy: &dyn EvictionPolicy,
    scores: &[f32],
    dims: Dims,
    budget: &Budget,
    mode: SelectionMode,
) -> Result<Vec<usize>, Error> {
    let rows = dims.rows()?;
    let n = dims.keys;
    let zeros;
    let scores = if scores.is_empty() && !policy.needs_scores() {
        zeros = vec![0.0f32; dims.total()?];
        &zeros[..]
    } else {
        dims.check(scores.len())?;
        scores
    };
    let k = budget.kept_count(n);
    let mut kept = Vec::with_capacity(rows.saturating_mul(k));
    let mut row = Vec::with_capacity(k);
    match mode {
        SelectionMode::PerLayer => {
            for r in 0..rows {
                let s = scores.get(r * n..(r + 1) * n).unwrap_or(&[]);
                policy.select_into(s, budget, &mut row);
                check_row(policy, &row, n, k, r, dims)?;
                kept.extend_from_slice(&row);
            }
        }
        SelectionMode::Shared => {
            let mut total = vec![0.0f32; n];
            if n > 0 {
                for chunk in scores.chunks_exact(n) {
                    for (t, s) in total.iter_mut().zip(chunk) {
                        *t += s;
                    }
                }
            }
            policy.select_into(&total, budget, &mut row);
            check_row(policy, &row, n, k, 0, dims)?;
            for _ in 0..rows {
                kept.extend_from_slice(&row);
            }
        }
    }
    Ok(kept)
}

fn check_row(
    policy: &dyn EvictionPolicy,
    row: &[usize],
    n: usize,
    k: usize,
    r: usize,
    dims: Dims,
) -> Result<(), Error> {
    let reason = if row.len() != k {
        Some("wrong number of slots")
    } else if row.windows(2).any(|w| w[0] >= w[1]) {
        Some("slots not strictly increasing")
    } else if row.last().is_some_and(|&s| s >= n) {
        Some("slot out of range")
    } else {
        None
    };
    match reason {
        None => Ok(()),
        Some(reason) => Err(Error::InvalidSelection {
            policy: policy.kind().to_string(),
            layer: r / dims.kv_heads.max(1),
            kv_head: r % dims.kv_heads.max(1),
            reason,
        }),
    }
}

/// Gathers the accumulated scores of the kept slots into `[layers][kv_heads][k]`, in slot order:
/// the same move the engine makes on keys and values, so scores stay aligned with their keys and
/// an evicted key's score is dropped.
///
/// `scores` is `[layers][kv_heads][dims.keys]`; `kept` is what [`select_kept`] returned.
pub fn compact_scores(scores: &[f32], dims: Dims, kept: &[usize]) -> Result<Vec<f32>, Error> {
    dims.check(scores.len())?;
    let rows = dims.rows()?;
    let k = kept.len().checked_div(rows).unwrap_or(0);
    Dims { keys: k, ..dims }.check(kept.len())?;
    if k == 0 {
        return Ok(Vec::new());
    }
    let n = dims.keys;
    let mut out = Vec::with_capacity(kept.len());
    for (r, row) in kept.chunks_exact(k).enumerate() {
        for &slot in row {
            let value = scores
                .get(r * n + slot)
                .filter(|_| slot < n)
                .ok_or(Error::SlotOutOfRange { slot, keys: n })?;
            out.push(*value);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PolicyConfig, PolicyKind, H2O};

    fn dims(layers: usize, kv_heads: usize, keys: usize) -> Dims {
        Dims {
            layers,
            kv_heads,
            keys,
        }
    }

    #[test]
    fn per_layer_and_shared() {
        // 2 layers x 1 head x 4 keys; keep 2 with no recent window.
        let scores = [
            1.0, 0.0, 0.0, 2.0, // layer 0 likes 0 and 3
            0.0, 3.0, 2.5, 0.0, // layer 1 likes 1 and 2
        ];
        let budget = Budget::new(2, 0, 0).unwrap();
        let per = select_kept(
            &H2O,
            &scores,
            dims(2, 1, 4),
            &budget,
            SelectionMode::PerLayer,
        );
        assert_eq!(per, Ok(vec![0, 3, 1, 2]));
        // Sums: 1, 3, 2.5, 2 → 1 and 2 everywhere.
        let shared = select_kept(&H2O, &scores, dims(2, 1, 4), &budget, SelectionMode::Shared);
        assert_eq!(shared, Ok(vec![1, 2, 1, 2]));
        let compacted = compact_scores(&scores, dims(2, 1, 4), &[0, 3, 1, 2]);
        assert_eq!(compacted, Ok(vec![1.0, 2.0, 3.0, 2.5]));
    }

    #[test]
    fn shape_errors() {
        let budget = Budget::new(2, 0, 0).unwrap();
        let err = select_kept(
            &H2O,
            &[0.0; 5],
            dims(2, 1, 4),
            &budget,
            SelectionMode::PerLayer,
        );
        assert!(matches!(
            err,
            Err(Error::Shape {
                got: 5,
                expected: 8,
                ..
            })
        ));
        // A policy that needs scores refuses an empty buffer.
        let err = select_kept(&H2O, &[], dims(2, 1, 4), &budget, SelectionMode::PerLayer);
        assert!(matches!(err, Err(Error::Shape { got: 0, .. })));
        let err = select_kept(
            &H2O,
            &[],
            dims(usize::MAX, 2, 1),
            &budget,
            SelectionMode::Shared,
        );
        assert!(matches!(err, Err(Error::DimsOverflow { .. })));
        assert!(compact_scores(&[0.0; 8], dims(2, 1, 4), &[0, 4, 1, 2]).is_err());
        assert!(compact_scores(&[0.0; 8], dims(2, 1, 4), &[0, 1, 2]).is_err());
        assert_eq!(compact_scores(&[], dims(0, 1, 4), &[]), Ok(vec![]));
        assert!(compact_scores(&[], dims(0, 1, 4), &[0]).is_err());
        assert_eq!(compact_scores(&[0.0; 8], dims(2, 1, 4), &[]), Ok(vec![]));
    }

    #[test]
    fn scoreless_policies_take_an_empty_buffer() {
        let budget = Budget::new(2, 0, 1).unwrap();
        let sink = PolicyKind::Sink.build(&PolicyConfig::default());
        let kept = select_kept(&*sink, &[], dims(1, 2, 5), &budget, SelectionMode::PerLayer);
        assert_eq!(kept, Ok(vec![0, 4, 0, 4]));
    }

    #[test]
    fn zero_keys_and_zero_rows() {
        let budget = Budget::new(3, 1, 0).unwrap();
        for mode in [SelectionMode::PerLayer, SelectionMode::Shared] {
            assert_eq!(
                select_kept(&H2O, &[], dims(2, 2, 0), &budget, mode),
                Ok(vec![])
            );
            assert_eq!(
                select_kept(&H2O, &[], dims(0, 2, 5), &budget, mode),
                Ok(vec![])
            );
        }
    }

    #[derive(Debug)]
    struct Broken;

    impl EvictionPolicy for Broken {
        fn kind(&self) -> PolicyKind {
            PolicyKind::H2O
        }
        fn score_function(&self) -> crate::ScoreFunction {
            crate::ScoreFunction::None
        }
        fn select_into(&self, scores: &[f32], _: &Budget, out: &mut Vec<usize>) {
            out.clear();
            out.extend(
                scores
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| **s > 0.0)
                    .map(|(i, _)| i),
            );
        }
    }

    #[test]
    fn a_policy_breaking_the_count_contract_is_refused() {
        let budget = Budget::new(1, 0, 0).unwrap();
        let scores = [1.0, 0.0, 1.0, 1.0];
        let err = select_kept(
            &Broken,
            &scores,
            dims(2, 1, 2),
            &budget,
            SelectionMode::PerLayer,
        );
        assert_eq!(
            err,
            Err(Error::InvalidSelection {
                policy: "h2o".into(),
                layer: 1,
                kv_head: 0,
                reason: "wrong number of slots",
            })
        );
    }

    #[test]
    fn parses_modes() {
        assert_eq!("per-layer".parse(), Ok(SelectionMode::PerLayer));
        assert_eq!("Shared".parse(), Ok(SelectionMode::Shared));
        let err = "global".parse::<SelectionMode>().unwrap_err().to_string();
        assert!(err.contains("per-layer, shared"), "{err}");
    }
}
