//! The whole forward pass on the GPU against the CPU backend, on random models.

use turbo_core::cpu::CpuBackend;
use turbo_core::DType;
use turbo_kernels::CudaBackend;
use turbo_llama::{Llama, LoadedModel};
use turbo_scheduler::{PersistentBatch, Request};
use turbo_tests::alone::{single_sequence, Alone};
use turbo_tests::engine::engine_logits;
use turbo_tests::files::write_gguf;
use turbo_tests::tiny::{random_tokens, TinySpec, TinyWeights};

fn gpu() -> Option<CudaBackend> {
    if !turbo_kernels::cuda_available() {
        eprintln!("skipping: no CUDA device");
        return None;
    }
    Some(CudaBackend::new(0).expect("CUDA device 0"))
}

fn load(spec: &TinySpec, dtype: DType, dir: &tempfile::TempDir) -> LoadedModel {
    let path = dir.path().join("model.gguf");
    write_gguf(&path, spec, &TinyWeights::random(spec), dtype);
    LoadedModel::load(&path).expect("tiny model loads")
}

/// Largest |gpu - cpu| over all logits, relative to the largest CPU logit.
fn rel_diff(gpu: &[Vec<f32>], cpu: &[Vec<f32>]) -> f32 {
    let scale = cpu.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    let diff = gpu
        .iter()
        .flatten()
        .zip(cpu.iter().flatten())
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / (1.0 + scale)
}

#[test]
fn gpu_logits_match_cpu_on_random_models() {
    let Some(gpu) = gpu() else { return };
    // bf16 weights and activations round each value to 2^-9 relative; a few dozen roundings
    // per layer through 2-3 layers keep logits within a few percent of the f32 CPU result.
    const TOL: f32 = 4e-2;
    // Head dimensions 32 and 64: the sizes the attention kernels support (16 is rejected).
    let cases = [
        (
            TinySpec {
                hidden: 128,
                ffn: 160,
                ..Default::default()
            },
            DType::F32,
        ),
        (
            TinySpec {
                heads: 8,
                kv_heads: 2,
                hidden: 256,
                ffn: 256,
                layers: 3,
                seed: 1,
                ..Default::default()
            },
            DType::Q8_0,
        ),
        (
            TinySpec {
                heads: 4,
                kv_heads: 4,
                hidden: 128,
                ffn: 192,
                tied: true,
                seed: 2,
                ..Default::default()
            },
            DType::BF16,
        ),
    ];
    for (spec, dtype) in cases {
        let dir = tempfile::tempdir().unwrap();
        let loaded = load(&spec, dtype, &dir);
        let cpu_model = Llama::new(CpuBackend::new(), &loaded.config, &loaded.weights).unwrap();
        let gpu_model = Llama::new(gpu.clone(), &loaded.config, &loaded.weights).unwrap();
        let tokens = random_tokens(&spec, 70, spec.seed + 10);
        let cpu = engine_logits(&cpu_model, &tokens);
        let gpu_logits = engine_logits(&gpu_model, &tokens);
        assert!(
            gpu_logits.iter().flatten().all(|x| x.is_finite()),
            "{dtype}: non-finite GPU logits"
        );
        let d = rel_diff(&gpu_logits, &cpu);
        eprintln!(
            "{dtype} {}x{} layers {}: max relative logit difference {d:.2e}",
            spec.hidden, spec.ffn, spec.layers
        );
        assert!(
            d <= TOL,
            "{dtype}: GPU logits differ from CPU by {d} (tolerance {TOL})"
        );
    }
}

#[test]
fn unsupported_head_dims_are_refused_up_front() {
    let Some(gpu) = gpu() else { return };
    let spec = TinySpec::default(); // head dim 16
    let dir = tempfile::tempdir().unwrap();
    let loaded = load(&spec, DType::F32, &dir);
    let model = Llama::new(gpu, &loaded.config, &loaded.weights).unwrap();
    let config = single_sequence(&loaded.config, 16);
    let err = PersistentBatch::new(model, loaded.tokenizer, config)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("head dimension 16"), "{err}");
}

