//! `turbo generate --prompts-file F.jsonl`: many requests at once through the persistent batch.

use crate::eviction::{budget_size, KvPolicyArgs};
use crate::generate::Output;
use crate::runtime::{KvArgs, ModelArgs};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::collections::VecDeque;
use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use turbo_engine::limits::MAX_REQUESTS_FILE_BYTES;
use turbo_engine::requests_file::{parse_requests, ParsedLine, RequestLine};
use turbo_engine::{ChatMessage, Engine, EngineConfig};
use turbo_scheduler::{FinishReason, Request, SamplingParams, StepPhases, StepTiming};

/// Options of batch mode.
pub struct BatchArgs {
    pub file: PathBuf,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub max_batch: usize,
    pub max_batched_tokens: usize,
    pub kv: KvArgs,
    pub eviction: KvPolicyArgs,
    /// Where to write the per-step timeline, if anywhere.
    pub step_profile: Option<PathBuf>,
    /// Each line's prompt is a user message in the model's chat template.
    pub chat: bool,
}

/// The tokens a step may hold, from `--max-batched-tokens`: below `--max-batch` it is raised to
/// it (every running sequence needs a token a step); 0 is a mistake rather than a request for
/// that.
pub(crate) fn tokens_per_step(max_batched_tokens: usize, max_batch: usize) -> Result<usize> {
    anyhow::ensure!(
        max_batched_tokens > 0,
        "--max-batched-tokens must be positive"
    );
    Ok(max_batched_tokens.max(max_batch))
}

/// The fewest requests a requests file keeps queued in the engine at once.
const QUEUE_WINDOW_MIN: usize = 4096;

/// Requests queued at once: enough for the scheduler to fill every slot and choose among
/// waiting prompts (4 batches, at least [`QUEUE_WINDOW_MIN`]), but not a whole file of millions
/// of lines, whose queued requests would take gigabytes.
fn queue_window(max_batch: usize, lines: usize) -> usize {
    (4 * max_batch).max(QUEUE_WINDOW_MIN).min(lines).max(1)
}

/// One request's failure, as its line of output.
#[derive(Serialize)]
struct FailedLine<'a> {
    /// The request's line in the requests file (1-based).
    line: usize,
    error: &'a str,
}

