//! KV eviction in the persistent batch, on the default model (SmolLM2-135M-Instruct): every
//! policy keeps its sequence within budget and gives blocks back, requests of different
//! policies share a batch, scoring alone changes nothing, teacher forcing reports the forced
//! tokens' log-probabilities, and bad settings fail with a clear error.

use turbo_core::cpu::CpuBackend;
use turbo_core::Backend;
use turbo_keyformer::{BudgetConfig, BudgetSize, PolicyKind};
use turbo_llama::{Llama, LoadedModel};
use turbo_scheduler::batch::Completion;
use turbo_scheduler::{
    BatchConfig, Event, KvEviction, PersistentBatch, Request, RequestError, RequestHandle,
};
use turbo_tests::default_model::load_default_model;

const BLOCK: usize = 16;

const TEXT: &str =
    "The lighthouse keeper had kept the same routine for thirty years. Every evening \
he climbed the hundred and twelve steps of the tower, trimmed the wick, polished the great lens \
until it shone like a second moon, and wrote the weather in a leather book whose pages had turned \
the colour of weak tea. The ships that passed did not know his name, and he did not know theirs, \
but he knew their lights: the ferry's green lamp at nine, the trawlers that came home in a ragged \
line before dawn, and once a year the tall ship from the naval school, lit from bow to stern like \
a festival. When the storm of that winter took the telegraph line, he kept the lamp burning for \
eleven nights on the oil he had saved, and on the twelfth morning a boy rowed out from the \
village with bread, a newspaper a week old, and the news that the lighthouse would be automated \
in the spring. He read the newspaper twice, folded it into the leather book, and climbed the \
stairs as he always had.";

fn batch(loaded: &LoadedModel) -> PersistentBatch<CpuBackend> {
    let config = BatchConfig {
        max_batch: 8,
        max_batched_tokens: 256,
        block_size: BLOCK,
        num_blocks: 256,
        prefill_chunk: 64,
        prefix_caching: true,
    };
    let model = Llama::new(CpuBackend::new(), &loaded.config, &loaded.weights).unwrap();
    PersistentBatch::new(model, loaded.tokenizer.clone(), config).unwrap()
}

fn evicting(prompt: &[u32], policy: PolicyKind, keep: usize) -> Request {
    Request {
        max_tokens: 40,
        ignore_eos: true,
        kv_eviction: Some(KvEviction::new(
            policy,
            BudgetConfig::new(BudgetSize::Tokens(keep)),
        )),
        ..Request::new(prompt.to_vec())
    }
}

fn finished(handle: &RequestHandle) -> Completion {
    match handle.drain().pop() {
        Some(Event::Finished(c)) => c,
        other => panic!("{}: ended with {other:?}", handle.id()),
    }
}

fn failed(handle: &RequestHandle) -> RequestError {
    match handle.drain().pop() {
        Some(Event::Failed(e)) => e,
        other => panic!("{}: ended with {other:?}", handle.id()),
    }
}

#[test]
fn every_policy_keeps_its_budget_and_gives_blocks_back_in_one_batch() {
    let loaded = load_default_model();
    let prompt = loaded.tokenizer.encode(TEXT).unwrap();
    assert!(prompt.len() > 200, "{} prompt tokens", prompt.len());
    let mut b = batch(&loaded);
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
        .map(|&p| b.submit(evicting(&prompt, p, keep)))
        .collect();
    b.run_until_idle().unwrap();
    let prompt_blocks = prompt.len().div_ceil(BLOCK);
    for (policy, h) in policies.iter().zip(&handles) {
        let c = finished(h);
        assert_eq!(c.token_ids.len(), 40, "{policy}");
        // The last generated token's KV is never computed.
        let tokens = prompt.len() + 39;
        if *policy == PolicyKind::Full {
            assert_eq!(c.kv_tokens, tokens);
            assert_eq!(c.kv_blocks, tokens.div_ceil(BLOCK));
        } else {
            assert!(
                (keep..keep + BLOCK).contains(&c.kv_tokens),
                "{policy}: {} keys for a budget of {keep}",
                c.kv_tokens
            );
            assert_eq!(c.kv_blocks, c.kv_tokens.div_ceil(BLOCK), "{policy}");
            assert!(
                c.kv_blocks_peak >= prompt_blocks,
                "{policy}: the prompt's peak"
            );
        }
    }
    // Everything went back: nothing used once the requests (without sessions) ended.
    assert_eq!(b.kv().num_used(), 0);
    b.kv().check().unwrap();
}

