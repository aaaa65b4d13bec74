//! Tensor parallelism on GPUs (NCCL, and the all-reduce through peer-mapped memory): a model
//! split over 2 and 4 GPUs against the same model on one GPU and on the CPU, and the peer
//! all-reduce against sums made on the host. Skips with a message unless two GPUs (four for the
//! 4-rank parts) and NCCL are present.
//!
//! Tolerances: a split GPU run differs from the whole one by the bf16 rounding of the partial
//! residual updates before their sum (each rank's W_o and W_down products round to bf16, then the
//! all-reduce rounds their sum), a few bf16 ulps per layer: the same 4e-2 of the logit scale that
//! the GPU-vs-CPU tests allow. Greedy tokens are compared up to the first step whose top-2 gap on
//! the CPU is below 0.1 (bf16 noise can pick either token there).

use half::bf16;
use std::time::{Duration, Instant};
use turbo_core::{Backend, DType};
use turbo_kernels::{CudaBackend, CudaTensor, PeerAllReduceKernel, FLAGGED_MAX_ELEMS};

/// Every kernel of the peer all-reduce, the automatic choice first.
const KERNELS: [PeerAllReduceKernel; 3] = [
    PeerAllReduceKernel::Auto,
    PeerAllReduceKernel::Flagged,
    PeerAllReduceKernel::Pulled,
];
use turbo_llama::{Llama, LoadedModel, Logits, SequenceChunk};
use turbo_scheduler::{BatchConfig, PersistentBatch, Request};
use turbo_tests::engine::{cpu_model, engine_logits, rows};
use turbo_tests::files::write_gguf;
use turbo_tests::tiny::{random_tokens, TinySpec, TinyWeights};

const TOL: f32 = 4e-2;

fn gpus(world: usize) -> Option<Vec<CudaBackend>> {
    let count = turbo_kernels::device_count();
    if count < world {
        eprintln!("skipping: {world} GPUs needed, {count} present");
        return None;
    }
    if !turbo_kernels::nccl_available() {
        eprintln!("skipping: NCCL (libnccl.so) not found");
        return None;
    }
    Some(CudaBackend::group(0, world).expect("a group of GPUs"))
}

fn spec() -> TinySpec {
    TinySpec {
        vocab: 320,
        hidden: 512,
        layers: 3,
        heads: 8,
        kv_heads: 2,
        ffn: 1024,
        context: 512,
        seed: 11,
        ..TinySpec::default()
    }
}

fn rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let scale = b.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    let diff = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / (1.0 + scale)
}

/// Greedy completions of `prompts` run together, and the model back.
fn greedy<B: turbo_core::Backend>(
    model: Llama<B>,
    loaded: &LoadedModel,
    prompts: &[Vec<u32>],
) -> (Vec<Vec<u32>>, Llama<B>) {
    let (tokens, _, model) = greedy_stepping(model, loaded, prompts, true);
    (tokens, model)
}

/// [`greedy`], each step issued before the last one's tokens are read back (`overlap`) or one
/// at a time; also how many steps overlapped.
fn greedy_stepping<B: turbo_core::Backend>(
    model: Llama<B>,
    loaded: &LoadedModel,
    prompts: &[Vec<u32>],
    overlap: bool,
) -> (Vec<Vec<u32>>, u64, Llama<B>) {
    let config = BatchConfig {
        max_batch: 8,
        max_batched_tokens: 256,
        prefill_chunk: 64,
        num_blocks: 256,
        ..BatchConfig::default()
    };
    let mut batch = PersistentBatch::new(model, loaded.tokenizer.clone(), config).unwrap();
    batch.set_overlap(overlap);
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            batch.submit(Request {
                max_tokens: 32,
                ignore_eos: true,
                ..Request::new(p.clone())
            })
        })
        .collect();
    batch.run_until_idle().unwrap();
    let tokens = handles
        .into_iter()
        .map(|h| h.wait().unwrap().token_ids)
        .collect();
    let overlapped = batch.stats().overlapped_steps;
    (tokens, overlapped, batch.into_parts().0)
}

#[test]
fn gpu_split_models_match_one_gpu_and_the_cpu() {
    // Four ranks hold one of the model's two KV heads each twice (replicated), and a quarter of
    // the vocabulary, of the query heads and of the FFN.
    for world in [2, 4] {
        if let Some(group) = gpus(world) {
            split_matches_one_gpu_and_the_cpu(group);
        }
    }
}

