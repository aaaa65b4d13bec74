//! The persistent batch on the GPU: greedy outputs of many concurrent requests of mixed lengths
//! equal those of each request run alone, token for token up to bf16 near ties, with a roomy KV
//! pool and with one so small that requests are preempted and recomputed; and the KV cache that
//! maps device memory as steps reach its blocks generates what one allocated up front does.

use turbo_core::cpu::KvCacheSpec;
use turbo_core::{Backend, BackendError, DType};
use turbo_kernels::CudaBackend;
use turbo_llama::{Llama, LoadedModel};
use turbo_scheduler::{
    BatchConfig, Completion, FinishReason, PersistentBatch, Request, RequestHandle,
};
use turbo_tests::engine::engine_logits;
use turbo_tests::files::write_gguf;
use turbo_tests::tiny::{random_tokens, TinySpec, TinyWeights};

/// Where a batched run leaves the alone run's greedy path, the alone run's logits there (scored
/// by one forward pass over its tokens) must have a top-2 gap below `NEAR_TIE * max(|top1|, 1)`,
/// and the token the batched run chose must be within that of the top. The GPU computes in bf16
/// (2^-9 relative rounding per stored activation), and a sequence's rows go through different
/// cuBLASLt algorithms and attention launches depending on the batch around them (how many rows,
/// decode or prefill path, how the prompt was chunked), so its logits differ between batch
/// compositions by bf16 rounding noise carried through 30 layers. The bound is the one that
/// `gpu_model.rs` uses for GPU against CPU, which covers that noise; a scheduling bug (a wrong KV
/// slot, a stale or foreign block, a token sampled from another sequence's row) picks a token
/// with no relation to the right logits, far below the top.
const NEAR_TIE: f32 = 0.05;

const BLOCK: usize = 16;

fn gpu() -> Option<CudaBackend> {
    if !turbo_kernels::cuda_available() {
        eprintln!("skipping: no CUDA device");
        return None;
    }
    Some(CudaBackend::new(0).expect("CUDA device 0"))
}

/// SmolLM2-135M's shape with random weights (F16, 30 layers, 9/3 heads, d 64, vocab 49152).
fn smollm2_shaped(dir: &tempfile::TempDir) -> (TinySpec, LoadedModel) {
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
    let path = dir.path().join("model.gguf");
    write_gguf(&path, &spec, &TinyWeights::random(&spec), DType::F16);
    (spec, LoadedModel::load(&path).expect("the model loads"))
}

fn request(prompt: &[u32]) -> Request {
    Request {
        max_tokens: 16,
        ignore_eos: true,
        ..Request::new(prompt.to_vec())
    }
}

fn finished(handle: RequestHandle, what: &str) -> Completion {
    let c = handle
        .wait()
        .unwrap_or_else(|e| panic!("{what} failed: {e}"));
    assert_eq!(c.finish_reason, FinishReason::Length, "{what}");
    assert_eq!(c.token_ids.len(), 16, "{what}");
    c
}

/// The steps `backend` recorded and replayed since it reported `before`.
fn graphs_since(
    backend: &CudaBackend,
    before: turbo_kernels::GraphStats,
) -> turbo_kernels::GraphStats {
    let after = backend.graph_stats();
    turbo_kernels::GraphStats {
        recorded: after.recorded - before.recorded,
        replayed: after.replayed - before.replayed,
    }
}

/// Panics unless `got` equals `alone` (greedy after `prompt`) or leaves it at a near tie; returns
/// whether they are equal.
fn same_greedy<B: Backend>(
    model: &Llama<B>,
    what: &str,
    prompt: &[u32],
    got: &[u32],
    alone: &[u32],
) -> bool {
    let m = got.iter().zip(alone).take_while(|(a, b)| a == b).count();
    if m == alone.len() {
        return true;
    }
    let mut seq = prompt.to_vec();
    seq.extend(&alone[..m]);
    let logits = engine_logits(model, &seq);
    let row = logits.last().expect("a non-empty sequence");
    let mut sorted = row.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let tolerance = NEAR_TIE * sorted[0].abs().max(1.0);
    let top2_gap = sorted[0] - sorted[1];
    let chosen_gap = sorted[0] - row[got[m] as usize];
    let detail = format!(
        "{what}: diverges at generated token {m}; alone run's top-2 gap there {top2_gap:.4}, the \
         batched token {} is {chosen_gap:.4} below the top (tolerance {tolerance:.4})\n  \
         batched {got:?}\n  alone   {alone:?}",
        got[m]
    );
    assert!(top2_gap < tolerance && chosen_gap < tolerance, "{detail}");
    eprintln!("accepted near tie: {detail}");
    false
}

