//! The persistent batch on the CPU backend: batched greedy generation equals generation alone
//! (also under preemption), sessions keep and lose their KV as they should, and a stress run of
//! random requests on a tiny model ends every request exactly once and leaves the KV cache clean.
//!
//! The real-model tests use the default model (SmolLM2-135M-Instruct), fetched on first use by
//! `turbo_models::DEFAULT_MODEL.ensure`; when that fails the tests fail.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::time::Instant;
use turbo_core::cpu::CpuBackend;
use turbo_core::Backend;
use turbo_kv::SeqState;
use turbo_llama::{Llama, LoadedModel, Logits, SequenceChunk};
use turbo_scheduler::batch::Completion;
use turbo_scheduler::{
    BatchConfig, Event, FinishReason, PersistentBatch, Request, RequestError, RequestHandle,
    SamplingParams,
};
use turbo_tests::alone::Alone;
use turbo_tests::default_model::{load_default_model, model_chat_template};
use turbo_tests::{random_tokens, write_gguf, DType, TinySpec, TinyWeights};
use turbo_tokenizer::chat::{ChatMessage, ChatTemplate};

/// A divergence between two greedy runs is accepted only where the reference run's top-2 logit
/// gap is below this. The f32 forward pass is not bitwise batch-invariant: a sequence's rows go
/// through GEMV or GEMM depending on how many rows the batch has, prefill is chunked differently,
/// and KV reused from other sequences was computed in other batch compositions, so logits differ
/// at ~1e-6 between runs. That can flip an argmax only at a near tie; a scheduling bug (a wrong
/// KV slot, a stale block, a token sampled from the wrong row) moves logits by far more than 1e-3.
const NEAR_TIE: f32 = 1e-3;

/// [`NEAR_TIE`] for a quantized KV cache: a key or value computed in another batch composition
/// (1e-6 apart in f32) may round to the neighbouring 8-bit code, which moves logits by a share of
/// a quantization step (measured: 0.088 with FP8 on a reused prefix) rather than by 1e-6.
const QUANT_NEAR_TIE: f32 = 0.25;

const BLOCK: usize = 16;

// ---------------------------------------------------------------------------------------------
// Shared helpers.

/// The completion of a request that ended, after checking its events for consistency: exactly
/// one terminal event, last, and it is `Finished`; the streamed tokens and text equal the
/// completion's (so nothing was streamed twice, e.g. after a preemption).
fn check_events(what: &str, events: &[Event]) -> Completion {
    let terminal = events.iter().filter(|e| e.is_terminal()).count();
    assert_eq!(
        terminal, 1,
        "{what}: {terminal} terminal events in {events:?}"
    );
    assert!(
        events.last().unwrap().is_terminal(),
        "{what}: events after the end"
    );
    let (mut tokens, mut text) = (Vec::new(), String::new());
    let mut logprobs: Option<u32> = None;
    for e in events {
        if let Some(want) = logprobs.take() {
            assert!(
                matches!(e, Event::Token(t) if *t == want),
                "{what}: log-probabilities of {want} followed by {e:?}"
            );
        }
        match e {
            Event::Logprobs(lp) => {
                assert!(lp.logprob <= 0.0, "{what}: {lp:?}");
                assert!(
                    lp.top.windows(2).all(|w| w[0].1 >= w[1].1),
                    "{what}: {lp:?}"
                );
                logprobs = Some(lp.token);
            }
            Event::Token(t) => tokens.push(*t),
            Event::Text(t) => text.push_str(t),
            Event::Finished(c) => {
                assert_eq!(tokens, c.token_ids, "{what}: streamed tokens");
                assert_eq!(text, c.text, "{what}: streamed text");
                return c.clone();
            }
            Event::Failed(e) => panic!("{what} failed: {e}"),
        }
    }
    unreachable!("a terminal event was counted")
}

/// [`check_events`] on everything `handle` has received.
fn outcome(handle: &RequestHandle) -> Completion {
    check_events(&handle.id().to_string(), &handle.drain())
}

/// Runs `prompt` (then `tokens`) through `model` from an empty cache; the top-2 logit gap after
/// each of `tokens`' positions: `gaps[m]` is the gap where `tokens[m]` was chosen.
fn top2_gaps<B: Backend>(model: &Llama<B>, prompt: &[u32], tokens: &[u32]) -> Vec<f32> {
    let mut all = prompt.to_vec();
    all.extend_from_slice(&tokens[..tokens.len().saturating_sub(1)]);
    let blocks = all.len().div_ceil(BLOCK);
    let mut cache = model
        .backend()
        .kv_cache(model.kv_spec(BLOCK, blocks))
        .unwrap();
    let chunk = SequenceChunk {
        tokens: all.clone(),
        start: 0,
        position: 0,
        block_table: (0..blocks as u32).collect(),
        scoring: None,
    };
    let logits = model.forward(&[chunk], &mut cache, Logits::All).unwrap();
    let vocab = model.config.vocab_size;
    logits
        .chunks_exact(vocab)
        .skip(prompt.len() - 1)
        .map(|row| {
            let mut sorted = row.to_vec();
            sorted.sort_unstable_by(|a, b| b.total_cmp(a));
            sorted[0] - sorted[1]
        })
        .collect()
}

/// Whether greedy `got` equals `expected` (after `prompt`) token for token; a divergence is
/// accepted (returning false) only at a near tie of the expected run, scored by `model`.
fn same_greedy<B: Backend>(
    model: &Llama<B>,
    what: &str,
    prompt: &[u32],
    got: &Completion,
    expected: &Completion,
) -> bool {
    same_greedy_within(model, what, prompt, got, expected, NEAR_TIE)
}

/// [`same_greedy`] with near ties below `near_tie`.
fn same_greedy_within<B: Backend>(
    model: &Llama<B>,
    what: &str,
    prompt: &[u32],
    got: &Completion,
    expected: &Completion,
    near_tie: f32,
) -> bool {
    if got.token_ids == expected.token_ids {
        assert_eq!(got.finish_reason, expected.finish_reason, "{what}");
        assert_eq!(got.text, expected.text, "{what}: same tokens, other text");
        return true;
    }
    let m = got
        .token_ids
        .iter()
        .zip(&expected.token_ids)
        .take_while(|(a, b)| a == b)
        .count();
    let gaps = top2_gaps(model, prompt, &expected.token_ids);
    let gap = gaps.get(m).copied().unwrap_or(f32::INFINITY);
    let detail = format!(
        "{what}: diverges at generated position {m} (reference top-2 gap there {gap:.2e})\n  \
         got      {:?} {:?}\n  expected {:?} {:?}",
        got.token_ids, got.text, expected.token_ids, expected.text
    );
    assert!(gap < near_tie, "{detail}");
    println!("accepted near tie: {detail}");
    false
}

// ---------------------------------------------------------------------------------------------
// The default model.

