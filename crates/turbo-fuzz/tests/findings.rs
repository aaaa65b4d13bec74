//! Reproductions of the fuzzers' findings (docs/reliability.md, "Findings"), one test each,
//! asserting what should happen: regression tests now that they are fixed. A new finding joins
//! them `#[ignore]`d while it is open.
//!
//! Inputs that abort or hang run in a child process (`turbo-fuzz repro`, under the fuzzers'
//! allocation limits) with a time limit, so that the test reports instead of dying.

use serde_json::{json, Value};
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use turbo_fuzz::hf_model::{seed_sets, FileSet};
use turbo_tokenizer::{ChatMessage, ChatTemplate};

/// Runs `input` through `target` in a child process; `Err` with what went wrong, if anything.
fn repro(target: &str, input: &[u8], limit: Duration) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("input.bin");
    std::fs::write(&file, input).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_turbo-fuzz"))
        .args(["repro", target])
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            let head: String = err.lines().take(6).collect::<Vec<_>>().join("\n");
            return match status.success() {
                true => Ok(()),
                false => Err(format!("{status}:\n{head}")),
            };
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("still running after {} s", limit.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `chat_template` input: the template and one user message.
fn chat(source: &str, content: &str) -> Vec<u8> {
    [
        &[1u8][..],
        source.as_bytes(),
        b"",
        b"",
        b"user",
        content.as_bytes(),
    ]
    .join(&0xffu8)
}

fn assert_template_returns(source: &str) {
    if let Err(e) = repro(
        "chat_template",
        &chat(source, "hi"),
        Duration::from_secs(20),
    ) {
        panic!("rendering {source:?} should give a string or an error, not:\n{e}");
    }
}

/// F1: `tojson(indent=u64::MAX)` overflows `indent × level` (a capacity-overflow panic).
#[test]
fn f1_tojson_huge_indent_panics() {
    assert_template_returns("{{ messages | tojson(indent=18446744073709551615) }}");
}

/// F1: `tojson(indent=10^12)` asks for a terabyte of spaces (an abort).
#[test]
fn f1_tojson_large_indent_aborts() {
    assert_template_returns("{{ messages | tojson(indent=1000000000000) }}");
}

/// F1: minijinja's `divisibleby(0)` divides by zero (a panic, in release builds too).
#[test]
fn f1_divisibleby_zero_panics() {
    assert_template_returns("{{ 10 is divisibleby(0) }}");
}

/// F1: minijinja filters that allocate in proportion to a number in the template.
#[test]
fn f1_filters_allocate_without_bound() {
    for source in [
        "{{ 'a' | indent(1000000000000) }}",
        "{{ '%999999999999d' | format(1) }}",
        "{{ ([1, 2] * 1000000000000) | list }}",
        "{% for i in range(100000) %}{{ 'x' * 90000000 }}{% endfor %}",
    ] {
        assert_template_returns(source);
    }
}

/// F2: loops whose length is a number in the template run for hours.
#[test]
fn f2_templates_hang() {
    for source in [
        "{% for i in [1, 2] * 1000000000000 %}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    ] {
        assert_template_returns(source);
    }
}

/// The first seed HF model, with `edit` applied to its `tokenizer.json` text.
fn hf_with_tokenizer(edit: impl FnOnce(String) -> String) -> Vec<u8> {
    let seed = &seed_sets()[0];
    let mut set = FileSet::decode(&seed.encode());
    let text = String::from_utf8(set.get(2).unwrap().to_vec()).unwrap();
    set.set(2, edit(text).into_bytes());
    set.encode()
}

fn json_edit(text: String, f: impl FnOnce(&mut Value)) -> String {
    let mut v: Value = serde_json::from_str(&text).unwrap();
    f(&mut v);
    v.to_string()
}

/// F3: a `tokenizer.json` whose vocabulary gives a special token an id past the embedding
/// loads, and encoding the token's text makes that id.
#[test]
fn f3_token_ids_past_the_embedding_load() {
    let input = hf_with_tokenizer(|t| {
        json_edit(t, |v| {
            v["model"]["vocab"]["<|im_start|>"] = json!(2147483648u64)
        })
    });
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in FileSet::decode(&input).files() {
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    if let Ok(model) = turbo_llama::LoadedModel::load(dir.path()) {
        let ids = model.tokenizer.encode("<|im_start|>user").unwrap();
        panic!(
            "loaded, with {} embedding rows; \"<|im_start|>user\" encodes to {ids:?}",
            model.config.vocab_size
        );
    }
}

/// F4: `tokenizers` panics on a BPE `continuing_subword_prefix` longer than a merge's second
/// token, and `LoadedModel::load` with it.
#[test]
fn f4_subword_prefix_panics() {
    let input = hf_with_tokenizer(|t| {
        json_edit(t, |v| v["model"]["continuing_subword_prefix"] = json!("##"))
    });
    if let Err(e) = repro("hf_model", &input, Duration::from_secs(20)) {
        panic!("loading should fail with an error, not:\n{e}");
    }
}

/// F4: `tokenizers` panics on a `tokenizer.json` cut short inside its `decoder`.
#[test]
fn f4_truncated_decoder_panics() {
    let input = hf_with_tokenizer(|t| {
        let at = t.find("\"decoder\"").expect("a decoder") + "\"decoder\":{\"type\":\"By".len();
        t[..at].to_string()
    });
    if let Err(e) = repro("hf_model", &input, Duration::from_secs(20)) {
        panic!("loading should fail with an error, not:\n{e}");
    }
}

/// F5 (fixed): a template that looks at the content no longer sees `encode`'s marks: the prompt
/// `encode` makes is the one `render` gives. A template that drops or transforms the content is
/// refused by `encode` (its content cannot be told from its markup), never encoded as trusted.
#[test]
fn f5_encode_differs_from_render() {
    let tok = turbo_tests::vocab::tiny_tokenizer(300);
    for source in [
        "{% for m in messages %}{% if m.content.startswith('/') %}cmd:{% endif %}{{ m.content }}{% endfor %}",
        "{% for m in messages %}{% if m.content | length > 3 %}long:{% endif %}{{ m.content }}{% endfor %}",
    ] {
        let t = ChatTemplate::new(source, "", "").unwrap();
        let messages = [ChatMessage::new("user", "/help")];
        let rendered = t.render(&messages, false).unwrap();
        let encoded = tok.decode(&t.encode(&tok, &messages, false).unwrap()).unwrap();
        assert_eq!(encoded, rendered, "{source}");
    }
    for (dropped, content) in [
        (
            "{% for m in messages %}{% if m.content == '/help' %}help{% endif %}{% endfor %}",
            "/help",
        ),
        (
            "{% for m in messages %}{{ m.content | length }}{% endfor %}",
            "/help",
        ),
    ] {
        let t = ChatTemplate::new(dropped, "", "").unwrap();
        let messages = [ChatMessage::new("user", content)];
        assert!(
            matches!(
                t.encode(&tok, &messages, false),
                Err(turbo_tokenizer::chat::ChatError::Content)
            ),
            "{dropped}"
        );
    }
}

/// The repro inputs are the targets' own format: a seed model loads.
#[test]
fn hf_seed_input_loads() {
    let input = hf_with_tokenizer(|t| t);
    repro("hf_model", &input, Duration::from_secs(60)).unwrap();
    assert!(Path::new(env!("CARGO_BIN_EXE_turbo-fuzz")).exists());
}