fn split_matches_one_gpu_and_the_cpu(group: Vec<CudaBackend>) {
    let world = group.len();
    let spec = spec();
    let dir = tempfile::tempdir().unwrap();
    for dtype in [DType::F16, DType::Q8_0] {
        let path = dir.path().join(format!("model-{dtype}.gguf"));
        write_gguf(&path, &spec, &TinyWeights::random(&spec), dtype);
        let loaded = LoadedModel::load(&path).unwrap();
        let tokens = random_tokens(&spec, 100, 5);
        let cpu = engine_logits(&cpu_model(&loaded), &tokens);
        let one = Llama::new(
            CudaBackend::new(0).unwrap(),
            &loaded.config,
            &loaded.weights,
        )
        .unwrap();
        let one_logits = engine_logits(&one, &tokens);
        let backends: Vec<CudaBackend> = match dtype {
            DType::F16 => group.clone(),
            _ => CudaBackend::group(0, world).unwrap(),
        };
        let rank0 = backends[0].clone();
        let split = Llama::new_parallel(backends, &loaded.config, &loaded.weights).unwrap();
        let split_logits = engine_logits(&split, &tokens);
        let (vs_one, vs_cpu) = (
            rel_diff(&split_logits, &one_logits),
            rel_diff(&split_logits, &cpu),
        );
        eprintln!(
            "{dtype}: tp {world} vs 1 GPU {vs_one:.2e}, vs CPU {vs_cpu:.2e} (1 GPU vs CPU {:.2e})",
            rel_diff(&one_logits, &cpu)
        );
        assert!(
            vs_one < TOL && vs_cpu < TOL,
            "{dtype}: {vs_one:e} / {vs_cpu:e}"
        );

        // Greedy decoding in a continuous batch, decode steps recorded as CUDA graphs with their
        // all-reduces inside.
        let prompts: Vec<Vec<u32>> = [7, 50, 120, 33]
            .iter()
            .enumerate()
            .map(|(i, &n)| random_tokens(&spec, n, 40 + i as u64))
            .collect();
        let (want, one) = greedy(one, &loaded, &prompts);
        let before = rank0.graph_stats();
        let (got, overlapped, split) = greedy_stepping(split, &loaded, &prompts, true);
        let after = rank0.graph_stats();
        // Overlapped steps: rank 1 embeds the tokens rank 0 sampled, which it takes on its
        // device. Stepping one at a time runs the same steps.
        assert!(overlapped > 0, "{dtype}: no step overlapped");
        let (alone, none, _) = greedy_stepping(split, &loaded, &prompts, false);
        assert_eq!(none, 0);
        assert_eq!(alone, got, "{dtype}: overlapped vs one step at a time");
        eprintln!(
            "{dtype}: tp {world} recorded {} and replayed {} decode steps",
            after.recorded - before.recorded,
            after.replayed - before.replayed
        );
        if rank0.has_peer_all_reduce() {
            assert!(
                after.replayed > before.replayed,
                "{dtype}: no step replayed"
            );
        }
        if rank0.has_peer_all_reduce() && world == 2 {
            // NCCL's sums of two ranks round as the peer kernel's do (of more ranks, in NCCL's
            // own order), and graphs launch the same kernels: the same tokens without either.
            let nccl = CudaBackend::group(0, 2).unwrap();
            for b in &nccl {
                b.set_peer_all_reduce(false);
            }
            let model = Llama::new_parallel(nccl, &loaded.config, &loaded.weights).unwrap();
            let (direct, _) = greedy(model, &loaded, &prompts);
            assert_eq!(
                direct, got,
                "{dtype}: NCCL without graphs vs peer all-reduce"
            );
        }
        for ((p, g), w) in prompts.iter().zip(&got).zip(&want) {
            let Some(m) = g.iter().zip(w).position(|(a, b)| a != b) else {
                continue;
            };
            // Where they part, the one-GPU model must see a near tie between the two tokens.
            let context: Vec<u32> = p.iter().chain(&w[..m]).copied().collect();
            let last = engine_logits(&one, &context).pop().unwrap();
            let scale = last.iter().fold(0f32, |a, x| a.max(x.abs()));
            let gap = last[w[m] as usize] - last[g[m] as usize];
            eprintln!(
                "{dtype}: tp {world} parts at token {m} of {}, one GPU's gap {gap:.4}",
                w.len()
            );
            assert!(
                gap <= TOL * (1.0 + scale),
                "{dtype}: tp {world} picks {} at token {m} where one GPU's {} is {gap} ahead",
                g[m],
                w[m]
            );
        }
    }
}