fn cpu_model(loaded: &LoadedModel) -> Llama<CpuBackend> {
    Llama::new(CpuBackend::new(), &loaded.config, &loaded.weights).unwrap()
}

fn chat_prompt(
    loaded: &LoadedModel,
    template: &ChatTemplate,
    messages: &[ChatMessage],
) -> Vec<u32> {
    let text = template.render(messages, true).unwrap();
    loaded.tokenizer.encode(&text).unwrap()
}

/// Prose to cut prompts from.
const TEXT: &str = "The lighthouse keeper had kept the same routine for thirty years. Every evening \
he climbed the hundred and twelve steps of the tower, trimmed the wick, polished the great lens \
until it shone like a second moon, and wrote the weather in a leather book whose pages had turned \
the colour of weak tea. The ships that passed did not know his name, and he did not know theirs, \
but he liked to imagine the sailors looking up from the dark water and feeling, for a moment, that \
someone was watching over them. In the spring the gulls returned to the cliffs and argued loudly \
about everything. In the summer children from the village rowed out to the island and asked him \
whether he was lonely, and he told them that a man with a lamp, a library and a sea to look after \
is never lonely, only busy in a quiet way. Autumn brought storms that rattled the windows and sent \
spray higher than the gallery rail, and on those nights he did not sleep at all, but sat beside the \
lamp with a pot of coffee and a book of old sea charts, tracing the coastlines with his finger. \
Winter was the hardest season. The supply boat came only twice a month, the days were short, and \
the cold found its way through every crack in the stone. Yet even then he kept the light burning, \
because a light that burns only in good weather is not a light at all. When the engineers from the \
mainland finally came to install an automatic lamp, they found him polite but puzzled. They showed \
him the sensors, the batteries and the little computer that would switch the beam on at dusk and \
off at dawn without any help. He listened carefully, asked sensible questions about the fuses, and \
then asked whether the machine would also write down the weather. The engineers laughed and said \
that it would send the readings to a server far away, where nobody would ever read them. He \
nodded slowly, thanked them, and the next morning he began to teach the youngest engineer how to \
read the clouds, just in case the server ever needed a second opinion.";

/// Batched greedy generation equals generation alone: twelve requests of 5 to 300 prompt tokens
/// (slices of one text, several sharing a prefix, and chat prompts), run with 8 slots and a
/// budget that forces chunked prefill mixed with decode; then again with a KV pool of about two
/// requests' worth, so that requests are preempted and recomputed.
#[test]
fn batched_greedy_generation_equals_generation_alone() {
    let loaded = load_default_model();
    let template = model_chat_template(&loaded);
    let text = loaded.tokenizer.encode(TEXT).unwrap();
    assert!(text.len() >= 400, "the text has only {} tokens", text.len());
    let mut prompts: Vec<Vec<u32>> = [
        (0, 5),
        (0, 40),
        (10, 17),
        (0, 300),
        (50, 120),
        (100, 64),
        (0, 150),
        (200, 90),
    ]
    .iter()
    .map(|&(at, len)| text[at..at + len].to_vec())
    .collect();
    for question in [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in one sentence why the sky is blue.",
        "List three prime numbers.",
    ] {
        prompts.push(chat_prompt(
            &loaded,
            &template,
            &[ChatMessage::new("user", question)],
        ));
    }
    let request = |prompt: &[u32]| Request {
        max_tokens: 24,
        ..Request::new(prompt.to_vec())
    };

    let started = Instant::now();
    let mut alone = Alone::new(cpu_model(&loaded), loaded.tokenizer.clone(), BLOCK);
    let expected: Vec<Completion> = prompts.iter().map(|p| alone.run(request(p))).collect();
    let alone_s = started.elapsed().as_secs_f64();
    let longest = prompts.iter().map(Vec::len).max().unwrap() + 24;

    for (name, num_blocks) in [
        ("roomy pool", 512),
        ("two-request pool", 2 * longest.div_ceil(BLOCK)),
    ] {
        let config = BatchConfig {
            max_batch: 8,
            max_batched_tokens: 64,
            block_size: BLOCK,
            num_blocks,
            prefill_chunk: 32,
            prefix_caching: true,
        };
        let mut batch =
            PersistentBatch::new(cpu_model(&loaded), loaded.tokenizer.clone(), config).unwrap();
        let started = Instant::now();
        let handles: Vec<RequestHandle> =
            prompts.iter().map(|p| batch.submit(request(p))).collect();
        let (mut steps, mut mixed, mut max_running) = (0, 0, 0);
        while !batch.is_idle() {
            let report = batch.step().unwrap();
            steps += 1;
            if report.decode_sequences > 0 && report.prefill_tokens > 0 {
                mixed += 1;
            }
            assert!(report.tokens <= 64, "over the token budget: {report:?}");
            max_running = max_running.max(batch.stats().running);
            batch.kv().check().unwrap();
        }
        let elapsed = started.elapsed().as_secs_f64();
        let stats = batch.stats();
        let mut matched = 0;
        for (i, (h, want)) in handles.iter().zip(&expected).enumerate() {
            let got = outcome(h);
            assert_eq!(
                got.prefilled_tokens + got.cached_prompt_tokens,
                prompts[i].len()
            );
            let what = format!("{name}, request {i} ({} prompt tokens)", prompts[i].len());
            matched += same_greedy(batch.model(), &what, &prompts[i], &got, want) as usize;
        }
        println!(
            "{name} ({num_blocks} blocks): {matched}/{} requests match the alone runs token for \
             token; {steps} steps ({mixed} mixing prefill and decode), up to {max_running} \
             running, {} preemptions, {} tokens run; {elapsed:.1} s batched vs {alone_s:.1} s alone",
            prompts.len(),
            stats.preemptions,
            stats.tokens_run,
        );
        assert!(mixed > 0, "no step mixed chunked prefill with decode");
        assert_eq!(max_running, 8, "the batch never filled its slots");
        if num_blocks < 512 {
            assert!(
                stats.preemptions > 0,
                "the small pool should force preemption"
            );
        }
        assert_eq!(
            stats.kv_blocks_used, 0,
            "requests without a session free their blocks"
        );
    }
}

