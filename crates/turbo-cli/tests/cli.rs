//! The real `turbo` binary on tiny models written to temporary directories: bad inputs must give
//! a non-zero exit and a one-line `error: ...` that says what is wrong (never a panic), and the
//! happy paths must produce what scripts rely on.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use turbo_tests::files::{gguf_metadata, gguf_tensors, gguf_writer};
use turbo_tests::{write_gguf, write_hf, DType, TinySpec, TinyWeights};

#[test]
fn missing_model_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.gguf");
    let line = expect_error(&generate_args(p(&missing), &[]), "No such file");
    assert!(line.contains("nope.gguf"), "{line}");
    expect_error(&["info", "--model", p(&missing)], "No such file");
}

#[test]
fn directory_that_is_not_a_model() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("README.md"), "not a model").unwrap();
    expect_error(&generate_args(p(dir.path()), &[]), "not a model");
}

#[test]
fn bad_gguf_magic() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(
        &path,
        b"GGML\x03\x00\x00\x00 and then some more bytes of nothing",
    )
    .unwrap();
    expect_error(&generate_args(p(&path), &[]), "not a GGUF file");
    std::fs::write(&path, b"").unwrap();
    expect_error(&["info", "--model", p(&path)], "truncated");
}

#[test]
fn truncated_gguf() {
    let (dir, path) = gguf_fixture(64);
    let bytes = std::fs::read(&path).unwrap();
    let file = turbo_gguf::GgufFile::open(&path).unwrap();
    let data_start = file.data_offset() as usize;
    // The tensor directory starts with the first tensor's name, after its u64 length.
    let name = b"token_embd.weight";
    let dir_start = bytes.windows(name.len()).position(|w| w == name).unwrap() - 8;
    // The metadata: halfway through the token list.
    let tokens = bytes
        .windows(b"<|im_end|>".len())
        .position(|w| w == b"<|im_end|>")
        .unwrap();
    let last = file.tensors().last().unwrap();
    let last_end = data_start + last.offset as usize + 300 * 68; // output.weight, Q8_0
    assert!(last_end <= bytes.len() && bytes.len() - last_end < 32);
    assert!(tokens > 24 && tokens < dir_start && dir_start < data_start);
    for (what, cut) in [
        ("header", 10),
        ("header", 20),
        ("metadata", tokens + 300),
        ("metadata", dir_start - 3),
        ("tensor directory", dir_start + 5),
        ("tensor directory", data_start - 20),
        ("tensor data", data_start + 100),
        ("tensor data", data_start + last.offset as usize + 1),
        // The last byte of the last tensor (the file may end in padding after it).
        ("tensor data", last_end - 1),
    ] {
        let cut_path = dir.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&cut_path, &bytes[..cut]).unwrap();
        let line = expect_error(&generate_args(p(&cut_path), &[]), "truncated");
        eprintln!("{what} at {cut}: {line}");
    }
}

#[test]
fn unsupported_tensor_type() {
    // Rows of 256 elements, so an IQ2_XXS tensor (66-byte blocks of 256) has a plausible size.
    let s = TinySpec {
        ffn: 256,
        ..spec(64)
    };
    let (mut tensors, _) = gguf_tensors(&s, &TinyWeights::random(&s), DType::F16);
    let down = tensors
        .iter_mut()
        .find(|t| t.name == "blk.0.ffn_down.weight")
        .unwrap();
    assert_eq!(down.dims, [256, 64]);
    down.ggml_type = 16; // GGML_TYPE_IQ2_XXS
    down.data = (0..64 * 66).map(|i| (i * 7 % 251) as u8).collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("k.gguf");
    gguf_writer(&gguf_metadata(&s), &tensors)
        .write(&path)
        .unwrap();
    let line = expect_error(&generate_args(p(&path), &[]), "IQ2_XXS");
    assert!(line.contains("blk.0.ffn_down.weight"), "{line}");
    expect_error(&["info", "--model", p(&path)], "IQ2_XXS");
}

#[test]
fn unsupported_architecture() {
    let s = spec(64);
    let mut meta = gguf_metadata(&s);
    for (k, v) in &mut meta {
        if k == "general.architecture" {
            *v = "gpt2".into();
        }
    }
    let (tensors, _) = gguf_tensors(&s, &TinyWeights::random(&s), DType::F32);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt2.gguf");
    gguf_writer(&meta, &tensors).write(&path).unwrap();
    let line = expect_error(&generate_args(p(&path), &[]), "architecture");
    assert!(line.contains("gpt2"), "{line}");
}

fn hf_fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(64);
    write_hf(dir.path(), &s, &TinyWeights::random(&s), DType::BF16);
    dir
}

