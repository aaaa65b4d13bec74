//! Seeds the mutators start from: tiny random LLaMA models as `turbo-tests` writes them, the
//! default model's tokenizer, header and chat template where this machine has them, real chat
//! templates, and texts. Each is made once per process.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use turbo_tests::TinySpec;
use turbo_tokenizer::TextTokenizer;

/// The SmolLM2 vocabulary as GGUF metadata in JSON, where the development machines keep it.
const SMOLLM2_VOCAB_JSON_GZ: &str = "/work/shared/tools/smollm2-tokenizer.json.gz";

/// Overrides the default model's path (`TURBO_FUZZ_MODEL=/path/model.gguf`), or turns it off
/// (`TURBO_FUZZ_MODEL=none`).
const MODEL_ENV: &str = "TURBO_FUZZ_MODEL";

/// A tiny model's shape: the smallest vocabulary the tiny tokenizer allows, rows of one
/// 32-element block so every quantized type fits, and `layers`, `kv_heads`, `tied` as given.
pub fn tiny_spec(layers: usize, kv_heads: usize, tied: bool, seed: u64) -> TinySpec {
    TinySpec {
        vocab: turbo_tests::vocab::MIN_VOCAB,
        hidden: 32,
        layers,
        heads: 2,
        kv_heads,
        ffn: 64,
        rope_theta: 10000.0,
        eps: 1e-5,
        context: 64,
        tied,
        seed,
    }
}

/// The default model's GGUF file, if it is on this machine already (it is never fetched here).
pub fn default_model_path() -> Option<&'static Path> {
    static PATH: OnceLock<Option<PathBuf>> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Some(p) = std::env::var_os(MODEL_ENV) {
            return (p != "none").then(|| PathBuf::from(p));
        }
        let m = turbo_models::DEFAULT_MODEL;
        let path = m.path().ok()?;
        std::fs::metadata(&path)
            .is_ok_and(|meta| meta.len() == m.size)
            .then_some(path)
    })
    .as_deref()
}

/// The default model's chat template source, if the model is here.
fn real_chat_template() -> Option<String> {
    let file = turbo_gguf::GgufFile::open(default_model_path()?).ok()?;
    file.get_str("tokenizer.chat_template")
        .ok()
        .map(str::to_string)
}

/// A tokenizer the tokenizer and chat targets run, with its special tokens.
pub struct SeedTokenizer {
    pub name: &'static str,
    pub tokenizer: TextTokenizer,
    /// Texts of the special tokens (the ones `encode_untrusted` keeps out of untrusted text).
    pub specials: Vec<String>,
    pub special_ids: BTreeSet<u32>,
    /// `tokenizer.vocab_size()`, kept: it builds the whole vocabulary map on each call.
    pub vocab: usize,
    /// Whether the tokenizer is byte-level BPE without a normalizer (as GGUF vocabularies and
    /// their `tokenizer.json` build): then the tokens of a text are its bytes, less those the
    /// vocabulary has no token for.
    pub byte_level: bool,
    /// Which bytes have a token of their own. SmolLM2's vocabulary lacks 21 (0x04, 0x06, 0x13,
    /// 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, 0xF5..=0xFF): byte-level BPE without an unknown
    /// token drops those bytes, so `decode(encode(text)) == text` holds only for text without
    /// them (as in HF transformers).
    pub byte_has_token: [bool; 256],
}

impl SeedTokenizer {
    fn new(name: &'static str, tokenizer: TextTokenizer, byte_level: bool) -> Self {
        let mut specials = Vec::new();
        let mut special_ids = BTreeSet::new();
        for (id, token) in tokenizer.inner().get_added_tokens_decoder() {
            if token.special && !token.content.is_empty() {
                specials.push(token.content.clone());
                special_ids.insert(id);
            }
        }
        specials.sort();
        let mut byte_has_token = [false; 256];
        for (b, c) in turbo_tests::vocab::byte_chars().into_iter().enumerate() {
            byte_has_token[b] = tokenizer.token_id(&c.to_string()).is_some();
        }
        SeedTokenizer {
            name,
            vocab: tokenizer.vocab_size(),
            tokenizer,
            specials,
            special_ids,
            byte_level,
            byte_has_token,
        }
    }
}

/// The tiny GGUF-built tokenizer, the same saved as `tokenizer.json` and loaded back (the HF
/// path), and SmolLM2's real one (49,152 tokens) where this machine has it.
pub fn tokenizers() -> &'static [SeedTokenizer] {
    static TOKENIZERS: OnceLock<Vec<SeedTokenizer>> = OnceLock::new();
    TOKENIZERS.get_or_init(|| {
        let tiny = turbo_tests::vocab::tiny_tokenizer(300);
        let dir = tempfile::tempdir().expect("a temporary directory");
        tiny.save(&dir.path().join("tokenizer.json"))
            .expect("saving tokenizer.json");
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": true}"#,
        )
        .expect("writing tokenizer_config.json");
        let hf = TextTokenizer::from_hf_dir(dir.path()).expect("the tiny tokenizer.json loads");
        let mut out = vec![
            SeedTokenizer::new("tiny-gguf", tiny, true),
            SeedTokenizer::new("tiny-hf", hf, true),
        ];
        if let Some(real) = smollm2_tokenizer() {
            out.push(SeedTokenizer::new("smollm2", real, true));
        }
        out
    })
}

