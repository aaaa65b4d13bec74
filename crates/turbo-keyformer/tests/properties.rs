//! Property tests of the public API: the selection contract for every policy and mode, the score
//! increments against their f64 reference, determinism under a seed, and a simulated decode loop.

use proptest::prelude::*;
use turbo_keyformer::{
    compact_scores, gumbel, gumbel_uniform, score_increment_reference, select_kept, Budget,
    BudgetConfig, BudgetSize, Dims, KeepRule, PolicyConfig, PolicyKind, ScoreFunction,
    SelectionMode, StepContext, TauSchedule,
};

fn kind() -> impl Strategy<Value = PolicyKind> {
    prop::sample::select(PolicyKind::ALL.to_vec())
}

fn mode() -> impl Strategy<Value = SelectionMode> {
    prop::sample::select(vec![SelectionMode::PerLayer, SelectionMode::Shared])
}

/// Scores with many exact ties (small integers) mixed with arbitrary finite values.
fn score() -> impl Strategy<Value = f32> {
    prop_oneof![(-3i32..4).prop_map(|i| i as f32), -10.0f32..10.0]
}

fn budget() -> impl Strategy<Value = Budget> {
    (1usize..40)
        .prop_flat_map(|keep| (Just(keep), 0..=keep))
        .prop_flat_map(|(keep, recent)| (Just(keep), Just(recent), 0..=keep - recent))
        .prop_map(|(keep, recent, sinks)| Budget::new(keep, recent, sinks).unwrap())
}

/// (dims, scores laid out `[layers][kv_heads][keys]`).
fn scores() -> impl Strategy<Value = (Dims, Vec<f32>)> {
    (0usize..4, 1usize..4, 0usize..48).prop_flat_map(|(layers, kv_heads, keys)| {
        let dims = Dims {
            layers,
            kv_heads,
            keys,
        };
        (
            Just(dims),
            prop::collection::vec(score(), layers * kv_heads * keys),
        )
    })
}

fn ctx() -> impl Strategy<Value = StepContext> {
    (
        any::<u64>(),
        any::<u32>(),
        0u32..600,
        0u32..600,
        0u32..80,
        0u32..64,
    )
        .prop_map(
            |(seed, query_pos, iteration, total_iterations, layer, q_head)| StepContext {
                seed,
                query_pos,
                iteration,
                total_iterations,
                layer,
                q_head,
            },
        )
}

fn score_function() -> impl Strategy<Value = ScoreFunction> {
    prop_oneof![
        Just(ScoreFunction::Softmax),
        (0.25f32..4.0, 0.25f32..4.0)
            .prop_map(|(a, b)| ScoreFunction::GumbelSoftmax(TauSchedule::new(a, b).unwrap())),
    ]
}

/// Logits with some masked (`-inf`) entries.
fn logits(max_len: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(
        prop_oneof![4 => -30.0f32..30.0, 1 => Just(f32::NEG_INFINITY)],
        0..max_len,
    )
}

fn check_row(kind: PolicyKind, row: &[usize], scores: &[f32], budget: &Budget) {
    let n = scores.len();
    let k = budget.kept_count(n);
    assert_eq!(row.len(), k);
    assert!(
        row.windows(2).all(|w| w[0] < w[1]),
        "not increasing: {row:?}"
    );
    assert!(row.iter().all(|&s| s < n));
    if k == n {
        assert!(row.iter().copied().eq(0..n));
        return;
    }
    match kind {
        PolicyKind::Full | PolicyKind::Window => assert!(row.iter().copied().eq(n - k..n)),
        PolicyKind::Sink => {
            let s = budget.sinks().min(k);
            assert!(row[..s].iter().copied().eq(0..s), "sinks: {row:?}");
            assert!(
                row[s..].iter().copied().eq(n - (k - s)..n),
                "recent: {row:?}"
            );
        }
        PolicyKind::Keyformer | PolicyKind::H2O => {
            let (s, w) = (budget.sinks(), budget.recent());
            assert!(row[..s].iter().copied().eq(0..s), "sinks: {row:?}");
            assert!(row[k - w..].iter().copied().eq(n - w..n), "recent: {row:?}");
            // Among the candidates, every kept one beats every dropped one (ties: lower slot).
            let kept: Vec<usize> = row[s..k - w].to_vec();
            let dropped = (s..n - w).filter(|c| kept.binary_search(c).is_err());
            for d in dropped {
                for &c in &kept {
                    let better = scores[c] > scores[d] || (scores[c] == scores[d] && c < d);
                    assert!(
                        better,
                        "kept {c} ({}) vs dropped {d} ({})",
                        scores[c], scores[d]
                    );
                }
            }
        }
    }
}

