//! GPU kernels at Llama-3-8B sizes, timed with CUDA events (criterion's `iter_custom`). Without a
//! GPU the bench prints a skip message and measures nothing.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use std::sync::Arc;
use std::time::Duration;
use turbo_attention::KvDtype;
use turbo_attention::QuerySpan;
use turbo_kernels::ops::{attention, elementwise, linear, norm};
use turbo_kernels::CudaDevice;

/// Bytes a bench reads between two reads of the same buffer when it must miss in L2 (the H100's
/// is 50 MB).
const L2_FLUSH_BYTES: usize = 160 << 20;

fn random_bf16(stream: &Arc<CudaStream>, n: usize, seed: u64) -> CudaSlice<bf16> {
    // A cheap deterministic pattern in [-1, 1): never zeros, different per buffer.
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let host: Vec<bf16> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf16::from_f32((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect();
    stream.clone_htod(&host).expect("upload")
}

/// A quantized cache of `blocks` blocks in `layout`'s device layout: random even codes (finite in
/// INT8 and FP8 alike: FP8's NaNs are odd) and every scale 1/128, as bf16 pairs.
fn random_quantized(
    stream: &Arc<CudaStream>,
    layout: attention::KvLayout,
    blocks: usize,
    seed: u64,
) -> CudaSlice<bf16> {
    let rows = layout.block_size * layout.n_kv_heads;
    let codes = rows * layout.head_dim;
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut bytes = vec![0u8; blocks * layout.block_bytes()];
    for block in bytes.chunks_mut(layout.block_bytes()) {
        for c in &mut block[..codes] {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *c = (x >> 56) as u8 & 0xFE;
        }
        for sc in block[codes..].chunks_mut(4) {
            sc.copy_from_slice(&(1.0f32 / 128.0).to_le_bytes());
        }
    }
    let host: Vec<bf16> = bytes
        .chunks(2)
        .map(|p| bf16::from_bits(u16::from_le_bytes([p[0], p[1]])))
        .collect();
    stream.clone_htod(&host).expect("upload")
}

/// Times `iters` runs of `f` between two CUDA events.
fn time_gpu(dev: &CudaDevice, iters: u64, mut f: impl FnMut()) -> Duration {
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = dev.ctx.new_event(flags).unwrap();
    let end = dev.ctx.new_event(flags).unwrap();
    start.record(&dev.stream).unwrap();
    for _ in 0..iters {
        f();
    }
    end.record(&dev.stream).unwrap();
    end.synchronize().unwrap();
    Duration::from_secs_f64(start.elapsed_ms(&end).unwrap() as f64 / 1e3)
}

fn bench(c: &mut Criterion) {
    if !turbo_kernels::cuda_available() {
        eprintln!("skipping GPU kernel benches: no CUDA device");
        return;
    }
    let dev = CudaDevice::new(0).expect("CUDA device");
    let s = dev.stream.clone();
    let mut g = c.benchmark_group("cuda");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));

    // Decode attention, GQA 32/8, d 128, bf16, blocks of 16, planned once and run (as the model
    // does once per layer): batch 64 at context 4096 with the grouped and the per-head row
    // kernels, then batch 1 and 4 at 8k to 128k keys (split-KV).
    let mut decode = |batch: usize,
                      ctx: usize,
                      row_kernel: attention::RowKernel,
                      split: attention::KvSplit,
                      graph: bool,
                      dtype: KvDtype| {
        let (heads, kv_heads, d, bs) = (32usize, 8usize, 128usize, 16usize);
        let blocks_per_seq = ctx / bs;
        let layout = attention::KvLayout {
            block_size: bs,
            n_kv_heads: kv_heads,
            head_dim: d,
            dtype,
        };
        // bf16 elements of each cache (a quantized one: its bytes, two to an element).
        let cache_len = batch * blocks_per_seq * layout.block_len();
        // A model reads each layer's KV once per step, long after the other layers' traffic has
        // evicted it from the 50 MB L2: runs cycle through enough caches to read at least
        // L2_FLUSH_BYTES between two reads of the same one, so that small caches are not served
        // from L2.
        let copies = L2_FLUSH_BYTES.div_ceil(2 * cache_len * 2).max(1);
        let cache = |seed| match dtype {
            KvDtype::Full => random_bf16(&s, cache_len, seed),
            _ => random_quantized(&s, layout, batch * blocks_per_seq, seed),
        };
        let caches: Vec<_> = (0..copies as u64)
            .map(|i| (cache(1 + 2 * i), cache(2 + 2 * i)))
            .collect();
        let q = random_bf16(&s, batch * heads * d, 3);
        let mut out = s.alloc_zeros::<bf16>(batch * heads * d).unwrap();
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|b| {
                (0..blocks_per_seq as u32)
                    .map(|i| (b * blocks_per_seq) as u32 + i)
                    .collect()
            })
            .collect();
        let spans: Vec<QuerySpan> = tables
            .iter()
            .enumerate()
            .map(|(b, t)| QuerySpan {
                q_start: b,
                n_q: 1,
                kv_len: ctx,
                block_table: t,
            })
            .collect();
        let options = attention::PlanOptions {
            row_kernel,
            split,
            ..Default::default()
        };
        let mut plan = attention::AttentionPlan::new(
            &dev,
            layout,
            heads,
            batch,
            &spans,
            batch * blocks_per_seq,
            options,
        )
        .unwrap();
        // Bytes of K and V read.
        g.throughput(Throughput::Bytes((2 * cache_len * 2) as u64));
        let kernel = match row_kernel {
            attention::RowKernel::Auto => "",
            attention::RowKernel::PerHead => "_per_head",
        };
        let split = match split {
            attention::KvSplit::Chunk(c) => format!("_chunk{c}"),
            _ => String::new(),
        };
        let cache_dtype = match dtype {
            KvDtype::Full => "",
            KvDtype::Int8 => "_int8",
            KvDtype::Fp8 => "_fp8",
        };
        let name =
            format!("decode_attention_b{batch}_ctx{ctx}_gqa32x8_d128{kernel}{split}{cache_dtype}");
        if !graph {
            g.bench_function(name, |b| {
                b.iter_custom(|iters| {
                    let mut next = caches.iter().cycle();
                    time_gpu(&dev, iters, || {
                        let (k, v) = next.next().unwrap();
                        plan.run(&dev, &q, k, v, 0.088, &mut out, None, 0).unwrap()
                    })
                })
            });
            return;
        }
        // As a decode step runs it: one replayed CUDA graph with the attention of every layer,
        // each over its own cache, so that launches cost what they cost in a recorded step and no
        // host work sits between them.
        const LAYERS: u32 = 32;
        let (k, v) = &caches[0];
        plan.run(&dev, &q, k, v, 0.088, &mut out, None, 0).unwrap(); // module load, smem opt-in
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        for (k, v) in caches.iter().cycle().take(LAYERS as usize) {
            plan.run(&dev, &q, k, v, 0.088, &mut out, None, 0).unwrap();
        }
        let step = s
            .end_capture(CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("captured work");
        g.bench_function(format!("{name}_graph"), |b| {
            b.iter_custom(|iters| time_gpu(&dev, iters, || step.launch().unwrap()) / LAYERS)
        });
    };
    let (grouped, per_head, auto) = (
        attention::RowKernel::Auto,
        attention::RowKernel::PerHead,
        attention::KvSplit::Auto,
    );
    decode(64, 4096, grouped, auto, false, KvDtype::Full);
    decode(64, 4096, per_head, auto, false, KvDtype::Full);
    // Short contexts, as in batched chat decode.
    for ctx in [256usize, 1024] {
        decode(64, ctx, grouped, auto, false, KvDtype::Full);
        decode(64, ctx, per_head, auto, false, KvDtype::Full);
    }
    // INT8 and FP8 caches: batch 64 at 4k keys, and batch 1 at 16k and 32k (split, replayed).
    for dtype in [KvDtype::Int8, KvDtype::Fp8] {
        decode(64, 4096, grouped, auto, false, dtype);
        decode(64, 4096, per_head, auto, false, dtype);
        for ctx in [16384usize, 32768] {
            decode(1, ctx, grouped, auto, true, dtype);
        }
    }
    // Split-KV: launched one by one, and replayed from a graph as the model runs them.
    for graph in [false, true] {
        for batch in [1usize, 4] {
            for ctx in [8192usize, 16384, 32768, 65536, 131072] {
                decode(batch, ctx, grouped, auto, graph, KvDtype::Full);
            }
        }
        // The per-head kernel (head dimensions without a grouped one) splits and merges the same
        // way, reading each K and V row once per query head.
        for ctx in [8192usize, 32768] {
            decode(1, ctx, per_head, auto, graph, KvDtype::Full);
        }
    }
    // The split planner's choice against longer ranges (fewer CTAs and states), and the fixed
    // cost of a split step (1024 keys in 16 ranges).
    for (batch, ctx, chunk) in [
        (1, 1024, 64),
        (1, 2048, 256),
        (1, 2048, 512),
        (1, 4096, 256),
        (1, 4096, 512),
        (1, 8192, 256),
        (1, 8192, 512),
        (2, 4096, 256),
        (2, 4096, 512),
        (2, 8192, 512),
        (2, 8192, 1024),
        (1, 16384, 1024),
        (1, 32768, 2048),
        (4, 8192, 2048),
        (4, 16384, 4096),
    ] {
        decode(
            batch,
            ctx,
            grouped,
            attention::KvSplit::Chunk(chunk),
            true,
            KvDtype::Full,
        );
    }

    // Prefill attention: one causal sequence of 2048 or 8192 tokens, 32 heads, d 128; with an
    // INT8 and an FP8 cache too (names ending in _int8 / _fp8).
    for (n, dtype) in [2048usize, 8192]
        .into_iter()
        .flat_map(|n| [KvDtype::Full, KvDtype::Int8, KvDtype::Fp8].map(|d| (n, d)))
    {
        let (heads, d, bs) = (32usize, 128usize, 16usize);
        let table: Vec<u32> = (0..(n / bs) as u32).collect();
        let layout = attention::KvLayout {
            block_size: bs,
            n_kv_heads: heads,
            head_dim: d,
            dtype,
        };
        let cache = |seed| match dtype {
            KvDtype::Full => random_bf16(&s, n * heads * d, seed),
            _ => random_quantized(&s, layout, n / bs, seed),
        };
        let (k, v) = (cache(4), cache(5));
        let q = random_bf16(&s, n * heads * d, 6);
        let mut out = s.alloc_zeros::<bf16>(n * heads * d).unwrap();
        let spans = [QuerySpan {
            q_start: 0,
            n_q: n,
            kv_len: n,
            block_table: &table,
        }];
        let suffix = match dtype {
            KvDtype::Full => "",
            KvDtype::Int8 => "_int8",
            KvDtype::Fp8 => "_fp8",
        };
        // Causal: half of full attention's 4·n²·d·heads FLOP ("elements" below are FLOP).
        g.throughput(Throughput::Elements((2 * n * n * d * heads) as u64));
        // The default kernel (warpgroup MMA on an sm_90 device), and the mma.sync one.
        for (name, prefill_kernel) in [
            ("prefill_attention", attention::PrefillKernel::Auto),
            (
                "prefill_attention_mma_sync",
                attention::PrefillKernel::MmaSync,
            ),
        ] {
            let options = attention::PlanOptions {
                prefill_kernel,
                ..Default::default()
            };
            let mut plan =
                attention::AttentionPlan::new(&dev, layout, heads, n, &spans, n / bs, options)
                    .unwrap();
            eprintln!("{name}: {:?}", plan.prefill_kernels().0);
            g.bench_function(format!("{name}_causal_s{n}_h32_d128{suffix}"), |b| {
                b.iter_custom(|iters| {
                    time_gpu(&dev, iters, || {
                        plan.run(&dev, &q, &k, &v, 0.088, &mut out, None, 0)
                            .unwrap()
                    })
                })
            });
        }
    }

    // cuBLASLt: the 8B FFN up-projection (14336 x 4096) at batch 1 (bandwidth) and 2048 tokens (FLOP).
    {
        let (m, k_dim) = (14336usize, 4096usize);
        let w = random_bf16(&s, m * k_dim, 7);
        for n in [1usize, 2048] {
            let x = random_bf16(&s, n * k_dim, 8);
            let mut out = s.alloc_zeros::<bf16>(n * m).unwrap();
            if n == 1 {
                g.throughput(Throughput::Bytes((m * k_dim * 2) as u64));
            } else {
                g.throughput(Throughput::Elements((2 * n * m * k_dim) as u64));
            }
            g.bench_function(format!("linear_14336x4096_n{n}"), |b| {
                b.iter_custom(|iters| {
                    time_gpu(&dev, iters, || {
                        linear::linear(&dev, &x, &w, n, k_dim, m, &mut out).unwrap()
                    })
                })
            });
        }
    }

    // Row ops over 2048 tokens.
    {
        let (rows, cols, ffn) = (2048usize, 4096usize, 14336usize);
        let x = random_bf16(&s, rows * cols, 9);
        let w = random_bf16(&s, cols, 10);
        let mut out = s.alloc_zeros::<bf16>(rows * cols).unwrap();
        g.throughput(Throughput::Bytes((2 * rows * cols * 2) as u64));
        g.bench_function("rms_norm_2048x4096", |b| {
            b.iter_custom(|iters| {
                time_gpu(&dev, iters, || {
                    norm::rms_norm(&dev, &x, &w, rows, cols, 1e-5, &mut out).unwrap()
                })
            })
        });
        let up = random_bf16(&s, rows * ffn, 11);
        let mut gate = random_bf16(&s, rows * ffn, 12);
        g.throughput(Throughput::Bytes((3 * rows * ffn * 2) as u64));
        g.bench_function("silu_mul_2048x14336", |b| {
            b.iter_custom(|iters| {
                time_gpu(&dev, iters, || {
                    elementwise::silu_mul(&dev, &mut gate, &up, rows * ffn).unwrap()
                })
            })
        });
        // The SwiGLU of a batched decode step's gate/up product (1024 rows of 2 x 14336).
        let swiglu_rows = 1024;
        let gate_up = random_bf16(&s, swiglu_rows * 2 * ffn, 13);
        let mut act = s.alloc_zeros::<bf16>(swiglu_rows * ffn).unwrap();
        g.throughput(Throughput::Bytes((3 * swiglu_rows * ffn * 2) as u64));
        g.bench_function("swiglu_1024x14336", |b| {
            b.iter_custom(|iters| {
                time_gpu(&dev, iters, || {
                    elementwise::swiglu(&dev, &gate_up, swiglu_rows, ffn, &mut act).unwrap()
                })
            })
        });
    }
    g.finish();
}

