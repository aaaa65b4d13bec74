#![no_main]
//! HF model directories (config.json, safetensors, tokenizer files) packed into one input:
//! the whole model load and a forward pass on the CPU.
//!
//! `cargo +nightly fuzz run hf_model`; see docs/reliability.md. The target and its structured
//! mutator live in crates/turbo-fuzz (`turbo_fuzz::hf_model`), where a bounded run of them is a
//! test on stable Rust.

use libfuzzer_sys::{fuzz_mutator, fuzz_target, fuzzer_mutate};

fuzz_target!(|data: &[u8]| turbo_fuzz::hf_model::run(data));

fuzz_mutator!(|data: &mut [u8], size: usize, max_size: usize, seed: u32| {
    turbo_fuzz::custom_mutate(
        &turbo_fuzz::HF_MODEL,
        data,
        size,
        max_size,
        seed,
        fuzzer_mutate,
    )
});
