//! End-to-end generation on the default model (SmolLM2-135M-Instruct, fetched on first use)
//! through a persistent batch of one slot: one decode step at a 64-token context, and a 128-token
//! prefill.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use turbo_core::cpu::CpuBackend;
use turbo_llama::{Llama, LoadedModel};
use turbo_scheduler::{BatchConfig, Completion, PersistentBatch, Request};

/// Submits `request` and steps the batch until it has run.
fn run(batch: &mut PersistentBatch<CpuBackend>, request: Request) -> Completion {
    let handle = batch.submit(request);
    batch.run_until_idle().unwrap();
    handle.wait().unwrap()
}

/// One token after `prompt`, in `session` if given.
fn one_token(prompt: &[u32], session: Option<&str>) -> Request {
    Request {
        max_tokens: 1,
        ignore_eos: true,
        session: session.map(Into::into),
        ..Request::new(prompt.to_vec())
    }
}

fn bench(c: &mut Criterion) {
    let path = turbo_models::DEFAULT_MODEL
        .ensure(false)
        .expect("the default model");
    let loaded = LoadedModel::load(&path).expect("model loads");
    let model =
        Llama::new(CpuBackend::new(), &loaded.config, &loaded.weights).expect("model placed");
    // One sequence at a time, with room for a full context; prompts in one forward pass.
    let config = BatchConfig {
        max_batch: 1,
        max_batched_tokens: 512,
        block_size: 16,
        num_blocks: loaded.config.context_length.div_ceil(16),
        prefill_chunk: 512,
        prefix_caching: true,
    };
    let mut batch = PersistentBatch::new(model, loaded.tokenizer, config.clone()).expect("batch");
    let prompt: Vec<u32> = (0..128u32).map(|i| 100 + i * 37 % 20000).collect();

    let mut group = c.benchmark_group("e2e_smollm2");
    group.sample_size(20);
    // A decode step: the session holds 64 tokens' KV; each iteration's prompt is those 64 tokens
    // and one more, so it runs that one token at position 64 and generates one, and the next
    // iteration's prompt drops the generated one again: every step runs at the same context
    // length.
    group.throughput(Throughput::Elements(1));
    run(&mut batch, one_token(&prompt[..64], Some("bench")));
    let next = one_token(&prompt[..65], Some("bench"));
    let step = run(&mut batch, next.clone());
    assert_eq!((step.cached_prompt_tokens, step.prefilled_tokens), (64, 1));
    group.bench_function("decode_step_ctx64", |b| {
        b.iter(|| run(&mut batch, next.clone()));
    });
    assert!(batch.end_session("bench").unwrap());

    // A prefill without any KV reuse, so that every iteration computes the whole prompt.
    let (model, tokenizer) = batch.into_parts();
    let config = BatchConfig {
        prefix_caching: false,
        ..config
    };
    let mut batch = PersistentBatch::new(model, tokenizer, config).expect("batch");
    group.throughput(Throughput::Elements(prompt.len() as u64));
    group.bench_function("prefill_128", |b| {
        b.iter(|| run(&mut batch, one_token(&prompt, None)))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
