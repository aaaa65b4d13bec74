//! Reading and writing GGUF files (versions 2 and 3, little-endian), the format of ggml and
//! llama.cpp models.
//!
//! [`GgufFile`] memory-maps a file and parses only its header, metadata and tensor directory; tensor
//! data stays in the page cache and is handed out as [`turbo_core::Bytes`] windows. Every count and
//! offset read from the file is checked against the bytes actually present before it is used, so a
//! corrupt or truncated file gives a [`GgufError`] rather than a panic or a huge allocation. No two
//! tensors' data may overlap, and messages show keys and names from the file escaped.
//! [`GgufWriter`] produces files laid out the way llama.cpp writes them, for tests and converters.

mod error;
mod read;
mod value;
mod write;

pub use error::{Escaped, GgufError};
pub use read::{GgufFile, TensorInfo};
pub use value::MetaValue;
pub use write::GgufWriter;

/// Alignment of the data section and of every tensor in it when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u32 = 32;

/// The key through which a file overrides [`DEFAULT_ALIGNMENT`].
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// ggml's `GGML_MAX_DIMS`: no reader accepts tensors with more dimensions.
pub const MAX_DIMS: usize = 4;

const MAGIC: &[u8; 4] = b"GGUF";

fn align_up(n: u64, alignment: u64) -> Option<u64> {
    n.checked_next_multiple_of(alignment)
}
