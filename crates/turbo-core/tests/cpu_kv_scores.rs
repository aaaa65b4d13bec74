//! The CPU backend's KV eviction scores against the f64 reference of the score functions, over a
//! scattered block table, a decode row and a prefill chunk with cached keys, under GQA; and
//! compaction carrying scores with their keys.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use turbo_attention::QuerySpan;
use turbo_core::backend::BatchLayout;
use turbo_core::cpu::{CpuBackend, CpuKvCache, HostTensor, KvCacheSpec};
use turbo_core::{Backend, KvCompaction, KvScoring};
use turbo_keyformer::{score_increment_reference, ScoreFunction, StepContext, TauSchedule};

const LAYERS: usize = 2;
const KV_HEADS: usize = 2;
const HEADS: usize = 6;
const D: usize = 16;
const BLOCK: usize = 4;
const SCALE: f32 = 0.25;

struct Case {
    cache: CpuKvCache,
    /// Per sequence: its block table and its keys, `[layer][key][kv head][d]`.
    tables: Vec<Vec<u32>>,
    keys: Vec<Vec<f32>>,
}

/// Two sequences with `lens` keys each on shuffled blocks, random keys in every layer.
fn case(rng: &mut ChaCha8Rng, lens: &[usize]) -> Case {
    let spec = KvCacheSpec {
        n_layers: LAYERS,
        n_kv_heads: KV_HEADS,
        head_dim: D,
        block_size: BLOCK,
        max_blocks: 64,
        dtype: turbo_core::KvDtype::Full,
    };
    let mut cache = CpuKvCache::new(spec);
    let mut ids: Vec<u32> = (0..64).collect();
    ids.shuffle(rng);
    let mut tables = Vec::new();
    let mut keys = Vec::new();
    let mut next = 0;
    for &len in lens {
        let blocks = len.div_ceil(BLOCK);
        let table = ids[next..next + blocks].to_vec();
        next += blocks;
        let slots: Vec<u32> = (0..len)
            .map(|j| table[j / BLOCK] * BLOCK as u32 + (j % BLOCK) as u32)
            .collect();
        let mut all = Vec::new();
        for layer in 0..LAYERS {
            let k: Vec<f32> = (0..len * KV_HEADS * D)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let v = vec![0.0; k.len()];
            cache.write(layer, &k, &v, &slots);
            all.extend_from_slice(&k);
        }
        tables.push(table);
        keys.push(all);
    }
    Case {
        cache,
        tables,
        keys,
    }
}

/// f64 reference: per (layer, KV head, key) the sum of the increments of every query row and
/// query head of the span, with the logits computed in f64 and rounded to f32 (the reference's
/// input type).
#[allow(clippy::too_many_arguments)]
fn reference(
    keys: &[f32],
    kv_len: usize,
    q: &[f32],
    rows: std::ops::Range<usize>,
    positions: &[u32],
    scoring: &KvScoring,
    layer: usize,
    out: &mut [f64],
) {
    let n_q = rows.len();
    for (r, row) in rows.enumerate() {
        let visible = kv_len - n_q + r + 1;
        for h in 0..HEADS {
            let g = h / (HEADS / KV_HEADS);
            let logits: Vec<f32> = (0..visible)
                .map(|j| {
                    let k = &keys[((layer * kv_len + j) * KV_HEADS + g) * D..][..D];
                    let qh = &q[(row * HEADS + h) * D..][..D];
                    let dot: f64 = qh.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum();
                    (dot * SCALE as f64) as f32
                })
                .collect();
            let ctx = StepContext {
                seed: scoring.seed,
                query_pos: positions[row],
                iteration: scoring.iteration,
                total_iterations: scoring.total_iterations,
                layer: layer as u32,
                q_head: h as u32,
            };
            let inc = score_increment_reference(&scoring.function, &logits, &ctx);
            for (j, v) in inc.iter().enumerate() {
                out[(layer * KV_HEADS + g) * kv_len + j] += v;
            }
        }
    }
}

/// A batch of one row per position over `spans`, scored as `scoring` says (only attention
/// inputs matter: ids and slots are placeholders).
fn scored_batch(
    backend: &CpuBackend,
    positions: &[u32],
    spans: &[QuerySpan],
    scoring: &[Option<KvScoring>],
    cache: &CpuKvCache,
) -> <CpuBackend as Backend>::Batch {
    let zeros = vec![0u32; positions.len()];
    let mut batch = backend.new_batch().unwrap();
    backend
        .prepare_batch(
            &mut batch,
            &BatchLayout {
                ids: &zeros,
                positions,
                slots: &zeros,
                spans,
                inv_freq: &[],
                outputs: &[],
                n_heads: HEADS,
                vocab: 0,
                sampling: None,
                scoring,
            },
            cache,
        )
        .unwrap();
    batch
}

