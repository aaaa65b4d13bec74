use std::path::PathBuf;
use turbo_core::DType;

/// Everything that can go wrong reading a GGUF file or looking things up in it.
///
/// Messages name the key, tensor or byte offset involved, since they usually end up in front of a
/// user holding a model file Turbo cannot load.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read '{}': {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("not a GGUF file: it starts with {found:02x?} instead of \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("GGUF version {0} is not supported (only versions 2 and 3 are)")]
    UnsupportedVersion(u32),
    #[error("file is truncated: {what} at offset {offset} runs past the end")]
    Truncated { what: String, offset: u64 },
    #[error("corrupt GGUF file: {0}")]
    Corrupt(String),
    #[error("metadata key '{0}' is missing")]
    MissingKey(String),
    #[error("metadata key '{key}' has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("tensor '{0}' is not in the file")]
    MissingTensor(String),
    #[error(
        "tensor '{tensor}' has type {type_name}, which Turbo does not support (supported: {})",
        supported_types()
    )]
    UnsupportedTensorType { tensor: String, type_name: String },
    #[error("tensor '{tensor}' has an unusable shape: {reason}")]
    BadShape { tensor: String, reason: String },
}

fn supported_types() -> String {
    DType::ALL.map(DType::name).join(", ")
}

impl GgufError {
    /// Says which part of the file a low-level read failure belongs to; the cursor that detects
    /// it only knows the offset.
    pub(crate) fn within(self, context: &str) -> Self {
        match self {
            GgufError::Truncated { what, offset } => GgufError::Truncated {
                what: format!("{what} of {context}"),
                offset,
            },
            GgufError::Corrupt(msg) => GgufError::Corrupt(format!("{context}: {msg}")),
            other => other,
        }
    }
}