#[test]
fn gpu_batched_greedy_generation_equals_generation_alone() {
    let Some(gpu) = gpu() else { return };
    batched_equals_alone(gpu);
}

/// The test's body, generic so that it can also be tried on the CPU backend.
fn batched_equals_alone<B: Backend>(backend: B) {
    let dir = tempfile::tempdir().unwrap();
    let (spec, loaded) = smollm2_shaped(&dir);
    // Mixed lengths, four sharing a 48-token prefix (shared KV blocks on the GPU).
    let mut prompts: Vec<Vec<u32>> = [5, 17, 40, 64, 100, 150, 300, 33, 80, 7, 200, 120]
        .iter()
        .enumerate()
        .map(|(i, &n)| random_tokens(&spec, n, 100 + i as u64))
        .collect();
    let prefix = random_tokens(&spec, 48, 1);
    for i in 0..4 {
        let mut p = prefix.clone();
        p.extend(random_tokens(&spec, 3 + 9 * i, 200 + i as u64));
        prompts.push(p);
    }

    // Alone: one request at a time, no KV reuse, the whole prompt in one pass.
    let model = Llama::new(backend, &loaded.config, &loaded.weights).unwrap();
    let alone_config = BatchConfig {
        max_batch: 1,
        max_batched_tokens: 512,
        block_size: BLOCK,
        num_blocks: 512 / BLOCK,
        prefill_chunk: 512,
        prefix_caching: false,
    };
    let mut batch = PersistentBatch::new(model, loaded.tokenizer.clone(), alone_config).unwrap();
    // The reference runs each step alone.
    batch.set_overlap(false);
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let h = batch.submit(request(p));
            batch.run_until_idle().unwrap();
            finished(h, &format!("request {i} alone")).token_ids
        })
        .collect();
    let mut parts = batch.into_parts();

    let longest = prompts.iter().map(Vec::len).max().unwrap() + 16;
    let runs_ahead = parts.0.backend().runs_ahead();
    for (name, num_blocks, overlap) in [
        ("roomy pool", 1024, true),
        ("roomy pool, steps one at a time", 1024, false),
        ("two-request pool", 2 * longest.div_ceil(BLOCK), true),
    ] {
        let config = BatchConfig {
            max_batch: 8,
            max_batched_tokens: 128,
            block_size: BLOCK,
            num_blocks,
            prefill_chunk: 64,
            prefix_caching: true,
        };
        let mut batch = PersistentBatch::new(parts.0, parts.1, config).unwrap();
        batch.set_overlap(overlap && runs_ahead);
        let handles: Vec<RequestHandle> =
            prompts.iter().map(|p| batch.submit(request(p))).collect();
        let mut mixed = 0;
        while !batch.is_idle() {
            let report = batch.step().unwrap();
            mixed += (report.decode_sequences > 0 && report.prefill_tokens > 0) as usize;
            batch.kv().check().unwrap();
        }
        let stats = batch.stats();
        let mut matched = 0;
        for (i, h) in handles.into_iter().enumerate() {
            let what = format!("{name}, request {i} ({} prompt tokens)", prompts[i].len());
            let got = finished(h, &what);
            matched +=
                same_greedy(batch.model(), &what, &prompts[i], &got.token_ids, &alone[i]) as usize;
        }
        eprintln!(
            "{name} ({num_blocks} blocks): {matched}/{} requests equal their alone runs token \
             for token; {mixed} steps mixed prefill and decode, {} preemptions, {} of {} steps \
             overlapped",
            prompts.len(),
            stats.preemptions,
            stats.overlapped_steps,
            stats.steps,
        );
        if !(overlap && runs_ahead) {
            assert_eq!(stats.overlapped_steps, 0, "{name}");
        } else if num_blocks == 1024 {
            // (A tight pool reads the step in flight back before steps that might preempt.)
            assert!(
                stats.overlapped_steps * 2 > stats.steps,
                "{name}: {} of {} steps overlapped",
                stats.overlapped_steps,
                stats.steps
            );
        }
        assert!(
            mixed > 0,
            "{name}: no step mixed chunked prefill with decode"
        );
        if num_blocks < 1024 {
            assert!(
                stats.preemptions > 0,
                "{name}: the pool should force preemption"
            );
        }
        assert_eq!(stats.kv_blocks_used, 0, "{name}: blocks left held");
        parts = batch.into_parts();
    }
}

