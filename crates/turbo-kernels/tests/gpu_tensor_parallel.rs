//! Tensor parallelism on GPUs (NCCL): a model split over 2 GPUs against the same model on one
//! GPU and on the CPU. Skips with a message unless two GPUs and NCCL are present.
//!
//! Tolerances: a split GPU run differs from the whole one by the bf16 rounding of the partial
//! residual updates before their sum (each rank's W_o and W_down products round to bf16, then the
//! all-reduce rounds their sum), a few bf16 ulps per layer: the same 4e-2 of the logit scale that
//! the GPU-vs-CPU tests allow. Greedy tokens are compared up to the first step whose top-2 gap on
//! the CPU is below 0.1 (bf16 noise can pick either token there).

use turbo_core::DType;
use turbo_kernels::CudaBackend;
use turbo_llama::{Llama, LoadedModel};
use turbo_scheduler::{BatchConfig, Request};
use turbo_tests::alone::run_together;
use turbo_tests::engine::{cpu_model, engine_logits};
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
    let config = BatchConfig {
        max_batch: 8,
        max_batched_tokens: 256,
        prefill_chunk: 64,
        num_blocks: 256,
        ..BatchConfig::default()
    };
    let requests = prompts
        .iter()
        .map(|p| Request {
            max_tokens: 32,
            ignore_eos: true,
            ..Request::new(p.clone())
        })
        .collect();
    let (done, model) = run_together(model, &loaded.tokenizer, config, requests);
    (done.into_iter().map(|c| c.token_ids).collect(), model)
}

#[test]
fn gpu_split_over_two_matches_one_gpu_and_the_cpu() {
    let Some(group) = gpus(2) else { return };
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
            _ => CudaBackend::group(0, 2).unwrap(),
        };
        let two = Llama::new_parallel(backends, &loaded.config, &loaded.weights).unwrap();
        let two_logits = engine_logits(&two, &tokens);
        let (vs_one, vs_cpu) = (
            rel_diff(&two_logits, &one_logits),
            rel_diff(&two_logits, &cpu),
        );
        eprintln!(
            "{dtype}: tp 2 vs 1 GPU {vs_one:.2e}, vs CPU {vs_cpu:.2e} (1 GPU vs CPU {:.2e})",
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
        let (got, _) = greedy(two, &loaded, &prompts);
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
                "{dtype}: parts at token {m} of {}, one GPU's gap {gap:.4}",
                w.len()
            );
            assert!(
                gap <= TOL * (1.0 + scale),
                "{dtype}: tp 2 picks {} at token {m} where one GPU's {} is {gap} ahead",
                g[m],
                w[m]
            );
        }
    }
}
