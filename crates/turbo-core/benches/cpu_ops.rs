//! CPU backend layers at SmolLM2-135M shapes: matrix products per weight type (decode: 1 token;
//! prefill: 512 tokens), RMSNorm and RoPE.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use turbo_core::cpu::{linear::linear, ops};
use turbo_core::quant::quantize_row;
use turbo_core::{Bytes, DType, WeightMatrix};

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

fn matrix(dtype: DType, rows: usize, cols: usize) -> WeightMatrix {
    let values = random(rows * cols, 1);
    // Types only read from files (Q5_0: most of a Q4_K_M SmolLM2) as random blocks.
    let bytes: Vec<u8> = match DType::WRITABLE.contains(&dtype) {
        true => values
            .chunks(cols)
            .flat_map(|r| quantize_row(dtype, r))
            .collect(),
        false => {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
            turbo_core::quant::random_blocks(dtype, rows * cols / dtype.block_len(), || {
                rng.random()
            })
        }
    };
    WeightMatrix::new(dtype, rows, cols, Bytes::owned(bytes)).unwrap()
}

fn bench_linear(c: &mut Criterion) {
    let mut group = c.benchmark_group("linear");
    // ffn_up of SmolLM2 (1536 x 576) and its LM head (49152 x 576).
    for (rows, cols) in [(1536usize, 576usize), (49152, 576)] {
        for dtype in [
            DType::Q4_1,
            DType::Q5_0,
            DType::Q8_0,
            DType::BF16,
            DType::F32,
        ] {
            let w = matrix(dtype, rows, cols);
            for n in [1usize, 512] {
                if rows > 2048 && n > 1 {
                    continue;
                }
                let x = random(n * cols, 2);
                let mut out = vec![0f32; n * rows];
                // Decode is bound by weight bytes; prefill by multiply-adds.
                if n == 1 {
                    group.throughput(Throughput::Bytes(w.data.len() as u64));
                } else {
                    group.throughput(Throughput::Elements((2 * n * rows * cols) as u64));
                }
                let id = BenchmarkId::new(format!("{dtype}_{rows}x{cols}"), format!("n{n}"));
                group.bench_function(id, |b| b.iter(|| linear(&x, n, &w, &mut out)));
            }
        }
    }
    group.finish();
}

/// Decode products with activations rounded to 8 bits (`--cpu-activations q8`), per weight type at
/// the shapes of a SmolLM2 Q4_K_M file: Q5_0 up/gate/QKV rows (1536 x 576), K-quant down rows
/// (576 x 1536), the Q8_0 LM head (49152 x 576). Bound by weight bytes.
fn bench_linear_q8(c: &mut Criterion) {
    use turbo_core::cpu::{linear::linear_with, CpuActivations};
    let mut group = c.benchmark_group("linear_q8");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    for (dtype, rows, cols) in [
        (DType::Q4_1, 1536usize, 576usize),
        (DType::Q5_0, 1536, 576),
        (DType::Q8_0, 1536, 576),
        (DType::Q4_K, 576, 1536),
        (DType::Q6_K, 576, 1536),
        (DType::Q8_0, 49152, 576),
    ] {
        let w = match DType::WRITABLE.contains(&dtype) {
            true => matrix(dtype, rows, cols),
            false => {
                let blocks = rows * cols / dtype.block_len();
                let bytes = turbo_core::quant::random_blocks(dtype, blocks, || rng.random());
                WeightMatrix::new(dtype, rows, cols, Bytes::owned(bytes)).unwrap()
            }
        };
        let x = random(cols, 2);
        let mut out = vec![0f32; rows];
        group.throughput(Throughput::Bytes(w.data.len() as u64));
        group.bench_function(format!("{dtype}_{rows}x{cols}_n1"), |b| {
            b.iter(|| linear_with(&x, 1, &w, &mut out, CpuActivations::Q8))
        });
    }
    group.finish();
}

fn bench_rows(c: &mut Criterion) {
    let mut group = c.benchmark_group("row_ops");
    let (d, n) = (576usize, 512usize);
    let x = random(n * d, 3);
    let w = random(d, 4);
    let mut out = vec![0f32; n * d];
    group.throughput(Throughput::Elements((n * d) as u64));
    group.bench_function("rms_norm_512x576", |b| {
        b.iter(|| ops::rms_norm(&x, &w, 1e-5, &mut out))
    });
    let inv_freq: Vec<f32> = (0..32)
        .map(|i| 1.0 / 100000f32.powf(i as f32 / 32.0))
        .collect();
    let positions: Vec<u32> = (0..n as u32).collect();
    group.bench_function("rope_512x9x64", |b| {
        b.iter(|| ops::rope_interleaved(&mut out, 64, &positions, &inv_freq))
    });
    group.finish();
}

criterion_group!(benches, bench_linear, bench_linear_q8, bench_rows);
criterion_main!(benches);
