#![no_main]
//! Tokenizers: encode, encode_untrusted, decode and streaming on arbitrary text and ids.
//!
//! `cargo +nightly fuzz run tokenizer`; see docs/reliability.md. The target and its structured
//! mutator live in crates/turbo-fuzz (`turbo_fuzz::tokenizer`), where a bounded run of them is a
//! test on stable Rust.

use libfuzzer_sys::{fuzz_mutator, fuzz_target, fuzzer_mutate};

fuzz_target!(|data: &[u8]| turbo_fuzz::tokenizer::run(data));

fuzz_mutator!(|data: &mut [u8], size: usize, max_size: usize, seed: u32| {
    turbo_fuzz::custom_mutate(
        &turbo_fuzz::TOKENIZER,
        data,
        size,
        max_size,
        seed,
        fuzzer_mutate,
    )
});
