//! Each fuzz target for a bounded number of cases (`TURBO_FUZZ_CASES` scales it), in child
//! processes with allocation and time limits; see `docs/reliability.md`.

use std::path::{Path, PathBuf};
use turbo_fuzz::harness::{supervise, Plan};
use turbo_fuzz::Target;

fn fuzz(target: &'static Target) {
    let out: PathBuf = Path::new(env!("CARGO_TARGET_TMPDIR")).join("turbo-fuzz");
    let plan = Plan::from_env(target, out);
    let report = supervise(Path::new(env!("CARGO_BIN_EXE_turbo-fuzz")), &plan);
    eprintln!("{report}");
    assert!(
        report.findings.is_empty() && !report.stopped_early,
        "fuzz target {} failed:\n{report}",
        target.name
    );
}

#[test]
fn gguf() {
    fuzz(&turbo_fuzz::GGUF);
}

#[test]
fn hf_model() {
    fuzz(&turbo_fuzz::HF_MODEL);
}

#[test]
fn tokenizer() {
    fuzz(&turbo_fuzz::TOKENIZER);
}

#[test]
fn chat_template() {
    fuzz(&turbo_fuzz::CHAT_TEMPLATE);
}

#[test]
fn requests_file() {
    fuzz(&turbo_fuzz::REQUESTS_FILE);
}
