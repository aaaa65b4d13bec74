//! Fuzz targets for the parts of Turbo that read untrusted bytes: GGUF files, HF model
//! directories, tokenizers, chat templates and requests files.
//!
//! Each target is a function of one byte string that panics when an invariant fails, and
//! otherwise returns: it must not panic, abort, hang or allocate without bound on any input.
//! The same functions serve two runners:
//!
//! - [`harness`]: a bounded run on stable Rust, for CI (`cargo test --release -p turbo-fuzz`) and
//!   longer local runs (`cargo run --release -p turbo-fuzz -- run`). Cases come from structured
//!   mutators seeded deterministically, so a case is named by its seed and index; each run
//!   happens in a child process under an allocator with limits ([`alloc`]) and a time limit per
//!   case, so an abort, a stack overflow, a hang or an absurd allocation is reported with the
//!   case that caused it, and its input is written to a file.
//! - `fuzz/` at the repository root: libFuzzer targets for `cargo +nightly fuzz`, thin wrappers
//!   of the same functions with the same mutators as custom mutators.
//!
//! The mutators know the formats: [`gguf`] edits metadata values, vocabulary arrays and tensor
//! entries and rewrites the file with a writer that writes anything; [`hf_model`] edits
//! `config.json` and safetensors headers as JSON; [`chat_template`] edits Jinja sources with a
//! dictionary of constructs; [`tokenizer`] builds text from many scripts and special tokens.
//! Their seeds are the tiny random models `turbo-tests` writes and, where the machine has them,
//! the default model's header, vocabulary and chat template.

pub mod alloc;
pub mod chat_template;
pub mod gguf;
pub mod harness;
pub mod hf_model;
pub mod json;
pub mod model;
pub mod mutate;
pub mod requests_file;
pub mod rng;
pub mod scratch;
pub mod seeds;
pub mod text;
pub mod tokenizer;

pub use rng::Rng;

use std::sync::atomic::{AtomicU64, Ordering};

static ACCEPTED: AtomicU64 = AtomicU64::new(0);

/// Counts a case whose input went all the way through (a model that loaded, a template that
/// rendered, a request that parsed): how deep the mutators reach, for reports.
pub fn accept() {
    ACCEPTED.fetch_add(1, Ordering::Relaxed);
}

/// Cases counted by [`accept`] in this process.
pub fn accepted() -> u64 {
    ACCEPTED.load(Ordering::Relaxed)
}

/// A fuzz target and its mutators.
#[derive(Debug)]
pub struct Target {
    pub name: &'static str,
    /// Runs one input; panics when an invariant fails.
    pub run: fn(&[u8]),
    /// A new input: a seed mutated structurally.
    pub generate: fn(&mut Rng) -> Vec<u8>,
    /// Mutates an input of the target (libFuzzer's custom mutator).
    pub mutate: fn(&[u8], &mut Rng) -> Vec<u8>,
    /// The unmutated seeds, for a libFuzzer corpus.
    pub seeds: fn() -> Vec<Vec<u8>>,
    /// Cases the CI test runs in a release build; each target's share of about a minute.
    pub ci_cases: u64,
}

pub const GGUF: Target = Target {
    name: "gguf",
    run: gguf::run,
    generate: gguf::generate,
    mutate: gguf::mutate,
    seeds: gguf::seeds,
    ci_cases: 8000,
};

pub const HF_MODEL: Target = Target {
    name: "hf_model",
    run: hf_model::run,
    generate: hf_model::generate,
    mutate: hf_model::mutate,
    seeds: hf_model::seeds,
    ci_cases: 15000,
};

pub const TOKENIZER: Target = Target {
    name: "tokenizer",
    run: tokenizer::run,
    generate: tokenizer::generate,
    mutate: tokenizer::mutate,
    seeds: tokenizer::seeds,
    ci_cases: 12000,
};

pub const CHAT_TEMPLATE: Target = Target {
    name: "chat_template",
    run: chat_template::run,
    generate: chat_template::generate,
    mutate: chat_template::mutate,
    seeds: chat_template::seeds,
    ci_cases: 10000,
};

pub const REQUESTS_FILE: Target = Target {
    name: "requests_file",
    run: requests_file::run,
    generate: requests_file::generate,
    mutate: requests_file::mutate,
    seeds: requests_file::seeds,
    ci_cases: 100000,
};

pub const TARGETS: [&Target; 5] = [&GGUF, &HF_MODEL, &TOKENIZER, &CHAT_TEMPLATE, &REQUESTS_FILE];

pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.into_iter().find(|t| t.name == name)
}

/// libFuzzer's custom mutator for `target`: half the time libFuzzer's own byte mutations
/// (`fallback`, which is `libfuzzer_sys::fuzzer_mutate`), else the target's structured one.
/// Deterministic in `seed`, as libFuzzer requires.
pub fn custom_mutate(
    target: &Target,
    data: &mut [u8],
    size: usize,
    max_size: usize,
    seed: u32,
    fallback: fn(&mut [u8], usize, usize) -> usize,
) -> usize {
    let mut rng = Rng::new(u64::from(seed));
    if rng.bool() {
        return fallback(data, size, max_size);
    }
    let out = (target.mutate)(&data[..size], &mut rng);
    let n = out.len().min(max_size).min(data.len());
    data[..n].copy_from_slice(&out[..n]);
    n
}
