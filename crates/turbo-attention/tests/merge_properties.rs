//! The merge algebra against a naive f64 softmax: any partition of the keys, merged in any order and
//! grouping, equals attention over all of them.

use proptest::prelude::*;
use turbo_attention::{
    attend, merge_into, merge_states, paged_attention, try_paged_attention, AttentionError,
    AttentionState, KvRows, PagedKv, QuerySpan,
};

/// Naive f64 attention of one query over rows `keys` of `kv`: (o, lse).
fn reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d: usize,
    keys: &[usize],
    scale: f64,
) -> (Vec<f64>, f64) {
    let scores: Vec<f64> = keys
        .iter()
        .map(|&j| {
            (0..d)
                .map(|i| q[i] as f64 * k[j * d + i] as f64)
                .sum::<f64>()
                * scale
        })
        .collect();
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = w.iter().sum();
    let mut o = vec![0f64; d];
    for (wj, &j) in w.iter().zip(keys) {
        for i in 0..d {
            o[i] += wj / sum * v[j * d + i] as f64;
        }
    }
    (o, max + sum.ln())
}

/// Elementwise closeness relative to the vector's scale, plus an absolute `slack`: `o` is a
/// weighted mean of values, so its rounding error scales with the largest of them, not with each
/// (possibly cancelling) element.
fn close(a: &[f32], b: &[f64], tol: f64, slack: f64) -> bool {
    let scale = 1.0 + b.iter().fold(0f64, |m, y| m.max(y.abs()));
    a.iter()
        .zip(b)
        .all(|(x, y)| (*x as f64 - y).abs() <= tol * scale + slack)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn merging_a_partition_equals_attention_over_all(
        n in 1usize..40,
        d in prop::sample::select(vec![4usize, 8, 16, 64]),
        // Scores up to |q||k| ~ magnitude^2 * d: exercises ranges far beyond exp's f32 range.
        magnitude in prop::sample::select(vec![0.1f32, 1.0, 10.0, 40.0]),
        seed in any::<u64>(),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
        order in any::<prop::sample::Index>(),
    ) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut r = |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0..1.0) * magnitude).collect() };
        let (q, k, v) = (r(d), r(n * d), r(n * d));
        let kv = KvRows { keys: &k, values: &v, head_dim: d };
        let scale = 1.0 / (d as f32).sqrt();

        let mut bounds: Vec<usize> = cuts.iter().map(|c| c.index(n + 1)).collect();
        bounds.extend([0, n]);
        bounds.sort();
        let mut parts: Vec<AttentionState> =
            bounds.windows(2).map(|w| attend(&q, &kv, w[0]..w[1], scale)).collect();
        let shift = order.index(parts.len());
        parts.rotate_left(shift);
        // A left fold of binary in-place merges, a pairwise tree of them, and the n-ary merge
        // must all agree with the reference.
        let mut folded = AttentionState::empty(d);
        for p in &parts {
            folded.merge(p);
        }
        let mut tree = parts.clone();
        while tree.len() > 1 {
            tree = tree
                .chunks(2)
                .map(|c| {
                    let mut a = c[0].clone();
                    if let Some(b) = c.get(1) {
                        merge_into(&mut a.o, &mut a.lse, &b.o, b.lse);
                    }
                    a
                })
                .collect();
        }
        let n_ary = AttentionState::merge_all(d, &parts);
        let all: Vec<usize> = (0..n).collect();
        let (o_ref, lse_ref) = reference(&q, &k, &v, d, &all, scale as f64);
        // f32 scores carry a rounding error of a few ulps of Σ|q_i k_i| · scale (thousands at
        // magnitude 40), which the softmax passes on to every weight as a relative error, so to
        // `o` times the largest value and to `lse` as is: that slack comes on top of 1e-4.
        let score_error = 8.0 * f32::EPSILON as f64 * (0..n)
            .map(|j| (0..d).map(|i| (q[i] * k[j * d + i]).abs() as f64).sum::<f64>() * scale as f64)
            .fold(0f64, f64::max);
        let v_max = v.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
        for s in [&folded, &tree[0], &n_ary] {
            prop_assert!(s.lse.is_finite());
            prop_assert!((s.lse as f64 - lse_ref).abs() <= 1e-4 * (1.0 + lse_ref.abs()) + score_error, "lse {} vs {}", s.lse, lse_ref);
            prop_assert!(close(&s.o, &o_ref, 1e-4, score_error * v_max), "o {:?} vs {:?}", s.o, o_ref);
        }
    }

    #[test]
    fn the_empty_state_is_the_identity(d in 1usize..16, lse in -1e30f32..1e30, seed in any::<u64>()) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let s = AttentionState { o: (0..d).map(|_| rng.random_range(-5.0..5.0)).collect(), lse };
        let mut left = AttentionState::empty(d);
        left.merge(&s);
        let mut right = s.clone();
        right.merge(&AttentionState::empty(d));
        prop_assert_eq!(&left, &s);
        prop_assert_eq!(&right, &s);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// States whose lse lie far apart (up to ±1e30, where exp of any of them overflows f32) merge
    /// to the f64 result: the shift by the largest lse keeps every exponent at most 0. Tolerance:
    /// each weight exp(lse_i − M) is computed from an f32 difference, so it is off by about
    /// |lse_i − M| · 2^-24 relatively, which only matters while the weight is not negligible
    /// (|lse_i − M| < ~20); that and the sum's rounding stay below 1e-5 relative to the largest
    /// |o_i|. The merged lse is M plus a logarithm in [0, ln n], rounded: 1e-6 · (1 + |lse|).
    #[test]
    fn far_apart_states_merge_without_overflow(
        n in 0usize..20,
        d in 1usize..12,
        range in prop::sample::select(vec![1.0f32, 30.0, 100.0, 1e4, 1e30]),
        empties in prop::collection::vec(any::<bool>(), 20),
        seed in any::<u64>(),
    ) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let states: Vec<AttentionState> = (0..n)
            .map(|i| AttentionState {
                o: (0..d).map(|_| rng.random_range(-3.0f32..3.0)).collect(),
                lse: if empties[i] { f32::NEG_INFINITY } else { rng.random_range(-range..range) },
            })
            .collect();
        let merged = AttentionState::merge_all(d, &states);
        let live: Vec<&AttentionState> = states.iter().filter(|s| s.lse.is_finite()).collect();
        if live.is_empty() {
            prop_assert_eq!(merged, AttentionState::empty(d));
            return Ok(());
        }
        let m = live.iter().map(|s| s.lse as f64).fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = live.iter().map(|s| (s.lse as f64 - m).exp()).collect();
        let sum: f64 = w.iter().sum();
        let o_ref: Vec<f64> = (0..d)
            .map(|i| live.iter().zip(&w).map(|(s, w)| w * s.o[i] as f64).sum::<f64>() / sum)
            .collect();
        let lse_ref = m + sum.ln();
        prop_assert!(merged.lse.is_finite() && merged.o.iter().all(|x| x.is_finite()));
        prop_assert!((merged.lse as f64 - lse_ref).abs() <= 1e-6 * (1.0 + lse_ref.abs()), "lse {} vs {lse_ref}", merged.lse);
        let o_max = live.iter().flat_map(|s| &s.o).fold(0f64, |a, &x| a.max(x.abs() as f64));
        for (x, y) in merged.o.iter().zip(&o_ref) {
            prop_assert!((*x as f64 - y).abs() <= 1e-5 * o_max, "o {x} vs {y}");
        }
        // Pairwise in-place merges agree as well.
        let mut folded = AttentionState::empty(d);
        for s in &states {
            folded.merge(s);
        }
        prop_assert!((folded.lse as f64 - lse_ref).abs() <= 1e-6 * (1.0 + lse_ref.abs()));
        for (x, y) in folded.o.iter().zip(&o_ref) {
            prop_assert!((*x as f64 - y).abs() <= 1e-5 * o_max, "folded o {x} vs {y}");
        }
    }

    /// Merging a state with any number of empty states gives it back bit for bit, whatever `o`
    /// the empty ones carry (an empty state's `o` is never read).
    #[test]
    fn empty_states_are_an_exact_identity_for_the_n_ary_merge(
        d in 1usize..16,
        lse in -1e30f32..1e30,
        before in 0usize..4,
        after in 0usize..4,
        seed in any::<u64>(),
    ) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let o: Vec<f32> = (0..d).map(|_| rng.random_range(-5.0..5.0)).collect();
        let junk: Vec<f32> = (0..d).map(|_| rng.random_range(-5.0..5.0)).collect();
        let mut states: Vec<(&[f32], f32)> = vec![(&junk, f32::NEG_INFINITY); before];
        states.push((&o, lse));
        states.extend(std::iter::repeat_n((&junk[..], f32::NEG_INFINITY), after));
        let mut out = vec![f32::NAN; d];
        let merged = merge_states(&states, &mut out);
        prop_assert_eq!(merged.to_bits(), lse.to_bits());
        prop_assert!(out.iter().zip(&o).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn merging_nothing_or_only_empty_states_is_the_empty_state() {
    let junk = [f32::NAN, 1.0, -2.0];
    for n in [0usize, 1, 5] {
        let states = vec![(&junk[..], f32::NEG_INFINITY); n];
        let mut out = [7.0f32; 3];
        assert_eq!(merge_states(&states, &mut out), f32::NEG_INFINITY);
        assert_eq!(out, [0.0; 3]);
    }
}

#[test]
fn empty_merged_with_empty_stays_empty() {
    let mut a = AttentionState::empty(3);
    a.merge(&AttentionState::empty(3));
    assert_eq!(a.lse, f32::NEG_INFINITY);
    assert_eq!(a.o, vec![0.0; 3]);
}

#[test]
fn paged_attention_matches_reference_on_ragged_batches() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let (block_size, n_kv_heads, n_heads, d) = (4usize, 2usize, 6usize, 8usize);
    let n_blocks = 40;
    let slot = n_kv_heads * d;
    let mut r =
        |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let keys = r(n_blocks * block_size * slot);
    let values = r(n_blocks * block_size * slot);
    let kv = PagedKv {
        keys: &keys,
        values: &values,
        block_size,
        n_kv_heads,
        head_dim: d,
        quant: None,
    };
    // Two sequences with scattered, non-monotonic blocks: a 3-token prefill over 6 cached tokens
    // (crossing a block boundary), and a 1-token decode at length 13.
    let table_a = [7u32, 2, 30];
    let table_b = [5u32, 9, 1, 22];
    let spans = [
        QuerySpan {
            q_start: 0,
            n_q: 3,
            kv_len: 9,
            block_table: &table_a,
        },
        QuerySpan {
            q_start: 3,
            n_q: 1,
            kv_len: 13,
            block_table: &table_b,
        },
    ];
    let q = r(4 * n_heads * d);
    let mut out = vec![f32::NAN; q.len()];
    let mut lse = vec![f32::NAN; 4 * n_heads];
    let scale = 0.3;
    paged_attention(&q, n_heads, &kv, &spans, scale, &mut out, Some(&mut lse));

    for (token, (table, pos)) in [
        (&table_a[..], 6),
        (&table_a[..], 7),
        (&table_a[..], 8),
        (&table_b[..], 12),
    ]
    .into_iter()
    .enumerate()
    {
        for h in 0..n_heads {
            let kvh = h / (n_heads / n_kv_heads);
            // Gather this head's keys 0..=pos into contiguous rows for the reference.
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for p in 0..=pos {
                let at = ((table[p / block_size] as usize * block_size + p % block_size)
                    * n_kv_heads
                    + kvh)
                    * d;
                k.extend_from_slice(&keys[at..at + d]);
                v.extend_from_slice(&values[at..at + d]);
            }
            let idx: Vec<usize> = (0..=pos).collect();
            let qh = &q[(token * n_heads + h) * d..][..d];
            let (o_ref, lse_ref) = reference(qh, &k, &v, d, &idx, scale as f64);
            let o = &out[(token * n_heads + h) * d..][..d];
            assert!(close(o, &o_ref, 1e-5, 0.0), "token {token} head {h}");
            assert!((lse[token * n_heads + h] as f64 - lse_ref).abs() < 1e-5);
        }
    }
}

