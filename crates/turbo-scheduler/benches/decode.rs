//! End-to-end generation on the default model (SmolLM2-135M-Instruct, fetched on first use):
//! one decode step at a 64-token context, and a 128-token prefill.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use turbo_core::cpu::CpuBackend;
use turbo_llama::{Llama, LoadedModel};
use turbo_scheduler::{Engine, GenerationRequest, Session};

fn bench(c: &mut Criterion) {
    let path = turbo_models::DEFAULT_MODEL
        .ensure(false)
        .expect("the default model");
    let loaded = LoadedModel::load(&path).expect("model loads");
    let model =
        Llama::new(CpuBackend::new(), &loaded.config, &loaded.weights).expect("model placed");
    let tokenizer = loaded.tokenizer;
    let mut engine = Engine::for_context(model, tokenizer, 16).expect("engine");
    let prompt: Vec<u32> = (0..128u32).map(|i| 100 + i * 37 % 20000).collect();

    let mut group = c.benchmark_group("e2e_smollm2");
    group.sample_size(20);
    // A decode step: the session holds 64 tokens, each iteration generates one more and
    // then forgets it again, so every step runs at the same context length.
    group.throughput(Throughput::Elements(1));
    let mut session = Session::new();
    let request = GenerationRequest {
        max_tokens: 1,
        ignore_eos: true,
        ..Default::default()
    };
    engine
        .generate(&mut session, &prompt[..64], &request, |_| true)
        .unwrap();
    let mut next = prompt[..65].to_vec();
    group.bench_function("decode_step_ctx64", |b| {
        b.iter(|| {
            engine
                .generate(&mut session, &next, &request, |_| true)
                .unwrap()
        });
    });
    next.truncate(0);
    engine.release(&mut session).unwrap();

    group.throughput(Throughput::Elements(prompt.len() as u64));
    group.bench_function("prefill_128", |b| {
        b.iter(|| {
            let mut s = Session::new();
            engine
                .generate(&mut s, &prompt, &request, |_| true)
                .unwrap();
            engine.release(&mut s).unwrap();
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
