//! An INT8 KV cache holds keys in the Hadamard basis: the attention step's RoPE-and-write
//! (`Backend::qkv_rope_write`) rotates keys and queries alike, so attention over the cache is
//! attention over the unquantized keys up to INT8 rounding, and that rounding is smaller than
//! with keys stored as they are when a key channel dominates its row (as RoPE'd LLaMA keys do).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use turbo_attention::kv_quant::{hadamard_rotate, rotated_query_scale};
use turbo_attention::QuerySpan;
use turbo_core::backend::BatchLayout;
use turbo_core::cpu::{CpuBackend, CpuBatch, CpuKvCache, HostTensor, KvCacheSpec};
use turbo_core::{Backend, KvDtype};

const KV_HEADS: usize = 2;
const HEADS: usize = 4;
const BLOCK: usize = 16;
const TOKENS: usize = 40;
const BLOCKS: usize = TOKENS.div_ceil(BLOCK);

fn tensor(data: Vec<f32>, cols: usize) -> HostTensor {
    HostTensor {
        rows: data.len() / cols,
        data,
        cols,
    }
}

fn cache(dtype: KvDtype, head_dim: usize) -> CpuKvCache {
    CpuKvCache::new(KvCacheSpec {
        n_layers: 1,
        n_kv_heads: KV_HEADS,
        head_dim,
        block_size: BLOCK,
        max_blocks: BLOCKS,
        dtype,
    })
}

/// A prepared batch of one sequence of `TOKENS` tokens at positions (and slots) 0..TOKENS.
fn batch(backend: &CpuBackend, cache: &CpuKvCache, head_dim: usize) -> CpuBatch {
    let positions: Vec<u32> = (0..TOKENS as u32).collect();
    let table: Vec<u32> = (0..BLOCKS as u32).collect();
    let spans = [QuerySpan {
        q_start: 0,
        n_q: TOKENS,
        kv_len: TOKENS,
        block_table: &table,
    }];
    let inv_freq: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / head_dim as f32))
        .collect();
    let ids = vec![0u32; TOKENS];
    let layout = BatchLayout {
        ids: &ids,
        positions: &positions,
        slots: &positions,
        spans: &spans,
        inv_freq: &inv_freq,
        outputs: &[],
        n_heads: HEADS,
        vocab: 0,
        sampling: None,
        scoring: &[],
    };
    let mut batch = backend.new_batch().unwrap();
    backend.prepare_batch(&mut batch, &layout, cache).unwrap();
    batch
}

/// What the attention step leaves: the queries, the RoPE'd keys and the values as the backend
/// handed them to `write_kv`, and the attention output.
struct Step {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    out: Vec<f32>,
}

/// `qkv_rope_write` then `attention` on `cache`.
fn step(cache: &mut CpuKvCache, head_dim: usize, qkv: &[f32]) -> Step {
    let backend = CpuBackend::new();
    let batch = batch(&backend, cache, head_dim);
    let (q_cols, kv_cols) = (HEADS * head_dim, KV_HEADS * head_dim);
    let qkv = tensor(qkv.to_vec(), q_cols + 2 * kv_cols);
    let mut q = tensor(vec![0.0; TOKENS * q_cols], q_cols);
    let mut k = tensor(vec![0.0; TOKENS * kv_cols], kv_cols);
    let mut v = tensor(vec![0.0; TOKENS * kv_cols], kv_cols);
    backend
        .qkv_rope_write(&qkv, &mut q, &mut k, &mut v, head_dim, cache, 0, &batch)
        .unwrap();
    let out = attend(&backend, cache, head_dim, &q.data);
    Step {
        q: q.data,
        k: k.data,
        v: v.data,
        out,
    }
}

fn attend(backend: &CpuBackend, cache: &CpuKvCache, head_dim: usize, q: &[f32]) -> Vec<f32> {
    let batch = batch(backend, cache, head_dim);
    let q = tensor(q.to_vec(), HEADS * head_dim);
    let mut out = tensor(vec![f32::NAN; q.data.len()], q.cols);
    let scale = 1.0 / (head_dim as f32).sqrt();
    backend
        .attention(&q, cache, 0, HEADS, &batch, scale, &mut out)
        .unwrap();
    out.data
}

/// Random `[q | k | v]` rows in [-1, 1]; with `outlier`, key channel 5 of every KV head is 12
/// times larger.
fn qkv_rows(rng: &mut ChaCha8Rng, head_dim: usize, outlier: bool) -> Vec<f32> {
    let width = (HEADS + 2 * KV_HEADS) * head_dim;
    let mut rows: Vec<f32> = (0..TOKENS * width)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    if outlier {
        for row in rows.chunks_mut(width) {
            for h in 0..KV_HEADS {
                row[HEADS * head_dim + h * head_dim + 5] *= 12.0;
            }
        }
    }
    rows
}

fn squared_error(got: &[f32], want: &[f32]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum()
}

#[test]
fn int8_queries_leave_the_step_rotated_and_attention_keeps_its_meaning() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for head_dim in [32usize, 64, 128] {
        let qkv = qkv_rows(&mut rng, head_dim, false);
        let full = step(&mut cache(KvDtype::Full, head_dim), head_dim, &qkv);
        let int8 = step(&mut cache(KvDtype::Int8, head_dim), head_dim, &qkv);
        // The full cache's queries are RoPE'd only; INT8's are those, rotated and scaled.
        let mut want = full.q.clone();
        for head in want.chunks_mut(head_dim) {
            hadamard_rotate(head);
            head.iter_mut()
                .for_each(|x| *x *= rotated_query_scale(head_dim));
        }
        assert_eq!(int8.q, want, "head_dim {head_dim}: rotated queries");
        // Values in [-1, 1]: INT8 keys and values move outputs by far less than 0.02.
        let error = int8
            .out
            .iter()
            .zip(&full.out)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(
            error < 2e-2,
            "head_dim {head_dim}: INT8 output off by {error}"
        );
    }
    // A head dimension that is not a power of two is stored as it is.
    let qkv = qkv_rows(&mut rng, 48, false);
    let full = step(&mut cache(KvDtype::Full, 48), 48, &qkv);
    let int8 = step(&mut cache(KvDtype::Int8, 48), 48, &qkv);
    assert_eq!(int8.q, full.q, "head_dim 48 is not rotated");
}

#[test]
fn rotated_int8_keys_lose_less_when_a_channel_dominates() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let head_dim = 64;
    let qkv = qkv_rows(&mut rng, head_dim, true);
    let full = step(&mut cache(KvDtype::Full, head_dim), head_dim, &qkv);
    let rotated = step(&mut cache(KvDtype::Int8, head_dim), head_dim, &qkv);
    // The same rows in an INT8 cache written as they are (`write_kv` stores what it is given),
    // read by the unrotated queries.
    let mut plain = cache(KvDtype::Int8, head_dim);
    let slots: Vec<u32> = (0..TOKENS as u32).collect();
    plain.write(0, &full.k, &full.v, &slots);
    let plain_out = attend(&CpuBackend::new(), &plain, head_dim, &full.q);
    let (rotated_error, plain_error) = (
        squared_error(&rotated.out, &full.out),
        squared_error(&plain_out, &full.out),
    );
    assert!(
        rotated_error < 0.5 * plain_error,
        "rotated {rotated_error:e} vs as they are {plain_error:e}"
    );
}
