//! CPU paged attention: decode (one query) and prefill (a causal block of queries), SmolLM2 heads.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use turbo_attention::{paged_attention, PagedKv, QuerySpan};

fn bench(c: &mut Criterion) {
    let (block_size, n_kv_heads, n_heads, d) = (16usize, 3usize, 9usize, 64usize);
    let mut group = c.benchmark_group("cpu_paged_attention");
    for (n_q, kv_len) in [(1usize, 512usize), (1, 4096), (128, 512)] {
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
        // Bytes of KV read, once per query (no reuse across queries on this path).
        group.throughput(Throughput::Bytes(
            (n_q * kv_len * n_kv_heads * d * 8) as u64,
        ));
        group.bench_function(format!("q{n_q}_kv{kv_len}"), |b| {
            b.iter(|| paged_attention(&q, n_heads, &kv, &spans, 0.125, &mut out, None))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