proptest! {
    #[test]
    fn selection_contract((dims, scores) in scores(), budget in budget(), kind in kind(), mode in mode()) {
        let policy = kind.build(&PolicyConfig::default());
        let kept = select_kept(&*policy, &scores, dims, &budget, mode).unwrap();
        let k = budget.kept_count(dims.keys);
        let rows = dims.layers * dims.kv_heads;
        prop_assert_eq!(kept.len(), rows * k);
        if k == 0 {
            return Ok(());
        }
        let n = dims.keys;
        for (r, row) in kept.chunks_exact(k).enumerate() {
            match mode {
                SelectionMode::PerLayer => check_row(kind, row, &scores[r * n..(r + 1) * n], &budget),
                SelectionMode::Shared => {
                    // Identical everywhere, and the contract holds for the summed scores.
                    prop_assert_eq!(row, &kept[..k]);
                    let mut total = vec![0.0f32; n];
                    for chunk in scores.chunks_exact(n) {
                        for (t, s) in total.iter_mut().zip(chunk) {
                            *t += s;
                        }
                    }
                    check_row(kind, row, &total, &budget);
                }
            }
        }
        let compacted = compact_scores(&scores, dims, &kept).unwrap();
        prop_assert_eq!(compacted.len(), kept.len());
        for (i, (&slot, &value)) in kept.iter().zip(&compacted).enumerate() {
            prop_assert_eq!(value.to_bits(), scores[(i / k) * n + slot].to_bits());
        }
    }

    /// A policy's `KeepRule` (what a device runs) chooses exactly what the policy does, also on
    /// NaN, signed zeros and ties; a rule keeping a prefix keeps it and otherwise picks from the
    /// rest as the rule would there.
    #[test]
    fn keep_rules_choose_what_their_policies_do(
        row in prop::collection::vec(prop_oneof![score(), Just(f32::NAN), Just(-0.0f32), Just(0.0f32)], 0..48),
        budget in budget(),
        kind in kind(),
        frozen in 0usize..12,
    ) {
        let policy = kind.build(&PolicyConfig::default());
        let Some(rule) = policy.keep_rule(&budget) else {
            return Err(TestCaseError::fail(format!("{kind:?} has no rule")));
        };
        let n = row.len();
        let mut by_rule = Vec::new();
        rule.select_into(&row, n, budget.keep(), &mut by_rule);
        prop_assert_eq!(&by_rule, &policy.select(&row, &budget));
        if !rule.needs_scores(n, budget.keep()) {
            let mut blind = Vec::new();
            rule.select_into(&[], n, budget.keep(), &mut blind);
            prop_assert_eq!(&blind, &by_rule);
        }
        let frozen = frozen.min(budget.keep());
        let kept = {
            let mut out = Vec::new();
            rule.keeping_prefix(frozen).select_into(&row, n, budget.keep(), &mut out);
            out
        };
        prop_assert_eq!(kept.len(), budget.keep().min(n));
        prop_assert!(kept.windows(2).all(|w| w[0] < w[1]));
        prop_assert!((0..frozen.min(n)).all(|i| kept.contains(&i)));
        prop_assert_eq!(KeepRule::sinks_and_recent(0).keeping_prefix(frozen).split(5).0, frozen.min(5));
    }

    #[test]
    fn scoreless_policies_ignore_scores((dims, scores) in scores(), budget in budget(), mode in mode()) {
        for kind in [PolicyKind::Full, PolicyKind::Window, PolicyKind::Sink] {
            let policy = kind.build(&PolicyConfig::default());
            prop_assert!(!policy.needs_scores());
            let with = select_kept(&*policy, &scores, dims, &budget, mode).unwrap();
            let without = select_kept(&*policy, &[], dims, &budget, mode).unwrap();
            prop_assert_eq!(with, without);
        }
    }

    #[test]
    fn increments_are_a_distribution(score in score_function(), logits in logits(64), ctx in ctx()) {
        let mut acc = vec![0.0f32; logits.len()];
        score.accumulate(&logits, &ctx, &mut acc);
        prop_assert!(acc.iter().all(|a| a.is_finite() && *a >= 0.0));
        for (a, x) in acc.iter().zip(&logits) {
            if !x.is_finite() {
                prop_assert_eq!(*a, 0.0);
            }
        }
        let sum: f32 = acc.iter().sum();
        if logits.iter().any(|x| x.is_finite()) {
            prop_assert!((sum - 1.0).abs() < 1e-5, "sum {}", sum);
        } else {
            prop_assert_eq!(sum, 0.0);
        }
    }

    #[test]
    fn increments_match_the_f64_reference(score in score_function(), logits in logits(64), ctx in ctx()) {
        let mut acc = vec![0.0f32; logits.len()];
        score.accumulate(&logits, &ctx, &mut acc);
        let reference = score_increment_reference(&score, &logits, &ctx);
        prop_assert_eq!(reference.len(), logits.len());
        let sum: f64 = reference.iter().sum();
        prop_assert!(sum == 0.0 || (sum - 1.0).abs() < 1e-12);
        for (a, r) in acc.iter().zip(&reference) {
            let err = (f64::from(*a) - r).abs();
            prop_assert!(err <= 2e-6 + 1e-4 * r, "f32 {} vs f64 {}", a, r);
        }
    }

    #[test]
    fn same_seed_same_increments_other_seed_other_noise(
        logits in prop::collection::vec(-2.0f32..2.0, 2..32),
        ctx in ctx(),
        tau in 0.5f32..4.0,
    ) {
        let score = ScoreFunction::GumbelSoftmax(TauSchedule::new(tau, tau).unwrap());
        let run = |ctx: &StepContext| {
            let mut acc = vec![0.0f32; logits.len()];
            score.accumulate(&logits, ctx, &mut acc);
            acc.iter().map(|a| a.to_bits()).collect::<Vec<_>>()
        };
        prop_assert_eq!(run(&ctx), run(&ctx));
        let other = StepContext { seed: ctx.seed ^ 1, ..ctx };
        prop_assert_ne!(run(&ctx), run(&other));
        // Softmax (H2O) has no noise: the seed does not matter.
        let plain = |ctx: &StepContext| {
            let mut acc = vec![0.0f32; logits.len()];
            ScoreFunction::Softmax.accumulate(&logits, ctx, &mut acc);
            acc
        };
        prop_assert_eq!(plain(&ctx), plain(&other));
    }

    #[test]
    fn gumbel_is_finite_and_uniform_is_open(seed: u64, step: u32, layer: u32, head: u32, key: u32) {
        let u = gumbel_uniform(seed, step, layer, head, key);
        prop_assert!(u > 0.0 && u < 1.0);
        prop_assert!(gumbel(seed, step, layer, head, key).is_finite());
    }

    #[test]
    fn budgets_resolve_within_bounds(
        prompt_len in 0usize..100_000,
        fraction in 1e-6f64..=1.0,
        recent_fraction in 0.0f64..=1.0,
        sinks in prop::option::of(0usize..16),
        default_sinks in 0usize..8,
    ) {
        let cfg = BudgetConfig { size: BudgetSize::Fraction(fraction), recent_fraction, sinks };
        let b = cfg.resolve(prompt_len, default_sinks).unwrap();
        prop_assert_eq!(b.keep(), ((fraction * prompt_len as f64).floor() as usize).max(1));
        prop_assert!(b.sinks() + b.recent() <= b.keep());
        prop_assert_eq!(b.sinks(), sinks.unwrap_or(default_sinks).min(b.keep()));
        prop_assert_eq!(b.sinks() + b.recent() + b.key_tokens(), b.keep());
    }

    /// A whole request: prompt pass, then decoding with selection whenever the cache exceeds the
    /// budget by a block. Tracks the original position of every slot to check the engine-level
    /// invariants: same count everywhere, positions in order, recent positions and sinks kept.
    #[test]
    fn simulated_decode_keeps_invariants(
        prompt_len in 1usize..40,
        steps in 0u32..40,
        block in 1usize..8,
        fraction in 0.1f64..=1.0,
        kind in kind(),
        mode in mode(),
        seed: u64,
    ) {
        const LAYERS: usize = 2;
        const KV_HEADS: usize = 2;
        const Q_PER_KV: usize = 2;
        let policy = kind.build(&PolicyConfig::default());
        let cfg = BudgetConfig::new(BudgetSize::Fraction(fraction));
        let budget = cfg.resolve(prompt_len, policy.default_sinks()).unwrap();
        let rows = LAYERS * KV_HEADS;
        // positions[r][j]: original position of slot j of row r.
        let mut positions: Vec<Vec<usize>> = vec![(0..prompt_len).collect(); rows];
        let mut scores = vec![0.0f32; rows * prompt_len];
        let mut n = prompt_len;
        // A deterministic stand-in for q·k: depends on row, query and key position.
        let logit = |r: usize, q: usize, p: usize| (((r * 31 + q * 7 + p * 13) % 17) as f32) / 4.0;
        let step = |query_pos: usize, iteration: u32, scores: &mut Vec<f32>, positions: &[Vec<usize>], n: usize| {
            for r in 0..rows {
                let (layer, kv_head) = (r / KV_HEADS, r % KV_HEADS);
                for g in 0..Q_PER_KV {
                    let ctx = StepContext {
                        seed,
                        query_pos: query_pos as u32,
                        iteration,
                        total_iterations: steps,
                        layer: layer as u32,
                        q_head: (kv_head * Q_PER_KV + g) as u32,
                    };
                    // Causal: a query sees the cached keys up to its own position.
                    let row: Vec<f32> = positions[r]
                        .iter()
                        .map(|&p| if p <= query_pos { logit(r, query_pos, p) } else { f32::NEG_INFINITY })
                        .collect();
                    policy.accumulate(&row, &ctx, &mut scores[r * n..(r + 1) * n]);
                }
            }
        };
        for q in 0..prompt_len {
            step(q, 0, &mut scores, &positions, n);
        }
        if policy.needs_scores() {
            // Every prompt row added one unit of mass per query head.
            let total: f32 = scores.iter().sum();
            let expected = (prompt_len * rows * Q_PER_KV) as f32;
            prop_assert!((total - expected).abs() < 1e-3 * expected, "{} vs {}", total, expected);
        }
        for (t, next_pos) in (0..=steps).zip(prompt_len..) {
            if policy.evicts() && n >= budget.keep() + block {
                let dims = Dims { layers: LAYERS, kv_heads: KV_HEADS, keys: n };
                let kept = select_kept(&*policy, &scores, dims, &budget, mode).unwrap();
                let k = budget.kept_count(n);
                prop_assert_eq!(kept.len(), rows * k);
                scores = compact_scores(&scores, dims, &kept).unwrap();
                for (r, row) in kept.chunks_exact(k).enumerate() {
                    positions[r] = row.iter().map(|&s| positions[r][s]).collect();
                }
                n = k;
                for r in 0..rows {
                    let pos = &positions[r];
                    prop_assert!(pos.windows(2).all(|w| w[0] < w[1]));
                    let w = match kind {
                        PolicyKind::Keyformer | PolicyKind::H2O => budget.recent(),
                        PolicyKind::Sink => k - budget.sinks().min(k),
                        PolicyKind::Window | PolicyKind::Full => k,
                    };
                    // The w most recent positions of the sequence are kept.
                    prop_assert!(pos[k - w..].iter().copied().eq(next_pos - w..next_pos));
                    if kind != PolicyKind::Window {
                        let s = budget.sinks().min(k);
                        prop_assert!(pos[..s].iter().copied().eq(0..s));
                    }
                    if mode == SelectionMode::Shared {
                        prop_assert_eq!(pos, &positions[0]);
                    }
                }
            }
            if t == steps {
                break;
            }
            // Append the new token's key everywhere, then attend with it.
            for (r, pos) in positions.iter_mut().enumerate() {
                pos.push(next_pos);
                scores.insert(r * (n + 1) + n, 0.0);
            }
            n += 1;
            step(next_pos, t + 1, &mut scores, &positions, n);
        }
        prop_assert!(positions.iter().all(|p| p.len() == n));
    }
}
