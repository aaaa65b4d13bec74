//! Running Turbo's forward pass on a loaded model, the way the tests compare it.

use turbo_core::comm::CpuGroup;
use turbo_core::cpu::CpuBackend;
use turbo_core::{Backend, KvCompaction};
use turbo_llama::{Llama, LoadedModel, Logits, SequenceChunk};

/// Places a loaded model on the CPU backend.
pub fn cpu_model(loaded: &LoadedModel) -> Llama<CpuBackend> {
    Llama::new(CpuBackend::new(), &loaded.config, &loaded.weights).expect("model placed on the CPU")
}

/// Places a loaded model on `world` CPU ranks of one tensor-parallel group (threads of this
/// process, summing in a fixed order).
pub fn cpu_model_split(loaded: &LoadedModel, world: usize) -> Llama<CpuBackend> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let backends = CpuGroup::members(world)
        .into_iter()
        .map(|m| CpuBackend::with_group((threads / world).max(1), m).expect("CPU threads"))
        .collect();
    Llama::new_parallel(backends, &loaded.config, &loaded.weights).expect("model split")
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
    let mut cache = model.kv_cache(block_size, blocks).expect("KV cache");
    let chunk = SequenceChunk {
        tokens: tokens.to_vec(),
        start: 0,
        position: 0,
        block_table: (0..blocks as u32).collect(),
        scoring: None,
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

/// A KV-eviction scenario: prefill `tokens[..prefill]`, keep per (layer, KV head) the key indices
/// of `kept` (`[layers][kv_heads][k]`, each row strictly increasing and below `prefill`), compacted
/// into the leading key indices, then run the rest at their true positions: a chunk of `chunk`
/// tokens, then one token per forward pass.
pub struct Compaction {
    pub prefill: usize,
    pub kept: Vec<u32>,
    pub k: usize,
    pub block_size: usize,
    /// Blocks of the sequence (covering `k` plus the tokens after the prefill, and the prefill).
    pub block_table: Vec<u32>,
    pub chunk: usize,
}

impl Compaction {
    /// Random distinct kept keys per row of a model with `layers` x `kv_heads` KV rows.
    pub fn random(layers: usize, kv_heads: usize, prefill: usize, k: usize, seed: u64) -> Vec<u32> {
        use rand::seq::index::sample;
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut kept = Vec::with_capacity(layers * kv_heads * k);
        for _ in 0..layers * kv_heads {
            let mut row: Vec<u32> = sample(&mut rng, prefill, k)
                .into_iter()
                .map(|i| i as u32)
                .collect();
            row.sort_unstable();
            kept.extend(row);
        }
        kept
    }

    /// Logits of the tokens after the prefill (`[tokens.len() - prefill][vocab]`).
    pub fn run<B: Backend>(&self, model: &Llama<B>, tokens: &[u32]) -> Vec<Vec<f32>> {
        let max_block = *self.block_table.iter().max().expect("a block table") as usize;
        let mut cache = model
            .backend()
            .kv_cache(model.kv_spec(self.block_size, max_block + 1))
            .expect("KV cache");
        let vocab = model.config.vocab_size;
        let run = |cache: &mut B::KvCache, chunk: SequenceChunk, which| {
            let out = model.forward(&[chunk], cache, which).expect("forward pass");
            rows(&out, vocab)
        };
        let table = self.block_table.clone();
        run(
            &mut cache,
            SequenceChunk::new(tokens[..self.prefill].to_vec(), 0, table.clone()),
            Logits::Last,
        );
        model
            .backend()
            .compact_kv(
                &mut cache,
                &KvCompaction {
                    block_table: &table,
                    kept: &self.kept,
                    kept_per_row: self.k,
                },
            )
            .expect("compaction");
        let mut logits = Vec::new();
        let mut at = self.prefill;
        while at < tokens.len() {
            let len = if at == self.prefill { self.chunk } else { 1 };
            let end = (at + len).min(tokens.len());
            let chunk = SequenceChunk {
                tokens: tokens[at..end].to_vec(),
                start: self.k + (at - self.prefill),
                position: at,
                block_table: table.clone(),
                scoring: None,
            };
            logits.extend(run(&mut cache, chunk, Logits::All));
            at = end;
        }
        logits
    }

    /// Whether query `t` of layer `layer` sees key `j` through KV head `kv_head` (`j <= t`): all
    /// keys before the compaction, afterwards the kept ones and every later one.
    pub fn visible(
        &self,
        kv_heads: usize,
        layer: usize,
        kv_head: usize,
        t: usize,
        j: usize,
    ) -> bool {
        if t < self.prefill || j >= self.prefill {
            return true;
        }
        let row = &self.kept[(layer * kv_heads + kv_head) * self.k..][..self.k];
        row.binary_search(&(j as u32)).is_ok()
    }
}