#[test]
fn scoring_without_eviction_changes_nothing_and_forced_tokens_are_scored() {
    let loaded = load_default_model();
    let prompt = loaded.tokenizer.encode(TEXT).unwrap();
    let mut b = batch(&loaded);
    let full = b.submit(Request {
        logprobs: Some(1),
        ..evicting(&prompt, PolicyKind::Full, 1)
    });
    b.run_until_idle().unwrap();
    let full_events = full.drain();
    // A budget above the sequence's length: scores accumulate, nothing is evicted.
    let big = b.submit(evicting(&prompt, PolicyKind::Keyformer, 10_000));
    b.run_until_idle().unwrap();
    let big = finished(&big);
    let full = match full_events.last() {
        Some(Event::Finished(c)) => c.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(big.token_ids, full.token_ids);
    assert_eq!(big.kv_tokens, full.kv_tokens);

    // Teacher forcing the full run's tokens reproduces its log-probabilities.
    let forced = b.submit(Request {
        logprobs: Some(1),
        forced_tokens: full.token_ids.iter().rev().copied().collect(),
        ..evicting(&prompt, PolicyKind::Window, 64)
    });
    b.run_until_idle().unwrap();
    let events = forced.drain();
    let c = match events.last() {
        Some(Event::Finished(c)) => c.clone(),
        other => panic!("{other:?}"),
    };
    let reversed: Vec<u32> = full.token_ids.iter().rev().copied().collect();
    assert_eq!(c.token_ids, reversed, "the forced tokens are the output");
    let logprobs: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Event::Logprobs(lp) => Some(lp.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(logprobs.len(), 40);
    for (lp, &t) in logprobs.iter().zip(&reversed) {
        assert_eq!(lp.token, t);
        assert!(lp.logprob <= 0.0 && lp.logprob.is_finite());
        assert!(
            lp.top[0].1 >= lp.logprob,
            "the top alternative is the greedy one"
        );
    }
    // The first forced token is predicted from the prompt alone, as in the full run.
    let first_full = full_events
        .iter()
        .find_map(|e| match e {
            Event::Logprobs(lp) => Some(lp.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        logprobs[0].top[0].0, first_full.token,
        "same greedy first token"
    );
}

#[test]
fn bad_settings_fail_with_a_clear_error() {
    let loaded = load_default_model();
    let prompt = loaded.tokenizer.encode(TEXT).unwrap();
    let mut b = batch(&loaded);
    let zero = b.submit(evicting(&prompt, PolicyKind::H2O, 0));
    let over = b.submit(Request {
        kv_eviction: Some(KvEviction::new(
            PolicyKind::Keyformer,
            BudgetConfig::new(BudgetSize::Fraction(1.5)),
        )),
        ..Request::new(prompt.clone())
    });
    for e in [failed(&zero), failed(&over)] {
        assert!(matches!(e, RequestError::Eviction(_)), "{e}");
    }
    // A prompt whose prefix is resident (shared, so never rewritten) beyond the budget reuses
    // only what the budget leaves room for, and recomputes the rest on blocks of its own.
    let plain = b.submit(Request {
        max_tokens: 1,
        ..Request::new(prompt.clone())
    });
    b.run_until_idle().unwrap();
    finished(&plain);
    let shared = b.submit(evicting(&prompt, PolicyKind::Keyformer, 64));
    b.run_until_idle().unwrap();
    let c = finished(&shared);
    assert!(c.cached_prompt_tokens > 0 && c.cached_prompt_tokens <= 64 - 19);
    assert!((64..64 + BLOCK).contains(&c.kv_tokens), "{}", c.kv_tokens);
    // The batch goes on.
    let after = b.submit(evicting(&prompt[50..], PolicyKind::Sink, 64));
    b.run_until_idle().unwrap();
    assert_eq!(finished(&after).token_ids.len(), 40);
    b.kv().check().unwrap();
}

#[test]
fn evicting_during_the_prompt_bounds_the_peak_by_budget_chunk_and_block() {
    let loaded = load_default_model();
    let prompt = loaded.tokenizer.encode(TEXT).unwrap();
    let mut b = batch(&loaded);
    let keep = 96;
    let chunk = 64; // `batch`'s prefill chunk
    let policies = [PolicyKind::Keyformer, PolicyKind::H2O, PolicyKind::Sink];
    let handles: Vec<_> = policies
        .iter()
        .map(|&p| {
            let mut r = evicting(&prompt, p, keep);
            if let Some(e) = r.kv_eviction.as_mut() {
                e.during_prefill = true;
            }
            b.submit(r)
        })
        .collect();
    b.run_until_idle().unwrap();
    let bound = (keep + BLOCK + chunk).div_ceil(BLOCK);
    for (policy, h) in policies.iter().zip(&handles) {
        let c = finished(h);
        assert_eq!(c.token_ids.len(), 40, "{policy}");
        assert!(
            (keep..keep + BLOCK).contains(&c.kv_tokens),
            "{policy}: {} keys for a budget of {keep}",
            c.kv_tokens
        );
        assert!(
            c.kv_blocks_peak <= bound && c.kv_blocks_peak < prompt.len().div_ceil(BLOCK),
            "{policy}: peak of {} blocks, bound {bound}, prompt {} blocks",
            c.kv_blocks_peak,
            prompt.len().div_ceil(BLOCK)
        );
    }
    assert_eq!(b.kv().num_used(), 0);
    b.kv().check().unwrap();
}

/// A sequence that evicts after reusing cached prompt blocks (its frozen prefix) never moves keys
/// into them, whatever its policy: a later request reusing the same blocks generates what it
/// generates alone.
#[test]
fn evicting_sequences_never_rewrite_a_shared_prefix() {
    let loaded = load_default_model();
    let prompt = loaded.tokenizer.encode(TEXT).unwrap();
    let plain = |max_tokens| Request {
        max_tokens,
        ignore_eos: true,
        ..Request::new(prompt.clone())
    };
    let alone = {
        let mut b = batch(&loaded);
        let h = b.submit(plain(8));
        b.run_until_idle().unwrap();
        finished(&h).token_ids
    };
    for policy in [
        PolicyKind::Window,
        PolicyKind::Sink,
        PolicyKind::Keyformer,
        PolicyKind::H2O,
    ] {
        let mut b = batch(&loaded);
        let first = b.submit(plain(1));
        b.run_until_idle().unwrap();
        finished(&first);
        // The same prompt and more: it reuses the cached blocks, then evicts down to 96 keys.
        let mut longer = prompt.clone();
        longer.extend_from_slice(&prompt[..40]);
        let h = b.submit(evicting(&longer, policy, 96));
        b.run_until_idle().unwrap();
        let c = finished(&h);
        assert!(c.cached_prompt_tokens >= BLOCK, "{policy:?}: {c:?}");
        assert!((96..96 + BLOCK).contains(&c.kv_tokens), "{policy:?}: {c:?}");
        let h = b.submit(plain(8));
        b.run_until_idle().unwrap();
        let again = finished(&h);
        assert!(again.cached_prompt_tokens >= BLOCK, "{policy:?}: {again:?}");
        assert_eq!(
            again.token_ids, alone,
            "{policy:?}: the shared prefix changed"
        );
    }
}

/// Evicting requests step overlapped between their compactions (their scores build up on the
/// device in step order, and the Keyformer temperature counts the token in flight), and give
/// exactly what they give one step at a time: the same tokens, the same keys and blocks held,
/// the same scores.
#[test]
fn evicting_requests_overlap_their_steps_and_generate_what_they_do_one_at_a_time() {
    let loaded = load_default_model();
    let prompt = loaded.tokenizer.encode(TEXT).unwrap();
    let run = |overlap: bool| {
        let mut b = batch(&loaded);
        b.set_overlap(overlap);
        let policies = [
            (PolicyKind::Keyformer, false),
            (PolicyKind::H2O, true),
            (PolicyKind::Window, false),
            (PolicyKind::Sink, true),
        ];
        let handles: Vec<_> = policies
            .iter()
            .enumerate()
            .map(|(i, &(p, during_prefill))| {
                let mut r = evicting(&prompt[..prompt.len() - 7 * i], p, 80 + 8 * i);
                if let Some(e) = r.kv_eviction.as_mut() {
                    e.during_prefill = during_prefill;
                }
                // A session keeps the KV, and its scores, for the comparison below.
                r.session = Some(format!("s{i}"));
                b.submit(r)
            })
            .collect();
        b.run_until_idle().unwrap();
        let done: Vec<_> = handles
            .iter()
            .map(|h| {
                let c = finished(h);
                (c.token_ids, c.kv_tokens, c.kv_blocks, c.kv_blocks_peak)
            })
            .collect();
        // Every kept key's score, bit for bit.
        let scores: Vec<Vec<u32>> = (0..done.len())
            .map(|i| {
                let seq = b.session_seq(&format!("s{i}")).expect("a resident session");
                let kv = b.kv();
                let (table, keys) = (kv.block_table(seq).unwrap(), kv.keys(seq).unwrap());
                let scores = b.model().backend().read_kv_scores(b.cache(), table, keys);
                scores.unwrap().iter().map(|s| s.to_bits()).collect()
            })
            .collect();
        b.kv().check().unwrap();
        (done, scores, b.stats())
    };
    let (alone, alone_scores, alone_stats) = run(false);
    let (overlapped, scores, stats) = run(true);
    assert_eq!(alone_stats.overlapped_steps, 0);
    assert!(
        stats.overlapped_steps * 2 > stats.steps,
        "{} of {} steps overlapped",
        stats.overlapped_steps,
        stats.steps
    );
    assert_eq!(overlapped, alone);
    assert_eq!(stats.compactions, alone_stats.compactions);
    // Window and sink keep no scores; Keyformer's and H2O's match.
    assert!(scores[0].len() > 1000 && scores[1].len() > 1000);
    assert!(
        scores == alone_scores,
        "scores differ between overlapped and alone"
    );
}
