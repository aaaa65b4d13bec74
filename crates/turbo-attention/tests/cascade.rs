//! Cascade attention against the plain path, and the grouping of spans by shared blocks.
//!
//! Batches are built the way the KV cache's prefix sharing makes them: families of sequences
//! whose block tables start with the same blocks (some families forking again further on), each
//! sequence continuing into blocks of its own, with block ids drawn from a shuffled pool so that
//! tables are neither contiguous nor monotonic, and the sequences' query rows in a shuffled order.

use proptest::prelude::*;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use turbo_attention::cascade::{
    cascade_groups, paged_attention_cascade, try_paged_attention_cascade, CascadeGroup,
};
use turbo_attention::kv_quant::{dequantize_row, quantize_row};
use turbo_attention::{paged_attention, AttentionError, KvDtype, PagedKv, QuantKv, QuerySpan};

/// A random batch: the paged KV storage, the query tensor, and per sequence (q_start, n_q,
/// kv_len, table).
struct Batch {
    block_size: usize,
    n_kv_heads: usize,
    n_heads: usize,
    d: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
    q: Vec<f32>,
    seqs: Vec<(usize, usize, usize, Vec<u32>)>,
}

impl Batch {
    /// `families`: per family, its shared prefix in blocks and its members as (extra blocks shared
    /// with the previous member, own tokens after the shared blocks, query rows).
    #[allow(clippy::type_complexity)]
    fn new(
        seed: u64,
        block_size: usize,
        n_kv_heads: usize,
        per_kv: usize,
        d: usize,
        magnitude: f32,
        families: &[(usize, Vec<(usize, usize, usize)>)],
    ) -> Batch {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let total_blocks: usize = families
            .iter()
            .map(|(p, ms)| {
                p + ms
                    .iter()
                    .map(|&(x, own, _)| x + own.div_ceil(block_size) + 1)
                    .sum::<usize>()
            })
            .sum::<usize>()
            + 3;
        let mut pool: Vec<u32> = (0..total_blocks as u32).collect();
        pool.shuffle(&mut rng);
        let mut take = |n: usize| -> Vec<u32> { pool.drain(..n).collect() };
        let mut seqs = Vec::new();
        for (prefix_blocks, members) in families {
            let prefix = take(*prefix_blocks);
            let mut previous = prefix.clone();
            for &(extra, own, n_q) in members {
                // Share `extra` more blocks with the previous member where it has them (a fork
                // further on), then continue into blocks of this sequence's own.
                let keep = (prefix.len() + extra).min(previous.len());
                let mut table = previous[..keep].to_vec();
                let kv_len = keep * block_size + own;
                table.extend(take(own.div_ceil(block_size) + 1));
                let n_q = n_q.clamp(1, kv_len);
                previous = table.clone();
                seqs.push((0, n_q, kv_len, table));
            }
        }
        let mut order: Vec<usize> = (0..seqs.len()).collect();
        order.shuffle(&mut rng);
        let mut row = 0;
        for &s in &order {
            seqs[s].0 = row;
            row += seqs[s].1;
        }
        let n_heads = n_kv_heads * per_kv;
        let len = total_blocks * block_size * n_kv_heads * d;
        let mut r = |n: usize, m: f32| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(-1.0f32..1.0) * m).collect()
        };
        Batch {
            block_size,
            n_kv_heads,
            n_heads,
            d,
            keys: r(len, magnitude),
            values: r(len, 1.0),
            q: r(row * n_heads * d, magnitude),
            seqs,
        }
    }

    fn kv(&self) -> PagedKv<'_> {
        PagedKv::f32(
            &self.keys,
            &self.values,
            self.block_size,
            self.n_kv_heads,
            self.d,
        )
    }

    /// Quantizes the keys and values as `dtype` (codes, scales) and replaces the f32 rows with
    /// their decoded values.
    fn quantize(&mut self, dtype: KvDtype) -> [(Vec<u8>, Vec<f32>); 2] {
        let d = self.d;
        [&mut self.keys, &mut self.values].map(|rows| {
            let mut codes = vec![0u8; rows.len()];
            let mut scales = Vec::new();
            for (x, c) in rows.chunks_mut(d).zip(codes.chunks_mut(d)) {
                let scale = quantize_row(dtype, x, c);
                dequantize_row(dtype, c, scale, x);
                scales.push(scale);
            }
            (codes, scales)
        })
    }

    fn spans(&self) -> Vec<QuerySpan<'_>> {
        self.seqs
            .iter()
            .map(|(q_start, n_q, kv_len, table)| QuerySpan {
                q_start: *q_start,
                n_q: *n_q,
                kv_len: *kv_len,
                block_table: table,
            })
            .collect()
    }

    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }

    /// The plain path's output and the cascade path's with `groups`.
    fn both(&self, groups: &[CascadeGroup]) -> (Output, Output) {
        let (kv, spans) = (self.kv(), self.spans());
        let rows = self.q.len() / self.d;
        let mut plain = (vec![f32::NAN; self.q.len()], vec![f32::NAN; rows]);
        paged_attention(
            &self.q,
            self.n_heads,
            &kv,
            &spans,
            self.scale(),
            &mut plain.0,
            Some(&mut plain.1),
        );
        let mut cascade = (vec![f32::NAN; self.q.len()], vec![f32::NAN; rows]);
        paged_attention_cascade(
            &self.q,
            self.n_heads,
            &kv,
            &spans,
            groups,
            self.scale(),
            &mut cascade.0,
            Some(&mut cascade.1),
        );
        (plain, cascade)
    }
}

