#![no_main]
//! Chat templates: arbitrary (mutated) Jinja sources, rendered and encoded over arbitrary
//! conversations.
//!
//! `cargo +nightly fuzz run chat_template`; see docs/reliability.md. The target and its structured
//! mutator live in crates/turbo-fuzz (`turbo_fuzz::chat_template`), where a bounded run of them is a
//! test on stable Rust.

use libfuzzer_sys::{fuzz_mutator, fuzz_target, fuzzer_mutate};

fuzz_target!(|data: &[u8]| turbo_fuzz::chat_template::run(data));

fuzz_mutator!(|data: &mut [u8], size: usize, max_size: usize, seed: u32| {
    turbo_fuzz::custom_mutate(
        &turbo_fuzz::CHAT_TEMPLATE,
        data,
        size,
        max_size,
        seed,
        fuzzer_mutate,
    )
});
