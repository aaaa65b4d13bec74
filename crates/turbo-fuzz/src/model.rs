//! What the model targets check once a (mutated) model has loaded, and what they check of the
//! errors when it has not.

use std::sync::OnceLock;
use turbo_core::cpu::CpuBackend;
use turbo_core::Backend;
use turbo_llama::{Llama, LoadedModel, Logits, SequenceChunk};
use turbo_tokenizer::{ChatMessage, ChatTemplate};

/// Error messages quote model files (names, keys, values), and Turbo's errors show that text
/// escaped, so that a hostile file cannot send control characters to a terminal. A message with
/// a control character in it breaks that promise.
pub fn check_message(what: &str, message: &str) {
    if let Some(c) = message.chars().find(|c| c.is_control()) {
        panic!("{what} error message holds the control character {c:?}: {message:?}");
    }
}

/// One CPU thread, shared by every case of the process.
fn backend() -> CpuBackend {
    static BACKEND: OnceLock<CpuBackend> = OnceLock::new();
    BACKEND
        .get_or_init(|| CpuBackend::with_threads(1).expect("a CPU thread"))
        .clone()
}

/// Checks a model that loaded: its config is valid and agrees with its tokenizer, it can be
/// placed on the CPU and run for a token or two, and its chat template (or ChatML) renders or
/// fails cleanly.
pub fn check_loaded(m: &LoadedModel) {
    crate::accept();
    let c = &m.config;
    if let Err(e) = c.validate() {
        panic!("a loaded model's config is invalid: {e}");
    }
    // Every id the tokenizer can make must have an embedding row: `check_vocab` compares
    // counts, and a `tokenizer.json` may give a token any id.
    if let Some(max) = m.tokenizer.inner().get_vocab(true).values().max() {
        assert!(
            (*max as usize) < c.vocab_size,
            "the tokenizer makes id {max}, past the {} embedding rows",
            c.vocab_size
        );
    }
    let vocab = m.tokenizer.vocab_size();
    assert!(
        vocab <= c.vocab_size,
        "the tokenizer's {vocab} tokens outnumber the {} embedding rows",
        c.vocab_size
    );
    for &id in m
        .tokenizer
        .eos_ids()
        .iter()
        .chain(m.tokenizer.bos_id().iter())
    {
        assert!(
            (id as usize) < vocab,
            "BOS/EOS id {id} outside the {vocab}-token vocabulary"
        );
    }
    let _ = m.tensor_types();
    let _ = c.parameter_count();
    assert_eq!(c.rope_inv_freq().len(), c.head_dim / 2);

    match Llama::new(backend(), c, &m.weights) {
        Ok(model) => {
            run_tokens(&model, vec![1 % c.vocab_size as u32], c.context_length);
            // What a chat prompt starts with: special tokens, then text.
            match m.tokenizer.encode("<|im_start|>user\nhi<|im_end|>") {
                Ok(ids) if !ids.is_empty() => run_tokens(&model, ids, c.context_length),
                Ok(_) => {}
                Err(e) => check_message("encoding", &e.to_string()),
            }
        }
        Err(e) => check_message("placing the model", &e.to_string()),
    }

    let messages = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "hi <|im_end|>"),
    ];
    match ChatTemplate::for_model(m.chat_template.as_deref(), &m.tokenizer) {
        Ok(t) => {
            let _ = t.render(&messages, true);
            let _ = t.encode(&m.tokenizer, &messages, true);
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
}

/// A forward pass over (at most a block of) `tokens`; the logits may be anything, but there must
/// be a row of them, or an error.
fn run_tokens(model: &Llama<CpuBackend>, mut tokens: Vec<u32>, context: usize) {
    tokens.truncate(context.min(16));
    let vocab = model.config.vocab_size;
    let mut cache = match model.backend().kv_cache(model.kv_spec(16, 1)) {
        Ok(c) => c,
        Err(e) => return check_message("making the KV cache", &e.to_string()),
    };
    let chunk = SequenceChunk::new(tokens, 0, vec![0]);
    match model.forward(&[chunk], &mut cache, Logits::Last) {
        Ok(logits) => assert_eq!(logits.len(), vocab, "one row of logits"),
        Err(e) => check_message("the forward pass", &e.to_string()),
    }
}