/// A session's second turn prefills only its new tokens; after the session is evicted (other
/// requests need every block) its next turn is recomputed and continues as if it had stayed.
#[test]
fn sessions_keep_their_kv_until_evicted() {
    let loaded = load_default_model();
    let template = model_chat_template(&loaded);
    let num_blocks = 24;
    let config = BatchConfig {
        max_batch: 4,
        max_batched_tokens: 256,
        block_size: BLOCK,
        num_blocks,
        prefill_chunk: 128,
        prefix_caching: true,
    };
    let mut batch =
        PersistentBatch::new(cpu_model(&loaded), loaded.tokenizer.clone(), config.clone()).unwrap();
    let mut alone = Alone::new(cpu_model(&loaded), loaded.tokenizer.clone(), BLOCK);
    let turn = |prompt: &[u32]| Request {
        max_tokens: 24,
        session: Some("chat".into()),
        ..Request::new(prompt.to_vec())
    };
    let run = |batch: &mut PersistentBatch<CpuBackend>, request: Request| {
        let h = batch.submit(request);
        batch.run_until_idle().unwrap();
        outcome(&h)
    };

    let mut messages = vec![ChatMessage::new("user", "What is the capital of France?")];
    let p1 = chat_prompt(&loaded, &template, &messages);
    let c1 = run(&mut batch, turn(&p1));
    assert_eq!(c1.cached_prompt_tokens, 0);
    let seq = batch.session_seq("chat").unwrap();
    assert_eq!(
        batch.kv().state(seq),
        Some(SeqState::Idle),
        "the session stays resident"
    );

    messages.push(ChatMessage::new("assistant", c1.text.clone()));
    messages.push(ChatMessage::new("user", "And the capital of Germany?"));
    let p2 = chat_prompt(&loaded, &template, &messages);
    assert!(p2.starts_with(&p1));
    let c2 = run(&mut batch, turn(&p2));
    println!(
        "turn 2: {} prompt tokens, {} cached, {} prefilled ({:.0} ms to first token): {:?}",
        p2.len(),
        c2.cached_prompt_tokens,
        c2.prefilled_tokens,
        c2.timings.prefill_ms,
        c2.text
    );
    assert!(
        c2.cached_prompt_tokens >= p1.len(),
        "turn 2 reused {} tokens, fewer than turn 1's prompt ({})",
        c2.cached_prompt_tokens,
        p1.len()
    );
    assert_eq!(c2.prefilled_tokens, p2.len() - c2.cached_prompt_tokens);
    let fresh2 = alone.run(turn(&p2));
    same_greedy(batch.model(), "turn 2 vs a fresh run", &p2, &c2, &fresh2);

    // A request that needs every block of the cache evicts the idle session and reallocates all
    // of its blocks, so nothing of it can be found by hash either.
    let text = loaded.tokenizer.encode(TEXT).unwrap();
    let fill_tokens = num_blocks * BLOCK;
    let fill = Request {
        max_tokens: 8,
        ignore_eos: true,
        ..Request::new(text[..fill_tokens - 7].to_vec())
    };
    let f = run(&mut batch, fill);
    assert_eq!(f.token_ids.len(), 8);
    assert_eq!(
        batch.kv().state(seq),
        Some(SeqState::Evicted),
        "the session was evicted"
    );

    messages.push(ChatMessage::new("assistant", c2.text.clone()));
    messages.push(ChatMessage::new("user", "Which of the two is bigger?"));
    let p3 = chat_prompt(&loaded, &template, &messages);
    let c3 = run(&mut batch, turn(&p3));
    println!(
        "turn 3 after eviction: {} prompt tokens, {} cached, {} prefilled: {:?}",
        p3.len(),
        c3.cached_prompt_tokens,
        c3.prefilled_tokens,
        c3.text
    );
    assert_eq!(
        c3.cached_prompt_tokens, 0,
        "an evicted session is a cache miss"
    );
    assert_eq!(c3.prefilled_tokens, p3.len());
    batch.kv().check().unwrap();

    // The same turns where the session stayed resident.
    let mut control = PersistentBatch::new(
        cpu_model(&loaded),
        loaded.tokenizer.clone(),
        BatchConfig {
            num_blocks: 256,
            ..config
        },
    )
    .unwrap();
    for p in [&p1, &p2] {
        run(&mut control, turn(p));
    }
    let stayed = run(&mut control, turn(&p3));
    assert!(
        stayed.cached_prompt_tokens >= p2.len(),
        "the control's turn 3 is a cache hit"
    );
    same_greedy(batch.model(), "turn 3 evicted vs stayed", &p3, &c3, &stayed);
    let fresh3 = alone.run(turn(&p3));
    same_greedy(batch.model(), "turn 3 vs a fresh run", &p3, &c3, &fresh3);

    assert!(batch.end_session("chat").unwrap());
    assert_eq!(batch.stats().kv_blocks_used, 0);
}

// ---------------------------------------------------------------------------------------------
// Stress on a tiny random model.

struct Submitted {
    handle: RequestHandle,
    prompt: Vec<u32>,
    request: Request,
    cancel_at: Option<usize>,
    events: Vec<Event>,
    done: Option<Completion>,
}

/// 1000 random requests (prompt lengths, budgets, sampling, stop strings, sessions, a shared
/// system prefix) arriving over time, about 10% cancelled at random moments, on a KV pool far
/// smaller than their total demand. Every request ends exactly once, the KV bookkeeping holds
/// after every step, and at the end every block is free or evictable. Greedy results are checked
/// against each request run alone (on a fresh batch of one slot).
#[test]
fn stress_random_requests_on_a_tiny_model() {
    stress(Stepping::OneAtATime);
}