/// Decode steps replayed from CUDA graphs (padded to a recorded batch size, attention split into
/// a fixed number of key ranges) generate what steps launched kernel by kernel generate: greedy
/// tokens equal up to bf16 near ties. Sampled runs (top-k, top-p, a repetition penalty) draw the
/// same uniform numbers in both, so their first tokens (from prefill steps, never replayed) are
/// equal; later ones may part where bf16 noise moves a boundary of the draw, so they are counted.
#[test]
fn gpu_graph_replay_equals_direct_launches() {
    let Some(gpu) = gpu() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (spec, loaded) = smollm2_shaped(&dir);
    // 11 requests (padded to 16 rows), lengths crossing the split choices.
    let prompts: Vec<Vec<u32>> = [3, 9, 30, 61, 120, 200, 260, 15, 44, 90, 7]
        .iter()
        .enumerate()
        .map(|(i, &n)| random_tokens(&spec, n, 300 + i as u64))
        .collect();
    let config = BatchConfig {
        max_batch: 16,
        max_batched_tokens: 512,
        block_size: BLOCK,
        num_blocks: 1024,
        prefill_chunk: 512,
        prefix_caching: false,
    };
    let sampled = |p: &[u32], i: usize| Request {
        sampling: turbo_scheduler::SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            repetition_penalty: 1.1,
            seed: 17 + i as u64,
            ..Default::default()
        },
        ..request(p)
    };
    let run = |graphs: bool| -> (Vec<Vec<u32>>, Vec<Vec<u32>>, turbo_kernels::GraphStats) {
        let backend = gpu.clone();
        backend.set_graphs(graphs);
        let before = backend.graph_stats();
        let model = Llama::new(backend.clone(), &loaded.config, &loaded.weights).unwrap();
        let mut batch =
            PersistentBatch::new(model, loaded.tokenizer.clone(), config.clone()).unwrap();
        let mut outputs = Vec::new();
        for sample in [false, true] {
            let handles: Vec<RequestHandle> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| batch.submit(if sample { sampled(p, i) } else { request(p) }))
                .collect();
            batch.run_until_idle().unwrap();
            outputs.push(
                handles
                    .into_iter()
                    .enumerate()
                    .map(|(i, h)| finished(h, &format!("request {i}")).token_ids)
                    .collect::<Vec<_>>(),
            );
        }
        let stats = graphs_since(&backend, before);
        let sampled_out = outputs.pop().unwrap();
        (outputs.pop().unwrap(), sampled_out, stats)
    };
    let (direct, direct_sampled, none) = run(false);
    assert_eq!(none, turbo_kernels::GraphStats::default());
    let (replayed, replayed_sampled, stats) = run(true);
    eprintln!("graphs: {stats:?}");
    assert!(
        stats.recorded > 0 && stats.replayed > 10 * stats.recorded,
        "decode steps should mostly replay graphs: {stats:?}"
    );
    let model = Llama::new(gpu.clone(), &loaded.config, &loaded.weights).unwrap();
    let mut equal = 0;
    for (i, p) in prompts.iter().enumerate() {
        let what = format!("request {i} ({} prompt tokens), greedy", p.len());
        equal += same_greedy(&model, &what, p, &replayed[i], &direct[i]) as usize;
        assert_eq!(
            replayed_sampled[i][0], direct_sampled[i][0],
            "request {i}: the first sampled token differs"
        );
    }
    let sampled_equal = (0..prompts.len())
        .filter(|&i| replayed_sampled[i] == direct_sampled[i])
        .count();
    eprintln!(
        "{equal}/{n} greedy and {sampled_equal}/{n} sampled outputs equal token for token",
        n = prompts.len()
    );
    assert!(
        equal * 2 > prompts.len(),
        "most outputs should be identical"
    );
}

