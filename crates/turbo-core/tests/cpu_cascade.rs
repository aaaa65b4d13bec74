//! The CPU backend's attention switches to cascade when sequences share prefix blocks, and agrees
//! with the plain path; malformed batches are errors.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use turbo_attention::cascade::cascade_groups;
use turbo_attention::{paged_attention, QuerySpan};
use turbo_core::backend::BatchLayout;
use turbo_core::cpu::{CpuBackend, CpuKvCache, HostTensor, KvCacheSpec, CASCADE_MIN_SHARED_KEYS};
use turbo_core::Backend;

const N_KV_HEADS: usize = 2;
const N_HEADS: usize = 6;
const D: usize = 16;
const BLOCK: usize = 4;

fn cache(rng: &mut ChaCha8Rng, blocks: usize) -> CpuKvCache {
    let mut cache = CpuKvCache::new(KvCacheSpec {
        n_layers: 1,
        n_kv_heads: N_KV_HEADS,
        head_dim: D,
        block_size: BLOCK,
        max_blocks: blocks,
        dtype: turbo_core::KvDtype::Full,
    });
    let n = blocks * BLOCK;
    let mut r =
        |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let (k, v) = (r(n * N_KV_HEADS * D), r(n * N_KV_HEADS * D));
    let slots: Vec<u32> = (0..n as u32).collect();
    cache.write(0, &k, &v, &slots);
    cache
}

/// A batch of `positions.len()` rows over `spans`, all of them outputs, with token id 0.
fn layout<'a>(
    positions: &'a [u32],
    slots: &'a [u32],
    spans: &'a [QuerySpan<'a>],
) -> BatchLayout<'a> {
    BatchLayout {
        ids: &ZEROS[..positions.len()],
        positions,
        slots,
        spans,
        inv_freq: &[],
        outputs: &[],
        n_heads: N_HEADS,
        vocab: 0,
        sampling: None,
        scoring: &[],
    }
}

static ZEROS: [u32; 4096] = [0; 4096];

fn attend(backend: &CpuBackend, cache: &CpuKvCache, q: &[f32], spans: &[QuerySpan]) -> Vec<f32> {
    let rows = q.len() / (N_HEADS * D);
    let (positions, slots) = (vec![0u32; rows], vec![0u32; rows]);
    let mut batch = backend.new_batch().unwrap();
    backend
        .prepare_batch(&mut batch, &layout(&positions, &slots, spans), cache)
        .unwrap();
    let q = HostTensor {
        data: q.to_vec(),
        rows,
        cols: N_HEADS * D,
    };
    let mut out = HostTensor {
        data: vec![f32::NAN; q.data.len()],
        rows,
        cols: N_HEADS * D,
    };
    backend
        .attention(&q, cache, 0, N_HEADS, &batch, 0.25, &mut out)
        .unwrap();
    out.data
}

#[test]
fn shared_prefixes_run_as_cascade_and_match_the_plain_path() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut ids: Vec<u32> = (0..200).collect();
    ids.shuffle(&mut rng);
    let cache = cache(&mut rng, 200);
    // Three sequences over the same 40 blocks (160 keys, above the threshold), one decoding and
    // two prefilling a few rows after it, plus a sequence of its own.
    let prefix = &ids[..40];
    let tables: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let own = &ids[40 + 10 * i..50 + 10 * i];
            if i < 3 {
                [prefix, own].concat()
            } else {
                own.to_vec()
            }
        })
        .collect();
    let seqs = [(1usize, 161usize), (3, 170), (5, 190), (2, 30)];
    let mut row = 0;
    let spans: Vec<QuerySpan> = seqs
        .iter()
        .zip(&tables)
        .map(|(&(n_q, kv_len), table)| {
            let s = QuerySpan {
                q_start: row,
                n_q,
                kv_len,
                block_table: table,
            };
            row += n_q;
            s
        })
        .collect();
    let groups = cascade_groups(&spans, BLOCK, CASCADE_MIN_SHARED_KEYS);
    assert_eq!(groups.len(), 1, "{groups:?}");
    assert_eq!(groups[0].members, vec![0, 1, 2]);
    assert_eq!(groups[0].shared_len, 160);

    let q: Vec<f32> = (0..row * N_HEADS * D)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let backend = CpuBackend::with_threads(2).unwrap();
    let got = attend(&backend, &cache, &q, &spans);
    let mut want = vec![f32::NAN; q.len()];
    paged_attention(&q, N_HEADS, &cache.layer(0), &spans, 0.25, &mut want, None);
    // Same inputs, f32 both ways, sums in another order: |o| <= 1 and scores are at most
    // 0.25 · 16 = 4, so rounding stays near 1e-6 (see turbo-attention's cascade tests).
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 5e-6, "element {i}: {g} vs {w}");
    }
}

#[test]
fn a_malformed_batch_is_an_error() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let cache = cache(&mut rng, 4);
    let backend = CpuBackend::with_threads(1).unwrap();
    let table = [0u32, 9];
    let spans = [QuerySpan {
        q_start: 0,
        n_q: 1,
        kv_len: 8,
        block_table: &table,
    }];
    let (positions, slots) = ([7u32], [0u32]);
    let mut batch = backend.new_batch().unwrap();
    backend
        .prepare_batch(&mut batch, &layout(&positions, &slots, &spans), &cache)
        .unwrap();
    let q = backend
        .upload(&vec![0.5; N_HEADS * D], 1, N_HEADS * D)
        .unwrap();
    let mut out = backend.tensor(1, N_HEADS * D).unwrap();
    let err = backend
        .attention(&q, &cache, 0, N_HEADS, &batch, 0.25, &mut out)
        .unwrap_err();
    assert!(err.to_string().contains("block 9 is past"), "{err}");
}
