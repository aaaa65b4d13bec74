//! Tensor parallelism on the CPU: a model split over 2, 3 or 4 ranks (threads of this process,
//! meeting in an in-process all-reduce that sums in a fixed order) computes what the whole model
//! computes.
//!
//! Tolerances: a split changes only the order of f32 sums (each rank's partial W_o and W_down
//! products, then their sum), so logits agree with the unsplit model's to f32 rounding:
//! `SPLIT_TOL` = 1e-5 relative, the bound the other "same model, work split differently" tests
//! use; both stay within `TOL` = 1e-4 of the f64 reference. Greedy tokens must be equal: a tiny
//! random model has no top-2 gap anywhere near 1e-5 on these prompts (the test prints the
//! smallest gap it met).

use turbo_core::comm::CpuGroup;
use turbo_core::cpu::CpuBackend;
use turbo_keyformer::{BudgetConfig, BudgetSize, PolicyKind};
use turbo_llama::{Llama, LoadedModel, ShardPlan};
use turbo_scheduler::{BatchConfig, KvEviction, Request};
use turbo_tests::alone::run_together;
use turbo_tests::{
    cpu_model, cpu_model_split, engine_logits, max_rel_diff, max_rel_err, random_tokens,
    reference_logits, write_gguf, DType, RopeStyle, TinySpec, TinyWeights,
};

const TOL: f64 = 1e-4;
const SPLIT_TOL: f64 = 1e-5;

/// A tiny model with Llama-3-8B's proportions: grouped-query attention with 4 query heads per
/// KV head, an FFN 2x the width, rows that are whole blocks of every quantized type even when
/// split 4 ways.
fn spec() -> TinySpec {
    TinySpec {
        vocab: 320,
        hidden: 256,
        layers: 3,
        heads: 8,
        kv_heads: 2,
        ffn: 512,
        context: 256,
        seed: 7,
        ..TinySpec::default()
    }
}

fn load(
    spec: &TinySpec,
    dtype: DType,
) -> (tempfile::TempDir, LoadedModel, turbo_tests::RefWeights) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let stored = write_gguf(&path, spec, &TinyWeights::random(spec), dtype);
    let loaded = LoadedModel::load(&path).unwrap();
    (dir, loaded, stored)
}

#[test]
fn split_logits_equal_the_whole_models() {
    let spec = spec();
    for dtype in [DType::F32, DType::Q8_0, DType::Q4_1] {
        let (_dir, loaded, stored) = load(&spec, dtype);
        let tokens = random_tokens(&spec, 40, 3);
        let whole = engine_logits(&cpu_model(&loaded), &tokens);
        let want = reference_logits(&spec, &stored, &tokens, RopeStyle::Interleaved);
        for world in [2, 4] {
            let split = engine_logits(&cpu_model_split(&loaded, world), &tokens);
            let vs_whole = max_rel_diff(&split, &whole);
            let vs_ref = max_rel_err(&split, &want);
            eprintln!("{dtype} tp {world}: vs tp 1 {vs_whole:.2e}, vs f64 {vs_ref:.2e}");
            assert!(
                vs_whole < SPLIT_TOL,
                "{dtype} tp {world}: {vs_whole:e} from tp 1"
            );
            assert!(
                vs_ref < TOL,
                "{dtype} tp {world}: {vs_ref:e} from the reference"
            );
        }
    }
}

#[test]
fn a_vocabulary_that_does_not_divide_splits_unevenly() {
    for tied in [false, true] {
        let spec = TinySpec {
            vocab: 323,
            tied,
            ..spec()
        };
        let (_dir, loaded, _) = load(&spec, DType::Q8_0);
        let tokens = random_tokens(&spec, 24, 5);
        let whole = engine_logits(&cpu_model(&loaded), &tokens);
        for world in [2, 4] {
            let split = engine_logits(&cpu_model_split(&loaded, world), &tokens);
            assert_eq!(split.len(), whole.len());
            let d = max_rel_diff(&split, &whole);
            assert!(d < SPLIT_TOL, "tied {tied}, tp {world}: {d:e}");
        }
    }
}

fn batch_config() -> BatchConfig {
    BatchConfig {
        max_batch: 4,
        max_batched_tokens: 64,
        prefill_chunk: 24,
        num_blocks: 64,
        ..BatchConfig::default()
    }
}