/// 16 KV heads of 128 (4 KiB of keys per token and layer, 64 KiB per block of 16), so that the
/// driver's 2 MiB mapping granule holds few blocks and a short run grows the cache many times.
fn wide_kv(dir: &tempfile::TempDir) -> (TinySpec, LoadedModel) {
    let spec = TinySpec {
        vocab: 1024,
        hidden: 2048,
        layers: 2,
        heads: 16,
        kv_heads: 16,
        ffn: 2048,
        rope_theta: 10000.0,
        context: 1024,
        tied: true,
        seed: 11,
        ..Default::default()
    };
    let path = dir.path().join("wide-kv.gguf");
    write_gguf(&path, &spec, &TinyWeights::random(&spec), DType::F16);
    (spec, LoadedModel::load(&path).expect("the model loads"))
}

/// A KV cache that maps device memory a few blocks at a time as steps reach them generates what
/// one allocated up front generates, token for token: the same kernels run on the same values
/// at other addresses. The cache grows many times, also between replays of recorded decode steps
/// (whose recordings hold the cache's addresses), and never past its blocks.
#[test]
fn gpu_kv_cache_mapped_on_demand_equals_allocated_up_front() {
    let Some(gpu) = gpu() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (spec, loaded) = wide_kv(&dir);
    // 12 requests, 8 at a time: a first wave of 8, then 4 more.
    let prompts: Vec<Vec<u32>> = [5, 60, 17, 33, 48, 9, 26, 40, 12, 70, 3, 21]
        .iter()
        .enumerate()
        .map(|(i, &n)| random_tokens(&spec, n, 500 + i as u64))
        .collect();
    let config = BatchConfig {
        max_batch: 8,
        max_batched_tokens: 512,
        block_size: BLOCK,
        num_blocks: 1024,
        prefill_chunk: 512,
        prefix_caching: true,
    };

    /// Runs every prompt for `max_tokens` greedy tokens; returns the tokens, the mapped block
    /// counts the cache went through, and how many growths happened in steps that replayed a
    /// recorded decode step.
    fn run(
        gpu: &CudaBackend,
        batch: &mut PersistentBatch<CudaBackend>,
        prompts: &[Vec<u32>],
        max_tokens: usize,
    ) -> (Vec<Vec<u32>>, Vec<usize>, usize) {
        let handles: Vec<RequestHandle> = prompts
            .iter()
            .map(|p| {
                batch.submit(Request {
                    max_tokens,
                    ignore_eos: true,
                    ..Request::new(p.clone())
                })
            })
            .collect();
        let mut mapped = vec![batch.cache().mapped_blocks()];
        let mut replayed_growths = 0;
        while !batch.is_idle() {
            let replayed = gpu.graph_stats().replayed;
            let report = batch.step().unwrap();
            let now = batch.cache().mapped_blocks();
            if now != *mapped.last().unwrap() {
                mapped.push(now);
                replayed_growths +=
                    (report.prefill_tokens == 0 && gpu.graph_stats().replayed > replayed) as usize;
            }
        }
        let tokens = handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| {
                let c = h
                    .wait()
                    .unwrap_or_else(|e| panic!("request {i} failed: {e}"));
                assert_eq!(c.finish_reason, FinishReason::Length, "request {i}");
                assert_eq!(c.token_ids.len(), max_tokens, "request {i}");
                c.token_ids
            })
            .collect();
        (tokens, mapped, replayed_growths)
    }

    // bf16, and an INT8 cache (blocks of codes and scales, sized in bytes, mapped the same way).
    for dtype in [turbo_core::KvDtype::Full, turbo_core::KvDtype::Int8] {
        // On demand first: its chunk (4 blocks, rounded up to the driver's granularity) sets how
        // long the requests decode. Eight sequences fill a block every BLOCK / 8 decode steps
        // between them; decode long enough to cross four chunks in the first wave alone.
        gpu.set_kv_chunk_blocks(Some(4));
        let mut model = Llama::new(gpu.clone(), &loaded.config, &loaded.weights).unwrap();
        model.set_kv_dtype(dtype);
        let mut batch =
            PersistentBatch::new(model, loaded.tokenizer.clone(), config.clone()).unwrap();
        assert!(batch.cache().grows());
        assert_eq!(
            batch.cache().mapped_blocks(),
            0,
            "nothing is mapped before a step"
        );
        let chunk = batch
            .cache()
            .chunk_blocks()
            .expect("a growing cache has a chunk");
        let longest = prompts.iter().map(Vec::len).max().unwrap();
        let max_tokens = (4 * chunk * BLOCK / 8).min(spec.context - longest);
        let (grown, mapped, replayed_growths) = run(&gpu, &mut batch, &prompts, max_tokens);
        let stats = batch.stats();
        let last = *mapped.last().unwrap();
        let growths = mapped.len() - 1;
        eprintln!(
            "{dtype} on demand: chunks of {chunk} blocks, {max_tokens} tokens per request; mapped blocks \
             {mapped:?} of {} ({growths} growths, {replayed_growths} in steps replaying a recorded \
             decode step)",
            config.num_blocks
        );
        assert!(
            mapped.windows(2).all(|w| w[0] < w[1]),
            "the mapped blocks only grow: {mapped:?}"
        );
        assert!(growths >= 4, "the cache should grow many times: {mapped:?}");
        assert!(
            growths <= last.div_ceil(chunk),
            "each growth maps at least a chunk: {mapped:?}"
        );
        assert!(
            replayed_growths > 0,
            "the cache should grow between replays of recorded decode steps"
        );
        assert!(
            last <= config.num_blocks,
            "mapped past the cache: {mapped:?}"
        );
        assert!(
            last < config.num_blocks,
            "the run should not need the whole cache: {mapped:?}"
        );
        let touched = stats.kv_blocks_total - stats.kv_blocks_free;
        assert!(
            last >= touched,
            "{touched} blocks were handed out, {last} mapped"
        );

        // The same requests on a cache allocated up front.
        let (model, tokenizer) = batch.into_parts();
        gpu.set_kv_chunk_blocks(None);
        let mut batch = PersistentBatch::new(model, tokenizer, config.clone()).unwrap();
        assert!(!batch.cache().grows());
        assert_eq!(batch.cache().mapped_blocks(), config.num_blocks);
        let (allocated, mapped, _) = run(&gpu, &mut batch, &prompts, max_tokens);
        assert_eq!(mapped, [config.num_blocks]);
        for (i, (a, b)) in grown.iter().zip(&allocated).enumerate() {
            assert_eq!(
                a, b,
                "{dtype} request {i}: mapped on demand and allocated up front generate differently"
            );
        }
        eprintln!(
            "{dtype}: {n}/{n} requests generate the same {max_tokens} tokens on both caches",
            n = prompts.len()
        );
    }
}

