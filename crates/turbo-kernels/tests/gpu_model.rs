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