/// Greedy completions of `prompts` submitted together (continuous batching: prompts of different
/// lengths, chunked prefill beside decode steps).
fn greedy(model: Llama<CpuBackend>, loaded: &LoadedModel, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let requests = prompts
        .iter()
        .map(|p| Request {
            max_tokens: 24,
            ignore_eos: true,
            ..Request::new(p.clone())
        })
        .collect();
    let (done, _) = run_together(model, &loaded.tokenizer, batch_config(), requests);
    done.into_iter().map(|c| c.token_ids).collect()
}

#[test]
fn split_models_generate_the_same_tokens_in_a_continuous_batch() {
    let spec = spec();
    let (_dir, loaded, _) = load(&spec, DType::Q8_0);
    let prompts: Vec<Vec<u32>> = [5, 37, 60, 11, 80]
        .iter()
        .enumerate()
        .map(|(i, &n)| random_tokens(&spec, n, 100 + i as u64))
        .collect();
    let whole = greedy(cpu_model(&loaded), &loaded, &prompts);
    for world in [2, 4] {
        let split = greedy(cpu_model_split(&loaded, world), &loaded, &prompts);
        assert_eq!(split, whole, "tp {world}");
    }
}

#[test]
fn uneven_splits_are_refused_by_name() {
    let spec = TinySpec {
        heads: 6,
        kv_heads: 3,
        hidden: 192,
        ffn: 384,
        ..spec()
    };
    let (_dir, loaded, _) = load(&spec, DType::F32);
    let err = |world| {
        ShardPlan::new(&loaded.config, world)
            .unwrap_err()
            .to_string()
    };
    assert!(
        err(4).contains("6 attention heads do not divide by 4"),
        "{}",
        err(4)
    );
    assert!(err(0).contains("at least one rank"), "{}", err(0));
    // 6 heads over 2: 3 KV heads do not divide by 2.
    assert!(
        err(2).contains("3 KV heads do not divide by 2"),
        "{}",
        err(2)
    );
    // 6 ranks over 3 KV heads: each KV head held by 2 ranks.
    let plan = ShardPlan::new(&loaded.config, 6).unwrap();
    assert_eq!((plan.heads_per_rank, plan.kv_replicas), (1, 2));
    // A group backend cannot be used as a whole model, nor backends in the wrong order.
    let mut members = CpuGroup::members(2);
    let second = CpuBackend::with_group(1, members.pop().unwrap()).unwrap();
    let first = CpuBackend::with_group(1, members.pop().unwrap()).unwrap();
    assert!(Llama::new(first.clone(), &loaded.config, &loaded.weights).is_err());
    let wrong = Llama::new_parallel(vec![second, first], &loaded.config, &loaded.weights);
    assert!(wrong.is_err());
}

#[test]
fn every_rank_holds_its_part_of_the_embedding_and_head() {
    for tied in [false, true] {
        let spec = TinySpec { tied, ..spec() };
        let (_dir, loaded, _) = load(&spec, DType::F32);
        let (c, w) = (&loaded.config, &loaded.weights);
        let whole = ShardPlan::new(c, 1).unwrap().bytes_of_rank(c, w, 0);
        for world in [2, 4] {
            let plan = ShardPlan::new(c, world).unwrap();
            let bytes: Vec<u64> = (0..world).map(|r| plan.bytes_of_rank(c, w, r)).collect();
            // Only the replicated norms, and KV heads held by several ranks, count more than once.
            let norms = 4 * (w.final_norm.len() + 2 * c.hidden_size * c.n_layers) as u64;
            let kv: u64 = w
                .layers
                .iter()
                .map(|l| (l.wk.data.len() + l.wv.data.len()) as u64)
                .sum();
            assert_eq!(
                bytes.iter().sum::<u64>(),
                whole + (world as u64 - 1) * norms + (plan.kv_replicas as u64 - 1) * kv,
                "tied {tied}, {world} ranks"
            );
            for r in 0..world {
                let shard = plan.shard(c, w, r).unwrap();
                let rows = plan.vocab(c, r);
                assert_eq!(shard.embed.rows, rows.len());
                assert_eq!(
                    shard.lm_head.as_ref().map(|m| m.rows),
                    (!tied).then_some(rows.len())
                );
                let first = w.embed.row_range(rows.start..rows.start + 1).unwrap();
                let (got, want) = (shard.embed.data.as_slice(), first.data.as_slice());
                assert_eq!(&got[..want.len()], want);
            }
        }
    }
}