/// `n` f32 values in [-scale, scale) from a cheap deterministic pattern, never zero.
/// A kernel that does nothing but read: each CTA XORs its share of a buffer's 16-byte words
/// (eight loads in flight per thread) and writes one word. Compiled here with NVRTC: it is a
/// measuring instrument, not part of the engine.
const READ_PROBE: &str = r#"
extern "C" __global__ void __launch_bounds__(1024) read_xor(const uint4* src, unsigned long long n16,
                                                             unsigned int* partial) {
    unsigned int acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n16; i += 8 * stride) {
        unsigned int v[8][4];
#pragma unroll
        for (int u = 0; u < 8; u++)
            asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v[u][0]), "=r"(v[u][1]), "=r"(v[u][2]), "=r"(v[u][3])
                         : "l"(src + i + u * stride));
#pragma unroll
        for (int u = 0; u < 8; u++) acc ^= v[u][0] ^ v[u][1] ^ v[u][2] ^ v[u][3];
    }
    for (; i < n16; i += stride) {
        const uint4 w = src[i];
        acc ^= w.x ^ w.y ^ w.z ^ w.w;
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    __shared__ unsigned int warps[32];
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (unsigned w = 1; w < blockDim.x / 32; w++) acc ^= warps[w];
        partial[blockIdx.x] = acc;
    }
}
"#;