/// An attention's `(out, lse)`.
type Output = (Vec<f32>, Vec<f32>);

/// Largest |cascade - plain| over o, and over lse relative to 1 + |lse|.
fn max_errors(plain: &Output, cascade: &Output) -> (f32, f32) {
    let o = plain
        .0
        .iter()
        .zip(&cascade.0)
        .map(|(a, b)| (a - b).abs())
        .fold(
            0f32,
            |m, e| if e.is_nan() { f32::INFINITY } else { m.max(e) },
        );
    let lse = plain
        .1
        .iter()
        .zip(&cascade.1)
        .map(|(a, b)| (a - b).abs() / (1.0 + a.abs()))
        .fold(
            0f32,
            |m, e| if e.is_nan() { f32::INFINITY } else { m.max(e) },
        );
    (o, lse)
}

/// Tolerance of cascade against plain. Both compute in f32 from the same inputs; they differ only
/// in the order of the softmax sums (the plain path sums all keys after one max, cascade sums per
/// key tile with online rescaling, then merges a few states). With |score| <= S, rounding a score
/// moves its weight by about S · 2^-24 relatively, and a sum of n <= 700 positive terms in another
/// order differs by well under n · 2^-24 relatively. Values are in [-1, 1], so |o| <= 1, and
/// `1e-6 · (1 + S)` absolute on o (relative to 1 + |lse| on lse) bounds that with room: over 300
/// random batches the largest difference was under 7% of it. A wrong key, block, head or merge
/// weight moves the result by orders of magnitude more (dropping one key per row fails at once).
fn tolerance(magnitude: f32, d: usize) -> f32 {
    let max_score = magnitude * magnitude * (d as f32).sqrt();
    1e-6 * (1.0 + max_score)
}