/// SmolLM2's tokenizer: from the shared vocabulary JSON, else from the default model's file.
fn smollm2_tokenizer() -> Option<TextTokenizer> {
    if Path::new(SMOLLM2_VOCAB_JSON_GZ).exists() {
        let out = std::process::Command::new("gzip")
            .arg("-dc")
            .arg(SMOLLM2_VOCAB_JSON_GZ)
            .output()
            .ok()?;
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        let strs = |k: &str| -> Option<Vec<String>> {
            j[k].as_array()?
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect()
        };
        let id = |k: &str| j.get(k).and_then(|v| v.as_u64()).map(|v| v as u32);
        let vocab = turbo_tokenizer::GgufVocab {
            model: j["tokenizer.ggml.model"].as_str()?.into(),
            pre: j["tokenizer.ggml.pre"].as_str().map(Into::into),
            tokens: strs("tokenizer.ggml.tokens")?,
            token_types: j["tokenizer.ggml.token_type"]
                .as_array()?
                .iter()
                .map(|v| v.as_i64().map(|t| t as i32))
                .collect::<Option<_>>()?,
            merges: strs("tokenizer.ggml.merges")?,
            bos_id: id("tokenizer.ggml.bos_token_id"),
            eos_id: id("tokenizer.ggml.eos_token_id"),
            add_bos: j
                .get("tokenizer.ggml.add_bos_token")
                .and_then(|v| v.as_bool()),
            eot_id: id("tokenizer.ggml.eot_token_id"),
            eom_id: id("tokenizer.ggml.eom_token_id"),
        };
        return TextTokenizer::from_gguf_vocab(&vocab).ok();
    }
    let model = turbo_llama::LoadedModel::load(default_model_path()?).ok()?;
    Some(model.tokenizer)
}

/// What a report says about the optional seeds.
pub fn describe() -> String {
    let names: Vec<String> = tokenizers()
        .iter()
        .map(|t| {
            let missing = t.byte_has_token.iter().filter(|&&has| !has).count();
            format!(
                "{} ({} tokens, {missing} bytes without one)",
                t.name, t.vocab
            )
        })
        .collect();
    format!(
        "tokenizers: {}; default model: {}",
        names.join(", "),
        default_model_path().map_or("absent (its seeds are skipped)".into(), |p| p
            .display()
            .to_string())
    )
}

/// Chat templates of real models (some abridged), written the ways model authors write them.
pub const TEMPLATES: &[&str] = &[
    // SmolLM2.
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    // ChatML.
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    // Llama 3.
    "{{- bos_token }}\n{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content']|trim %}\n    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = \"\" %}\n{%- endif %}\n{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n{{- system_message }}\n{{- \"<|eot_id|>\" }}\n{%- for message in messages %}\n    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n",
    // Mistral: roles must alternate.
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}",
    // Gemma.
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}",
    // Qwen3 (abridged): reasoning cut from assistant turns, tool responses grouped.
    "{%- for message in messages %}\n    {%- if message.role == \"user\" or message.role == \"system\" %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == \"assistant\" %}\n        {%- set content = message.content %}\n        {%- if '</think>' in content %}\n            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n        {%- endif %}\n        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n",
    // A namespace, a filtered loop, filters and Python string methods.
    "{% set ns = namespace(system='') %}{% for m in messages %}{% if m.role == 'system' %}{% set ns.system = m.content %}{% endif %}{% endfor %}{{ ns.system }}{% for m in messages if m.role != 'system' %}{{ m.role | upper }}: {% if m.content.startswith('/') %}cmd {% endif %}{{ m.content | trim }}\n{% endfor %}{{ eos_token }}",
    // JSON of the conversation (tool-calling templates do this).
    "{{ bos_token }}{{ messages | tojson }}{% for m in messages %}{{ m | tojson(indent=2) }}{{ m.content | length }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
];

/// The templates to mutate: [`TEMPLATES`] and the default model's own, where present.
pub fn templates() -> &'static [String] {
    static ALL: OnceLock<Vec<String>> = OnceLock::new();
    ALL.get_or_init(|| {
        let mut all: Vec<String> = TEMPLATES.iter().map(|t| t.to_string()).collect();
        all.extend(real_chat_template());
        all
    })
}

/// Texts the tokenizer golden files hold (transformers' reference strings), and a few more.
pub fn texts() -> &'static [String] {
    static TEXTS: OnceLock<Vec<String>> = OnceLock::new();
    TEXTS.get_or_init(|| {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/tokenizer_strings.json");
        let mut texts: Vec<String> = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|j| {
                j["strings"].as_array().map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(str::to_string))
                        .collect()
                })
            })
            .unwrap_or_default();
        texts.extend(crate::text::FRAGMENTS.iter().map(|s| s.to_string()));
        texts
    })
}