/// The read ceiling of one launch of a given size: [`READ_PROBE`] replayed 32 times from a graph
/// over buffers cycled as the decode benches cycle caches (cold in L2). Its result is checked
/// against the host's XOR of the same bytes once per size.
fn bench_read_probe(c: &mut Criterion) {
    if !turbo_kernels::cuda_available() {
        eprintln!("skipping the read probe: no CUDA device");
        return;
    }
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let dev = CudaDevice::new(0).expect("CUDA device");
    let s = dev.stream.clone();
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some("compute_80"),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(READ_PROBE, opts).expect("NVRTC");
    let f = dev
        .ctx
        .load_module(ptx)
        .and_then(|m| m.load_function("read_xor"))
        .expect("read probe");
    let mut g = c.benchmark_group("cuda");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_secs(1));
    let ctas = 2 * dev.sm_count();
    let cfg = LaunchConfig {
        grid_dim: (ctas as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut partial = s.alloc_zeros::<u32>(ctas).unwrap();
    // The decode benches' K and V bytes at batch 1, 8k to 128k keys (and 8 MiB, 16 MiB below).
    for mib in [8usize, 16, 32, 64, 128, 256, 512, 1024] {
        let bytes = mib << 20;
        let copies = L2_FLUSH_BYTES.div_ceil(bytes).max(1);
        let bufs: Vec<CudaSlice<bf16>> = (0..copies as u64)
            .map(|i| random_bf16(&s, bytes / 2, 11 + i))
            .collect();
        let n16 = (bytes / 16) as u64;
        let run = |buf: &CudaSlice<bf16>, partial: &mut CudaSlice<u32>| {
            let mut b = s.launch_builder(&f);
            b.arg(buf).arg(&n16).arg(partial);
            // SAFETY: read_xor reads n16 16-byte words of `buf` (its whole length) and writes
            // one word per CTA of `partial`, which has one per CTA.
            unsafe { b.launch(cfg).unwrap() };
        };
        run(&bufs[0], &mut partial);
        let host_words: Vec<bf16> = s.clone_dtoh(&bufs[0]).unwrap();
        let want = host_words.chunks_exact(2).fold(0u32, |a, w| {
            a ^ (w[0].to_bits() as u32 | (w[1].to_bits() as u32) << 16)
        });
        let got = s
            .clone_dtoh(&partial)
            .unwrap()
            .iter()
            .fold(0u32, |a, p| a ^ p);
        assert_eq!(got, want, "read probe XOR of {mib} MiB");
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        for buf in bufs.iter().cycle().take(32) {
            run(buf, &mut partial);
        }
        let step = s
            .end_capture(CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("captured work");
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(format!("read_probe_{mib}MiB_graph"), |b| {
            b.iter_custom(|iters| time_gpu(&dev, iters, || step.launch().unwrap()) / 32)
        });
    }
}

fn random_f32(stream: &Arc<CudaStream>, n: usize, seed: u64, scale: f32) -> CudaSlice<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let host: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0 + 1e-7) * scale
        })
        .collect();
    stream.clone_htod(&host).expect("upload")
}