/// Runs every request of the file through one engine and prints their outcomes in input
/// order. A request that cannot run (a malformed line, a prompt over the context, a failure
/// while it runs) gets a line with its `error` and line number, the others run; the command
/// fails at the end if any did. Ctrl-C cancels what is still running: those requests print what
/// they generated, with finish reason `cancelled`.
pub fn run(model: &ModelArgs, args: BatchArgs) -> Result<()> {
    let bytes = read_requests_file(&args.file)?;
    let lines = parse_requests(&bytes);
    drop(bytes);
    if lines.is_empty() {
        bail!("{} holds no requests", args.file.display());
    }
    let step_tokens = tokens_per_step(args.max_batched_tokens, args.max_batch)?;
    if let Some(path) = &args.step_profile {
        crate::output::check_writable("--step-profile", path)?;
    }
    // Ctrl-C while the model loads cancels every request once they are queued: each still gets
    // its line (cancelled), none is lost.
    let early = Arc::new(AtomicBool::new(false));
    let flag = early.clone();
    crate::interrupt::cancel_on_ctrl_c(move || flag.store(true, Ordering::SeqCst));
    // CPU default: room for every slot to hold a full context (capped at 4096 tokens each).
    // Requests are queued a window at a time (a file may hold millions of lines).
    let window = queue_window(args.max_batch, lines.len());
    let engine = Arc::new(Engine::start(EngineConfig {
        kv: args.kv.size(args.max_batch, 4096)?,
        max_batch: args.max_batch,
        max_batched_tokens: step_tokens,
        prefill_chunk: 512,
        max_pending: window,
        profile_steps: args.step_profile.is_some(),
        ..model.engine_config()?
    })?);
    let started = Instant::now();
    // Every request submitted so far, for Ctrl-C; once it came, later ones are cancelled as
    // they are submitted, so that each line still gets its (cancelled) outcome.
    let submitted_ids = Arc::new(Mutex::new(Vec::new()));
    let interrupted = Arc::new(AtomicBool::new(false));
    let cancel_all = {
        let (engine, ids, interrupted) =
            (engine.clone(), submitted_ids.clone(), interrupted.clone());
        Arc::new(move || {
            interrupted.store(true, Ordering::SeqCst);
            for &id in ids.lock().unwrap().iter() {
                engine.cancel(id);
            }
        })
    };
    let submit = |line: &ParsedLine| {
        line.request
            .clone()
            .map_err(anyhow::Error::msg)
            .and_then(|request| make_request(&engine, &args, request))
            .and_then(|request| {
                let prompt = request.prompt.clone();
                let stream = engine.submit(request)?;
                submitted_ids.lock().unwrap().push(stream.id());
                if interrupted.load(Ordering::SeqCst) {
                    engine.cancel(stream.id());
                }
                Ok((prompt, stream))
            })
    };
    let mut queued: VecDeque<_> = lines.iter().take(window).map(submit).collect();
    let mut unsubmitted = lines.iter().skip(window);
    let on_interrupt = cancel_all.clone();
    crate::interrupt::cancel_on_ctrl_c(move || on_interrupt());
    // Installed first, checked second: a Ctrl-C in between is taken by one or the other.
    if early.load(Ordering::SeqCst) {
        cancel_all();
    }
    let (mut failed, mut cancelled, mut generated) = (0usize, false, 0usize);
    let mut prompt_tokens = 0usize;
    for line in &lines {
        let outcome = queued.pop_front().expect("a request a line, in order");
        let finished = outcome.and_then(|(prompt, stream)| {
            let completion = stream.wait()?;
            Ok((prompt, completion))
        });
        if let Some(next) = unsubmitted.next() {
            queued.push_back(submit(next));
        }
        match finished {
            Ok((prompt, c)) => {
                generated += c.token_ids.len();
                prompt_tokens += prompt.len();
                cancelled |= c.finish_reason == FinishReason::Cancelled;
                outln!("{}", serde_json::to_string(&Output::new(&prompt, &c))?)?;
            }
            Err(e) => {
                failed += 1;
                let error = format!("{e:#}");
                let out = FailedLine {
                    line: line.number,
                    error: &error,
                };
                outln!("{}", serde_json::to_string(&out)?)?;
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let requests = lines.len();
    engine.shutdown(std::time::Duration::ZERO); // every request has ended: the stats are final
    let stats = engine.stats().batch;
    eprintln!(
        "{requests} requests ({prompt_tokens} prompt tokens) in {elapsed:.2} s: {:.2} requests/s, {:.1} output tok/s ({generated} tokens), {} preemptions, {} KV blocks of {}",
        requests as f64 / elapsed,
        generated as f64 / elapsed,
        stats.preemptions,
        engine.info().num_blocks,
        engine.info().block_size,
    );
    if stats.decode_step_micros > 0 {
        let seconds = stats.decode_step_micros as f64 / 1e6;
        eprintln!(
            "decode-only steps: {} steps, {} tokens in {seconds:.2} s: {:.1} tok/s, {:.1} sequences per step",
            stats.decode_steps,
            stats.decode_step_tokens,
            stats.decode_step_tokens as f64 / seconds,
            stats.decode_step_tokens as f64 / stats.decode_steps.max(1) as f64,
        );
    }
    if let Some(path) = &args.step_profile {
        write_step_profile(path, &engine.take_step_profile())?;
        print_phases(&stats.phases, elapsed);
    }
    if stats.compactions > 0 {
        eprintln!(
            "KV compactions: {} in {:.2} s of host time ({:.2} ms each)",
            stats.compactions,
            stats.compaction_micros as f64 / 1e6,
            stats.compaction_micros as f64 / 1e3 / stats.compactions as f64,
        );
    }
    if cancelled {
        return Err(crate::interrupt::Interrupted.into());
    }
    if failed > 0 {
        bail!(
            "{failed} of {requests} requests of {} failed (their lines say why)",
            args.file.display()
        );
    }
    Ok(())
}

/// One step of `--step-profile`, as its JSON line.
#[derive(Serialize)]
struct StepLine {
    at_us: f64,
    sequences: usize,
    tokens: usize,
    prefill_tokens: usize,
    schedule_us: f64,
    forward_us: f64,
    wait_us: f64,
    device_us: Option<f64>,
    postprocess_us: f64,
}

fn write_step_profile(path: &std::path::Path, steps: &[StepTiming]) -> Result<()> {
    use std::io::Write;
    let file = std::fs::File::create(path)
        .with_context(|| format!("cannot write step profile {}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    let round = |v: f64| (v * 10.0).round() / 10.0;
    for t in steps {
        let line = StepLine {
            at_us: round(t.at_micros),
            sequences: t.sequences,
            tokens: t.tokens,
            prefill_tokens: t.prefill_tokens,
            schedule_us: round(t.schedule_micros),
            forward_us: round(t.forward_micros),
            wait_us: round(t.wait_micros),
            device_us: t.device_micros.map(round),
            postprocess_us: round(t.postprocess_micros),
        };
        serde_json::to_writer(&mut out, &line)?;
        out.write_all(b"\n")?;
    }
    out.flush()
        .with_context(|| format!("cannot write step profile {}", path.display()))?;
    Ok(())
}

/// Where the steps' time went, on stderr: each phase's seconds and share of the run.
fn print_phases(p: &StepPhases, elapsed: f64) {
    let part = |micros: u64| {
        let s = micros as f64 / 1e6;
        format!("{s:.2} s ({:.0}%)", 100.0 * s / elapsed.max(1e-9))
    };
    eprintln!(
        "step phases: schedule {}, forward (host) {}, wait for results {}, postprocess {}; device busy {}",
        part(p.schedule_micros),
        part(p.forward_micros),
        part(p.wait_micros),
        part(p.postprocess_micros),
        part(p.device_micros),
    );
}

/// The requests file's bytes, refused past [`MAX_REQUESTS_FILE_BYTES`].
fn read_requests_file(path: &std::path::Path) -> Result<Vec<u8>> {
    let file = std::fs::File::open(path)
        .with_context(|| format!("cannot read prompts file {}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(MAX_REQUESTS_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read prompts file {}", path.display()))?;
    anyhow::ensure!(
        bytes.len() as u64 <= MAX_REQUESTS_FILE_BYTES,
        "prompts file {} is longer than {MAX_REQUESTS_FILE_BYTES} bytes",
        path.display()
    );
    Ok(bytes)
}

/// The engine request of one line, with the flags for what the line leaves out.
fn make_request(engine: &Engine, args: &BatchArgs, line: RequestLine) -> Result<Request> {
    let prompt = match args.chat {
        true => engine.chat_prompt(&[ChatMessage::new("user", line.prompt.clone())])?,
        false => engine.text_prompt(&line.prompt)?,
    };
    let mut request = Request::new(prompt);
    request.sampling = SamplingParams {
        temperature: line.temperature.unwrap_or(args.sampling.temperature),
        seed: line.seed.unwrap_or(args.sampling.seed),
        ..args.sampling.clone()
    };
    request.max_tokens = line.max_tokens.unwrap_or(args.max_tokens);
    request.stop_strings = args.stop.clone();
    request.ignore_eos = args.ignore_eos;
    request.session = line.session;
    let size = budget_size(line.kv_budget, line.kv_budget_tokens);
    request.kv_eviction = match (line.kv_policy, size) {
        (None, None) => args.eviction.eviction(request.sampling.seed)?,
        (policy, size) => {
            let policy = match policy {
                Some(p) => p.parse().map_err(|e| anyhow::anyhow!("kv_policy: {e}"))?,
                None => args.eviction.kv_policy,
            };
            args.eviction
                .eviction_with(policy, size, request.sampling.seed)?
        }
    };
    Ok(request)
}
