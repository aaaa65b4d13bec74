#![no_main]
//! GGUF files: the reader (header, metadata, tensor directory), then the whole model load
//! (config, tokenizer, weights) and a forward pass on the CPU.
//!
//! `cargo +nightly fuzz run gguf`; see docs/reliability.md. The target and its structured
//! mutator live in crates/turbo-fuzz (`turbo_fuzz::gguf`), where a bounded run of them is a
//! test on stable Rust.

use libfuzzer_sys::{fuzz_mutator, fuzz_target, fuzzer_mutate};

fuzz_target!(|data: &[u8]| turbo_fuzz::gguf::run(data));

fuzz_mutator!(|data: &mut [u8], size: usize, max_size: usize, seed: u32| {
    turbo_fuzz::custom_mutate(
        &turbo_fuzz::GGUF,
        data,
        size,
        max_size,
        seed,
        fuzzer_mutate,
    )
});