/// Attention-state merges at Llama-3-8B head shapes (32 heads of 128), f32 states: 64 KV-chunk
/// states of 64 rows into one (a long-context split-KV decode step), written as f32 and as bf16,
/// and two states of 128 rows merged in place (cascade: shared prefix and own suffix).
/// Throughput is the bytes read and written.
fn bench_merge(c: &mut Criterion) {
    use turbo_kernels::ops::merge::{self, StateShape};
    if !turbo_kernels::cuda_available() {
        eprintln!("skipping GPU merge benches: no CUDA device");
        return;
    }
    let dev = CudaDevice::new(0).expect("CUDA device");
    let s = dev.stream.clone();
    let mut g = c.benchmark_group("cuda_merge");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));

    {
        let (chunks, rows, heads, d) = (64usize, 64usize, 32usize, 128usize);
        let shape = StateShape {
            rows,
            heads,
            head_dim: d,
        };
        let pairs = shape.pairs();
        let o = random_f32(&s, chunks * pairs * d, 21, 1.0);
        let lse = random_f32(&s, chunks * pairs, 22, 10.0);
        let mut out_lse = s.alloc_zeros::<f32>(pairs).unwrap();
        let read = chunks * pairs * (d + 1) * 4;
        let mut out = s.alloc_zeros::<f32>(pairs * d).unwrap();
        g.throughput(Throughput::Bytes((read + pairs * (d + 1) * 4) as u64));
        g.bench_function("merge_states_64x64x32x128_f32", |b| {
            b.iter_custom(|iters| {
                time_gpu(&dev, iters, || {
                    merge::merge_states(&dev, shape, chunks, &o, &lse, &mut out, Some(&mut out_lse))
                        .unwrap()
                })
            })
        });
        let mut out = s.alloc_zeros::<bf16>(pairs * d).unwrap();
        g.throughput(Throughput::Bytes((read + pairs * (2 * d + 4)) as u64));
        g.bench_function("merge_states_64x64x32x128_bf16", |b| {
            b.iter_custom(|iters| {
                time_gpu(&dev, iters, || {
                    merge::merge_states(&dev, shape, chunks, &o, &lse, &mut out, Some(&mut out_lse))
                        .unwrap()
                })
            })
        });
    }

    {
        let (rows, heads, d) = (128usize, 32usize, 128usize);
        let shape = StateShape {
            rows,
            heads,
            head_dim: d,
        };
        let pairs = shape.pairs();
        let mut o_a = random_f32(&s, pairs * d, 23, 1.0);
        let mut lse_a = random_f32(&s, pairs, 24, 10.0);
        let o_b = random_f32(&s, pairs * d, 25, 1.0);
        let lse_b = random_f32(&s, pairs, 26, 10.0);
        // Reads a and b, writes a.
        g.throughput(Throughput::Bytes((3 * pairs * (d + 1) * 4) as u64));
        g.bench_function("merge_state_in_place_128x32x128", |b| {
            b.iter_custom(|iters| {
                time_gpu(&dev, iters, || {
                    merge::merge_state_in_place(&dev, shape, &mut o_a, &mut lse_a, &o_b, &lse_b)
                        .unwrap()
                })
            })
        });
    }
    g.finish();
}