#[test]
fn replicated_kv_heads_give_the_same_logits() {
    // 8 ranks over 2 KV heads: each KV head is held by 4 ranks, each rank with one query head.
    let spec = spec();
    let (_dir, loaded, _) = load(&spec, DType::F32);
    let tokens = random_tokens(&spec, 30, 9);
    let whole = engine_logits(&cpu_model(&loaded), &tokens);
    let split = engine_logits(&cpu_model_split(&loaded, 8), &tokens);
    let d = max_rel_diff(&split, &whole);
    assert!(d < SPLIT_TOL, "tp 8: {d:e}");
}

/// Greedy completions of `prompts` with `eviction` on, and the keys each holds at the end.
fn evicting(
    model: Llama<CpuBackend>,
    loaded: &LoadedModel,
    prompts: &[Vec<u32>],
    eviction: KvEviction,
) -> Vec<(Vec<u32>, usize)> {
    let requests = prompts
        .iter()
        .map(|p| Request {
            max_tokens: 40,
            ignore_eos: true,
            kv_eviction: Some(eviction),
            ..Request::new(p.clone())
        })
        .collect();
    let (done, _) = run_together(model, &loaded.tokenizer, batch_config(), requests);
    done.into_iter()
        .map(|c| (c.token_ids, c.kv_tokens))
        .collect()
}

/// KV eviction on a split model: each rank scores, chooses and compacts its own KV heads. With
/// one rank per KV head group (no replicas) the scores of every (layer, KV head) are the whole
/// model's, so window, sink and H2O (per layer or shared across layers) keep the same keys and
/// generate the same tokens. Keyformer's noise is drawn per rank-local head index, so its draws
/// (and kept keys) differ from the whole model's: it must keep its budget.
#[test]
fn split_models_evict_as_the_whole_model_does() {
    use turbo_keyformer::SelectionMode;
    let spec = spec();
    let (_dir, loaded, _) = load(&spec, DType::F32);
    let prompts: Vec<Vec<u32>> = [60, 90, 45]
        .iter()
        .enumerate()
        .map(|(i, &n)| random_tokens(&spec, n, 200 + i as u64))
        .collect();
    let budget = BudgetConfig::new(BudgetSize::Tokens(24));
    for (kind, mode) in [
        (PolicyKind::Window, SelectionMode::PerLayer),
        (PolicyKind::Sink, SelectionMode::PerLayer),
        (PolicyKind::H2O, SelectionMode::PerLayer),
        (PolicyKind::H2O, SelectionMode::Shared),
        (PolicyKind::Keyformer, SelectionMode::PerLayer),
    ] {
        let eviction = KvEviction {
            mode,
            during_prefill: true,
            ..KvEviction::new(kind, budget)
        };
        let whole = evicting(cpu_model(&loaded), &loaded, &prompts, eviction);
        let split = evicting(cpu_model_split(&loaded, 2), &loaded, &prompts, eviction);
        for ((w, s), p) in whole.iter().zip(&split).zip(&prompts) {
            assert!(
                w.1 < p.len(),
                "{kind:?} {mode:?}: {} keys kept of {}",
                w.1,
                p.len()
            );
            assert_eq!(s.1, w.1, "{kind:?} {mode:?}: keys held at the end");
            if kind != PolicyKind::Keyformer {
                assert_eq!(s.0, w.0, "{kind:?} {mode:?}: tokens");
            }
        }
    }
    // KV heads held by 2 ranks each: each replica scores with its own query heads.
    let eviction = KvEviction::new(PolicyKind::H2O, budget);
    let whole = evicting(cpu_model(&loaded), &loaded, &prompts, eviction);
    let split = evicting(cpu_model_split(&loaded, 4), &loaded, &prompts, eviction);
    for (w, s) in whole.iter().zip(&split) {
        assert_eq!((s.0.len(), s.1), (w.0.len(), w.1));
    }
}