/// Mapping past the device's memory is an out-of-memory error, not a panic or a broken cache:
/// the blocks mapped before stay usable, the cache grows again within memory, and dropping it
/// gives every byte back.
#[test]
fn gpu_kv_cache_growth_past_device_memory_fails_cleanly() {
    let Some(gpu) = gpu() else { return };
    let free_before = gpu.free_memory().expect("free device memory");
    // One layer whose keys and values would each take 60% of the free memory.
    let (heads, dim) = (8, 128);
    let block_bytes = BLOCK * heads * dim * 2;
    let spec = KvCacheSpec {
        n_layers: 1,
        n_kv_heads: heads,
        head_dim: dim,
        block_size: BLOCK,
        max_blocks: free_before / 10 * 6 / block_bytes,
        dtype: turbo_core::KvDtype::Full,
    };
    gpu.set_kv_chunk_blocks(Some(4));
    let cache = gpu
        .kv_cache(spec)
        .expect("reserving addresses takes no memory");
    assert!(cache.grows());
    let chunk = cache.chunk_blocks().unwrap();
    cache.map_blocks(1).unwrap();
    assert_eq!(cache.mapped_blocks(), chunk);
    let err = cache
        .map_blocks(spec.max_blocks)
        .expect_err("keys and values together do not fit");
    eprintln!("mapping {} blocks: {err}", spec.max_blocks);
    assert!(
        matches!(err, BackendError::OutOfMemory(_)),
        "expected out of memory, got {err:?}"
    );
    assert_eq!(
        cache.mapped_blocks(),
        chunk,
        "a failed growth leaves the mapped blocks as they were"
    );
    cache.map_blocks(chunk + 1).unwrap();
    assert_eq!(cache.mapped_blocks(), 2 * chunk);
    // The keys were mapped in full before the values ran out: all of that comes back. (Other
    // tests may allocate meanwhile, hence the margin.)
    let held = gpu.free_memory().expect("free device memory");
    drop(cache);
    gpu.set_kv_chunk_blocks(None);
    let free_after = gpu.free_memory().expect("free device memory");
    let keys_bytes = spec.max_blocks * block_bytes;
    eprintln!(
        "free device memory: {free_before} bytes before, {held} holding the cache, {free_after} \
         after dropping it"
    );
    assert!(
        free_after >= held + keys_bytes / 2,
        "dropping the cache should give its memory back"
    );
    let t = gpu.upload(&[1.0, 2.0], 1, 2).unwrap();
    assert_eq!(
        gpu.download(&t).unwrap(),
        [1.0, 2.0],
        "the device still works"
    );
}