/// Cascade (shared-prefix) decode attention against plain paged decode over the same KV: B
/// sequences whose first `prefix` keys are the same blocks (as the KV manager shares a common
/// prompt) plus 256 keys of their own each, GQA 32/8, d 128, blocks of 16, planned once.
fn bench_cascade(c: &mut Criterion) {
    if !turbo_kernels::cuda_available() {
        eprintln!("skipping cascade benches: no CUDA device");
        return;
    }
    let dev = CudaDevice::new(0).expect("CUDA device");
    let s = dev.stream.clone();
    let mut g = c.benchmark_group("cuda_cascade");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    let (heads, kv_heads, d, bs, suffix) = (32usize, 8usize, 128usize, 16usize, 256usize);
    for prefix in [8192usize, 32768] {
        for batch in [64usize, 128] {
            let prefix_blocks = prefix / bs;
            let own_blocks = suffix / bs;
            let n_blocks = prefix_blocks + batch * own_blocks;
            let cache_len = n_blocks * bs * kv_heads * d;
            let k = random_bf16(&s, cache_len, 21);
            let v = random_bf16(&s, cache_len, 22);
            let q = random_bf16(&s, batch * heads * d, 23);
            let mut out = s.alloc_zeros::<bf16>(batch * heads * d).unwrap();
            let tables: Vec<Vec<u32>> = (0..batch)
                .map(|b| {
                    (0..prefix_blocks as u32)
                        .chain((0..own_blocks).map(|i| (prefix_blocks + b * own_blocks + i) as u32))
                        .collect()
                })
                .collect();
            let spans: Vec<QuerySpan> = tables
                .iter()
                .enumerate()
                .map(|(b, t)| QuerySpan {
                    q_start: b,
                    n_q: 1,
                    kv_len: prefix + suffix,
                    block_table: t,
                })
                .collect();
            let layout = attention::KvLayout {
                block_size: bs,
                n_kv_heads: kv_heads,
                head_dim: d,
                dtype: KvDtype::Full,
            };
            // Keys attended, over all sequences (what plain attention reads).
            g.throughput(Throughput::Elements((batch * (prefix + suffix)) as u64));
            for (name, cascade_min_shared, prefill_kernel) in [
                (
                    "cascade",
                    Some(attention::CASCADE_MIN_SHARED),
                    attention::PrefillKernel::Auto,
                ),
                (
                    "cascade_mma_sync",
                    Some(attention::CASCADE_MIN_SHARED),
                    attention::PrefillKernel::MmaSync,
                ),
                ("plain", None, attention::PrefillKernel::Auto),
            ] {
                let options = attention::PlanOptions {
                    cascade_min_shared,
                    prefill_kernel,
                    ..Default::default()
                };
                let mut plan = attention::AttentionPlan::new(
                    &dev, layout, heads, batch, &spans, n_blocks, options,
                )
                .unwrap();
                assert_eq!(plan.cascade_rows() > 0, cascade_min_shared.is_some());
                g.bench_function(format!("{name}_prefix{prefix}_b{batch}"), |b| {
                    b.iter_custom(|iters| {
                        time_gpu(&dev, iters, || {
                            plan.run(&dev, &q, &k, &v, 0.088, &mut out, None, 0)
                                .unwrap()
                        })
                    })
                });
            }
        }
    }
    g.finish();
}

