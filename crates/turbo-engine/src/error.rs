use thiserror::Error;

/// Why an engine could not be made, or a model loaded.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error("{0}")]
    Config(String),
    #[error("cannot fetch the default model: {0}")]
    Fetch(#[from] turbo_models::FetchError),
    #[error("cannot load model {path}: {error}")]
    Load {
        path: String,
        error: turbo_llama::LlamaError,
    },
    #[error(transparent)]
    Model(#[from] turbo_llama::LlamaError),
    #[error(transparent)]
    Backend(#[from] turbo_core::BackendError),
    #[error(transparent)]
    Batch(#[from] turbo_scheduler::BatchError),
    #[error(transparent)]
    Tokenizer(#[from] turbo_tokenizer::TokenizerError),
    #[error(transparent)]
    Chat(#[from] turbo_tokenizer::ChatError),
    /// The model's chat template did not compile when the engine started.
    #[error("{0}")]
    Template(String),
    /// The steps run before serving failed (`EngineConfig::warm_up`).
    #[error("the warm-up before serving failed: {0} (--no-warm-up skips it)")]
    WarmUp(String),
    #[error(
        "the prompt is {bytes} bytes of text, more than a prompt within the model's context of \
         {context} tokens can be ({limit} bytes)"
    )]
    PromptTextTooLong {
        bytes: u64,
        limit: u64,
        context: usize,
    },
    #[error(
        "the prompt has more than {at_least} tokens, more than the model's context of {context}"
    )]
    PromptTooManyTokens { at_least: usize, context: usize },
    #[error("the engine thread stopped before the model was loaded")]
    Stopped,
}

/// Why [`Engine::submit`](crate::Engine::submit) refused a request. The request was not queued.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum SubmitError {
    /// The request can never run here (empty or too long a prompt, bad sampling parameters,
    /// more KV than the whole cache).
    #[error(transparent)]
    Invalid(#[from] turbo_scheduler::RequestError),
    #[error("the engine is at capacity ({0} requests running or queued); retry later")]
    QueueFull(usize),
    #[error("the engine is shutting down")]
    ShuttingDown,
    #[error("the engine has stopped")]
    Stopped,
}