#[test]
fn a_split_head_gathers_large_logits_in_several_calls() {
    // 130 output rows of a 20,001-column part are more than a staging half holds (2M values):
    // the peer gather takes two calls; an odd part width takes the kernel's scalar path.
    let spec = TinySpec {
        vocab: 40_002,
        hidden: 128,
        layers: 1,
        heads: 4,
        kv_heads: 2,
        ffn: 256,
        context: 256,
        seed: 5,
        ..TinySpec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wide.gguf");
    write_gguf(&path, &spec, &TinyWeights::random(&spec), DType::F16);
    let loaded = LoadedModel::load(&path).unwrap();
    let tokens = random_tokens(&spec, 130, 9);
    let mut want = None;
    // Four ranks hold parts of 10,000 and 10,001 columns.
    for world in [2, 4] {
        let Some(group) = gpus(world) else { return };
        let want = want.get_or_insert_with(|| {
            let one = Llama::new(
                CudaBackend::new(0).unwrap(),
                &loaded.config,
                &loaded.weights,
            )
            .unwrap();
            engine_logits(&one, &tokens)
        });
        let nccl = CudaBackend::group(0, world).unwrap();
        for b in &nccl {
            b.set_peer_all_reduce(false);
        }
        for (what, backends) in [("peer", group), ("NCCL", nccl)] {
            let split = Llama::new_parallel(backends, &loaded.config, &loaded.weights).unwrap();
            let got = engine_logits(&split, &tokens);
            assert_eq!(got.len(), want.len());
            let d = rel_diff(&got, want);
            eprintln!("{what}: 130 rows of 40,002 logits, tp {world} vs 1 GPU {d:.2e}");
            assert!(d < TOL, "{what}, tp {world}: {d:e}");
            // Every column came from its rank's part: the split product of a row equals the
            // whole one's up to the bf16 noise of the layers (a column left unwritten would be
            // 0 or stale).
            let far = got
                .iter()
                .zip(want.iter())
                .flat_map(|(g, w)| g.iter().zip(w))
                .filter(|(g, w)| (*g - *w).abs() > 0.25 * (1.0 + w.abs()))
                .count();
            assert_eq!(
                far, 0,
                "{what}, tp {world}: {far} logits far from one GPU's"
            );
        }
    }
}

/// Logits of decode steps: four sequences take `tokens[..prefill]` as a prompt, then the first
/// decodes the rest one token a step (steps of one row), and then steps of 2, 3 and 4 rows
/// decode one more token of the first sequences each (every kernel of the matrix-vector family).
fn decode_logits<B: turbo_core::Backend>(
    model: &Llama<B>,
    tokens: &[u32],
    prefill: usize,
) -> Vec<Vec<f32>> {
    let block_size = 16;
    let blocks = (tokens.len() + 4).div_ceil(block_size) as u32;
    let mut cache = model.kv_cache(block_size, 4 * blocks as usize).unwrap();
    let chunk = |t: u32, start: usize, seq: u32| SequenceChunk {
        tokens: vec![t],
        start,
        position: start,
        block_table: (seq * blocks..(seq + 1) * blocks).collect(),
        scoring: None,
    };
    let vocab = model.config.vocab_size;
    let mut out = Vec::new();
    for seq in 0..4 {
        let prompt = SequenceChunk {
            tokens: tokens[..prefill].to_vec(),
            ..chunk(0, 0, seq)
        };
        model.forward(&[prompt], &mut cache, Logits::Last).unwrap();
    }
    let mut lengths = [prefill; 4];
    for &t in &tokens[prefill..] {
        let logits = model.forward(&[chunk(t, lengths[0], 0)], &mut cache, Logits::Last);
        out.extend(rows(&logits.unwrap(), vocab));
        lengths[0] += 1;
    }
    for rows_in_step in 2..=4 {
        let step: Vec<SequenceChunk> = (0..rows_in_step)
            .map(|seq| chunk(tokens[seq], lengths[seq], seq as u32))
            .collect();
        let logits = model.forward(&step, &mut cache, Logits::Last).unwrap();
        out.extend(rows(&logits, vocab));
        for length in &mut lengths[..rows_in_step] {
            *length += 1;
        }
    }
    out
}

#[test]
fn fused_product_all_reduce_gives_the_bits_of_the_separate_kernels() {
    let spec = spec();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    write_gguf(&path, &spec, &TinyWeights::random(&spec), DType::F16);
    let loaded = LoadedModel::load(&path).unwrap();
    let tokens = random_tokens(&spec, 40, 11);
    // Auto fuses each decode step's W_o and W_down products with their all-reduces; Pulled and
    // Flagged keep them apart. A fresh group each, so that no recorded step carries over.
    for world in [2, 4] {
        fused_matches_separate(&loaded, &tokens, world);
    }
}

fn fused_matches_separate(loaded: &LoadedModel, tokens: &[u32], world: usize) {
    let mut fused = None;
    for kernel in KERNELS {
        let Some(group) = peer_group(world) else {
            return;
        };
        group[0].set_peer_all_reduce_kernel(kernel);
        let model = Llama::new_parallel(group.clone(), &loaded.config, &loaded.weights).unwrap();
        let logits = decode_logits(&model, tokens, 30);
        let launched = group[0].fused_all_reduces();
        match kernel {
            PeerAllReduceKernel::Auto => {
                assert!(
                    launched > 0,
                    "world {world}: Auto launched no fused product"
                );
                fused = Some(logits);
            }
            _ => {
                assert_eq!(launched, 0, "world {world}: {kernel:?} fused");
                let fused = fused.as_ref().expect("Auto runs first");
                assert!(
                    &logits == fused,
                    "world {world}, {kernel:?}: logits differ from the fused kernel's"
                );
            }
        }
        eprintln!("world {world}, {kernel:?}: {launched} fused launches");
    }
}

/// Values exactly representable in bf16, from a seeded generator.
fn bf16_values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32;
            bf16::from_f32((unit - 0.5) * 8.0).to_f32()
        })
        .collect()
}