/// The sampler at batch 1, 64 and 128 over 49152 (SmolLM2) and 128256 (Llama 3) logits: greedy,
/// top-k 50 + top-p 0.9 at temperature 0.8 (the gathered top-k path), and top-p 0.95 alone (the
/// radix-select path), penalty off so every run sees the same logits. Throughput is the logits'
/// bytes, read once.
fn bench_sampling(c: &mut Criterion) {
    use turbo_core::sampling::SampleParams;
    use turbo_kernels::ops::sampling;
    if !turbo_kernels::cuda_available() {
        eprintln!("skipping sampling benches: no CUDA device");
        return;
    }
    let dev = CudaDevice::new(0).expect("CUDA device");
    let s = dev.stream.clone();
    let mut g = c.benchmark_group("cuda_sampling");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    let configs = [
        ("greedy", SampleParams::GREEDY),
        (
            "topk50_topp0.9_t0.8",
            SampleParams {
                temperature: 0.8,
                top_k: 50,
                top_p: 0.9,
                uniform: 0.37,
                ..SampleParams::GREEDY
            },
        ),
        (
            "topp0.95_t1",
            SampleParams {
                temperature: 1.0,
                top_p: 0.95,
                uniform: 0.37,
                ..SampleParams::GREEDY
            },
        ),
    ];
    for vocab in [49_152usize, 128_256] {
        for batch in [1usize, 64, 128] {
            let mut logits = random_f32(&s, batch * vocab, 31, 8.0);
            let offsets = s.alloc_zeros::<u32>(batch + 1).unwrap();
            let tokens = s.alloc_zeros::<u32>(1).unwrap();
            let mut out = s.alloc_zeros::<u32>(batch).unwrap();
            g.throughput(Throughput::Bytes((batch * vocab * 4) as u64));
            for (name, p) in configs {
                let params = s
                    .clone_htod(&sampling::param_words(&vec![p; batch]))
                    .unwrap();
                g.bench_function(format!("sample_{name}_b{batch}_v{vocab}"), |b| {
                    b.iter_custom(|iters| {
                        time_gpu(&dev, iters, || {
                            sampling::sample(
                                &dev,
                                &mut logits,
                                batch,
                                vocab,
                                &params.as_view(),
                                &offsets.as_view(),
                                &tokens.as_view(),
                                &tokens.as_view(),
                                &mut out.as_view_mut(),
                            )
                            .unwrap()
                        })
                    })
                });
            }
        }
    }
    g.finish();
}

/// Decode products (1-4 tokens) at Llama-3-8B's shapes, each with its fused op, by the stream
/// kernels of `ops::gemv` and by cuBLASLt (`ops::linear`, the product alone). Weights are cycled through copies
/// filling 4x the L2, so every launch reads them from memory as a decode step does.
fn bench_gemv(c: &mut Criterion) {
    use turbo_kernels::ops::gemv::{gemv, GemvNorm, GemvOut};
    if !turbo_kernels::cuda_available() {
        eprintln!("skipping GEMV benches: no CUDA device");
        return;
    }
    let dev = CudaDevice::new(0).expect("CUDA device");
    let s = dev.stream.clone();
    let mut g = c.benchmark_group("cuda_gemv");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(1))
        .warm_up_time(Duration::from_millis(300));
    // (name, rows, k, fused op)
    let shapes = [
        ("qkv_norm", 6144usize, 4096usize),
        ("o_residual", 4096, 4096),
        ("gate_up_norm_swiglu", 28672, 4096),
        ("down_residual", 4096, 14336),
        ("lm_head_f32", 49152, 4096),
        // A rank's share of the same products split over two GPUs (`--tp 2`).
        ("qkv_norm", 3072, 4096),
        ("o_residual", 4096, 2048),
        ("gate_up_norm_swiglu", 14336, 4096),
        ("down_residual", 4096, 7168),
        ("lm_head_f32", 24576, 4096),
    ];
    for (name, rows, k) in shapes {
        let copies = (200usize << 20).div_ceil(rows * k * 2).max(1);
        let ws: Vec<_> = (0..copies)
            .map(|i| random_bf16(&s, rows * k, 40 + i as u64))
            .collect();
        let norm_w = random_bf16(&s, k, 50);
        g.throughput(Throughput::Bytes((rows * k * 2) as u64));
        for tokens in [1usize, 2, 4] {
            let x = random_bf16(&s, tokens * k, 51);
            let mut out = random_bf16(&s, tokens * rows, 52);
            let mut out_f32 = s.alloc_zeros::<f32>(tokens * rows).unwrap();
            let mut next = 0;
            g.bench_function(format!("{name}_{rows}x{k}_t{tokens}"), |b| {
                b.iter_custom(|iters| {
                    time_gpu(&dev, iters, || {
                        let w = &ws[next % copies];
                        next += 1;
                        let norm = || GemvNorm {
                            weight: &norm_w,
                            eps: 1e-5,
                        };
                        let (norm, target) = match name {
                            "qkv_norm" => (Some(norm()), GemvOut::Bf16(&mut out)),
                            "gate_up_norm_swiglu" => (Some(norm()), GemvOut::SwiGlu(&mut out)),
                            "lm_head_f32" => (None, GemvOut::F32(&mut out_f32)),
                            _ => (None, GemvOut::AddTo(&mut out)),
                        };
                        gemv(&dev, &x, tokens, w, rows, k, norm, target).unwrap()
                    })
                })
            });
            g.bench_function(format!("cublas_{rows}x{k}_t{tokens}"), |b| {
                b.iter_custom(|iters| {
                    time_gpu(&dev, iters, || {
                        let w = &ws[next % copies];
                        next += 1;
                        linear::linear(&dev, &x, w, tokens, k, rows, &mut out).unwrap()
                    })
                })
            });
        }
    }
    g.finish();
}

