//! The merge algebra against a naive f64 softmax: any partition of the keys, merged in any order and
//! grouping, equals attention over all of them.

use proptest::prelude::*;
use turbo_attention::{attend, paged_attention, AttentionState, KvRows, PagedKv, QuerySpan};

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

/// Elementwise closeness relative to the vector's scale: `o` is a weighted mean of values, so its
/// rounding error scales with the largest of them, not with each (possibly cancelling) element.
fn close(a: &[f32], b: &[f64], tol: f64) -> bool {
    let scale = 1.0 + b.iter().fold(0f64, |m, y| m.max(y.abs()));
    a.iter()
        .zip(b)
        .all(|(x, y)| (*x as f64 - y).abs() <= tol * scale)
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
        // Left fold and a pairwise tree of merges must agree with the reference.
        let folded = AttentionState::merge_all(d, &parts);
        let mut tree = parts.clone();
        while tree.len() > 1 {
            tree = tree.chunks(2).map(|c| AttentionState::merge_all(d, c)).collect();
        }
        let all: Vec<usize> = (0..n).collect();
        let (o_ref, lse_ref) = reference(&q, &k, &v, d, &all, scale as f64);
        for s in [&folded, &tree[0]] {
            prop_assert!(s.lse.is_finite());
            prop_assert!((s.lse as f64 - lse_ref).abs() <= 1e-4 * (1.0 + lse_ref.abs()), "lse {} vs {}", s.lse, lse_ref);
            prop_assert!(close(&s.o, &o_ref, 1e-4), "o {:?} vs {:?}", s.o, o_ref);
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
            assert!(close(o, &o_ref, 1e-5), "token {token} head {h}");
            assert!((lse[token * n_heads + h] as f64 - lse_ref).abs() < 1e-5);
        }
    }
}
