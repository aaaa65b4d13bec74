//! Helpers shared by the CLI's integration tests: the real `turbo` binary on tiny models.

#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use turbo_tests::{write_gguf, DType, TinySpec, TinyWeights};

pub fn turbo(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_turbo"))
        .args(args)
        .env_remove("TURBO_LOG")
        .env("RAYON_NUM_THREADS", "2")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the turbo binary runs");
    let mut input = child.stdin.take().unwrap();
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).unwrap();
    }
    drop(input);
    child.wait_with_output().unwrap()
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `turbo args` and checks it fails with a single `error:` line containing `phrase`.
#[track_caller]
pub fn expect_error(args: &[&str], phrase: &str) -> String {
    let out = turbo(args, None);
    let stderr = text(&out.stderr);
    assert!(
        !out.status.success(),
        "turbo {args:?} succeeded; stderr: {stderr}"
    );
    assert!(
        !stderr.contains("panicked"),
        "turbo {args:?} panicked: {stderr}"
    );
    let line = stderr.trim_end_matches('\n');
    assert!(
        !line.contains('\n'),
        "turbo {args:?}: stderr is not one line:\n{stderr}"
    );
    assert!(
        line.starts_with("error: "),
        "turbo {args:?}: stderr does not start with 'error: ': {stderr}"
    );
    assert!(
        line.contains(phrase),
        "turbo {args:?}: stderr does not mention {phrase:?}: {stderr}"
    );
    eprintln!("{line}");
    line.to_string()
}

/// A failure whose message clap owns (usage errors): non-zero and no panic is all we ask.
#[track_caller]
pub fn expect_usage_error(args: &[&str]) {
    let out = turbo(args, None);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "turbo {args:?} succeeded");
    assert!(!stderr.contains("panicked"), "turbo {args:?}: {stderr}");
    assert!(!stderr.trim().is_empty(), "turbo {args:?}: no message");
}

pub fn spec(context: usize) -> TinySpec {
    TinySpec {
        context,
        seed: 3,
        ..TinySpec::default()
    }
}

/// A temporary directory holding `tiny.gguf` (Q8_0, the given context).
pub fn gguf_fixture(context: usize) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let s = spec(context);
    write_gguf(&path, &s, &TinyWeights::random(&s), DType::Q8_0);
    (dir, path)
}

pub fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

pub fn generate_args<'a>(model: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["generate", "--model", model, "--prompt", "hi"];
    args.extend_from_slice(extra);
    args
}
