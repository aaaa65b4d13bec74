//! Choosing a token from a row of logits: the one definition every backend implements.
//!
//! The randomness is drawn by the caller (one uniform number per sampled row) and passed in, so a
//! backend only transforms logits into a token: the same logits, parameters and uniform number
//! give the same token on every backend, up to the rounding of their sums (the CPU sums in f64, a
//! GPU in f32), which matters only when the draw or the top-p mass lands within about 1e-6 of a
//! boundary between two tokens.
//!
//! The steps, in order:
//! 1. **Penalties**, on the row's listed tokens only: the repetition penalty (HF's) divides a
//!    listed token's logit by the penalty when positive and multiplies it otherwise; then a token
//!    listed with a count `c > 0` (its occurrences in the generated text) loses
//!    `frequency_penalty · c + presence_penalty` (OpenAI's definition).
//! 2. **Greedy** when the temperature is 0: the lowest index of the largest logit (NaN counts as
//!    -inf), as `torch.argmax`.
//! 3. Otherwise tokens are ranked by logit, descending, the lower index first on ties, and weighted
//!    `w = exp((l - max) / temperature)` (so the most likely token weighs 1). **Top-k** keeps the
//!    first `top_k` of the ranking; **top-p** then keeps the shortest prefix of what is left whose
//!    weight reaches `top_p` of its total; **min-p** then keeps those with `w >= min_p`.
//! 4. **The draw**: with `K` the total weight kept, the token is the first kept one, in index order,
//!    whose running weight exceeds `uniform · K` (the last kept one if rounding leaves none).
//!
//! A row in which no logit is above -inf (every one NaN or -inf: a model whose weights or
//! arithmetic went wrong) has no token to give: sampling returns [`NO_FINITE_LOGIT`], which is
//! outside every vocabulary, and the caller fails the request rather than emit a made-up token.

use bytemuck::{Pod, Zeroable};

/// What sampling returns for a row with no logit above -inf (see the module docs). A GPU's
/// embedding reads an id this large as a row of NaN, so a step issued with it before the host
/// has seen it computes nothing from other memory.
pub const NO_FINITE_LOGIT: u32 = 0xFFFF_FFFE;

/// One row's sampling parameters, as every backend receives them (`#[repr(C)]`: a GPU reads them
/// as they are laid out here).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct SampleParams {
    /// 0 for greedy decoding.
    pub temperature: f32,
    /// Keep only the `top_k` highest-ranked tokens; 0 keeps all.
    pub top_k: u32,
    /// In (0, 1]; 1 keeps all.
    pub top_p: f32,
    /// In [0, 1]; 0 keeps all.
    pub min_p: f32,
    /// 1 disables the penalty.
    pub repetition_penalty: f32,
    /// The row's random number, uniform in [0, 1).
    pub uniform: f32,
    /// Subtracted once per generated occurrence of a token; 0 disables it.
    pub frequency_penalty: f32,
    /// Subtracted once from every token generated at least once; 0 disables it.
    pub presence_penalty: f32,
}

impl SampleParams {
    pub const GREEDY: SampleParams = SampleParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        uniform: 0.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
    };

    /// Whether any penalty changes logits (so the row's listed tokens matter).
    pub fn penalizes(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }
}

/// Rows' penalized tokens as one list with offsets (row `r`'s are `tokens[offsets[r]..offsets[r +
/// 1]]`), each with its count of generated occurrences in `counts` (same length as `tokens`), the
/// form a GPU receives them in.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PenaltyLists {
    pub offsets: Vec<u32>,
    pub tokens: Vec<u32>,
    pub counts: Vec<u32>,
}

/// One row of [`PenaltyLists`]: distinct tokens and, for each, how often it was generated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PenaltyRow<'a> {
    pub tokens: &'a [u32],
    pub counts: &'a [u32],
}

impl<'a> PenaltyRow<'a> {
    /// Tokens only the repetition penalty applies to (counted as never generated).
    pub fn repeated(tokens: &'a [u32]) -> Self {
        PenaltyRow {
            tokens,
            counts: &[],
        }
    }

    fn count(&self, i: usize) -> u32 {
        self.counts.get(i).copied().unwrap_or(0)
    }
}

impl PenaltyLists {
    /// Lists of `rows` empty rows.
    pub fn empty(rows: usize) -> Self {
        PenaltyLists {
            offsets: vec![0; rows + 1],
            tokens: Vec::new(),
            counts: Vec::new(),
        }
    }