/// What every rank must hold after summing `parts`: the f32 sum in rank order, rounded once.
fn rank_order_sum(parts: &[Vec<f32>]) -> Vec<f32> {
    (0..parts[0].len())
        .map(|i| bf16::from_f32(parts.iter().fold(0f32, |a, p| a + p[i])).to_f32())
        .collect()
}

/// Uploads `parts[r]` to rank r, all-reduces on every rank, each from a thread of its own as the
/// model does (NCCL blocks a thread that issues one rank's call until the others join), and
/// returns what each rank holds.
fn all_reduce(group: &[CudaBackend], parts: &[Vec<f32>]) -> Vec<Vec<f32>> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = group
            .iter()
            .zip(parts)
            .map(|(b, p)| {
                scope.spawn(move || {
                    let mut t = b.upload(p, 1, p.len()).unwrap();
                    b.all_reduce_sum(&mut t).unwrap();
                    b.download(&t).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A group whose GPUs map each other's memory, or a message saying why the test skips.
fn peer_group(world: usize) -> Option<Vec<CudaBackend>> {
    let group = gpus(world)?;
    if !group[0].has_peer_all_reduce() {
        eprintln!("skipping: these GPUs cannot map each other's memory");
        return None;
    }
    Some(group)
}

#[test]
fn peer_all_reduce_sums_in_rank_order_on_every_rank() {
    for world in [2, 4] {
        let Some(group) = peer_group(world) else {
            continue;
        };
        // Odd sizes exercise the tails; the large ones use every block of the fixed grid (the
        // flagged kernel's largest message, then the pulled kernel's); many calls in a row
        // exercise the epochs and the alternating halves, with the kernels interleaved. Every
        // kernel must give the rank-order sum's bits.
        let sizes = [
            1,
            7,
            8,
            4099,
            83 * 4096,
            FLAGGED_MAX_ELEMS,
            256 * 4096 + 5,
            1 << 22,
        ];
        for kernel in KERNELS {
            group[0].set_peer_all_reduce_kernel(kernel);
            for (call, &n) in sizes.iter().cycle().take(3 * sizes.len()).enumerate() {
                let parts: Vec<Vec<f32>> = (0..world)
                    .map(|r| bf16_values(n, (call * world + r) as u64 + 1))
                    .collect();
                let want = rank_order_sum(&parts);
                for (r, got) in all_reduce(&group, &parts).iter().enumerate() {
                    assert!(
                        got == &want,
                        "world {world}, {kernel:?}, call {call}, n {n}: rank {r} differs from \
                         the rank-order sum"
                    );
                }
            }
        }
        group[0].set_peer_all_reduce_kernel(PeerAllReduceKernel::Auto);
        // The same sums through NCCL agree with these up to the bf16 rounding of NCCL's own
        // partial sums: each of its world - 1 additions, and the reference's one rounding, is
        // off by at most half an ulp (2^-8 relative) of a partial sum, which the sum of the
        // parts' magnitudes bounds (partial sums can be far larger than the whole one).
        for b in &group {
            b.set_peer_all_reduce(false);
        }
        let parts: Vec<Vec<f32>> = (0..world)
            .map(|r| bf16_values(4096, 99 + r as u64))
            .collect();
        let want = rank_order_sum(&parts);
        let nccl = all_reduce(&group, &parts);
        let worst = nccl[0]
            .iter()
            .zip(&want)
            .enumerate()
            .map(|(i, (a, b))| {
                let magnitude: f32 = parts.iter().map(|p| p[i].abs()).sum();
                (a - b).abs() / (magnitude * 2f32.powi(-8) + f32::MIN_POSITIVE)
            })
            .fold(0f32, f32::max);
        assert!(
            worst <= world as f32 + 1e-3,
            "world {world}: NCCL's sum is {worst} half-ulps of the parts' magnitude off"
        );
        eprintln!("world {world}: peer all-reduce exact; NCCL within {worst:.2} half-ulps");
    }
}

#[test]
fn peer_all_reduce_replays_from_cuda_graphs() {
    let Some(group) = peer_group(2) else { return };
    let n = 3 * 4096 + 1;
    let mut tensors: Vec<CudaTensor> = group.iter().map(|b| b.tensor(1, n).unwrap()).collect();
    // All-reduces one after the other, as a layer makes them, each kernel followed by each
    // other (the ranks record one after the other, so the group's kernel can change between
    // calls); recorded once per rank, replayed many times.
    use PeerAllReduceKernel::{Flagged, Pulled};
    let sequence = [Flagged, Pulled, Flagged, Flagged, Pulled, Pulled, Flagged];
    let graphs: Vec<_> = group
        .iter()
        .zip(&mut tensors)
        .map(|(b, t)| {
            let stream = &b.device().stream;
            stream
                .begin_capture(
                    cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
                .unwrap();
            for kernel in sequence {
                b.set_peer_all_reduce_kernel(kernel);
                b.all_reduce_sum(t).unwrap();
            }
            b.set_peer_all_reduce_kernel(PeerAllReduceKernel::Auto);
            stream
                .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
                .unwrap()
                .expect("a recorded graph")
        })
        .collect();
    for replay in 0..40u64 {
        let parts: Vec<Vec<f32>> = (0..2).map(|r| bf16_values(n, 7 * replay + r)).collect();
        // Every rank holds the sum after the first call, so each later one doubles it (exact
        // in bf16).
        let doublings = 2f32.powi(sequence.len() as i32 - 1);
        let want: Vec<f32> = rank_order_sum(&parts)
            .iter()
            .map(|&s| bf16::from_f32(doublings * s).to_f32())
            .collect();
        // The graphs name the buffers they were recorded with: new values are copied in.
        for ((b, t), p) in group.iter().zip(&mut tensors).zip(&parts) {
            let host: Vec<bf16> = p.iter().map(|&v| bf16::from_f32(v)).collect();
            b.device().stream.memcpy_htod(&host, &mut t.data).unwrap();
        }
        for g in &graphs {
            g.launch().unwrap();
        }
        for (r, (b, t)) in group.iter().zip(&tensors).enumerate() {
            let got = b.download(t).unwrap();
            assert!(
                got == want,
                "replay {replay}: rank {r} differs from the sum"
            );
        }
    }
}

#[test]
fn peer_all_reduce_abort_releases_a_waiting_rank() {
    let Some(group) = peer_group(2) else { return };
    let mut t = group[0].upload(&bf16_values(64, 3), 1, 64).unwrap();
    let started = Instant::now();
    // Rank 1 never joins: rank 0's kernel waits at the barrier until the group is aborted.
    group[0].all_reduce_sum(&mut t).unwrap();
    let aborter = {
        let b = group[0].clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            b.abort_collectives();
        })
    };
    group[0].device().stream.synchronize().unwrap();
    aborter.join().unwrap();
    assert!(started.elapsed() >= Duration::from_millis(250));
    let refused = group[1].all_reduce_sum(&mut group[1].tensor(1, 64).unwrap());
    assert!(
        refused.is_err(),
        "an aborted group must refuse later collectives"
    );
}
