use thiserror::Error;
use turbo_gguf::Escaped;

/// Everything that can go wrong between a model path and a forward pass.
///
/// Names and messages often quote a model file (tensor names, config values, parser messages),
/// so every text field is shown [`Escaped`]: a hostile file cannot send control characters to
/// the terminal that prints the error.
#[derive(Debug, Error)]
pub enum LlamaError {
    #[error("{}: {error}", Escaped(path))]
    Io { path: String, error: std::io::Error },
    #[error(transparent)]
    Gguf(#[from] turbo_gguf::GgufError),
    #[error("{}: invalid safetensors file: {}", Escaped(file), Escaped(reason))]
    Safetensors { file: String, reason: String },
    #[error("{}", Escaped(.0))]
    Config(String),
    #[error("the model has no tensor '{}'", Escaped(.0))]
    MissingTensor(String),
    #[error(
        "tensor '{}' has shape {}, expected {}",
        Escaped(name),
        Escaped(found),
        Escaped(expected)
    )]
    Shape {
        name: String,
        found: String,
        expected: String,
    },
    #[error(
        "tensor '{}' has type {}, which Turbo does not support here (supported: {supported})",
        Escaped(name),
        Escaped(dtype)
    )]
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
    #[error("{}", Escaped(.0))]
    Format(String),
}

pub type Result<T, E = LlamaError> = std::result::Result<T, E>;

pub(crate) fn io_err(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> LlamaError + '_ {
    move |error| LlamaError::Io {
        path: path.display().to_string(),
        error,
    }
}