/// KV eviction on the GPU through the persistent batch: requests of every policy share one batch,
/// each evicting sequence ends within its budget (plus less than a block) holding only the blocks
/// its keys need, the scored policies (Keyformer, H2O) score on the device, and every block goes
/// back when they end.
#[test]
fn gpu_every_eviction_policy_keeps_its_budget_in_one_batch() {
    use turbo_keyformer::{BudgetConfig, BudgetSize, PolicyKind};
    use turbo_scheduler::KvEviction;
    let Some(gpu) = gpu() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (spec, loaded) = smollm2_shaped(&dir);
    let model = Llama::new(gpu, &loaded.config, &loaded.weights).unwrap();
    let config = BatchConfig {
        max_batch: 8,
        max_batched_tokens: 256,
        block_size: BLOCK,
        num_blocks: 256,
        prefill_chunk: 64,
        prefix_caching: true,
    };
    let mut b = PersistentBatch::new(model, loaded.tokenizer.clone(), config).unwrap();
    let prompt = random_tokens(&spec, 300, 21);
    let keep = 96;
    let policies = [
        PolicyKind::Keyformer,
        PolicyKind::H2O,
        PolicyKind::Window,
        PolicyKind::Sink,
        PolicyKind::Full,
    ];
    let handles: Vec<_> = policies
        .iter()
        .map(|&p| {
            b.submit(Request {
                kv_eviction: Some(KvEviction::new(
                    p,
                    BudgetConfig::new(BudgetSize::Tokens(keep)),
                )),
                ..request(&prompt)
            })
        })
        .collect();
    b.run_until_idle().unwrap();
    for (policy, h) in policies.iter().zip(handles) {
        let c = finished(h, &policy.to_string());
        let tokens = prompt.len() + 15;
        if *policy == PolicyKind::Full {
            assert_eq!(c.kv_tokens, tokens);
        } else {
            assert!(
                (keep..keep + BLOCK).contains(&c.kv_tokens),
                "{policy}: {} keys for a budget of {keep}",
                c.kv_tokens
            );
            assert_eq!(c.kv_blocks, c.kv_tokens.div_ceil(BLOCK), "{policy}");
        }
    }
    assert_eq!(b.kv().num_used(), 0);
    b.kv().check().unwrap();
}

