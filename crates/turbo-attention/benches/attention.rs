//! CPU paged attention: decode (one query) and prefill (a causal block of queries), SmolLM2 heads;
//! and decode of a batch whose sequences share a prompt prefix, plain against cascade.
//!
//! `q170_kv2370` is round 10 of the multi-round chat bench (docs/perf/cpu.md): 170 new tokens over
//! a 2,200-token history.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use turbo_attention::cascade::{cascade_groups, paged_attention_cascade};
use turbo_attention::{paged_attention, PagedKv, QuerySpan};

fn bench(c: &mut Criterion) {
    let (block_size, n_kv_heads, n_heads, d) = (16usize, 3usize, 9usize, 64usize);
    let mut group = c.benchmark_group("cpu_paged_attention");
    let cases = [
        (1usize, 512usize),
        (1, 4096),
        (2, 2048),
        (4, 2048),
        (128, 512),
        (170, 2370),
    ];
    for (n_q, kv_len) in cases {
        let n_blocks = kv_len.div_ceil(block_size);
        let len = n_blocks * block_size * n_kv_heads * d;
        let keys: Vec<f32> = (0..len)
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0) - 0.5)
            .collect();
        let values: Vec<f32> = (0..len)
            .map(|i| ((i * 104729 % 1000) as f32 / 1000.0) - 0.5)
            .collect();
        let table: Vec<u32> = (0..n_blocks as u32).rev().collect();
        let kv = PagedKv {
            keys: &keys,
            values: &values,
            block_size,
            n_kv_heads,
            head_dim: d,
            quant: None,
        };
        let q: Vec<f32> = (0..n_q * n_heads * d)
            .map(|i| (i % 13) as f32 / 13.0 - 0.5)
            .collect();
        let mut out = vec![0f32; q.len()];
        let spans = [QuerySpan {
            q_start: 0,
            n_q,
            kv_len,
            block_table: &table,
        }];
        // Scores computed (query rows x heads x the keys each row sees); each costs 4 * d flops
        // (q . k and the weighted sum of v).
        let scores: usize = (kv_len - n_q..kv_len).map(|p| (p + 1) * n_heads).sum();
        group.throughput(Throughput::Elements(scores as u64));
        group.bench_function(format!("q{n_q}_kv{kv_len}"), |b| {
            b.iter(|| paged_attention(&q, n_heads, &kv, &spans, 0.125, &mut out, None))
        });
    }
    group.finish();
}

/// Decode steps of 16 sequences that share `shared` prompt keys (the same blocks) and then hold
/// 32 keys of their own: the plain path reads the prefix once per sequence (and query head), the
/// cascade path once per KV head.
fn bench_shared_prefix(c: &mut Criterion) {
    let (block_size, n_kv_heads, n_heads, d) = (16usize, 3usize, 9usize, 64usize);
    let (batch, own) = (16usize, 32usize);
    let mut group = c.benchmark_group("cpu_shared_prefix_decode");
    for shared in [16usize, 32, 64, 128, 512, 2048] {
        let prefix_blocks = shared / block_size;
        let own_blocks = own.div_ceil(block_size);
        let n_blocks = prefix_blocks + batch * own_blocks;
        let len = n_blocks * block_size * n_kv_heads * d;
        let keys: Vec<f32> = (0..len)
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0) - 0.5)
            .collect();
        let values: Vec<f32> = (0..len)
            .map(|i| ((i * 104729 % 1000) as f32 / 1000.0) - 0.5)
            .collect();
        let kv = PagedKv {
            keys: &keys,
            values: &values,
            block_size,
            n_kv_heads,
            head_dim: d,
            quant: None,
        };
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|b| {
                let own_ids = (0..own_blocks).map(|i| (prefix_blocks + b * own_blocks + i) as u32);
                (0..prefix_blocks as u32).chain(own_ids).collect()
            })
            .collect();
        let spans: Vec<QuerySpan> = tables
            .iter()
            .enumerate()
            .map(|(b, t)| QuerySpan {
                q_start: b,
                n_q: 1,
                kv_len: shared + own,
                block_table: t,
            })
            .collect();
        let groups = cascade_groups(&spans, block_size, 1);
        assert_eq!(groups.len(), 1);
        let q: Vec<f32> = (0..batch * n_heads * d)
            .map(|i| (i % 13) as f32 / 13.0 - 0.5)
            .collect();
        let mut out = vec![0f32; q.len()];
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_function(format!("plain_b{batch}_shared{shared}"), |b| {
            b.iter(|| paged_attention(&q, n_heads, &kv, &spans, 0.125, &mut out, None))
        });
        group.bench_function(format!("cascade_b{batch}_shared{shared}"), |b| {
            b.iter(|| {
                paged_attention_cascade(&q, n_heads, &kv, &spans, &groups, 0.125, &mut out, None)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench, bench_shared_prefix);
criterion_main!(benches);