#[test]
fn gpu_greedy_matches_cpu_on_a_smollm2_shaped_model() {
    let Some(gpu) = gpu() else { return };
    // SmolLM2-135M's shape with random weights (F16, 30 layers, 9/3 heads, d 64, vocab 49152).
    let spec = TinySpec {
        vocab: 49152,
        hidden: 576,
        layers: 30,
        heads: 9,
        kv_heads: 3,
        ffn: 1536,
        rope_theta: 100000.0,
        context: 512,
        tied: true,
        seed: 7,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let loaded = load(&spec, DType::F16, &dir);
    let prompt = random_tokens(&spec, 24, 3);
    let request = Request {
        max_tokens: 32,
        ignore_eos: true,
        ..Request::new(prompt.clone())
    };
    let cpu_model = Llama::new(CpuBackend::new(), &loaded.config, &loaded.weights).unwrap();
    let gpu_model = Llama::new(gpu, &loaded.config, &loaded.weights).unwrap();

    let mut cpu = Alone::new(cpu_model, loaded.tokenizer.clone(), 16);
    let cpu_out = cpu.run(request.clone());
    let mut gpu = Alone::new(gpu_model, loaded.tokenizer.clone(), 16);
    let gpu_out = gpu.run(request);

    // Tokens must agree until the CPU's own top-2 logit gap is small enough for bf16 rounding to
    // flip it; find that position by scoring the CPU's sequence once.
    let mut seq = prompt.clone();
    seq.extend(&cpu_out.token_ids);
    let cpu_logits = engine_logits(cpu.model(), &seq);
    let agree = cpu_out
        .token_ids
        .iter()
        .zip(&gpu_out.token_ids)
        .take_while(|(a, b)| a == b)
        .count();
    eprintln!("greedy: {agree}/{} tokens agree", cpu_out.token_ids.len());
    if agree < cpu_out.token_ids.len() {
        let row = &cpu_logits[prompt.len() - 1 + agree];
        let mut sorted = row.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let gap = sorted[0] - sorted[1];
        let scale = sorted[0].abs().max(1.0);
        assert!(
            gap <= 0.05 * scale,
            "GPU left the CPU's greedy path at token {agree} where the CPU's top-2 gap is {gap} (scale {scale})"
        );
    }
}

/// KV eviction on the GPU: a prefill, each (layer, KV head) compacted to its own kept keys over
/// scattered blocks, then a chunk and decode steps at the true positions, against the CPU
/// backend (itself checked against the f64 reference in `turbo-tests`).
#[test]
fn compacted_kv_matches_cpu() {
    use turbo_tests::engine::Compaction;
    let Some(gpu) = gpu() else { return };
    const TOL: f32 = 4e-2;
    let spec = TinySpec {
        heads: 8,
        kv_heads: 2,
        hidden: 256,
        ffn: 256,
        layers: 3,
        seed: 4,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let loaded = load(&spec, DType::BF16, &dir);
    let cpu_model = Llama::new(CpuBackend::new(), &loaded.config, &loaded.weights).unwrap();
    let gpu_model = Llama::new(gpu, &loaded.config, &loaded.weights).unwrap();
    for (prefill, k, total, block_size) in [(40, 13, 64, 4), (300, 150, 340, 16)] {
        let tokens = random_tokens(&spec, total, spec.seed + prefill as u64);
        let blocks = prefill.max(k + total - prefill).div_ceil(block_size);
        let mut table: Vec<u32> = (0..blocks as u32).map(|b| (b * 7 + 3) % 97).collect();
        table.dedup();
        assert_eq!(table.len(), blocks);
        let scenario = Compaction {
            prefill,
            kept: Compaction::random(spec.layers, spec.kv_heads, prefill, k, 9),
            k,
            block_size,
            block_table: table,
            chunk: 5,
        };
        let cpu = scenario.run(&cpu_model, &tokens);
        let gpu_logits = scenario.run(&gpu_model, &tokens);
        let d = rel_diff(&gpu_logits, &cpu);
        eprintln!("compacted {prefill} -> {k} keys: max relative logit difference {d:.2e}");
        assert!(d <= TOL, "GPU logits after compaction differ by {d}");
    }
}

/// Random values that bf16 holds exactly, so that both backends score the very same inputs.
fn bf16_exact(rng: &mut rand_chacha::ChaCha8Rng, n: usize, max: f32) -> Vec<f32> {
    use rand::Rng;
    (0..n)
        .map(|_| half::bf16::from_f32(rng.random_range(-max..max)).to_f32())
        .collect()
}

/// Chooses a sequence's kept keys from its scores and key count: the keys and how many per row.
type Choose<'a> = dyn FnMut(usize, &[f32], usize) -> (Vec<u32>, usize) + 'a;

/// One step of the scoring scenario: rows of sequences, each `(sequence, first key, rows)`.
struct ScoreStep {
    chunks: Vec<(usize, usize, usize)>,
}

/// Two sequences on scattered blocks of a 2-layer cache under GQA (8 query heads over 2 KV
/// heads), scored by `function` through prefill chunks, decode steps and a compaction, on
/// `backend`; returns each sequence's scores (`[layer][kv head][key]`) after every step, and
/// before the last steps compacts both with `kept` of the scores read at that point (chosen
/// by `choose`, which sees the scores and returns the kept keys and their count).
fn scored_run<B: turbo_core::Backend>(
    backend: &B,
    function: turbo_keyformer::ScoreFunction,
    (head_dim, n_kv_heads, dtype): (usize, usize, turbo_core::KvDtype),
    choose: &mut Choose,
) -> Vec<Vec<f32>> {
    use rand::SeedableRng;
    use turbo_attention::QuerySpan;
    use turbo_core::backend::BatchLayout;
    use turbo_core::cpu::KvCacheSpec;
    use turbo_core::{KvCompaction, KvScoring};
    const HEADS: usize = 8;
    let spec = KvCacheSpec {
        n_layers: 2,
        n_kv_heads,
        head_dim,
        block_size: 16,
        max_blocks: 64,
        dtype,
    };
    let kv_cols = spec.n_kv_heads * head_dim;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(head_dim as u64);
    let mut cache = backend.kv_cache(spec).unwrap();
    let mut batch = backend.new_batch().unwrap();
    // Shuffled, disjoint blocks: 40 for sequence 0 (up to 640 keys), 8 for sequence 1.
    let blocks: Vec<u32> = (0..64u32).map(|b| (b * 17 + 5) % 64).collect();
    let tables = [blocks[..40].to_vec(), blocks[40..48].to_vec()];
    let mut keys = [0usize, 0usize];
    let mut positions = [0u32, 0u32];
    let steps = [
        // Sequence 0 long enough that its decode steps split its keys into several ranges. The
        // decode steps output both rows, as recordable steps do: on the GPU they take the
        // recorded steps' plan (a fixed split, the scores' launch shapes fixed by the rows).
        ScoreStep {
            chunks: vec![(0, 0, 300)],
        },
        ScoreStep {
            chunks: vec![(0, 300, 300), (1, 0, 33)],
        },
        ScoreStep {
            chunks: vec![(0, 600, 1), (1, 33, 1)],
        },
        ScoreStep {
            chunks: vec![(0, 601, 1), (1, 34, 1)],
        },
        // After compaction (below): decode at the true positions over fewer keys.
        ScoreStep {
            chunks: vec![(0, 0, 1), (1, 0, 1)],
        },
        ScoreStep {
            chunks: vec![(0, 0, 3), (1, 0, 1)],
        },
    ];
    let mut out = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        if i == 4 {
            for s in 0..2 {
                let scores = backend.read_kv_scores(&cache, &tables[s], keys[s]).unwrap();
                let (kept, k) = choose(s, &scores, keys[s]);
                backend
                    .compact_kv(
                        &mut cache,
                        &KvCompaction {
                            block_table: &tables[s],
                            kept: &kept,
                            kept_per_row: k,
                        },
                    )
                    .unwrap();
                keys[s] = k;
            }
        }
        let (mut ids, mut pos, mut slots, mut spans_at) = (vec![], vec![], vec![], vec![]);
        for &(s, _, n) in &step.chunks {
            spans_at.push((ids.len(), n, keys[s] + n, s));
            for j in 0..n {
                let key = keys[s] + j;
                ids.push(1u32);
                pos.push(positions[s] + j as u32);
                slots.push(tables[s][key / 16] * 16 + (key % 16) as u32);
            }
            keys[s] += n;
            positions[s] += n as u32;
        }
        let spans: Vec<QuerySpan> = spans_at
            .iter()
            .map(|&(q_start, n_q, kv_len, s)| QuerySpan {
                q_start,
                n_q,
                kv_len,
                block_table: &tables[s],
            })
            .collect();
        let scoring: Vec<Option<KvScoring>> = spans_at
            .iter()
            .map(|&(_, _, _, s)| {
                Some(KvScoring {
                    function,
                    seed: 11 + s as u64,
                    iteration: i as u32,
                    total_iterations: 8,
                })
            })
            .collect();
        let inv_freq = vec![1.0f32; head_dim / 2];
        let decode = step.chunks.iter().all(|&(_, _, n)| n == 1);
        let layout = BatchLayout {
            ids: &ids,
            positions: &pos,
            slots: &slots,
            spans: &spans,
            inv_freq: &inv_freq,
            outputs: if decode { &[0, 1] } else { &[] },
            n_heads: HEADS,
            vocab: 1,
            sampling: None,
            scoring: &scoring,
        };
        backend.prepare_batch(&mut batch, &layout, &cache).unwrap();
        let t = ids.len();
        for layer in 0..spec.n_layers {
            let k = backend
                .upload(&bf16_exact(&mut rng, t * kv_cols, 1.0), t, kv_cols)
                .unwrap();
            let v = backend.upload(&vec![0.0; t * kv_cols], t, kv_cols).unwrap();
            let q = backend
                .upload(
                    &bf16_exact(&mut rng, t * HEADS * head_dim, 2.0),
                    t,
                    HEADS * head_dim,
                )
                .unwrap();
            backend.write_kv(&mut cache, layer, &k, &v, &batch).unwrap();
            // As in the model: attention first (on the GPU, decode rows' logits come from it).
            let mut attn = backend
                .upload(&vec![0.0; t * HEADS * head_dim], t, HEADS * head_dim)
                .unwrap();
            backend
                .attention(&q, &cache, layer, HEADS, &batch, scale, &mut attn)
                .unwrap();
            backend
                .accumulate_kv_scores(&q, &mut cache, layer, HEADS, &batch, scale)
                .unwrap();
        }
        for s in 0..2 {
            out.push(backend.read_kv_scores(&cache, &tables[s], keys[s]).unwrap());
        }
    }
    out
}

/// `policy`'s kept keys of the scoring scenario's 2 x `kv_heads` rows at half of `keys` (an
/// eighth recent), and how many per row.
fn keep_half(
    policy: &dyn turbo_keyformer::EvictionPolicy,
    scores: &[f32],
    keys: usize,
    kv_heads: usize,
) -> (Vec<u32>, usize) {
    use turbo_keyformer::{select_kept, Budget, Dims, SelectionMode};
    let budget = Budget::new(keys / 2, keys / 8, 0).unwrap();
    let dims = Dims {
        layers: 2,
        kv_heads,
        keys,
    };
    let kept = select_kept(policy, scores, dims, &budget, SelectionMode::PerLayer).unwrap();
    let kept = kept.into_iter().map(|k| k as u32).collect();
    (kept, budget.kept_count(keys))
}

/// KV eviction scores on the GPU against the CPU backend (itself tested against the f64
/// reference) on identical bf16 inputs, for H2O and Keyformer, through prefill chunks, decode
/// steps and a compaction that must carry each key's score; the kept sets chosen from GPU scores
/// equal the CPU's up to keys whose scores tie within rounding.
#[test]
fn gpu_kv_scores_and_kept_sets_match_cpu() {
    use turbo_keyformer::{PolicyConfig, PolicyKind, ScoreFunction, TauSchedule};
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    // 64 and 128: tensor-core prompt scoring and decode scoring from the attention's logits;
    // 96: the CUDA-core kernels reading the keys for both. 8 query heads over 2 KV heads (4 a
    // group: the decode kernel's lanes share the noise), 1 (8 a group) and 4 (a key's scores
    // updated four at a time). INT8 and FP8 caches too (the keys are bf16 values, which both
    // backends quantize to the same codes): the quantized decode and prompt-scoring kernels.
    use turbo_core::KvDtype::{Fp8, Full, Int8};
    for (head_dim, kv_heads, dtype) in [
        (64, 2, Full),
        (128, 2, Full),
        (96, 2, Full),
        (128, 1, Full),
        (128, 4, Full),
        (64, 2, Int8),
        (128, 2, Fp8),
    ] {
        for (kind, function) in [
            (PolicyKind::H2O, ScoreFunction::Softmax),
            (
                PolicyKind::Keyformer,
                ScoreFunction::GumbelSoftmax(TauSchedule::PAPER),
            ),
        ] {
            let policy = kind.build(&PolicyConfig::default());
            // The CPU chooses; the GPU run compacts with the CPU's choice (so that both runs stay
            // comparable), and the GPU's own choice is compared with it.
            let mut cpu_kept: Vec<Vec<u32>> = Vec::new();
            let mut choose_cpu = |_s: usize, scores: &[f32], keys: usize| {
                let (kept, k) = keep_half(policy.as_ref(), scores, keys, kv_heads);
                cpu_kept.push(kept.clone());
                (kept, k)
            };
            let cpu_scores =
                scored_run(&cpu, function, (head_dim, kv_heads, dtype), &mut choose_cpu);
            let mut i = 0;
            let mut tie_breaks = 0;
            let mut choose_gpu = |_s: usize, scores: &[f32], keys: usize| {
                let (kept, k) = keep_half(policy.as_ref(), scores, keys, kv_heads);
                let want = &cpu_kept[i];
                i += 1;
                // Keys chosen by one side only must tie with the other side's choice: their
                // scores within rounding of the smallest score kept by policy.
                for row in 0..2 * kv_heads {
                    let (g, c) = (&kept[row * k..][..k], &want[row * k..][..k]);
                    let row_scores = &scores[row * keys..][..keys];
                    let min_kept = c
                        .iter()
                        .map(|&j| row_scores[j as usize])
                        .fold(f32::INFINITY, f32::min);
                    for &j in g {
                        if !c.contains(&j) {
                            tie_breaks += 1;
                            let s = row_scores[j as usize];
                            assert!(
                                (s - min_kept).abs() <= 1e-4 * (1.0 + min_kept.abs()),
                                "{kind:?} {dtype} d={head_dim} kv={kv_heads}: GPU keeps key {j} (score {s}) that the \
                                 CPU drops; the CPU's smallest kept score is {min_kept}"
                            );
                        }
                    }
                }
                (want.clone(), k)
            };
            let gpu_scores =
                scored_run(&gpu, function, (head_dim, kv_heads, dtype), &mut choose_gpu);
            assert_eq!(cpu_scores.len(), gpu_scores.len());
            let mut worst = 0f32;
            for (c, g) in cpu_scores.iter().zip(&gpu_scores) {
                assert_eq!(c.len(), g.len());
                for (a, b) in c.iter().zip(g) {
                    worst = worst.max((a - b).abs() / (1e-3 + a.abs()));
                }
            }
            eprintln!(
                "{kind:?} {dtype} d={head_dim} kv={kv_heads}: max relative score difference {worst:.2e}, \
                 {tie_breaks} kept keys differing by a tie"
            );
            assert!(
                worst <= 2e-3,
                "{kind:?} {dtype} d={head_dim} kv={kv_heads}: scores differ by {worst}"
            );
        }
    }
}

/// INT8 and FP8 KV caches on the GPU against the CPU backend with the same dtype: a prefill
/// (tensor-core prefill kernel at head_dim 64 and 128), and a compaction followed by a chunk and
/// decode steps (the grouped decode kernel reading quantized blocks, the codes and scales moved
/// together). Both backends quantize each (token, KV head) row with the same rule, but from
/// slightly different inputs (the GPU's keys and values are bf16, the CPU's f32), so a code may
/// differ by one step where a value sits near a rounding boundary. The bound is the bf16
/// tolerance plus the quantization's own effect on the CPU's logits (quantized against f32
/// cache): a broken decode (wrong scale, code or row) moves logits by far more than either.
#[test]
fn quantized_kv_matches_cpu() {
    use turbo_core::KvDtype;
    use turbo_tests::engine::Compaction;
    let Some(gpu) = gpu() else { return };
    const TOL: f32 = 4e-2;
    // (query heads, KV heads, hidden): head_dim 64 (GQA 2) and 128 (MQA).
    for (heads, kv_heads, hidden) in [(4, 2, 256), (4, 1, 512)] {
        let spec = TinySpec {
            heads,
            kv_heads,
            hidden,
            ffn: 256,
            layers: 2,
            seed: 7,
            ..Default::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let loaded = load(&spec, DType::BF16, &dir);
        let mut cpu_full = Llama::new(CpuBackend::new(), &loaded.config, &loaded.weights).unwrap();
        let mut cpu_model = Llama::new(CpuBackend::new(), &loaded.config, &loaded.weights).unwrap();
        let mut gpu_model = Llama::new(gpu.clone(), &loaded.config, &loaded.weights).unwrap();
        cpu_full.set_kv_dtype(KvDtype::Full);
        for dtype in [KvDtype::Int8, KvDtype::Fp8] {
            cpu_model.set_kv_dtype(dtype);
            gpu_model.set_kv_dtype(dtype);
            let tokens = random_tokens(&spec, 90, spec.seed + 1);
            let full = engine_logits(&cpu_full, &tokens);
            let cpu = engine_logits(&cpu_model, &tokens);
            let gpu_logits = engine_logits(&gpu_model, &tokens);
            let (own, d) = (rel_diff(&cpu, &full), rel_diff(&gpu_logits, &cpu));
            eprintln!(
                "{dtype} d {}: prefill, GPU vs CPU {d:.2e} (CPU {dtype} vs f32 cache {own:.2e})",
                hidden / heads
            );
            assert!(d <= TOL + own, "{dtype}: prefill logits differ by {d}");

            let (prefill, k, total, block_size) = (60, 30, 110, 16);
            let tokens = random_tokens(&spec, total, spec.seed + 2);
            let blocks = prefill.max(k + total - prefill).div_ceil(block_size);
            let scenario = Compaction {
                prefill,
                kept: Compaction::random(spec.layers, spec.kv_heads, prefill, k, 3),
                k,
                block_size,
                block_table: (0..blocks as u32).map(|b| (b * 5 + 2) % 23).collect(),
                chunk: 5,
            };
            let full = scenario.run(&cpu_full, &tokens);
            let cpu = scenario.run(&cpu_model, &tokens);
            let gpu_logits = scenario.run(&gpu_model, &tokens);
            let (own, d) = (rel_diff(&cpu, &full), rel_diff(&gpu_logits, &cpu));
            eprintln!(
                "{dtype} d {}: compacted + decode, GPU vs CPU {d:.2e} (CPU {dtype} vs f32 cache {own:.2e})",
                hidden / heads
            );
            assert!(
                d <= TOL + own,
                "{dtype}: decode logits after compaction differ by {d}"
            );
        }
    }
}