    /// From one list per row; each list should name a token once (a repeated token would be
    /// penalized twice).
    pub fn from_rows<'a>(rows: impl IntoIterator<Item = PenaltyRow<'a>>) -> Self {
        let mut lists = PenaltyLists::empty(0);
        for row in rows {
            lists.push_row(row);
        }
        lists
    }

    /// Appends a row's list (a missing count is 0).
    pub fn push_row(&mut self, row: PenaltyRow<'_>) {
        if self.offsets.is_empty() {
            self.offsets.push(0);
        }
        self.tokens.extend_from_slice(row.tokens);
        self.counts
            .extend((0..row.tokens.len()).map(|i| row.count(i)));
        self.offsets.push(self.tokens.len() as u32);
    }

    pub fn rows(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    pub fn row(&self, r: usize) -> PenaltyRow<'_> {
        let range = self.offsets[r] as usize..self.offsets[r + 1] as usize;
        PenaltyRow {
            tokens: &self.tokens[range.clone()],
            counts: &self.counts[range],
        }
    }
}

/// Index of the largest logit, the lowest index on ties, NaN counting as -inf (0 for an empty or
/// all-NaN row).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        let l = if l.is_nan() { f32::NEG_INFINITY } else { l };
        if best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// Applies the penalties to `logits` in place (step 1 of the module's definition).
pub fn apply_penalties(logits: &mut [f32], params: &SampleParams, row: PenaltyRow<'_>) {
    if !params.penalizes() {
        return;
    }
    let (rep, freq, presence) = (
        params.repetition_penalty,
        params.frequency_penalty,
        params.presence_penalty,
    );
    for (i, &t) in row.tokens.iter().enumerate() {
        if let Some(l) = logits.get_mut(t as usize) {
            if rep != 1.0 {
                *l = if *l > 0.0 { *l / rep } else { *l * rep };
            }
            let c = row.count(i);
            if c > 0 {
                *l -= freq * c as f32 + presence;
            }
        }
    }
}

