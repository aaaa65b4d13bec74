use thiserror::Error;

/// Everything that can go wrong between a model path and a forward pass.
#[derive(Debug, Error)]
pub enum LlamaError {
    #[error("{path}: {error}")]
    Io { path: String, error: std::io::Error },
    #[error(transparent)]
    Gguf(#[from] turbo_gguf::GgufError),
    #[error("{file}: invalid safetensors file: {reason}")]
    Safetensors { file: String, reason: String },
    #[error("{0}")]
    Config(String),
    #[error("the model has no tensor '{0}'")]
    MissingTensor(String),
    #[error("tensor '{name}' has shape {found}, expected {expected}")]
    Shape {
        name: String,
        found: String,
        expected: String,
    },
    #[error("tensor '{name}' has type {dtype}, which Turbo does not support here (supported: {supported})")]
    UnsupportedDtype {
        name: String,
        dtype: String,
        supported: &'static str,
    },
    #[error(transparent)]
    Tokenizer(#[from] turbo_tokenizer::tokenizer::TokenizerError),
    #[error(transparent)]
    Chat(#[from] turbo_tokenizer::chat::ChatError),
    #[error(transparent)]
    Backend(#[from] turbo_core::BackendError),
    #[error("{0}")]
    Format(String),
}

pub type Result<T, E = LlamaError> = std::result::Result<T, E>;

pub(crate) fn io_err(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> LlamaError + '_ {
    move |error| LlamaError::Io {
        path: path.display().to_string(),
        error,
    }
}