fn family() -> impl Strategy<Value = (usize, Vec<(usize, usize, usize)>)> {
    (
        1usize..24,
        prop::collection::vec((0usize..4, 0usize..40, 1usize..6), 1..6),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(120))]

    #[test]
    fn cascade_equals_plain_attention(
        block_size in 1usize..=16,
        n_kv_heads in 1usize..=3,
        per_kv in prop::sample::select(vec![1usize, 2, 3, 4]),
        d in prop::sample::select(vec![4usize, 8, 16, 64]),
        magnitude in prop::sample::select(vec![1.0f32, 3.0]),
        families in prop::collection::vec(family(), 1..4),
        min_shared in prop::sample::select(vec![0usize, 1, 16, 64]),
        seed in any::<u64>(),
    ) {
        let batch = Batch::new(seed, block_size, n_kv_heads, per_kv, d, magnitude, &families);
        let groups = cascade_groups(&batch.spans(), block_size, min_shared);
        for g in &groups {
            prop_assert!(g.shared_len >= min_shared.max(1));
        }
        let (plain, cascade) = batch.both(&groups);
        let (e_o, e_lse) = max_errors(&plain, &cascade);
        let tol = tolerance(magnitude, d);
        prop_assert!(e_o <= tol, "o differs by {e_o} > {tol} with groups {groups:?}");
        prop_assert!(e_lse <= tol, "lse differs by {e_lse} > {tol} with groups {groups:?}");
    }

    /// Any valid grouping works, not only the one `cascade_groups` picks: here each family's
    /// members are grouped over a random number of their common blocks.
    #[test]
    fn any_valid_group_gives_the_same_attention(
        block_size in 1usize..=8,
        per_kv in 1usize..=3,
        prefix in 1usize..40,
        members in prop::collection::vec((0usize..30, 1usize..4), 2..6),
        cut in any::<prop::sample::Index>(),
        seed in any::<u64>(),
    ) {
        let family = (prefix, members.iter().map(|&(own, n_q)| (0, own + n_q, n_q)).collect());
        let batch = Batch::new(seed, block_size, 2, per_kv, 8, 1.0, &[family]);
        let shared_len = (1 + cut.index(prefix)) * block_size;
        let groups = [CascadeGroup { members: (0..members.len()).collect(), shared_len }];
        let (plain, cascade) = batch.both(&groups);
        let (e_o, e_lse) = max_errors(&plain, &cascade);
        let tol = tolerance(1.0, 8);
        prop_assert!(e_o <= tol && e_lse <= tol, "errors {e_o}, {e_lse} > {tol}");
    }

    /// The groups `cascade_groups` returns always satisfy `CascadeGroup`'s invariants (checked by
    /// the cascade entry point), and no span is in two of them.
    #[test]
    fn groups_satisfy_their_invariants(
        block_size in 1usize..=16,
        families in prop::collection::vec(family(), 1..5),
        min_shared in 0usize..100,
        seed in any::<u64>(),
    ) {
        let batch = Batch::new(seed, block_size, 1, 1, 4, 1.0, &families);
        let spans = batch.spans();
        let groups = cascade_groups(&spans, block_size, min_shared);
        let mut out = vec![0.0; batch.q.len()];
        let checked = try_paged_attention_cascade(
            &batch.q, 1, &batch.kv(), &spans, &groups, 1.0, &mut out, None,
        );
        prop_assert!(checked.is_ok(), "{checked:?} for {groups:?}");
        for g in &groups {
            prop_assert!(g.shared_len >= min_shared);
        }
        prop_assert_eq!(cascade_groups(&spans, block_size, min_shared), groups);
    }
}

/// Spans over hand-made tables: (n_q, kv_len, table).
fn spans_of(seqs: &[(usize, usize, Vec<u32>)]) -> Vec<QuerySpan<'_>> {
    let mut row = 0;
    seqs.iter()
        .map(|(n_q, kv_len, table)| {
            let s = QuerySpan {
                q_start: row,
                n_q: *n_q,
                kv_len: *kv_len,
                block_table: table,
            };
            row += n_q;
            s
        })
        .collect()
}

/// Cascade over a quantized cache decodes each shared tile as the plain path reads the same rows
/// stored as f32: the outputs are the same bits.
#[test]
fn cascade_over_quantized_kv_equals_it_over_the_decoded_rows() {
    for dtype in [KvDtype::Int8, KvDtype::Fp8] {
        let family = (3, vec![(0, 20, 1), (1, 7, 1), (0, 33, 1), (0, 5, 4)]);
        let mut batch = Batch::new(9, 4, 2, 4, 64, 1.0, &[family.clone(), family]);
        let [(kc, ks), (vc, vs)] = batch.quantize(dtype);
        let spans = batch.spans();
        let groups = cascade_groups(&spans, batch.block_size, 1);
        assert!(!groups.is_empty());
        let rows = batch.q.len() / batch.d;
        let run = |kv: &PagedKv| {
            let mut out = (vec![f32::NAN; batch.q.len()], vec![f32::NAN; rows]);
            paged_attention_cascade(
                &batch.q,
                batch.n_heads,
                kv,
                &spans,
                &groups,
                batch.scale(),
                &mut out.0,
                Some(&mut out.1),
            );
            out
        };
        let plain = run(&batch.kv());
        let mut quant = PagedKv::f32(&[], &[], batch.block_size, batch.n_kv_heads, batch.d);
        quant.quant = Some(QuantKv {
            dtype,
            keys: &kc,
            values: &vc,
            key_scales: &ks,
            value_scales: &vs,
        });
        let quantized = run(&quant);
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same(&plain.0, &quantized.0) && same(&plain.1, &quantized.1),
            "{dtype}"
        );
    }
}