/// The token `params` choose from `logits` (penalized in place), by the module's definition.
pub fn sample_row(logits: &mut [f32], params: &SampleParams, penalized: PenaltyRow<'_>) -> u32 {
    apply_penalties(logits, params, penalized);
    if params.temperature == 0.0 {
        // One pass: the argmax's own logit says whether any is above -inf (NaN > x is false).
        let best = argmax(logits);
        return match logits.get(best as usize) {
            Some(&l) if l > f32::NEG_INFINITY => best,
            _ => NO_FINITE_LOGIT,
        };
    }
    let max = logits
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return NO_FINITE_LOGIT;
    }
    if !max.is_finite() {
        // No finite ranking to weigh (a +inf logit): the first best.
        return argmax(logits);
    }
    let t = params.temperature;
    let weight = |l: f32| ((l - max) / t).exp();
    let by_rank = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let mut kept: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| **l > f32::NEG_INFINITY)
        .map(|(i, &l)| (i as u32, l))
        .collect();
    let k = params.top_k as usize;
    if k > 0 && k < kept.len() {
        kept.select_nth_unstable_by(k - 1, by_rank);
        kept.truncate(k);
    }
    // From here on the pairs hold weights; they keep the ranking's order where it matters.
    if params.top_p < 1.0 {
        kept.sort_unstable_by(by_rank);
        for c in kept.iter_mut() {
            c.1 = weight(c.1);
        }
        let total: f64 = kept.iter().map(|c| c.1 as f64).sum();
        let goal = params.top_p as f64 * total;
        let mut cum = 0.0f64;
        let mut keep = kept.len();
        for (i, c) in kept.iter().enumerate() {
            cum += c.1 as f64;
            if cum >= goal {
                keep = i + 1;
                break;
            }
        }
        kept.truncate(keep);
    } else {
        for c in kept.iter_mut() {
            c.1 = weight(c.1);
        }
    }
    if params.min_p > 0.0 {
        kept.retain(|c| c.1 >= params.min_p);
    }
    kept.sort_unstable_by_key(|c| c.0);
    let total: f64 = kept.iter().map(|c| c.1 as f64).sum();
    let r = params.uniform as f64 * total;
    let mut cum = 0.0f64;
    for c in &kept {
        cum += c.1 as f64;
        if cum > r {
            return c.0;
        }
    }
    kept.last().map_or_else(|| argmax(logits), |c| c.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SampleParams {
        SampleParams {
            temperature,
            ..SampleParams::GREEDY
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum_and_skips_nan() {
        assert_eq!(
            sample_row(
                &mut [0.1, 3.0, 3.0, -1.0],
                &params(0.0),
                PenaltyRow::default()
            ),
            1
        );
        assert_eq!(
            sample_row(
                &mut [f32::NAN, -5.0, -1.0],
                &params(0.0),
                PenaltyRow::default()
            ),
            2
        );
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
    }

    #[test]
    fn repetition_penalty_follows_hf() {
        let mut logits = [4.0, 3.0, -1.0];
        let p = SampleParams {
            repetition_penalty: 2.0,
            ..SampleParams::GREEDY
        };
        assert_eq!(
            sample_row(&mut logits, &p, PenaltyRow::repeated(&[0, 2])),
            1
        );
        assert_eq!(logits, [2.0, 3.0, -2.0]);
    }

    #[test]
    fn frequency_and_presence_penalties_follow_openai() {
        // Token 0 generated 3 times, token 2 once, token 1 only in the prompt (count 0).
        let mut logits = [4.0, 3.0, -1.0, 0.5];
        let p = SampleParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..SampleParams::GREEDY
        };
        let row = PenaltyRow {
            tokens: &[0, 1, 2],
            counts: &[3, 0, 1],
        };
        assert_eq!(sample_row(&mut logits, &p, row), 1);
        assert_eq!(logits, [4.0 - 1.75, 3.0, -1.75, 0.5]);
        // With a repetition penalty too, it applies first, to every listed token.
        let mut logits = [4.0, 3.0, -1.0, 0.5];
        let p = SampleParams {
            repetition_penalty: 2.0,
            ..p
        };
        sample_row(&mut logits, &p, row);
        assert_eq!(logits, [2.0 - 1.75, 1.5, -2.0 - 0.75, 0.5]);
    }

    /// The draw walks the kept tokens in index order: uniform numbers in each token's share of
    /// [0, 1) pick it.
    #[test]
    fn the_draw_maps_uniform_numbers_to_index_order_shares() {
        // Weights 1, 3 (after the max shift): shares [0, 1/4) and [1/4, 1).
        let logits = [0.0f32, 3.0f32.ln()];
        for (u, want) in [(0.0, 0), (0.24, 0), (0.26, 1), (0.999, 1)] {
            let p = SampleParams {
                uniform: u,
                ..params(1.0)
            };
            assert_eq!(
                sample_row(&mut logits.clone(), &p, PenaltyRow::default()),
                want,
                "u = {u}"
            );
        }
    }

    #[test]
    fn truncation_keeps_only_allowed_tokens() {
        let logits = [4.9f32, 5.0, 1.0, 0.0, -3.0, 4.9];
        for (p, allowed) in [
            (
                SampleParams {
                    top_k: 2,
                    ..params(1.0)
                },
                vec![0, 1], // the tie at 4.9 keeps the lower index
            ),
            (
                SampleParams {
                    top_p: 0.3,
                    ..params(1.0)
                },
                vec![1],
            ),
            (
                SampleParams {
                    top_p: 0.4,
                    ..params(1.0)
                },
                vec![0, 1],
            ),
            (
                SampleParams {
                    min_p: 0.5,
                    ..params(1.0)
                },
                vec![0, 1, 5],
            ),
        ] {
            let mut seen = std::collections::BTreeSet::new();
            for i in 0..1000 {
                let p = SampleParams {
                    uniform: i as f32 / 1000.0,
                    ..p
                };
                seen.insert(sample_row(&mut logits.clone(), &p, PenaltyRow::default()));
            }
            assert_eq!(seen.into_iter().collect::<Vec<_>>(), allowed, "{p:?}");
        }
    }

    #[test]
    fn infinite_logits_do_not_poison_the_draw() {
        let p = SampleParams {
            uniform: 0.9,
            ..params(0.7)
        };
        assert_eq!(
            sample_row(
                &mut [f32::NEG_INFINITY, 1.0, f32::NAN],
                &p,
                PenaltyRow::default()
            ),
            1
        );
        assert_eq!(
            sample_row(&mut [1.0, f32::INFINITY, 2.0], &p, PenaltyRow::default()),
            1
        );
        // No logit above -inf: no token, greedy or not.
        for t in [0.0, 0.7] {
            let p = SampleParams {
                temperature: t,
                ..p
            };
            for row in [
                [f32::NEG_INFINITY; 3],
                [f32::NAN; 3],
                [f32::NAN, f32::NEG_INFINITY, f32::NAN],
            ] {
                let mut row = row;
                assert_eq!(
                    sample_row(&mut row, &p, PenaltyRow::default()),
                    NO_FINITE_LOGIT,
                    "{row:?} at temperature {t}"
                );
            }
        }
    }

    #[test]
    fn penalty_lists_round_trip() {
        let l = PenaltyLists::from_rows([
            PenaltyRow {
                tokens: &[1, 2],
                counts: &[0, 4],
            },
            PenaltyRow::default(),
            PenaltyRow::repeated(&[7]),
        ]);
        assert_eq!(l.rows(), 3);
        assert_eq!(l.row(0).tokens, &[1, 2]);
        assert_eq!(l.row(0).counts, &[0, 4]);
        assert!(l.row(1).tokens.is_empty());
        assert_eq!(l.row(2).tokens, &[7]);
        assert_eq!(l.row(2).counts, &[0]);
        assert_eq!(PenaltyLists::empty(2).rows(), 2);
    }
}