/// A decode step's one-token products back to back, as a step runs them: eight layers of
/// Llama-3-8B's four products with their fused ops, each reading what the one before wrote
/// (QKV after the norm, the output product into the residual stream from the QKV rows, gate/up
/// with SwiGLU, down into the residual stream), through `gemv.cu`'s kernels and through the
/// ring-fed ones (`ops::gemv::GemvRing`, Hopper only), which start while the product ahead
/// finishes. Throughput counts the weights once.
fn bench_gemv_chain(c: &mut Criterion) {
    use turbo_kernels::ops::gemv::{gemv_ring_config, gemv_with_ring, GemvNorm, GemvOut};
    if !turbo_kernels::cuda_available() {
        eprintln!("skipping GEMV chain benches: no CUDA device");
        return;
    }
    let dev = CudaDevice::new(0).expect("CUDA device");
    let s = dev.stream.clone();
    let mut g = c.benchmark_group("cuda_gemv_chain");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    let (hidden, qkv, ffn, layers) = (4096usize, 6144usize, 14336usize, 8usize);
    let weights: Vec<[CudaSlice<bf16>; 4]> = (0..layers)
        .map(|l| {
            let seed = 60 + 4 * l as u64;
            [
                random_bf16(&s, qkv * hidden, seed),
                random_bf16(&s, hidden * hidden, seed + 1),
                random_bf16(&s, 2 * ffn * hidden, seed + 2),
                random_bf16(&s, hidden * ffn, seed + 3),
            ]
        })
        .collect();
    let norm_w = random_bf16(&s, hidden, 59);
    let mut h = random_bf16(&s, hidden, 58);
    let mut qkv_out = random_bf16(&s, qkv, 57);
    let mut act = random_bf16(&s, ffn, 56);
    let bytes = layers * 2 * hidden * (qkv + hidden + 3 * ffn);
    g.throughput(Throughput::Bytes(bytes as u64));
    let ring = gemv_ring_config();
    let forms = [("stream", None), ("ring", ring)];
    for (name, form) in forms {
        if name == "ring" && !dev.supports_module("gemv_sm90a") {
            continue;
        }
        g.bench_function(format!("{name}_8B_layers{layers}_t1"), |b| {
            b.iter_custom(|iters| {
                time_gpu(&dev, iters, || {
                    for [wqkv, wo, wgu, wd] in &weights {
                        let norm = || {
                            Some(GemvNorm {
                                weight: &norm_w,
                                eps: 1e-5,
                            })
                        };
                        let (d, f) = (&dev, form);
                        let out = GemvOut::Bf16(&mut qkv_out);
                        gemv_with_ring(d, f, &h, 1, wqkv, qkv, hidden, norm(), out).unwrap();
                        let out = GemvOut::AddTo(&mut h);
                        gemv_with_ring(d, f, &qkv_out, 1, wo, hidden, hidden, None, out).unwrap();
                        let out = GemvOut::SwiGlu(&mut act);
                        gemv_with_ring(d, f, &h, 1, wgu, 2 * ffn, hidden, norm(), out).unwrap();
                        let out = GemvOut::AddTo(&mut h);
                        gemv_with_ring(d, f, &act, 1, wd, hidden, ffn, None, out).unwrap();
                    }
                })
            })
        });
    }
    g.finish();
}

