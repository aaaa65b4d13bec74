#![no_main]
//! Requests files (JSONL): one entry per non-blank line, numbered from 1.
//!
//! `cargo +nightly fuzz run requests_file`; see docs/reliability.md. The target and its structured
//! mutator live in crates/turbo-fuzz (`turbo_fuzz::requests_file`), where a bounded run of them is a
//! test on stable Rust.

use libfuzzer_sys::{fuzz_mutator, fuzz_target, fuzzer_mutate};

fuzz_target!(|data: &[u8]| turbo_fuzz::requests_file::run(data));

fuzz_mutator!(|data: &mut [u8], size: usize, max_size: usize, seed: u32| {
    turbo_fuzz::custom_mutate(
        &turbo_fuzz::REQUESTS_FILE,
        data,
        size,
        max_size,
        seed,
        fuzzer_mutate,
    )
});
