//! Text in and out of a model, for any model family: the tokenizer (`TextTokenizer`, built from a
//! Hugging Face `tokenizer.json` or a GGUF vocabulary), incremental detokenization for streaming
//! (`TextStream`), and chat templates (`ChatTemplate`) rendered as HF transformers renders them.
//! It knows nothing of weights or backends.

pub mod chat;
mod contain;
pub mod files;
pub mod tokenizer;

pub use chat::{ChatError, ChatMessage, ChatTemplate, MAX_RENDERED_ITEMS};
pub use files::{read_model_text, MODEL_TEXT_LIMIT};
pub use tokenizer::{GgufVocab, TextStream, TextTokenizer, TokenizerError};