/// The all-reduce of a split model's residual stream (hidden 4096, bf16) over two GPUs, through
/// peer-mapped memory (each of its kernels, and the automatic choice) and through NCCL: decode
/// steps of 1 to 256 rows (83, the mean of the 1000-request run) and a mixed step of 640 rows.
/// One iteration is 64 calls on each rank (a 32-layer step), each rank issuing its own from a
/// thread of its own as the model does.
fn bench_all_reduce(c: &mut Criterion) {
    use turbo_core::Backend;
    use turbo_kernels::CudaBackend;
    if turbo_kernels::device_count() < 2 || !turbo_kernels::nccl_available() {
        eprintln!("skipping all-reduce benches: two GPUs and NCCL needed");
        return;
    }
    let group = CudaBackend::group(0, 2).expect("a group of two GPUs");
    let mut g = c.benchmark_group("all_reduce");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    use turbo_kernels::PeerAllReduceKernel::{Auto, Flagged, Pulled};
    for rows in [1usize, 8, 32, 83, 256, 640] {
        let n = rows * 4096;
        let mut tensors: Vec<_> = group
            .iter()
            .map(|b| b.upload(&vec![0.5f32; n], rows, 4096).expect("upload"))
            .collect();
        let modes = [
            ("auto", Some(Auto)),
            ("flagged", Some(Flagged)),
            ("pulled", Some(Pulled)),
            ("nccl", None),
        ];
        for (mode, kernel) in modes {
            let peer = kernel.is_some();
            if peer && !group[0].has_peer_all_reduce()
                || kernel == Some(Flagged) && n > turbo_kernels::FLAGGED_MAX_ELEMS
            {
                continue;
            }
            group[0].set_peer_all_reduce(peer);
            group[0].set_peer_all_reduce_kernel(kernel.unwrap_or(Auto));
            g.throughput(Throughput::Bytes((64 * n * 2) as u64));
            g.bench_function(format!("tp2_rows{rows}_x64_{mode}"), |bench| {
                bench.iter_custom(|iters| all_reduce_rounds(&group, &mut tensors, iters))
            });
        }
    }
    // The pulled kernel's block cap (one block an SM by default) at the sizes where it runs.
    let sms = group[0].device().sm_count();
    if group[0].has_peer_all_reduce() {
        group[0].set_peer_all_reduce(true);
        group[0].set_peer_all_reduce_kernel(Pulled);
        for rows in [83usize, 256, 640] {
            let n = rows * 4096;
            let mut tensors: Vec<_> = group
                .iter()
                .map(|b| b.upload(&vec![0.5f32; n], rows, 4096).expect("upload"))
                .collect();
            for cap in [sms / 2, sms, (2 * sms).min(turbo_kernels::PEER_MAX_BLOCKS)] {
                group[0].set_peer_max_blocks(cap);
                g.throughput(Throughput::Bytes((64 * n * 2) as u64));
                g.bench_function(format!("tp2_rows{rows}_x64_pulled_blocks{cap}"), |bench| {
                    bench.iter_custom(|iters| all_reduce_rounds(&group, &mut tensors, iters))
                });
            }
        }
        group[0].set_peer_max_blocks(sms);
        group[0].set_peer_all_reduce_kernel(Auto);
    }
    g.finish();
}

/// The time of `iters` rounds of 64 all-reduces of `tensors` (one per rank), each rank issuing
/// its calls from a thread of its own, as a split model does.
fn all_reduce_rounds(
    group: &[turbo_kernels::CudaBackend],
    tensors: &mut [turbo_kernels::CudaTensor],
    iters: u64,
) -> Duration {
    use turbo_core::Backend;
    let start = std::time::Instant::now();
    std::thread::scope(|scope| {
        for (b, t) in group.iter().zip(tensors.iter_mut()) {
            scope.spawn(move || {
                for _ in 0..iters * 64 {
                    b.all_reduce_sum(t).expect("all-reduce");
                }
                b.device().stream.synchronize().expect("sync");
            });
        }
    });
    start.elapsed()
}

/// The algorithms cuBLASLt's heuristic offers for the 8B shape's decode products at 16-256
/// rows, each timed: the first is what the products use. Prints a table (no criterion samples);
/// runs only when its name is in the filter (`--bench lt_candidates`).
fn bench_lt_candidates(_c: &mut Criterion) {
    use turbo_kernels::ops::linear::{candidates, linear_with_candidate};
    if !std::env::args().any(|a| a.contains("lt_candidates")) || !turbo_kernels::cuda_available() {
        return;
    }
    let dev = CudaDevice::new(0).expect("CUDA device");
    let s = dev.stream.clone();
    let shapes = [
        ("qkv", 6144usize, 4096usize),
        ("o", 4096, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
    ];
    println!(
        "lt_candidates: shape rows | candidates | first choice µs (TB/s) | best µs (TB/s), index"
    );
    for (name, m, k) in shapes {
        let w = random_bf16(&s, m * k, 21);
        for n in [16usize, 32, 64, 128, 256] {
            let x = random_bf16(&s, n * k, 22);
            let mut out = s.alloc_zeros::<bf16>(n * m).unwrap();
            let count = candidates(&dev, n, k, m).unwrap();
            let bytes = ((m * k + n * k + n * m) * 2) as f64;
            let mut times = Vec::new();
            for c in 0..count {
                let run = |out: &mut _| linear_with_candidate(&dev, &x, &w, n, k, m, c, out);
                if run(&mut out).is_err() {
                    continue;
                }
                let t = time_gpu(&dev, 50, || run(&mut out).unwrap());
                times.push((c, t.as_secs_f64() / 50.0 * 1e6));
            }
            let first = times
                .iter()
                .find(|(c, _)| *c == 0)
                .map_or(f64::NAN, |t| t.1);
            let (best_c, best) = times
                .iter()
                .copied()
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .unwrap_or((0, f64::NAN));
            println!(
                "lt_candidates: {name} {n} | {count} | {first:.1} ({:.2}) | {best:.1} ({:.2}), {best_c}",
                bytes / first / 1e6,
                bytes / best / 1e6
            );
        }
    }
}

criterion_group!(
    benches,
    bench_all_reduce,
    bench_read_probe,
    bench,
    bench_merge,
    bench_cascade,
    bench_sampling,
    bench_gemv,
    bench_gemv_chain,
    bench_lt_candidates
);
criterion_main!(benches);
