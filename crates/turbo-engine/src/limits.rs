//! Bounds on every size that a user (a flag, a request, a file) controls, checked before anything
//! is sized by it. A value past its bound is refused with one line naming the value and the
//! bound, never allocated, truncated or left to overflow later arithmetic.
//!
//! Where a bound comes from:
//! - what the code can represent: KV block ids are `u32`, attention kernels index keys and
//!   positions with 32-bit signed integers ([`MAX_CONTEXT`]);
//! - what the machine holds: KV blocks are checked against the device's free memory once the
//!   weights are loaded ([`crate::KvSize::num_blocks`]), CPU threads against its cores;
//! - what any real use needs, with a wide margin, where nothing else bounds a value before it
//!   sizes a buffer ([`MAX_BLOCK_SIZE`], [`MAX_BATCH`], [`MAX_BATCHED_TOKENS`]).

use crate::EngineError;
use std::io::Read;

/// Longest sequence, in tokens: positions and key counts are 32-bit signed integers on a GPU.
pub const MAX_CONTEXT: usize = i32::MAX as usize;

/// Largest KV block, in tokens (common sizes are 16 to 256; one block of a large model at this
/// size is already hundreds of megabytes).
pub const MAX_BLOCK_SIZE: usize = 1024;

/// Most ranks a model may be split over (a host has at most 8 or 16 GPUs; the CPU's ranks are
/// threads of one process, for tests).
pub const MAX_TENSOR_PARALLEL: usize = 64;

/// Most batch slots (sequences running at once).
pub const MAX_BATCH: usize = 1 << 16;

/// Most tokens in one forward pass: activation buffers are sized by it.
pub const MAX_BATCHED_TOKENS: usize = 1 << 16;

/// Most bytes of a prompt read from a file or a chat line when the model's own bound is not
/// tighter (see [`crate::Engine::max_prompt_bytes`]).
pub const MAX_PROMPT_BYTES: u64 = 64 << 20;

/// Largest requests file (`--prompts-file`).
pub const MAX_REQUESTS_FILE_BYTES: u64 = 1 << 30;

/// CPU threads that can run at once on this machine: more only time-slice the same cores, and
/// every step waits for the slowest of them.
pub fn max_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `value` of the setting `name`, if it is within `1..=max`.
pub fn check_positive(name: &str, value: usize, max: usize) -> Result<usize, EngineError> {
    if value == 0 {
        return Err(EngineError::Config(format!("{name} must be positive")));
    }
    if value > max {
        return Err(EngineError::Config(format!(
            "{name} of {value} is more than the {max} allowed"
        )));
    }
    Ok(value)
}

/// Why a bounded read failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("is longer than {limit} bytes")]
    TooLong { limit: u64 },
    #[error("is not UTF-8 text (invalid byte at offset {offset})")]
    NotUtf8 { offset: usize },
}

/// Reads all of `reader` as UTF-8 text, refusing it once it passes `limit` bytes: never holds
/// more than `limit + 1` bytes, whatever the source (a pipe, `/dev/zero`, a huge file).
pub fn read_text_bounded(reader: impl Read, limit: u64) -> Result<String, ReadError> {
    let mut bytes = Vec::new();
    reader
        .take(limit.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(ReadError::TooLong { limit });
    }
    String::from_utf8(bytes).map_err(|e| ReadError::NotUtf8 {
        offset: e.utf8_error().valid_up_to(),
    })
}

/// [`read_text_bounded`] of a file.
pub fn read_file_bounded(path: &std::path::Path, limit: u64) -> Result<String, ReadError> {
    read_text_bounded(std::fs::File::open(path)?, limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_reads_stop_at_the_limit() {
        assert_eq!(read_text_bounded(&b"abc"[..], 3).unwrap(), "abc");
        assert!(matches!(
            read_text_bounded(&b"abcd"[..], 3),
            Err(ReadError::TooLong { limit: 3 })
        ));
        // An endless source is refused after limit + 1 bytes.
        assert!(matches!(
            read_text_bounded(std::io::repeat(0), 1 << 20),
            Err(ReadError::TooLong { .. })
        ));
        assert!(matches!(
            read_text_bounded(&b"ok\xff"[..], 10),
            Err(ReadError::NotUtf8 { offset: 2 })
        ));
    }

    #[test]
    fn positive_settings_name_value_and_bound() {
        assert_eq!(check_positive("the block size", 16, 1024).unwrap(), 16);
        assert_eq!(check_positive("the block size", 1024, 1024).unwrap(), 1024);
        let e = check_positive("the block size", 1025, 1024).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the block size of 1025 is more than the 1024 allowed"
        );
        let e = check_positive("the block size", 0, 1024).unwrap_err();
        assert_eq!(e.to_string(), "the block size must be positive");
    }
}