#[test]
fn malformed_batches_are_errors_not_panics() {
    let (block_size, n_kv_heads, n_heads, d) = (4usize, 2usize, 4usize, 8usize);
    let storage = vec![0.5f32; 3 * block_size * n_kv_heads * d];
    let kv = PagedKv {
        keys: &storage,
        values: &storage,
        block_size,
        n_kv_heads,
        head_dim: d,
        quant: None,
    };
    let q = vec![0.1f32; 2 * n_heads * d];
    let table = [2u32, 0];
    let span = |q_start, n_q, kv_len, block_table| QuerySpan {
        q_start,
        n_q,
        kv_len,
        block_table,
    };
    let run = |spans: &[QuerySpan], heads: usize, lse_len: usize| {
        let mut out = vec![0.0; q.len()];
        let mut lse = vec![0.0; lse_len];
        try_paged_attention(&q, heads, &kv, spans, 1.0, &mut out, Some(&mut lse))
    };
    let cases: Vec<(Result<(), AttentionError>, &str)> = vec![
        (
            run(&[span(0, 2, 6, &table)], 3, 6),
            "not a multiple of 2 KV heads",
        ),
        (
            run(&[span(0, 2, 6, &table)], n_heads, 5),
            "lse has 5 elements",
        ),
        (run(&[], n_heads, 8), "no spans"),
        (
            run(&[span(0, 3, 6, &table)], n_heads, 8),
            "past the batch's 2 rows",
        ),
        (run(&[span(0, 2, 1, &table)], n_heads, 8), "only 1 keys"),
        (run(&[span(0, 2, 9, &table)], n_heads, 8), "need 3 blocks"),
        (
            run(&[span(0, 2, 6, &[2, 3])], n_heads, 8),
            "block 3 is past",
        ),
        (
            run(&[span(0, 2, 6, &table), span(1, 1, 3, &table)], n_heads, 8),
            "row 1 is also a row of span 0",
        ),
    ];
    for (result, expected) in cases {
        let e = result.expect_err(expected);
        assert!(e.to_string().contains(expected), "'{e}' lacks '{expected}'");
    }
    assert!(run(&[span(0, 2, 6, &table)], n_heads, 8).is_ok());
}