#[test]
fn scores_match_the_f64_reference_for_decode_and_prefill_rows() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for function in [
        ScoreFunction::Softmax,
        ScoreFunction::GumbelSoftmax(TauSchedule::new(1.0, 2.0).unwrap()),
    ] {
        // Sequence 0 decodes one row over 37 keys; sequence 1 prefills 9 rows after 21 cached.
        let lens = [37usize, 30];
        let mut c = case(&mut rng, &lens);
        let spans = [
            QuerySpan {
                q_start: 0,
                n_q: 1,
                kv_len: 37,
                block_table: &c.tables[0],
            },
            QuerySpan {
                q_start: 1,
                n_q: 9,
                kv_len: 30,
                block_table: &c.tables[1],
            },
        ];
        let rows = 10;
        // Positions past the key counts, as after compaction.
        let positions: Vec<u32> = std::iter::once(120).chain((0..9).map(|i| 51 + i)).collect();
        let scorings = [
            Some(KvScoring {
                function,
                seed: 7,
                iteration: 3,
                total_iterations: 10,
            }),
            Some(KvScoring {
                function,
                seed: 8,
                iteration: 0,
                total_iterations: 10,
            }),
        ];
        let q: Vec<f32> = (0..rows * HEADS * D)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let backend = CpuBackend::with_threads(2).unwrap();
        let batch = scored_batch(&backend, &positions, &spans, &scorings, &c.cache);
        let qt = HostTensor {
            data: q.clone(),
            rows,
            cols: HEADS * D,
        };
        // Two steps accumulate.
        for _ in 0..2 {
            for layer in 0..LAYERS {
                backend
                    .accumulate_kv_scores(&qt, &mut c.cache, layer, HEADS, &batch, SCALE)
                    .unwrap();
            }
        }
        for (s, span) in spans.iter().enumerate() {
            let got = backend
                .read_kv_scores(&c.cache, span.block_table, span.kv_len)
                .unwrap();
            let mut want = vec![0.0f64; LAYERS * KV_HEADS * span.kv_len];
            for layer in 0..LAYERS {
                let rows = span.q_start..span.q_start + span.n_q;
                let sc = scorings[s].as_ref().unwrap();
                reference(
                    &c.keys[s],
                    span.kv_len,
                    &q,
                    rows,
                    &positions,
                    sc,
                    layer,
                    &mut want,
                );
            }
            // Each row's increments sum to 1 per query head; the scores are sums of at most
            // 2 steps x 9 rows x 3 heads of them. f32 exp and sums against f64: 1e-5 relative
            // per increment, so 2e-4 absolute on totals up to ~54 is generous but not loose.
            let total: f64 = want.iter().sum();
            let expect_total = (span.n_q * HEADS * LAYERS) as f64;
            assert!(
                (total - expect_total).abs() < 1e-6 * expect_total,
                "{total}"
            );
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let w2 = 2.0 * w;
                assert!(
                    (*g as f64 - w2).abs() <= 2e-4 * w2.abs().max(1.0),
                    "{function:?} seq {s} entry {i}: {g} vs {w2}"
                );
            }
        }
    }
}

#[test]
fn compaction_carries_scores_and_new_keys_start_at_zero() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let mut c = case(&mut rng, &[12]);
    let table = c.tables[0].clone();
    let spans = [QuerySpan {
        q_start: 0,
        n_q: 1,
        kv_len: 12,
        block_table: &table,
    }];
    let scoring = [Some(KvScoring {
        function: ScoreFunction::Softmax,
        seed: 0,
        iteration: 1,
        total_iterations: 4,
    })];
    let backend = CpuBackend::with_threads(1).unwrap();
    let batch = scored_batch(&backend, &[11], &spans, &scoring, &c.cache);
    let q = HostTensor {
        data: (0..HEADS * D)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect(),
        rows: 1,
        cols: HEADS * D,
    };
    for layer in 0..LAYERS {
        backend
            .accumulate_kv_scores(&q, &mut c.cache, layer, HEADS, &batch, SCALE)
            .unwrap();
    }
    let before = backend.read_kv_scores(&c.cache, &table, 12).unwrap();
    // Every row keeps its own 5 keys.
    let kept: Vec<u32> = (0..LAYERS * KV_HEADS)
        .flat_map(|r| [0, 2 + r as u32 % 2, 5, 8, 11])
        .collect();
    let compaction = KvCompaction {
        block_table: &table,
        kept: &kept,
        kept_per_row: 5,
    };
    backend.compact_kv(&mut c.cache, &compaction).unwrap();
    let after = backend.read_kv_scores(&c.cache, &table, 5).unwrap();
    for r in 0..LAYERS * KV_HEADS {
        for (i, &from) in kept[r * 5..(r + 1) * 5].iter().enumerate() {
            assert_eq!(after[r * 5 + i], before[r * 12 + from as usize]);
        }
    }
    // A key written at index 5 starts unscored in every layer.
    let slot = table[5 / BLOCK] * BLOCK as u32 + (5 % BLOCK) as u32;
    for layer in 0..LAYERS {
        let k = vec![0.5; KV_HEADS * D];
        c.cache.write(layer, &k, &k, &[slot]);
    }
    let fresh = backend.read_kv_scores(&c.cache, &table, 6).unwrap();
    for r in 0..LAYERS * KV_HEADS {
        assert_eq!(fresh[r * 6 + 5], 0.0);
        assert!(fresh[r * 6..r * 6 + 5].iter().sum::<f32>() > 0.0);
    }
}
