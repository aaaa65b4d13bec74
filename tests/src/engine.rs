//! Running Turbo's forward pass on a loaded model, the way the tests compare it.

use turbo_core::cpu::CpuBackend;
use turbo_core::Backend;
use turbo_llama::{Llama, LoadedModel, Logits, SequenceChunk};

/// Places a loaded model on the CPU backend.
pub fn cpu_model(loaded: &LoadedModel) -> Llama<CpuBackend> {
    Llama::new(CpuBackend::new(), &loaded.config, &loaded.weights).expect("model placed on the CPU")
}

/// Splits row-major `[rows, vocab]` logits into rows.
pub fn rows(logits: &[f32], vocab: usize) -> Vec<Vec<f32>> {
    assert_eq!(logits.len() % vocab, 0);
    logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect()
}

/// Logits at every position of `tokens`, run in one forward pass over a fresh cache with
/// contiguous blocks of 16 tokens.
pub fn engine_logits<B: Backend>(model: &Llama<B>, tokens: &[u32]) -> Vec<Vec<f32>> {
    let block_size = 16;
    let blocks = tokens.len().div_ceil(block_size);
    let mut cache = model
        .backend()
        .kv_cache(model.kv_spec(block_size, blocks))
        .expect("KV cache");
    let chunk = SequenceChunk {
        tokens: tokens.to_vec(),
        start: 0,
        block_table: (0..blocks as u32).collect(),
    };
    let out = model
        .forward(&[chunk], &mut cache, Logits::All)
        .expect("forward pass");
    rows(&out, model.config.vocab_size)
}

/// Loads `path` and returns its logits at every position of `tokens`.
pub fn load_and_run(path: impl AsRef<std::path::Path>, tokens: &[u32]) -> Vec<Vec<f32>> {
    let path = path.as_ref();
    let loaded =
        LoadedModel::load(path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
    engine_logits(&cpu_model(&loaded), tokens)
}