/// Decode steps that score keys for KV eviction (Keyformer, H2O) are recorded and replayed as CUDA
/// graphs too (their attention writes the rows' logits under a fixed key split, and the scoring
/// kernels' launch shapes follow the padded rows alone), and choose what steps launched kernel by
/// kernel choose: with a budget of 48 keys over 64 generated tokens, each sequence compacts at
/// every block from decode scores, so a replay that scored stale or foreign keys would keep other
/// keys and part from the direct run's tokens. Both runs hold the same keys at the end; greedy
/// outputs are equal for most requests (bf16 noise between the fixed split and the direct plan
/// may move a near tie of the scores, and then the rest).
#[test]
fn gpu_scored_decode_steps_replay_as_launched() {
    use turbo_keyformer::{BudgetConfig, BudgetSize, PolicyKind};
    use turbo_scheduler::KvEviction;
    let Some(gpu) = gpu() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (spec, loaded) = smollm2_shaped(&dir);
    let prompts: Vec<Vec<u32>> = [40, 70, 130, 250, 95, 33]
        .iter()
        .enumerate()
        .map(|(i, &n)| random_tokens(&spec, n, 900 + i as u64))
        .collect();
    let policies = [PolicyKind::Keyformer, PolicyKind::H2O];
    let config = BatchConfig {
        max_batch: 16,
        max_batched_tokens: 512,
        block_size: BLOCK,
        num_blocks: 512,
        prefill_chunk: 512,
        prefix_caching: false,
    };
    let run = |graphs: bool| -> (Vec<(Vec<u32>, usize)>, turbo_kernels::GraphStats) {
        let backend = gpu.clone();
        backend.set_graphs(graphs);
        let before = backend.graph_stats();
        let model = Llama::new(backend.clone(), &loaded.config, &loaded.weights).unwrap();
        let mut batch =
            PersistentBatch::new(model, loaded.tokenizer.clone(), config.clone()).unwrap();
        let handles: Vec<RequestHandle> = policies
            .iter()
            .flat_map(|&policy| prompts.iter().map(move |p| (policy, p)))
            .map(|(policy, p)| {
                batch.submit(Request {
                    max_tokens: 64,
                    kv_eviction: Some(KvEviction::new(
                        policy,
                        BudgetConfig::new(BudgetSize::Tokens(48)),
                    )),
                    ..request(p)
                })
            })
            .collect();
        batch.run_until_idle().unwrap();
        let out = handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| {
                let c = h
                    .wait()
                    .unwrap_or_else(|e| panic!("request {i} failed: {e}"));
                assert_eq!(c.token_ids.len(), 64, "request {i}");
                (c.token_ids, c.kv_tokens)
            })
            .collect();
        assert_eq!(batch.kv().num_used(), 0);
        let stats = graphs_since(&backend, before);
        (out, stats)
    };
    let (direct, none) = run(false);
    assert_eq!(none, turbo_kernels::GraphStats::default());
    let (replayed, stats) = run(true);
    eprintln!("graphs of scored steps: {stats:?}");
    assert!(
        stats.recorded > 0 && stats.replayed > 10 * stats.recorded,
        "scored decode steps should mostly replay graphs: {stats:?}"
    );
    let mut equal = 0;
    for (i, ((d, dk), (r, rk))) in direct.iter().zip(&replayed).enumerate() {
        assert_eq!(dk, rk, "request {i}: keys held at the end");
        assert!((48..48 + BLOCK).contains(dk), "request {i}: {dk} keys");
        equal += (d == r) as usize;
    }
    eprintln!("{equal}/{} outputs equal token for token", direct.len());
    assert!(
        equal * 3 >= direct.len() * 2,
        "most scored outputs should be identical: {equal}/{}",
        direct.len()
    );
}