/// The same stress with overlapped stepping (each step issued before the previous step's tokens
/// are read back, decoding rows naming their input by the previous step's output row): the
/// same completions as the requests run alone, cancellations, sessions and preemption included.
/// Penalties and log-probabilities, which make steps run one at a time, are rarer here, so that
/// most steps overlap.
#[test]
fn stress_random_requests_with_overlapped_steps() {
    stress(Stepping::Overlapped);
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stepping {
    OneAtATime,
    Overlapped,
}

fn stress(stepping: Stepping) {
    let (spec, loaded, _dir) = tiny_model();
    let overlapped = stepping == Stepping::Overlapped;
    // Chance of a penalty or of log-probabilities in a request (each forces steps one at a time
    // while the request is in the batch).
    let (penalty, logprobs) = if overlapped { (0.02, 0.02) } else { (0.3, 0.2) };
    let config = BatchConfig {
        max_batch: 16,
        max_batched_tokens: 96,
        block_size: 8,
        // Overlapped steps run one at a time while the next step might preempt, which a pool
        // this tight makes most steps; a roomier one still preempts, with most steps overlapped.
        num_blocks: if overlapped { 120 } else { 40 },
        prefill_chunk: 32,
        prefix_caching: true,
    };
    let mut batch =
        PersistentBatch::new(cpu_model(&loaded), loaded.tokenizer.clone(), config.clone()).unwrap();
    assert!(
        !batch.overlaps(),
        "the CPU backend runs steps one at a time by default"
    );
    batch.set_overlap(overlapped);
    let mut rng = ChaCha8Rng::seed_from_u64(if overlapped { 2025 } else { 2024 });
    let system = random_tokens(&spec, 24, 1);
    let total = 1000;
    let mut reqs: Vec<Submitted> = Vec::with_capacity(total);
    // Per session: the index of its latest request, whose prompt and reply the next one extends.
    let mut sessions: HashMap<String, usize> = HashMap::new();
    let started = Instant::now();
    let (mut step, mut demand) = (0usize, 0usize);

    while reqs.len() < total || !batch.is_idle() {
        for _ in 0..rng.random_range(0..=3usize).min(total - reqs.len()) {
            let i = reqs.len();
            let session = rng
                .random_bool(0.15)
                .then(|| format!("s{}", rng.random_range(0..6)));
            let mut prompt = Vec::new();
            if let Some(prev) = session.as_ref().and_then(|s| sessions.get(s)) {
                if let Some(done) = &reqs[*prev].done {
                    prompt = reqs[*prev].prompt.clone();
                    prompt.extend_from_slice(&done.token_ids);
                }
            }
            let len = rng.random_range(1..=80usize);
            if prompt.len() + len >= spec.context {
                prompt.clear();
            }
            if prompt.is_empty() && rng.random_bool(0.3) {
                prompt = system.clone();
            }
            prompt.extend(random_tokens(&spec, len, i as u64 + 100));
            prompt.truncate(spec.context - 1);
            let greedy = rng.random_bool(0.4);
            let sampling = SamplingParams {
                temperature: if greedy {
                    0.0
                } else {
                    rng.random_range(0.3..1.5)
                },
                top_k: if rng.random_bool(0.5) {
                    0
                } else {
                    rng.random_range(1..50)
                },
                top_p: if rng.random_bool(0.5) {
                    1.0
                } else {
                    rng.random_range(0.5..1.0)
                },
                min_p: if rng.random_bool(0.7) {
                    0.0
                } else {
                    rng.random_range(0.0..0.2)
                },
                repetition_penalty: if rng.random_bool(1.0 - penalty) {
                    1.0
                } else {
                    1.1
                },
                frequency_penalty: if rng.random_bool(1.0 - penalty) {
                    0.0
                } else {
                    0.5
                },
                presence_penalty: if rng.random_bool(1.0 - penalty) {
                    0.0
                } else {
                    -0.3
                },
                seed: rng.random(),
            };
            let request = Request {
                prompt: prompt.clone(),
                sampling,
                max_tokens: if rng.random_bool(0.1) {
                    500
                } else {
                    rng.random_range(1..=40)
                },
                stop_strings: if rng.random_bool(0.1) {
                    vec!["a".into(), "\n\n".into()]
                } else {
                    vec![]
                },
                ignore_eos: rng.random_bool(0.5),
                session: session.clone(),
                logprobs: rng.random_bool(logprobs).then(|| rng.random_range(0..=5)),
                max_queue_wait: None,
                kv_eviction: None,
                forced_tokens: Vec::new(),
            };
            demand += (prompt.len() + request.max_tokens).min(spec.context);
            if let Some(s) = session {
                sessions.insert(s, i);
            }
            let handle = batch.submit(request.clone());
            reqs.push(Submitted {
                handle,
                prompt,
                request,
                cancel_at: rng.random_bool(0.1).then(|| step + rng.random_range(0..30)),
                events: Vec::new(),
                done: None,
            });
        }
        for r in reqs.iter_mut() {
            if r.cancel_at == Some(step) {
                batch.cancel(r.handle.id()).unwrap();
            }
        }
        batch.step().unwrap();
        step += 1;
        batch
            .kv()
            .check()
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
        let stats = batch.stats();
        assert_eq!(
            stats.kv_blocks_free + stats.kv_blocks_evictable + stats.kv_blocks_used,
            stats.kv_blocks_total
        );
        // Collect events as they come: a session's next prompt extends its previous reply.
        for r in reqs.iter_mut().filter(|r| r.done.is_none()) {
            if r.handle.poll(&mut r.events) {
                let what = format!("stress {}", r.handle.id());
                r.done = Some(check_events(&what, &r.events));
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let stats = batch.stats();

    let (mut cancelled, mut hits, mut by_reason) = (0, 0, HashMap::new());
    for (i, r) in reqs.iter().enumerate() {
        let c = r
            .done
            .as_ref()
            .unwrap_or_else(|| panic!("request {i} never ended"));
        let cap = r.request.max_tokens.min(spec.context - r.prompt.len());
        assert!(c.token_ids.len() <= cap, "request {i}: too many tokens");
        // Keys held at the end: every token but the last; under overlapped stepping a request
        // ended by a stop may also hold the last one (its row was issued before the stop was
        // seen).
        let keys = r.prompt.len() + c.token_ids.len() - 1;
        let stop_row = overlapped && c.finish_reason == FinishReason::Stop;
        if c.finish_reason != FinishReason::Cancelled {
            assert!(
                c.kv_tokens == keys || (stop_row && c.kv_tokens == keys + 1),
                "request {i}: {} keys held for {keys} tokens",
                c.kv_tokens
            );
        }
        match c.finish_reason {
            FinishReason::Length => assert_eq!(c.token_ids.len(), cap, "request {i}"),
            FinishReason::Cancelled => {
                assert!(r.cancel_at.is_some(), "request {i} cancelled unasked");
                cancelled += 1;
            }
            FinishReason::Stop => {}
        }
        *by_reason
            .entry(format!("{:?}", c.finish_reason))
            .or_insert(0) += 1;
        hits += (c.cached_prompt_tokens > 0) as usize;
    }
    println!(
        "{stepping:?}: {total} requests ({demand} tokens of demand on a pool of {} tokens) in \
         {elapsed:.1} s, {step} steps ({} overlapped): {by_reason:?}; {hits} prompts partly \
         cached; {} preemptions, {} tokens run",
        config.num_blocks * config.block_size,
        stats.overlapped_steps,
        stats.preemptions,
        stats.tokens_run,
    );
    match stepping {
        Stepping::OneAtATime => assert_eq!(stats.overlapped_steps, 0),
        // The pool is still tight enough that many steps read back first (one might preempt).
        Stepping::Overlapped => assert!(
            stats.overlapped_steps * 4 > stats.steps,
            "{} of {} steps overlapped",
            stats.overlapped_steps,
            stats.steps
        ),
    }
    assert!(cancelled >= 30, "only {cancelled} cancellations");
    assert!(demand > 50 * config.num_blocks * config.block_size);
    assert!(stats.preemptions > 0, "the pool should force preemption");
    assert!(hits > 0, "no prompt reused cached KV");
    assert_eq!((stats.running, stats.waiting), (0, 0));
    for s in sessions.keys() {
        assert!(batch.end_session(s).unwrap());
    }
    let stats = batch.stats();
    assert_eq!(stats.kv_blocks_used, 0, "{stats:?}");
    assert_eq!(
        stats.kv_blocks_free + stats.kv_blocks_evictable,
        stats.kv_blocks_total
    );
    batch.kv().check().unwrap();

    // Completions equal those of the requests run alone, preempted ones included. Greedy ones up
    // to a near tie; seeded sampling draws from logits that differ at ~1e-6, which changes a draw
    // only when it falls that close to a boundary between tokens, so all but a rare one match.
    let mut alone = Alone::new(
        cpu_model(&loaded),
        loaded.tokenizer.clone(),
        config.block_size,
    );
    let (mut greedy, mut greedy_matched, mut preempted) = (0, 0, 0);
    let (mut sampled, mut sampled_matched) = (0, 0);
    for (i, r) in reqs.iter().enumerate() {
        let c = r.done.as_ref().unwrap();
        if c.finish_reason == FinishReason::Cancelled {
            continue;
        }
        let want = alone.run(r.request.clone());
        preempted += (c.preemptions > 0) as usize;
        if r.request.sampling.temperature == 0.0 {
            greedy += 1;
            let what = format!("stress request {i}");
            greedy_matched += same_greedy(batch.model(), &what, &r.prompt, c, &want) as usize;
        } else {
            sampled += 1;
            sampled_matched += (c.token_ids == want.token_ids) as usize;
        }
    }
    println!(
        "{stepping:?} vs alone: greedy {greedy_matched}/{greedy} equal token for token, sampled \
         {sampled_matched}/{sampled}; {preempted} of these were preempted at least once"
    );
    assert!(greedy > 100 && preempted > 50);
    assert!(
        sampled_matched * 100 >= sampled * 99,
        "{sampled_matched}/{sampled} sampled requests equal their runs alone"
    );
}

/// A batch for the tiny model: 64 tokens a step, blocks of 8, prefix caching on.
fn tiny_batch_config(max_batch: usize, num_blocks: usize, prefill_chunk: usize) -> BatchConfig {
    BatchConfig {
        max_batch,
        max_batched_tokens: 64,
        block_size: 8,
        num_blocks,
        prefill_chunk,
        prefix_caching: true,
    }
}

/// A tiny random model (hidden 64, 2 layers, context 128) written to a GGUF file in a temporary
/// directory, which must outlive the model (its weights may be memory-mapped).
fn tiny_model() -> (TinySpec, LoadedModel, tempfile::TempDir) {
    let spec = TinySpec {
        context: 128,
        seed: 11,
        ..TinySpec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_gguf(&path, &spec, &TinyWeights::random(&spec), DType::F32);
    let loaded = LoadedModel::load(&path).unwrap();
    (spec, loaded, dir)
}

/// Requests that can never run fail at submission with a clear error; cancelling a running or
/// waiting request, or dropping its handle, ends it once and frees its blocks at once; requests
/// of one session run one after the other, the later one reusing the earlier one's KV.
#[test]
fn refusals_cancellations_and_busy_sessions() {
    let (spec, loaded, _dir) = tiny_model();
    let config = tiny_batch_config(2, 8, 16);
    let mut batch =
        PersistentBatch::new(cpu_model(&loaded), loaded.tokenizer.clone(), config).unwrap();
    let tokens = |n: usize, seed: u64| random_tokens(&spec, n, seed);
    let failure = |h: RequestHandle| match h.drain().as_slice() {
        [Event::Failed(e)] => e.clone(),
        other => panic!("expected one Failed event, got {other:?}"),
    };
    assert_eq!(
        failure(batch.submit(Request::new(vec![]))),
        RequestError::EmptyPrompt
    );
    assert!(matches!(
        failure(batch.submit(Request::new(tokens(128, 1)))),
        RequestError::PromptTooLong { prompt: 128, .. }
    ));
    assert!(matches!(
        failure(batch.submit(Request::new(vec![5, 10_000]))),
        RequestError::BadToken { id: 10_000, .. }
    ));
    let bad_sampling = Request {
        sampling: SamplingParams {
            temperature: -1.0,
            ..Default::default()
        },
        ..Request::new(tokens(4, 2))
    };
    assert!(matches!(
        failure(batch.submit(bad_sampling)),
        RequestError::Sampling(_)
    ));
    // 60 + 19 tokens of KV need 10 blocks of 8; the cache has 8.
    let too_large = batch.submit(Request {
        max_tokens: 20,
        ..Request::new(tokens(60, 3))
    });
    let error = failure(too_large);
    println!("refused: {error}");
    assert_eq!(
        error,
        RequestError::TooLargeForCache {
            tokens: 79,
            needed: 10,
            total: 8
        }
    );
    let nothing = batch.submit(Request {
        max_tokens: 0,
        ..Request::new(tokens(4, 4))
    });
    let c = outcome(&nothing);
    assert_eq!(
        (c.token_ids.len(), c.finish_reason),
        (0, FinishReason::Length)
    );
    assert!(batch.is_idle());

    // Cancellation: a running request, a waiting one, a dropped handle.
    let long = |seed| Request {
        max_tokens: 20,
        ignore_eos: true,
        ..Request::new(tokens(20, seed))
    };
    let running = batch.submit(long(5));
    let dropped = batch.submit(long(6));
    let waiting = batch.submit(long(7));
    for _ in 0..3 {
        batch.step().unwrap();
    }
    assert_eq!((batch.stats().running, batch.stats().waiting), (2, 1));
    assert!(batch.cancel(running.id()).unwrap());
    let c = outcome(&running);
    assert_eq!(c.finish_reason, FinishReason::Cancelled);
    assert!(!c.token_ids.is_empty() && c.token_ids.len() < 20);
    assert!(batch.cancel(waiting.id()).unwrap());
    let c = outcome(&waiting);
    assert_eq!(
        (c.token_ids.len(), c.finish_reason),
        (0, FinishReason::Cancelled)
    );
    assert!(!batch.cancel(waiting.id()).unwrap(), "already ended");
    drop(dropped);
    // The dropped request is noticed when it streams its next token, and ended at the next step.
    batch.step().unwrap();
    batch.step().unwrap();
    assert!(batch.is_idle());
    let stats = batch.stats();
    assert_eq!(stats.kv_blocks_used, 0, "{stats:?}");
    batch.kv().check().unwrap();

    // Two requests of one session: the second waits for the first and reuses its KV.
    let p1 = tokens(20, 8);
    let mut p2 = p1.clone();
    p2.extend(tokens(10, 9));
    let turn = |prompt: &[u32]| Request {
        max_tokens: 5,
        ignore_eos: true,
        session: Some("a".into()),
        ..Request::new(prompt.to_vec())
    };
    let first = batch.submit(turn(&p1));
    let second = batch.submit(turn(&p2));
    batch.step().unwrap();
    assert_eq!((batch.stats().running, batch.stats().waiting), (1, 1));
    batch.run_until_idle().unwrap();
    let (c1, c2) = (outcome(&first), outcome(&second));
    assert_eq!(c1.cached_prompt_tokens, 0);
    assert_eq!(c2.cached_prompt_tokens, p1.len());
    assert_eq!(c2.prefilled_tokens, p2.len() - p1.len());
    let seq = batch.session_seq("a").unwrap();
    assert_eq!(batch.kv().state(seq), Some(SeqState::Idle));
    assert!(batch.end_session("a").unwrap());
    assert_eq!(batch.kv().state(seq), None);
    assert_eq!(batch.stats().kv_blocks_used, 0);
}

/// With `prefix_caching` off nothing is reused: requests sharing a prefix and a session's next
/// turn prefill their whole prompts, and nothing stays resident; with it on, the same requests
/// skip the shared prefix and the session's history, hold fewer blocks, and generate the same
/// tokens.
#[test]
fn prefix_caching_off_prefills_every_prompt_whole() {
    let (spec, loaded, _dir) = tiny_model();
    let system = random_tokens(&spec, 40, 1);
    let with_system = |seed| {
        let mut p = system.clone();
        p.extend(random_tokens(&spec, 6, seed));
        p
    };
    let shared: Vec<Vec<u32>> = (0..4).map(|i| with_system(10 + i)).collect();
    let greedy = |prompt: &[u32], session: Option<&str>| Request {
        max_tokens: 8,
        ignore_eos: true,
        session: session.map(Into::into),
        ..Request::new(prompt.to_vec())
    };
    let run = |prefix_caching: bool| {
        let config = BatchConfig {
            max_batch: 4,
            max_batched_tokens: 64,
            block_size: 8,
            num_blocks: 64,
            prefill_chunk: 64,
            prefix_caching,
        };
        let mut batch =
            PersistentBatch::new(cpu_model(&loaded), loaded.tokenizer.clone(), config).unwrap();
        // One request first, so that the others find its prefix computed.
        let mut outs = vec![];
        let h = batch.submit(greedy(&shared[0], None));
        batch.run_until_idle().unwrap();
        outs.push(outcome(&h));
        let hs: Vec<_> = shared[1..]
            .iter()
            .map(|p| batch.submit(greedy(p, None)))
            .collect();
        batch.run_until_idle().unwrap();
        outs.extend(hs.iter().map(outcome));
        // A session's two turns.
        let turn1 = random_tokens(&spec, 20, 30);
        let h = batch.submit(greedy(&turn1, Some("s")));
        batch.run_until_idle().unwrap();
        let c1 = outcome(&h);
        let mut turn2 = turn1.clone();
        turn2.extend(&c1.token_ids);
        turn2.extend(random_tokens(&spec, 5, 31));
        let h = batch.submit(greedy(&turn2, Some("s")));
        batch.run_until_idle().unwrap();
        outs.push(c1);
        outs.push(outcome(&h));
        batch.kv().check().unwrap();
        let stats = batch.stats();
        let prompts: Vec<Vec<u32>> = shared.iter().cloned().chain([turn1, turn2]).collect();
        (outs, prompts, stats)
    };
    let (on, prompts, on_stats) = run(true);
    let (off, _, off_stats) = run(false);
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    for (i, (a, b)) in on.iter().zip(&off).enumerate() {
        assert_eq!(
            b.cached_prompt_tokens, 0,
            "request {i} reused KV with caching off"
        );
        assert_eq!(b.prefilled_tokens, prompts[i].len());
        same_greedy(
            &cpu_model(&loaded),
            &format!("request {i}, caching on vs off"),
            &prompts[i],
            a,
            b,
        );
    }
    // Shared: the system prompt's 5 full blocks, for 3 requests; the session's first turn.
    assert_eq!(on[1].cached_prompt_tokens, 40);
    assert!(on[5].cached_prompt_tokens >= prompts[4].len());
    assert_eq!(off_stats.prefill_tokens_run as usize, prompt_tokens);
    let saved = 3 * 40 + on[5].cached_prompt_tokens;
    assert_eq!(on_stats.prefill_tokens_run as usize, prompt_tokens - saved);
    assert!(
        on_stats.kv_blocks_peak < off_stats.kv_blocks_peak,
        "{on_stats:?} vs {off_stats:?}"
    );
    // Only the session's history stays held, and only with caching on.
    assert_eq!((off_stats.idle_sessions, off_stats.kv_blocks_used), (0, 0));
    assert_eq!(on_stats.idle_sessions, 1);
    assert!(on_stats.kv_blocks_used > 0);
}

/// Requests submitted together with a common prefix compute it once: those arriving while the
/// first one prefills it wait for its blocks and share them, while a request with another
/// prompt is admitted at once.
#[test]
fn concurrent_requests_compute_a_common_prefix_once() {
    let (spec, loaded, _dir) = tiny_model();
    let config = tiny_batch_config(8, 64, 16);
    let mut batch =
        PersistentBatch::new(cpu_model(&loaded), loaded.tokenizer.clone(), config).unwrap();
    let system = random_tokens(&spec, 40, 1);
    let mut prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let mut p = system.clone();
            p.extend(random_tokens(&spec, 6, 10 + i));
            p
        })
        .collect();
    prompts.push(random_tokens(&spec, 30, 20));
    let handles: Vec<RequestHandle> = prompts
        .iter()
        .map(|p| {
            batch.submit(Request {
                max_tokens: 4,
                ignore_eos: true,
                ..Request::new(p.clone())
            })
        })
        .collect();
    let first = batch.step().unwrap();
    assert_eq!(first.admitted, 2, "the unrelated request joins at once");
    batch.run_until_idle().unwrap();
    let done: Vec<Completion> = handles.iter().map(outcome).collect();
    for c in &done[1..4] {
        assert_eq!(c.cached_prompt_tokens, 40, "{c:?}");
    }
    let stats = batch.stats();
    assert_eq!(stats.prefill_tokens_run as usize, 46 + 3 * 6 + 30);
    batch.kv().check().unwrap();
}

/// An INT8 or FP8 KV cache serves the batch as it serves one request: chat requests sharing a
/// long system prompt (prefix sharing and cascade over quantized blocks) give the tokens each
/// gives alone on the same dtype, up to near ties; run again, they reuse the resident quantized
/// prefix (the LRU of KV caches) with the same tokens; and a request evicting with H2O
/// (compaction moving codes and scales) keeps its budget.
#[test]
fn quantized_kv_caches_serve_the_batch() {
    use turbo_keyformer::{BudgetConfig, BudgetSize, PolicyKind};
    use turbo_scheduler::KvEviction;
    let loaded = load_default_model();
    let template = model_chat_template(&loaded);
    let system = TEXT[..1400].to_string();
    let prompts: Vec<Vec<u32>> = [
        "What is the keeper's routine?",
        "Why does he keep the light burning in winter?",
        "Summarise the story in one sentence.",
    ]
    .iter()
    .map(|q| {
        chat_prompt(
            &loaded,
            &template,
            &[
                ChatMessage::new("system", &system),
                ChatMessage::new("user", *q),
            ],
        )
    })
    .collect();
    assert!(
        prompts[0].len() > 256,
        "the shared prefix is long enough for cascade"
    );
    let request = |prompt: &[u32]| Request {
        max_tokens: 12,
        ignore_eos: true,
        ..Request::new(prompt.to_vec())
    };
    for dtype in [turbo_core::KvDtype::Int8, turbo_core::KvDtype::Fp8] {
        let model = || {
            let mut m = cpu_model(&loaded);
            m.set_kv_dtype(dtype);
            m
        };
        let mut alone = Alone::new(model(), loaded.tokenizer.clone(), BLOCK);
        let expected: Vec<Completion> = prompts.iter().map(|p| alone.run(request(p))).collect();
        let config = BatchConfig {
            max_batch: 8,
            max_batched_tokens: 512,
            block_size: BLOCK,
            num_blocks: 512,
            prefill_chunk: 512,
            prefix_caching: true,
        };
        let mut batch = PersistentBatch::new(model(), loaded.tokenizer.clone(), config).unwrap();
        for wave in 0..2 {
            let handles: Vec<RequestHandle> =
                prompts.iter().map(|p| batch.submit(request(p))).collect();
            let evicting = batch.submit(Request {
                kv_eviction: Some(KvEviction::new(
                    PolicyKind::H2O,
                    BudgetConfig::new(BudgetSize::Tokens(128)),
                )),
                ..request(&prompts[2])
            });
            batch.run_until_idle().unwrap();
            batch.kv().check().unwrap();
            for (i, (h, want)) in handles.iter().zip(&expected).enumerate() {
                let got = outcome(h);
                if wave == 1 {
                    assert!(
                        got.cached_prompt_tokens > 0,
                        "{dtype} wave 2, request {i}: the resident prefix was not reused"
                    );
                }
                let what = format!("{dtype} wave {wave}, request {i}");
                same_greedy_within(
                    batch.model(),
                    &what,
                    &prompts[i],
                    &got,
                    want,
                    QUANT_NEAR_TIE,
                );
            }
            let e = outcome(&evicting);
            assert_eq!(e.token_ids.len(), 12, "{dtype}");
            assert!(
                e.kv_tokens <= 128 + BLOCK,
                "{dtype}: the evicting request holds {} keys",
                e.kv_tokens
            );
        }
    }
}

/// Under overlapped stepping, cancelling everything (a shutdown's deadline) first reads back
/// the step in flight: a request whose last token is already computed ends finished with it,
/// not cancelled without it.
#[test]
fn cancel_all_reads_back_the_step_in_flight() {
    let (spec, loaded, _dir) = tiny_model();
    let config = tiny_batch_config(4, 64, 32);
    let mut batch =
        PersistentBatch::new(cpu_model(&loaded), loaded.tokenizer.clone(), config).unwrap();
    batch.set_overlap(true);
    let handles: Vec<RequestHandle> = (0..3)
        .map(|i| {
            batch.submit(Request {
                max_tokens: 2,
                ignore_eos: true,
                ..Request::new(random_tokens(&spec, 10 + i, 300 + i as u64))
            })
        })
        .collect();
    // Step 1 issues the prompts (first tokens in flight); step 2 issues the second, last tokens
    // and reads the first ones back.
    batch.step().unwrap();
    batch.step().unwrap();
    assert_eq!(batch.stats().overlapped_steps, 1);
    assert!(!batch.is_idle(), "the last tokens are still in flight");
    assert_eq!(batch.cancel_all().unwrap(), 0, "every request had ended");
    assert!(batch.is_idle());
    for h in &handles {
        let c = outcome(h);
        assert_eq!(c.finish_reason, FinishReason::Length);
        assert_eq!(c.token_ids.len(), 2);
    }
    assert_eq!(batch.stats().kv_blocks_used, 0);
    batch.kv().check().unwrap();
}

/// A model split over two CPU ranks steps overlapped (rank 0 samples, its peer takes the tokens
/// for the carried ids of the next step) and generates what the whole model generates stepping
/// one at a time: the same greedy tokens, up to near ties.
#[test]
fn a_split_model_overlaps_its_steps_and_generates_what_the_whole_one_does() {
    let (spec, loaded, _dir) = tiny_model();
    let config = BatchConfig {
        max_batch: 4,
        max_batched_tokens: 48,
        block_size: 8,
        num_blocks: 96,
        prefill_chunk: 24,
        prefix_caching: true,
    };
    let prompts: Vec<Vec<u32>> = [3, 17, 40, 9, 26, 60]
        .iter()
        .enumerate()
        .map(|(i, &n)| random_tokens(&spec, n, 500 + i as u64))
        .collect();
    let run = |model: Llama<CpuBackend>, overlap: bool| {
        let mut batch =
            PersistentBatch::new(model, loaded.tokenizer.clone(), config.clone()).expect("a batch");
        batch.set_overlap(overlap);
        let handles: Vec<RequestHandle> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                batch.submit(Request {
                    max_tokens: 6 + 3 * i,
                    ignore_eos: true,
                    ..Request::new(p.clone())
                })
            })
            .collect();
        batch.run_until_idle().expect("the batch steps");
        let done: Vec<Completion> = handles.iter().map(outcome).collect();
        let stats = batch.stats();
        (done, stats, batch.into_parts().0)
    };
    let (want, _, whole) = run(cpu_model(&loaded), false);
    let split = Llama::new_parallel(
        turbo_core::comm::CpuGroup::members(2)
            .into_iter()
            .map(|m| CpuBackend::with_group(1, m).unwrap())
            .collect(),
        &loaded.config,
        &loaded.weights,
    )
    .unwrap();
    let (got, stats, _) = run(split, true);
    assert!(
        stats.overlapped_steps * 2 > stats.steps,
        "{} of {} steps overlapped",
        stats.overlapped_steps,
        stats.steps
    );
    for (i, ((g, w), p)) in got.iter().zip(&want).zip(&prompts).enumerate() {
        assert_eq!(g.token_ids.len(), 6 + 3 * i);
        same_greedy(&whole, &format!("request {i}"), p, g, w);
    }
}

/// A warm-up runs its steps and leaves nothing behind: no request or held block, every counter
/// at zero, consistent KV bookkeeping; the requests after it generate what they do on a batch
/// that was not warmed up, in as many steps.
#[test]
fn warm_up_leaves_the_batch_as_it_found_it() {
    let (spec, loaded, _dir) = tiny_model();
    let config = tiny_batch_config(4, 64, 64);
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| random_tokens(&spec, 20 + i, 40 + i as u64))
        .collect();
    let run = |warm: bool| {
        let mut batch =
            PersistentBatch::new(cpu_model(&loaded), loaded.tokenizer.clone(), config.clone())
                .unwrap();
        if warm {
            let done = batch.warm_up(4, 64).unwrap();
            assert_eq!((done.prefill_tokens, done.decode_rows), (64, 4), "{done:?}");
            assert!(batch.is_idle());
            let s = batch.stats();
            assert_eq!(
                (s.steps, s.tokens_run, s.decode_steps, s.kv_blocks_used),
                (0, 0, 0, 0)
            );
            // The finished warm-up prompts' full blocks stay findable: it did run.
            assert!(s.kv_blocks_evictable > 0, "the warm-up ran no step");
            batch.kv().check().unwrap();
        }
        let handles: Vec<RequestHandle> = prompts
            .iter()
            .map(|p| {
                batch.submit(Request {
                    max_tokens: 6,
                    ignore_eos: true,
                    ..Request::new(p.clone())
                })
            })
            .collect();
        batch.run_until_idle().unwrap();
        let outs: Vec<Vec<u32>> = handles.iter().map(|h| outcome(h).token_ids).collect();
        (outs, batch.stats())
    };
    let (cold, cold_stats) = run(false);
    let (warm, warm_stats) = run(true);
    assert_eq!(warm, cold);
    // More slots than a step has room for 8-token prompts: the short prompts shrink so that
    // every slot still decodes in one step.
    let mut wide = PersistentBatch::new(
        cpu_model(&loaded),
        loaded.tokenizer.clone(),
        tiny_batch_config(32, 64, 64),
    )
    .unwrap();
    assert_eq!(wide.warm_up(32, 64).unwrap().decode_rows, 32);
    assert_eq!(
        (warm_stats.steps, warm_stats.tokens_run),
        (cold_stats.steps, cold_stats.tokens_run)
    );
}