#[test]
fn forks_of_one_prompt_form_separate_groups() {
    // Block size 2. Spans 0, 1 and 3 share blocks 10, 11 (4 keys); 0 and 1 share 10..=17 (16
    // keys); span 2 starts elsewhere; span 4 shares block 10 but its rows start at key 1.
    let long: Vec<u32> = (10..18).collect();
    let seqs = vec![
        (1, 20, [long.clone(), vec![40, 41]].concat()),
        (1, 19, [long.clone(), vec![50, 51]].concat()),
        (1, 9, vec![60, 61, 62, 63, 64]),
        (2, 9, vec![10, 11, 70, 71, 72]),
        (2, 3, vec![10, 80]),
        (1, 7, vec![10, 11, 90, 91]),
    ];
    let spans = spans_of(&seqs);
    let groups = cascade_groups(&spans, 2, 0);
    // 0 and 1 over 16 keys saves 16 reads; all four over 4 keys saves only 12. Then 3 and 5 over
    // their common 4 keys.
    assert_eq!(
        groups,
        vec![
            CascadeGroup {
                members: vec![0, 1],
                shared_len: 16
            },
            CascadeGroup {
                members: vec![3, 5],
                shared_len: 4
            },
        ]
    );
    // A threshold above 4 keys drops the second group.
    assert_eq!(cascade_groups(&spans, 2, 5), groups[..1].to_vec());
    // A threshold above 16 drops both.
    assert!(cascade_groups(&spans, 2, 17).is_empty());
}

#[test]
fn prefill_rows_inside_the_prefix_cap_what_a_span_can_share() {
    // Both tables share 4 blocks of 4, but span 1's 10 query rows start at key 6: it can share
    // only the first block (keys 0..4) without a causal mask inside the shared part.
    let seqs = vec![(1, 20, vec![1, 2, 3, 4, 5]), (10, 16, vec![1, 2, 3, 4])];
    let groups = cascade_groups(&spans_of(&seqs), 4, 0);
    assert_eq!(
        groups,
        vec![CascadeGroup {
            members: vec![0, 1],
            shared_len: 4
        }]
    );
    // A span whose rows start in its first block shares nothing.
    let seqs = vec![(1, 20, vec![1, 2, 3, 4, 5]), (14, 16, vec![1, 2, 3, 4])];
    assert!(cascade_groups(&spans_of(&seqs), 4, 0).is_empty());
    assert!(cascade_groups(&[], 4, 0).is_empty());
    assert!(cascade_groups(&spans_of(&seqs), 0, 0).is_empty());
}

#[test]
fn malformed_groups_are_errors_not_panics() {
    let batch = Batch::new(
        3,
        4,
        1,
        1,
        4,
        1.0,
        &[(3, vec![(0, 5, 1), (0, 2, 2)]), (2, vec![(0, 3, 1)])],
    );
    let spans = batch.spans();
    let kv = batch.kv();
    let mut out = vec![0.0; batch.q.len()];
    let mut run = |groups: &[CascadeGroup]| {
        try_paged_attention_cascade(&batch.q, 1, &kv, &spans, groups, 1.0, &mut out, None)
    };
    let group = |members: Vec<usize>, shared_len| CascadeGroup {
        members,
        shared_len,
    };
    let cases: [(Vec<CascadeGroup>, &str); 7] = [
        (vec![group(vec![0], 4)], "needs two"),
        (vec![group(vec![1, 0], 4)], "ascending"),
        (vec![group(vec![0, 7], 4)], "past the 3 spans"),
        (vec![group(vec![0, 1], 6)], "multiple of the block size"),
        (vec![group(vec![0, 1], 16)], "inside the 16 shared keys"),
        (vec![group(vec![0, 2], 4)], "differ from span 0"),
        (
            vec![group(vec![0, 1], 4), group(vec![1, 2], 4)],
            "also in group 0",
        ),
    ];
    for (groups, expected) in cases {
        match run(&groups) {
            Err(e @ AttentionError::Group { .. }) => {
                assert!(e.to_string().contains(expected), "{e} lacks '{expected}'")
            }
            other => panic!("{groups:?}: expected a group error, got {other:?}"),
        }
    }
    assert!(run(&[group(vec![0, 1], 12)]).is_ok());
}
