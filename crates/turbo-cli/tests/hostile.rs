//! The `turbo` binary used as a hostile user would: sizes at and just past their limits, closed
//! pipes and full disks, Ctrl-C, bad lines in a requests file, bad bytes on chat's stdin. Every
//! refusal is one line naming what was wrong; nothing panics, aborts or loses a request.

mod common;

use common::*;
use std::io::{BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn cpu_args<'a>(model: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["generate", "--device", "cpu", "--model", model];
    args.extend_from_slice(extra);
    args
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// Runs `args` and checks it succeeds.
#[track_caller]
fn expect_ok(args: &[&str]) -> String {
    let out = turbo(args, None);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "turbo {args:?} failed: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    text(&out.stdout)
}

/// The number in `line` right after `prefix`.
fn number_after(line: &str, prefix: &str) -> u64 {
    let rest = &line[line
        .find(prefix)
        .unwrap_or_else(|| panic!("{prefix:?} in {line}"))
        + prefix.len()..];
    rest.split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn each_size_a_user_controls_has_a_largest_value_and_a_clear_error_above_it() {
    let (dir, model) = gguf_fixture(64);
    let m = p(&model);
    let hi = ["--prompt", "hi", "--max-tokens", "1"];
    let with = |flag: &str, value: &str| -> Vec<String> {
        let mut args: Vec<String> = cpu_args(m, &hi).iter().map(|s| s.to_string()).collect();
        args.extend([flag.to_string(), value.to_string()]);
        args
    };
    let run_ok = |flag: &str, value: String| {
        expect_ok(&strs(&with(flag, &value)));
    };
    let run_err = |flag: &str, value: String, phrase: &str| {
        expect_error(&strs(&with(flag, &value)), phrase);
    };

    run_ok("--block-size", "1024".into());
    run_err(
        "--block-size",
        "1025".into(),
        "block size of 1025 is more than the 1024 allowed",
    );
    run_err(
        "--block-size",
        "4294967296".into(),
        "more than the 1024 allowed",
    );

    let cores = std::thread::available_parallelism().unwrap().get();
    run_ok("--threads", cores.to_string());
    run_err(
        "--threads",
        (cores + 1).to_string(),
        &format!("{} threads is more than the {cores} CPUs", cores + 1),
    );

    // A context past the model's is allowed (with a warning); the KV cache is cut to memory.
    run_ok("--context", "2147483647".into());
    run_err(
        "--context",
        "2147483648".into(),
        "context of 2147483648 is more than the 2147483647 allowed",
    );
    run_err(
        "--context",
        "18446744073709551615".into(),
        "more than the 2147483647 allowed",
    );

    // A prompt file is read up to the longest text that can fit the context, and no further.
    let file = dir.path().join("prompt.txt");
    let zero = cpu_args(m, &["--prompt-file", "/dev/zero"]);
    let line = expect_error(&zero, "is longer than");
    let limit = number_after(&line, "longer than ");
    std::fs::write(&file, "a".repeat(limit as usize)).unwrap();
    let at_limit = cpu_args(m, &["--prompt-file", p(&file)]);
    expect_error(&at_limit, "tokens, but the model's context holds 64");
    std::fs::write(&file, "a".repeat(limit as usize + 1)).unwrap();
    expect_error(&at_limit, &format!("is longer than {limit} bytes"));

    // Batch sizes of the persistent batch.
    let requests = dir.path().join("requests.jsonl");
    std::fs::write(&requests, "{\"prompt\": \"hello\", \"max_tokens\": 1}\n").unwrap();
    let batch = |extra: &[&str]| -> Vec<String> {
        let mut args: Vec<String> = cpu_args(m, &["--prompts-file", p(&requests)])
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let ok = |extra: &[&str]| {
        expect_ok(&strs(&batch(extra)));
    };
    let err = |extra: &[&str], phrase: &str| {
        expect_error(&strs(&batch(extra)), phrase);
    };
    ok(&["--max-batch", "65536"]);
    err(
        &["--max-batch", "65537"],
        "batch size of 65537 is more than the 65536 allowed",
    );
    ok(&["--max-batched-tokens", "65536"]);
    err(
        &["--max-batched-tokens", "65537"],
        "tokens per step of 65537 is more than the 65536 allowed",
    );
    // KV blocks: ids are u32, and the cache must fit in free memory.
    err(
        &["--kv-blocks", "4294967296"],
        "4294967296 KV blocks is more than the 4294967295 allowed",
    );
    err(&["--kv-blocks", "4294967295"], "bytes of KV, more than the");
    err(&["--kv-cache-gb", "1e30"], "bytes free on");
    ok(&["--kv-blocks", "64"]);

    // Values the argument parser refuses are one line too.
    expect_error(
        &cpu_args(m, &["--threads", "-1"]),
        "invalid value '-1' for '--threads <THREADS>'",
    );
    expect_error(&cpu_args(m, &["--block-size", "nan"]), "--block-size");
    expect_error(
        &cpu_args(m, &["--kv-blocks", "18446744073709551616", "--prompt", "x"]),
        "--kv-blocks",
    );

    // Benchmarks and evaluations: repetitions, rounds, requests and token counts.
    let tool = |args: &[&str], phrase: &str| {
        let mut all = args.to_vec();
        all.extend_from_slice(&["--device", "cpu", "--model", m]);
        expect_error(&all, phrase);
    };
    tool(
        &["bench", "--repeats", "1001"],
        "--repeats must be at most 1000",
    );
    // The server refuses a step of no tokens, as the batch commands do, before it listens.
    tool(
        &["serve", "--max-batched-tokens", "0"],
        "--max-batched-tokens must be positive",
    );
    tool(&["bench", "--multi-round", "1000000000"], "rounds of ~");
    tool(
        &["bench", "--shared-prefix", "65537", "--prefix-tokens", "8"],
        "65537 requests is more than the 65536 allowed",
    );
    tool(
        &[
            "bench",
            "--shared-prefix",
            "2",
            "--prefix-tokens",
            "18446744073709551615",
        ],
        "does not fit the model's context of 64",
    );
    tool(
        &[
            "eval-kv",
            "--text",
            "/dev/zero",
            "--prompt-tokens",
            "100000000000",
        ],
        "is more than the model's context of 64",
    );

    // The load generator and saved evaluation rows: sizes and reads bounded before any work.
    let serve = |extra: &[&str], phrase: &str| {
        let mut args = vec!["bench", "serve", "--url", "http://127.0.0.1:1"];
        args.extend_from_slice(extra);
        expect_error(&args, phrase);
    };
    serve(
        &["--requests", "18446744073709551615"],
        "--requests 18446744073709551615 is more than the 100000 allowed",
    );
    serve(
        &["--requests", "1", "--mean-in", "18446744073709551615"],
        "is more than the 100000 words allowed",
    );
    serve(
        &["--requests", "1000", "--mean-in", "100000"],
        "100000000 words, more than the 20000000 allowed",
    );
    serve(
        &["--requests", "1", "--mean-out", "18446744073709551615"],
        "tokens allowed",
    );
    serve(
        &["--requests", "1", "--prompts-file", "/dev/zero"],
        "is longer than 1073741824 bytes",
    );
    expect_error(
        &["eval-kv", "--from-json", "/dev/zero"],
        "is longer than 268435456 bytes",
    );
}

/// Input with no lines at all (`/dev/zero`) ends chat with one error line instead of being read
/// forever.
#[test]
fn chat_stops_on_input_without_lines() {
    let (_dir, model) = gguf_fixture(64);
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_turbo"))
        .args(["chat", "--device", "cpu", "--model", p(&model)])
        .stdin(std::fs::File::open("/dev/zero").unwrap())
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("with no end; it is not chat text"),
        "{stderr}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn a_reader_that_goes_away_ends_the_command_quietly_and_a_full_disk_is_an_error() {
    let (_dir, model) = gguf_fixture(4096);
    let args = cpu_args(
        p(&model),
        &["--prompt", "hi", "--max-tokens", "3000", "--ignore-eos"],
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_turbo"))
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 1];
    child
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    drop(child.stdout.take()); // `| head -c 1`
    let started = Instant::now();
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(stderr.is_empty(), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(20));

    if std::path::Path::new("/dev/full").exists() {
        for extra in [&[][..], &["--json"][..]] {
            let mut full = args.clone();
            full.extend_from_slice(extra);
            let out = Command::new(env!("CARGO_BIN_EXE_turbo"))
                .args(&full)
                .stdout(
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open("/dev/full")
                        .unwrap(),
                )
                .output()
                .unwrap();
            let stderr = text(&out.stderr);
            assert!(!out.status.success());
            assert_eq!(
                stderr.trim_end(),
                "error: cannot write to standard output: No space left on device (os error 28)"
            );
        }
        let out = Command::new(env!("CARGO_BIN_EXE_turbo"))
            .args(["info", "--model", p(&model)])
            .stdout(
                std::fs::OpenOptions::new()
                    .write(true)
                    .open("/dev/full")
                    .unwrap(),
            )
            .output()
            .unwrap();
        assert!(!out.status.success());
        assert!(text(&out.stderr).starts_with("error: cannot write to standard output"));
    }
}

/// Sends SIGINT to `child`, as Ctrl-C in its terminal would.
fn ctrl_c(child: &Child) {
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Reads `reader` until `needle` has been seen; what was read.
fn read_until(reader: &mut impl Read, needle: &str) -> String {
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    while !String::from_utf8_lossy(&seen).contains(needle) {
        if reader.read(&mut byte).unwrap() == 0 {
            panic!("the stream ended before {needle:?}: {}", text(&seen));
        }
        seen.push(byte[0]);
    }
    text(&seen)
}

/// Runs `args`, sends Ctrl-C 1.5 s later, and waits for it to end.
fn interrupted(args: &[&str]) -> std::process::Output {
    let child = Command::new(env!("CARGO_BIN_EXE_turbo"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    ctrl_c(&child);
    child.wait_with_output().unwrap()
}

#[test]
fn ctrl_c_stops_generation_and_keeps_what_was_generated() {
    let (dir, model) = gguf_fixture(1_000_000);
    let m = p(&model);
    // One prompt: the text so far is printed, then exit 130.
    let args = cpu_args(
        m,
        &[
            "--prompt",
            "hi",
            "--max-tokens",
            "900000",
            "--ignore-eos",
            "--json",
        ],
    );
    let out = interrupted(&args);
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(json["finish_reason"], "cancelled");
    assert!(!json["token_ids"].as_array().unwrap().is_empty());

    // A requests file: every request still gets its line, in order.
    let requests = dir.path().join("requests.jsonl");
    let lines: Vec<String> = (0..3)
        .map(|i| format!("{{\"prompt\": \"story {i}\", \"max_tokens\": 200000}}"))
        .collect();
    std::fs::write(&requests, lines.join("\n")).unwrap();
    let args = cpu_args(
        m,
        &[
            "--prompts-file",
            p(&requests),
            "--ignore-eos",
            "--kv-blocks",
            "40000",
        ],
    );
    let out = interrupted(&args);
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    for row in rows {
        assert_eq!(row["finish_reason"], "cancelled", "{row}");
    }
}

#[test]
fn ctrl_c_in_chat_stops_the_reply_and_keeps_the_conversation() {
    // The default model: its greedy reply to this runs to the token limit, long enough to stop.
    let mut child = Command::new(env!("CARGO_BIN_EXE_turbo"))
        .args(["chat", "--device", "cpu", "--max-tokens", "2000"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    read_until(&mut stdout, ">>> ");
    // At the prompt, a first Ctrl-C only says how to quit.
    ctrl_c(&child);
    read_until(&mut stderr, "Ctrl-C again");
    writeln!(stdin, "Tell me a long story about a dragon.").unwrap();
    // Some of the reply, then Ctrl-C: the reply stops and the prompt comes back.
    let mut byte = [0u8; 1];
    stdout.read_exact(&mut byte).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    ctrl_c(&child);
    let first = read_until(&mut stderr, " cached tokens in");
    assert!(first.contains("[reply stopped: "), "{first}");
    let first_prompt = number_after(&first, "; prompt ");
    read_until(&mut stdout, ">>> ");
    // The conversation goes on: the next turn finds the first turn's KV resident.
    writeln!(stdin, "Thanks.").unwrap();
    stdout.read_exact(&mut byte).unwrap();
    ctrl_c(&child);
    let stats = read_until(&mut stderr, " cached tokens in");
    assert!(stats.contains("[reply stopped: "), "{stats}");
    // At least the whole first prompt is reused (and the stopped reply's tokens, however few
    // came before the Ctrl-C on a loaded machine).
    let cached = number_after(&stats, " new + ");
    assert!(cached >= first_prompt, "{first}\n{stats}");
    writeln!(stdin, "/exit").unwrap();
    drop(stdin);
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).unwrap();
    assert!(!rest.contains("panicked"), "{rest}");
}

#[test]
fn chat_refuses_bad_lines_and_goes_on() {
    let (_dir, model) = gguf_fixture(256);
    let m = p(&model);
    let mut input = b"hello\n\xff\xfe bad bytes\n".to_vec();
    input.extend(vec![b'a'; 1 << 20]);
    input.extend(b"\nhello again\n/exit\n");
    let mut child = Command::new(env!("CARGO_BIN_EXE_turbo"))
        .args(["chat", "--model", m, "--max-tokens", "3"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("not UTF-8 text; not sent"), "{stderr}");
    assert!(
        stderr.contains("bytes, more than the context holds; not sent"),
        "{stderr}"
    );
    // Both good messages were answered.
    assert_eq!(stderr.matches(" tokens, ").count(), 2, "{stderr}");
}

#[test]
fn a_bad_request_line_fails_alone() {
    let (dir, model) = gguf_fixture(64);
    let requests = dir.path().join("requests.jsonl");
    let long = "word ".repeat(200);
    let file = format!(
        "{{\"prompt\": \"hello\", \"max_tokens\": 2}}\nnot json\n\n{{\"prompt\": \"{long}\"}}\n\
         {{\"prompt\": \"hi\", \"temperature\": -1}}\n{{\"prompt\": \"hi\", \"kv_policy\": \"nope\"}}\n\
         {{\"prompt\": \"bye\", \"max_tokens\": 2}}\n"
    );
    std::fs::write(&requests, file).unwrap();
    let out = turbo(
        &cpu_args(p(&model), &["--prompts-file", p(&requests)]),
        None,
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"));
    assert!(stderr.contains("error: 4 of 6 requests of"), "{stderr}");
    let rows: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 6);
    assert!(rows[0]["token_ids"].is_array());
    let failed: Vec<(u64, &str)> = rows[1..5]
        .iter()
        .map(|r| (r["line"].as_u64().unwrap(), r["error"].as_str().unwrap()))
        .collect();
    assert_eq!(failed[0].0, 2);
    assert!(failed[0].1.contains("not a request object"));
    assert_eq!(failed[1].0, 4);
    assert!(failed[1].1.contains("context holds 64"), "{}", failed[1].1);
    assert_eq!(failed[2].0, 5);
    assert!(failed[2].1.contains("temperature"));
    assert_eq!(failed[3].0, 6);
    assert!(failed[3].1.contains("kv_policy"));
    assert!(rows[5]["token_ids"].is_array());
}

#[test]
fn diagnostics_have_no_colour_codes_off_a_terminal() {
    let (_dir, model) = gguf_fixture(64);
    // Past the declared context: a warning is logged.
    let out = turbo(
        &cpu_args(
            p(&model),
            &["--prompt", "hi", "--max-tokens", "1", "--context", "128"],
        ),
        None,
    );
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("WARN"), "{stderr}");
    assert!(!stderr.contains('\u{1b}'), "{stderr:?}");
}

/// Flags that would make a server open or useless, or that would be ignored, are refused before
/// the model loads; output files of long runs are checked before the run, not after it; a
/// device given as the model is named as such.
#[test]
fn empty_keys_and_unwritable_outputs_are_refused_up_front() {
    expect_error(&["serve", "--api-key", ""], "the API key");
    expect_error(
        &["serve", "--served-model-name", " "],
        "--served-model-name",
    );
    expect_error(&["serve", "--max-body-bytes", "0"], "--max-body-bytes");
    expect_error(&["info", "--model", "/dev/null"], "not a device or pipe");
    expect_error(
        &["generate", "--prompt", "hi", "--max-batch", "0"],
        "--max-batch",
    );
    let line = expect_error(
        &["eval-kv", "--from-json", "/nonexistent/rows.jsonl"],
        "No such file",
    );
    assert_eq!(line.matches("No such file").count(), 1, "said once: {line}");
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("p.jsonl");
    std::fs::write(&prompts, "{\"prompt\": \"hi\", \"max_tokens\": 1}\n").unwrap();
    let missing = dir.path().join("no/such/dir/profile.jsonl");
    expect_error(
        &[
            "generate",
            "--device",
            "cpu",
            "--prompts-file",
            prompts.to_str().unwrap(),
            "--step-profile",
            missing.to_str().unwrap(),
        ],
        "--step-profile",
    );
    expect_error(
        &[
            "eval-kv",
            "--device",
            "cpu",
            "--text",
            prompts.to_str().unwrap(),
            "--greedy-out",
            dir.path().to_str().unwrap(),
        ],
        "--greedy-out",
    );
}