/// A request whose logits turn NaN (here: its prompt holds a token whose embedding is NaN) fails
/// with `NoFiniteLogits` instead of emitting a made-up token, one step at a time and overlapped,
/// and the request beside it in the batch generates what it does alone.
#[test]
fn a_request_without_finite_logits_fails_and_its_neighbour_goes_on() {
    let spec = TinySpec {
        context: 128,
        seed: 12,
        ..TinySpec::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let load = |poison: Option<u32>| {
        let mut weights = TinyWeights::random(&spec);
        if let Some(t) = poison {
            let d = spec.hidden;
            weights.embed[t as usize * d..(t as usize + 1) * d].fill(f32::NAN);
        }
        let path = dir.path().join(format!("tiny-{poison:?}.gguf"));
        write_gguf(&path, &spec, &weights, DType::F32);
        LoadedModel::load(&path).unwrap()
    };
    let greedy = |prompt: Vec<u32>| Request {
        max_tokens: 8,
        ignore_eos: true,
        ..Request::new(prompt)
    };
    let healthy = random_tokens(&spec, 12, 50);
    // What the healthy request generates on the clean model; the poisoned token is one it never
    // meets.
    let clean = load(None);
    let mut batch = PersistentBatch::new(
        cpu_model(&clean),
        clean.tokenizer.clone(),
        tiny_batch_config(2, 32, 64),
    )
    .unwrap();
    let h = batch.submit(greedy(healthy.clone()));
    batch.run_until_idle().unwrap();
    let alone = outcome(&h).token_ids;
    let poison = (0..spec.vocab as u32)
        .find(|t| !healthy.contains(t) && !alone.contains(t))
        .unwrap();
    let broken = load(Some(poison));
    for overlap in [false, true] {
        let mut batch = PersistentBatch::new(
            cpu_model(&broken),
            broken.tokenizer.clone(),
            tiny_batch_config(2, 32, 64),
        )
        .unwrap();
        batch.set_overlap(overlap);
        let mut bad_prompt = random_tokens(&spec, 10, 51);
        bad_prompt[3] = poison;
        let bad = batch.submit(Request {
            session: Some("broken".into()),
            ..greedy(bad_prompt.clone())
        });
        let good = batch.submit(greedy(healthy.clone()));
        batch.run_until_idle().unwrap();
        match bad.drain().as_slice() {
            [Event::Failed(RequestError::NoFiniteLogits { index: 0 })] => {}
            other => panic!("overlap {overlap}: expected NoFiniteLogits, got {other:?}"),
        }
        assert_eq!(outcome(&good).token_ids, alone, "overlap {overlap}");
        // Its KV is not kept for reuse, nor is its session.
        assert_eq!(batch.kv().resident_prefix(&bad_prompt), 0);
        assert!(batch.session_seq("broken").is_none());
        assert_eq!(batch.stats().kv_blocks_used, 0);
        batch.kv().check().unwrap();
    }
}

/// Sessions are bounded: past `MAX_SESSIONS` names, a new one forgets the least recently used
/// session (named, or its request ended) with no request in the batch, never one with a request
/// waiting or running; a name longer than `MAX_SESSION_NAME_BYTES` is refused.
#[test]
fn sessions_are_forgotten_least_recently_used_first_past_the_bound() {
    use turbo_scheduler::{MAX_SESSIONS, MAX_SESSION_NAME_BYTES};
    let (spec, loaded, _dir) = tiny_model();
    let mut batch = PersistentBatch::new(
        cpu_model(&loaded),
        loaded.tokenizer.clone(),
        tiny_batch_config(2, 64, 64),
    )
    .unwrap();
    let prompt = random_tokens(&spec, 5, 60);
    let named = |name: String, max_tokens: usize| Request {
        max_tokens,
        session: Some(name),
        ..Request::new(prompt.clone())
    };
    // Waiting in the batch, and the least recently named: it must stay.
    let kept = batch.submit(named("in-batch".into(), 3));
    for i in 0..MAX_SESSIONS + 10 {
        // Finished at once (no tokens asked for), so idle.
        batch.submit(named(format!("s{i}"), 0));
        if i == 20 {
            // Named again: now more recent than s1..s20.
            batch.submit(named("s0".into(), 0));
        }
    }
    assert!(batch.session_seq("in-batch").is_some());
    // 11 names had to go, the least recently named: s1..s11 (s0 was named again after s20).
    assert!(batch.session_seq("s0").is_some());
    for i in 1..=11 {
        assert!(
            batch.session_seq(&format!("s{i}")).is_none(),
            "s{i} remembered"
        );
    }
    assert!(batch.session_seq("s12").is_some());
    assert!(batch
        .session_seq(&format!("s{}", MAX_SESSIONS + 9))
        .is_some());
    batch.run_until_idle().unwrap();
    assert_eq!(outcome(&kept).token_ids.len(), 3);
    // Its request ended after every other session was named: it is now the most recently used,
    // so new names forget all the others first.
    for i in 0..MAX_SESSIONS - 1 {
        batch.submit(named(format!("t{i}"), 0));
    }
    assert!(batch.session_seq("in-batch").is_some());
    assert!(batch.session_seq("s0").is_none());
    let long = batch.submit(named("x".repeat(MAX_SESSION_NAME_BYTES + 1), 2));
    match long.drain().as_slice() {
        [Event::Failed(RequestError::SessionName(n))] => assert_eq!(*n, MAX_SESSION_NAME_BYTES + 1),
        other => panic!("expected SessionName, got {other:?}"),
    }
    batch.kv().check().unwrap();
}