#[test]
fn hf_happy_path() {
    let dir = hf_fixture();
    let out = turbo(&["info", "--model", p(dir.path())], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("HF safetensors"));
    let out = turbo(
        &generate_args(p(dir.path()), &["--max-tokens", "3", "--json"]),
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn hf_malformed_config() {
    let dir = hf_fixture();
    std::fs::write(dir.path().join("config.json"), "{\"hidden_size\": 64,").unwrap();
    expect_error(&generate_args(p(dir.path()), &[]), "config.json");
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type": "llama", "hidden_size": "big"}"#,
    )
    .unwrap();
    expect_error(&generate_args(p(dir.path()), &[]), "config.json");
}

#[test]
fn hf_missing_tokenizer() {
    let dir = hf_fixture();
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    expect_error(&generate_args(p(dir.path()), &[]), "tokenizer.json");
}

#[test]
fn hf_truncated_safetensors() {
    let dir = hf_fixture();
    let st = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for cut in [4, 8 + header / 2, 8 + header + 10, bytes.len() - 1] {
        std::fs::write(&st, &bytes[..cut]).unwrap();
        let line = expect_error(&generate_args(p(dir.path()), &[]), "safetensors");
        eprintln!("cut at {cut}: {line}");
    }
}

#[test]
fn prompt_longer_than_context() {
    let (_dir, path) = gguf_fixture(32);
    let prompt = vec!["word"; 100].join(" ");
    let args = ["generate", "--model", p(&path), "--prompt", &prompt];
    expect_error(&args, "context");
    // Text within the byte bound of a long context but far past it in tokens is refused after
    // counting its first pieces, not tokenized whole (which would take GBs).
    let (_dir, path) = gguf_fixture(1 << 16);
    let prompt = vec!["word"; 200_000].join(" ");
    let prompt_file = _dir.path().join("long.txt");
    std::fs::write(&prompt_file, &prompt).unwrap();
    let args = [
        "generate",
        "--device",
        "cpu",
        "--model",
        p(&path),
        "--prompt-file",
        p(&prompt_file),
    ];
    let line = expect_error(&args, "the prompt has more than");
    assert!(line.contains("context of 65536"), "{line}");
}

/// eval-kv reads a text's head, which may hold more tokens than the context, and keeps the
/// first prompt + eval tokens of it: a long text is not refused as a prompt would be.
#[test]
fn eval_kv_reads_the_head_of_a_text_longer_than_the_context() {
    let (dir, path) = gguf_fixture(4096);
    let long = dir.path().join("long.txt");
    std::fs::write(&long, vec!["word"; 200_000].join(" ")).unwrap();
    let out = turbo(
        &[
            "eval-kv",
            "--device",
            "cpu",
            "--model",
            p(&path),
            "--text",
            p(&long),
            "--prompt-tokens",
            "3000",
            "--eval-tokens",
            "4",
            "--policies",
            "window",
            "--budgets",
            "0.5",
            "--json",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).lines().count(),
        2,
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn missing_prompt_file() {
    let (dir, path) = gguf_fixture(64);
    let missing = dir.path().join("prompt.txt");
    let args = [
        "generate",
        "--model",
        p(&path),
        "--prompt-file",
        p(&missing),
    ];
    let line = expect_error(&args, "prompt file");
    assert!(line.contains("prompt.txt"), "{line}");
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let args = ["generate", "--model", p(&path), "--prompt-file", p(&empty)];
    expect_error(&args, "empty");
}

#[test]
fn bad_flags() {
    let (_dir, path) = gguf_fixture(64);
    let model = p(&path);
    expect_usage_error(&generate_args(model, &["--temperature", "abc"]));
    expect_usage_error(&generate_args(model, &["--frobnicate"]));
    expect_usage_error(&generate_args(model, &["--max-tokens", "-1"]));
    expect_usage_error(&["generate", "--model", model]); // no prompt
    expect_usage_error(&["frobnicate"]);
    let out = turbo(&generate_args(model, &["--temperature", "abc"]), None);
    assert_eq!(out.status.code(), Some(2), "clap's usage-error status");
}

#[test]
fn invalid_sampling_parameters() {
    let (_dir, path) = gguf_fixture(64);
    let model = p(&path);
    expect_error(&generate_args(model, &["--top-p", "0"]), "top_p");
    expect_error(&generate_args(model, &["--temperature=-1"]), "temperature");
    expect_error(&generate_args(model, &["--min-p", "2"]), "min_p");
}

#[test]
fn invalid_model_options() {
    let (_dir, path) = gguf_fixture(64);
    let model = p(&path);
    expect_error(&generate_args(model, &["--block-size", "0"]), "block-size");
    expect_error(&generate_args(model, &["--threads", "0"]), "threads");
    expect_error(
        &generate_args(model, &["--kv-alloc-chunk", "0"]),
        "--kv-alloc-chunk must be positive",
    );
}

fn generate_json(args: &[&str]) -> serde_json::Value {
    let out = turbo(args, None);
    assert!(
        out.status.success(),
        "turbo {args:?} failed: {}",
        text(&out.stderr)
    );
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "one JSON line expected: {stdout}");
    serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

#[test]
fn generate_json_output() {
    let (_dir, path) = gguf_fixture(64);
    let v = generate_json(&generate_args(p(&path), &["--max-tokens", "5", "--json"]));
    let ids = |k: &str| -> Vec<u64> {
        v[k].as_array()
            .unwrap_or_else(|| panic!("{k} is not an array: {v}"))
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    let tok = turbo_tests::vocab::tiny_tokenizer(spec(64).vocab);
    let prompt: Vec<u64> = tok
        .encode_with_bos("hi")
        .unwrap()
        .into_iter()
        .map(u64::from)
        .collect();
    assert_eq!(ids("prompt_token_ids"), prompt);
    let generated = ids("token_ids");
    assert!(!generated.is_empty() && generated.len() <= 5, "{v}");
    assert!(generated.iter().all(|&t| t < spec(64).vocab as u64));
    assert!(v["text"].is_string(), "{v}");
    let reason = v["finish_reason"].as_str().unwrap();
    match reason {
        "length" => assert_eq!(generated.len(), 5),
        "stop" => assert_eq!(
            *generated.last().unwrap(),
            u64::from(turbo_tests::vocab::EOS_ID)
        ),
        other => panic!("finish_reason {other}"),
    }
    for k in ["prefill_ms", "decode_ms"] {
        let ms = v["timings"][k]
            .as_f64()
            .unwrap_or_else(|| panic!("{k}: {v}"));
        assert!(ms >= 0.0 && ms.is_finite(), "{k} = {ms}");
    }
    // Greedy decoding is the default: the same command gives the same tokens.
    let again = generate_json(&generate_args(p(&path), &["--max-tokens", "5", "--json"]));
    assert_eq!(again["token_ids"], v["token_ids"]);
}

#[test]
fn sampling_is_deterministic_for_a_seed() {
    let (_dir, path) = gguf_fixture(64);
    let run = |seed: &str| {
        let v = generate_json(&generate_args(
            p(&path),
            &[
                "--max-tokens",
                "12",
                "--temperature",
                "0.8",
                "--seed",
                seed,
                "--ignore-eos",
                "--json",
            ],
        ));
        (v["token_ids"].clone(), v["text"].clone())
    };
    let a = run("7");
    assert_eq!(a, run("7"), "same seed, same output");
    assert_eq!(a.0.as_array().unwrap().len(), 12);
    // Another seed samples something else (12 tokens from a flat-ish distribution).
    assert_ne!(a.0, run("8").0);
}

#[test]
fn generate_streams_text() {
    let (dir, path) = gguf_fixture(64);
    let prompt = dir.path().join("prompt.txt");
    std::fs::write(&prompt, "the heart").unwrap();
    let out = turbo(
        &[
            "generate",
            "--model",
            p(&path),
            "--prompt-file",
            p(&prompt),
            "--max-tokens",
            "4",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).ends_with('\n'));
    assert!(!text(&out.stderr).contains("error"));
}

#[test]
fn info_describes_the_model() {
    let (_dir, path) = gguf_fixture(64);
    let out = turbo(&["info", "--model", p(&path)], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for want in [
        "GGUF",
        "layers       2",
        "vocab        300",
        "context      64",
        "Q8_0",
    ] {
        assert!(stdout.contains(want), "{want:?} not in:\n{stdout}");
    }
}

#[test]
fn chat_reads_stdin_until_exit() {
    let (_dir, path) = gguf_fixture(64);
    let out = turbo(
        &["chat", "--model", p(&path), "--max-tokens", "6"],
        Some("hello\n/reset\nhi\n/exit\n"),
    );
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "chat failed: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("[conversation cleared]"), "{stderr}");
    // One prompt per line read: two turns were answered, then /reset and /exit.
    assert_eq!(
        text(&out.stdout).matches(">>> ").count(),
        4,
        "{}",
        text(&out.stdout)
    );

    // End of input ends the chat as /exit does; so does it with no subcommand.
    let out = turbo(&["--model", p(&path), "--max-tokens", "3"], Some("hello\n"));
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn chat_survives_a_prompt_too_long_for_the_context() {
    let (_dir, path) = gguf_fixture(32);
    let long = vec!["word"; 100].join(" ");
    let input = format!("{long}\nhi\n/exit\n");
    let out = turbo(
        &["chat", "--model", p(&path), "--max-tokens", "2"],
        Some(&input),
    );
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("context"), "{stderr}");
}

#[test]
fn bench_runs_on_a_tiny_model() {
    let (_dir, path) = gguf_fixture(64);
    let args = [
        "bench",
        "--model",
        p(&path),
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "4",
        "--repeats",
        "1",
        "--json",
    ];
    let out = turbo(&args, None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(v["prompt_tokens"], 8);
    assert!(v["decode_tok_s_median"].as_f64().unwrap() > 0.0, "{v}");
    expect_error(&["bench", "--model", p(&path), "--repeats", "0"], "repeats");
    // The default prompt of 512 tokens does not fit a 64-token context.
    expect_error(&["bench", "--model", p(&path)], "context");
}

#[test]
fn info_on_a_native_directory() {
    let (dir, path) = gguf_fixture(64);
    let native = dir.path().join("native");
    let loaded = turbo_llama::LoadedModel::load(&path).unwrap();
    turbo_llama::native::write(&loaded, &native).unwrap();
    let out = turbo(&["info", "--model", p(&native)], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("Turbo native") && stdout.contains("Q8_0"),
        "{stdout}"
    );
    let gen = generate_json(&generate_args(p(&native), &["--max-tokens", "4", "--json"]));
    let from_gguf = generate_json(&generate_args(p(&path), &["--max-tokens", "4", "--json"]));
    assert_eq!(gen["token_ids"], from_gguf["token_ids"]);
}

/// Each part of an error message should say something new. Today the causes of most load errors
/// are printed twice ("...: file is truncated: X: file is truncated: X"), because
/// `turbo_llama::LlamaError` (and `TokenizerError`) both format their source into their own
/// message and return it from `source()`, and `main` prints the whole chain with `{:#}`.
#[test]
fn error_messages_do_not_repeat_themselves() {
    let (dir, path) = gguf_fixture(64);
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..10]).unwrap();
    let bad = dir.path().join("bad.gguf");
    std::fs::write(&bad, b"GGML and more").unwrap();
    let hf = hf_fixture();
    std::fs::remove_file(hf.path().join("tokenizer.json")).unwrap();
    let missing = dir.path().join("missing.gguf");
    for (model, phrase) in [
        (p(&missing), "No such file"),
        (p(&cut), "truncated"),
        (p(&bad), "not a GGUF file"),
        (p(hf.path()), "tokenizer.json"),
    ] {
        let line = expect_error(&generate_args(model, &[]), phrase);
        let parts: Vec<&str> = line.split(": ").collect();
        for (i, part) in parts.iter().enumerate() {
            assert!(
                !parts[i + 1..].contains(part),
                "{part:?} appears twice in: {line}"
            );
        }
    }
}

/// A GGUF whose chat template does not compile.
fn broken_template_fixture() -> (tempfile::TempDir, PathBuf) {
    let s = spec(64);
    let mut meta = gguf_metadata(&s);
    meta.push((
        "tokenizer.chat_template".into(),
        "{% for message in messages %}{{ message['content'] }".into(),
    ));
    let (tensors, _) = gguf_tensors(&s, &TinyWeights::random(&s), DType::Q8_0);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("template.gguf");
    gguf_writer(&meta, &tensors).write(&path).unwrap();
    (dir, path)
}

/// Today the message spans several lines: `ChatError` formats minijinja's error with `{:#}`, which
/// adds a framed excerpt of the template, and also returns it as its source, so `main` prints it
/// twice.
#[test]
fn broken_chat_template() {
    let (_dir, path) = broken_template_fixture();
    expect_error(&generate_args(p(&path), &["--chat"]), "chat template");
    // Without --chat the template is not needed.
    let out = turbo(&generate_args(p(&path), &["--max-tokens", "2"]), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// `generate --json` of one token of `prompt` on the CPU, with `extra` flags.
fn one_token_json(model: &Path, prompt: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "generate",
        "--device",
        "cpu",
        "--model",
        p(model),
        "--prompt",
        prompt,
        "--json",
        "--max-tokens",
        "1",
    ];
    args.extend_from_slice(extra);
    let out = turbo(&args, None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    serde_json::from_str(text(&out.stdout).trim()).unwrap()
}

#[test]
fn prompts_file_runs_every_request_in_input_order() {
    let (dir, model) = gguf_fixture(64);
    let file = dir.path().join("prompts.jsonl");
    let lines = [
        r#"{"prompt": "hello", "max_tokens": 3}"#,
        r#"{"prompt": "the quick brown fox", "max_tokens": 5, "temperature": 0.8, "seed": 7}"#,
        "",
        r#"{"prompt": "hi", "max_tokens": 1, "session": "a"}"#,
    ];
    std::fs::write(&file, lines.join("\n")).unwrap();
    let args = [
        "generate",
        "--device",
        "cpu",
        "--model",
        p(&model),
        "--prompts-file",
        p(&file),
        "--max-batch",
        "2",
    ];
    let out = turbo(&args, None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    // Each line answers its own request: the prompt ids are those of a single `generate` of it.
    for (row, (prompt, max)) in
        rows.iter()
            .zip([("hello", 3usize), ("the quick brown fox", 5), ("hi", 1)])
    {
        let single = one_token_json(&model, prompt, &[]);
        assert_eq!(row["prompt_token_ids"], single["prompt_token_ids"]);
        assert!(row["token_ids"].as_array().unwrap().len() <= max);
        assert!(row["timings"]["prefill_ms"].as_f64().is_some());
    }
    assert!(text(&out.stderr).contains("requests/s"));

    // --chat wraps each line's prompt as a user message, as it does a single prompt's.
    std::fs::write(&file, "{\"prompt\": \"hello\", \"max_tokens\": 1}\n").unwrap();
    let chat_args: Vec<&str> = args.iter().copied().chain(["--chat"]).collect();
    let out = turbo(&chat_args, None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let row: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    let single = one_token_json(&model, "hello", &["--chat"]);
    assert_eq!(row["prompt_token_ids"], single["prompt_token_ids"]);
    assert_ne!(row["prompt_token_ids"], rows[0]["prompt_token_ids"]);

    // A malformed line fails alone, with its line number; the command fails at the end.
    std::fs::write(&file, "{\"prompt\": \"ok\", \"max_tokens\": 1}\nnot json\n").unwrap();
    let out = turbo(&args, None);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert_eq!(rows[1]["line"], 2);
    assert!(text(&out.stderr).contains("error: 1 of 2 requests"));
}

#[test]
fn kv_cache_size_flags() {
    let (dir, model) = gguf_fixture(64);
    let file = dir.path().join("prompts.jsonl");
    std::fs::write(&file, "{\"prompt\": \"hello\", \"max_tokens\": 2}\n").unwrap();
    let batch = |extra: &[&str]| -> Vec<String> {
        let mut args: Vec<String> = ["generate", "--device", "cpu", "--model", p(&model)]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend(["--prompts-file".into(), p(&file).into()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let error = |extra: &[&str], phrase: &str| {
        let args = batch(extra);
        expect_error(&args.iter().map(String::as_str).collect::<Vec<_>>(), phrase);
    };
    for bad in ["0", "1.5", "-0.2", "nan", "inf"] {
        error(
            &[format!("--kv-cache-fraction={bad}").as_str()],
            "--kv-cache-fraction must be in (0, 1]",
        );
    }
    error(&["--kv-cache-gb", "0"], "--kv-cache-gb must be a positive");
    error(
        &["--kv-cache-gb", "nan"],
        "--kv-cache-gb must be a positive",
    );
    error(&["--kv-cache-gb", "1e-12"], "less than one KV block");
    // Values that start with a hyphen reach the flags' own checks, and sizes print short.
    error(
        &["--kv-cache-gb", "-inf"],
        "--kv-cache-gb must be a positive",
    );
    error(
        &["--kv-cache-fraction", "-inf"],
        "--kv-cache-fraction must be in (0, 1]",
    );
    error(
        &["--kv-cache-gb", "5e-324"],
        "a KV cache of 4.94065646e-315 bytes",
    );
    expect_error(
        &generate_args(
            p(&model),
            &["--kv-policy", "keyformer", "--keyformer-tau", "-1:2"],
        ),
        "Keyformer temperatures must be finite and positive",
    );
    error(
        &["--max-batched-tokens", "0"],
        "--max-batched-tokens must be positive",
    );
    error(&["--kv-blocks", "0"], "--kv-blocks must be positive");
    let both = batch(&["--kv-blocks", "8", "--kv-cache-fraction", "0.5"]);
    expect_usage_error(&both.iter().map(String::as_str).collect::<Vec<_>>());
    // A fraction of MemAvailable on the CPU, and a size in GB, both run; the CPU's storage
    // always grows on demand, so a GPU's allocation chunk changes nothing there.
    for ok in [
        ["--kv-cache-fraction", "0.01"],
        ["--kv-cache-gb", "0.01"],
        ["--kv-alloc-chunk", "4"],
    ] {
        let args = batch(&ok);
        let out = turbo(&args.iter().map(String::as_str).collect::<Vec<_>>(), None);
        assert!(out.status.success(), "{ok:?}: {}", text(&out.stderr));
        assert_eq!(text(&out.stdout).lines().count(), 1);
    }
    // A single prompt does not run in the persistent batch: the flags would do nothing.
    expect_error(
        &generate_args(p(&model), &["--kv-blocks", "8"]),
        "--prompts-file",
    );
    // Chat takes them too.
    let out = turbo(
        &[
            "chat",
            "--model",
            p(&model),
            "--max-tokens",
            "2",
            "--kv-cache-fraction",
            "0.01",
        ],
        Some("hello\n"),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    expect_error(
        &["chat", "--model", p(&model), "--kv-cache-fraction", "2"],
        "kv-cache-fraction",
    );
}

#[test]
fn chat_reuses_the_conversation_kv_and_fails_clearly_on_a_tiny_cache() {
    let (_dir, path) = gguf_fixture(256);
    let out = turbo(
        &["chat", "--model", p(&path), "--max-tokens", "4"],
        Some("hello there\nand again\n"),
    );
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // "[4 tokens, ... tok/s; prompt N new + M cached tokens in T ms]" per turn.
    let cached: Vec<usize> = stderr
        .lines()
        .filter_map(|l| l.split(" new + ").nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    assert_eq!(cached.len(), 2, "{stderr}");
    assert_eq!(cached[0], 0, "{stderr}");
    assert!(cached[1] > 0, "the second turn reuses the first: {stderr}");

    // A cache of one block cannot hold a turn: the turn is refused, the chat goes on.
    let out = turbo(
        &[
            "chat",
            "--model",
            p(&path),
            "--kv-blocks",
            "1",
            "--max-tokens",
            "4",
        ],
        Some("hello there\n/exit\n"),
    );
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("KV blocks"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn bench_multi_round_compares_cached_and_uncached() {
    let (_dir, path) = gguf_fixture(512);
    let args = [
        "bench",
        "--device",
        "cpu",
        "--model",
        p(&path),
        "--multi-round",
        "3",
        "--user-tokens",
        "12",
        "--gen-tokens",
        "3",
        "--repeats",
        "1",
        "--json",
    ];
    let out = turbo(&args, None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    let (cached, uncached) = (
        v["cached"].as_array().unwrap(),
        v["uncached"].as_array().unwrap(),
    );
    assert_eq!((cached.len(), uncached.len()), (3, 3), "{v}");
    for k in 0..3 {
        // The same prompts; only the cached run finds history resident.
        assert_eq!(cached[k]["prompt_tokens"], uncached[k]["prompt_tokens"]);
        assert_eq!(uncached[k]["cached_tokens"], 0, "{v}");
        assert!(cached[k]["ttft_ms_median"].as_f64().unwrap() > 0.0);
        if k > 0 {
            let prev = cached[k - 1]["prompt_tokens"].as_u64().unwrap();
            assert!(cached[k]["cached_tokens"].as_u64().unwrap() >= prev, "{v}");
        }
    }
    // The table form.
    let out = turbo(&args[..args.len() - 1], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("TTFT uncached"));
    expect_error(
        &["bench", "--model", p(&path), "--multi-round", "0"],
        "--multi-round",
    );
    expect_usage_error(&[
        "bench",
        "--model",
        p(&path),
        "--multi-round",
        "2",
        "--shared-prefix",
        "2",
    ]);
    // More rounds than the context holds.
    expect_error(
        &[
            "bench",
            "--model",
            p(&path),
            "--multi-round",
            "40",
            "--user-tokens",
            "20",
            "--repeats",
            "1",
        ],
        "context",
    );
}

#[test]
fn bench_shared_prefix_counts_prefill_and_blocks() {
    let (_dir, path) = gguf_fixture(256);
    let args = [
        "bench",
        "--device",
        "cpu",
        "--model",
        p(&path),
        "--shared-prefix",
        "4",
        "--prefix-tokens",
        "40",
        "--user-tokens",
        "5",
        "--gen-tokens",
        "2",
        "--block-size",
        "8",
        "--json",
    ];
    let out = turbo(&args, None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    let (s, u) = (&v["shared"], &v["unshared"]);
    let count = |x: &serde_json::Value, k: &str| x[k].as_u64().unwrap();
    assert_eq!(count(s, "prompt_tokens"), 4 * 45, "{v}");
    assert_eq!(count(u, "prompt_tokens"), 4 * 45, "{v}");
    assert_eq!(count(u, "prefill_tokens_run"), 4 * 45, "{v}");
    assert_eq!(count(u, "cached_prompt_tokens"), 0, "{v}");
    assert!(
        count(s, "prefill_tokens_run") < count(u, "prefill_tokens_run"),
        "{v}"
    );
    assert!(
        count(s, "kv_blocks_peak") < count(u, "kv_blocks_peak"),
        "{v}"
    );
    assert_eq!(
        count(s, "prefill_tokens_run") + count(s, "cached_prompt_tokens"),
        4 * 45,
        "{v}"
    );
    expect_error(
        &[
            "bench",
            "--model",
            p(&path),
            "--shared-prefix",
            "2",
            "--prefix-tokens",
            "400",
        ],
        "context",
    );
}

/// The first 8 bytes and the IHDR width and height of a PNG file.
fn png_size(path: &Path) -> (u32, u32) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(
        &bytes[..8],
        b"\x89PNG\r\n\x1a\n",
        "{} is not a PNG",
        path.display()
    );
    assert_eq!(&bytes[12..16], b"IHDR");
    let be = |i: usize| u32::from_be_bytes(bytes[i..i + 4].try_into().unwrap());
    (be(16), be(20))
}

const EVAL_ROWS: &str = r#"{"text":"a.txt","task":"continue","policy":"full","budget":1.0,"kv_tokens":40,"nll":2.0,"ppl":7.38905609893065,"greedy_agree":1.0}
{"text":"a.txt","task":"continue","policy":"h2o","budget":0.5,"kv_tokens":20,"nll":2.1,"ppl":8.16616991256765,"greedy_agree":0.75}

{"text":"b.txt","task":"continue","policy":"full","budget":1.0,"kv_tokens":40,"nll":1.0,"ppl":2.718281828459045,"greedy_agree":1.0}
{"text":"b.txt","task":"continue","policy":"h2o","budget":0.5,"kv_tokens":20,"nll":1.2,"ppl":3.3201169227365472,"greedy_agree":0.5}
"#;

#[test]
fn eval_kv_from_json_prints_and_plots_saved_rows() {
    let dir = tempfile::tempdir().unwrap();
    let rows = dir.path().join("rows.jsonl");
    std::fs::write(&rows, EVAL_ROWS).unwrap();
    // --json prints the rows back as they were written (no model is needed).
    let out = turbo(&["eval-kv", "--from-json", p(&rows), "--json"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let printed: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let saved: Vec<serde_json::Value> = EVAL_ROWS
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(printed, saved);
    // The table and the plot.
    let png = dir.path().join("quality.png");
    let out = turbo(
        &["eval-kv", "--from-json", p(&rows), "--plot", p(&png)],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("text"), "{stdout}");
    assert_eq!(stdout.lines().count(), 5, "{stdout}");
    assert_eq!(png_size(&png), (1500, 620));
}

#[test]
fn eval_kv_bad_saved_rows_and_plot_paths() {
    let dir = tempfile::tempdir().unwrap();
    let rows = dir.path().join("rows.jsonl");
    std::fs::write(&rows, EVAL_ROWS).unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, EVAL_ROWS.replacen("\"h2o\"", "h2o", 1)).unwrap();
    expect_error(&["eval-kv", "--from-json", p(&bad)], "line 2");
    let no_full: String = EVAL_ROWS
        .lines()
        .filter(|l| !l.contains("\"full\""))
        .map(|l| format!("{l}\n"))
        .collect();
    let no_full_path = dir.path().join("no-full.jsonl");
    std::fs::write(&no_full_path, no_full).unwrap();
    let png = dir.path().join("q.png");
    expect_error(
        &[
            "eval-kv",
            "--from-json",
            p(&no_full_path),
            "--plot",
            p(&png),
        ],
        "full-attention",
    );
    expect_error(
        &[
            "eval-kv",
            "--from-json",
            p(&dir.path().join("missing.jsonl")),
        ],
        "cannot read",
    );
    let nowhere = dir.path().join("no-such-dir/q.png");
    expect_error(
        &["eval-kv", "--from-json", p(&rows), "--plot", p(&nowhere)],
        "does not exist",
    );
    // The path is checked before the model is even looked for.
    expect_error(
        &[
            "eval-kv",
            "--model",
            p(&dir.path().join("missing.gguf")),
            "--text",
            p(&rows),
            "--plot",
            p(&nowhere),
        ],
        "does not exist",
    );
    expect_usage_error(&["eval-kv"]); // neither --text nor --from-json
    expect_usage_error(&["eval-kv", "--from-json", p(&rows), "--text", p(&rows)]);
}

#[test]
fn eval_kv_plots_a_run() {
    let (dir, path) = gguf_fixture(128);
    let text_path = dir.path().join("story.txt");
    let story =
        "Once upon a time a small fox walked through the quiet forest and met an owl. ".repeat(20);
    std::fs::write(&text_path, story).unwrap();
    let png = dir.path().join("run.png");
    let args = [
        "eval-kv",
        "--model",
        p(&path),
        "--text",
        p(&text_path),
        "--prompt-tokens",
        "48",
        "--eval-tokens",
        "8",
        "--policies",
        "h2o,window",
        "--budgets",
        "0.5",
        "--max-batch",
        "3",
        "--block-size",
        "8",
        "--json",
        "--plot",
        p(&png),
    ];
    let out = turbo(&args, None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).lines().count(),
        3,
        "{}",
        text(&out.stdout)
    );
    assert_eq!(png_size(&png), (1500, 620));
}

/// `--greedy-out` writes full attention's greedy tokens per text; `--greedy-ref` measures
/// agreement against them (here the same run: every step agrees), and a reference that lacks a
/// text or has other lengths is refused in one line.
#[test]
fn eval_kv_greedy_tokens_round_trip_as_a_reference() {
    let (dir, path) = gguf_fixture(128);
    let text_path = dir.path().join("story.txt");
    let story = "A small fox walked through the quiet forest and met an owl. ".repeat(20);
    std::fs::write(&text_path, story).unwrap();
    let greedy = dir.path().join("greedy.json");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "eval-kv",
            "--model",
            p(&path),
            "--text",
            p(&text_path),
            "--prompt-tokens",
            "40",
            "--eval-tokens",
            "6",
            "--policies",
            "full",
            "--block-size",
            "8",
            "--json",
        ];
        args.extend_from_slice(extra);
        turbo(&args, None)
    };
    let out = run(&["--greedy-out", p(&greedy)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&greedy).unwrap()).unwrap();
    assert_eq!(
        saved["story.txt"].as_array().map(Vec::len),
        Some(6),
        "{saved}"
    );
    let out = run(&["--greedy-ref", p(&greedy)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let row: serde_json::Value =
        serde_json::from_str(text(&out.stdout).lines().next().unwrap()).unwrap();
    assert_eq!(row["greedy_agree"], 1.0, "{row}");

    let other = dir.path().join("other.json");
    std::fs::write(&other, r#"{"another.txt": [1, 2, 3, 4, 5, 6]}"#).unwrap();
    let out = run(&["--greedy-ref", p(&other)]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("no tokens for story.txt"),
        "{}",
        text(&out.stderr)
    );
    std::fs::write(&other, r#"{"story.txt": [1, 2]}"#).unwrap();
    let out = run(&["--greedy-ref", p(&other)]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("are 2 steps"),
        "{}",
        text(&out.stderr)
    );
    std::fs::write(&other, "not json").unwrap();
    let out = run(&["--greedy-ref", p(&other)]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("not a file of"),
        "{}",
        text(&out.stderr)
    );
}

/// `--weights-dtype` takes native or bf16 (the CPU keeps its own weights either way); anything
/// else is a usage error.
#[test]
fn weights_dtype_is_accepted_and_checked() {
    let (_dir, path) = gguf_fixture(128);
    let args = [
        "--device",
        "cpu",
        "--max-tokens",
        "3",
        "--ignore-eos",
        "--json",
        "--weights-dtype",
        "bf16",
    ];
    let out = turbo(&generate_args(p(&path), &args), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    expect_usage_error(&generate_args(
        p(&path),
        &["--device", "cpu", "--weights-dtype", "q4"],
    ));
}

/// `--tensor-parallel` on the CPU: a model that splits gives the same greedy text split over 2
/// ranks as whole (the library tests compare logits); `info` shows the split; one that does not
/// split is refused in one line naming why.
#[test]
fn tensor_parallel_generates_the_same_text_and_refuses_uneven_splits() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    let s = TinySpec {
        hidden: 128,
        heads: 4,
        kv_heads: 2,
        ffn: 128,
        context: 128,
        seed: 5,
        ..TinySpec::default()
    };
    write_gguf(&model, &s, &TinyWeights::random(&s), DType::Q8_0);
    let m = p(&model);
    let run = |tp: &str| {
        let out = turbo(
            &generate_args(
                m,
                &[
                    "--device",
                    "cpu",
                    "--max-tokens",
                    "12",
                    "--ignore-eos",
                    "--json",
                    "--tp",
                    tp,
                ],
            ),
            None,
        );
        assert!(out.status.success(), "tp {tp}: {}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["token_ids"].clone()
    };
    let whole = run("1");
    assert_eq!(whole.as_array().map(Vec::len), Some(12));
    assert_eq!(run("2"), whole);
    let info = turbo(&["info", "--model", m, "--tensor-parallel", "2"], None);
    let shown = text(&info.stdout);
    assert!(
        shown.contains(
            "2 ranks: 2 heads, 1 KV heads, FFN 64 and 150 of the 300-token vocabulary per rank"
        ) && shown.contains("GB of weights per rank (rank 0 gathers the logits)"),
        "{shown}"
    );

    let (_fixture_dir, fixture) = gguf_fixture(64);
    let f = p(&fixture);
    let args = |tp: &'static str| generate_args(f, &["--device", "cpu", "--tp", tp]);
    expect_error(&args("3"), "its 4 attention heads do not divide by 3");
    // FFN 96 over 2 ranks: W_down's columns 0..48 are not whole Q8_0 blocks.
    expect_error(&args("2"), "do not fall on Q8_0 blocks of 32");
    expect_error(&args("65"), "more than the 64 allowed");
    expect_error(&args("0"), "--tensor-parallel must be positive");
}

/// `--kv-dtype int8|fp8` runs a model on the CPU with a quantized KV cache (on a tiny model
/// whose logits are far apart, the greedy text is the unquantized one), `info` names the dtype
/// and its bytes, and an unknown dtype is refused in one line.
#[test]
fn kv_dtypes_run_and_unknown_ones_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    let s = TinySpec {
        context: 128,
        seed: 9,
        ..TinySpec::default()
    };
    write_gguf(&model, &s, &TinyWeights::random(&s), DType::F32);
    let m = p(&model);
    let run = |dtype: &str| {
        let out = turbo(
            &generate_args(
                m,
                &[
                    "--device",
                    "cpu",
                    "--max-tokens",
                    "8",
                    "--ignore-eos",
                    "--json",
                    "--kv-dtype",
                    dtype,
                ],
            ),
            None,
        );
        assert!(out.status.success(), "{dtype}: {}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["token_ids"].as_array().map(Vec::len)
    };
    for dtype in ["bf16", "int8", "fp8"] {
        assert_eq!(run(dtype), Some(8), "{dtype}");
    }
    let info = turbo(&["info", "--model", m, "--kv-dtype", "int8"], None);
    assert!(
        text(&info.stdout).contains("kv cache     int8: "),
        "{}",
        text(&info.stdout)
    );
    expect_error(
        &generate_args(m, &["--device", "cpu", "--kv-dtype", "int4"]),
        "unknown KV dtype \"int4\"",
    );
}

/// `--cpu-activations q8` runs decode products on 8-bit activations (a Q8_0 model, which it
/// serves); an unknown choice is refused in one line.
#[test]
fn cpu_activations_q8_runs_and_unknown_ones_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    let s = TinySpec {
        context: 128,
        seed: 3,
        ..TinySpec::default()
    };
    write_gguf(&model, &s, &TinyWeights::random(&s), DType::Q8_0);
    let m = p(&model);
    let args = [
        "--device",
        "cpu",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--json",
        "--cpu-activations",
        "q8",
    ];
    let out = turbo(&generate_args(m, &args), None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["token_ids"].as_array().map(Vec::len), Some(6));
    expect_error(
        &generate_args(m, &["--device", "cpu", "--cpu-activations", "q4"]),
        "unknown CPU activations \"q4\"",
    );
}
